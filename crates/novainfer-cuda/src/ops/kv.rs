//! The paged KV pool of one layer as the launchers take it, and block copies within it.
//!
//! Layout (row-major, as the CPU's `PagedKvCache` before it tiled its keys; the CPU pool now keeps
//! keys in tiles of 16 slots, this one does not): K and V in separate buffers, each
//! `[num_blocks, block_size, num_kv_heads, head_dim]`, so slot `s` is the `kv_row =
//! num_kv_heads · head_dim` values at `s · kv_row`, and block `b` holds slots
//! `b · block_size .. (b + 1) · block_size`.

use cudarc::driver::CudaViewMut;

use crate::context::{driver, GpuContext};
use crate::error::{CudaError, Result};

/// One layer's K and V pools, writable.
pub struct KvCacheMut<'a, T> {
    pub k: CudaViewMut<'a, T>,
    pub v: CudaViewMut<'a, T>,
}

/// Shape of a pool's blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvGeometry {
    pub block_size: usize,
    /// `num_kv_heads · head_dim`: values per slot.
    pub kv_row: usize,
}

/// Copy slots `0..num_tokens` of block `src` over those of block `dst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockCopy {
    pub src: usize,
    pub dst: usize,
    pub num_tokens: usize,
}

/// A forked sequence's own copy of a partially filled block (n > 1 sampling), in one layer:
/// call once per layer. Device-to-device copies on the context's stream, K then V.
pub fn copy_block<T>(
    gpu: &GpuContext,
    cache: KvCacheMut<'_, T>,
    geometry: KvGeometry,
    copy: BlockCopy,
) -> Result<()> {
    let KvCacheMut { mut k, mut v } = cache;
    if k.len() != v.len() {
        return Err(CudaError::invalid(
            "cache",
            format!("K holds {} values and V {}", k.len(), v.len()),
        ));
    }
    let block_len = geometry.block_size * geometry.kv_row;
    if block_len == 0 || !k.len().is_multiple_of(block_len) {
        return Err(CudaError::invalid(
            "cache",
            format!(
                "{} values is not a whole number of blocks of {block_len}",
                k.len()
            ),
        ));
    }
    let num_blocks = k.len() / block_len;
    if copy.src.max(copy.dst) >= num_blocks || copy.num_tokens > geometry.block_size {
        return Err(CudaError::invalid(
            "copy",
            format!(
                "{} slots from block {} to {} outside a pool of {num_blocks} blocks of {}",
                copy.num_tokens, copy.src, copy.dst, geometry.block_size
            ),
        ));
    }
    if copy.src == copy.dst || copy.num_tokens == 0 {
        return Ok(());
    }
    let len = copy.num_tokens * geometry.kv_row;
    for pool in [&mut k, &mut v] {
        copy_within(gpu, pool, copy.src * block_len, copy.dst * block_len, len)?;
    }
    Ok(())
}

/// `pool[to..to + len] = pool[from..from + len]` for non-overlapping ranges (distinct
/// blocks), which `split_at_mut` lets us borrow apart.
fn copy_within<T>(
    gpu: &GpuContext,
    pool: &mut CudaViewMut<'_, T>,
    from: usize,
    to: usize,
    len: usize,
) -> Result<()> {
    let (mut lo, mut hi) = pool.split_at_mut(from.max(to));
    let ranges = if from < to {
        lo.try_slice(from..from + len).zip(hi.try_slice_mut(0..len))
    } else {
        hi.try_slice(0..len).zip(lo.try_slice_mut(to..to + len))
    };
    let (src, mut dst) = ranges.ok_or_else(|| {
        CudaError::invalid(
            "copy",
            format!("{len} values from {from} to {to} overlap or overrun"),
        )
    })?;
    gpu.stream()
        .memcpy_dtod(&src, &mut dst)
        .map_err(|e| driver("cuMemcpyDtoDAsync", e))
}
