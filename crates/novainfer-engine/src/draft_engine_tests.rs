//! A draft model in the engine's step loop, over a pool tight enough to preempt. The target
//! drafts for itself with a toy that reads its KV back through the block tables, so every
//! draft is accepted only if the draft's KV is where the scheduler's tables say, through
//! reservations, verifications and preemptions.

use std::collections::HashMap;
use std::sync::mpsc;

use novainfer_core::{RequestId, SamplingParams, SchedulerConfig};

use serde_json::json;

use crate::draft_model::test_support::{PoolEcho, BLOCK};
use crate::draft_model::DraftModel;
use crate::engine::LoadedEngine;
use crate::gguf_tokenizer::test_support::tiny_byte_level_tokenizer;
use crate::output_processor::OutputEvent;
use crate::speculative::SpeculativeConfig;
use crate::{EngineCore, Scheduling};

/// 20 blocks of 4 tokens: four requests of 34 tokens need 36.
const NUM_BLOCKS: usize = 20;

fn engine(speculative: bool) -> (EngineCore, mpsc::Receiver<Vec<OutputEvent>>) {
    let tokenizer = tiny_byte_level_tokenizer();
    let vocab = tokenizer.vocab_size();
    let target = PoolEcho::new(NUM_BLOCKS, vocab);
    let max_model_len = NUM_BLOCKS * BLOCK;
    let scheduler = SchedulerConfig::builder()
        .max_num_batched_tokens(64)
        .max_num_seqs(8)
        .max_model_len(max_model_len)
        .block_size(BLOCK)
        .num_blocks(NUM_BLOCKS)
        .build()
        .expect("scheduler config");
    let draft_config = json!({"method": "draft_model", "model": "toy",
        "num_speculative_tokens": 3, "draft_policy": "always"});
    let speculative =
        speculative.then(|| SpeculativeConfig::from_json(&draft_config).expect("valid"));
    let draft = speculative
        .is_some()
        .then(|| DraftModel::new(Box::new(PoolEcho::new(NUM_BLOCKS, vocab)), vocab, 64));
    let loaded =
        LoadedEngine::for_tests(Box::new(target), tokenizer, scheduler, speculative, draft);
    let (tx, rx) = mpsc::channel();
    (EngineCore::new(loaded, tx), rx)
}

/// Each request's greedy tokens, and the engine that made them.
fn generate(speculative: bool) -> (HashMap<RequestId, Vec<u32>>, EngineCore) {
    let (mut core, rx) = engine(speculative);
    let (sink, _deltas) = mpsc::channel();
    let params = SamplingParams::builder()
        .temperature(0.0)
        .max_tokens(Some(24))
        .ignore_eos(true)
        .build()
        .expect("valid");
    for id in 0..4u32 {
        let prompt = (0..10).map(|i| 40 + (id * 7 + i) % 50).collect();
        let request = core
            .frontend()
            .check_request(prompt, params.clone())
            .expect("accepted");
        core.add_request(
            RequestId(u64::from(id)),
            request,
            Scheduling::default(),
            sink.clone().into(),
        );
    }
    let mut tokens: HashMap<RequestId, Vec<u32>> = HashMap::new();
    for _ in 0..500 {
        if !core.has_work() {
            break;
        }
        core.step();
        while let Ok(events) = rx.try_recv() {
            for event in events {
                match event {
                    OutputEvent::Token { id, token, .. } => {
                        tokens.entry(id).or_default().push(token.token_id)
                    }
                    OutputEvent::Failed { error, .. } => panic!("request failed: {error}"),
                    _ => {}
                }
            }
        }
    }
    assert!(!core.has_work(), "the requests finished");
    (tokens, core)
}

#[test]
fn a_self_drafting_model_has_every_draft_accepted_through_preemptions() {
    let (want, _) = generate(false);
    let (got, core) = generate(true);
    assert_eq!(got, want);
    let stats = core.stats();
    assert!(stats.num_preemptions > 0, "the pool was meant to preempt");
    assert!(stats.num_draft_tokens > 0);
    assert_eq!(stats.num_accepted_tokens, stats.num_draft_tokens);
    assert_eq!(stats.kv.num_used_blocks, 0, "a block leaked");
}

#[test]
fn the_kv_stats_count_the_drafts_half_of_each_block() {
    let (plain, _) = engine(false);
    let (drafting, _) = engine(true);
    let (alone, both) = (plain.stats(), drafting.stats());
    // The draft here is the target's twin, so a shared block holds twice the bytes.
    assert!(alone.kv_bytes_per_block > 0);
    assert_eq!(both.kv_bytes_per_block, 2 * alone.kv_bytes_per_block);
    assert_eq!(both.kv_pool_bytes, 2 * alone.kv_pool_bytes);
}
