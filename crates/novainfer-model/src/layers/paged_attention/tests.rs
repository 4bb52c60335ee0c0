//! The kernel against an f64 reference at long context, and its invariances (batch, chunking,
//! block size, work split, ISA) bit for bit, for every KV dtype.

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::*;
use crate::config::Qwen2Config;
use crate::kv_dtype::KvStorage;
use crate::paged_kv::PagedKvCache;

const DTYPES: [KvStorage; 4] = [
    KvStorage::F32,
    KvStorage::F16,
    KvStorage::Bf16,
    KvStorage::Q8_0,
];

/// Qwen2.5-0.5B's attention: 14 query heads over 2 KV heads of 64.
const SHAPE: AttentionShape = AttentionShape {
    num_heads: 14,
    num_kv_heads: 2,
    head_dim: 64,
};

fn config(shape: AttentionShape) -> Qwen2Config {
    Qwen2Config {
        vocab_size: 8,
        hidden_size: shape.num_heads * shape.head_dim,
        intermediate_size: 8,
        num_hidden_layers: 1,
        num_attention_heads: shape.num_heads,
        num_key_value_heads: shape.num_kv_heads,
        max_position_embeddings: 1 << 20,
        rope_theta: 10_000.0,
        rms_norm_eps: 1e-6,
        tie_word_embeddings: false,
        torch_dtype: None,
        bos_token_id: None,
        eos_token_ids: vec![],
    }
}

fn random(len: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..len).map(|_| rng.random_range(-scale..scale)).collect()
}

/// One sequence of `len` tokens in a pool of blocks of `bs`, its block table a scrambled
/// order of the pool's blocks (so that paging is really exercised).
struct Fixture {
    pool: PagedKvCache,
    table: Vec<u32>,
    shape: AttentionShape,
}

impl Fixture {
    fn new(shape: AttentionShape, len: usize, bs: usize, dtype: KvStorage, seed: u64) -> Self {
        let blocks = len.div_ceil(bs);
        let table: Vec<u32> = (0..blocks as u32)
            .map(|b| (b * 7 + 3) % blocks as u32)
            .collect();
        let table = if blocks.is_multiple_of(7) {
            (0..blocks as u32).rev().collect()
        } else {
            table
        };
        let mut pool = PagedKvCache::new(&config(shape), blocks, bs, dtype);
        let row = shape.num_kv_heads * shape.head_dim;
        // Keys large enough that softmax is far from uniform.
        let k = random(len * row, seed, 2.0);
        let v = random(len * row, seed + 1, 1.0);
        let slots: Vec<usize> = (0..len)
            .map(|p| table[p / bs] as usize * bs + p % bs)
            .collect();
        pool.write(0, &slots, &k, &v);
        Self { pool, table, shape }
    }

    /// Attention of `q` rows at `positions` (one span of this sequence).
    fn run(&self, q: &[f32], positions: &[usize], isa: AttnIsa) -> Vec<f32> {
        self.run_with(q, positions, isa, &mut Plan::default())
    }

    /// [`Fixture::run`] through `plan` (as the model reuses one from call to call).
    fn run_with(&self, q: &[f32], positions: &[usize], isa: AttnIsa, plan: &mut Plan) -> Vec<f32> {
        let span = SeqSpan {
            query_start: 0,
            query_len: positions.len(),
            block_table: self.table.clone(),
            output: crate::forward_batch::SpanOutput::LastLogits,
            adapter: None,
        };
        let (layer, mut out) = (self.pool.layer(0), Vec::new());
        paged_attention_into(
            q,
            positions,
            &[span],
            layer,
            self.shape,
            isa,
            plan,
            &mut out,
        );
        out
    }

    /// The f64 softmax over the pool's (decoded) rows.
    fn reference(&self, q: &[f32], positions: &[usize]) -> Vec<f64> {
        let AttentionShape {
            num_heads,
            num_kv_heads,
            head_dim: hd,
        } = self.shape;
        let layer = self.pool.layer(0);
        let bs = layer.geo.block_size;
        let last = positions.iter().copied().max().unwrap_or(0);
        // Every cached row decoded once: [buffer][position][kv head][hd].
        let decoded: Vec<Vec<f64>> = [true, false]
            .iter()
            .map(|&keys| {
                let mut all = Vec::with_capacity((last + 1) * num_kv_heads * hd);
                let mut one = vec![0f32; hd];
                for pos in 0..=last {
                    for g in 0..num_kv_heads {
                        let slot = self.table[pos / bs] as usize * bs + pos % bs;
                        if keys {
                            layer.geo.read_key(layer.k, slot, g, &mut one);
                        } else {
                            layer.geo.read_value(layer.v, slot, g, &mut one);
                        }
                        all.extend(one.iter().map(|x| f64::from(*x)));
                    }
                }
                all
            })
            .collect();
        let row = |which: usize, pos: usize, g: usize| {
            &decoded[which][(pos * num_kv_heads + g) * hd..][..hd]
        };
        let mut out = vec![0f64; q.len()];
        for (t, &p) in positions.iter().enumerate() {
            for h in 0..num_heads {
                let g = h / (num_heads / num_kv_heads);
                let qh = &q[(t * num_heads + h) * hd..][..hd];
                let scores: Vec<f64> = (0..=p)
                    .map(|j| {
                        let k = row(0, j, g);
                        qh.iter()
                            .zip(k)
                            .map(|(a, b)| f64::from(*a) * b)
                            .sum::<f64>()
                            / (hd as f64).sqrt()
                    })
                    .collect();
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let sum: f64 = w.iter().sum();
                let o = &mut out[(t * num_heads + h) * hd..][..hd];
                for (j, wj) in w.iter().enumerate() {
                    for (od, vd) in o.iter_mut().zip(row(1, j, g)) {
                        *od += wj / sum * vd;
                    }
                }
            }
        }
        out
    }
}

/// Every ISA this CPU has for `head_dim`, the portable one first: AVX-512 whenever the CPU
/// has AVX-512F, whatever its self-check said (a disagreement must fail the tests).
fn isas_for(head_dim: usize) -> Vec<AttnIsa> {
    let mut v = vec![AttnIsa::Scalar];
    #[cfg(target_arch = "x86_64")]
    {
        if head_dim.is_multiple_of(8) && ops::Avx2::detect() {
            v.push(AttnIsa::Avx2);
        }
        if head_dim.is_multiple_of(16) && ops::Avx512::detect() {
            v.push(AttnIsa::Avx512);
        }
    }
    v
}

fn isas() -> Vec<AttnIsa> {
    isas_for(SHAPE.head_dim)
}

/// The SIMD ISAs of [`isas_for`].
fn fast_isas(head_dim: usize) -> Vec<AttnIsa> {
    isas_for(head_dim).split_off(1)
}

#[test]
fn the_chosen_isa_is_a_timed_candidate_and_the_choice_is_recorded() {
    let isa = AttnIsa::select(SHAPE, KvStorage::F16);
    let forced = std::env::var(ISA_VAR).ok().filter(|v| !v.is_empty());
    assert!(isas().contains(&isa), "{isa:?} is not an ISA this CPU has");
    let group = SHAPE.num_heads / SHAPE.num_kv_heads;
    let kernel = format!(
        "attention (head_dim {}, {group} query heads per KV head, F16 cache)",
        SHAPE.head_dim
    );
    let s = crate::kernel_select::selections()
        .into_iter()
        .find(|s| s.kernel == kernel)
        .expect("the choice is recorded");
    // Seen with --nocapture (scripts/gpu-test puts it in its summary for the GPU machine's CPU).
    println!("attention ISA for head_dim {}: {s}", SHAPE.head_dim);
    assert_eq!(s.chosen, isa.name());
    assert!(
        s.rejected.is_empty(),
        "a candidate disagreed with AVX2: {s}"
    );
    if forced.is_none() && fast_isas(SHAPE.head_dim).len() > 1 {
        // Every SIMD ISA the CPU has (AVX-512 only after its self-check) was timed.
        assert_eq!(s.decision, crate::kernel_select::Decision::Timed);
        let timed: Vec<_> = s.timings.iter().map(|t| t.0).collect();
        assert_eq!(timed, ["avx2", "avx512"]);
    }
    // Asked again (another model of this geometry), the memoised choice: nothing re-timed.
    let recorded = || {
        let all = crate::kernel_select::selections();
        all.iter().filter(|s| s.kernel == kernel).count()
    };
    let before = recorded();
    assert_eq!(AttnIsa::select(SHAPE, KvStorage::F16), isa);
    assert_eq!(recorded(), before);
}

#[cfg(target_arch = "x86_64")]
#[test]
fn the_candidates_are_what_the_cpu_and_head_size_allow_and_forcing_a_lower_one_skips_the_self_check(
) {
    use AttnIsa::{Avx2, Avx512, Scalar};
    let yes = || true;
    let no = || false;
    let unasked = || -> bool { panic!("the AVX-512 self-check ran for nothing") };
    // (forced, head_dim, AVX2, then whether AVX-512 is usable) → candidates, baseline first.
    assert_eq!(super::candidates(None, 64, true, yes), [Avx2, Avx512]);
    assert_eq!(
        super::candidates(Some("avx512"), 128, true, yes),
        [Avx2, Avx512]
    );
    assert_eq!(
        super::candidates(Some("bogus"), 64, true, yes),
        [Avx2, Avx512]
    );
    assert_eq!(super::candidates(None, 64, true, no), [Avx2]);
    assert_eq!(super::candidates(Some("avx512"), 64, true, no), [Avx2]);
    assert_eq!(super::candidates(Some("avx2"), 64, true, unasked), [Avx2]);
    assert_eq!(
        super::candidates(Some("scalar"), 64, true, unasked),
        [Avx2, Scalar]
    );
    assert_eq!(super::candidates(None, 72, true, unasked), [Avx2]);
    assert_eq!(super::candidates(None, 12, true, unasked), [Scalar]);
    assert_eq!(super::candidates(None, 64, false, unasked), [Scalar]);
    assert_eq!(
        super::candidates(Some("avx2"), 64, false, unasked),
        [Scalar]
    );
}

#[cfg(target_arch = "x86_64")]
#[test]
fn the_timed_choice_runs_every_candidate_on_the_same_problem_and_forcing_wins() {
    // The real problem and stopwatch: whichever wins, both candidates' bits agreed (nothing
    // rejected), and a forced name wins without timing.
    let cands = super::candidates(
        None,
        SHAPE.head_dim,
        ops::Avx2::detect(),
        super::avx512_usable,
    );
    let (isa, s) = super::timed(SHAPE.head_dim, 7, KvStorage::Q8_0, None, cands.clone());
    assert!(cands.contains(&isa) && s.rejected.is_empty(), "{s}");
    if cands.len() > 1 {
        assert_eq!(s.timings.len(), cands.len(), "{s}");
    }
    let last = *cands.last().expect("a candidate");
    let forced = Some((ISA_VAR, last.name().to_string()));
    let (isa, s) = super::timed(SHAPE.head_dim, 7, KvStorage::Q8_0, forced, cands);
    assert_eq!(isa, last);
    assert_eq!(
        s.decision,
        crate::kernel_select::Decision::Forced { var: ISA_VAR }
    );
}

#[test]
fn a_reused_plan_gives_a_fresh_ones_bits() {
    // A deep decode leaves many partials behind; the calls after it (fewer partitions, two
    // rows in different ones) must not read any of them.
    let fx = Fixture::new(SHAPE, 1200, 16, KvStorage::F16, 5);
    let width = SHAPE.num_heads * SHAPE.head_dim;
    for isa in isas() {
        let mut plan = Plan::default();
        for (i, positions) in [vec![1199], vec![300, 1000], vec![700]].iter().enumerate() {
            let q = random(positions.len() * width, 40 + i as u64, 1.0);
            let reused = fx.run_with(&q, positions, isa, &mut plan);
            let fresh = fx.run(&q, positions, isa);
            assert!(
                reused
                    .iter()
                    .zip(&fresh)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{isa:?}, call {i}"
            );
        }
    }
}

#[test]
fn prefetching_runs_ahead_within_a_walk_and_on_into_the_next_items() {
    let (walk, next) = (256..512, 0..100);
    // Inside the walk, cut at its end.
    assert_eq!(
        ahead_of(&walk, Some(&next), 256, 64),
        Some((false, 256..320))
    );
    assert_eq!(
        ahead_of(&walk, Some(&next), 480, 64),
        Some((false, 480..512))
    );
    // Past its end: the next item's first positions, cut at that walk's end.
    assert_eq!(ahead_of(&walk, Some(&next), 512, 32), Some((true, 0..32)));
    assert_eq!(ahead_of(&walk, Some(&next), 576, 64), Some((true, 64..100)));
    // Past both, or no next item on this thread.
    assert_eq!(ahead_of(&walk, Some(&next), 612, 32), None);
    assert_eq!(ahead_of(&walk, None, 512, 32), None);
}

#[test]
fn exp_is_accurate_on_the_softmax_range() {
    for i in 0..=17_400 {
        let x = -(i as f32) * 0.005;
        let (got, want) = (f64::from(ops::exp_scalar(x)), f64::from(x).exp());
        assert!(
            (got - want).abs() <= 3e-7 * want,
            "exp({x}) = {got}, want {want}"
        );
    }
    assert!(ops::exp_scalar(f32::NEG_INFINITY) < 1e-37);
}

#[test]
fn matches_an_f64_reference_beyond_4k_positions_for_every_block_size_and_dtype() {
    let len = 4100;
    // Decode at the end (split over partitions), a short chunk (split) and one longer than
    // QUERY_TILE (partitions in turn, a full item and a 1-token one), all past 4k.
    let cases: [Vec<usize>; 3] = [
        vec![len - 1],
        (len - 3..len).collect(),
        (len - (QUERY_TILE + 1)..len).collect(),
    ];
    for dtype in DTYPES {
        // 24: keys as rows in every dtype (blocks of whole key tiles hold them tiled).
        for bs in [16, 24, 64] {
            let fx = Fixture::new(SHAPE, len, bs, dtype, 11);
            for positions in &cases {
                let q = random(positions.len() * SHAPE.num_heads * SHAPE.head_dim, 5, 1.0);
                let want = fx.reference(&q, positions);
                for isa in isas() {
                    let got = fx.run(&q, positions, isa);
                    let err = got
                        .iter()
                        .zip(&want)
                        .map(|(a, b)| (f64::from(*a) - b).abs())
                        .fold(0f64, f64::max);
                    assert!(
                        err < 2e-6,
                        "{dtype:?} bs={bs} {isa:?} {} rows: max error {err}",
                        positions.len()
                    );
                }
            }
        }
    }
}

#[test]
fn a_row_is_bit_identical_however_the_prompt_is_chunked_or_the_pool_is_paged() {
    let len = 600; // crosses two partition boundaries
    let width = SHAPE.num_heads * SHAPE.head_dim;
    let q = random(len * width, 9, 1.0);
    for dtype in DTYPES {
        let pools = [
            Fixture::new(SHAPE, len, 16, dtype, 3),
            Fixture::new(SHAPE, len, 64, dtype, 3),
            Fixture::new(SHAPE, len, 1, dtype, 3),
        ];
        let positions: Vec<usize> = (0..len).collect();
        let fast = fast_isas(SHAPE.head_dim);
        let whole = pools[0].run(
            &q,
            &positions,
            fast.first().copied().unwrap_or(AttnIsa::Scalar),
        );
        // The portable path is slow (software fma): one chunking of it is enough.
        let mut runs = vec![(AttnIsa::Scalar, 64)];
        for &isa in &fast {
            for chunk in [1, 7, 64, 512, len] {
                runs.push((isa, chunk));
            }
        }
        for fx in &pools {
            for &(isa, chunk) in &runs {
                let mut chunked = Vec::with_capacity(q.len());
                for start in (0..len).step_by(chunk) {
                    let end = (start + chunk).min(len);
                    chunked.extend(fx.run(
                        &q[start * width..end * width],
                        &positions[start..end],
                        isa,
                    ));
                }
                assert!(
                    chunked == whole,
                    "{dtype:?} bs={} {isa:?} chunk {chunk} differs",
                    fx.pool.block_size()
                );
            }
        }
    }
}

#[test]
fn a_row_is_bit_identical_alone_and_in_a_mixed_batch() {
    let width = SHAPE.num_heads * SHAPE.head_dim;
    for dtype in DTYPES {
        // Three sequences in one pool: a long decode, a prefill chunk and a short history.
        let lens = [700usize, 300, 20];
        let bs = 16;
        let total_blocks: usize = lens.iter().map(|l| l.div_ceil(bs)).sum();
        let mut pool = PagedKvCache::new(&config(SHAPE), total_blocks, bs, dtype);
        let row = SHAPE.num_kv_heads * SHAPE.head_dim;
        let mut tables = Vec::new();
        let mut next = 0u32;
        for (i, &len) in lens.iter().enumerate() {
            let blocks = len.div_ceil(bs) as u32;
            // Interleave: the tables take blocks from the back of the pool forwards.
            let table: Vec<u32> = (next..next + blocks).rev().collect();
            next += blocks;
            let slots: Vec<usize> = (0..len)
                .map(|p| table[p / bs] as usize * bs + p % bs)
                .collect();
            pool.write(
                0,
                &slots,
                &random(len * row, 20 + i as u64, 2.0),
                &random(len * row, 30 + i as u64, 1.0),
            );
            tables.push(table);
        }
        // The batch: seq 0 decodes its last token, seq 1 runs its last 37, seq 2 its last 2.
        let rows: [std::ops::Range<usize>; 3] = [699..700, 263..300, 18..20];
        let mut q = Vec::new();
        let mut positions = Vec::new();
        let mut spans = Vec::new();
        for (i, r) in rows.iter().enumerate() {
            spans.push(SeqSpan {
                query_start: positions.len(),
                query_len: r.len(),
                block_table: tables[i].clone(),
                output: crate::forward_batch::SpanOutput::LastLogits,
                adapter: None,
            });
            positions.extend(r.clone());
            q.extend(random(r.len() * width, 40 + i as u64, 1.0));
        }
        for isa in isas() {
            let batched = paged_attention(&q, &positions, &spans, pool.layer(0), SHAPE, isa);
            for (i, span) in spans.iter().enumerate() {
                let range = span.query_start * width..(span.query_start + span.query_len) * width;
                let alone_span = SeqSpan {
                    query_start: 0,
                    ..span.clone()
                };
                let alone = paged_attention(
                    &q[range.clone()],
                    &positions[span.query_start..span.query_start + span.query_len],
                    &[alone_span],
                    pool.layer(0),
                    SHAPE,
                    AttnIsa::Scalar,
                );
                assert!(
                    batched[range] == alone[..],
                    "{dtype:?} {isa:?}: sequence {i} differs in the batch"
                );
            }
        }
    }
}

#[test]
fn odd_head_sizes_run_on_the_portable_path() {
    let shape = AttentionShape {
        num_heads: 6,
        num_kv_heads: 3,
        head_dim: 12,
    };
    assert_eq!(AttnIsa::select(shape, KvStorage::F16), AttnIsa::Scalar);
    for dtype in DTYPES {
        let fx = Fixture::new(shape, 300, 16, dtype, 1);
        let positions: Vec<usize> = (290..300).collect();
        let q = random(positions.len() * 6 * 12, 2, 1.0);
        let want = fx.reference(&q, &positions);
        let got = fx.run(&q, &positions, AttnIsa::Scalar);
        let err = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (f64::from(*a) - b).abs())
            .fold(0f64, f64::max);
        assert!(err < 2e-6, "{dtype:?}: max error {err}");
    }
}

#[test]
fn head_dim_128_and_odd_groups_match_the_reference_and_the_portable_path_bit_for_bit() {
    // Qwen2.5-1.5B's shape (group of 6, head_dim 128), and a group of 5 whose rows per
    // item (160, 40, 65) split into register blocks of 5 and 6; rows end mid-tile and
    // mid-group of 8 positions; a chunk longer than QUERY_TILE (a whole item and a partial
    // one, partitions in turn), a short chunk and a decode row (split over partitions);
    // the history crosses a partition.
    let shapes = [
        AttentionShape {
            num_heads: 12,
            num_kv_heads: 2,
            head_dim: 128,
        },
        AttentionShape {
            num_heads: 10,
            num_kv_heads: 2,
            head_dim: 128,
        },
    ];
    for shape in shapes {
        for dtype in [KvStorage::F16, KvStorage::F32] {
            let len = 300;
            let fx = Fixture::new(shape, len, 16, dtype, 17);
            let cases = [
                (len - (QUERY_TILE + 8)..len).collect::<Vec<_>>(),
                (len - 13..len).collect(),
                vec![len - 1],
            ];
            for positions in cases {
                let q = random(positions.len() * shape.num_heads * shape.head_dim, 6, 1.0);
                let want = fx.reference(&q, &positions);
                let portable = fx.run(&q, &positions, AttnIsa::Scalar);
                let err = portable
                    .iter()
                    .zip(&want)
                    .map(|(a, b)| (f64::from(*a) - b).abs())
                    .fold(0f64, f64::max);
                assert!(err < 2e-6, "{shape:?} {dtype:?}: max error {err}");
                for isa in fast_isas(shape.head_dim) {
                    let got = fx.run(&q, &positions, isa);
                    assert!(
                        got == portable,
                        "{shape:?} {dtype:?} {isa:?}: differs from the portable path"
                    );
                }
            }
        }
    }
}

/// Not a test: times the kernel alone (the `attention` bench goes through the whole layer,
/// whose test-only dense matmul dominates). `NOVAINFER_KERNEL_DEPTH` (default 4096) history,
/// f16 cache, a 512-token prefill chunk ending there and one decode row, CPU time:
/// `RAYON_NUM_THREADS=1 cargo test --release -p novainfer-model kernel_timing -- --ignored
/// --nocapture`
/// (`NOVAINFER_KERNEL_DEPTH` sets the depth, 4096 by default; `NOVAINFER_KERNEL_POINT=decode`
/// or `prefill_512` runs only that point, for a profiler; `NOVAINFER_KERNEL_LAYERS=28` cycles
/// through that many caches, so that each call reads its own from memory as a model's step
/// does, rather than one from the last level cache; `NOVAINFER_KERNEL_WALL=1` times the wall
/// clock, for runs on more than one thread): every SIMD ISA on the 0.5B's and the
/// 1.5B's attention shapes, f16 cache.
#[test]
#[ignore = "timing printout, run by hand"]
fn kernel_timing() {
    let depth: usize = std::env::var("NOVAINFER_KERNEL_DEPTH")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4096);
    // Qwen2.5-1.5B: 12 query heads over 2 KV heads of 128.
    let shape_1_5b = AttentionShape {
        num_heads: 12,
        num_kv_heads: 2,
        head_dim: 128,
    };
    let only = std::env::var("NOVAINFER_KERNEL_POINT").ok();
    let wall = std::env::var_os("NOVAINFER_KERNEL_WALL").is_some();
    let layers: usize = std::env::var("NOVAINFER_KERNEL_LAYERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    for shape in [SHAPE, shape_1_5b] {
        let fxs: Vec<Fixture> = (0..layers)
            .map(|l| Fixture::new(shape, depth, 16, KvStorage::F16, 1 + l as u64))
            .collect();
        let width = shape.num_heads * shape.head_dim;
        let (heads, kv_heads, hd) = (shape.num_heads, shape.num_kv_heads, shape.head_dim);
        for isa in fast_isas(shape.head_dim) {
            for (name, positions, reps) in [
                ("prefill_512", (depth - 512..depth).collect::<Vec<_>>(), 5),
                ("decode", vec![depth - 1], 2000),
            ] {
                if only.as_ref().is_some_and(|p| p != name) {
                    continue;
                }
                let q = random(positions.len() * width, 2, 1.0);
                // This thread's CPU time (with one thread the pool runs every item here):
                // wall time on the shared machine swings with the other processes. With
                // more threads, `NOVAINFER_KERNEL_WALL=1` times the wall clock instead.
                let cpu = || {
                    let mut ts = libc::timespec {
                        tv_sec: 0,
                        tv_nsec: 0,
                    };
                    let clock = if wall {
                        libc::CLOCK_MONOTONIC
                    } else {
                        libc::CLOCK_THREAD_CPUTIME_ID
                    };
                    // SAFETY: `ts` is a valid timespec to write.
                    unsafe { libc::clock_gettime(clock, &mut ts) };
                    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
                };
                let mut times = Vec::new();
                for rep in 0..reps {
                    let fx = &fxs[rep % layers];
                    let t = cpu();
                    std::hint::black_box(fx.run(&q, &positions, isa));
                    times.push(cpu() - t);
                }
                times.sort_by(f64::total_cmp);
                let flops = positions.iter().map(|p| p + 1).sum::<usize>() * width * 4;
                println!(
                    "{heads}/{kv_heads}/{hd} {name} depth {depth} {isa:?}: min {:.3} ms, \
                     median {:.3} ms, {:.2} GFLOP/s",
                    times[0] * 1e3,
                    times[reps / 2] * 1e3,
                    flops as f64 / times[0] / 1e9
                );
            }
        }
    }
}
