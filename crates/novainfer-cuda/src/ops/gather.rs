//! Launchers of `kernels/gather.cu`: `out[i] = x[rows[i]]`, the rows a step samples from;
//! `out[r, j] = x[r, order[j]]`, a GPTQ act-order matrix's input in its columns' order; and a
//! step's input tokens taken on the device from the draws of the step before it.

use cudarc::driver::{CudaView, CudaViewMut, PushKernelArg};

use super::{check_len, check_multiple, elementwise, launch, per_row, to_i32, Dtype};
use crate::context::GpuContext;
use crate::error::{CudaError, Result};

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

/// `out[r, j] = x[r, order[j]]` for every row of `x` (`[rows, d]`, `d = order.len()`): the input
/// of a matrix whose stored column `j` is input channel `order[j]` (GPTQ act-order, as the CPU's
/// `Linear` permutes it). The loader checks that `order` is a permutation; an entry outside the
/// row gives zero rather than an out-of-bounds read.
pub fn gather_columns<T: Dtype>(
    gpu: &GpuContext,
    x: &CudaView<'_, T>,
    order: &CudaView<'_, u32>,
    out: &mut CudaViewMut<'_, T>,
) -> Result<()> {
    let d = order.len();
    let rows = check_multiple("x", x.len(), d)?;
    check_len("out", out.len(), rows * d)?;
    if rows == 0 {
        return Ok(());
    }
    let d_i = to_i32("order", d)?;
    let f = gpu.kernels().gather_columns.get::<T>();
    let mut args = gpu.stream().launch_builder(f);
    args.arg(x).arg(order).arg(out).arg(&d_i);
    launch(args, per_row(rows, 256)?)
}

/// `token_ids[pairs[2i]] = drawn[pairs[2i + 1]]` for each pair: a step's tokens that the step
/// before it drew (`drawn`: its drawn ids by sampled row, still on the device).
pub fn chain_tokens(
    gpu: &GpuContext,
    drawn: &CudaView<'_, u32>,
    pairs: &CudaView<'_, i32>,
    token_ids: &mut CudaViewMut<'_, u32>,
) -> Result<()> {
    if !pairs.len().is_multiple_of(2) {
        return Err(CudaError::invalid(
            "pairs",
            format!("{} values: pairs come in twos", pairs.len()),
        ));
    }
    let count = pairs.len() / 2;
    if count == 0 {
        return Ok(());
    }
    let (count_i, drawn_i, tokens_i) = (
        to_i32("pairs", count)?,
        to_i32("drawn", drawn.len())?,
        to_i32("token_ids", token_ids.len())?,
    );
    let mut args = gpu.stream().launch_builder(&gpu.kernels().chain_tokens);
    args.arg(drawn)
        .arg(pairs)
        .arg(token_ids)
        .arg(&count_i)
        .arg(&drawn_i)
        .arg(&tokens_i);
    launch(args, elementwise(count))
}
