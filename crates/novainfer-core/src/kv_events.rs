//! KV-cache events: what the prefix cache gained and lost, for routers that place requests
//! where their prefix is cached (vLLM's `BlockStored` / `BlockRemoved` / `AllBlocksCleared`).
//!
//! The [`BlockPool`](crate::BlockPool) records an event where its prefix index changes:
//! a block published under a hash, a cached block evicted for reuse, the index cleared.
//! The engine takes the events once per step and hands them to a publisher. Off by
//! default: a disabled [`KvEventLog`] holds no buffer and each call is one branch.
//!
//! Consecutive events of one kind are merged as vLLM sends them: blocks stored one after
//! the other along one chain (each the parent of the next) become one `BlockStored` with
//! their hashes in order and their token ids concatenated.

use crate::prefix_hash::{BlockHash, BlockKey};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Full blocks published in the prefix cache, in chain order: `block_hashes[0]`'s parent
    /// is `parent`, and each later block's parent is the one before it.
    BlockStored {
        block_hashes: Vec<BlockHash>,
        parent: Option<BlockHash>,
        /// `block_size` tokens per block, concatenated.
        token_ids: Vec<u32>,
        block_size: usize,
        /// The LoRA adapter whose KV the blocks hold (`None`: the base model's).
        lora_id: Option<u64>,
    },
    /// Cached blocks whose content is gone (evicted to hold other tokens).
    BlockRemoved { block_hashes: Vec<BlockHash> },
    /// Every cached block is gone (`reset_prefix_cache`).
    AllBlocksCleared,
}

/// Where an engine hands each step's events (a publisher's bounded queue, say).
/// `publish` runs on the engine thread between steps: it must not block.
pub trait KvEventSink: Send + Sync + std::fmt::Debug {
    fn publish(&self, events: Vec<KvEvent>);
}

/// The events since the last [`KvEventLog::take`], when enabled.
#[derive(Debug, Clone, Default)]
pub struct KvEventLog {
    events: Option<Vec<KvEvent>>,
}

impl KvEventLog {
    pub fn enable(&mut self) {
        self.events.get_or_insert_with(Vec::new);
    }

    pub fn is_enabled(&self) -> bool {
        self.events.is_some()
    }

    /// A block now cached under `hash`, holding `key`.
    pub fn stored(&mut self, hash: BlockHash, key: &BlockKey<'_>) {
        let Some(events) = self.events.as_mut() else {
            return;
        };
        let block_size = key.token_ids.len();
        // The only extra key today is a request's adapter id (`Request::cache_keys`).
        let lora = key.extra_keys.first().copied();
        if let Some(KvEvent::BlockStored {
            block_hashes,
            token_ids,
            block_size: size,
            lora_id,
            ..
        }) = events.last_mut()
        {
            if *size == block_size
                && *lora_id == lora
                && key.parent.is_some()
                && block_hashes.last() == key.parent.as_ref()
            {
                block_hashes.push(hash);
                token_ids.extend_from_slice(key.token_ids);
                return;
            }
        }
        events.push(KvEvent::BlockStored {
            block_hashes: vec![hash],
            parent: key.parent,
            token_ids: key.token_ids.to_vec(),
            block_size,
            lora_id: lora,
        });
    }

    /// The block cached under `hash` was evicted.
    pub fn removed(&mut self, hash: BlockHash) {
        let Some(events) = self.events.as_mut() else {
            return;
        };
        match events.last_mut() {
            Some(KvEvent::BlockRemoved { block_hashes }) => block_hashes.push(hash),
            _ => events.push(KvEvent::BlockRemoved {
                block_hashes: vec![hash],
            }),
        }
    }

    pub fn cleared(&mut self) {
        if let Some(events) = self.events.as_mut() {
            events.push(KvEvent::AllBlocksCleared);
        }
    }

    /// The events recorded since the last call, oldest first (empty when disabled).
    pub fn take(&mut self) -> Vec<KvEvent> {
        self.events.as_mut().map(std::mem::take).unwrap_or_default()
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
    fn a_disabled_log_records_nothing() {
        let mut log = KvEventLog::default();
        log.stored(BlockHash(1), &key(None, &[1, 2]));
        log.removed(BlockHash(1));
        log.cleared();
        assert!(log.take().is_empty());
        assert!(!log.is_enabled());
    }

    #[test]
    fn a_chain_is_one_event_and_a_new_chain_another() {
        let mut log = KvEventLog::default();
        log.enable();
        let (h0, h1, other) = (BlockHash(10), BlockHash(11), BlockHash(20));
        log.stored(h0, &key(None, &[1, 2]));
        log.stored(h1, &key(Some(h0), &[3, 4]));
        log.stored(other, &key(None, &[9, 9]));
        log.removed(h0);
        log.removed(h1);
        log.cleared();
        assert_eq!(
            log.take(),
            vec![
                KvEvent::BlockStored {
                    block_hashes: vec![h0, h1],
                    parent: None,
                    token_ids: vec![1, 2, 3, 4],
                    block_size: 2,
                    lora_id: None,
                },
                KvEvent::BlockStored {
                    block_hashes: vec![other],
                    parent: None,
                    token_ids: vec![9, 9],
                    block_size: 2,
                    lora_id: None,
                },
                KvEvent::BlockRemoved {
                    block_hashes: vec![h0, h1]
                },
                KvEvent::AllBlocksCleared,
            ]
        );
        assert!(log.take().is_empty(), "taking empties the log");
        assert!(log.is_enabled());
    }

    #[test]
    fn an_adapters_blocks_carry_its_id() {
        let mut log = KvEventLog::default();
        log.enable();
        let key = |parent, tokens: &'static [u32], extra: &'static [u64]| BlockKey {
            parent,
            token_ids: tokens,
            extra_keys: extra,
        };
        log.stored(BlockHash(1), &key(None, &[1, 2], &[7]));
        log.stored(BlockHash(2), &key(Some(BlockHash(1)), &[3, 4], &[7]));
        log.stored(BlockHash(3), &key(None, &[1, 2], &[]));
        let ids: Vec<Option<u64>> = log
            .take()
            .iter()
            .map(|e| match e {
                KvEvent::BlockStored { lora_id, .. } => *lora_id,
                _ => unreachable!("only stores were logged"),
            })
            .collect();
        assert_eq!(ids, vec![Some(7), None]);
    }
}
