//! Kernels against candle on random data of awkward shapes.
//!
//! Tolerances:
//! * vs candle's `QMatMul` (same int8 activations, same exact int block sums): only
//!   the f32 order of the per-block sums differs, so the error is a few ulps of
//!   `Σ|w·x|` — we allow `2e-5·Σ|w·x|`.
//! * vs the f32 product with dequantized weights: activation rounding moves each
//!   `x` by at most half a step `d = amax_block/127` (plus the f16 rounding of `d`,
//!   ≤ 127·d·2⁻¹¹ for Q8_0), so the error is at most `Σ_k |w_k|·0.57·d_k`.

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::simd::IsaChoice;
use super::PackedMatrix;

fn random(len: usize, seed: u64) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

struct Case {
    packed: PackedMatrix,
    candle: QMatMul,
    dequant: Vec<f32>,
    block: usize,
}

fn case(dtype: GgmlDType, n: usize, k: usize) -> Case {
    let w = Tensor::from_vec(random(n * k, 7 + n as u64), (n, k), &Device::Cpu).expect("w");
    let q = QTensor::quantize(&w, dtype).expect("quantize");
    let dequant = q
        .dequantize(&Device::Cpu)
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1::<f32>())
        .expect("dequantize");
    let packed = PackedMatrix::from_qtensor(&q)
        .expect("pack")
        .expect("supported");
    let block = dtype.block_size();
    let candle = QMatMul::from_qtensor(q).expect("qmatmul");
    Case {
        packed,
        candle,
        dequant,
        block,
    }
}

fn check(dtype: GgmlDType, n: usize, k: usize, ms: &[usize]) {
    let c = case(dtype, n, k);
    for &m in ms {
        let x = random(m * k, 1000 + m as u64);
        let ours = c.packed.matmul(&x, m);
        let xt = Tensor::from_slice(&x, (m, k), &Device::Cpu).expect("x");
        let theirs = c
            .candle
            .forward(&xt)
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1::<f32>())
            .expect("candle");
        for r in 0..m {
            let xr = &x[r * k..(r + 1) * k];
            let steps: Vec<f32> = xr
                .chunks(c.block)
                .flat_map(|b| {
                    let d = b.iter().fold(0f32, |a, v| a.max(v.abs())) / 127.0;
                    std::iter::repeat_n(d, b.len())
                })
                .collect();
            for j in 0..n {
                let wr = &c.dequant[j * k..(j + 1) * k];
                let exact: f64 = wr.iter().zip(xr).map(|(&w, &v)| f64::from(w * v)).sum();
                let magnitude: f32 = wr.iter().zip(xr).map(|(w, v)| (w * v).abs()).sum();
                let act_err: f32 = wr.iter().zip(&steps).map(|(w, d)| w.abs() * 0.57 * d).sum();
                let (o, t) = (ours[r * n + j], theirs[r * n + j]);
                assert!(
                    (o - t).abs() <= 2e-5 * magnitude + 1e-6,
                    "{dtype:?} n={n} k={k} m={m} ({r},{j}): ours {o} candle {t}"
                );
                assert!(
                    (f64::from(o) - exact).abs() <= f64::from(act_err + 2e-5 * magnitude),
                    "{dtype:?} n={n} k={k} m={m} ({r},{j}): ours {o} f32 {exact} bound {act_err}"
                );
            }
        }
    }
}

const MS: [usize; 4] = [1, 3, 17, 64];

#[test]
fn q5_0_matches_candle() {
    check(GgmlDType::Q5_0, 37, 896, &MS);
    check(GgmlDType::Q5_0, 13, 4864, &[1, 17]);
}

#[test]
fn q8_0_matches_candle() {
    check(GgmlDType::Q8_0, 37, 896, &MS);
    check(GgmlDType::Q8_0, 13, 4864, &[1, 17]);
}

#[test]
fn q4_k_matches_candle() {
    check(GgmlDType::Q4K, 37, 4864, &MS);
    check(GgmlDType::Q4K, 5, 1536, &[1, 3]);
}

#[test]
fn q6_k_matches_candle() {
    check(GgmlDType::Q6K, 37, 4864, &MS);
    check(GgmlDType::Q6K, 5, 1536, &[1, 3]);
}

/// Row r of an m-row product equals the product of row r alone, bit for bit, and
/// the AVX2, AVX-VNNI and AVX-512 paths agree bit for bit.
#[test]
fn rows_are_batch_invariant_and_isa_independent() {
    for (dtype, k) in [
        (GgmlDType::Q5_0, 896),
        (GgmlDType::Q8_0, 896),
        (GgmlDType::Q4K, 4864),
        (GgmlDType::Q6K, 1536),
    ] {
        let mut c = case(dtype, 29, k);
        let m = 23;
        let x = random(m * k, 99);
        let batch = c.packed.matmul(&x, m);
        for r in 0..m {
            let alone = c.packed.matmul(&x[r * k..(r + 1) * k], 1);
            let row = &batch[r * 29..(r + 1) * 29];
            assert!(
                alone
                    .iter()
                    .zip(row)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{dtype:?}: row {r} differs between m={m} and m=1"
            );
        }
        for isa in [IsaChoice::Avx2, IsaChoice::Vnni256, IsaChoice::Avx512] {
            if !supports(isa) {
                continue;
            }
            c.packed.isa = isa;
            let other = c.packed.matmul(&x, m);
            assert!(
                other
                    .iter()
                    .zip(&batch)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{dtype:?}: {isa:?} differs from the detected ISA"
            );
        }
    }
}

fn supports(isa: IsaChoice) -> bool {
    match isa {
        IsaChoice::Avx2 => true,
        IsaChoice::Vnni256 => is_x86_feature_detected!("avxvnni"),
        IsaChoice::Avx512 => {
            is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vnni")
        }
    }
}

#[test]
fn products_of_one_input_together_equal_each_alone_bit_for_bit() {
    // Q/K/V and gate/up of the demo model mix formats of both activation kinds.
    let k = 512;
    let cases = [
        case(GgmlDType::Q5_0, 40, k),
        case(GgmlDType::Q4K, 24, k),
        case(GgmlDType::Q8_0, 17, k),
        case(GgmlDType::Q6K, 33, k),
    ];
    let mats: Vec<&PackedMatrix> = cases.iter().map(|c| &c.packed).collect();
    for m in [1, 5, 70] {
        let x = random(m * k, 77 + m as u64);
        let together = super::matmul_many(&mats, &x, m);
        for (w, got) in mats.iter().zip(&together) {
            assert!(
                *got == w.matmul(&x, m),
                "m={m}: a product differs when shared"
            );
        }
    }
}
