//! The Qwen2 forward on one NVIDIA GPU (feature `cuda`): weights uploaded and expanded to
//! bf16, GEMMs through cuBLAS, the kernels of `novainfer-cuda`, and a paged bf16 KV pool.
//!
//! * [`weights`]: the checkpoint on the device (fused QKV and gate|up, f32 norms and bias).
//! * [`buffers`]: activations preallocated for a step's limits, the step's metadata buffer
//!   and its pinned staging copy, the KV pool.
//! * [`forward`]: one eager step over the launchers.
//! * [`lora`]: adapters copied to the device on first use, applied after each GEMM.
//! * [`executor`]: the engine's [`DeviceWeights`] and [`Executor`](crate::Executor) on top.
//!
//! What the host prepares (the layout of fused weights, the CPU twin of the dequant
//! kernels, the step's validated metadata) lives in [`crate::prepare`], outside this
//! feature, so the default test run checks it.

mod buffers;
mod executor;
mod forward;
mod graphs;
mod lora;
mod weights;

use novainfer_cuda::CudaError;

pub use executor::{CudaExecutor, CudaWeights};

use crate::device::Device;
use crate::error::{ModelError, Result};
use crate::executor::{DeviceWeights, StepLimits};
use crate::loader::OpenedCheckpoint;
use crate::qwen2::LoadOptions;

/// Whether GPU `ordinal` can run a model here: a CUDA 13 driver, a GPU with that ordinal,
/// NVRTC and cuBLAS. `Err` names what is missing.
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
    novainfer_cuda::nvrtc::probe().map_err(why)?;
    novainfer_cuda::libs::probe_cublas().map_err(why)
}

/// Loads the model's weights onto GPU `ordinal`.
pub fn load_weights(
    ordinal: usize,
    opened: OpenedCheckpoint,
    opts: &LoadOptions,
    limits: StepLimits,
) -> Result<Box<dyn DeviceWeights>> {
    Ok(Box::new(CudaWeights::load(ordinal, opened, opts, limits)?))
}

/// A failure inside the GPU runtime as a [`ModelError`]; "not available" keeps its meaning.
pub(crate) fn cuda_error(device: Device, e: CudaError) -> ModelError {
    match e {
        CudaError::NotAvailable(reason) => ModelError::DeviceUnavailable {
            device: device.to_string(),
            reason,
        },
        other => ModelError::Cuda(other.to_string()),
    }
}

/// A cudarc driver call's failure (allocations and copies made here, not in a launcher).
pub(crate) fn driver_error(
    op: &'static str,
) -> impl Fn(novainfer_cuda::cudarc::driver::DriverError) -> ModelError {
    move |e| ModelError::Cuda(format!("{op} failed: {e:?}"))
}
