//! The context's cuBLAS handle: created once, bound to the context's stream, with a
//! workspace of our own.
//!
//! The explicit workspace is for CUDA graphs: without one cuBLAS allocates from its own pool
//! on first use of a shape, which must not happen inside a capture. `cublasSetStream` resets
//! the workspace, so it is set after cudarc binds the stream, and never changed again.

use std::sync::Arc;

use cudarc::cublas::{sys, CudaBlas};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtrMut};

use crate::context::driver;
use crate::error::Result;

/// NVIDIA's recommended cuBLAS workspace for Hopper (it covers Ampere's smaller need).
const WORKSPACE_BYTES: usize = 32 << 20;

pub(crate) struct Blas {
    // Dropped first: the handle must go before the workspace it points into.
    handle: CudaBlas,
    _workspace: CudaSlice<u8>,
}

impl Blas {
    /// The caller has probed libcublas (`libs::probe_cublas`): cudarc would panic otherwise.
    pub fn new(stream: &Arc<CudaStream>) -> Result<Self> {
        let handle = CudaBlas::new(stream.clone()).map_err(|e| driver("cublasCreate", e))?;
        let mut workspace = stream
            .alloc_zeros::<u8>(WORKSPACE_BYTES)
            .map_err(|e| driver("cuMemAlloc", e))?;
        {
            let (ptr, _sync) = workspace.device_ptr_mut(stream);
            // SAFETY: the handle is live; `ptr` addresses WORKSPACE_BYTES bytes of device
            // memory that `Blas` keeps alive for as long as the handle.
            unsafe {
                sys::cublasSetWorkspace_v2(
                    *handle.handle(),
                    ptr as *mut std::ffi::c_void,
                    WORKSPACE_BYTES,
                )
            }
            .result()
            .map_err(|e| driver("cublasSetWorkspace", e))?;
        }
        Ok(Self {
            handle,
            _workspace: workspace,
        })
    }

    pub fn handle(&self) -> sys::cublasHandle_t {
        *self.handle.handle()
    }
}
