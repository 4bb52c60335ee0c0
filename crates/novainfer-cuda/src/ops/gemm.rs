//! `y[m, n] = x[m, k] · W[n, k]ᵀ` through cuBLAS: bf16 inputs, f32 accumulation, bf16 or
//! f32 output (the latter for logits). Row-major on both sides, as every other buffer here.
//!
//! cuBLAS is column-major. A row-major `[r, c]` matrix with row stride c is, byte for byte,
//! the column-major `[c, r]` matrix (its transpose) with leading dimension c. So:
//!
//! ```text
//!   wanted (row-major):    y[m,n]  = x[m,k] · W[n,k]ᵀ
//!   transpose both sides:  yᵀ[n,m] = W[n,k] · xᵀ[k,m]
//!   in cuBLAS's terms:     C = op(A) · op(B) with
//!     C = y's memory seen column-major: yᵀ, n×m, ldc = n
//!     A = W's memory seen column-major: Wᵀ (k×n, lda = k); op(A) = A ᵀ = W   → transa = T
//!     B = x's memory seen column-major: xᵀ (k×m, ldb = k); op(B) = B  = xᵀ  → transb = N
//!     (cuBLAS m, n, k) = (n, m, k)
//! ```
//!
//! Batch invariance: cuBLAS may pick a different algorithm (and so a different summation
//! order) for a different m, so a row's bits can depend on how many rows share the launch.
//! With `NOVAINFER_CUDA_GEMM=lt` each shape runs one cuBLASLt algorithm, chosen once and
//! without split-K where one exists ([`crate::blas_lt`]); a different m is still another
//! shape. Every other op here is invariant.

use std::ffi::c_void;

use cudarc::cublas::result::gemm_ex;
use cudarc::cublas::sys::{
    cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType_t,
};
use cudarc::driver::{CudaView, CudaViewMut, DevicePtr, DevicePtrMut};
use half::bf16;

use super::{check_len, to_i32};
use crate::blas_lt::LtShape;
use crate::context::{driver, GpuContext};
use crate::error::{CudaError, Result};

/// `x` is `[m, k]`, `W` is `[n, k]` (a Linear layer's weight as stored), `y` is `[m, n]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemmShape {
    pub m: usize,
    pub n: usize,
    pub k: usize,
}

/// `y = x · Wᵀ` with a bf16 result (rounded once from the f32 accumulator).
pub fn gemm_bf16(
    gpu: &GpuContext,
    x: &CudaView<'_, bf16>,
    w: &CudaView<'_, bf16>,
    shape: GemmShape,
    y: &mut CudaViewMut<'_, bf16>,
) -> Result<()> {
    gemm(gpu, x, w, shape, y, cudaDataType_t::CUDA_R_16BF)
}

/// `y = x · Wᵀ` with an f32 result (the LM head: logits keep their f32 accumulator).
pub fn gemm_bf16_f32out(
    gpu: &GpuContext,
    x: &CudaView<'_, bf16>,
    w: &CudaView<'_, bf16>,
    shape: GemmShape,
    y: &mut CudaViewMut<'_, f32>,
) -> Result<()> {
    gemm(gpu, x, w, shape, y, cudaDataType_t::CUDA_R_32F)
}

/// `y_type` must be the cuBLAS type of `Y`; only the two wrappers above call this.
fn gemm<Y>(
    gpu: &GpuContext,
    x: &CudaView<'_, bf16>,
    w: &CudaView<'_, bf16>,
    shape: GemmShape,
    y: &mut CudaViewMut<'_, Y>,
    y_type: cudaDataType_t,
) -> Result<()> {
    let GemmShape { m, n, k } = shape;
    if k == 0 || n == 0 {
        return Err(CudaError::invalid(
            "shape",
            format!("a GEMM needs n > 0 and k > 0 (got n = {n}, k = {k})"),
        ));
    }
    check_len("x", x.len(), m * k)?;
    check_len("w", w.len(), n * k)?;
    check_len("y", y.len(), m * n)?;
    if m == 0 {
        return Ok(());
    }
    let stream = gpu.stream();
    super::count_launch();
    if let Some(lt) = gpu.lt() {
        gpu.context()
            .bind_to_thread()
            .map_err(|e| driver("cuCtxSetCurrent", e))?;
        let (x_ptr, _x_sync) = x.device_ptr(stream);
        let (w_ptr, _w_sync) = w.device_ptr(stream);
        let (y_ptr, _y_sync) = y.device_ptr_mut(stream);
        let shape = LtShape {
            m,
            n,
            k,
            f32_out: y_type == cudaDataType_t::CUDA_R_32F,
        };
        // SAFETY: the lengths of x, W and y were checked against (m, n, k) above, `y_type`
        // is `Y`'s (only the two wrappers call this), and the views outlive the enqueue.
        if unsafe { lt.gemm(stream, shape, w_ptr, x_ptr, y_ptr) }? {
            return Ok(());
        }
        // No cuBLASLt plan for this shape: plain cuBLAS below.
    }
    let (m, n, k) = (to_i32("m", m)?, to_i32("n", n)?, to_i32("k", k)?);
    let (alpha, beta) = (1.0f32, 0.0f32);
    // cuBLAS enqueues on the context current to this thread, which may not be the thread
    // that opened it (kernel launches bind it for themselves).
    gpu.context()
        .bind_to_thread()
        .map_err(|e| driver("cuCtxSetCurrent", e))?;
    let (x_ptr, _x_sync) = x.device_ptr(stream);
    let (w_ptr, _w_sync) = w.device_ptr(stream);
    let (y_ptr, _y_sync) = y.device_ptr_mut(stream);
    // SAFETY: the handle is live and bound to `stream`; the lengths of x, W and y were checked
    // against (m, n, k) above, and the leading dimensions are those of the derivation in the
    // module doc (A = W with lda = k, B = x with ldb = k, C = y with ldc = n); alpha and beta
    // are host f32, as CUBLAS_COMPUTE_32F with the default host pointer mode expects.
    unsafe {
        gemm_ex(
            gpu.blas().handle(),
            cublasOperation_t::CUBLAS_OP_T,
            cublasOperation_t::CUBLAS_OP_N,
            n,
            m,
            k,
            (&alpha as *const f32).cast::<c_void>(),
            w_ptr as *const c_void,
            cudaDataType_t::CUDA_R_16BF,
            k,
            x_ptr as *const c_void,
            cudaDataType_t::CUDA_R_16BF,
            k,
            (&beta as *const f32).cast::<c_void>(),
            y_ptr as *mut c_void,
            y_type,
            n,
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(|e| driver("cublasGemmEx", e))
}
