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
//!
//! GPTQ act-order int4 parts keep their columns sorted by group ([`PartData::Quantized`]'s
//! `order`): a matrix kept packed on the device multiplies them by its input permuted the same
//! way (as the CPU's `Linear` does), which needs every part to share the order
//! ([`HostMatrix::input_order`]: Q, K and V, or gate and up, see the same input); expanded to
//! bf16, their columns are put back in place on the host.

use std::sync::Arc;

use candle_core::DType;
use half::bf16;

use super::dequant::{dequantize_bf16, gpu_quant_of, GpuQuant};
use crate::error::Result;
use crate::loader::RawTensor;

/// A part's values as they will be uploaded.
pub enum PartData {
    /// Blocks of a type the GPU expands (or multiplies) itself: GGUF, int4, FP8. With an
    /// `order` (GPTQ act-order int4), stored column `j` is input channel `order[j]`.
    Quantized {
        kind: GpuQuant,
        bytes: Vec<u8>,
        order: Option<Arc<[u32]>>,
    },
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
                    order: None,
                },
                None => PartData::Bf16(to_bf16(&q.dequantize(&candle_core::Device::Cpu)?)?),
            },
            RawTensor::Dense(t) => PartData::Bf16(to_bf16(&t)?),
            // The device expands (or, native, multiplies) the blocks; an act-order layer keeps
            // its sorted columns and their order (see the module's note).
            RawTensor::Int4(w) => PartData::Quantized {
                kind: GpuQuant::Int4,
                bytes: w.blocks().to_vec(),
                order: w.input_order().cloned(),
            },
            RawTensor::Fp8(w) => PartData::Quantized {
                kind: GpuQuant::Fp8,
                bytes: w.blocks().to_vec(),
                order: None,
            },
        })
    }

    /// How many values this part expands to.
    pub fn len(&self) -> usize {
        match self {
            PartData::Quantized { kind, bytes, .. } => {
                bytes.len() / kind.block_bytes() * kind.block_values()
            }
            PartData::Bf16(v) => v.len(),
        }
    }

    /// The input order of an act-order part (`None` for every other part).
    pub fn order(&self) -> Option<&Arc<[u32]>> {
        match self {
            PartData::Quantized { order, .. } => order.as_ref(),
            PartData::Bf16(_) => None,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A quantized part's values as bf16 in their checkpoint's column order: through the device
/// dequantizer's CPU twin (`s·(q − z)` rounded once for int4), an act-order part's columns
/// (`order`) put back in place.
pub fn quantized_bf16(kind: GpuQuant, bytes: &[u8], order: Option<&[u32]>) -> Result<Vec<bf16>> {
    let stored = dequantize_bf16(kind, bytes)?;
    Ok(match order {
        Some(order) => crate::int4::in_input_order(&stored, order),
        None => stored,
    })
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

    /// The whole matrix expanded to bf16 as the GPU holds it then (quantized parts through the
    /// CPU twin, act-order columns back in place).
    pub fn to_bf16(&self) -> Result<Vec<bf16>> {
        let mut out = vec![bf16::ZERO; self.len()];
        for (at, part) in self.placed() {
            let dst = &mut out[at..at + part.rows * self.cols];
            match &part.data {
                PartData::Bf16(v) => dst.copy_from_slice(v),
                PartData::Quantized { kind, bytes, order } => {
                    dst.copy_from_slice(&quantized_bf16(*kind, bytes, order.as_deref())?)
                }
            }
        }
        Ok(out)
    }

    /// The order the parts' stored columns share: whether a packed copy of the matrix can be
    /// multiplied by one permuted input.
    pub fn input_order(&self) -> InputOrder<'_> {
        let mut orders = self.parts.iter().map(|p| p.data.order());
        let first = orders.next().flatten();
        if !orders.all(|o| o == first) {
            return InputOrder::Mixed;
        }
        match first {
            Some(order) => InputOrder::Shared(order),
            None => InputOrder::Natural,
        }
    }
}

/// How a [`HostMatrix`]'s stored columns map to its input channels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InputOrder<'a> {
    /// Column `j` is input channel `j` in every part.
    Natural,
    /// In every part, stored column `j` is input channel `order[j]`.
    Shared(&'a Arc<[u32]>),
    /// Parts disagree (act-order layers sorted by different statistics, or act-order beside
    /// plain parts): the matrix is expanded to bf16 with its columns in place.
    Mixed,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::int4::GroupedInt4;

    fn int4(rows: usize, cols: usize, seed: u32, order: Option<Vec<u32>>) -> RawTensor {
        let values: Vec<f32> = (0..rows * cols)
            .map(|i| {
                ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 2001) as f32 / 1000.0
                    - 1.0
            })
            .collect();
        let w = GroupedInt4::quantize(rows, cols, &values).expect("quantize");
        RawTensor::Int4(match order {
            Some(order) => w.with_input_order("w", order).expect("a permutation"),
            None => w,
        })
    }

    /// An affine shuffle of `0..cols` (37 is prime to a power of two): not the identity.
    fn shuffled(cols: usize) -> Vec<u32> {
        (0..cols as u32)
            .map(|j| (j * 37 + 5) % cols as u32)
            .collect()
    }

    #[test]
    fn act_order_parts_keep_their_blocks_and_expand_in_place() {
        let (rows, cols) = (3, 256);
        let order = shuffled(cols);
        let RawTensor::Int4(w) = int4(rows, cols, 1, Some(order.clone())) else {
            unreachable!()
        };
        let want: Vec<bf16> = w.dequantize().into_iter().map(bf16::from_f32).collect();
        let m = HostMatrix::single("w", rows, cols, RawTensor::Int4(w)).expect("matrix");
        let PartData::Quantized {
            kind: GpuQuant::Int4,
            order: Some(kept),
            ..
        } = &m.parts[0].data
        else {
            panic!("an act-order int4 part stays int4 with its order")
        };
        assert_eq!(&kept[..], &order[..]);
        let got = m.to_bf16().expect("expand");
        let first_diff = got
            .iter()
            .zip(&want)
            .position(|(a, b)| a.to_bits() != b.to_bits());
        assert_eq!(first_diff, None, "columns back in input-channel order");
    }

    #[test]
    fn a_matrix_has_one_input_order_only_when_every_part_shares_it() {
        let (cols, order) = (256, shuffled(256));
        let matrix = |parts: Vec<Option<Vec<u32>>>| {
            let mut m = HostMatrix {
                cols,
                parts: Vec::new(),
            };
            for (i, o) in parts.into_iter().enumerate() {
                m.push(&format!("p{i}"), 2, int4(2, cols, i as u32, o))
                    .expect("part");
            }
            m
        };
        assert_eq!(matrix(vec![None, None]).input_order(), InputOrder::Natural);
        let shared = matrix(vec![Some(order.clone()), Some(order.clone())]);
        assert!(matches!(shared.input_order(), InputOrder::Shared(o) if o[..] == order[..]));
        let mut other = order.clone();
        other.swap(0, 1);
        assert_eq!(
            matrix(vec![Some(order.clone()), Some(other)]).input_order(),
            InputOrder::Mixed
        );
        assert_eq!(
            matrix(vec![Some(order), None]).input_order(),
            InputOrder::Mixed
        );
    }
}
