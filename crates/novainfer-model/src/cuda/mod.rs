//! The Qwen2 forward on one NVIDIA GPU (feature `cuda`): weights uploaded and expanded to
//! bf16, GEMMs through cuBLAS, the kernels of `novainfer-cuda`, and a paged bf16 KV pool.

use novainfer_cuda::CudaError;

use crate::device::Device;
use crate::error::{ModelError, Result};
use crate::executor::{DeviceWeights, StepLimits};
use crate::loader::OpenedCheckpoint;
use crate::qwen2::LoadOptions;

/// Whether GPU `ordinal` can run a model here: a CUDA 13 driver, a GPU with that ordinal,
/// and NVRTC. `Err` names what is missing.
pub fn probe(ordinal: usize) -> std::result::Result<(), String> {
    let why = |e: CudaError| match e {
        CudaError::NotAvailable(why) => why,
        other => other.to_string(),
    };
    let count = novainfer_cuda::device_count().map_err(why)?;
    if count == 0 {
        return Err("the NVIDIA driver reports no CUDA device".to_owned());
    }
    if ordinal >= count {
        return Err(format!(
            "cuda:{ordinal} requested but only {count} device(s) present"
        ));
    }
    novainfer_cuda::nvrtc::probe().map_err(why)
}

/// Loads the model's weights onto GPU `ordinal`.
pub fn load_weights(
    ordinal: usize,
    opened: OpenedCheckpoint,
    opts: &LoadOptions,
    limits: StepLimits,
) -> Result<Box<dyn DeviceWeights>> {
    let _ = (opened, opts, limits);
    Err(ModelError::Unsupported {
        what: "the CUDA forward pass".into(),
        device: Device::Cuda(ordinal).to_string(),
    })
}
