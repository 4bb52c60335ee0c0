//! A contiguous per-sequence KV cache: the simple layout used for one sequence
//! at a time. Rows are `[pos][kv_head][head_dim]`, one buffer per layer for keys
//! and one for values; positions `0..len` are valid.

use crate::config::Qwen2Config;
use crate::error::{ModelError, Result};
use crate::layers::KvView;

pub struct SequenceKvCache {
    layers: Vec<LayerKv>,
    len: usize,
    capacity: usize,
    row: usize,
    head_dim: usize,
}

struct LayerKv {
    k: Vec<f32>,
    v: Vec<f32>,
}

pub struct LayerView<'a> {
    kv: &'a LayerKv,
    row: usize,
    head_dim: usize,
}

impl KvView for LayerView<'_> {
    fn key(&self, pos: usize, kv_head: usize) -> &[f32] {
        let start = pos * self.row + kv_head * self.head_dim;
        &self.kv.k[start..start + self.head_dim]
    }

    fn value(&self, pos: usize, kv_head: usize) -> &[f32] {
        let start = pos * self.row + kv_head * self.head_dim;
        &self.kv.v[start..start + self.head_dim]
    }
}

impl SequenceKvCache {
    /// An empty cache that can hold up to `capacity` tokens; memory grows as tokens arrive.
    pub fn new(cfg: &Qwen2Config, capacity: usize) -> Self {
        let layers = (0..cfg.num_hidden_layers)
            .map(|_| LayerKv {
                k: Vec::new(),
                v: Vec::new(),
            })
            .collect();
        let head_dim = cfg.head_dim();
        Self {
            layers,
            len: 0,
            capacity,
            row: cfg.num_key_value_heads * head_dim,
            head_dim,
        }
    }

    /// Tokens whose keys and values are cached.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Fails before any work when `new_tokens` more would not fit.
    pub fn reserve(&self, new_tokens: usize) -> Result<()> {
        let needed = self.len + new_tokens;
        if needed > self.capacity {
            return Err(ModelError::ContextOverflow {
                needed,
                capacity: self.capacity,
            });
        }
        Ok(())
    }

    /// Stores keys and values `[rows, kv_heads·head_dim]` for positions `len..len+rows` of `layer`.
    pub(crate) fn write(&mut self, layer: usize, k: &[f32], v: &[f32]) {
        let kv = &mut self.layers[layer];
        let start = self.len * self.row;
        kv.k.truncate(start);
        kv.v.truncate(start);
        kv.k.extend_from_slice(k);
        kv.v.extend_from_slice(v);
    }

    pub(crate) fn view(&self, layer: usize) -> LayerView<'_> {
        LayerView {
            kv: &self.layers[layer],
            row: self.row,
            head_dim: self.head_dim,
        }
    }

    /// Makes the `rows` tokens written by the last forward part of the history.
    pub(crate) fn advance(&mut self, rows: usize) {
        self.len += rows;
    }

    /// Forgets everything from `len` on (e.g. to re-run a prompt suffix).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }
}
