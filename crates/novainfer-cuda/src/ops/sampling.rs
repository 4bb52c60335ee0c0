//! Launcher of `kernels/sampling.cu`: greedy argmax, seeded top-k/top-p/min-p sampling, and
//! `draw`, which runs either per row of a step with the token's logprob.

use cudarc::driver::{CudaView, CudaViewMut, DeviceRepr, PushKernelArg, ValidAsZeroBits};

use super::{check_len, check_multiple, launch, per_row, to_i32, Dtype};
use crate::context::GpuContext;
use crate::error::Result;

/// Threads per row; must equal `SAMPLE_THREADS` in the kernel.
pub const SAMPLE_THREADS: u32 = 1024;

pub use crate::sample_params::MAX_TOP_LOGPROBS;

/// Where `draw` writes the logprobs a row asked for: the chosen token's rank in the raw row,
/// and the most likely tokens with their raw logprobs (`MAX_TOP_LOGPROBS` slots a row, the
/// first `tops[row]` filled).
pub struct TopLogprobs<'a, 'b> {
    /// `[rows]`: −1 (none asked), else how many top tokens (at most `MAX_TOP_LOGPROBS`).
    pub tops: &'b CudaView<'a, i32>,
    pub ids: &'b mut CudaViewMut<'a, u32>, // [rows · MAX_TOP_LOGPROBS]
    pub logprobs: &'b mut CudaViewMut<'a, f32>, // [rows · MAX_TOP_LOGPROBS]
    pub ranks: &'b mut CudaViewMut<'a, u32>, // [rows]
}

pub use crate::sample_params::{DrawMode, RowEdit, RowPenalties, SampleParams};

// SAFETY: `DrawMode` is `#[repr(i32)]`, the kernel's `i32` mode.
unsafe impl DeviceRepr for DrawMode {}
// SAFETY: `#[repr(C)]` plain old data with the kernel structs' field order and types (sizes
// asserted where they are defined).
unsafe impl DeviceRepr for RowEdit {}
unsafe impl DeviceRepr for RowPenalties {}
// SAFETY: integers and floats: all-zero bytes are a valid value (token 0, no flags, no bias).
unsafe impl ValidAsZeroBits for RowEdit {}

/// A step's row edits in CSR form: row r's are `edits[offsets[r]..offsets[r + 1]]`, each
/// token at most once per row; `penalties[r]` their strengths.
pub struct RowEdits<'a> {
    pub offsets: CudaView<'a, i32>,            // [rows + 1]
    pub edits: CudaView<'a, RowEdit>,          // [offsets[rows]]
    pub penalties: CudaView<'a, RowPenalties>, // [rows]
}

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

/// A grammar's token masks over rows of `logits`, in place: row r with `masks_at[r] >= 0`
/// gets −inf for every id whose bit in its `words` mask words (at `masks[masks_at[r] · words]`)
/// is clear, and for every id past them. Rows with −1 are left alone. The CPU twin is
/// [`crate::reference::mask_row`].
pub fn mask_rows<T: Dtype>(
    gpu: &GpuContext,
    logits: &mut CudaViewMut<'_, T>, // [rows, vocab]
    masks_at: &CudaView<'_, i32>,    // [rows]
    masks: &CudaView<'_, u32>,       // [masked rows, words]
    words: usize,
    vocab: usize,
) -> Result<()> {
    let rows = check_multiple("logits", logits.len(), vocab)?;
    check_len("masks_at", masks_at.len(), rows)?;
    check_multiple("masks", masks.len(), words.max(1))?;
    if rows == 0 {
        return Ok(());
    }
    let (words, vocab) = (to_i32("words", words)?, to_i32("vocab", vocab)?);
    let f = gpu.kernels().mask_rows.get::<T>();
    let mut args = gpu.stream().launch_builder(f);
    args.arg(logits)
        .arg(masks_at)
        .arg(masks)
        .arg(&words)
        .arg(&vocab);
    launch(args, per_row(rows, SAMPLE_THREADS)?)
}

/// Copies each row of `logits` that has edits, sanitized, into `adjusted` and applies them
/// (penalties, bias, mask: [`RowEdit`]); rows without edits are not touched. The CPU twin is
/// [`crate::reference::adjust`].
pub fn adjust_rows<T: Dtype>(
    gpu: &GpuContext,
    logits: &CudaView<'_, T>, // [rows, vocab]
    edits: &RowEdits<'_>,
    vocab: usize,
    adjusted: &mut CudaViewMut<'_, f32>, // [rows, vocab]
) -> Result<()> {
    let rows = check_multiple("logits", logits.len(), vocab)?;
    check_len("offsets", edits.offsets.len(), rows + 1)?;
    check_len("penalties", edits.penalties.len(), rows)?;
    check_len("adjusted", adjusted.len(), rows * vocab)?;
    if rows == 0 {
        return Ok(());
    }
    let vocab = to_i32("vocab", vocab)?;
    let f = gpu.kernels().adjust_rows.get::<T>();
    let mut args = gpu.stream().launch_builder(f);
    args.arg(logits)
        .arg(adjusted)
        .arg(&edits.offsets)
        .arg(&edits.edits)
        .arg(&edits.penalties)
        .arg(&vocab);
    launch(args, per_row(rows, SAMPLE_THREADS)?)
}

/// One step's draws in one launch: for each row of `logits`, by `modes[row]`, the greedy or
/// sampled token into `ids[row]` and its raw logprob (`log_softmax` of the row) into
/// `logprobs[row]`; a [`DrawMode::Skip`] row is left alone (the engine samples it from its
/// logits). A row with edits (`offsets[row] < offsets[row + 1]`) is drawn from its copy in
/// `adjusted`, written by [`adjust_rows`] first. A row that asked for logprobs gets them in
/// `top` (see [`TopLogprobs`]). `scratch` holds `[rows, vocab]` f32 for the random rows'
/// scaled logits. The CPU twins are [`crate::reference::draw`] and
/// [`crate::reference::top_logprobs`].
#[allow(clippy::too_many_arguments)]
pub fn draw<T: Dtype>(
    gpu: &GpuContext,
    logits: &CudaView<'_, T>,            // [rows, vocab]
    adjusted: &CudaView<'_, f32>,        // [rows, vocab]
    offsets: &CudaView<'_, i32>,         // [rows + 1]
    params: &CudaView<'_, SampleParams>, // [rows]
    modes: &CudaView<'_, DrawMode>,      // [rows]
    vocab: usize,
    scratch: &mut CudaViewMut<'_, f32>,  // [rows, vocab]
    ids: &mut CudaViewMut<'_, u32>,      // [rows]
    logprobs: &mut CudaViewMut<'_, f32>, // [rows]
    top: TopLogprobs<'_, '_>,
) -> Result<()> {
    let rows = check_multiple("logits", logits.len(), vocab)?;
    check_len("adjusted", adjusted.len(), rows * vocab)?;
    check_len("tops", top.tops.len(), rows)?;
    check_len("top ids", top.ids.len(), rows * MAX_TOP_LOGPROBS)?;
    check_len("top logprobs", top.logprobs.len(), rows * MAX_TOP_LOGPROBS)?;
    check_len("ranks", top.ranks.len(), rows)?;
    check_len("offsets", offsets.len(), rows + 1)?;
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
        .arg(adjusted)
        .arg(offsets)
        .arg(params)
        .arg(modes)
        .arg(top.tops)
        .arg(scratch)
        .arg(ids)
        .arg(logprobs)
        .arg(top.ids)
        .arg(top.logprobs)
        .arg(top.ranks)
        .arg(&vocab);
    launch(args, per_row(rows, SAMPLE_THREADS)?)
}
