//! The physical KV pool: fixed-size blocks per layer, addressed by slot.
//!
//! The scheduler (in `novainfer-core`) decides which blocks a sequence owns and
//! hands us `slot_mapping` (where each new token's K/V goes) and `block_table`
//! (where a sequence's history lives). This module only owns the bytes:
//!
//! ```text
//!   layer l, keys:  [ block 0: slot 0 .. slot bs-1 | block 1: slot bs .. | ... ]
//!   one slot     =  [kv_head 0: head_dim floats | kv_head 1: head_dim floats | ...]
//!   slot of pos  =  block_table[pos / bs] * bs + pos % bs
//! ```

use crate::config::Qwen2Config;
use crate::error::{ModelError, Result};
use crate::layers::KvView;

pub struct PagedKvCache {
    block_size: usize,
    num_blocks: usize,
    /// Floats per slot: `num_kv_heads * head_dim`.
    row: usize,
    head_dim: usize,
    layers: Vec<LayerPool>,
}

struct LayerPool {
    k: Vec<f32>,
    v: Vec<f32>,
}

impl PagedKvCache {
    pub fn new(cfg: &Qwen2Config, num_blocks: usize, block_size: usize) -> Self {
        let row = cfg.num_key_value_heads * cfg.head_dim();
        let floats = num_blocks * block_size * row;
        let layers = (0..cfg.num_hidden_layers)
            .map(|_| LayerPool {
                k: vec![0.0; floats],
                v: vec![0.0; floats],
            })
            .collect();
        Self {
            block_size,
            num_blocks,
            row,
            head_dim: cfg.head_dim(),
            layers,
        }
    }

    /// Bytes one block takes over all layers (keys and values, f32).
    pub fn bytes_per_block(cfg: &Qwen2Config, block_size: usize) -> usize {
        2 * cfg.num_hidden_layers
            * block_size
            * cfg.num_key_value_heads
            * cfg.head_dim()
            * std::mem::size_of::<f32>()
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
            src * self.block_size * self.row,
            dst * self.block_size * self.row,
            num_tokens * self.row,
        );
        for pool in &mut self.layers {
            pool.k.copy_within(from..from + len, to);
            pool.v.copy_within(from..from + len, to);
        }
        Ok(())
    }

    /// Stores K and V rows `[slots.len(), row]` of `layer` at `slots`.
    pub(crate) fn write(&mut self, layer: usize, slots: &[usize], k: &[f32], v: &[f32]) {
        let row = self.row;
        let pool = &mut self.layers[layer];
        for (i, &slot) in slots.iter().enumerate() {
            pool.k[slot * row..(slot + 1) * row].copy_from_slice(&k[i * row..(i + 1) * row]);
            pool.v[slot * row..(slot + 1) * row].copy_from_slice(&v[i * row..(i + 1) * row]);
        }
    }

    pub(crate) fn view<'a>(&'a self, layer: usize, block_table: &'a [u32]) -> PagedView<'a> {
        PagedView {
            pool: &self.layers[layer],
            block_table,
            block_size: self.block_size,
            row: self.row,
            head_dim: self.head_dim,
        }
    }
}

/// One sequence's history in one layer, read through its block table.
pub struct PagedView<'a> {
    pool: &'a LayerPool,
    block_table: &'a [u32],
    block_size: usize,
    row: usize,
    head_dim: usize,
}

impl PagedView<'_> {
    #[inline]
    fn offset(&self, pos: usize, kv_head: usize) -> usize {
        let slot = self.block_table[pos / self.block_size] as usize * self.block_size
            + pos % self.block_size;
        slot * self.row + kv_head * self.head_dim
    }
}

impl KvView for PagedView<'_> {
    fn key(&self, pos: usize, kv_head: usize) -> &[f32] {
        let o = self.offset(pos, kv_head);
        &self.pool.k[o..o + self.head_dim]
    }

    fn value(&self, pos: usize, kv_head: usize) -> &[f32] {
        let o = self.offset(pos, kv_head);
        &self.pool.v[o..o + self.head_dim]
    }
}
