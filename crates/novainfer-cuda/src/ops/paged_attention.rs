//! Launcher of `kernels/paged_attention.cu`: causal GQA attention over the paged pool.
//!
//! Two entry points with the same result bit for bit (see the kernel's header):
//! * [`paged_attention_decode`] — one query token per sequence; splits of [`ATTN_SPLIT`]
//!   positions run in parallel and are merged in order by a second kernel. The grid depends
//!   only on the scratch's capacity, so a CUDA graph captured for a batch bucket stays valid.
//!   The first phase is [`DecodeKernel::Grouped`] (a block per KV head, split and part of
//!   the group, the part's query heads sharing one staged copy of each K/V row) wherever it
//!   applies, else [`DecodeKernel::PerHead`] (one warp per query head and split); all give
//!   the same bits.
//!   The caller passes the batch's longest history, known on the host: a batch the scratch
//!   cannot hold is refused, never cut short.
//! * [`paged_attention_prefill`] — any number of query tokens per sequence (prefill, chunked
//!   prefill, mixed batches), one warp per (token, head).

use cudarc::driver::{
    CudaSlice, CudaView, CudaViewMut, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg,
};

use super::{check_len, launch, to_i32, to_u32, Dtype};
use crate::context::{driver, GpuContext};
use crate::error::{CudaError, Result};
use crate::table::AttentionFns;

/// Positions per split; must equal `ATTN_SPLIT` in the kernel (a test checks).
pub const ATTN_SPLIT: usize = 512;
/// Warps per block; must equal `ATTN_WARPS` in the kernel.
const ATTN_WARPS: usize = 4;
/// The largest group (query heads per KV head) the grouped decode kernel takes, one warp
/// each; must equal `ATTN_MAX_GROUP` in the kernel (a test checks).
pub const ATTN_MAX_GROUP: usize = 16;
/// Alignment the grouped decode kernel's 16-byte loads need of the pool's start.
const POOL_ALIGN: u64 = 16;

/// Which first phase a decode launch runs. All write the same partials, bit for bit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeKernel {
    /// Grid (num_kv_heads · ⌈group / heads_per_block⌉, num_seqs, splits), one warp per query
    /// head: each block stages the K/V rows of its split once, with 16-byte loads, for
    /// `heads_per_block` heads of one group (the whole group reads each row once; fewer
    /// heads per block make more blocks, for batches too small to fill the GPU).
    Grouped { heads_per_block: usize },
    /// Grid (⌈num_heads / 4⌉, num_seqs, splits), one warp per query head: each K/V row is
    /// read once per query head. For groups over [`ATTN_MAX_GROUP`] and pools whose start is
    /// not 16-byte aligned.
    PerHead,
}

/// Head geometry and pool geometry of one layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionConfig {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    /// Row stride of `block_tables`.
    pub max_blocks_per_seq: usize,
}

/// The pool of one layer and the per-sequence tables a launch reads.
pub struct PagedKv<'a, T> {
    pub k_cache: CudaView<'a, T>, // [num_blocks, block_size, num_kv_heads, head_dim]
    pub v_cache: CudaView<'a, T>, // [num_blocks, block_size, num_kv_heads, head_dim]
    /// `[num_seqs, max_blocks_per_seq]`; entries past a sequence's last block are never read.
    pub block_tables: CudaView<'a, i32>,
    /// `[num_seqs]`: positions `0..seq_len` are in the pool (0 for a padding sequence).
    pub seq_lens: CudaView<'a, i32>,
}

/// Mirror of the kernel's `AttnShape`, passed by value.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct AttnShape {
    num_heads: i32,
    num_kv_heads: i32,
    block_size: i32,
    num_blocks: i32,
    max_blocks_per_seq: i32,
    max_splits: i32,
    scale: f32,
}
const _: () = assert!(std::mem::size_of::<AttnShape>() == 28);
// SAFETY: `#[repr(C)]` plain old data with the kernel struct's field order and types.
unsafe impl DeviceRepr for AttnShape {}

/// f32 partials of the decode splits, sized for a batch bucket.
pub struct DecodeScratch {
    part_acc: CudaSlice<f32>,
    part_ml: CudaSlice<f32>,
    max_num_seqs: usize,
    max_splits: usize,
}

impl DecodeScratch {
    /// Room for `max_num_seqs` sequences of up to `max_seq_len` positions.
    pub fn new(
        gpu: &GpuContext,
        cfg: &AttentionConfig,
        max_num_seqs: usize,
        max_seq_len: usize,
    ) -> Result<Self> {
        let max_splits = max_seq_len.div_ceil(ATTN_SPLIT).max(1);
        let parts = max_num_seqs * cfg.num_heads * max_splits;
        let alloc = |n: usize| {
            gpu.stream()
                .alloc_zeros::<f32>(n)
                .map_err(|e| driver("cuMemAlloc", e))
        };
        Ok(Self {
            part_acc: alloc(parts * cfg.head_dim)?,
            part_ml: alloc(parts * 2)?,
            max_num_seqs,
            max_splits,
        })
    }

    /// The longest history a decode launch with this scratch accepts.
    pub fn max_seq_len(&self) -> usize {
        self.max_splits * ATTN_SPLIT
    }
}

/// Checks the geometry against the buffers; returns the kernel's shape, the number of
/// sequences and the kernels for this dtype and head dim.
fn check_config<'g, T: Dtype>(
    gpu: &'g GpuContext,
    cfg: &AttentionConfig,
    kv: &PagedKv<'_, T>,
) -> Result<(AttnShape, usize, &'g AttentionFns)> {
    let fns = gpu.kernels().attention::<T>(cfg.head_dim).ok_or_else(|| {
        CudaError::invalid(
            "head_dim",
            format!(
                "{} has no {} kernel (have {:?})",
                cfg.head_dim,
                T::KIND.suffix(),
                T::KIND.attention_head_dims()
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
    let shape = AttnShape {
        num_heads: to_i32("num_heads", cfg.num_heads)?,
        num_kv_heads: to_i32("num_kv_heads", cfg.num_kv_heads)?,
        block_size: to_i32("block_size", cfg.block_size)?,
        num_blocks: to_i32("k_cache", kv.k_cache.len() / slot_len)?,
        max_blocks_per_seq: to_i32("max_blocks_per_seq", cfg.max_blocks_per_seq)?,
        max_splits: 0,
        scale: 1.0 / (cfg.head_dim as f32).sqrt(),
    };
    Ok((shape, num_seqs, fns))
}

/// One query token per sequence: `q`/`out` are `[num_seqs, num_heads, head_dim]`.
///
/// `max_seq_len` is the longest `seq_lens` entry of the batch, which the runner knows on the
/// host; a batch longer than the scratch ([`DecodeScratch::max_seq_len`]) or than a block-table
/// row (`max_blocks_per_seq · block_size`) is refused rather than attended to in part.
pub fn paged_attention_decode<T: Dtype>(
    gpu: &GpuContext,
    cfg: &AttentionConfig,
    q: &CudaView<'_, T>,
    kv: PagedKv<'_, T>,
    max_seq_len: usize,
    scratch: &mut DecodeScratch,
    out: &mut CudaViewMut<'_, T>,
) -> Result<()> {
    let kernel = decode_kernel_for(gpu, cfg, &kv, max_seq_len);
    paged_attention_decode_with(gpu, kernel, cfg, q, kv, max_seq_len, scratch, out)
}

/// Whether the grouped kernel takes this geometry and pool: groups of 1..=[`ATTN_MAX_GROUP`]
/// query heads over a pool whose K and V start on 16 bytes.
fn grouped_applies<T: Dtype>(gpu: &GpuContext, cfg: &AttentionConfig, kv: &PagedKv<'_, T>) -> bool {
    let group = cfg.num_heads / cfg.num_kv_heads.max(1);
    let aligned = |view: &CudaView<'_, T>| {
        let (ptr, _sync) = view.device_ptr(gpu.stream());
        ptr % POOL_ALIGN == 0
    };
    (1..=ATTN_MAX_GROUP).contains(&group) && aligned(&kv.k_cache) && aligned(&kv.v_cache)
}

/// The decode kernel [`paged_attention_decode`] runs for this geometry, pool and longest
/// history: grouped where it applies, with whole groups per block once the batch's
/// (sequence, KV head, split) triples make two blocks per multiprocessor, and the group cut
/// into parts (more, smaller blocks) below that. The choice never changes a bit of the
/// result; a CUDA graph that captures a launch should fix it for its bucket.
pub fn decode_kernel_for<T: Dtype>(
    gpu: &GpuContext,
    cfg: &AttentionConfig,
    kv: &PagedKv<'_, T>,
    max_seq_len: usize,
) -> DecodeKernel {
    if !grouped_applies(gpu, cfg, kv) {
        return DecodeKernel::PerHead;
    }
    let group = cfg.num_heads / cfg.num_kv_heads;
    let working =
        kv.seq_lens.len().max(1) * cfg.num_kv_heads * max_seq_len.div_ceil(ATTN_SPLIT).max(1);
    let parts = (2 * gpu.multiprocessor_count())
        .div_ceil(working)
        .clamp(1, group);
    DecodeKernel::Grouped {
        heads_per_block: group.div_ceil(parts),
    }
}

/// [`paged_attention_decode`] with the first phase chosen by the caller (tests and benchmarks
/// compare them). [`DecodeKernel::Grouped`] is refused where it does not apply.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention_decode_with<T: Dtype>(
    gpu: &GpuContext,
    kernel: DecodeKernel,
    cfg: &AttentionConfig,
    q: &CudaView<'_, T>,
    kv: PagedKv<'_, T>,
    max_seq_len: usize,
    scratch: &mut DecodeScratch,
    out: &mut CudaViewMut<'_, T>,
) -> Result<()> {
    let (mut shape, num_seqs, fns) = check_config(gpu, cfg, &kv)?;
    if let DecodeKernel::Grouped { heads_per_block } = kernel {
        let group = cfg.num_heads / cfg.num_kv_heads;
        if !grouped_applies(gpu, cfg, &kv) || !(1..=group).contains(&heads_per_block) {
            return Err(CudaError::invalid(
                "kernel",
                format!(
                    "the grouped decode kernel takes groups of 1..={ATTN_MAX_GROUP} query heads \
                     over a 16-byte aligned pool, 1..=group heads per block ({} / {} heads, \
                     {heads_per_block} per block given)",
                    cfg.num_heads, cfg.num_kv_heads
                ),
            ));
        }
    }
    let row = cfg.num_heads * cfg.head_dim;
    check_len("q", q.len(), num_seqs * row)?;
    check_len("out", out.len(), num_seqs * row)?;
    if num_seqs > scratch.max_num_seqs {
        return Err(CudaError::invalid(
            "seq_lens",
            format!(
                "{num_seqs} sequences exceed the scratch's {}",
                scratch.max_num_seqs
            ),
        ));
    }
    if max_seq_len > scratch.max_seq_len() {
        return Err(CudaError::invalid(
            "max_seq_len",
            format!(
                "{max_seq_len} positions exceed the decode scratch's {} ({} splits of {ATTN_SPLIT}); \
                 size DecodeScratch for max_model_len",
                scratch.max_seq_len(),
                scratch.max_splits
            ),
        ));
    }
    let table_reach = cfg.max_blocks_per_seq * cfg.block_size;
    if max_seq_len > table_reach {
        return Err(CudaError::invalid(
            "max_seq_len",
            format!(
                "{max_seq_len} positions exceed a block-table row of {} blocks of {}",
                cfg.max_blocks_per_seq, cfg.block_size
            ),
        ));
    }
    if num_seqs == 0 {
        return Ok(());
    }
    shape.max_splits = to_i32("max_splits", scratch.max_splits)?;
    let seqs = to_u32("seq_lens", num_seqs)?;
    let splits = to_u32("max_splits", scratch.max_splits)?;
    let (function, phase1) = match kernel {
        DecodeKernel::Grouped { heads_per_block } => {
            let parts = (cfg.num_heads / cfg.num_kv_heads).div_ceil(heads_per_block);
            (
                &fns.decode_grouped,
                LaunchConfig {
                    grid_dim: (
                        to_u32("num_kv_heads", cfg.num_kv_heads * parts)?,
                        seqs,
                        splits,
                    ),
                    block_dim: (to_u32("heads_per_block", heads_per_block * 32)?, 1, 1),
                    shared_mem_bytes: 0,
                },
            )
        }
        DecodeKernel::PerHead => (
            &fns.decode,
            LaunchConfig {
                grid_dim: (
                    to_u32("num_heads", cfg.num_heads.div_ceil(ATTN_WARPS))?,
                    seqs,
                    splits,
                ),
                block_dim: ((ATTN_WARPS * 32) as u32, 1, 1),
                shared_mem_bytes: 0,
            },
        ),
    };
    let mut args = gpu.stream().launch_builder(function);
    args.arg(q)
        .arg(&kv.k_cache)
        .arg(&kv.v_cache)
        .arg(&kv.block_tables)
        .arg(&kv.seq_lens)
        .arg(&mut scratch.part_acc)
        .arg(&mut scratch.part_ml)
        .arg(&shape);
    launch(args, phase1)?;
    let mut args = gpu.stream().launch_builder(&fns.merge);
    args.arg(&kv.seq_lens)
        .arg(&scratch.part_acc)
        .arg(&scratch.part_ml)
        .arg(out)
        .arg(&shape);
    launch(
        args,
        LaunchConfig {
            grid_dim: (to_u32("num_heads", cfg.num_heads)?, seqs, 1),
            block_dim: (32, 1, 1),
            shared_mem_bytes: 0,
        },
    )
}

/// Flattened query tokens: `q`/`out` are `[num_tokens, num_heads, head_dim]`; sequence s owns
/// tokens `query_start_loc[s]..query_start_loc[s+1]`; token t attends to `0..=positions[t]`.
pub fn paged_attention_prefill<T: Dtype>(
    gpu: &GpuContext,
    cfg: &AttentionConfig,
    q: &CudaView<'_, T>,
    kv: PagedKv<'_, T>,
    query_start_loc: &CudaView<'_, i32>, // [num_seqs + 1]
    positions: &CudaView<'_, i32>,       // [num_tokens]
    out: &mut CudaViewMut<'_, T>,
) -> Result<()> {
    let (shape, num_seqs, fns) = check_config(gpu, cfg, &kv)?;
    let num_tokens = positions.len();
    let row = cfg.num_heads * cfg.head_dim;
    check_len("q", q.len(), num_tokens * row)?;
    check_len("out", out.len(), num_tokens * row)?;
    check_len("query_start_loc", query_start_loc.len(), num_seqs + 1)?;
    if num_tokens == 0 || num_seqs == 0 {
        return Ok(());
    }
    let (tokens, seqs) = (
        to_i32("positions", num_tokens)?,
        to_i32("seq_lens", num_seqs)?,
    );
    let mut args = gpu.stream().launch_builder(&fns.prefill);
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
    let rows = num_tokens * cfg.num_heads;
    launch(
        args,
        LaunchConfig {
            grid_dim: (to_u32("positions", rows.div_ceil(ATTN_WARPS))?, 1, 1),
            block_dim: ((ATTN_WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: 0,
        },
    )
}
