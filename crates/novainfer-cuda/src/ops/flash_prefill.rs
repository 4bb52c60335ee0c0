//! Launcher of `kernels/flash_prefill.cu`: causal GQA prefill attention on tensor cores
//! (`mma.sync.m16n8k16`, bf16 in, f32 accumulation) over the paged bf16 pool, with the same
//! inputs as [`paged_attention_prefill`] (prefill, chunked prefill after a cached prefix,
//! several sequences per launch).
//!
//! **Unverified on a GPU**: the kernel was written where no GPU was available; its index
//! arithmetic and algorithm are checked on the CPU ([`crate::flash_plan`], `tests/flash_twin.rs`)
//! and it compiles for sm_80/sm_90, but it has never run. The executor therefore keeps the
//! legacy kernel unless `NOVAINFER_CUDA_PREFILL=flash` ([`PrefillKernel::from_env`]);
//! `tests/flash_prefill.rs` (parity) and the `flash_prefill` bench are what a GPU run must
//! pass before the default changes (docs/benchmarks.md).
//!
//! It differs from the legacy kernel within bf16 rounding (P is rounded to bf16 for the
//! tensor cores, sums run in another order), not bit for bit; like it, a row's result does
//! not depend on the batch or on how its prompt was chunked (tiles sit at absolute
//! positions).
//!
//! [`paged_attention_prefill`]: super::paged_attention::paged_attention_prefill

use cudarc::driver::{CudaView, CudaViewMut, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg};
use half::bf16;

use super::paged_attention::{paged_attention_prefill, AttentionConfig, PagedKv};
use super::{check_len, launch, to_i32, to_u32};
use crate::error::{CudaError, Result};
use crate::flash_plan::{self, grid_tiles, WARPS};
use crate::GpuContext;

/// Selects the executor's prefill attention kernel.
pub const PREFILL_KERNEL_ENV: &str = "NOVAINFER_CUDA_PREFILL";

/// Which kernel runs prefill attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PrefillKernel {
    /// `paged_attention_prefill_*`: one warp per (token, head), CUDA cores. The default
    /// until a GPU run verifies [`PrefillKernel::Flash`].
    #[default]
    Legacy,
    /// `flash_prefill_bf16_hd*`: tensor cores (head dims 64 and 128; other head dims fall
    /// back to the legacy kernel).
    Flash,
}

impl PrefillKernel {
    /// Parses a value of [`PREFILL_KERNEL_ENV`]: `legacy`, `flash`, or empty for the default.
    pub fn parse(value: &str) -> Result<Self> {
        match value.trim() {
            "" | "legacy" => Ok(Self::Legacy),
            "flash" => Ok(Self::Flash),
            other => Err(CudaError::invalid(
                PREFILL_KERNEL_ENV,
                format!("{other:?} is neither `legacy` nor `flash`"),
            )),
        }
    }

    /// The kernel [`PREFILL_KERNEL_ENV`] names (read once per process).
    pub fn from_env() -> Result<Self> {
        static CHOICE: std::sync::OnceLock<std::result::Result<PrefillKernel, String>> =
            std::sync::OnceLock::new();
        CHOICE
            .get_or_init(|| {
                let value = std::env::var(PREFILL_KERNEL_ENV).unwrap_or_default();
                Self::parse(&value).map_err(|e| e.to_string())
            })
            .clone()
            .map_err(|why| CudaError::invalid(PREFILL_KERNEL_ENV, why))
    }
}

/// Mirror of the kernel's `FlashShape`, passed by value.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct FlashShape {
    num_heads: i32,
    num_kv_heads: i32,
    block_size: i32,
    num_blocks: i32,
    max_blocks_per_seq: i32,
    scale_log2: f32,
}
const _: () = assert!(std::mem::size_of::<FlashShape>() == 24);
// SAFETY: `#[repr(C)]` plain old data with the kernel struct's field order and types.
unsafe impl DeviceRepr for FlashShape {}

/// Whether [`flash_prefill`] takes this head dim.
pub fn flash_applies(cfg: &AttentionConfig) -> bool {
    flash_plan::HEAD_DIMS.contains(&cfg.head_dim)
}

/// The prefill attention `kernel` names; [`PrefillKernel::Flash`] falls back to the legacy
/// kernel for head dims it lacks.
#[allow(clippy::too_many_arguments)]
pub fn prefill_attention(
    gpu: &GpuContext,
    kernel: PrefillKernel,
    cfg: &AttentionConfig,
    q: &CudaView<'_, bf16>,
    kv: PagedKv<'_, bf16>,
    query_start_loc: &CudaView<'_, i32>,
    positions: &CudaView<'_, i32>,
    out: &mut CudaViewMut<'_, bf16>,
) -> Result<()> {
    if kernel == PrefillKernel::Flash && flash_applies(cfg) {
        flash_prefill(gpu, cfg, q, kv, query_start_loc, positions, out)
    } else {
        paged_attention_prefill(gpu, cfg, q, kv, query_start_loc, positions, out)
    }
}

/// Flattened query tokens: `q`/`out` are `[num_tokens, num_heads, head_dim]`; sequence s
/// owns tokens `query_start_loc[s]..query_start_loc[s+1]`; token t attends to positions
/// `0..=positions[t]` (capped by `seq_lens[s]`), read through the block table.
pub fn flash_prefill(
    gpu: &GpuContext,
    cfg: &AttentionConfig,
    q: &CudaView<'_, bf16>,
    kv: PagedKv<'_, bf16>,
    query_start_loc: &CudaView<'_, i32>,
    positions: &CudaView<'_, i32>,
    out: &mut CudaViewMut<'_, bf16>,
) -> Result<()> {
    let function = gpu.kernels().flash_prefill(cfg.head_dim).ok_or_else(|| {
        CudaError::invalid(
            "head_dim",
            format!(
                "{} has no flash prefill kernel (have {:?})",
                cfg.head_dim,
                flash_plan::HEAD_DIMS
            ),
        )
    })?;
    if cfg.num_kv_heads == 0 || !cfg.num_heads.is_multiple_of(cfg.num_kv_heads) {
        return Err(CudaError::invalid(
            "num_kv_heads",
            format!(
                "{} does not divide num_heads {}",
                cfg.num_kv_heads, cfg.num_heads
            ),
        ));
    }
    let slot_len = cfg.block_size * cfg.num_kv_heads * cfg.head_dim;
    if slot_len == 0 || !kv.k_cache.len().is_multiple_of(slot_len) {
        return Err(CudaError::invalid(
            "k_cache",
            format!(
                "{} values is not a whole number of blocks of {slot_len}",
                kv.k_cache.len()
            ),
        ));
    }
    check_len("v_cache", kv.v_cache.len(), kv.k_cache.len())?;
    let num_seqs = kv.seq_lens.len();
    check_len(
        "block_tables",
        kv.block_tables.len(),
        num_seqs * cfg.max_blocks_per_seq,
    )?;
    let num_tokens = positions.len();
    let row = cfg.num_heads * cfg.head_dim;
    check_len("q", q.len(), num_tokens * row)?;
    check_len("out", out.len(), num_tokens * row)?;
    check_len("query_start_loc", query_start_loc.len(), num_seqs + 1)?;
    // cp.async moves 16 bytes at a time from q and the pool; rows are whole 16-byte pieces
    // (head_dim a multiple of 8), so only the starts need checking.
    let stream = gpu.stream();
    let misaligned = |ptr: u64| !ptr.is_multiple_of(16);
    if misaligned(q.device_ptr(stream).0)
        || misaligned(kv.k_cache.device_ptr(stream).0)
        || misaligned(kv.v_cache.device_ptr(stream).0)
        || misaligned(out.device_ptr(stream).0)
    {
        return Err(CudaError::invalid(
            "q",
            "q, out and the pool must start on 16 bytes for the flash prefill kernel".to_owned(),
        ));
    }
    if num_tokens == 0 || num_seqs == 0 {
        return Ok(());
    }
    let group = cfg.num_heads / cfg.num_kv_heads;
    let shape = FlashShape {
        num_heads: to_i32("num_heads", cfg.num_heads)?,
        num_kv_heads: to_i32("num_kv_heads", cfg.num_kv_heads)?,
        block_size: to_i32("block_size", cfg.block_size)?,
        num_blocks: to_i32("k_cache", kv.k_cache.len() / slot_len)?,
        max_blocks_per_seq: to_i32("max_blocks_per_seq", cfg.max_blocks_per_seq)?,
        scale_log2: flash_plan::scale_log2(cfg.head_dim),
    };
    // Packed rows (tokens · group) must fit the kernel's i32 arithmetic.
    to_i32("positions", num_tokens * group + flash_plan::BLOCK_M)?;
    let (tokens, seqs) = (
        to_i32("positions", num_tokens)?,
        to_i32("seq_lens", num_seqs)?,
    );
    let mut args = stream.launch_builder(function);
    args.arg(q)
        .arg(&kv.k_cache)
        .arg(&kv.v_cache)
        .arg(&kv.block_tables)
        .arg(&kv.seq_lens)
        .arg(query_start_loc)
        .arg(positions)
        .arg(out)
        .arg(&tokens)
        .arg(&seqs)
        .arg(&shape);
    launch(
        args,
        LaunchConfig {
            grid_dim: (
                to_u32("positions", grid_tiles(num_tokens, num_seqs, group))?,
                to_u32("num_kv_heads", cfg.num_kv_heads)?,
                1,
            ),
            block_dim: ((WARPS * 32) as u32, 1, 1),
            // Static shared memory only (35 KiB at head_dim 128).
            shared_mem_bytes: 0,
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_switch_parses_and_defaults_to_legacy() {
        assert_eq!(PrefillKernel::default(), PrefillKernel::Legacy);
        assert_eq!(PrefillKernel::parse("").ok(), Some(PrefillKernel::Legacy));
        assert_eq!(
            PrefillKernel::parse("legacy").ok(),
            Some(PrefillKernel::Legacy)
        );
        assert_eq!(
            PrefillKernel::parse(" flash ").ok(),
            Some(PrefillKernel::Flash)
        );
        assert!(PrefillKernel::parse("fast").is_err());
    }
}
