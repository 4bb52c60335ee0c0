//! The checkpoint on the device: every matrix bf16 `[rows, cols]` row-major, fused as
//! [`crate::prepare::matrix`] lays it out; norm weights and the QKV bias f32.
//!
//! Quantized parts travel raw (a quarter to a half of the bf16 bytes) and are expanded by
//! the dequant kernel straight into their rows of the fused matrix; the raw copy is freed
//! in stream order once the kernel has read it. A matrix whose parts are all GPU quant types that
//! `gpu_weight_dtype` keeps packed (`native`: all of them; `auto`: FP8) keeps them raw instead
//! ([`MatrixData::Packed`]): decode
//! steps multiply the blocks in place, larger steps expand them into a scratch first
//! (`forward::gemm`); a packed embedding table expands just the step's token rows. A packed
//! GPTQ act-order matrix keeps its sorted columns and their order ([`GpuMatrix::input_order`]):
//! its products take their input permuted to match (`gather_columns`).

use half::bf16;
use novainfer_cuda::cudarc::driver::CudaSlice;
use novainfer_cuda::ops::dequant::{dequantize, QuantType};
use novainfer_cuda::ops::gemv_quant::{bf16_bytes, GemvWeights, WeightRun, MAX_PARTS};
use novainfer_cuda::GpuContext;
use smallvec::{smallvec, SmallVec};

use super::{cuda_error, driver_error};
use crate::device::Device;
use crate::error::{ModelError, Result};
use crate::gpu_weight_dtype::GpuWeightDtype;
use crate::loader::TensorSource;
use crate::prepare::matrix::quantized_bf16;
use crate::prepare::{HostLayer, HostMatrix, HostModelReader, InputOrder, PartData};

/// A `[rows, cols]` matrix on the device.
pub(crate) struct GpuMatrix {
    pub data: MatrixData,
    pub rows: usize,
    pub cols: usize,
    /// A packed act-order matrix's: stored column `j` is input channel `input_order[j]`, so a
    /// product multiplies it by `x[:, input_order]`. `None`: columns in place.
    pub input_order: Option<CudaSlice<u32>>,
}

pub(crate) enum MatrixData {
    /// Row-major bf16.
    Bf16(CudaSlice<bf16>),
    /// Each part's rows as the checkpoint's blocks, parts in row order.
    Packed(Vec<PackedPart>),
}

/// Rows `row0 .. row0 + rows` of a packed matrix: `rows` rows of `cols / block_values` blocks.
pub(crate) struct PackedPart {
    pub qtype: QuantType,
    pub row0: usize,
    pub rows: usize,
    pub blocks: CudaSlice<u8>,
}

impl GpuMatrix {
    /// Bytes on the device: bf16 values, or the packed parts' blocks (and input order).
    pub fn bytes(&self) -> usize {
        let order = self.input_order.as_ref().map_or(0, |o| o.len() * 4);
        order
            + match &self.data {
                MatrixData::Bf16(d) => d.len() * 2,
                MatrixData::Packed(parts) => parts.iter().map(|p| p.blocks.len()).sum(),
            }
    }

    /// The matrix as runs of rows in one GEMV format, in row order: a bf16 matrix is one run,
    /// a packed one a run per part. More parts than a launch takes (none of Qwen2's matrices
    /// has) is an error.
    pub fn runs(&self) -> Result<SmallVec<[WeightRun<'_>; MAX_PARTS]>> {
        let runs: SmallVec<[WeightRun<'_>; MAX_PARTS]> = match &self.data {
            MatrixData::Bf16(d) => smallvec![WeightRun {
                weights: GemvWeights::Bf16,
                bytes: bf16_bytes(d),
                rows: self.rows,
            }],
            MatrixData::Packed(parts) => parts
                .iter()
                .map(|p| WeightRun {
                    weights: p.qtype.into(),
                    bytes: p.blocks.as_view(),
                    rows: p.rows,
                })
                .collect(),
        };
        if runs.len() > MAX_PARTS {
            return Err(ModelError::Cuda(format!(
                "a matrix of {} parts: the GEMV takes at most {MAX_PARTS}",
                runs.len()
            )));
        }
        Ok(runs)
    }

    /// Values a packed matrix expands to (0 for a bf16 one): what its larger steps need of the
    /// expansion scratch.
    pub fn expanded_len(&self) -> usize {
        match self.data {
            MatrixData::Bf16(_) => 0,
            MatrixData::Packed(_) => self.rows * self.cols,
        }
    }
}

pub(crate) struct GpuLayer {
    pub input_layernorm: CudaSlice<f32>,
    pub qkv: GpuMatrix,
    pub qkv_bias: CudaSlice<f32>,
    pub o_proj: GpuMatrix,
    pub post_attention_layernorm: CudaSlice<f32>,
    pub gate_up: GpuMatrix,
    pub down_proj: GpuMatrix,
}

pub(crate) struct GpuModel {
    pub embed_tokens: GpuMatrix,
    pub layers: Vec<GpuLayer>,
    pub norm: CudaSlice<f32>,
    /// `None` when the embeddings are tied: the head is `embed_tokens`.
    lm_head: Option<GpuMatrix>,
}

impl GpuModel {
    /// Reads every tensor through `reader` (the CPU builder's checks) and uploads it, one
    /// layer at a time.
    pub fn load<S: TensorSource>(
        gpu: &GpuContext,
        device: Device,
        mut reader: HostModelReader<S>,
        policy: GpuWeightDtype,
    ) -> Result<Self> {
        let up = Uploader {
            gpu,
            device,
            policy,
        };
        let n = reader.config().num_hidden_layers;
        tracing::info!(%device, gpu = gpu.device_name(), layers = n, "loading weights");
        let embed_tokens = up.table(&reader.embedding()?)?;
        // A line per quarter of the model: enough to see a slow load move.
        let every = n.div_ceil(4).max(1);
        let mut layers = Vec::with_capacity(n);
        for i in 0..n {
            layers.push(up.layer(&reader.layer(i)?)?);
            if (i + 1) % every == 0 || i + 1 == n {
                tracing::info!(%device, "loaded layer {}/{n}", i + 1);
            }
        }
        let norm = up.vector(&reader.final_norm()?)?;
        let lm_head = match reader.lm_head()? {
            Some(head) => Some(up.matrix(&head)?),
            None => None,
        };
        reader.finish()?;
        Ok(Self {
            embed_tokens,
            layers,
            norm,
            lm_head,
        })
    }

    pub fn lm_head(&self) -> &GpuMatrix {
        self.lm_head.as_ref().unwrap_or(&self.embed_tokens)
    }

    /// Bytes a decode step reads: every layer's matrices (bf16, or a packed matrix's blocks),
    /// vectors and the head; of the embedding table only a row per token, not counted.
    pub fn weight_bytes_per_token(&self) -> usize {
        let vector = |v: &CudaSlice<f32>| v.len() * 4;
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                [&l.qkv, &l.o_proj, &l.gate_up, &l.down_proj]
                    .into_iter()
                    .map(GpuMatrix::bytes)
                    .sum::<usize>()
                    + vector(&l.input_layernorm)
                    + vector(&l.qkv_bias)
                    + vector(&l.post_attention_layernorm)
            })
            .sum();
        layers + vector(&self.norm) + self.lm_head().bytes()
    }

    /// Bytes every weight holds on the device: [`Self::weight_bytes_per_token`]'s and the
    /// embedding table's (once when it is the head).
    pub fn weight_bytes(&self) -> usize {
        let table = match self.lm_head {
            Some(_) => self.embed_tokens.bytes(),
            None => 0,
        };
        self.weight_bytes_per_token() + table
    }

    /// Values of the widest input a product permutes (an act-order matrix's `cols`; 0 when no
    /// matrix has an order): what a row of the permuted-input scratch holds.
    pub fn ordered_cols(&self) -> usize {
        self.layers
            .iter()
            .flat_map(|l| [&l.qkv, &l.o_proj, &l.gate_up, &l.down_proj])
            .chain([self.lm_head()])
            .filter(|m| m.input_order.is_some())
            .map(|m| m.cols)
            .max()
            .unwrap_or(0)
    }

    /// The largest expansion a step may need: the biggest packed matrix (0 when none is).
    pub fn expanded_len(&self) -> usize {
        let layers = self
            .layers
            .iter()
            .flat_map(|l| [&l.qkv, &l.o_proj, &l.gate_up, &l.down_proj]);
        // The head, tied or not (a tied one is the table itself).
        layers
            .chain([self.lm_head()])
            .map(GpuMatrix::expanded_len)
            .max()
            .unwrap_or(0)
    }
}

struct Uploader<'a> {
    gpu: &'a GpuContext,
    device: Device,
    /// Which quantized matrices stay packed.
    policy: GpuWeightDtype,
}

impl Uploader<'_> {
    fn vector(&self, v: &[f32]) -> Result<CudaSlice<f32>> {
        self.gpu
            .stream()
            .clone_htod(v)
            .map_err(driver_error("cuMemcpyHtoD"))
    }

    fn layer(&self, l: &HostLayer) -> Result<GpuLayer> {
        Ok(GpuLayer {
            input_layernorm: self.vector(&l.input_layernorm)?,
            qkv: self.matrix(&l.qkv)?,
            qkv_bias: self.vector(&l.qkv_bias)?,
            o_proj: self.matrix(&l.o_proj)?,
            post_attention_layernorm: self.vector(&l.post_attention_layernorm)?,
            gate_up: self.matrix(&l.gate_up)?,
            down_proj: self.matrix(&l.down_proj)?,
        })
    }

    /// Whether every part of `m` is a GPU quant type the policy keeps packed, whose rows are
    /// whole blocks, and one permuted input serves every part.
    fn packable(&self, m: &HostMatrix) -> bool {
        let parts = m.parts.iter().all(|p| match &p.data {
            PartData::Quantized { kind, .. } => {
                self.policy.keeps_packed(*kind) && m.cols.is_multiple_of(kind.block_values())
            }
            PartData::Bf16(_) => false,
        });
        parts && m.input_order() != InputOrder::Mixed
    }

    /// The embedding table: its rows are looked up, not multiplied, so it stays packed only
    /// with its columns in place (an act-order table, which no checkpoint we know has, is
    /// expanded with them put back).
    fn table(&self, m: &HostMatrix) -> Result<GpuMatrix> {
        if m.input_order() == InputOrder::Natural {
            self.matrix(m)
        } else {
            self.bf16_matrix(m)
        }
    }

    fn matrix(&self, m: &HostMatrix) -> Result<GpuMatrix> {
        if !self.packable(m) {
            return self.bf16_matrix(m);
        }
        let stream = self.gpu.stream();
        let input_order = match m.input_order() {
            InputOrder::Shared(order) => Some(
                stream
                    .clone_htod(&order[..])
                    .map_err(driver_error("cuMemcpyHtoD"))?,
            ),
            InputOrder::Natural | InputOrder::Mixed => None,
        };
        let mut parts = Vec::with_capacity(m.parts.len());
        let mut row0 = 0;
        for part in &m.parts {
            let PartData::Quantized { kind, bytes, .. } = &part.data else {
                unreachable!("packable: every part is quantized")
            };
            let blocks = stream
                .clone_htod(bytes.as_slice())
                .map_err(driver_error("cuMemcpyHtoD"))?;
            parts.push(PackedPart {
                qtype: *kind,
                row0,
                rows: part.rows,
                blocks,
            });
            row0 += part.rows;
        }
        Ok(GpuMatrix {
            data: MatrixData::Packed(parts),
            rows: m.rows(),
            cols: m.cols,
            input_order,
        })
    }

    fn bf16_matrix(&self, m: &HostMatrix) -> Result<GpuMatrix> {
        let stream = self.gpu.stream();
        let mut data = stream
            .alloc_zeros::<bf16>(m.len())
            .map_err(driver_error("cuMemAlloc"))?;
        for (at, part) in m.placed() {
            let len = part.rows * m.cols;
            let mut rows = data.try_slice_mut(at..at + len).ok_or_else(|| {
                ModelError::Cuda(format!("`{}` does not fit its fused matrix", part.name))
            })?;
            match &part.data {
                PartData::Bf16(values) => stream
                    .memcpy_htod(values.as_slice(), &mut rows)
                    .map_err(driver_error("cuMemcpyHtoD"))?,
                // Act-order columns go back in place on the host (the device expands blocks
                // in their stored order).
                PartData::Quantized {
                    kind,
                    bytes,
                    order: Some(order),
                } => stream
                    .memcpy_htod(
                        quantized_bf16(*kind, bytes, Some(order))?.as_slice(),
                        &mut rows,
                    )
                    .map_err(driver_error("cuMemcpyHtoD"))?,
                PartData::Quantized {
                    kind,
                    bytes,
                    order: None,
                } => {
                    let raw = stream
                        .clone_htod(bytes.as_slice())
                        .map_err(driver_error("cuMemcpyHtoD"))?;
                    dequantize::<bf16>(self.gpu, *kind, &raw.as_view(), &mut rows).map_err(
                        |e| {
                            ModelError::Cuda(format!(
                                "expanding `{}`: {}",
                                part.name,
                                cuda_error(self.device, e)
                            ))
                        },
                    )?;
                }
            }
        }
        Ok(GpuMatrix {
            data: MatrixData::Bf16(data),
            rows: m.rows(),
            cols: m.cols,
            input_order: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use candle_core::quantized::QTensor;
    use candle_core::Tensor;
    use novainfer_cuda::gpu_test::{when_unavailable_from_env, WhenUnavailable};
    use novainfer_cuda::CudaError;

    use super::*;
    use crate::loader::RawTensor;

    /// A fused matrix with one part per GPU quant type and a bf16 part, expanded on the
    /// device, equals its host assembly (the CPU twin) bit for bit.
    #[test]
    fn device_expansion_equals_the_host_twin() {
        let gpu = match GpuContext::new(0) {
            Ok(gpu) => gpu,
            Err(CudaError::NotAvailable(why)) => match when_unavailable_from_env() {
                WhenUnavailable::Skip => {
                    println!("device_expansion: skipped: no CUDA device ({why})");
                    return;
                }
                WhenUnavailable::Fail => panic!("NOVAINFER_REQUIRE_GPU is set: {why}"),
            },
            Err(e) => panic!("opening cuda:0: {e}"),
        };
        let cols = 512;
        let values = |rows: usize, seed: u32| {
            let data: Vec<f32> = (0..rows * cols)
                .map(|i| {
                    ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 2001) as f32 / 1000.0
                        - 1.0
                })
                .collect();
            Tensor::from_vec(data, (rows, cols), &candle_core::Device::Cpu).expect("tensor")
        };
        let mut host = HostMatrix {
            cols,
            parts: Vec::new(),
        };
        for (i, kind) in crate::prepare::GGUF_KINDS.into_iter().enumerate() {
            let ggml = crate::prepare::ggml_of(kind).expect("gguf");
            let q = QTensor::quantize(&values(3, i as u32), ggml).expect("quantize");
            host.push(&format!("{kind:?}"), 3, RawTensor::Quantized(q))
                .expect("part");
        }
        let int4 = crate::int4::GroupedInt4::quantize(
            3,
            cols,
            &values(3, 77)
                .flatten_all()
                .and_then(|t| t.to_vec1())
                .expect("values"),
        )
        .expect("int4");
        host.push("int4", 3, RawTensor::Int4(int4)).expect("part");
        let fp8 = crate::fp8_blocks::Fp8Blocks::quantize_rows(
            "fp8",
            3,
            cols,
            &values(3, 55)
                .flatten_all()
                .and_then(|t| t.to_vec1())
                .expect("values"),
        )
        .expect("fp8");
        host.push("fp8", 3, RawTensor::Fp8(fp8)).expect("part");
        host.push("dense", 2, RawTensor::Dense(values(2, 99)))
            .expect("part");
        let up = Uploader {
            gpu: &gpu,
            device: Device::Cuda(0),
            policy: GpuWeightDtype::Native,
        };
        let m = up.matrix(&host).expect("upload");
        let MatrixData::Bf16(data) = &m.data else {
            panic!("a matrix with a bf16 part is held in bf16")
        };
        let got = gpu.stream().clone_dtoh(data).expect("download");
        gpu.synchronize().expect("sync");
        let want = host.to_bf16().expect("host twin");
        assert_eq!((m.rows, m.cols), (20, cols));
        let first_diff = got
            .iter()
            .zip(&want)
            .position(|(a, b)| a.to_bits() != b.to_bits());
        assert_eq!(first_diff, None, "device and host twin differ");
    }
}
