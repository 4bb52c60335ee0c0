//! Launcher of `kernels/silu_mul.cu`: `out = silu(gate) · up`.

use cudarc::driver::{CudaView, CudaViewMut, PushKernelArg};

use super::{check_len, check_multiple, elementwise, launch, to_i32, Dtype};
use crate::context::GpuContext;
use crate::error::{CudaError, Result};

/// Separate gate and up tensors, `[rows, d]` each.
pub fn silu_mul<T: Dtype>(
    gpu: &GpuContext,
    gate: &CudaView<'_, T>, // [rows, d]
    up: &CudaView<'_, T>,   // [rows, d]
    d: usize,
    out: &mut CudaViewMut<'_, T>, // [rows, d]
) -> Result<()> {
    check_multiple("gate", gate.len(), d)?;
    check_len("up", up.len(), gate.len())?;
    check_len("out", out.len(), gate.len())?;
    if gate.is_empty() {
        return Ok(());
    }
    let (d_i, n) = (to_i32("d", d)?, gate.len() as i64);
    let f = gpu.kernels().silu_mul.get::<T>();
    let mut args = gpu.stream().launch_builder(f);
    args.arg(gate).arg(up).arg(out).arg(&d_i).arg(&d_i).arg(&n);
    launch(args, elementwise(gate.len()))
}

/// One fused gate_up projection `[rows, 2d]` (gate in the first d columns).
pub fn silu_mul_fused<T: Dtype>(
    gpu: &GpuContext,
    gate_up: &CudaView<'_, T>, // [rows, 2d]
    d: usize,
    out: &mut CudaViewMut<'_, T>, // [rows, d]
) -> Result<()> {
    let rows = check_multiple("gate_up", gate_up.len(), 2 * d)?;
    check_len("out", out.len(), rows * d)?;
    if rows == 0 {
        return Ok(());
    }
    // The up half starts d values in; the kernel walks both halves with stride 2d.
    let up = gate_up
        .try_slice(d..)
        .ok_or_else(|| CudaError::invalid("gate_up", "too short for its up half"))?;
    let (d_i, stride, n) = (to_i32("d", d)?, to_i32("d", 2 * d)?, (rows * d) as i64);
    let f = gpu.kernels().silu_mul.get::<T>();
    let mut args = gpu.stream().launch_builder(f);
    args.arg(gate_up)
        .arg(&up)
        .arg(out)
        .arg(&d_i)
        .arg(&stride)
        .arg(&n);
    launch(args, elementwise(rows * d))
}
