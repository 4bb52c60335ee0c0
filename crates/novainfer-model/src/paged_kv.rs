//! The physical KV pool: fixed-size blocks per layer, addressed by slot.
//!
//! The scheduler (in `novainfer-core`) decides which blocks a sequence owns and
//! hands us `slot_mapping` (where each new token's K/V goes) and `block_table`
//! (where a sequence's history lives). This module only owns the bytes:
//!
//! ```text
//!   layer l, values: [ block 0: slot 0 .. slot bs-1 | block 1: slot bs .. | ... ]
//!   one slot       =  [kv_head 0: one row | kv_head 1: one row | ...]
//!   slot of pos    =  block_table[pos / bs] * bs + pos % bs
//! ```
//! where a row is `head_dim` numbers in the pool's [`KvStorage`] (f32, f16, bf16 or q8_0).
//! Keys take the same bytes per slot, laid out as [`KeyLayout`] says: rows like the values,
//! or (f32/f16/bf16 with blocks a multiple of [`KEY_TILE`] slots) tiles of [`KEY_TILE`]
//! consecutive slots whose numbers lie side by side.

use crate::config::Qwen2Config;
use crate::error::{ModelError, Result};
use crate::kv_dtype::KvStorage;
use crate::large_buffer::LargeBuffer;

/// Slots per key tile ([`KeyLayout::Tiled`]).
pub(crate) const KEY_TILE: usize = 16;

/// How a pool lays out its keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum KeyLayout {
    /// Like the values: one row of `head_dim` numbers per (slot, KV head).
    Rows,
    /// Per KV head, the keys of [`KEY_TILE`] consecutive slots (from a multiple of
    /// [`KEY_TILE`]) side by side: number `d` of slot `s` at tile offset `KEY_TILE·d + s % KEY_TILE`
    /// ([`KvGeometry::key_tile_at`]). The same bytes as the rows, transposed.
    ///
    /// Why: a score is one dot product per position, and the attention kernel computes
    /// [`KEY_TILE`] (or 8) positions' at once, one number of each per vector lane; from rows it
    /// first had to transpose every tile of keys, which took more than a third of a decode
    /// step's attention (1.5B shape, depth 1,024, Xeon: 0.103 ms a layer, 0.065 without it).
    Tiled(TiledDtype),
}

/// The dtypes whose keys can be tiled: those of one number per element (a q8_0 block
/// shares a scale over 32 numbers of a row).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TiledDtype {
    F32,
    F16,
    Bf16,
}

impl TiledDtype {
    pub(crate) fn storage(self) -> KvStorage {
        match self {
            Self::F32 => KvStorage::F32,
            Self::F16 => KvStorage::F16,
            Self::Bf16 => KvStorage::Bf16,
        }
    }

    /// Bytes per number.
    pub(crate) fn size(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::Bf16 => 2,
        }
    }
}

/// Where a layer's rows lie in its K and V buffers.
#[derive(Clone, Copy, Debug)]
pub(crate) struct KvGeometry {
    pub(crate) dtype: KvStorage,
    pub(crate) block_size: usize,
    pub(crate) head_dim: usize,
    /// Bytes of one head's row, and of one slot (`num_kv_heads` rows).
    pub(crate) head_bytes: usize,
    pub(crate) slot_bytes: usize,
    pub(crate) keys: KeyLayout,
}

impl KvGeometry {
    /// Keys tiled wherever the dtype and the block size allow it.
    pub(crate) fn new(
        dtype: KvStorage,
        block_size: usize,
        head_dim: usize,
        num_kv_heads: usize,
    ) -> Self {
        let tiled = match dtype {
            KvStorage::F32 => Some(TiledDtype::F32),
            KvStorage::F16 => Some(TiledDtype::F16),
            KvStorage::Bf16 => Some(TiledDtype::Bf16),
            KvStorage::Q8_0 => None,
        };
        let keys = match tiled {
            Some(t) if block_size.is_multiple_of(KEY_TILE) => KeyLayout::Tiled(t),
            _ => KeyLayout::Rows,
        };
        let head_bytes = dtype.row_bytes(head_dim);
        Self {
            dtype,
            block_size,
            head_dim,
            head_bytes,
            slot_bytes: num_kv_heads * head_bytes,
            keys,
        }
    }

    /// Byte offset of the row of `slot`'s KV head `head` (values; keys laid out as rows).
    pub(crate) fn row_at(&self, slot: usize, head: usize) -> usize {
        slot * self.slot_bytes + head * self.head_bytes
    }

    /// Byte offset of the key tile of KV head `head` that holds `slot` ([`KeyLayout::Tiled`]):
    /// the tiles of a run of [`KEY_TILE`] slots take those slots' bytes, head after head.
    pub(crate) fn key_tile_at(&self, slot: usize, head: usize) -> usize {
        (slot - slot % KEY_TILE) * self.slot_bytes + head * KEY_TILE * self.head_bytes
    }

    /// Stores `src`, the key of `slot`'s KV head `head`, into a layer's key buffer.
    pub(crate) fn write_key(&self, buf: &mut [u8], slot: usize, head: usize, src: &[f32]) {
        match self.keys {
            KeyLayout::Rows => self.write_value(buf, slot, head, src),
            KeyLayout::Tiled(t) => {
                // Each number encoded alone into its lane: a tiled dtype encodes number by
                // number, so these are the rows layout's bits.
                let (size, lane) = (t.size(), slot % KEY_TILE);
                let tile = &mut buf[self.key_tile_at(slot, head)..][..KEY_TILE * self.head_bytes];
                for (d, x) in src.iter().enumerate() {
                    let at = (KEY_TILE * d + lane) * size;
                    self.dtype
                        .encode(std::slice::from_ref(x), &mut tile[at..at + size]);
                }
            }
        }
    }

    /// Stores `src`, the value of `slot`'s KV head `head`, into a layer's value buffer.
    pub(crate) fn write_value(&self, buf: &mut [u8], slot: usize, head: usize, src: &[f32]) {
        let at = self.row_at(slot, head);
        self.dtype.encode(src, &mut buf[at..at + self.head_bytes]);
    }

    /// The key of `slot`'s KV head `head`, decoded into `out` (`head_dim` numbers).
    #[cfg(test)]
    pub(crate) fn read_key(&self, buf: &[u8], slot: usize, head: usize, out: &mut [f32]) {
        match self.keys {
            KeyLayout::Rows => self.read_value(buf, slot, head, out),
            KeyLayout::Tiled(t) => {
                let (size, lane) = (t.size(), slot % KEY_TILE);
                let tile = &buf[self.key_tile_at(slot, head)..][..KEY_TILE * self.head_bytes];
                let row: Vec<u8> = (0..self.head_dim)
                    .flat_map(|d| &tile[(KEY_TILE * d + lane) * size..][..size])
                    .copied()
                    .collect();
                self.dtype.decode(&row, out);
            }
        }
    }

    /// The value of `slot`'s KV head `head`, decoded into `out` (`head_dim` numbers).
    #[cfg(test)]
    pub(crate) fn read_value(&self, buf: &[u8], slot: usize, head: usize, out: &mut [f32]) {
        let at = self.row_at(slot, head);
        self.dtype.decode(&buf[at..at + self.head_bytes], out);
    }
}

pub struct PagedKvCache {
    num_blocks: usize,
    num_kv_heads: usize,
    geo: KvGeometry,
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
        let geo = KvGeometry::new(dtype, block_size, cfg.head_dim(), cfg.num_key_value_heads);
        let bytes = num_blocks * block_size * geo.slot_bytes;
        let layers = (0..cfg.num_hidden_layers)
            .map(|_| LayerPool {
                k: LargeBuffer::zeroed(bytes),
                v: LargeBuffer::zeroed(bytes),
            })
            .collect();
        Self {
            num_blocks,
            num_kv_heads: cfg.num_key_value_heads,
            geo,
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
        self.geo.dtype
    }

    pub fn block_size(&self) -> usize {
        self.geo.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    pub fn num_slots(&self) -> usize {
        self.num_blocks * self.geo.block_size
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
        let (bs, sb) = (self.geo.block_size, self.geo.slot_bytes);
        if src.max(dst) >= self.num_blocks || num_tokens > bs {
            return Err(ModelError::config(
                "block_copies",
                format!(
                    "copy of {num_tokens} slots from block {src} to {dst} outside a pool of {} \
                     blocks of {}",
                    self.num_blocks, bs
                ),
            ));
        }
        let (from, to, len) = (src * bs * sb, dst * bs * sb, num_tokens * sb);
        // Tiled keys: whole tiles (the lanes past `num_tokens` are never weighed, and a
        // later write fills them number by number).
        let key_len = match self.geo.keys {
            KeyLayout::Rows => len,
            KeyLayout::Tiled(_) => num_tokens.next_multiple_of(KEY_TILE) * sb,
        };
        for pool in &mut self.layers {
            pool.k.copy_within(from..from + key_len, to);
            pool.v.copy_within(from..from + len, to);
        }
        Ok(())
    }

    /// Stores K and V rows `[slots.len(), num_kv_heads·head_dim]` of `layer` at `slots`,
    /// converted to the pool's dtype.
    pub(crate) fn write(&mut self, layer: usize, slots: &[usize], k: &[f32], v: &[f32]) {
        let geo = self.geo;
        let pool = &mut self.layers[layer];
        let hd = geo.head_dim;
        let row = self.num_kv_heads * hd;
        for (i, &slot) in slots.iter().enumerate() {
            let (ks, vs) = (&k[i * row..(i + 1) * row], &v[i * row..(i + 1) * row]);
            for (head, (kh, vh)) in ks.chunks_exact(hd).zip(vs.chunks_exact(hd)).enumerate() {
                geo.write_key(&mut pool.k, slot, head, kh);
                geo.write_value(&mut pool.v, slot, head, vh);
            }
        }
    }

    /// One layer of the pool as the attention kernel reads it.
    pub(crate) fn layer(&self, layer: usize) -> PoolLayer<'_> {
        PoolLayer {
            k: &self.layers[layer].k,
            v: &self.layers[layer].v,
            geo: self.geo,
        }
    }
}

/// One layer's keys and values, with the geometry needed to find a row.
#[derive(Clone, Copy)]
pub(crate) struct PoolLayer<'a> {
    pub(crate) k: &'a [u8],
    pub(crate) v: &'a [u8],
    pub(crate) geo: KvGeometry,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pool_past_a_huge_page_asks_for_huge_pages() {
        let cfg = config(2, 64);
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
        let mut one = vec![0f32; cfg.head_dim()];
        layer.geo.read_key(layer.k, last, 1, &mut one);
        assert!(one.iter().all(|&x| x == 1.5));
        layer.geo.read_value(layer.v, last, 1, &mut one);
        assert!(one.iter().all(|&x| x == -2.0));
    }

    fn config(num_kv_heads: usize, head_dim: usize) -> Qwen2Config {
        Qwen2Config {
            vocab_size: 8,
            hidden_size: 2 * num_kv_heads * head_dim,
            intermediate_size: 8,
            num_hidden_layers: 2,
            num_attention_heads: 2 * num_kv_heads,
            num_key_value_heads: num_kv_heads,
            max_position_embeddings: 1 << 20,
            rope_theta: 10_000.0,
            rms_norm_eps: 1e-6,
            tie_word_embeddings: false,
            torch_dtype: None,
            bos_token_id: None,
            eos_token_ids: vec![],
        }
    }

    /// Distinct numbers, exact in every dtype (small integers and halves).
    fn numbers(len: usize, seed: usize) -> Vec<f32> {
        (0..len)
            .map(|i| ((i * 7 + seed * 13) % 61) as f32 * 0.5 - 15.0)
            .collect()
    }

    #[test]
    fn keys_are_tiled_only_where_every_number_stands_alone_and_blocks_hold_whole_tiles() {
        for (dtype, bs, tiled) in [
            (KvStorage::F16, 16, true),
            (KvStorage::F32, 32, true),
            (KvStorage::Bf16, 256, true),
            (KvStorage::F16, 8, false),
            (KvStorage::F16, 24, false),
            (KvStorage::Q8_0, 16, false),
        ] {
            let geo = KvGeometry::new(dtype, bs, 64, 2);
            assert_eq!(
                matches!(geo.keys, KeyLayout::Tiled(_)),
                tiled,
                "{dtype:?} {bs}"
            );
        }
    }

    /// Every layout gives back the rows written, slot by slot and head by head, and a tiled
    /// pool holds the rows' own bytes, transposed per tile.
    #[test]
    fn every_layout_reads_back_what_was_written() {
        let (heads, hd) = (2, 32);
        for dtype in [
            KvStorage::F32,
            KvStorage::F16,
            KvStorage::Bf16,
            KvStorage::Q8_0,
        ] {
            for bs in [16, 32, 5] {
                let cfg = config(heads, hd);
                let mut pool = PagedKvCache::new(&cfg, 3, bs, dtype);
                let slots: Vec<usize> = (0..pool.num_slots()).rev().step_by(2).collect();
                let (k, v) = (
                    numbers(slots.len() * heads * hd, 1),
                    numbers(slots.len() * heads * hd, 2),
                );
                pool.write(1, &slots, &k, &v);
                let layer = pool.layer(1);
                let mut one = vec![0f32; hd];
                for (i, &slot) in slots.iter().enumerate() {
                    for h in 0..heads {
                        let want = |x: &[f32]| {
                            let mut row = vec![0u8; dtype.row_bytes(hd)];
                            let mut back = vec![0f32; hd];
                            dtype.encode(&x[(i * heads + h) * hd..][..hd], &mut row);
                            dtype.decode(&row, &mut back);
                            back
                        };
                        layer.geo.read_key(layer.k, slot, h, &mut one);
                        assert_eq!(one, want(&k), "{dtype:?} bs {bs} slot {slot} head {h}");
                        layer.geo.read_value(layer.v, slot, h, &mut one);
                        assert_eq!(one, want(&v), "{dtype:?} bs {bs} slot {slot} head {h}");
                    }
                }
                if let KeyLayout::Tiled(t) = layer.geo.keys {
                    // Number d of slot s of head h: its row's bytes, at lane s % 16 of line d.
                    let (slot, h, d) = (slots[3], 1, 5);
                    let mut row = vec![0u8; dtype.row_bytes(hd)];
                    dtype.encode(&k[(3 * heads + h) * hd..][..hd], &mut row);
                    let at = layer.geo.key_tile_at(slot, h) + (16 * d + slot % 16) * t.size();
                    assert_eq!(
                        &layer.k[at..at + t.size()],
                        &row[d * t.size()..(d + 1) * t.size()]
                    );
                }
            }
        }
    }

    /// A fork's copy of a partly filled block reads back the copied slots in either layout.
    #[test]
    fn copying_a_partly_filled_block_keeps_its_slots() {
        let (heads, hd) = (2, 32);
        for (dtype, bs) in [
            (KvStorage::F16, 32),
            (KvStorage::Q8_0, 16),
            (KvStorage::F32, 5),
        ] {
            let mut pool = PagedKvCache::new(&config(heads, hd), 2, bs, dtype);
            let filled = bs - 3;
            let slots: Vec<usize> = (0..filled).collect();
            let (k, v) = (
                numbers(filled * heads * hd, 3),
                numbers(filled * heads * hd, 4),
            );
            for layer in 0..2 {
                pool.write(layer, &slots, &k, &v);
            }
            pool.copy_block(0, 1, filled).expect("inside the pool");
            let (mut a, mut b) = (vec![0f32; hd], vec![0f32; hd]);
            for layer in 0..2 {
                let l = pool.layer(layer);
                for s in 0..filled {
                    for h in 0..heads {
                        l.geo.read_key(l.k, s, h, &mut a);
                        l.geo.read_key(l.k, bs + s, h, &mut b);
                        assert_eq!(a, b, "{dtype:?} layer {layer} slot {s} head {h}");
                        l.geo.read_value(l.v, s, h, &mut a);
                        l.geo.read_value(l.v, bs + s, h, &mut b);
                        assert_eq!(a, b, "{dtype:?} layer {layer} slot {s} head {h}");
                    }
                }
            }
        }
    }
}
