//! What the scheduler asks of a KV layout, and the layouts it can run on.
//!
//! The scheduler only ever thinks in "tables": a request's KV positions
//! `0..n` live in `block_table[pos / block_size]`. The BLOCK layout
//! ([`KvCacheManager`]) hands out blocks of `block_size` tokens with prefix
//! caching; the SLOT layout ([`SlotKvManager`]) hands out single cells
//! (llama.cpp-style, `block_size` is 1), so a table is the sequence's cells in
//! position order and the model reads both layouts the same way.
//!
//! [`AnyKv`] is the scheduler's field: an enum rather than a `Box<dyn>` so the
//! scheduler stays `Clone` (its benchmark clones it) and calls stay static.

use std::fmt;
use std::str::FromStr;

use crate::ids::{BlockId, RequestId};
use crate::kv_cache_manager::{BlockCopy, KvCacheManager, KvCacheStats, NewBlocks, PrefixHit};
use crate::request::Request;
use crate::sampling_params::ParamError;
use crate::slot_kv_manager::SlotKvManager;

/// The contract between the scheduler and a KV layout. Every method's meaning
/// is the one documented on [`KvCacheManager`]; a layout without prefix caching
/// returns [`PrefixHit::none`] from `lookup_prefix` and ignores `cache_full_blocks`.
pub trait KvManager {
    /// Tokens per table entry.
    fn block_size(&self) -> usize;
    fn lookup_prefix(&self, request: &Request) -> PrefixHit;
    /// Room for `num_new_tokens` more tokens; `None`, with nothing changed, if out of room.
    fn allocate_slots(
        &mut self,
        request: &Request,
        num_new_tokens: usize,
        prefix_hit: &PrefixHit,
    ) -> Option<NewBlocks>;
    fn cache_full_blocks(&mut self, request: &Request);
    /// Gives `child` (holding nothing) the KV of `parent`'s first
    /// `parent.num_computed_tokens` positions, shared where the layout can share
    /// and otherwise as a [`BlockCopy`] the model must run before its next step.
    /// `None`, with nothing changed, if out of room.
    fn fork(&mut self, parent: &Request, child: RequestId) -> Option<Option<BlockCopy>>;
    /// Releases everything the request holds; false if it held nothing.
    fn free(&mut self, request_id: RequestId) -> bool;
    /// The request's table in position order; empty if it holds nothing.
    fn block_table(&self, request_id: RequestId) -> &[BlockId];
    /// Every request holding KV, with its table (for invariant checks).
    fn block_tables(&self) -> Vec<(RequestId, &[BlockId])>;
    /// How many tables hold `block` (0 for a free one).
    fn ref_count(&self, block: BlockId) -> u32;
    fn stats(&self) -> KvCacheStats;
    /// Forgets every cached prefix; refused (false) while any block is in use.
    fn reset_prefix_cache(&mut self) -> bool;
}

/// Which KV layout an engine runs on.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum KvLayout {
    /// Fixed-size blocks with prefix caching (vLLM-style).
    #[default]
    Block,
    /// One cell per token (llama.cpp-style); no prefix caching. CPU only.
    Slot,
}

impl KvLayout {
    pub fn as_str(self) -> &'static str {
        match self {
            KvLayout::Block => "block",
            KvLayout::Slot => "slot",
        }
    }
}

impl fmt::Display for KvLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for KvLayout {
    type Err = ParamError;

    fn from_str(s: &str) -> Result<Self, ParamError> {
        match s {
            "block" => Ok(KvLayout::Block),
            "slot" => Ok(KvLayout::Slot),
            _ => Err(ParamError::new(
                "kv_layout",
                format!("must be \"block\" or \"slot\", got {s:?}"),
            )),
        }
    }
}

/// One of the layouts, chosen at scheduler construction.
#[derive(Debug, Clone)]
pub enum AnyKv {
    Block(KvCacheManager),
    Slot(SlotKvManager),
}

impl AnyKv {
    pub fn layout(&self) -> KvLayout {
        match self {
            AnyKv::Block(_) => KvLayout::Block,
            AnyKv::Slot(_) => KvLayout::Slot,
        }
    }
    pub fn as_block(&self) -> Option<&KvCacheManager> {
        match self {
            AnyKv::Block(kv) => Some(kv),
            AnyKv::Slot(_) => None,
        }
    }
    pub fn as_slot(&self) -> Option<&SlotKvManager> {
        match self {
            AnyKv::Block(_) => None,
            AnyKv::Slot(kv) => Some(kv),
        }
    }
    /// Starts recording KV-cache events; the SLOT layout has no prefix cache, hence none.
    pub fn enable_kv_events(&mut self) {
        if let AnyKv::Block(kv) = self {
            kv.enable_kv_events();
        }
    }
    /// The KV-cache events since the last call, oldest first.
    pub fn take_kv_events(&mut self) -> Vec<crate::kv_events::KvEvent> {
        match self {
            AnyKv::Block(kv) => kv.take_kv_events(),
            AnyKv::Slot(_) => Vec::new(),
        }
    }
    /// The active layout, through the trait the scheduler programs against.
    pub fn as_dyn(&self) -> &dyn KvManager {
        match self {
            AnyKv::Block(kv) => kv,
            AnyKv::Slot(kv) => kv,
        }
    }
    pub fn as_dyn_mut(&mut self) -> &mut dyn KvManager {
        match self {
            AnyKv::Block(kv) => kv,
            AnyKv::Slot(kv) => kv,
        }
    }
}

impl KvManager for KvCacheManager {
    fn block_size(&self) -> usize {
        KvCacheManager::block_size(self)
    }
    fn lookup_prefix(&self, request: &Request) -> PrefixHit {
        KvCacheManager::lookup_prefix(self, request)
    }
    fn allocate_slots(
        &mut self,
        request: &Request,
        num_new_tokens: usize,
        prefix_hit: &PrefixHit,
    ) -> Option<NewBlocks> {
        KvCacheManager::allocate_slots(self, request, num_new_tokens, prefix_hit)
    }
    fn cache_full_blocks(&mut self, request: &Request) {
        KvCacheManager::cache_full_blocks(self, request)
    }
    fn fork(&mut self, parent: &Request, child: RequestId) -> Option<Option<BlockCopy>> {
        KvCacheManager::fork(self, parent, child)
    }
    fn free(&mut self, request_id: RequestId) -> bool {
        KvCacheManager::free(self, request_id)
    }
    fn block_table(&self, request_id: RequestId) -> &[BlockId] {
        KvCacheManager::block_table(self, request_id)
    }
    fn block_tables(&self) -> Vec<(RequestId, &[BlockId])> {
        KvCacheManager::block_tables(self).collect()
    }
    fn ref_count(&self, block: BlockId) -> u32 {
        self.pool().ref_count(block)
    }
    fn stats(&self) -> KvCacheStats {
        KvCacheManager::stats(self)
    }
    fn reset_prefix_cache(&mut self) -> bool {
        KvCacheManager::reset_prefix_cache(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_parse_and_a_bad_one_names_kv_layout() {
        assert_eq!("block".parse::<KvLayout>().unwrap(), KvLayout::Block);
        assert_eq!("slot".parse::<KvLayout>().unwrap(), KvLayout::Slot);
        let err = "paged".parse::<KvLayout>().unwrap_err();
        assert_eq!(err.param, "kv_layout");
        assert!(err.to_string().contains("\"paged\""), "{err}");
        assert_eq!(KvLayout::Slot.to_string(), "slot");
    }
}
