//! Weight matrices as the GPU stores them: row-major bf16 `[rows, cols]`, built from one or
//! more checkpoint tensors stacked by rows.
//!
//! Fusing is stacking: Q, K and V (`[H·D, h]`, `[KVH·D, h]`, `[KVH·D, h]`) become one
//! `[(H+2·KVH)·D, h]` matrix, so one GEMM yields a row `q | k | v` per token; gate and up
//! become `[2·F, h]`, gate rows first, so a row is `gate | up` as `silu_mul_fused` reads it.
//! A part's rows are contiguous in the fused matrix, so the device fills each part in place:
//! raw GGUF blocks are expanded straight into their rows, bf16 rows are copied there.
//! [`HostMatrix::to_bf16`] assembles the same bytes on the host; tests check the layout
//! with it and a GPU parity test can compare the device's copy to it.

use candle_core::DType;
use half::bf16;

use super::dequant::{dequantize_bf16, gpu_quant_of, GpuQuant};
use crate::error::Result;
use crate::loader::RawTensor;

/// A part's values as they will be uploaded.
pub enum PartData {
    /// Blocks of a type the GPU expands (or multiplies) itself: GGUF, int4, FP8.
    Quantized { kind: GpuQuant, bytes: Vec<u8> },
    /// Already bf16 (dense checkpoints, and GGUF types the GPU has no kernel for).
    Bf16(Vec<bf16>),
}

/// One checkpoint tensor's rows in a [`HostMatrix`].
pub struct MatrixPart {
    /// The checkpoint name, for messages.
    pub name: String,
    pub rows: usize,
    pub data: PartData,
}

/// A `[rows, cols]` matrix: its parts stacked in order.
pub struct HostMatrix {
    pub cols: usize,
    pub parts: Vec<MatrixPart>,
}

impl PartData {
    /// Dense tensors are rounded to bf16 here, by candle's `to_dtype` (round to nearest
    /// even: exact for bf16 checkpoints); quantized ones stay raw when the GPU can expand
    /// them, else candle dequantizes them and they are rounded the same way.
    pub fn from_raw(raw: RawTensor) -> Result<Self> {
        Ok(match raw {
            RawTensor::Quantized(q) => match gpu_quant_of(q.dtype()) {
                Some(kind) => PartData::Quantized {
                    kind,
                    bytes: q.data()?.into_owned(),
                },
                None => PartData::Bf16(to_bf16(&q.dequantize(&candle_core::Device::Cpu)?)?),
            },
            RawTensor::Dense(t) => PartData::Bf16(to_bf16(&t)?),
            // The device expands (or, native, multiplies) the blocks; an act-order layer's
            // permuted columns are put back in place on the host (`s·(q − z)` rounded once).
            RawTensor::Int4(w) if w.input_order().is_none() => PartData::Quantized {
                kind: GpuQuant::Int4,
                bytes: w.blocks().to_vec(),
            },
            RawTensor::Int4(w) => {
                PartData::Bf16(w.dequantize().into_iter().map(bf16::from_f32).collect())
            }
            RawTensor::Fp8(w) => PartData::Quantized {
                kind: GpuQuant::Fp8,
                bytes: w.blocks().to_vec(),
            },
        })
    }

    /// How many values this part expands to.
    pub fn len(&self) -> usize {
        match self {
            PartData::Quantized { kind, bytes } => {
                bytes.len() / kind.block_bytes() * kind.block_values()
            }
            PartData::Bf16(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn to_bf16(t: &candle_core::Tensor) -> Result<Vec<bf16>> {
    Ok(t.to_dtype(DType::BF16)?.flatten_all()?.to_vec1::<bf16>()?)
}

impl HostMatrix {
    /// A matrix of one tensor.
    pub fn single(name: &str, rows: usize, cols: usize, raw: RawTensor) -> Result<Self> {
        let mut m = Self {
            cols,
            parts: Vec::new(),
        };
        m.push(name, rows, raw)?;
        Ok(m)
    }

    /// Stacks `raw` (`[rows, cols]`) under the rows already there.
    pub fn push(&mut self, name: &str, rows: usize, raw: RawTensor) -> Result<()> {
        let data = PartData::from_raw(raw)?;
        if data.len() != rows * self.cols {
            // The reader checked the shape; a different count means a broken tensor.
            return Err(crate::error::ModelError::ShapeMismatch {
                name: name.to_owned(),
                expected: vec![rows, self.cols],
                found: vec![data.len()],
            });
        }
        self.parts.push(MatrixPart {
            name: name.to_owned(),
            rows,
            data,
        });
        Ok(())
    }

    pub fn rows(&self) -> usize {
        self.parts.iter().map(|p| p.rows).sum()
    }

    pub fn len(&self) -> usize {
        self.rows() * self.cols
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Each part with the index of its first value in the matrix.
    pub fn placed(&self) -> impl Iterator<Item = (usize, &MatrixPart)> {
        self.parts.iter().scan(0, move |offset, part| {
            let at = *offset;
            *offset += part.rows * self.cols;
            Some((at, part))
        })
    }

    /// The whole matrix as the GPU holds it (quantized parts through the CPU twin).
    pub fn to_bf16(&self) -> Result<Vec<bf16>> {
        let mut out = vec![bf16::ZERO; self.len()];
        for (at, part) in self.placed() {
            let dst = &mut out[at..at + part.rows * self.cols];
            match &part.data {
                PartData::Bf16(v) => dst.copy_from_slice(v),
                PartData::Quantized { kind, bytes } => {
                    dst.copy_from_slice(&dequantize_bf16(*kind, bytes)?)
                }
            }
        }
        Ok(out)
    }
}
