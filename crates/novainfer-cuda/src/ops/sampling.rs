//! Launcher of `kernels/sampling.cu`: greedy argmax, seeded top-k/top-p/min-p sampling, and
//! `draw`, which runs either per row of a step with the token's logprob.

use cudarc::driver::{CudaView, CudaViewMut, DeviceRepr, PushKernelArg};

use super::{check_len, check_multiple, launch, per_row, to_i32, Dtype};
use crate::context::GpuContext;
use crate::error::Result;

/// Threads per row; must equal `SAMPLE_THREADS` in the kernel.
pub const SAMPLE_THREADS: u32 = 1024;

pub use crate::sample_params::{DrawMode, SampleParams};

// SAFETY: `DrawMode` is `#[repr(i32)]`, the kernel's `i32` mode.
unsafe impl DeviceRepr for DrawMode {}

// SAFETY: `SampleParams` is `#[repr(C)]` plain old data with the kernel struct's field
// order and types (its size is asserted where it is defined).
unsafe impl DeviceRepr for SampleParams {}

/// The first index of each row's maximum (lowest id on ties; NaN counts as −inf).
pub fn argmax<T: Dtype>(
    gpu: &GpuContext,
    logits: &CudaView<'_, T>, // [rows, vocab]
    vocab: usize,
    out: &mut CudaViewMut<'_, u32>, // [rows]
) -> Result<()> {
    let rows = check_multiple("logits", logits.len(), vocab)?;
    check_len("out", out.len(), rows)?;
    if rows == 0 {
        return Ok(());
    }
    let vocab = to_i32("vocab", vocab)?;
    let f = gpu.kernels().argmax.get::<T>();
    let mut args = gpu.stream().launch_builder(f);
    args.arg(logits).arg(out).arg(&vocab);
    launch(args, per_row(rows, SAMPLE_THREADS)?)
}

/// One token per row under its `params`; `scratch` holds `[rows, vocab]` f32 for the
/// scaled logits. Greedy rows (temperature 0 or below `MIN_SAMPLING_TEMPERATURE`, top-k 1)
/// go to [`argmax`]: `SampleParams::new` refuses them.
pub fn sample<T: Dtype>(
    gpu: &GpuContext,
    logits: &CudaView<'_, T>,            // [rows, vocab]
    params: &CudaView<'_, SampleParams>, // [rows]
    vocab: usize,
    scratch: &mut CudaViewMut<'_, f32>, // [rows, vocab]
    out: &mut CudaViewMut<'_, u32>,     // [rows]
) -> Result<()> {
    let rows = check_multiple("logits", logits.len(), vocab)?;
    check_len("params", params.len(), rows)?;
    check_len("scratch", scratch.len(), rows * vocab)?;
    check_len("out", out.len(), rows)?;
    if rows == 0 {
        return Ok(());
    }
    let vocab = to_i32("vocab", vocab)?;
    let f = gpu.kernels().sample.get::<T>();
    let mut args = gpu.stream().launch_builder(f);
    args.arg(logits)
        .arg(params)
        .arg(scratch)
        .arg(out)
        .arg(&vocab);
    launch(args, per_row(rows, SAMPLE_THREADS)?)
}

/// One step's draws in one launch: for each row of `logits`, by `modes[row]`, the greedy or
/// sampled token into `ids[row]` and its raw logprob (`log_softmax` of the row) into
/// `logprobs[row]`; a [`DrawMode::Skip`] row is left alone (the engine samples it from its
/// logits). `scratch` holds `[rows, vocab]` f32 for the random rows' scaled logits. The CPU
/// twin is [`crate::reference::draw`].
#[allow(clippy::too_many_arguments)]
pub fn draw<T: Dtype>(
    gpu: &GpuContext,
    logits: &CudaView<'_, T>,            // [rows, vocab]
    params: &CudaView<'_, SampleParams>, // [rows]
    modes: &CudaView<'_, DrawMode>,      // [rows]
    vocab: usize,
    scratch: &mut CudaViewMut<'_, f32>,  // [rows, vocab]
    ids: &mut CudaViewMut<'_, u32>,      // [rows]
    logprobs: &mut CudaViewMut<'_, f32>, // [rows]
) -> Result<()> {
    let rows = check_multiple("logits", logits.len(), vocab)?;
    check_len("params", params.len(), rows)?;
    check_len("modes", modes.len(), rows)?;
    check_len("scratch", scratch.len(), rows * vocab)?;
    check_len("ids", ids.len(), rows)?;
    check_len("logprobs", logprobs.len(), rows)?;
    if rows == 0 {
        return Ok(());
    }
    let vocab = to_i32("vocab", vocab)?;
    let f = gpu.kernels().draw.get::<T>();
    let mut args = gpu.stream().launch_builder(f);
    args.arg(logits)
        .arg(params)
        .arg(modes)
        .arg(scratch)
        .arg(ids)
        .arg(logprobs)
        .arg(&vocab);
    launch(args, per_row(rows, SAMPLE_THREADS)?)
}
