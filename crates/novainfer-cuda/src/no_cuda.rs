//! Stand-in for the device context when the crate is built without the `cuda` feature:
//! the same entry points, each answering "CUDA not available".

use crate::error::{CudaError, Result};

const WHY: &str = "novainfer was built without the `cuda` feature";

/// Without the `cuda` feature there is never a device.
pub fn device_count() -> Result<usize> {
    Err(CudaError::NotAvailable(WHY.to_owned()))
}

/// Uninhabited: no context can exist in a build without CUDA.
pub enum GpuContext {}

impl GpuContext {
    pub fn new(_ordinal: usize) -> Result<Self> {
        Err(CudaError::NotAvailable(WHY.to_owned()))
    }
}
