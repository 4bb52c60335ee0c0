//! The dense matmul (`layers::dense`, the CPU path of f32/bf16/f16 checkpoints) with f32, bf16
//! and f16 weights: the 0.5B model's gate/up shape `[4864, 896]` (17 MB in f32, inside a 32 MiB
//! L3) and a 1.5B-lm_head-like `[32768, 1536]` (201 MB in f32: streamed from memory, where a
//! 16-bit weight halves the bytes), one decode row and a 64-row prefill tile.
//!
//! `RAYON_NUM_THREADS=2 cargo bench -p novainfer-model --bench dense`

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use novainfer_model::layers::dense::matmul_into;
use novainfer_model::layers::ops::DotElem;

fn data(len: usize, seed: usize) -> Vec<f32> {
    (0..len)
        .map(|i| (((i * 7919 + seed * 104729) % 2003) as f32 - 1001.0) / 5000.0)
        .collect()
}

fn case<W: DotElem + Sync>(c: &mut Criterion, dtype: &str, w: &[W], n: usize, k: usize) {
    let mut group = c.benchmark_group(format!("dense_{dtype}"));
    group.sample_size(10);
    for rows in [1usize, 64] {
        let x = data(rows * k, 2);
        let mut y = Vec::new();
        group.throughput(Throughput::Elements((rows * n * k) as u64));
        group.bench_function(format!("rows_{rows}_{n}x{k}"), |b| {
            b.iter(|| matmul_into(black_box(&x), rows, black_box(w), n, k, &mut y))
        });
    }
    group.finish();
}

fn dense(c: &mut Criterion) {
    for (n, k) in [(4864, 896), (32768, 1536)] {
        let w = data(n * k, 1);
        let bf: Vec<half::bf16> = w.iter().map(|&v| half::bf16::from_f32(v)).collect();
        let hf: Vec<half::f16> = w.iter().map(|&v| half::f16::from_f32(v)).collect();
        case(c, "f32", &w, n, k);
        case(c, "bf16", &bf, n, k);
        case(c, "f16", &hf, n, k);
    }
}

criterion_group!(benches, dense);
criterion_main!(benches);
