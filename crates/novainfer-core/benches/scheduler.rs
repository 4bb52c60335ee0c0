//! `Scheduler::schedule()` cost with many running decode requests.
//!
//! `schedule` only allocates; counters advance in `update`. Calling it again
//! without `update` therefore schedules the same decode step each time, which
//! isolates its cost. `step` adds `update` (on a fresh clone per iteration).

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion};
use novainfer_core::{Request, RequestId, Scheduler, SchedulerConfig};

const PROMPT_LEN: usize = 100;

/// `n` requests, prefilled and one token into decode.
fn decoding(n: usize) -> Scheduler {
    let cfg = SchedulerConfig::builder()
        .max_num_seqs(n)
        .max_num_batched_tokens(n * PROMPT_LEN)
        .block_size(16)
        .num_blocks(n * 16)
        .max_model_len(4096)
        .build()
        .expect("valid bench config");
    let mut s = Scheduler::new(cfg);
    for i in 0..n {
        // Distinct prompts: no prefix hits, every request owns its blocks.
        let prompt = (0..PROMPT_LEN as u32)
            .map(|t| t + 1000 * i as u32)
            .collect();
        s.add_request(Request::new(RequestId(i as u64), prompt, 1 << 20));
    }
    for _ in 0..2 {
        let out = s.schedule();
        let sampled: Vec<_> = out
            .scheduled
            .iter()
            .map(|r| (r.request_id, vec![7]))
            .collect();
        s.update(&out, &sampled);
    }
    assert_eq!(s.num_running(), n);
    s
}

fn bench_schedule(c: &mut Criterion) {
    let mut group = c.benchmark_group("scheduler");
    for n in [256, 1024] {
        let mut s = decoding(n);
        assert_eq!(s.schedule().num_batched_tokens, n, "a pure decode step");
        group.bench_with_input(BenchmarkId::new("schedule", n), &n, |b, _| {
            b.iter(|| black_box(s.schedule()))
        });
        let template = decoding(n);
        group.bench_with_input(BenchmarkId::new("schedule+update", n), &n, |b, _| {
            b.iter_batched(
                || template.clone(),
                |mut s| {
                    let out = s.schedule();
                    let sampled: Vec<_> = out
                        .scheduled
                        .iter()
                        .map(|r| (r.request_id, vec![7]))
                        .collect();
                    black_box(s.update(&out, &sampled));
                    s
                },
                BatchSize::LargeInput,
            )
        });
    }
    group.finish();
}

criterion_group!(benches, bench_schedule);
criterion_main!(benches);
