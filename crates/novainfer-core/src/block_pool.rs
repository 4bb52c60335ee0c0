//! The pool of physical KV blocks: refcounts, the LRU free queue and the prefix index.
//!
//! The pool only counts; the bytes live in the model's KV tensors.
//!
//! Invariants (checked by the tests and the scheduler proptest):
//! - `num_free_blocks() + num_used_blocks() == num_blocks()`;
//! - a block is in the free queue iff its refcount is 0;
//! - a cached hash maps to exactly one block (see [`PrefixIndex`]).
//!
//! The free queue's order *is* the eviction order. Free blocks keep their cached
//! content until they are handed out again, so a later request can still hit
//! them; [`BlockPool::allocate`] pops from the head and evicts whatever hash the
//! popped block held. Callers free a request's blocks tail first, so the end of a
//! sequence (least likely to be shared) is evicted before its prefix.
//!
//! ```text
//!   head (evict next)                                      tail (freed last)
//!   NIL ⇄ b7 ⇄ b3 ⇄ b9 ⇄ b1 ⇄ NIL       touch(b3): unlink in O(1), refcount 0 → 1
//! ```
//! The queue is a doubly linked list threaded through two `Vec<u32>` (`prev`,
//! `next`) indexed by block id, with slot `num_blocks` as the sentinel.

use crate::ids::BlockId;
use crate::kv_events::{KvEvent, KvEventLog};
use crate::prefix_hash::{BlockHash, BlockKey, PrefixIndex};

#[derive(Debug, Clone)]
pub struct BlockPool {
    ref_cnt: Vec<u32>,
    prev: Vec<u32>,
    next: Vec<u32>,
    num_free: usize,
    index: PrefixIndex,
    num_evictions: u64,
    /// What the prefix index gained and lost, for KV-cache event subscribers (off by default).
    events: KvEventLog,
}

impl BlockPool {
    /// A pool with every block free, queued in id order.
    ///
    /// Panics if `num_blocks` does not fit a [`BlockId`]; `SchedulerConfig` rejects that earlier.
    pub fn new(num_blocks: usize) -> Self {
        assert!(
            num_blocks < u32::MAX as usize,
            "block pool: {num_blocks} blocks do not fit a u32 block id"
        );
        let sentinel = num_blocks as u32;
        let mut pool = Self {
            ref_cnt: vec![0; num_blocks],
            prev: vec![sentinel; num_blocks + 1],
            next: vec![sentinel; num_blocks + 1],
            num_free: 0,
            index: PrefixIndex::new(num_blocks),
            num_evictions: 0,
            events: KvEventLog::default(),
        };
        for b in 0..num_blocks {
            pool.push_back(b as u32);
        }
        pool
    }

    pub fn num_blocks(&self) -> usize {
        self.ref_cnt.len()
    }
    pub fn num_free_blocks(&self) -> usize {
        self.num_free
    }
    pub fn num_used_blocks(&self) -> usize {
        self.num_blocks() - self.num_free
    }
    pub fn ref_count(&self, block: BlockId) -> u32 {
        self.ref_cnt[block.index()]
    }
    pub fn num_evictions(&self) -> u64 {
        self.num_evictions
    }
    pub fn num_cached_blocks(&self) -> usize {
        self.index.len()
    }
    pub fn is_cached(&self, block: BlockId) -> bool {
        self.index.is_cached(block)
    }

    /// The free queue from head (next to evict) to tail.
    pub fn free_queue(&self) -> Vec<BlockId> {
        let sentinel = self.sentinel();
        let mut out = Vec::with_capacity(self.num_free);
        let mut b = self.next[sentinel as usize];
        while b != sentinel {
            out.push(BlockId(b));
            b = self.next[b as usize];
        }
        out
    }

    /// Takes `n` blocks from the head of the free queue (refcount 1 each), evicting
    /// their cached content. `None`, with nothing changed, if fewer than `n` are free.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if n > self.num_free {
            return None;
        }
        let blocks = (0..n)
            .map(|_| {
                let b = self.next[self.sentinel() as usize];
                self.unlink(b);
                self.ref_cnt[b as usize] = 1;
                if let Some(hash) = self.index.remove_block(BlockId(b)) {
                    self.num_evictions += 1;
                    self.events.removed(hash);
                }
                BlockId(b)
            })
            .collect();
        Some(blocks)
    }

    /// Adds a holder to each block (a prefix hit or a fork); a free block leaves the queue.
    pub fn touch(&mut self, blocks: &[BlockId]) {
        for &b in blocks {
            if self.ref_cnt[b.index()] == 0 {
                self.unlink(b.0);
            }
            self.ref_cnt[b.index()] += 1;
        }
    }

    /// Drops one holder from each block, in the given order; blocks reaching 0 join
    /// the tail of the free queue in that order (so the first given is evicted first).
    pub fn free(&mut self, blocks: impl IntoIterator<Item = BlockId>) {
        for b in blocks {
            let rc = &mut self.ref_cnt[b.index()];
            *rc = rc
                .checked_sub(1)
                .expect("block pool: freeing a free block: this is a bug");
            if *rc == 0 {
                self.push_back(b.0);
            }
        }
    }

    /// How many of `blocks` are free now (a hit on them uses up free-queue room).
    pub fn num_free_among(&self, blocks: &[BlockId]) -> usize {
        blocks
            .iter()
            .filter(|b| self.ref_cnt[b.index()] == 0)
            .count()
    }

    /// The cached block holding exactly `key`, if any (verified, see [`PrefixIndex`]).
    pub fn lookup(&self, hash: BlockHash, key: &BlockKey<'_>) -> Option<BlockId> {
        self.index.get(hash, key)
    }

    /// Publishes a full, computed block under `hash`; false if it stays uncached.
    pub fn cache(&mut self, block: BlockId, hash: BlockHash, key: &BlockKey<'_>) -> bool {
        debug_assert!(self.ref_cnt[block.index()] > 0, "caching a free block");
        let cached = self.index.insert(block, hash, key);
        if cached {
            self.events.stored(hash, key);
        }
        cached
    }

    /// Forgets every cached hash. Refused (false) while any block is in use, because
    /// a running request may be about to publish blocks that the reset cannot see.
    pub fn reset_prefix_cache(&mut self) -> bool {
        if self.num_used_blocks() > 0 {
            return false;
        }
        self.index.clear();
        self.events.cleared();
        true
    }

    /// Starts recording KV-cache events (see [`crate::kv_events`]).
    pub fn enable_events(&mut self) {
        self.events.enable();
    }

    /// The KV-cache events since the last call, oldest first.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        self.events.take()
    }

    fn sentinel(&self) -> u32 {
        self.ref_cnt.len() as u32
    }

    fn push_back(&mut self, b: u32) {
        let s = self.sentinel();
        let last = self.prev[s as usize];
        self.next[last as usize] = b;
        self.prev[b as usize] = last;
        self.next[b as usize] = s;
        self.prev[s as usize] = b;
        self.num_free += 1;
    }

    fn unlink(&mut self, b: u32) {
        let (p, n) = (self.prev[b as usize], self.next[b as usize]);
        self.next[p as usize] = n;
        self.prev[n as usize] = p;
        self.num_free -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(v: &[u32]) -> Vec<BlockId> {
        v.iter().map(|&b| BlockId(b)).collect()
    }

    fn key(token_ids: &[u32]) -> BlockKey<'_> {
        BlockKey {
            parent: None,
            token_ids,
            extra_keys: &[],
        }
    }

    #[test]
    fn eviction_order_follows_free_order_and_hits_leave_the_queue() {
        let mut pool = BlockPool::new(6);
        let a = pool.allocate(3).unwrap();
        assert_eq!(a, ids(&[0, 1, 2]));
        let b = pool.allocate(2).unwrap();
        assert_eq!(b, ids(&[3, 4]));
        // Cache a's blocks, then free `a` tail first (as the manager does).
        for (i, &blk) in a.iter().enumerate() {
            let toks = [i as u32];
            assert!(pool.cache(blk, key(&toks).hash(), &key(&toks)));
        }
        pool.free(a.iter().rev().copied());
        assert_eq!(pool.free_queue(), ids(&[5, 2, 1, 0]));
        // A hit on block 1 removes it from the middle of the queue.
        assert_eq!(pool.lookup(key(&[1]).hash(), &key(&[1])), Some(BlockId(1)));
        pool.touch(&ids(&[1]));
        assert_eq!(pool.free_queue(), ids(&[5, 2, 0]));
        assert_eq!(pool.ref_count(BlockId(1)), 1);
        // Allocating two pops 5 (uncached) then 2 (cached: evicted).
        assert_eq!(pool.allocate(2).unwrap(), ids(&[5, 2]));
        assert_eq!(pool.num_evictions(), 1);
        assert_eq!(pool.lookup(key(&[2]).hash(), &key(&[2])), None);
        assert_eq!(pool.lookup(key(&[0]).hash(), &key(&[0])), Some(BlockId(0)));
        assert_eq!(pool.allocate(2), None, "only block 0 is free");
        assert_eq!(pool.num_free_blocks() + pool.num_used_blocks(), 6);
        pool.free(b);
        assert_eq!(pool.free_queue(), ids(&[0, 3, 4]));
    }

    #[test]
    fn shared_blocks_are_freed_by_their_last_holder() {
        let mut pool = BlockPool::new(2);
        let a = pool.allocate(1).unwrap();
        pool.touch(&a);
        assert_eq!(pool.ref_count(a[0]), 2);
        pool.free(a.clone());
        assert_eq!(pool.num_free_blocks(), 1);
        pool.free(a);
        assert_eq!(pool.num_free_blocks(), 2);
    }

    #[test]
    fn events_follow_the_prefix_index() {
        let mut pool = BlockPool::new(2);
        pool.enable_events();
        let a = pool.allocate(2).unwrap();
        let (k0, k1) = (key(&[1]), key(&[2]));
        assert!(pool.cache(a[0], k0.hash(), &k0));
        assert!(
            !pool.cache(a[1], k0.hash(), &k0),
            "a duplicate stays uncached: no event"
        );
        pool.free(a);
        // Reusing block 0 evicts its content; block 1 held nothing cached.
        let b = pool.allocate(2).unwrap();
        assert!(pool.cache(b[0], k1.hash(), &k1));
        pool.free(b);
        assert!(pool.reset_prefix_cache());
        let removed = KvEvent::BlockRemoved {
            block_hashes: vec![k0.hash()],
        };
        let stored = |k: &BlockKey<'_>| KvEvent::BlockStored {
            block_hashes: vec![k.hash()],
            parent: None,
            token_ids: k.token_ids.to_vec(),
            block_size: 1,
            lora_id: None,
        };
        assert_eq!(
            pool.take_events(),
            vec![stored(&k0), removed, stored(&k1), KvEvent::AllBlocksCleared]
        );
    }

    #[test]
    fn reset_is_refused_while_blocks_are_in_use() {
        let mut pool = BlockPool::new(2);
        let a = pool.allocate(1).unwrap();
        assert!(pool.cache(a[0], key(&[1]).hash(), &key(&[1])));
        assert!(!pool.reset_prefix_cache());
        assert_eq!(pool.num_cached_blocks(), 1);
        pool.free(a);
        assert!(pool.reset_prefix_cache());
        assert_eq!(pool.num_cached_blocks(), 0);
    }
}
