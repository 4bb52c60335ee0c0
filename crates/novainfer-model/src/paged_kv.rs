//! The physical KV pool: fixed-size blocks per layer, addressed by slot.
//!
//! The scheduler (in `novainfer-core`) decides which blocks a sequence owns and
//! hands us `slot_mapping` (where each new token's K/V goes) and `block_table`
//! (where a sequence's history lives). This module only owns the bytes:
//!
//! ```text
//!   layer l, keys:  [ block 0: slot 0 .. slot bs-1 | block 1: slot bs .. | ... ]
//!   one slot     =  [kv_head 0: one row | kv_head 1: one row | ...]
//!   slot of pos  =  block_table[pos / bs] * bs + pos % bs
//! ```
//! where a row is `head_dim` numbers in the pool's [`KvStorage`] (f32, f16, bf16 or q8_0).

use crate::config::Qwen2Config;
use crate::error::{ModelError, Result};
use crate::kv_dtype::KvStorage;

pub struct PagedKvCache {
    block_size: usize,
    num_blocks: usize,
    dtype: KvStorage,
    num_kv_heads: usize,
    head_dim: usize,
    /// Bytes of one head's row, and of one slot (`num_kv_heads` rows).
    head_bytes: usize,
    slot_bytes: usize,
    layers: Vec<LayerPool>,
}

pub(crate) struct LayerPool {
    pub(crate) k: Vec<u8>,
    pub(crate) v: Vec<u8>,
}

impl PagedKvCache {
    /// A pool of `num_blocks` blocks of `block_size` slots. The buffers are zero-initialised
    /// allocations, so untouched blocks cost address space, not memory.
    pub fn new(cfg: &Qwen2Config, num_blocks: usize, block_size: usize, dtype: KvStorage) -> Self {
        let head_bytes = dtype.row_bytes(cfg.head_dim());
        let slot_bytes = cfg.num_key_value_heads * head_bytes;
        let bytes = num_blocks * block_size * slot_bytes;
        let layers = (0..cfg.num_hidden_layers)
            .map(|_| LayerPool {
                k: vec![0; bytes],
                v: vec![0; bytes],
            })
            .collect();
        Self {
            block_size,
            num_blocks,
            dtype,
            num_kv_heads: cfg.num_key_value_heads,
            head_dim: cfg.head_dim(),
            head_bytes,
            slot_bytes,
            layers,
        }
    }

    /// Bytes one block takes over all layers (keys and values) when stored as `dtype`.
    pub fn bytes_per_block(cfg: &Qwen2Config, block_size: usize, dtype: KvStorage) -> usize {
        2 * cfg.num_hidden_layers
            * block_size
            * cfg.num_key_value_heads
            * dtype.row_bytes(cfg.head_dim())
    }

    pub fn dtype(&self) -> KvStorage {
        self.dtype
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    pub fn num_slots(&self) -> usize {
        self.num_blocks * self.block_size
    }

    /// Fails if any slot or block id lies outside the pool (a scheduler/runner bug,
    /// reported as an error rather than an out-of-bounds panic on the engine thread).
    pub fn check_slots(&self, slots: &[usize]) -> Result<()> {
        match slots.iter().find(|&&s| s >= self.num_slots()) {
            Some(&slot) => Err(ModelError::config(
                "slot_mapping",
                format!("slot {slot} outside a pool of {} slots", self.num_slots()),
            )),
            None => Ok(()),
        }
    }

    /// Copies slots `0..num_tokens` of block `src` into block `dst` in every layer
    /// (a forked sequence's own copy of a partially filled block).
    pub fn copy_block(&mut self, src: usize, dst: usize, num_tokens: usize) -> Result<()> {
        if src.max(dst) >= self.num_blocks || num_tokens > self.block_size {
            return Err(ModelError::config(
                "block_copies",
                format!(
                    "copy of {num_tokens} slots from block {src} to {dst} outside a pool of {} \
                     blocks of {}",
                    self.num_blocks, self.block_size
                ),
            ));
        }
        let (from, to, len) = (
            src * self.block_size * self.slot_bytes,
            dst * self.block_size * self.slot_bytes,
            num_tokens * self.slot_bytes,
        );
        for pool in &mut self.layers {
            pool.k.copy_within(from..from + len, to);
            pool.v.copy_within(from..from + len, to);
        }
        Ok(())
    }

    /// Stores K and V rows `[slots.len(), num_kv_heads·head_dim]` of `layer` at `slots`,
    /// converted to the pool's dtype.
    pub(crate) fn write(&mut self, layer: usize, slots: &[usize], k: &[f32], v: &[f32]) {
        let (hd, hb, sb, dtype) = (self.head_dim, self.head_bytes, self.slot_bytes, self.dtype);
        let pool = &mut self.layers[layer];
        let row = self.num_kv_heads * hd;
        for (i, &slot) in slots.iter().enumerate() {
            let (ks, vs) = (&k[i * row..(i + 1) * row], &v[i * row..(i + 1) * row]);
            let kd = &mut pool.k[slot * sb..(slot + 1) * sb];
            for (src, dst) in ks.chunks_exact(hd).zip(kd.chunks_exact_mut(hb)) {
                dtype.encode(src, dst);
            }
            let vd = &mut pool.v[slot * sb..(slot + 1) * sb];
            for (src, dst) in vs.chunks_exact(hd).zip(vd.chunks_exact_mut(hb)) {
                dtype.encode(src, dst);
            }
        }
    }

    /// One layer of the pool as the attention kernel reads it.
    pub(crate) fn layer(&self, layer: usize) -> PoolLayer<'_> {
        PoolLayer {
            k: &self.layers[layer].k,
            v: &self.layers[layer].v,
            dtype: self.dtype,
            block_size: self.block_size,
            head_dim: self.head_dim,
            head_bytes: self.head_bytes,
            slot_bytes: self.slot_bytes,
        }
    }
}

/// One layer's keys and values, with the geometry needed to find a row.
#[derive(Clone, Copy)]
pub(crate) struct PoolLayer<'a> {
    pub(crate) k: &'a [u8],
    pub(crate) v: &'a [u8],
    pub(crate) dtype: KvStorage,
    pub(crate) block_size: usize,
    pub(crate) head_dim: usize,
    pub(crate) head_bytes: usize,
    pub(crate) slot_bytes: usize,
}
