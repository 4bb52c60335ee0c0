//! NovaInfer's CUDA backend pieces: a device context, kernels compiled at run time with
//! NVRTC and cached on disk, and one launcher per kernel (`ops`).
//!
//! * `kernels/*.cu` (repository root) are embedded with `include_str!` ([`kernels`]); nothing
//!   is compiled at build time, so the `cuda` feature builds with no CUDA toolkit, and
//!   cudarc loads libcuda/libnvrtc at run time (`dynamic-loading`).
//! * Without the `cuda` feature the crate still has the sources, the cache naming, the CPU
//!   twins of device-side algorithms ([`reference`]) and a [`GpuContext`] whose constructor
//!   returns [`CudaError::NotAvailable`]; cudarc is not even built.
//! * [`rope_scaling`] is the RoPE frequency math (plain, linear, dynamic NTK, YaRN) that the
//!   CPU model and the GPU's cos/sin table share, so both rotate by the same angles.
//! * Every kernel is batch invariant: a row's result never depends on what else is in the
//!   launch (each `.cu` file says how).

pub mod cache;
pub mod draw_walk;
pub mod error;
pub mod flash_plan;
pub mod gemm_choice;
pub mod gemm_tile;
pub mod gemv_plan;
pub mod gpu_test;
pub mod kernels;
pub mod lora_plan;
pub mod quant_type;
pub mod reference;
pub mod rope_scaling;
pub mod sample_params;
pub mod validate;

#[cfg(feature = "cuda")]
mod blas;
#[cfg(feature = "cuda")]
pub mod blas_lt;
#[cfg(feature = "cuda")]
mod context;
#[cfg(feature = "cuda")]
pub mod libs;
#[cfg(feature = "cuda")]
pub mod nvrtc;
#[cfg(feature = "cuda")]
pub mod ops;
#[cfg(feature = "cuda")]
mod table;

#[cfg(feature = "cuda")]
pub use context::{cached_cubin_with_origin, device_count, GpuContext};
#[cfg(not(feature = "cuda"))]
mod no_cuda;
#[cfg(not(feature = "cuda"))]
pub use no_cuda::{device_count, GpuContext};

#[cfg(feature = "cuda")]
pub use cudarc;
pub use error::{CudaError, Result};
pub use rope_scaling::{RopeScaling, Yarn};
pub use sample_params::{SampleParams, MIN_SAMPLING_TEMPERATURE};
pub use validate::{validate_step, StepInputs, StepLimits};
