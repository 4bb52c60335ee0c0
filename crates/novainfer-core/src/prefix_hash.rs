//! Content hashes of full KV blocks and the index from hash to cached block.
//!
//! A block's hash covers its parent's hash, its token ids and any extra keys
//! (LoRA id, cache salt, ...), so equal hashes mean equal *prefixes*, not just
//! equal blocks:
//!
//! ```text
//!   tokens:  [ t0 .. t15 ][ t16 .. t31 ][ t32 .. t40 ]      block_size = 16
//!   hash:       h0 = H(None, t0..t15)
//!                            h1 = H(h0, t16..t31)
//!                                          (partial: never hashed)
//! ```
//!
//! Invariants of [`PrefixIndex`]:
//! - a hash maps to at most one block and that block maps back to the hash;
//! - the index stores the exact key (parent hash, token ids, extra keys) that was
//!   hashed, and [`PrefixIndex::get`] compares it, so a 64-bit collision is a miss,
//!   never wrong KV. Because the parent hash is compared too and each parent was
//!   itself verified when it was looked up, a whole chain of hits is verified.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::ids::BlockId;

/// Fixed so hashes are stable across runs and processes (a router may compare them).
const HASH_SEED: u64 = 0x4e6f_7661_496e_6665; // "NovaInfe"

/// 64-bit xxh3 of a block's [`BlockKey`]; the parent link lives inside the hashed bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockHash(pub u64);

/// What a full block's hash is computed from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockKey<'a> {
    /// `None` for the first block of a sequence.
    pub parent: Option<BlockHash>,
    pub token_ids: &'a [u32],
    pub extra_keys: &'a [u64],
}

impl BlockKey<'_> {
    /// `hash(parent_hash, block_token_ids, extra_keys)`, with lengths mixed in so
    /// that moving a value from one field to the next changes the hash.
    pub fn hash(&self) -> BlockHash {
        let mut bytes =
            Vec::with_capacity(9 + 16 + 4 * self.token_ids.len() + 8 * self.extra_keys.len());
        match self.parent {
            None => bytes.push(0),
            Some(BlockHash(h)) => {
                bytes.push(1);
                bytes.extend_from_slice(&h.to_le_bytes());
            }
        }
        bytes.extend_from_slice(&(self.token_ids.len() as u64).to_le_bytes());
        for t in self.token_ids {
            bytes.extend_from_slice(&t.to_le_bytes());
        }
        bytes.extend_from_slice(&(self.extra_keys.len() as u64).to_le_bytes());
        for k in self.extra_keys {
            bytes.extend_from_slice(&k.to_le_bytes());
        }
        BlockHash(xxh3_64_with_seed(&bytes, HASH_SEED))
    }
}

/// The owned copy of a [`BlockKey`], kept to verify hits.
#[derive(Debug, Clone)]
struct StoredKey {
    hash: BlockHash,
    parent: Option<BlockHash>,
    token_ids: Box<[u32]>,
    extra_keys: Box<[u64]>,
}

impl StoredKey {
    fn matches(&self, key: &BlockKey<'_>) -> bool {
        self.parent == key.parent
            && *self.token_ids == *key.token_ids
            && *self.extra_keys == *key.extra_keys
    }
}

/// Keys are already xxh3 outputs: hashing them again (SipHash) only costs time.
#[derive(Debug, Default, Clone, Copy)]
struct PassThrough(u64);

impl Hasher for PassThrough {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Only `write_u64` is expected; fold anything else in so it stays correct.
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

/// Hash → block for full blocks whose KV is computed. Knows nothing about refcounts.
#[derive(Debug, Clone)]
pub struct PrefixIndex {
    by_hash: HashMap<BlockHash, BlockId, BuildHasherDefault<PassThrough>>,
    by_block: Vec<Option<StoredKey>>,
}

impl PrefixIndex {
    pub fn new(num_blocks: usize) -> Self {
        Self {
            by_hash: HashMap::default(),
            by_block: vec![None; num_blocks],
        }
    }

    /// The cached block holding exactly `key`, if any.
    pub fn get(&self, hash: BlockHash, key: &BlockKey<'_>) -> Option<BlockId> {
        let block = *self.by_hash.get(&hash)?;
        let stored = self.by_block[block.index()]
            .as_ref()
            .expect("prefix index: hash maps to an uncached block: this is a bug");
        stored.matches(key).then_some(block)
    }

    /// Records that `block` holds `key`. Returns false (and changes nothing) when the
    /// block is already cached or another block already owns the hash (the same
    /// prefix computed twice, or a collision): the block then simply stays uncached.
    pub fn insert(&mut self, block: BlockId, hash: BlockHash, key: &BlockKey<'_>) -> bool {
        if self.by_block[block.index()].is_some() || self.by_hash.contains_key(&hash) {
            return false;
        }
        self.by_hash.insert(hash, block);
        self.by_block[block.index()] = Some(StoredKey {
            hash,
            parent: key.parent,
            token_ids: key.token_ids.into(),
            extra_keys: key.extra_keys.into(),
        });
        true
    }

    /// Forgets `block`'s content (it is about to be overwritten). Its hash if it was cached.
    pub fn remove_block(&mut self, block: BlockId) -> Option<BlockHash> {
        let stored = self.by_block[block.index()].take()?;
        let owner = self.by_hash.remove(&stored.hash);
        assert_eq!(
            owner,
            Some(block),
            "prefix index: block and hash maps disagree: this is a bug"
        );
        Some(stored.hash)
    }

    pub fn hash_of(&self, block: BlockId) -> Option<BlockHash> {
        self.by_block[block.index()].as_ref().map(|s| s.hash)
    }

    pub fn is_cached(&self, block: BlockId) -> bool {
        self.by_block[block.index()].is_some()
    }

    /// Number of cached blocks.
    pub fn len(&self) -> usize {
        self.by_hash.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_hash.is_empty()
    }

    pub fn clear(&mut self) {
        self.by_hash.clear();
        self.by_block.iter_mut().for_each(|s| *s = None);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key<'a>(parent: Option<BlockHash>, token_ids: &'a [u32]) -> BlockKey<'a> {
        BlockKey {
            parent,
            token_ids,
            extra_keys: &[],
        }
    }

    #[test]
    fn hash_depends_on_parent_tokens_and_extra_keys() {
        let base = key(None, &[1, 2, 3]).hash();
        assert_eq!(
            base,
            key(None, &[1, 2, 3]).hash(),
            "hash must be deterministic"
        );
        assert_ne!(base, key(Some(BlockHash(0)), &[1, 2, 3]).hash());
        assert_ne!(base, key(None, &[1, 2, 4]).hash());
        let salted = BlockKey {
            extra_keys: &[7],
            ..key(None, &[1, 2, 3])
        };
        assert_ne!(base, salted.hash());
    }

    #[test]
    fn a_colliding_hash_with_other_tokens_is_a_miss() {
        let mut index = PrefixIndex::new(4);
        let forced = BlockHash(42);
        assert!(index.insert(BlockId(2), forced, &key(None, &[1, 2])));
        assert_eq!(index.get(forced, &key(None, &[1, 2])), Some(BlockId(2)));
        assert_eq!(index.get(forced, &key(None, &[9, 9])), None);
        assert_eq!(index.get(forced, &key(Some(BlockHash(1)), &[1, 2])), None);
        // The hash is taken: a second block with it stays uncached.
        assert!(!index.insert(BlockId(3), forced, &key(None, &[9, 9])));
        assert!(!index.is_cached(BlockId(3)));
        assert_eq!(index.remove_block(BlockId(2)), Some(forced));
        assert_eq!(index.get(forced, &key(None, &[1, 2])), None);
        assert!(index.is_empty());
    }
}
