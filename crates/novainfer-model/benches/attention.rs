//! Attention at depth through the CPU forward: one decoder layer of Qwen2.5-0.5B's attention shape
//! (14 query heads, 2 KV heads of 64) with a small MLP and vocabulary, so the paged attention
//! kernel is most of each call. Per KV cache dtype: one decode token at depth 4,096, and a
//! 512-token prefill chunk at depth 3,584..4,096 (the history written once, outside the timing).
//! `NOVAINFER_BENCH_DEPTH=16384` moves both to that depth (long-context prefill: each chunk
//! token attends to ~16k positions; writing the history takes a while).
//!
//! The layer's dense f32 projections (a plain test-path matmul) take most of a prefill chunk's
//! time here; for the kernel alone see `kernel_timing` in `layers/paged_attention/tests.rs`.
//!
//! `RAYON_NUM_THREADS=1 cargo bench -p novainfer-model --bench attention`

#[path = "../tests/common/mod.rs"]
mod common;

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use novainfer_model::{ForwardBatch, PagedKvCache, Qwen2Config, Qwen2Model};

/// The history's length: `NOVAINFER_BENCH_DEPTH`, 4,096 if unset; a multiple of `CHUNK`.
fn depth() -> usize {
    let depth = std::env::var("NOVAINFER_BENCH_DEPTH")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(4096);
    depth.div_ceil(CHUNK).max(1) * CHUNK
}
const CHUNK: usize = 512;
const BLOCK_SIZE: usize = 16;

fn config() -> Qwen2Config {
    Qwen2Config {
        vocab_size: 64,
        hidden_size: 896,
        intermediate_size: 128,
        num_hidden_layers: 1,
        num_attention_heads: 14,
        num_key_value_heads: 2,
        max_position_embeddings: depth() + 1,
        eos_token_ids: vec![63],
        ..common::config(false)
    }
}

/// One span at positions `start..start + len` of a sequence whose blocks are `0..`.
fn span(start: usize, len: usize, table: &[u32]) -> ForwardBatch {
    let tokens: Vec<u32> = (start..start + len).map(|p| (p * 7 % 60) as u32).collect();
    let slots = (start..start + len).collect(); // block b holds positions b*16.. in order
    let mut batch = ForwardBatch::default();
    batch.push(&tokens, start, slots, table.to_vec(), true);
    batch
}

/// The model in `dtype` and a pool holding a `depth + 1`-token history.
fn prepared(dtype: &str, depth: usize) -> (Qwen2Model, PagedKvCache, Vec<u32>) {
    let cfg = config();
    let model = common::build_kv(cfg.clone(), common::weights(&cfg), dtype).expect("bench model");
    let blocks = (depth + 1).div_ceil(BLOCK_SIZE);
    let table: Vec<u32> = (0..blocks as u32).collect();
    let mut kv = PagedKvCache::new(&cfg, blocks, BLOCK_SIZE, model.kv_dtype());
    for start in (0..depth).step_by(CHUNK) {
        model
            .forward_outputs(&span(start, CHUNK, &table), &mut kv)
            .expect("history");
    }
    (model, kv, table)
}

fn attention_at_depth(c: &mut Criterion) {
    let depth = depth();
    let mut group = c.benchmark_group(format!("attention_at_depth_{depth}"));
    group.sample_size(10);
    for dtype in ["f32", "f16", "q8_0"] {
        let (model, mut kv, table) = prepared(dtype, depth);
        // Each call rewrites the same positions' K/V, so every iteration sees the same history.
        let decode = span(depth, 1, &table);
        group.bench_function(BenchmarkId::new("decode", dtype), |b| {
            b.iter(|| black_box(model.forward_outputs(&decode, &mut kv).expect("decode")))
        });
        let chunk = span(depth - CHUNK, CHUNK, &table);
        group.bench_function(BenchmarkId::new("prefill_chunk_512", dtype), |b| {
            b.iter(|| black_box(model.forward_outputs(&chunk, &mut kv).expect("chunk")))
        });
    }
    group.finish();
}

criterion_group!(benches, attention_at_depth);
criterion_main!(benches);
