//! The checkpoint on the device: every matrix bf16 `[rows, cols]` row-major, fused as
//! [`crate::prepare::matrix`] lays it out; norm weights and the QKV bias f32.
//!
//! Quantized parts travel raw (a quarter to a half of the bf16 bytes) and are expanded by
//! the dequant kernel straight into their rows of the fused matrix; the raw copy is freed
//! in stream order once the kernel has read it.

use half::bf16;
use novainfer_cuda::cudarc::driver::{CudaSlice, CudaView};
use novainfer_cuda::ops::dequant::{dequantize, QuantType};
use novainfer_cuda::GpuContext;

use super::{cuda_error, driver_error};
use crate::device::Device;
use crate::error::{ModelError, Result};
use crate::loader::TensorSource;
use crate::prepare::{GpuQuant, HostLayer, HostMatrix, HostModelReader, PartData};

/// A bf16 `[rows, cols]` matrix on the device.
pub(crate) struct GpuMatrix {
    pub data: CudaSlice<bf16>,
    pub rows: usize,
    pub cols: usize,
}

impl GpuMatrix {
    pub fn view(&self) -> CudaView<'_, bf16> {
        self.data.as_view()
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
    ) -> Result<Self> {
        let up = Uploader { gpu, device };
        let n = reader.config().num_hidden_layers;
        tracing::info!(%device, gpu = gpu.device_name(), layers = n, "loading weights");
        let embed_tokens = up.matrix(&reader.embedding()?)?;
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
}

struct Uploader<'a> {
    gpu: &'a GpuContext,
    device: Device,
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

    fn matrix(&self, m: &HostMatrix) -> Result<GpuMatrix> {
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
                PartData::Quantized { kind, bytes } => {
                    let raw = stream
                        .clone_htod(bytes.as_slice())
                        .map_err(driver_error("cuMemcpyHtoD"))?;
                    dequantize::<bf16>(self.gpu, quant_type(*kind), &raw.as_view(), &mut rows)
                        .map_err(|e| {
                            ModelError::Cuda(format!(
                                "expanding `{}`: {}",
                                part.name,
                                cuda_error(self.device, e)
                            ))
                        })?;
                }
            }
        }
        Ok(GpuMatrix {
            data,
            rows: m.rows(),
            cols: m.cols,
        })
    }
}

fn quant_type(kind: GpuQuant) -> QuantType {
    match kind {
        GpuQuant::Q4K => QuantType::Q4K,
        GpuQuant::Q5_0 => QuantType::Q5_0,
        GpuQuant::Q6K => QuantType::Q6K,
        GpuQuant::Q8_0 => QuantType::Q8_0,
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

    #[test]
    fn the_host_and_device_quant_types_agree_on_block_geometry() {
        for kind in GpuQuant::ALL {
            let q = quant_type(kind);
            assert_eq!(q.block_bytes(), kind.block_bytes(), "{kind:?}");
            assert_eq!(q.block_values(), kind.block_values(), "{kind:?}");
        }
    }

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
        for (i, kind) in GpuQuant::ALL.into_iter().enumerate() {
            let q = QTensor::quantize(&values(3, i as u32), kind.ggml()).expect("quantize");
            host.push(&format!("{kind:?}"), 3, RawTensor::Quantized(q))
                .expect("part");
        }
        host.push("dense", 2, RawTensor::Dense(values(2, 99)))
            .expect("part");
        let up = Uploader {
            gpu: &gpu,
            device: Device::Cuda(0),
        };
        let m = up.matrix(&host).expect("upload");
        let got = gpu.stream().clone_dtoh(&m.data).expect("download");
        gpu.synchronize().expect("sync");
        let want = host.to_bf16().expect("host twin");
        assert_eq!((m.rows, m.cols), (14, cols));
        let first_diff = got
            .iter()
            .zip(&want)
            .position(|(a, b)| a.to_bits() != b.to_bits());
        assert_eq!(first_diff, None, "device and host twin differ");
    }
}
