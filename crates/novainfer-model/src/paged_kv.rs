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
use crate::large_buffer::LargeBuffer;

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

/// One layer's keys and values, on huge pages where the OS has them. A long context's decode
/// reads its rows from all over the pool, and with 4 KiB pages every few rows cost a page walk
/// whose page-table lines the weights streamed between layers have evicted: the 1.5B's attention
/// took 0.43-0.53 ms a layer at depth 4,096 on 4 KiB pages and 0.41-0.43 on 2 MiB ones, 2.26 and
/// 1.59 ms at depth 16,384 (decode 8.0 → 11.2 tok/s; docs/benchmarks.md). The price is the lazy
/// allocation's grain: a touched huge page costs its whole 2 MiB, so the first sequence adds up
/// to 4 MiB a layer (~110 MB for the 1.5B), and the step whose K/V first lands in a page zeroes
/// it (per layer, keys and values). The free queue cycles through every block
/// (`novainfer_core::block_pool`), so a serving process ends up touching the whole pool on
/// either page size.
pub(crate) struct LayerPool {
    pub(crate) k: LargeBuffer,
    pub(crate) v: LargeBuffer,
}

impl PagedKvCache {
    /// A pool of `num_blocks` blocks of `block_size` slots. The buffers are zero-initialised
    /// lazily, so untouched pages cost address space, not memory ([`LayerPool`]).
    pub fn new(cfg: &Qwen2Config, num_blocks: usize, block_size: usize, dtype: KvStorage) -> Self {
        let head_bytes = dtype.row_bytes(cfg.head_dim());
        let slot_bytes = cfg.num_key_value_heads * head_bytes;
        let bytes = num_blocks * block_size * slot_bytes;
        let layers = (0..cfg.num_hidden_layers)
            .map(|_| LayerPool {
                k: LargeBuffer::zeroed(bytes),
                v: LargeBuffer::zeroed(bytes),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pool_past_a_huge_page_asks_for_huge_pages() {
        let cfg = Qwen2Config {
            vocab_size: 8,
            hidden_size: 256,
            intermediate_size: 8,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            max_position_embeddings: 1 << 20,
            rope_theta: 10_000.0,
            rms_norm_eps: 1e-6,
            tie_word_embeddings: false,
            torch_dtype: None,
            bos_token_id: None,
            eos_token_ids: vec![],
        };
        let dtype = KvStorage::F16;
        // One layer's keys past 2 MiB.
        let slot_bytes = cfg.num_key_value_heads * dtype.row_bytes(cfg.head_dim());
        let blocks = (4 << 20) / (16 * slot_bytes);
        let mut pool = PagedKvCache::new(&cfg, blocks, 16, dtype);
        for layer in &pool.layers {
            assert!(cfg!(not(unix)) || (layer.k.is_mapped() && layer.v.is_mapped()));
        }
        // Rows land where the slot says, in either buffer, at the far end too.
        let row = cfg.num_key_value_heads * cfg.head_dim();
        let last = pool.num_slots() - 1;
        let (k, v) = (vec![1.5f32; row], vec![-2.0f32; row]);
        pool.write(0, &[last], &k, &v);
        let layer = pool.layer(0);
        let at = |buf: &[u8]| {
            let bytes = &buf[last * slot_bytes..last * slot_bytes + 2];
            half::f16::from_le_bytes([bytes[0], bytes[1]]).to_f32()
        };
        assert_eq!((at(layer.k), at(layer.v)), (1.5, -2.0));
    }
}
