//! Heap allocations of a CPU decode step, counted by a global allocator (its own test binary,
//! so the counting does not touch other tests). A decode step of 3 sequences on the tiny model
//! (dense f32 weights, and GGUF Q8_0 weights through our packed kernels), written into a reused
//! `ForwardOutput`, must allocate nothing once the buffers have grown: every position up to
//! 300 (two attention partitions, so the split-and-merge path too) is run once to warm up, then
//! the last 60 again (across the partition boundary at 256), counting.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use candle_core::quantized::GgmlDType;
use common::{config, weights, MemorySource, Stored};
use novainfer_model::{ForwardBatch, ForwardOutput, LoadOptions, PagedKvCache, Qwen2Model};

struct Counting;

static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const BLOCK_SIZE: usize = 16;
const SEQS: usize = 3;
const DEPTH: usize = 300;

/// The tiny model's shape with k-dimensions that Q8_0 blocks divide (hidden 64, MLP 96).
fn model(quantized: bool) -> Qwen2Model {
    let cfg = novainfer_model::Qwen2Config {
        hidden_size: 64,
        intermediate_size: 96,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        max_position_embeddings: DEPTH,
        ..config(false)
    };
    let w = weights(&cfg);
    let source = MemorySource(
        w.into_iter()
            .map(|(name, t)| {
                let matrix = t.dims().len() == 2 && name != "model.embed_tokens.weight";
                let stored = if quantized && matrix {
                    Stored::quantize(&t, GgmlDType::Q8_0)
                } else {
                    Stored::Dense(t)
                };
                (name, stored)
            })
            .collect(),
    );
    Qwen2Model::build(cfg, source, &LoadOptions::default()).expect("tiny model")
}

/// A decode step of `SEQS` sequences at depth `pos` (sequence s owns blocks s·16..).
fn step(batch: &mut ForwardBatch, tables: &[Vec<u32>], pos: usize) {
    batch.clear();
    for (s, table) in tables.iter().enumerate() {
        let slot = table[pos / BLOCK_SIZE] as usize * BLOCK_SIZE + pos % BLOCK_SIZE;
        batch.push(
            &[(s * 7 + pos) as u32 % 40],
            pos,
            vec![slot],
            table.clone(),
            true,
        );
    }
}

/// Allocations of each counted step (positions `DEPTH - 60..DEPTH`).
fn allocations_per_step(quantized: bool) -> Vec<usize> {
    let model = model(quantized);
    let cfg = model.config().clone();
    let blocks_per_seq = DEPTH.div_ceil(BLOCK_SIZE);
    let mut kv = PagedKvCache::new(&cfg, SEQS * blocks_per_seq, BLOCK_SIZE, model.kv_dtype());
    let tables: Vec<Vec<u32>> = (0..SEQS)
        .map(|s| {
            (s * blocks_per_seq..(s + 1) * blocks_per_seq)
                .map(|b| b as u32)
                .collect()
        })
        .collect();
    let mut batch = ForwardBatch::default();
    let mut out = ForwardOutput::default();
    let mut counts = Vec::new();
    for pass in 0..2 {
        let from = if pass == 0 { 0 } else { DEPTH - 60 };
        for pos in from..DEPTH {
            step(&mut batch, &tables, pos);
            let before = ALLOCATIONS.load(Ordering::SeqCst);
            model
                .forward_outputs_into(&batch, &mut kv, &mut out)
                .expect("decode step");
            if pass == 1 {
                counts.push(ALLOCATIONS.load(Ordering::SeqCst) - before);
            }
        }
    }
    assert_eq!(out.logits.len(), SEQS * cfg.vocab_size);
    counts
}

#[test]
fn a_decode_step_allocates_nothing_after_warm_up() {
    for quantized in [false, true] {
        let counts = allocations_per_step(quantized);
        let allocating: Vec<(usize, usize)> = counts
            .iter()
            .copied()
            .enumerate()
            .filter(|&(_, c)| c > 0)
            .collect();
        assert!(
            allocating.is_empty(),
            "quantized={quantized}: (step, allocations) of the steps that allocated: {allocating:?}"
        );
    }
}
