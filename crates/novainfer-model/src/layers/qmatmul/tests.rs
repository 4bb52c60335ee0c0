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
use super::Isas;
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
/// the AVX2, AVX-VNNI, AVX-512 and AMX paths agree bit for bit.
#[test]
fn rows_are_batch_invariant_and_isa_independent() {
    let int4 = crate::int4::GroupedInt4::quantize(29, 1024, &random(29 * 1024, 5)).expect("q");
    let int4 = PackedMatrix::from_int4(&int4).expect("AVX2 is here");
    let mut all: Vec<(String, PackedMatrix, usize)> = vec![("int4".into(), int4, 1024)];
    for (dtype, k) in [
        (GgmlDType::Q5_0, 896),
        (GgmlDType::Q8_0, 896),
        (GgmlDType::Q4K, 4864),
        (GgmlDType::Q6K, 1536),
    ] {
        all.push((format!("{dtype:?}"), case(dtype, 29, k).packed, k));
    }
    for (name, mut packed, k) in all {
        let m = 23;
        let x = random(m * k, 99);
        let batch = packed.matmul(&x, m);
        for r in 0..m {
            let alone = packed.matmul(&x[r * k..(r + 1) * k], 1);
            let row = &batch[r * 29..(r + 1) * 29];
            assert!(
                alone
                    .iter()
                    .zip(row)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{name}: row {r} differs between m={m} and m=1"
            );
        }
        for isa in ISAS {
            if !supports(isa) {
                continue;
            }
            packed.isas = Isas::all(isa);
            let other = packed.matmul(&x, m);
            assert!(
                other
                    .iter()
                    .zip(&batch)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{name}: {isa:?} differs from the detected ISA"
            );
        }
    }
}

/// Which regime's ISA runs a work item: by its rows up to [`super::FEW_ROWS`] (a prefill's
/// last chunk may be short), past them by the product's rows.
#[test]
fn work_items_run_their_regimes_isa() {
    let isas = Isas {
        one: IsaChoice::Avx2,
        few: IsaChoice::Vnni256,
        batch: IsaChoice::Avx512,
        many: IsaChoice::Amx,
    };
    for (m, rows, want) in [
        (1, 1, IsaChoice::Avx2),
        (8, 8, IsaChoice::Vnni256),
        (9, 9, IsaChoice::Avx512),
        (super::BATCH_ROWS, 29, IsaChoice::Avx512),
        (super::BATCH_ROWS + 1, super::BATCH_ROWS + 1, IsaChoice::Amx),
        (512, 29, IsaChoice::Amx),
        (512, 5, IsaChoice::Vnni256),
        (513, 1, IsaChoice::Avx2),
    ] {
        assert_eq!(isas.for_item(m, rows), want, "m={m}, rows={rows}");
    }
}

/// Every implementation; a test runs those [`supports`] says this CPU has.
const ISAS: [IsaChoice; 4] = [
    IsaChoice::Avx2,
    IsaChoice::Vnni256,
    IsaChoice::Avx512,
    IsaChoice::Amx,
];

fn supports(isa: IsaChoice) -> bool {
    let avx512 = is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vnni");
    match isa {
        IsaChoice::Avx2 => true,
        IsaChoice::Vnni256 => is_x86_feature_detected!("avxvnni"),
        IsaChoice::Avx512 => avx512,
        IsaChoice::Amx => avx512 && super::amx::available(),
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
    let int4 = crate::int4::GroupedInt4::quantize(19, k, &random(19 * k, 8)).expect("q");
    let int4 = PackedMatrix::from_int4(&int4).expect("AVX2 is here");
    let mut mats: Vec<&PackedMatrix> = cases.iter().map(|c| &c.packed).collect();
    // MAX_MANY at once: Q5_0 and int4 share the Q8_0 activations.
    mats[2] = &int4;
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

/// Outputs are not zeroed before the products: every element must be written, whatever the
/// buffer held (here NaN), on every ISA, with a partial column group and partial row tiles.
#[test]
fn products_overwrite_every_output() {
    let (n, k) = (29, 512);
    for dtype in [
        GgmlDType::Q5_0,
        GgmlDType::Q8_0,
        GgmlDType::Q4K,
        GgmlDType::Q6K,
    ] {
        let mut packed = case(dtype, n, k).packed;
        for isa in ISAS.into_iter().filter(|&isa| supports(isa)) {
            packed.isas = Isas::all(isa);
            for m in [1, 5, 37] {
                let x = random(m * k, 5 + m as u64);
                let want = packed.matmul(&x, m);
                let mut out = vec![f32::NAN; m * n];
                super::matmul_many_into(&[&packed], &x, m, &mut [&mut out]);
                assert_bits_equal(&out, &want, &format!("{dtype:?} {isa:?} m={m}"));
            }
        }
    }
}

/// Raw ggml K-quant rows whose every byte is random (so scales reach -128 and 127 and the
/// quants 0 and their maximum), with block scales `d`/`dmin` kept small and finite.
fn raw_k_rows(n: usize, k: usize, block_bytes: usize, f16_at: &[usize], seed: u64) -> Vec<u8> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut raw: Vec<u8> = (0..n * k / 256 * block_bytes)
        .map(|_| rng.random())
        .collect();
    for block in raw.chunks_exact_mut(block_bytes) {
        for &at in f16_at {
            let d = half::f16::from_f32(rng.random_range(-0.01f32..0.01));
            block[at..at + 2].copy_from_slice(&d.to_le_bytes());
        }
    }
    raw
}

fn packed_from_raw(
    format: super::Format,
    raw: &[u8],
    n: usize,
    k: usize,
    isa: IsaChoice,
) -> PackedMatrix {
    let (group_bytes, data) = match format {
        super::Format::Q6K => super::pack::<super::q6_k::Q6K>(raw, n, k),
        super::Format::Q4K => super::pack::<super::q4_k::Q4K>(raw, n, k),
        _ => unreachable!("K-quant formats only"),
    };
    PackedMatrix {
        format,
        isas: Isas::all(isa),
        n,
        k,
        group_bytes,
        data,
    }
}

/// Activations whose rows hit the quantizer's extremes: a row of equal values quantizes
/// to ±127 everywhere (the largest i16 pair sums the AVX2 kernels can see), the rest random.
fn extreme_acts(m: usize, k: usize, seed: u64) -> Vec<f32> {
    let mut x = random(m * k, seed);
    for (r, row) in x.chunks_exact_mut(k).enumerate() {
        match r % 4 {
            0 => row.fill(1.0),
            1 => row.fill(-0.5),
            _ => {}
        }
    }
    x
}

/// The scalar definition of the Q6_K product: per (row, column, block) the exact integer
/// `Σ_g sc_g·Σ (q - 32)·a`, then `acc = fma(isum, d_w·d_a, acc)` block by block.
fn reference_q6k(raw: &[u8], n: usize, k: usize, x: &[f32], m: usize) -> Vec<f32> {
    use super::activation::{ActKind, QuantizedActs};
    let acts = QuantizedActs::new(ActKind::Q8K, x, m, k);
    let nb = k / 256;
    let mut out = vec![0f32; m * n];
    for r in 0..m {
        for j in 0..n {
            let mut acc = 0f32;
            for b in 0..nb {
                let blk = &raw[(j * nb + b) * 210..(j * nb + b + 1) * 210];
                let q = super::q6_k::decode(blk);
                let a = &acts.qs[r * k + 256 * b..r * k + 256 * (b + 1)];
                let isum: i32 = (0..16)
                    .map(|g| {
                        let sc = i32::from(blk[192 + g] as i8);
                        let dot: i32 = (16 * g..16 * g + 16)
                            .map(|i| (i32::from(q[i]) - 32) * i32::from(a[i]))
                            .sum();
                        sc * dot
                    })
                    .sum();
                let dw = half::f16::from_le_bytes([blk[208], blk[209]]).to_f32();
                acc = (isum as f32).mul_add(dw * acts.d[r * nb + b], acc);
            }
            out[r * n + j] = acc;
        }
    }
    out
}

/// The scalar definition of the Q4_K product: exact `isum = Σ_s sc_s·Σ q·a` and
/// `imin = Σ_s m_s·Σa_s`, then `acc = fma(isum, d·d_a, acc)`, `acc = acc - imin·(dmin·d_a)`.
fn reference_q4k(raw: &[u8], n: usize, k: usize, x: &[f32], m: usize) -> Vec<f32> {
    use super::activation::{ActKind, QuantizedActs};
    let acts = QuantizedActs::new(ActKind::Q8K, x, m, k);
    let nb = k / 256;
    let mut out = vec![0f32; m * n];
    for r in 0..m {
        for j in 0..n {
            let mut acc = 0f32;
            for b in 0..nb {
                let blk = &raw[(j * nb + b) * 144..(j * nb + b + 1) * 144];
                let a = &acts.qs[r * k + 256 * b..r * k + 256 * (b + 1)];
                let (mut isum, mut imin) = (0i32, 0i32);
                for s in 0..8 {
                    let (sc, mn) = super::q4_k::scale_min(s, &blk[4..16]);
                    let (p, high) = (s / 2, s % 2 == 1);
                    let mut dot = 0i32;
                    let mut asum = 0i32;
                    for l in 0..32 {
                        let byte = blk[16 + 32 * p + l];
                        let q = if high { byte >> 4 } else { byte & 15 };
                        let av = i32::from(a[32 * s + l]);
                        dot += i32::from(q) * av;
                        asum += av;
                    }
                    isum += i32::from(sc) * dot;
                    imin += i32::from(mn) * asum;
                }
                let dw = half::f16::from_le_bytes([blk[0], blk[1]]).to_f32();
                let dmin = half::f16::from_le_bytes([blk[2], blk[3]]).to_f32();
                let da = acts.d[r * nb + b];
                acc = (isum as f32).mul_add(dw * da, acc);
                acc = (-(imin as f32)).mul_add(dmin * da, acc);
            }
            out[r * n + j] = acc;
        }
    }
    out
}

fn assert_bits_equal(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            g.to_bits() == w.to_bits(),
            "{what}: element {i}: kernel {g}, reference {w}"
        );
    }
}

/// Every ISA path's K-quant product equals the scalar definition bit for bit, on raw blocks
/// with extreme scales and quants, activations at ±127, tile heights and their tails, and
/// column counts that leave partial groups: a last group of 5 columns (one 8-column half)
/// and of 12 (a full half and a partial one). A single row runs the 16-column decode
/// kernels (`row_avx2` on AVX2), more rows the multi-row tiles (on AVX2 both formats' own
/// `tile_avx2`: m = 2 to 8 in the few-row streaming walk, as one tile of m rows or, for 7 and
/// 8, tiles of 4 and 3 or 4; m = 9 and 13 in the prefill driver's 6-row tiles and their 2-
/// and 1-row tails; on AMX, m = 16 to 200 in single and paired 16-row tiles, the rows past
/// them on AVX-512).
#[test]
fn k_quant_kernels_equal_the_scalar_reference_bit_for_bit() {
    let k = 1536;
    for (format, block_bytes, f16_at, quants, n) in [
        (super::Format::Q6K, 210, &[208][..], 0..192, 37),
        (super::Format::Q6K, 210, &[208][..], 0..192, 28),
        (super::Format::Q4K, 144, &[0, 2][..], 16..144, 21),
        (super::Format::Q4K, 144, &[0, 2][..], 16..144, 44),
    ] {
        let mut raw = raw_k_rows(n, k, block_bytes, f16_at, 5 + n as u64);
        // Every quant at its maximum in the first block of two columns (one per half): against
        // the ±127 rows, the largest i16 sums the AVX2 kernels accumulate.
        for j in [0, 9] {
            raw[j * (k / 256) * block_bytes..][quants.clone()].fill(0xFF);
        }
        // 200 rows: AMX's 160-row chunks at this k, then a pair of tiles and 8 rows.
        for m in [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 16, 33, 48, 200] {
            let x = extreme_acts(m, k, 31 + m as u64);
            let want = match format {
                super::Format::Q6K => reference_q6k(&raw, n, k, &x, m),
                _ => reference_q4k(&raw, n, k, &x, m),
            };
            for isa in ISAS {
                if !supports(isa) {
                    continue;
                }
                let packed = packed_from_raw(format, &raw, n, k, isa);
                let got = packed.matmul(&x, m);
                assert_bits_equal(&got, &want, &format!("{format:?} {isa:?} m={m}"));
                // Each row alone (the decode kernels), random rows included: m = 1 by
                // itself only sees the constant row 0.
                for r in 1..m.min(4) {
                    let got = packed.matmul(&x[r * k..(r + 1) * k], 1);
                    let what = format!("{format:?} {isa:?} row {r} of m={m} alone");
                    assert_bits_equal(&got, &want[r * n..(r + 1) * n], &what);
                }
            }
        }
    }
}

/// The scalar definition of the Q5_0 / Q8_0 products: per (row, column, block) the exact
/// integer `Σ w·a` (Q5_0: `w = q - 16`), then `acc = fma(isum, d_w·d_a, acc)` block by block.
fn reference_q8_0_style(
    dtype: GgmlDType,
    raw: &[u8],
    n: usize,
    k: usize,
    x: &[f32],
    m: usize,
) -> Vec<f32> {
    use super::activation::{ActKind, QuantizedActs};
    let acts = QuantizedActs::new(ActKind::Q8_0, x, m, k);
    let (nb, bytes) = (k / 32, if dtype == GgmlDType::Q5_0 { 22 } else { 34 });
    let mut out = vec![0f32; m * n];
    for r in 0..m {
        for j in 0..n {
            let mut acc = 0f32;
            for b in 0..nb {
                let blk = &raw[(j * nb + b) * bytes..(j * nb + b + 1) * bytes];
                let w: Vec<i32> = if dtype == GgmlDType::Q5_0 {
                    let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
                    (0..32)
                        .map(|i| {
                            let nib = if i < 16 {
                                blk[6 + i] & 15
                            } else {
                                blk[6 + i - 16] >> 4
                            };
                            i32::from(nib | ((((qh >> i) & 1) as u8) << 4)) - 16
                        })
                        .collect()
                } else {
                    blk[2..34].iter().map(|&v| i32::from(v as i8)).collect()
                };
                let a = &acts.qs[r * k + 32 * b..r * k + 32 * (b + 1)];
                let isum: i32 = w.iter().zip(a).map(|(&w, &a)| w * i32::from(a)).sum();
                let dw = half::f16::from_le_bytes([blk[0], blk[1]]).to_f32();
                acc = (isum as f32).mul_add(dw * acts.d[r * nb + b], acc);
            }
            out[r * n + j] = acc;
        }
    }
    out
}

/// Q5_0 and Q8_0 on every ISA path equal their scalar definition bit for bit, at every row
/// count the few-row streaming walk takes on AVX2 (2 to 8, as a speculative verification step
/// does) and past it, with activations at ±127, saturated weights in the first block of two
/// columns and a last group of 5 / 12 columns.
#[test]
fn q5_0_and_q8_0_kernels_equal_the_scalar_reference_bit_for_bit() {
    let k = 896;
    for (dtype, n) in [
        (GgmlDType::Q5_0, 37),
        (GgmlDType::Q5_0, 28),
        (GgmlDType::Q8_0, 21),
        (GgmlDType::Q8_0, 44),
    ] {
        let w = Tensor::from_vec(random(n * k, 3 + n as u64), (n, k), &Device::Cpu).expect("w");
        let q = QTensor::quantize(&w, dtype).expect("quantize");
        let mut raw = q.data().expect("raw").into_owned();
        let bytes = if dtype == GgmlDType::Q5_0 { 22 } else { 34 };
        // Largest magnitudes: Q5_0 all 31 (w = 15), Q8_0 all -128.
        for j in [0, 9] {
            let blk = &mut raw[j * (k / 32) * bytes..][..bytes];
            if dtype == GgmlDType::Q5_0 {
                blk[2..22].fill(0xFF);
            } else {
                blk[2..34].fill(0x80);
            }
        }
        let (format, (group_bytes, data)) = match dtype {
            GgmlDType::Q5_0 => (
                super::Format::Q5_0,
                super::pack::<super::q5_0::Q5_0>(&raw, n, k),
            ),
            _ => (
                super::Format::Q8_0,
                super::pack::<super::q8_0::Q8_0>(&raw, n, k),
            ),
        };
        let mut packed = PackedMatrix {
            format,
            isas: Isas::all(IsaChoice::Avx2),
            n,
            k,
            group_bytes,
            data,
        };
        for m in [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 16, 33, 48] {
            let x = extreme_acts(m, k, 41 + m as u64);
            let want = reference_q8_0_style(dtype, &raw, n, k, &x, m);
            for isa in ISAS {
                if !supports(isa) {
                    continue;
                }
                packed.isas = Isas::all(isa);
                let got = packed.matmul(&x, m);
                assert_bits_equal(&got, &want, &format!("{dtype:?} n={n} {isa:?} m={m}"));
            }
        }
    }
}

/// Grouped int4 rows whose every nibble and zero point is random (zero points over GPTQ's
/// whole 0..=16), scales small, positive and negative.
fn raw_int4_rows(n: usize, k: usize, seed: u64) -> Vec<u8> {
    use crate::int4::{encode_nibbles, GROUP_K};
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut raw = Vec::new();
    for _ in 0..n * k / GROUP_K {
        let s: f32 = rng.random_range(-0.01f32..0.01);
        raw.extend_from_slice(&s.to_le_bytes());
        raw.push(rng.random_range(0..=16u8));
        let q: Vec<u8> = (0..GROUP_K).map(|_| rng.random_range(0..16u8)).collect();
        raw.extend(encode_nibbles(&q));
    }
    raw
}

/// The scalar definition of the grouped int4 product: per (row, column, 32-value sub-block)
/// the exact `Σ q·a − z·Σa`, then `acc = fma(isum, s·d_a, acc)` sub-block by sub-block.
fn reference_int4(w: &crate::int4::GroupedInt4, x: &[f32], m: usize) -> Vec<f32> {
    use super::activation::{ActKind, QuantizedActs};
    let (n, k) = (w.rows(), w.cols());
    let acts = QuantizedActs::new(ActKind::Q8_0, x, m, k);
    let mut out = vec![0f32; m * n];
    for r in 0..m {
        for j in 0..n {
            let mut acc = 0f32;
            for sb in 0..k / 32 {
                let (s, z, _) = w.stored_parts(j, 32 * sb);
                let a = &acts.qs[r * k + 32 * sb..r * k + 32 * (sb + 1)];
                let dot: i32 = (0..32)
                    .map(|i| i32::from(w.stored_parts(j, 32 * sb + i).2) * i32::from(a[i]))
                    .sum();
                let asum: i32 = a.iter().map(|&v| i32::from(v)).sum();
                let isum = dot - i32::from(z) * asum;
                acc = (isum as f32).mul_add(s * acts.d[r * (k / 32) + sb], acc);
            }
            out[r * n + j] = acc;
        }
    }
    out
}

/// Grouped int4 on every ISA path equals its scalar definition bit for bit: single rows (the
/// decode kernels), 2 to 8 rows (AVX2's few-row streaming walk), 9 and 13 (the prefill
/// tiles and their tails), activations at ±127 against weights all 15 with zero points 0 and
/// 16 (the largest integer sums, and the AVX2 tile's largest i16 sums), a last group of 5 or
/// 12 columns, and k of 1, 7 and 14 groups (slabs of 1024 values and their tail).
#[test]
fn int4_kernels_equal_the_scalar_reference_bit_for_bit() {
    use crate::int4::{GroupedInt4, BLOCK_BYTES, GROUP_K};
    for (n, k) in [(37, 896), (28, 1792), (21, 128)] {
        let mut raw = raw_int4_rows(n, k, 11 + n as u64);
        for (j, z) in [(0, 0u8), (9, 16u8)] {
            let block = &mut raw[j * (k / GROUP_K) * BLOCK_BYTES..][..BLOCK_BYTES];
            block[4] = z;
            block[5..].fill(0xFF);
        }
        let w = GroupedInt4::from_blocks("t", n, k, raw).expect("valid");
        let mut packed = PackedMatrix::from_int4(&w).expect("AVX2 is here");
        for m in [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 16, 33, 48] {
            let x = extreme_acts(m, k, 51 + m as u64);
            let want = reference_int4(&w, &x, m);
            for isa in ISAS {
                if !supports(isa) {
                    continue;
                }
                packed.isas = Isas::all(isa);
                let got = packed.matmul(&x, m);
                assert_bits_equal(&got, &want, &format!("int4 n={n} k={k} {isa:?} m={m}"));
                for r in 1..m.min(4) {
                    let got = packed.matmul(&x[r * k..(r + 1) * k], 1);
                    let what = format!("int4 n={n} {isa:?} row {r} of m={m} alone");
                    assert_bits_equal(&got, &want[r * n..(r + 1) * n], &what);
                }
            }
        }
    }
}

/// Against the f32 product with the dequantized weights: only the activations' int8
/// rounding separates them (the bound of [`check`]).
#[test]
fn int4_matches_the_dequantized_product() {
    let (n, k) = (45, 1536);
    let w = crate::int4::GroupedInt4::quantize(n, k, &random(n * k, 17)).expect("quantize");
    let dequant = w.dequantize();
    let packed = PackedMatrix::from_int4(&w).expect("AVX2 is here");
    for m in [1, 6, 40] {
        let x = random(m * k, 300 + m as u64);
        let ours = packed.matmul(&x, m);
        for r in 0..m {
            let xr = &x[r * k..(r + 1) * k];
            let steps: Vec<f32> = xr
                .chunks(32)
                .flat_map(|b| {
                    std::iter::repeat_n(b.iter().fold(0f32, |a, v| a.max(v.abs())) / 127.0, 32)
                })
                .collect();
            for j in 0..n {
                let wr = &dequant[j * k..(j + 1) * k];
                let exact: f64 = wr
                    .iter()
                    .zip(xr)
                    .map(|(&w, &v)| f64::from(w) * f64::from(v))
                    .sum();
                let magnitude: f32 = wr.iter().zip(xr).map(|(w, v)| (w * v).abs()).sum();
                let act_err: f32 = wr.iter().zip(&steps).map(|(w, d)| w.abs() * 0.57 * d).sum();
                let o = ours[r * n + j];
                assert!(
                    (f64::from(o) - exact).abs() <= f64::from(act_err + 2e-5 * magnitude),
                    "m={m} ({r},{j}): ours {o} f64 {exact} bound {act_err}"
                );
            }
        }
    }
}

/// Prefill products of the demo models' shapes (512 rows) on each ISA this CPU has: best of
/// five, milliseconds. `RAYON_NUM_THREADS=2 cargo test --release -p novainfer-model --lib
/// prefill_shapes_per_isa -- --ignored --nocapture`
#[test]
#[ignore = "timing printout, run by hand"]
fn prefill_shapes_per_isa() {
    let m: usize = std::env::var("NOVAINFER_PREFILL_ROWS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(512);
    for (dtype, n, k, what) in [
        (GgmlDType::Q4K, 8960, 1536, "1.5B ffn_gate"),
        (GgmlDType::Q4K, 1536, 1536, "1.5B attn_q"),
        (GgmlDType::Q4K, 1536, 8960, "1.5B ffn_down (Q4_K layers)"),
        (GgmlDType::Q6K, 1536, 8960, "1.5B ffn_down"),
        (GgmlDType::Q5_0, 4864, 896, "0.5B ffn_gate"),
        (GgmlDType::Q8_0, 896, 896, "0.5B attn_q"),
    ] {
        let mut packed = case(dtype, n, k).packed;
        let x = random(m * k, 7);
        let mut line = format!("{what} {dtype:?} {n}x{k}, m={m}:");
        let only = std::env::var("NOVAINFER_QMATMUL_ISA").ok();
        for isa in ISAS {
            if !supports(isa) || only.as_deref().is_some_and(|o| o != isa.name()) {
                continue;
            }
            packed.isas = Isas::all(isa);
            let mut best = f64::MAX;
            // The output reused, as the engine's buffers are (a fresh 18 MB one faults its
            // pages in on every run).
            let mut out = Vec::new();
            for _ in 0..5 {
                let t = std::time::Instant::now();
                packed.matmul_into(&x, m, &mut out);
                std::hint::black_box(&out);
                best = best.min(t.elapsed().as_secs_f64() * 1e3);
            }
            let gmacs = (m * n * k) as f64 / best / 1e6;
            line += &format!(" {}: {best:.2} ms ({gmacs:.0} GMAC/s)", isa.name());
        }
        println!("{line}");
    }
}
