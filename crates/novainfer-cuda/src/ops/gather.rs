//! Launcher of `kernels/gather.cu`: `out[i] = x[rows[i]]`, the rows a step samples from.

use cudarc::driver::{CudaView, CudaViewMut, PushKernelArg};

use super::{check_len, check_multiple, launch, per_row, to_i32, Dtype};
use crate::context::GpuContext;
use crate::error::Result;

/// Copies row `rows[i]` of `x` (`[num_src_rows, d]`) to row i of `out` (`[rows.len(), d]`).
/// The runner builds `rows` from the batch it scheduled; an index outside `x` gives a zero
/// row rather than an out-of-bounds read.
pub fn gather_rows<T: Dtype>(
    gpu: &GpuContext,
    x: &CudaView<'_, T>,
    rows: &CudaView<'_, i32>,
    d: usize,
    out: &mut CudaViewMut<'_, T>,
) -> Result<()> {
    let num_src_rows = check_multiple("x", x.len(), d)?;
    let num_out = rows.len();
    check_len("out", out.len(), num_out * d)?;
    if num_out == 0 {
        return Ok(());
    }
    let (d_i, src_rows) = (to_i32("d", d)?, to_i32("x", num_src_rows)?);
    let f = gpu.kernels().gather.get::<T>();
    let mut args = gpu.stream().launch_builder(f);
    args.arg(x).arg(rows).arg(out).arg(&d_i).arg(&src_rows);
    launch(args, per_row(num_out, 256)?)
}
