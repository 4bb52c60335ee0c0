//! The GEMV over runs of rows in different formats against its twin (`emulate_runs`), and the
//! fused GEMVs against the GEMV followed by the kernel they absorb, bit for bit: gate/up with
//! SiLU·mul (`gemv_silu_mul` = `gemv` + `silu_mul_fused`) and the QKV projection with bias, RoPE
//! and the cache write (`gemv_qkv` = `gemv` + `qkv_bias_rope_cache`), every weight format and
//! mixes of them, f32 and bf16 stores, 1, 3 and 8 rows; `gemv_qkv` also against its CPU twin
//! (`gemv_plan::emulate_qkv`). Fresh random inputs every run (the seed is printed).
//!
//! A module of the `parity` test binary rather than a binary of its own: the GPU machine gets
//! the test binaries carried, and each binary repeats the crates it links.

use crate::common;
use crate::common::host::{down, gemv_matrix, up, Rng, TestDtype};
use half::bf16;
use novainfer_cuda::cudarc::driver::CudaSlice;
use novainfer_cuda::cudarc::driver::CudaView;
use novainfer_cuda::gemv_plan::{self, GemvWeights};
use novainfer_cuda::ops::dequant::QuantType;
use novainfer_cuda::ops::gemv_quant::{
    gemv, gemv_qkv, gemv_silu_mul, OutColumns, QkvHeads, QkvTokens, WeightRun,
};
use novainfer_cuda::ops::kv::KvCacheMut;
use novainfer_cuda::ops::qkv::{qkv_bias_rope_cache, QkvInput};
use novainfer_cuda::ops::rope::{host_table, RopeHeads, RopeTable};
use novainfer_cuda::ops::silu_mul::silu_mul_fused;
use novainfer_cuda::{CudaError, GpuContext};

fn seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64)
}

fn bits<T: TestDtype>(v: &[T]) -> Vec<u32> {
    v.iter().map(|x| x.to_f32().to_bits()).collect()
}

fn activations(rng: &mut Rng, n: usize, k: usize) -> Vec<bf16> {
    rng.vec(n * k, 2.0)
        .into_iter()
        .map(bf16::from_f32)
        .collect()
}

/// A matrix's runs, `(format, rows)` in row order, with random contents on the host and device.
struct Runs {
    layout: Vec<(GemvWeights, usize)>,
    host: Vec<Vec<u8>>,
    device: Vec<CudaSlice<u8>>,
}

impl Runs {
    fn new(gpu: &GpuContext, rng: &mut Rng, layout: &[(GemvWeights, usize)], k: usize) -> Self {
        let host: Vec<Vec<u8>> = layout
            .iter()
            .map(|&(w, rows)| gemv_matrix(w, rows, k, rng))
            .collect();
        let device = host.iter().map(|h| up(gpu, h)).collect();
        Self {
            layout: layout.to_vec(),
            host,
            device,
        }
    }

    fn rows(&self) -> usize {
        self.layout.iter().map(|&(_, r)| r).sum()
    }

    fn on_device(&self) -> Vec<WeightRun<'_>> {
        self.layout
            .iter()
            .zip(&self.device)
            .map(|(&(weights, rows), d)| WeightRun {
                weights,
                bytes: d.as_view(),
                rows,
            })
            .collect()
    }

    fn on_host(&self) -> Vec<gemv_plan::HostRun<'_>> {
        self.layout
            .iter()
            .zip(&self.host)
            .map(|(&(weights, rows), h)| gemv_plan::HostRun {
                weights,
                bytes: h,
                rows,
            })
            .collect()
    }
}

fn packed(q: QuantType) -> GemvWeights {
    GemvWeights::Packed(q)
}

fn runs_body<T: TestDtype>(gpu: &GpuContext, rng: &mut Rng) {
    // Every packed format across two launches (a launch takes one family: bf16 runs go alone, as
    // `gemv_body` runs them), run boundaries not on a block of four warps.
    let layouts = [
        vec![
            (packed(QuantType::Q4K), 9),
            (packed(QuantType::Q6K), 3),
            (packed(QuantType::Int4), 5),
            (packed(QuantType::Fp8), 6),
        ],
        vec![(packed(QuantType::Q5_0), 7), (packed(QuantType::Q8_0), 5)],
    ];
    for layout in &layouts {
        runs_launch::<T>(gpu, rng, layout);
    }
}

fn runs_launch<T: TestDtype>(gpu: &GpuContext, rng: &mut Rng, layout: &[(GemvWeights, usize)]) {
    let k = 1536;
    let runs = Runs::new(gpu, rng, layout, k);
    let rows = runs.rows();
    for n in [1, 3, 8] {
        let x_host = activations(rng, n, k);
        let x = up(gpu, &x_host);
        let out = OutColumns {
            ld: rows + 7,
            col0: 3,
        };
        let mut y = up(gpu, &vec![T::from_f32(-7.0); n * out.ld]);
        let (xv, mut yv) = (x.as_view(), y.as_view_mut());
        gemv(gpu, &runs.on_device(), k, &xv, n, &mut yv, out).expect("gemv");
        let want = gemv_plan::emulate_runs(&runs.on_host(), k, &x_host, n);
        let got = down(gpu, &y);
        for r in 0..n {
            for c in 0..out.ld {
                let expected = if (out.col0..out.col0 + rows).contains(&c) {
                    T::from_f32(want[r * rows + c - out.col0]).to_f32()
                } else {
                    -7.0
                };
                let g = got[r * out.ld + c].to_f32();
                assert_eq!(g.to_bits(), expected.to_bits(), "n = {n} ({r}, {c})");
            }
        }
    }
}

#[test]
fn one_launch_multiplies_runs_of_every_format_as_the_twin() {
    let Some(gpu) = common::gpu_or_skip("gemv runs") else {
        return;
    };
    let seed = seed();
    println!("gemv runs: seed {seed}");
    let mut rng = Rng(seed);
    runs_body::<f32>(&gpu, &mut rng);
    runs_body::<bf16>(&gpu, &mut rng);
}

fn silu_body<T: TestDtype>(gpu: &GpuContext, rng: &mut Rng) {
    // f = 42: not a multiple of the block's four warps.
    let (f, k) = (42, 1536);
    let mut layouts: Vec<Vec<(GemvWeights, usize)>> =
        GemvWeights::ALL.iter().map(|&w| vec![(w, 2 * f)]).collect();
    // Gate and up of different types; and runs that do not split at the halves.
    layouts.push(vec![
        (packed(QuantType::Q4K), f),
        (packed(QuantType::Q6K), f),
    ]);
    layouts.push(vec![
        (packed(QuantType::Q8_0), f - 2),
        (packed(QuantType::Q4K), 4),
        (packed(QuantType::Q5_0), f - 2),
    ]);
    for layout in layouts {
        let runs = Runs::new(gpu, rng, &layout, k);
        let w = runs.on_device();
        for n in [1, 3, 8] {
            let x = up(gpu, &activations(rng, n, k));
            let xv = x.as_view();
            let mut gate_up = up(gpu, &vec![T::default(); n * 2 * f]);
            let all = OutColumns { ld: 2 * f, col0: 0 };
            gemv(gpu, &w, k, &xv, n, &mut gate_up.as_view_mut(), all).expect("gemv");
            let mut want = up(gpu, &vec![T::default(); n * f]);
            silu_mul_fused(gpu, &gate_up.as_view(), f, &mut want.as_view_mut()).expect("silu");
            let mut got = up(gpu, &vec![T::from_f32(-7.0); n * f]);
            gemv_silu_mul(gpu, &w, k, &xv, n, &mut got.as_view_mut()).expect("fused");
            assert_eq!(
                bits(&down(gpu, &got)),
                bits(&down(gpu, &want)),
                "{layout:?} n = {n}"
            );
        }
    }
}

#[test]
fn the_fused_gate_up_is_the_gemv_then_silu_mul() {
    let Some(gpu) = common::gpu_or_skip("gemv_silu_mul") else {
        return;
    };
    let seed = seed();
    println!("gemv_silu_mul: seed {seed}");
    let mut rng = Rng(seed);
    silu_body::<f32>(&gpu, &mut rng);
    silu_body::<bf16>(&gpu, &mut rng);
}

// Qwen2-1.5B's attention geometry: 12 q heads, 2 kv heads of 128, hidden 1536.
const HEADS: QkvHeads = QkvHeads {
    num_heads: 12,
    num_kv_heads: 2,
    head_dim: 128,
};
const K: usize = 1536;
const MAX_POSITIONS: usize = 512;
const NUM_SLOTS: usize = 48;

/// A q_out, K cache and V cache, filled with a sentinel so untouched values show.
struct Outputs<T> {
    q: Vec<T>,
    k: Vec<T>,
    v: Vec<T>,
}

impl<T: TestDtype> Outputs<T> {
    fn sentinel(n: usize) -> Self {
        let kv = NUM_SLOTS * HEADS.num_kv_heads * HEADS.head_dim;
        let s = T::from_f32(-7.0);
        Self {
            q: vec![s; n * HEADS.num_heads * HEADS.head_dim],
            k: vec![s; kv],
            v: vec![s; kv],
        }
    }
}

fn qkv_case<T: TestDtype>(
    gpu: &GpuContext,
    rng: &mut Rng,
    runs: &Runs,
    n: usize,
    with_bias: bool,
    (table, host_cos_sin): (&RopeTable, &[f32]),
) {
    let hd = HEADS.head_dim;
    let total = HEADS.total() * hd;
    let w = runs.on_device();
    let x_host = activations(rng, n, K);
    let bias_host = rng.vec(total, 0.5);
    // Distinct slots; with 3 rows or more, a padding row (slot −1) and a position outside the
    // table (q and k left unrotated).
    let mut slots: Vec<i64> = (0..n as i64)
        .map(|i| (i * 7 + 3) % NUM_SLOTS as i64)
        .collect();
    let mut positions: Vec<i32> = (0..n)
        .map(|_| (rng.next() % MAX_POSITIONS as u64) as i32)
        .collect();
    if n >= 3 {
        slots[1] = -1;
        positions[2] = MAX_POSITIONS as i32;
    }
    let (x, bias) = (up(gpu, &x_host), up(gpu, &bias_host));
    let (pos, slot) = (up(gpu, &positions), up(gpu, &slots));
    let start = Outputs::<T>::sentinel(n);

    // Separate: the GEMV into [n, total], then qkv.cu.
    let mut qkv = up(gpu, &vec![T::default(); n * total]);
    let all = OutColumns { ld: total, col0: 0 };
    let xv = x.as_view();
    gemv(gpu, &w, K, &xv, n, &mut qkv.as_view_mut(), all).expect("gemv");
    let (mut q, mut kc, mut vc) = (up(gpu, &start.q), up(gpu, &start.k), up(gpu, &start.v));
    let rope_heads = RopeHeads {
        num_heads: HEADS.num_heads,
        num_kv_heads: HEADS.num_kv_heads,
    };
    let input = QkvInput {
        qkv: qkv.as_view(),
        bias: with_bias.then(|| bias.as_view()),
        positions: pos.as_view(),
        slot_mapping: slot.as_view(),
    };
    let cache = KvCacheMut {
        k: kc.as_view_mut(),
        v: vc.as_view_mut(),
    };
    qkv_bias_rope_cache(gpu, table, rope_heads, input, &mut q.as_view_mut(), cache).expect("qkv");
    let want = Outputs {
        q: down(gpu, &q),
        k: down(gpu, &kc),
        v: down(gpu, &vc),
    };

    // Fused: one launch.
    let (mut q, mut kc, mut vc) = (up(gpu, &start.q), up(gpu, &start.k), up(gpu, &start.v));
    let tokens = QkvTokens {
        bias: with_bias.then(|| bias.as_view()),
        positions: pos.as_view(),
        slot_mapping: slot.as_view(),
    };
    let cache = KvCacheMut {
        k: kc.as_view_mut(),
        v: vc.as_view_mut(),
    };
    let mut qv = q.as_view_mut();
    gemv_qkv(gpu, table, HEADS, &w, K, &xv, &tokens, &mut qv, cache).expect("fused");
    let got = Outputs {
        q: down(gpu, &q),
        k: down(gpu, &kc),
        v: down(gpu, &vc),
    };
    let what = format!("{:?} n = {n} bias {with_bias}", runs.layout);
    assert_eq!(bits(&got.q), bits(&want.q), "q: {what}");
    assert_eq!(bits(&got.k), bits(&want.k), "k cache: {what}");
    assert_eq!(bits(&got.v), bits(&want.v), "v cache: {what}");

    // The CPU twin.
    let widen = |v: &[T]| v.iter().map(|x| x.to_f32()).collect::<Vec<f32>>();
    let mut twin = gemv_plan::QkvOut {
        q: widen(&start.q),
        k_cache: widen(&start.k),
        v_cache: widen(&start.v),
    };
    let host_tokens = gemv_plan::QkvTokens {
        bias: with_bias.then_some(&bias_host[..]),
        positions: &positions,
        slots: &slots,
        cos_sin: host_cos_sin,
    };
    let round: fn(f32) -> f32 = |v| T::from_f32(v).to_f32();
    let host_runs = runs.on_host();
    gemv_plan::emulate_qkv(
        &host_runs,
        HEADS,
        K,
        &x_host,
        n,
        host_tokens,
        round,
        &mut twin,
    );
    let f32_bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
    assert_eq!(bits(&got.q), f32_bits(&twin.q), "twin q: {what}");
    assert_eq!(bits(&got.k), f32_bits(&twin.k_cache), "twin k: {what}");
    assert_eq!(bits(&got.v), f32_bits(&twin.v_cache), "twin v: {what}");
}

fn qkv_body<T: TestDtype>(gpu: &GpuContext, rng: &mut Rng) {
    let (hd, theta) = (HEADS.head_dim, 1_000_000.0);
    let table = RopeTable::new(gpu, hd, theta, MAX_POSITIONS).expect("table");
    let host = host_table(hd, theta, MAX_POSITIONS).expect("host table");
    let (q_rows, kv_rows) = (HEADS.num_heads * hd, HEADS.num_kv_heads * hd);
    // A bf16 checkpoint (one run); packed q | k | v tensors of mixed formats, as Q4_K_M mixes
    // Q4_K and Q6_K; the other formats.
    let layouts = [
        vec![(GemvWeights::Bf16, q_rows + 2 * kv_rows)],
        vec![
            (packed(QuantType::Q4K), q_rows),
            (packed(QuantType::Q4K), kv_rows),
            (packed(QuantType::Q6K), kv_rows),
        ],
        vec![
            (packed(QuantType::Q5_0), q_rows),
            (packed(QuantType::Int4), kv_rows),
            (packed(QuantType::Q8_0), kv_rows),
        ],
    ];
    for layout in &layouts {
        let runs = Runs::new(gpu, rng, layout, K);
        for n in [1, 3, 8] {
            for with_bias in [true, false] {
                qkv_case::<T>(gpu, rng, &runs, n, with_bias, (&table, &host));
            }
        }
    }
}

#[test]
fn the_fused_qkv_is_the_gemv_then_qkv_cu_and_its_twin() {
    let Some(gpu) = common::gpu_or_skip("gemv_qkv") else {
        return;
    };
    let seed = seed();
    println!("gemv_qkv: seed {seed}");
    let mut rng = Rng(seed);
    qkv_body::<f32>(&gpu, &mut rng);
    qkv_body::<bf16>(&gpu, &mut rng);
}

#[test]
fn misaligned_or_misshapen_operands_are_refused() {
    let Some(gpu) = common::gpu_or_skip("gemv guards") else {
        return;
    };
    let (rows, k) = (8, 64);
    let bytes = rows * k * 2;
    let w = up(&gpu, &vec![0u8; bytes + 2]);
    let x = up(&gpu, &vec![bf16::ZERO; k + 8]);
    let call = |w: CudaView<'_, u8>, runs: usize, x: CudaView<'_, bf16>| {
        let mut y = up(&gpu, &vec![0f32; runs * rows]);
        let run = || WeightRun {
            weights: GemvWeights::Bf16,
            bytes: w.slice(..),
            rows,
        };
        let w: Vec<WeightRun<'_>> = (0..runs).map(|_| run()).collect();
        let out = OutColumns {
            ld: runs * rows,
            col0: 0,
        };
        gemv(&gpu, &w, k, &x, 1, &mut y.as_view_mut(), out)
    };
    let param = |e: CudaError| match e {
        CudaError::InvalidArgument { param, .. } => param,
        other => panic!("not an argument error: {other}"),
    };
    // A bf16 matrix that starts 2 bytes in: its rows are not on 16-byte boundaries.
    let err = call(w.slice(2..2 + bytes), 1, x.slice(..k)).expect_err("misaligned w");
    assert_eq!(param(err), "w");
    let err = call(w.slice(..bytes), 1, x.slice(1..k + 1)).expect_err("misaligned x");
    assert_eq!(param(err), "x");
    let err = call(w.slice(..bytes - 2), 1, x.slice(..k)).expect_err("a short run");
    assert_eq!(param(err), "w");
    let err = call(w.slice(..bytes), 5, x.slice(..k)).expect_err("five runs");
    assert_eq!(param(err), "runs");
    call(w.slice(..bytes), 4, x.slice(..k)).expect("four aligned runs");
    // A bf16 run beside a packed one: each family is a kernel of its own.
    let q8 = up(
        &gpu,
        &vec![0u8; rows * GemvWeights::Packed(QuantType::Q8_0).row_bytes(k)],
    );
    let mixed = [
        WeightRun {
            weights: GemvWeights::Bf16,
            bytes: w.slice(..bytes),
            rows,
        },
        WeightRun {
            weights: GemvWeights::Packed(QuantType::Q8_0),
            bytes: q8.as_view(),
            rows,
        },
    ];
    let mut y = up(&gpu, &vec![0f32; 2 * rows]);
    let out = OutColumns {
        ld: 2 * rows,
        col0: 0,
    };
    let (xv, mut yv) = (x.slice(..k), y.as_view_mut());
    let err = gemv(&gpu, &mixed, k, &xv, 1, &mut yv, out).expect_err("mixed families");
    assert_eq!(param(err), "runs");
}
