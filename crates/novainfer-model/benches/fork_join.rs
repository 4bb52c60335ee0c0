//! What one fork/join of candle's barrier pool costs (the pool every CPU matmul and the
//! attention kernel run on): `execute_chunked` over as many no-op items as there are
//! threads, wall time. A decode step of Qwen2 runs 5 per layer (Q/K/V together, attention,
//! o_proj, gate/up together, down) plus one for the LM head: 121 for the 0.5B model's 24
//! layers (193 before Q/K/V and gate/up shared one).
//!
//! `RAYON_NUM_THREADS=2 cargo bench -p novainfer-model --bench fork_join`

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};

fn fork_join(c: &mut Criterion) {
    let pool = candle_core::utils::barrier_pool();
    let threads = candle_core::utils::get_num_threads();
    c.bench_function(&format!("fork_join_{threads}_threads"), |b| {
        b.iter(|| {
            pool.execute_chunked(black_box(threads), |range| {
                black_box(range);
            })
        })
    });
}

criterion_group!(benches, fork_join);
criterion_main!(benches);
