//! The dense f32 matmul (`layers::dense`, the CPU path of f32/bf16/f16 checkpoints) at the 0.5B
//! model's gate/up shape: one decode row and a 64-row prefill tile, weights `[4864, 896]`.
//!
//! `RAYON_NUM_THREADS=2 cargo bench -p novainfer-model --bench dense`

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use novainfer_model::layers::dense::matmul_f32_into;

fn data(len: usize, seed: usize) -> Vec<f32> {
    (0..len)
        .map(|i| (((i * 7919 + seed * 104729) % 2003) as f32 - 1001.0) / 5000.0)
        .collect()
}

fn dense(c: &mut Criterion) {
    let (n, k) = (4864, 896);
    let w = data(n * k, 1);
    let mut group = c.benchmark_group("dense_f32");
    for rows in [1usize, 64] {
        let x = data(rows * k, 2);
        let mut y = Vec::new();
        group.throughput(Throughput::Elements((rows * n * k) as u64));
        group.bench_function(format!("rows_{rows}_{n}x{k}"), |b| {
            b.iter(|| matmul_f32_into(black_box(&x), rows, black_box(&w), n, k, &mut y))
        });
    }
    group.finish();
}

criterion_group!(benches, dense);
criterion_main!(benches);
