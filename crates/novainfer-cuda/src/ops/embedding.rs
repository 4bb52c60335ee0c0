//! Launchers of token-row gathers: from a bf16 table (`kernels/embedding.cu`), and from a table
//! kept as quantized blocks (`kernels/dequant.cu`'s `embed_*`, the load-time expansion's values).

use cudarc::driver::{CudaView, CudaViewMut, PushKernelArg};
use half::bf16;

use super::{check_len, launch, per_row, to_i32, Dtype};
use crate::context::GpuContext;
use crate::error::{CudaError, Result};
use crate::quant_type::QuantType;

/// Shape of the embedding table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EmbeddingShape {
    pub vocab_size: usize,
    pub hidden: usize,
}

/// `out[t] = table[token_ids[t]]`. The runner validates ids on the host
/// (`validate::validate_step`); an id outside the vocabulary still gives a zero row rather
/// than an out-of-bounds read.
pub fn embedding<T: Dtype>(
    gpu: &GpuContext,
    token_ids: &CudaView<'_, u32>, // [num_tokens]
    table: &CudaView<'_, bf16>,    // [vocab_size, hidden]
    shape: EmbeddingShape,
    out: &mut CudaViewMut<'_, T>, // [num_tokens, hidden]
) -> Result<()> {
    let num_tokens = token_ids.len();
    check_len("table", table.len(), shape.vocab_size * shape.hidden)?;
    check_len("out", out.len(), num_tokens * shape.hidden)?;
    if num_tokens == 0 {
        return Ok(());
    }
    let (hidden, vocab) = (
        to_i32("hidden", shape.hidden)?,
        to_i32("vocab_size", shape.vocab_size)?,
    );
    let f = gpu.kernels().embedding.get::<T>();
    let mut args = gpu.stream().launch_builder(f);
    args.arg(token_ids)
        .arg(table)
        .arg(out)
        .arg(&hidden)
        .arg(&vocab);
    launch(args, per_row(num_tokens, 256)?)
}

/// `out[t]` = row `token_ids[t]` of a table held as `qtype` blocks (`blocks`: `vocab_size`
/// rows of `hidden / block_values` blocks), expanded as the load-time dequantizer does.
pub fn embedding_quant<T: Dtype>(
    gpu: &GpuContext,
    qtype: QuantType,
    token_ids: &CudaView<'_, u32>, // [num_tokens]
    blocks: &CudaView<'_, u8>,
    shape: EmbeddingShape,
    out: &mut CudaViewMut<'_, T>, // [num_tokens, hidden]
) -> Result<()> {
    let num_tokens = token_ids.len();
    if !shape.hidden.is_multiple_of(qtype.block_values()) {
        return Err(CudaError::invalid(
            "shape",
            format!("hidden {} is not whole {qtype:?} blocks", shape.hidden),
        ));
    }
    let row_bytes = shape.hidden / qtype.block_values() * qtype.block_bytes();
    check_len("blocks", blocks.len(), shape.vocab_size * row_bytes)?;
    check_len("out", out.len(), num_tokens * shape.hidden)?;
    if num_tokens == 0 {
        return Ok(());
    }
    let (hidden, vocab) = (
        to_i32("hidden", shape.hidden)?,
        to_i32("vocab_size", shape.vocab_size)?,
    );
    let f = gpu.kernels().embed[qtype.index()].get::<T>();
    let mut args = gpu.stream().launch_builder(f);
    args.arg(token_ids)
        .arg(blocks)
        .arg(out)
        .arg(&hidden)
        .arg(&vocab);
    launch(args, per_row(num_tokens, 256)?)
}
