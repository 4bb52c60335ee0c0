//! The fused GEMVs against the GEMV followed by the kernel they absorb, bit for bit: gate/up
//! with SiLU·mul (`gemv_silu_mul` = `gemv` + `silu_mul_fused`) and a QKV part with bias, RoPE
//! and the cache write (`gemv_qkv` = `gemv` + `qkv_bias_rope_cache`), every weight format, f32
//! and bf16 stores, 1, 3 and 8 rows; `gemv_qkv` also against its CPU twin
//! (`gemv_plan::emulate_qkv`). Fresh random inputs every run (the seed is printed).
//!
//! A module of the `parity` test binary rather than a binary of its own: the GPU machine gets
//! the test binaries carried, and each binary repeats the crates it links.

use crate::common;
use crate::common::host::{down, gemv_matrix, up, Rng, TestDtype};
use half::bf16;
use novainfer_cuda::cudarc::driver::CudaView;
use novainfer_cuda::gemv_plan::{self, GemvWeights};
use novainfer_cuda::ops::dequant::QuantType;
use novainfer_cuda::ops::gemv_quant::{
    gemv, gemv_qkv, gemv_silu_mul, GateUp, OutColumns, QkvHeads, QkvPart, QkvTokens,
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

fn silu_body<T: TestDtype>(gpu: &GpuContext, rng: &mut Rng) {
    // f = 42: not a multiple of the block's four warps.
    let (f, k) = (42, 1536);
    for weights in GemvWeights::ALL {
        let raw = gemv_matrix(weights, 2 * f, k, rng);
        let w = up(gpu, &raw);
        let half = f * weights.row_bytes(k);
        for n in [1, 3, 8] {
            let x = up(gpu, &activations(rng, n, k));
            let mut gate_up = up(gpu, &vec![T::default(); n * 2 * f]);
            let all = OutColumns { ld: 2 * f, col0: 0 };
            let (xv, wv) = (x.as_view(), w.as_view());
            gemv(
                gpu,
                weights,
                &wv,
                2 * f,
                k,
                &xv,
                n,
                &mut gate_up.as_view_mut(),
                all,
            )
            .expect("gemv");
            let mut want = up(gpu, &vec![T::default(); n * f]);
            silu_mul_fused(gpu, &gate_up.as_view(), f, &mut want.as_view_mut()).expect("silu");
            let mut got = up(gpu, &vec![T::from_f32(-7.0); n * f]);
            let halves = GateUp {
                weights,
                gate: w.slice(..half),
                up: w.slice(half..),
                f,
            };
            gemv_silu_mul(gpu, &halves, k, &xv, n, &mut got.as_view_mut()).expect("fused");
            assert_eq!(
                bits(&down(gpu, &got)),
                bits(&down(gpu, &want)),
                "{weights:?} n = {n}"
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

/// The weight's runs: `(format, head0, heads)`, q | k | v order.
type Runs = [(GemvWeights, usize, usize)];

#[allow(clippy::too_many_arguments)]
fn qkv_case<T: TestDtype>(
    gpu: &GpuContext,
    rng: &mut Rng,
    runs: &Runs,
    n: usize,
    with_bias: bool,
    table: &RopeTable,
    host_cos_sin: &[f32],
) {
    let hd = HEADS.head_dim;
    let total = HEADS.total() * hd;
    let parts: Vec<Vec<u8>> = runs
        .iter()
        .map(|&(weights, _, heads)| gemv_matrix(weights, heads * hd, K, rng))
        .collect();
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
    let w: Vec<_> = parts.iter().map(|p| up(gpu, p)).collect();
    let start = Outputs::<T>::sentinel(n);

    // Separate: each run's GEMV into its columns of [n, total], then qkv.cu.
    let mut qkv = up(gpu, &vec![T::default(); n * total]);
    for (&(weights, head0, heads), w) in runs.iter().zip(&w) {
        let out = OutColumns {
            ld: total,
            col0: head0 * hd,
        };
        let (xv, wv) = (x.as_view(), w.as_view());
        gemv(
            gpu,
            weights,
            &wv,
            heads * hd,
            K,
            &xv,
            n,
            &mut qkv.as_view_mut(),
            out,
        )
        .expect("gemv");
    }
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

    // Fused: a launch per run.
    let (mut q, mut kc, mut vc) = (up(gpu, &start.q), up(gpu, &start.k), up(gpu, &start.v));
    let tokens = QkvTokens {
        bias: with_bias.then(|| bias.as_view()),
        positions: pos.as_view(),
        slot_mapping: slot.as_view(),
    };
    for (&(weights, head0, heads), w) in runs.iter().zip(&w) {
        let part = QkvPart {
            weights,
            w: w.as_view(),
            head0,
            heads,
        };
        let cache = KvCacheMut {
            k: kc.as_view_mut(),
            v: vc.as_view_mut(),
        };
        let (xv, mut qv) = (x.as_view(), q.as_view_mut());
        gemv_qkv(gpu, table, HEADS, &part, K, &xv, &tokens, &mut qv, cache).expect("fused");
    }
    let got = Outputs {
        q: down(gpu, &q),
        k: down(gpu, &kc),
        v: down(gpu, &vc),
    };
    let what = format!("{runs:?} n = {n} bias {with_bias}");
    assert_eq!(bits(&got.q), bits(&want.q), "q: {what}");
    assert_eq!(bits(&got.k), bits(&want.k), "k cache: {what}");
    assert_eq!(bits(&got.v), bits(&want.v), "v cache: {what}");

    // The CPU twin, run by run.
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
    for (&(weights, head0, heads), raw) in runs.iter().zip(&parts) {
        gemv_plan::emulate_qkv(
            weights,
            raw,
            HEADS,
            (head0, heads),
            K,
            &x_host,
            n,
            host_tokens,
            round,
            &mut twin,
        );
    }
    let f32_bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
    assert_eq!(bits(&got.q), f32_bits(&twin.q), "twin q: {what}");
    assert_eq!(bits(&got.k), f32_bits(&twin.k_cache), "twin k: {what}");
    assert_eq!(bits(&got.v), f32_bits(&twin.v_cache), "twin v: {what}");
}

fn qkv_body<T: TestDtype>(gpu: &GpuContext, rng: &mut Rng) {
    let (hd, theta) = (HEADS.head_dim, 1_000_000.0);
    let table = RopeTable::new(gpu, hd, theta, MAX_POSITIONS).expect("table");
    let host = host_table(hd, theta, MAX_POSITIONS).expect("host table");
    let (nh, nkv) = (HEADS.num_heads, HEADS.num_kv_heads);
    let packed = |q: QuantType| GemvWeights::Packed(q);
    // A bf16 checkpoint (one run of every head); packed q | k | v tensors of mixed formats, as
    // Q4_K_M mixes Q4_K and Q6_K; the other formats.
    let layouts: [&Runs; 3] = [
        &[(GemvWeights::Bf16, 0, nh + 2 * nkv)],
        &[
            (packed(QuantType::Q4K), 0, nh),
            (packed(QuantType::Q4K), nh, nkv),
            (packed(QuantType::Q6K), nh + nkv, nkv),
        ],
        &[
            (packed(QuantType::Q5_0), 0, nh),
            (packed(QuantType::Int4), nh, nkv),
            (packed(QuantType::Q8_0), nh + nkv, nkv),
        ],
    ];
    for runs in layouts {
        for n in [1, 3, 8] {
            for with_bias in [true, false] {
                qkv_case::<T>(gpu, rng, runs, n, with_bias, &table, &host);
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
    let w = up(&gpu, &vec![0u8; (rows + 1) * k * 2]);
    let x = up(&gpu, &vec![bf16::ZERO; k + 8]);
    let call = |w: CudaView<'_, u8>, x: CudaView<'_, bf16>| {
        let mut y = up(&gpu, &vec![0f32; rows]);
        let out = OutColumns { ld: rows, col0: 0 };
        gemv(
            &gpu,
            GemvWeights::Bf16,
            &w,
            rows,
            k,
            &x,
            1,
            &mut y.as_view_mut(),
            out,
        )
    };
    let bytes = rows * k * 2;
    // A bf16 matrix that starts 2 bytes in: its rows are not on 16-byte boundaries.
    let param = |e: CudaError| match e {
        CudaError::InvalidArgument { param, .. } => param,
        other => panic!("not an argument error: {other}"),
    };
    let err = call(w.slice(2..2 + bytes), x.slice(..k)).expect_err("misaligned w");
    assert_eq!(param(err), "w");
    let err = call(w.slice(..bytes), x.slice(1..k + 1)).expect_err("misaligned x");
    assert_eq!(param(err), "x");
    assert!(
        call(w.slice(..bytes - 2), x.slice(..k)).is_err(),
        "a short matrix"
    );
    call(w.slice(..bytes), x.slice(..k)).expect("aligned");
}
