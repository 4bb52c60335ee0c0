//! Per-request block tables over one [`BlockPool`], with prefix caching.
//!
//! The manager turns "this request will have N computed tokens" into blocks:
//! a request at `num_computed_tokens + num_new_tokens` tokens holds
//! `ceil(that / block_size)` blocks, the first of which may be shared.
//!
//! Prefix caching: a full block whose tokens are all computed is published in the
//! pool's [`PrefixIndex`](crate::prefix_hash::PrefixIndex) by
//! [`cache_full_blocks`](KvCacheManager::cache_full_blocks) (called after each step,
//! so a block is only ever shared once its KV has been written). A new request's
//! [`lookup_prefix`](KvCacheManager::lookup_prefix) walks its full blocks through
//! the index and stops at the first miss; [`allocate_slots`](KvCacheManager::allocate_slots)
//! then takes a reference on each hit block. A hit never covers the request's last
//! token: that one is always computed so the model produces logits to sample from.
//! Blocks with more than one holder are always full and computed, so nobody writes to them.
//!
//! `n > 1` sampling: [`fork`](KvCacheManager::fork) gives a child request the
//! parent's full blocks by refcount and a fresh block as the copy target for a
//! partial last block (the model copies those slots). Children created later
//! without `fork` still share the prompt through the prefix index, at the cost
//! of recomputing the partial last block.
//!
//! Extra keys: a request's LoRA adapter id ([`Request::cache_keys`]), so two adapters (or
//! an adapter and the base model) never share KV.

use std::borrow::Cow;
use std::collections::HashMap;

use crate::block_pool::BlockPool;
use crate::ids::{BlockId, RequestId};
use crate::prefix_hash::{BlockHash, BlockKey};
use crate::request::Request;

/// The cached prefix found for a request, not yet referenced: pass it to
/// [`KvCacheManager::allocate_slots`] in the same scheduling step.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PrefixHit {
    pub blocks: Vec<BlockId>,
    /// `blocks.len() * block_size`: the tokens whose compute is skipped.
    pub num_tokens: usize,
    block_hashes: Vec<BlockHash>,
}

impl PrefixHit {
    pub fn none() -> Self {
        Self::default()
    }
}

/// Blocks newly taken from the free queue by one [`KvCacheManager::allocate_slots`].
#[derive(Debug, Clone, PartialEq)]
pub struct NewBlocks {
    pub block_ids: Vec<BlockId>,
}

/// What [`KvCacheManager::fork`] asks the model to do: copy the parent's partial
/// last block into the child's own block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockCopy {
    pub src: BlockId,
    pub dst: BlockId,
    /// Slots `0..num_tokens` of the block are valid.
    pub num_tokens: usize,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KvCacheStats {
    pub num_blocks: usize,
    pub num_used_blocks: usize,
    pub num_free_blocks: usize,
    /// Most blocks ever in use at once.
    pub watermark_blocks: usize,
    pub num_cached_blocks: usize,
    /// Admissions that consulted the prefix cache (a resumed request counts again).
    pub num_queries: u64,
    pub num_query_tokens: u64,
    pub num_hit_blocks: u64,
    /// Tokens served from the cache instead of computed: the saved work.
    pub num_hit_tokens: u64,
    pub num_evictions: u64,
}

#[derive(Debug, Clone, Default)]
struct RequestBlocks {
    blocks: Vec<BlockId>,
    /// Hashes of `blocks[..block_hashes.len()]`, all full and computed.
    block_hashes: Vec<BlockHash>,
}

type Hasher = fn(&BlockKey<'_>) -> BlockHash;

#[derive(Debug, Clone)]
pub struct KvCacheManager {
    block_size: usize,
    enable_prefix_caching: bool,
    pool: BlockPool,
    tables: HashMap<RequestId, RequestBlocks>,
    stats: KvCacheStats,
    hasher: Hasher,
}

impl KvCacheManager {
    pub fn new(num_blocks: usize, block_size: usize, enable_prefix_caching: bool) -> Self {
        assert!(block_size > 0, "block_size must be >= 1: this is a bug");
        Self {
            block_size,
            enable_prefix_caching,
            pool: BlockPool::new(num_blocks),
            tables: HashMap::new(),
            stats: KvCacheStats::default(),
            hasher: |key| key.hash(),
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// This request's blocks, in position order; empty if it holds none.
    pub fn block_table(&self, request_id: RequestId) -> &[BlockId] {
        self.tables
            .get(&request_id)
            .map_or(&[][..], |t| t.blocks.as_slice())
    }

    /// Every request holding blocks, with its table.
    pub fn block_tables(&self) -> impl Iterator<Item = (RequestId, &[BlockId])> {
        self.tables.iter().map(|(&id, t)| (id, t.blocks.as_slice()))
    }

    pub fn stats(&self) -> KvCacheStats {
        KvCacheStats {
            num_blocks: self.pool.num_blocks(),
            num_used_blocks: self.pool.num_used_blocks(),
            num_free_blocks: self.pool.num_free_blocks(),
            num_cached_blocks: self.pool.num_cached_blocks(),
            num_evictions: self.pool.num_evictions(),
            ..self.stats
        }
    }

    /// The longest cached prefix of `request`'s tokens, in whole blocks, leaving
    /// at least the last token to compute. Empty when caching is off or the
    /// request already holds blocks.
    pub fn lookup_prefix(&self, request: &Request) -> PrefixHit {
        if !self.enable_prefix_caching || self.tables.contains_key(&request.id) {
            return PrefixHit::none();
        }
        let max_blocks = request.num_tokens().saturating_sub(1) / self.block_size;
        let mut hit = PrefixHit::none();
        for i in 0..max_blocks {
            let token_ids = self.block_tokens(request, i);
            let key = BlockKey {
                parent: hit.block_hashes.last().copied(),
                token_ids: &token_ids,
                extra_keys: request.cache_keys(),
            };
            let hash = (self.hasher)(&key);
            match self.pool.lookup(hash, &key) {
                Some(block) => {
                    hit.blocks.push(block);
                    hit.block_hashes.push(hash);
                }
                None => break,
            }
        }
        hit.num_tokens = hit.blocks.len() * self.block_size;
        hit
    }

    /// Makes room for `num_new_tokens` more tokens after `request.num_computed_tokens`
    /// (plus `prefix_hit`, which must come from `lookup_prefix` on a request holding
    /// no blocks). `None`, with nothing changed, if the pool is out of room.
    pub fn allocate_slots(
        &mut self,
        request: &Request,
        num_new_tokens: usize,
        prefix_hit: &PrefixHit,
    ) -> Option<NewBlocks> {
        let num_held = self.block_table(request.id).len();
        debug_assert!(
            prefix_hit.blocks.is_empty() || num_held == 0,
            "a prefix hit for a request that already holds blocks"
        );
        let num_tokens = request.num_computed_tokens + prefix_hit.num_tokens + num_new_tokens;
        let num_needed = num_tokens.div_ceil(self.block_size);
        let num_new_blocks = num_needed.saturating_sub(num_held + prefix_hit.blocks.len());
        // Hit blocks sitting in the free queue leave it, so they cannot also be allocated.
        let num_available =
            self.pool.num_free_blocks() - self.pool.num_free_among(&prefix_hit.blocks);
        if num_new_blocks > num_available {
            return None;
        }
        self.pool.touch(&prefix_hit.blocks);
        let new = self
            .pool
            .allocate(num_new_blocks)
            .expect("allocate_slots: room was checked: this is a bug");
        let is_admission = !self.tables.contains_key(&request.id);
        let table = self.tables.entry(request.id).or_default();
        table.blocks.extend_from_slice(&prefix_hit.blocks);
        table
            .block_hashes
            .extend_from_slice(&prefix_hit.block_hashes);
        table.blocks.extend_from_slice(&new);
        if is_admission && self.enable_prefix_caching {
            self.stats.num_queries += 1;
            self.stats.num_query_tokens += request.num_tokens() as u64;
            self.stats.num_hit_blocks += prefix_hit.blocks.len() as u64;
            self.stats.num_hit_tokens += prefix_hit.num_tokens as u64;
        }
        self.stats.watermark_blocks = self.stats.watermark_blocks.max(self.pool.num_used_blocks());
        Some(NewBlocks { block_ids: new })
    }

    /// Publishes every full block of `request` whose tokens are all computed.
    pub fn cache_full_blocks(&mut self, request: &Request) {
        if !self.enable_prefix_caching {
            return;
        }
        let Some(mut table) = self.tables.remove(&request.id) else {
            return;
        };
        let num_full = (request.num_computed_tokens / self.block_size).min(table.blocks.len());
        for i in table.block_hashes.len()..num_full {
            let token_ids = self.block_tokens(request, i);
            let key = BlockKey {
                parent: table.block_hashes.last().copied(),
                token_ids: &token_ids,
                extra_keys: request.cache_keys(),
            };
            let hash = (self.hasher)(&key);
            self.pool.cache(table.blocks[i], hash, &key);
            table.block_hashes.push(hash);
        }
        self.tables.insert(request.id, table);
    }

    /// Releases the request's blocks, tail first so its prefix is evicted last.
    /// False if it held none.
    pub fn free(&mut self, request_id: RequestId) -> bool {
        match self.tables.remove(&request_id) {
            Some(table) => {
                self.pool.free(table.blocks.into_iter().rev());
                true
            }
            None => false,
        }
    }

    /// Gives `child` the parent's full computed blocks (shared by refcount) and,
    /// if the parent's last computed block is partial, a fresh block to copy it
    /// into. The caller sets the child's `num_computed_tokens` to the parent's.
    /// `None`, with nothing changed, if no block is free for the copy.
    pub fn fork(&mut self, parent: &Request, child: RequestId) -> Option<Option<BlockCopy>> {
        assert!(
            !self.tables.contains_key(&child),
            "fork: child {child} already holds blocks: this is a bug"
        );
        let table = self.tables.get(&parent.id)?;
        let num_full = parent.num_computed_tokens / self.block_size;
        let num_partial = parent.num_computed_tokens % self.block_size;
        let shared = table.blocks[..num_full].to_vec();
        let src = (num_partial > 0).then(|| table.blocks[num_full]);
        let block_hashes = table.block_hashes[..table.block_hashes.len().min(num_full)].to_vec();
        let copy = match src {
            Some(src) => {
                let dst = self.pool.allocate(1)?[0];
                Some(BlockCopy {
                    src,
                    dst,
                    num_tokens: num_partial,
                })
            }
            None => None,
        };
        self.pool.touch(&shared);
        let mut blocks = shared;
        blocks.extend(copy.map(|c| c.dst));
        self.tables.insert(
            child,
            RequestBlocks {
                blocks,
                block_hashes,
            },
        );
        self.stats.watermark_blocks = self.stats.watermark_blocks.max(self.pool.num_used_blocks());
        Some(copy)
    }

    /// Forgets every cached prefix; refused (false) while any block is in use.
    pub fn reset_prefix_cache(&mut self) -> bool {
        self.pool.reset_prefix_cache()
    }

    /// Starts recording KV-cache events (see [`crate::kv_events`]).
    pub fn enable_kv_events(&mut self) {
        self.pool.enable_events();
    }

    /// The KV-cache events since the last call, oldest first.
    pub fn take_kv_events(&mut self) -> Vec<crate::kv_events::KvEvent> {
        self.pool.take_events()
    }

    /// Block `i`'s tokens: borrowed when it lies inside the prompt, else gathered.
    fn block_tokens<'r>(&self, request: &'r Request, i: usize) -> Cow<'r, [u32]> {
        let range = i * self.block_size..(i + 1) * self.block_size;
        match request.prompt_token_ids.get(range.clone()) {
            Some(slice) => Cow::Borrowed(slice),
            None => Cow::Owned(request.token_ids(range)),
        }
    }

    #[cfg(test)]
    fn set_hasher(&mut self, hasher: Hasher) {
        self.hasher = hasher;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(v: &[u32]) -> Vec<BlockId> {
        v.iter().map(|&b| BlockId(b)).collect()
    }

    /// Allocates for the whole prompt, marks it computed and publishes its blocks.
    fn prefill(kv: &mut KvCacheManager, id: u64, prompt: Vec<u32>) -> Request {
        let mut r = Request::new(RequestId(id), prompt, 4);
        let hit = kv.lookup_prefix(&r);
        let n = r.num_tokens() - hit.num_tokens;
        kv.allocate_slots(&r, n, &hit).expect("room");
        r.num_computed_tokens = r.num_tokens();
        kv.cache_full_blocks(&r);
        r
    }

    #[test]
    fn a_shared_two_block_prefix_hits_exactly_those_blocks() {
        let mut kv = KvCacheManager::new(10, 4, true);
        let a = prefill(&mut kv, 1, (0..10).collect());
        assert_eq!(kv.block_table(a.id), ids(&[0, 1, 2]));
        let b = Request::new(
            RequestId(2),
            [&a.prompt_token_ids[..8], &[100, 101, 102]].concat(),
            4,
        );
        let hit = kv.lookup_prefix(&b);
        assert_eq!((hit.blocks.clone(), hit.num_tokens), (ids(&[0, 1]), 8));
        let new = kv.allocate_slots(&b, 3, &hit).unwrap();
        assert_eq!(new.block_ids, ids(&[3]));
        assert_eq!(kv.block_table(b.id), ids(&[0, 1, 3]));
        let rc: Vec<u32> = (0..4).map(|b| kv.pool().ref_count(BlockId(b))).collect();
        assert_eq!(rc, vec![2, 2, 1, 1]);
        let s = kv.stats();
        assert_eq!(
            (s.num_queries, s.num_hit_blocks, s.num_hit_tokens),
            (2, 2, 8)
        );
        assert_eq!(s.num_query_tokens, 21);
    }

    #[test]
    fn a_prompt_of_exactly_full_blocks_still_computes_its_last_token() {
        let mut kv = KvCacheManager::new(10, 4, true);
        let a = prefill(&mut kv, 1, (0..8).collect());
        let b = Request::new(RequestId(2), a.prompt_token_ids.clone(), 4);
        let hit = kv.lookup_prefix(&b);
        assert_eq!((hit.blocks, hit.num_tokens), (ids(&[0]), 4));
    }

    #[test]
    fn a_hash_collision_is_not_a_hit() {
        let mut kv = KvCacheManager::new(10, 2, true);
        kv.set_hasher(|_| BlockHash(7));
        let a = prefill(&mut kv, 1, vec![1, 2, 3, 4, 5]);
        assert_eq!(
            kv.pool().num_cached_blocks(),
            1,
            "the second block's hash was taken"
        );
        let other = Request::new(RequestId(2), vec![9, 9, 3, 4, 5], 4);
        assert_eq!(kv.lookup_prefix(&other), PrefixHit::none());
        let same_first = Request::new(RequestId(3), vec![1, 2, 3, 4, 5], 4);
        assert_eq!(
            kv.lookup_prefix(&same_first).blocks,
            kv.block_table(a.id)[..1]
        );
    }

    #[test]
    fn reset_is_refused_while_blocks_are_in_use() {
        let mut kv = KvCacheManager::new(4, 2, true);
        let a = prefill(&mut kv, 1, vec![1, 2, 3]);
        assert!(!kv.reset_prefix_cache());
        let b = Request::new(RequestId(2), vec![1, 2, 3], 4);
        assert_eq!(kv.lookup_prefix(&b).num_tokens, 2);
        assert!(kv.free(a.id));
        assert!(kv.reset_prefix_cache());
        assert_eq!(kv.lookup_prefix(&b), PrefixHit::none());
    }

    #[test]
    fn out_of_room_changes_nothing() {
        let mut kv = KvCacheManager::new(3, 2, true);
        prefill(&mut kv, 1, vec![1, 2, 3, 4]);
        let b = Request::new(RequestId(2), vec![5, 6, 7], 4);
        assert_eq!(kv.allocate_slots(&b, 3, &PrefixHit::none()), None);
        assert_eq!(kv.block_table(b.id), &[][..]);
        assert_eq!(kv.pool().num_free_blocks(), 1);
    }

    #[test]
    fn free_hit_blocks_count_against_room_and_eviction_skips_them() {
        let mut kv = KvCacheManager::new(3, 4, true);
        let a = prefill(&mut kv, 1, (0..9).collect());
        kv.free(a.id);
        assert_eq!(kv.pool().free_queue(), ids(&[2, 1, 0]), "tail freed first");
        let b = Request::new(RequestId(2), [&a.prompt_token_ids[..8], &[50]].concat(), 4);
        let hit = kv.lookup_prefix(&b);
        assert_eq!(hit.blocks, ids(&[0, 1]));
        // 2 hit blocks + 2 new would need 4: refused although 3 are "free".
        assert_eq!(kv.allocate_slots(&b, 5, &hit), None);
        assert_eq!(kv.allocate_slots(&b, 1, &hit).unwrap().block_ids, ids(&[2]));
        assert_eq!(kv.block_table(b.id), ids(&[0, 1, 2]));
        assert_eq!(
            kv.stats().num_evictions,
            0,
            "block 2 was partial, never cached"
        );
    }

    #[test]
    fn allocating_a_cached_free_block_evicts_it() {
        let mut kv = KvCacheManager::new(2, 2, true);
        let a = prefill(&mut kv, 1, vec![1, 2, 3]);
        kv.free(a.id);
        let b = prefill(&mut kv, 2, vec![7, 8, 9, 10]);
        assert_eq!(kv.block_table(b.id), ids(&[1, 0]));
        assert_eq!(kv.stats().num_evictions, 1);
        let c = Request::new(RequestId(3), vec![1, 2, 3], 4);
        assert_eq!(kv.lookup_prefix(&c), PrefixHit::none());
    }

    #[test]
    fn fork_shares_full_blocks_and_copies_the_partial_one() {
        let mut kv = KvCacheManager::new(5, 4, true);
        let a = prefill(&mut kv, 1, (0..6).collect());
        let copy = kv.fork(&a, RequestId(2)).unwrap().unwrap();
        assert_eq!(
            copy,
            BlockCopy {
                src: BlockId(1),
                dst: BlockId(2),
                num_tokens: 2
            }
        );
        assert_eq!(kv.block_table(RequestId(2)), ids(&[0, 2]));
        assert_eq!(kv.pool().ref_count(BlockId(0)), 2);
        kv.free(a.id);
        kv.free(RequestId(2));
        assert_eq!(kv.pool().num_free_blocks(), 5);
    }

    #[test]
    fn disabled_prefix_caching_never_hits() {
        let mut kv = KvCacheManager::new(10, 2, false);
        let a = prefill(&mut kv, 1, vec![1, 2, 3]);
        let b = Request::new(RequestId(2), a.prompt_token_ids.clone(), 4);
        assert_eq!(kv.lookup_prefix(&b), PrefixHit::none());
        assert_eq!(kv.pool().num_cached_blocks(), 0);
    }
}
