//! Launcher of `kernels/rms_norm.cu`: RMSNorm, alone or fused with the residual add.

use cudarc::driver::{CudaView, CudaViewMut, PushKernelArg};

use super::{check_len, check_multiple, launch, per_row, to_i32, Dtype};
use crate::context::GpuContext;
use crate::error::Result;

/// Threads per row; must equal `RMS_THREADS` in the kernel (the reduction shape).
pub const RMS_THREADS: u32 = 256;

/// `out = x · rsqrt(mean(x²) + eps) · weight`, per row of `weight.len()` values.
pub fn rms_norm<T: Dtype>(
    gpu: &GpuContext,
    x: &CudaView<'_, T>,        // [rows, dim]
    weight: &CudaView<'_, f32>, // [dim]
    eps: f32,
    out: &mut CudaViewMut<'_, T>, // [rows, dim]
) -> Result<()> {
    let dim = weight.len();
    let rows = check_multiple("x", x.len(), dim)?;
    check_len("out", out.len(), x.len())?;
    if rows == 0 {
        return Ok(());
    }
    let dim = to_i32("weight", dim)?;
    let f = gpu.kernels().rms_norm.get::<T>();
    let mut args = gpu.stream().launch_builder(f);
    args.arg(x).arg(weight).arg(out).arg(&dim).arg(&eps);
    launch(args, per_row(rows, RMS_THREADS)?)
}

/// `residual += x; out = rms_norm(residual)` (the residual is updated in place).
pub fn add_rms_norm<T: Dtype>(
    gpu: &GpuContext,
    x: &CudaView<'_, T>,               // [rows, dim]
    residual: &mut CudaViewMut<'_, T>, // [rows, dim]
    weight: &CudaView<'_, f32>,        // [dim]
    eps: f32,
    out: &mut CudaViewMut<'_, T>, // [rows, dim]
) -> Result<()> {
    let dim = weight.len();
    let rows = check_multiple("x", x.len(), dim)?;
    check_len("residual", residual.len(), x.len())?;
    check_len("out", out.len(), x.len())?;
    if rows == 0 {
        return Ok(());
    }
    let dim = to_i32("weight", dim)?;
    let f = gpu.kernels().add_rms_norm.get::<T>();
    let mut args = gpu.stream().launch_builder(f);
    args.arg(x)
        .arg(residual)
        .arg(weight)
        .arg(out)
        .arg(&dim)
        .arg(&eps);
    launch(args, per_row(rows, RMS_THREADS)?)
}
