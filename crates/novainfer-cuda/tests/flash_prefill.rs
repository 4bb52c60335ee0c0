//! The tensor-core prefill kernel (`kernels/flash_prefill.cu`) on a GPU: against the plain CPU
//! attention, the legacy prefill kernel and its own CPU twin (`flash_plan::emulate`), at the
//! Qwen2 geometries, lengths 1, 15, 64, 65, 1000 and 4096, prefix-cached starts, and the same
//! prompt in one chunk or several (which must give the same bits: tiles sit at absolute
//! positions and rows are independent, see the kernel's header). `flash_prefill_speed` (ignored;
//! `scripts/gpu-test run` runs it) prints TFLOP/s at 4k and 16k tokens for the 1.5B shape.
//!
//! Needs a GPU: without one each test prints a skip line (a failure under
//! `NOVAINFER_REQUIRE_GPU=1`, as `scripts/gpu-test run` sets).

#![cfg(feature = "cuda")]

mod common;

use common::host::{down, up, zeros};
use half::bf16;
use novainfer_cuda::cudarc::driver::CudaSlice;
use novainfer_cuda::flash_plan::{emulate, PoolRef, QueryRef};
use novainfer_cuda::ops::flash_prefill::flash_prefill;
use novainfer_cuda::ops::paged_attention::{paged_attention_prefill, AttentionConfig, PagedKv};
use novainfer_cuda::GpuContext;
use novainfer_model::layers;

#[derive(Clone, Copy, Debug)]
struct Geometry {
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    block_size: usize,
}

const GEOMETRIES: [Geometry; 3] = [
    Geometry {
        num_heads: 14,
        num_kv_heads: 2,
        head_dim: 64,
        block_size: 16,
    },
    Geometry {
        num_heads: 12,
        num_kv_heads: 2,
        head_dim: 128,
        block_size: 16,
    },
    Geometry {
        num_heads: 28,
        num_kv_heads: 4,
        head_dim: 128,
        block_size: 32,
    },
];

const LENS: [usize; 6] = [1, 15, 64, 65, 1000, 4096];
/// Prefix-cached starts of LENS' sequences (mid-tile, mid-block).
const STARTS_CACHED: [usize; 6] = [0, 3, 37, 64, 500, 4000];
/// Under the CPU emulator (novainfer-cuemu's fake CUDA) a 4k prompt takes minutes: the same
/// tile and block edges with shorter tails.
const EMULATED_LENS: [usize; 6] = [1, 15, 64, 65, 130, 200];
const EMULATED_STARTS_CACHED: [usize; 6] = [0, 3, 37, 64, 70, 190];

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn bf16s(&mut self, n: usize, scale: f32) -> Vec<bf16> {
        (0..n)
            .map(|_| {
                bf16::from_f32(((self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0) * scale)
            })
            .collect()
    }
}

/// A pool with whole sequences in scrambled blocks, every position's query, on host and GPU.
struct Case {
    g: Geometry,
    k: Vec<bf16>,
    v: Vec<bf16>,
    tables: Vec<i32>,
    max_blocks: usize,
    q_all: Vec<Vec<bf16>>, // [seq][pos · num_heads · head_dim]
    dk: CudaSlice<bf16>,
    dv: CudaSlice<bf16>,
    dtables: CudaSlice<i32>,
}

struct Launch {
    q: Vec<bf16>,
    qsl: Vec<i32>,
    positions: Vec<i32>,
    seq_lens: Vec<i32>,
}

impl Case {
    fn new(gpu: &GpuContext, g: Geometry, lens: &[usize], seed: u64) -> Self {
        let mut rng = Rng(seed);
        let max_blocks = lens
            .iter()
            .map(|l| l.div_ceil(g.block_size))
            .max()
            .unwrap_or(0)
            + 1;
        let total = lens.iter().map(|l| l.div_ceil(g.block_size)).sum::<usize>() + 2;
        let n = total * g.block_size * g.num_kv_heads * g.head_dim;
        let (k, v) = (rng.bf16s(n, 1.0), rng.bf16s(n, 1.0));
        let mut ids: Vec<i32> = (0..total as i32).collect();
        for i in (1..ids.len()).rev() {
            ids.swap(i, rng.next() as usize % (i + 1));
        }
        let mut tables = vec![-1i32; lens.len() * max_blocks];
        let mut next = 0;
        for (s, l) in lens.iter().enumerate() {
            for b in 0..l.div_ceil(g.block_size) {
                tables[s * max_blocks + b] = ids[next];
                next += 1;
            }
        }
        let q_all = lens
            .iter()
            .map(|&l| rng.bf16s(l * g.num_heads * g.head_dim, 2.0))
            .collect();
        let (dk, dv, dtables) = (up(gpu, &k), up(gpu, &v), up(gpu, &tables));
        Self {
            g,
            k,
            v,
            tables,
            max_blocks,
            q_all,
            dk,
            dv,
            dtables,
        }
    }

    fn cfg(&self) -> AttentionConfig {
        AttentionConfig {
            num_heads: self.g.num_heads,
            num_kv_heads: self.g.num_kv_heads,
            head_dim: self.g.head_dim,
            block_size: self.g.block_size,
            max_blocks_per_seq: self.max_blocks,
        }
    }

    /// Positions `starts[s] .. ends[s]` of each sequence as one launch's query tokens.
    fn launch(&self, starts: &[usize], ends: &[usize]) -> Launch {
        let row = self.g.num_heads * self.g.head_dim;
        let (mut q, mut qsl, mut positions) = (Vec::new(), vec![0i32], Vec::new());
        for (s, (&a, &b)) in starts.iter().zip(ends).enumerate() {
            q.extend_from_slice(&self.q_all[s][a * row..b * row]);
            positions.extend(a as i32..b as i32);
            qsl.push(positions.len() as i32);
        }
        let seq_lens = ends.iter().map(|&e| e as i32).collect();
        Launch {
            q,
            qsl,
            positions,
            seq_lens,
        }
    }

    /// `flash` true: the tensor-core kernel, else the legacy one.
    fn run(&self, gpu: &GpuContext, l: &Launch, flash: bool) -> Vec<bf16> {
        let (dq, dqsl, dpos, dlens) = (
            up(gpu, &l.q),
            up(gpu, &l.qsl),
            up(gpu, &l.positions),
            up(gpu, &l.seq_lens),
        );
        let mut out = zeros::<bf16>(gpu, l.q.len());
        let kv = PagedKv {
            k_cache: self.dk.as_view(),
            v_cache: self.dv.as_view(),
            block_tables: self.dtables.as_view(),
            seq_lens: dlens.as_view(),
        };
        let f = if flash {
            flash_prefill
        } else {
            paged_attention_prefill::<bf16>
        };
        f(
            gpu,
            &self.cfg(),
            &dq.as_view(),
            kv,
            &dqsl.as_view(),
            &dpos.as_view(),
            &mut out.as_view_mut(),
        )
        .expect("prefill launch");
        down(gpu, &out)
    }

    fn twin(&self, l: &Launch) -> Vec<f32> {
        let qr = QueryRef {
            q: &l.q,
            query_start_loc: &l.qsl,
            positions: &l.positions,
            num_heads: self.g.num_heads,
        };
        let pool = PoolRef {
            k: &self.k,
            v: &self.v,
            block_tables: &self.tables,
            seq_lens: &l.seq_lens,
            block_size: self.g.block_size,
            max_blocks_per_seq: self.max_blocks,
            num_kv_heads: self.g.num_kv_heads,
            head_dim: self.g.head_dim,
        };
        emulate(&qr, &pool)
    }

    fn reference(&self, l: &Launch) -> Vec<f32> {
        let g = self.g;
        let k32: Vec<f32> = self.k.iter().map(|x| x.to_f32()).collect();
        let v32: Vec<f32> = self.v.iter().map(|x| x.to_f32()).collect();
        let views: Vec<View> = (0..l.seq_lens.len())
            .map(|s| View {
                k: &k32,
                v: &v32,
                table: &self.tables[s * self.max_blocks..(s + 1) * self.max_blocks],
                g,
            })
            .collect();
        let rows: Vec<layers::QueryRow> = (0..l.positions.len())
            .map(|t| layers::QueryRow {
                position: l.positions[t] as usize,
                seq: (0..l.seq_lens.len())
                    .rfind(|&s| l.qsl[s] as usize <= t)
                    .unwrap_or(0),
            })
            .collect();
        let q32: Vec<f32> = l.q.iter().map(|x| x.to_f32()).collect();
        layers::attention(
            &q32,
            &rows,
            &views,
            layers::AttentionShape {
                num_heads: g.num_heads,
                num_kv_heads: g.num_kv_heads,
                head_dim: g.head_dim,
            },
        )
    }
}

struct View<'a> {
    k: &'a [f32],
    v: &'a [f32],
    table: &'a [i32],
    g: Geometry,
}

impl layers::KvView for View<'_> {
    fn key(&self, pos: usize, kv_head: usize) -> &[f32] {
        let o = self.at(pos, kv_head);
        &self.k[o..o + self.g.head_dim]
    }
    fn value(&self, pos: usize, kv_head: usize) -> &[f32] {
        let o = self.at(pos, kv_head);
        &self.v[o..o + self.g.head_dim]
    }
}

impl View<'_> {
    fn at(&self, pos: usize, kv_head: usize) -> usize {
        let g = self.g;
        let slot = self.table[pos / g.block_size] as usize * g.block_size + pos % g.block_size;
        (slot * g.num_kv_heads + kv_head) * g.head_dim
    }
}

/// The flash kernel's documented tolerance (`FLASH_RTOL`/`FLASH_ATOL` in `tests/flash_twin.rs`):
/// the output's bf16 rounding, relative, plus P's rounding to bf16 for the tensor cores, up to
/// 2^-9 · max|V − out| absolute (2^-8 at worst for V in [-1, 1); 2^-7 for margin).
fn assert_close(what: &str, got: &[bf16], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let mut worst = 0f32;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let g = g.to_f32();
        let err = (g - w).abs();
        worst = worst.max(err);
        assert!(
            err <= 1.6e-2 * w.abs() + 1.0 / 128.0,
            "{what}: element {i}: gpu {g} vs {w}"
        );
    }
    println!("{what}: max abs error {worst:.2e}");
}

fn to_f32(v: &[bf16]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

fn differing_bits(a: &[bf16], b: &[bf16]) -> usize {
    a.iter()
        .zip(b)
        .filter(|(x, y)| x.to_bits() != y.to_bits())
        .count()
}

#[test]
fn flash_prefill_matches_cpu_legacy_and_twin() {
    let Some(gpu) = common::gpu_or_skip("flash prefill parity") else {
        return;
    };
    let (lens, starts_cached) = if gpu.is_emulated() {
        (EMULATED_LENS, EMULATED_STARTS_CACHED)
    } else {
        (LENS, STARTS_CACHED)
    };
    for (i, g) in GEOMETRIES.into_iter().enumerate() {
        let case = Case::new(&gpu, g, &lens, 40 + i as u64);
        // Whole prompts, then the same sequences behind cached prefixes.
        for starts in [[0; 6], starts_cached] {
            let l = case.launch(&starts, &lens);
            let what = format!("{g:?} starts {starts:?}");
            let flash = case.run(&gpu, &l, true);
            let legacy = case.run(&gpu, &l, false);
            assert_close(
                &format!("{what}: flash vs CPU"),
                &flash,
                &case.reference(&l),
            );
            assert_close(
                &format!("{what}: flash vs legacy"),
                &flash,
                &to_f32(&legacy),
            );
            // The twin runs single-threaded: only where it takes seconds (0.5B heads, the
            // cached starts: 637 query tokens).
            if i == 0 && starts == starts_cached {
                assert_close(
                    &format!("{what}: flash vs its CPU twin"),
                    &flash,
                    &case.twin(&l),
                );
            }
            println!(
                "{what}: {} of {} values differ from the legacy kernel's bits",
                differing_bits(&flash, &legacy),
                flash.len()
            );
        }
    }
}

#[test]
fn flash_prefill_does_not_depend_on_chunking() {
    let Some(gpu) = common::gpu_or_skip("flash prefill chunking") else {
        return;
    };
    // The second sequence is cut at `cuts`, the first (shorter) one where they fall within it.
    let (lens, all_cuts) = if gpu.is_emulated() {
        (
            [100, 300],
            [
                vec![0, 64, 300],
                vec![0, 1, 65, 100, 117, 299, 300],
                vec![0, 150, 300],
            ],
        )
    } else {
        (
            [1000, 4096],
            [
                vec![0, 512, 4096],
                vec![0, 1, 65, 1000, 1017, 4095, 4096],
                vec![0, 2048, 4096],
            ],
        )
    };
    for (i, g) in GEOMETRIES.into_iter().enumerate() {
        let case = Case::new(&gpu, g, &lens, 70 + i as u64);
        let whole = case.run(&gpu, &case.launch(&[0, 0], &lens), true);
        let row = g.num_heads * g.head_dim;
        for cuts in all_cuts.clone() {
            let mut pieces = [Vec::new(), Vec::new()];
            for w in cuts.windows(2) {
                let (a0, b0) = (w[0].min(lens[0]), w[1].min(lens[0]));
                let out = case.run(&gpu, &case.launch(&[a0, w[0]], &[b0, w[1]]), true);
                let n0 = (b0 - a0) * row;
                pieces[0].extend_from_slice(&out[..n0]);
                pieces[1].extend_from_slice(&out[n0..]);
            }
            let chunked = pieces.concat();
            let differ = differing_bits(&chunked, &whole);
            assert_eq!(
                differ, 0,
                "{g:?}: cuts {cuts:?}: {differ} values differ from one chunk"
            );
        }
    }
}

/// TFLOP/s (4·n²/2·head_dim·num_heads causal flops) of one layer's prefill attention at the
/// 1.5B shape, flash and legacy. `cargo test --release -p novainfer-cuda --features cuda --test
/// flash_prefill -- --ignored --nocapture`.
#[test]
#[ignore = "timing: run on a GPU with --ignored --nocapture"]
fn flash_prefill_speed() {
    let Some(gpu) = common::gpu_or_skip("flash prefill speed") else {
        return;
    };
    let g = Geometry {
        num_heads: 12,
        num_kv_heads: 2,
        head_dim: 128,
        block_size: 16,
    };
    for n in [4096usize, 16384] {
        let case = Case::new(&gpu, g, &[n], 9);
        let l = case.launch(&[0], &[n]);
        let (dq, dqsl, dpos, dlens) = (
            up(&gpu, &l.q),
            up(&gpu, &l.qsl),
            up(&gpu, &l.positions),
            up(&gpu, &l.seq_lens),
        );
        let mut out = zeros::<bf16>(&gpu, l.q.len());
        let flops = 2.0 * (n as f64) * (n as f64) * (g.head_dim * g.num_heads) as f64;
        for flash in [true, false] {
            let mut once = || {
                let kv = PagedKv {
                    k_cache: case.dk.as_view(),
                    v_cache: case.dv.as_view(),
                    block_tables: case.dtables.as_view(),
                    seq_lens: dlens.as_view(),
                };
                let f = if flash {
                    flash_prefill
                } else {
                    paged_attention_prefill::<bf16>
                };
                f(
                    &gpu,
                    &case.cfg(),
                    &dq.as_view(),
                    kv,
                    &dqsl.as_view(),
                    &dpos.as_view(),
                    &mut out.as_view_mut(),
                )
                .expect("launch");
            };
            once();
            gpu.synchronize().expect("sync");
            let iters = if flash { 20 } else { 3 };
            let start = std::time::Instant::now();
            for _ in 0..iters {
                once();
            }
            gpu.synchronize().expect("sync");
            let secs = start.elapsed().as_secs_f64() / iters as f64;
            println!(
                "prefill attention {} n={n} (12/2 heads, hd 128): {:.3} ms, {:.1} TFLOP/s",
                if flash { "flash " } else { "legacy" },
                secs * 1e3,
                flops / secs / 1e12
            );
        }
    }
}
