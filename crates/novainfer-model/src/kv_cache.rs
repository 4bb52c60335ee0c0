//! A per-sequence KV cache for running one sequence on its own (tests, the
//! reference checks, the probe). It is the paged pool with a single block as
//! large as the sequence may grow, so there is one forward path for both.

use crate::config::Qwen2Config;
use crate::error::{ModelError, Result};
use crate::kv_dtype::KvStorage;
use crate::paged_kv::PagedKvCache;

pub struct SequenceKvCache {
    pub(crate) pool: PagedKvCache,
    len: usize,
}

impl SequenceKvCache {
    /// An empty cache for up to `capacity` tokens stored as `dtype`. The buffers are
    /// zero-initialised allocations, so untouched capacity costs address space, not memory.
    pub fn new(cfg: &Qwen2Config, capacity: usize, dtype: KvStorage) -> Self {
        Self {
            pool: PagedKvCache::new(cfg, 1, capacity.max(1), dtype),
            len: 0,
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
        self.pool.block_size()
    }

    /// Fails before any work when `new_tokens` more would not fit.
    pub fn reserve(&self, new_tokens: usize) -> Result<()> {
        let needed = self.len + new_tokens;
        if needed > self.capacity() {
            return Err(ModelError::ContextOverflow {
                needed,
                capacity: self.capacity(),
            });
        }
        Ok(())
    }

    /// Makes the `rows` tokens written by the last forward part of the history.
    pub(crate) fn advance(&mut self, rows: usize) {
        self.len += rows;
    }
}
