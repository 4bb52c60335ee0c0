//! Launcher of `kernels/silu_mul.cu`: `out = silu(gate) · up`.

use cudarc::driver::{CudaSlice, PushKernelArg};

use super::{check_len, check_multiple, elementwise, entry, launch, to_i32, Dtype};
use crate::context::GpuContext;
use crate::error::{CudaError, Result};
use crate::kernels::SILU_MUL;

/// Separate gate and up tensors, `[rows, d]` each.
pub fn silu_mul<T: Dtype>(
    gpu: &GpuContext,
    gate: &CudaSlice<T>, // [rows, d]
    up: &CudaSlice<T>,   // [rows, d]
    d: usize,
    out: &mut CudaSlice<T>, // [rows, d]
) -> Result<()> {
    check_multiple("gate", gate.len(), d)?;
    check_len("up", up.len(), gate.len())?;
    check_len("out", out.len(), gate.len())?;
    if gate.is_empty() {
        return Ok(());
    }
    let f = gpu.function(&SILU_MUL, &entry::<T>("silu_mul"))?;
    let (d_i, n) = (to_i32("d", d)?, gate.len() as i64);
    let mut args = gpu.stream().launch_builder(&f);
    args.arg(gate).arg(up).arg(out).arg(&d_i).arg(&d_i).arg(&n);
    launch(args, elementwise(gate.len()))
}

/// One fused gate_up projection `[rows, 2d]` (gate in the first d columns).
pub fn silu_mul_fused<T: Dtype>(
    gpu: &GpuContext,
    gate_up: &CudaSlice<T>, // [rows, 2d]
    d: usize,
    out: &mut CudaSlice<T>, // [rows, d]
) -> Result<()> {
    let rows = check_multiple("gate_up", gate_up.len(), 2 * d)?;
    check_len("out", out.len(), rows * d)?;
    if rows == 0 {
        return Ok(());
    }
    let up = gate_up
        .try_slice(d..)
        .ok_or_else(|| CudaError::invalid("gate_up", "too short for its up half"))?;
    let f = gpu.function(&SILU_MUL, &entry::<T>("silu_mul"))?;
    let (d_i, stride, n) = (to_i32("d", d)?, to_i32("d", 2 * d)?, (rows * d) as i64);
    let mut args = gpu.stream().launch_builder(&f);
    args.arg(gate_up)
        .arg(&up)
        .arg(out)
        .arg(&d_i)
        .arg(&stride)
        .arg(&n);
    launch(args, elementwise(rows * d))
}
