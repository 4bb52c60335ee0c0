//! kernels/dequant.cu run by the emulator: every `dequant_*` and `embed_*` kernel, f32 and bf16
//! outputs, on random blocks (every bit of the quants and scales random, f16 scales from
//! subnormal to large, negative ones, int4 zero points past 15, FP8 subnormal codes), launched as
//! `ops::dequant::dequantize` and `ops::embedding::embedding_quant` launch them. The kernels
//! promise candle's `to_float` (and `GroupedInt4` / `Fp8Blocks::dequantize`) bit for bit, so the
//! reference here is a decoder written from ggml's block loops in candle's order of operations
//! (not the kernels' per-value indexing), and the GEMV twin's chunks (`gemv_plan::chunk`:
//! `a·q − b`) are checked against it too; a bf16 output is that value rounded once.

mod common;

use common::{Aligned, Dtype, Rng};
use half::{bf16, f16};
use novainfer_cuda::gemv_plan::{chunk, GemvWeights, CHUNK};
use novainfer_cuda::quant_type::{e4m3_to_f32, QuantType};
use novainfer_cuemu::kernels::dequant::*;
use novainfer_cuemu::{launch, Dim3};

type DequantFn<T> = unsafe extern "C-unwind" fn(*const u8, *mut T, i64);
type EmbedFn<T> = unsafe extern "C-unwind" fn(*const u32, *const u8, *mut T, i32, i32);

/// An output dtype: its kernels, and the bits a stored f32 value becomes.
trait Out: Dtype {
    const SENTINEL: Self;
    fn dequant(q: QuantType) -> DequantFn<Self>;
    fn embed(q: QuantType) -> EmbedFn<Self>;
    /// What the kernel stores for `v`, as the f32 it reads back (bits compared).
    fn stored(v: f32) -> u32;
    fn bits(self) -> u32;
}

impl Out for f32 {
    const SENTINEL: Self = -7.0;
    fn dequant(q: QuantType) -> DequantFn<Self> {
        match q {
            QuantType::Q4K => dequant_q4_k_f32,
            QuantType::Q5_0 => dequant_q5_0_f32,
            QuantType::Q6K => dequant_q6_k_f32,
            QuantType::Q8_0 => dequant_q8_0_f32,
            QuantType::Int4 => dequant_int4_f32,
            QuantType::Fp8 => dequant_fp8_f32,
        }
    }
    fn embed(q: QuantType) -> EmbedFn<Self> {
        match q {
            QuantType::Q4K => embed_q4_k_f32,
            QuantType::Q5_0 => embed_q5_0_f32,
            QuantType::Q6K => embed_q6_k_f32,
            QuantType::Q8_0 => embed_q8_0_f32,
            QuantType::Int4 => embed_int4_f32,
            QuantType::Fp8 => embed_fp8_f32,
        }
    }
    fn stored(v: f32) -> u32 {
        v.to_bits()
    }
    fn bits(self) -> u32 {
        self.to_bits()
    }
}

/// bf16 as the kernels take it: its bit pattern.
impl Out for u16 {
    const SENTINEL: Self = 0xC0E0; // -7.0
    fn dequant(q: QuantType) -> DequantFn<Self> {
        match q {
            QuantType::Q4K => dequant_q4_k_bf16,
            QuantType::Q5_0 => dequant_q5_0_bf16,
            QuantType::Q6K => dequant_q6_k_bf16,
            QuantType::Q8_0 => dequant_q8_0_bf16,
            QuantType::Int4 => dequant_int4_bf16,
            QuantType::Fp8 => dequant_fp8_bf16,
        }
    }
    fn embed(q: QuantType) -> EmbedFn<Self> {
        match q {
            QuantType::Q4K => embed_q4_k_bf16,
            QuantType::Q5_0 => embed_q5_0_bf16,
            QuantType::Q6K => embed_q6_k_bf16,
            QuantType::Q8_0 => embed_q8_0_bf16,
            QuantType::Int4 => embed_int4_bf16,
            QuantType::Fp8 => embed_fp8_bf16,
        }
    }
    fn stored(v: f32) -> u32 {
        bf16::from_f32(v).to_f32().to_bits()
    }
    fn bits(self) -> u32 {
        bf16::from_bits(self).to_f32().to_bits()
    }
}

/// A random f16 scale: mostly normal values of either sign around GGUF's, sometimes a
/// subnormal, zero or a large one.
fn f16_scale(rng: &mut Rng) -> [u8; 2] {
    let v = match rng.below(8) {
        0 => f16::from_bits(rng.below(0x400) as u16 | if rng.below(2) == 0 { 0 } else { 0x8000 }),
        1 => f16::from_f32(rng.f32(3000.0)),
        2 if rng.below(4) == 0 => f16::ZERO,
        _ => f16::from_f32(rng.f32(0.05)),
    };
    v.to_le_bytes()
}

/// A random f32 scale (int4, FP8 blocks).
fn f32_scale(rng: &mut Rng) -> [u8; 4] {
    let v = match rng.below(8) {
        0 => f32::from_bits(rng.below(1 << 23) as u32), // subnormal
        1 => rng.f32(100.0),
        _ => rng.f32(0.02),
    };
    v.to_le_bytes()
}

/// `blocks` random blocks of `q`: random quants and scale bits, sane scales.
fn random_blocks(q: QuantType, blocks: usize, rng: &mut Rng) -> Vec<u8> {
    let bb = q.block_bytes();
    let mut raw: Vec<u8> = (0..blocks * bb).map(|_| rng.next() as u8).collect();
    for b in raw.chunks_exact_mut(bb) {
        match q {
            QuantType::Q8_0 | QuantType::Q5_0 => b[..2].copy_from_slice(&f16_scale(rng)),
            QuantType::Q4K => {
                b[..2].copy_from_slice(&f16_scale(rng));
                b[2..4].copy_from_slice(&f16_scale(rng));
            }
            QuantType::Q6K => b[208..210].copy_from_slice(&f16_scale(rng)),
            QuantType::Int4 => {
                b[..4].copy_from_slice(&f32_scale(rng));
                // Real zero points are 0..16; the format holds a byte.
                if rng.below(4) != 0 {
                    b[4] &= 0x0F;
                }
            }
            QuantType::Fp8 => {
                b[..4].copy_from_slice(&f32_scale(rng));
                // The loaders refuse the NaN codes (S.1111.111).
                for c in &mut b[4..] {
                    if *c & 0x7F == 0x7F {
                        *c = 0x7E;
                    }
                }
            }
        }
    }
    raw
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

fn f32_at(b: &[u8]) -> f32 {
    f32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

/// ggml's `get_scale_min_k4`, written out again.
fn scale_min(j: usize, s: &[u8]) -> (f32, f32) {
    let (sc, m) = if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    };
    (f32::from(sc), f32::from(m))
}

/// One block's values, by ggml's `dequantize_row_*` loops in candle's f32 order.
fn decode_block(q: QuantType, b: &[u8]) -> Vec<f32> {
    let mut y = Vec::with_capacity(q.block_values());
    match q {
        QuantType::Q8_0 => {
            let d = f16_at(b, 0);
            y.extend(b[2..34].iter().map(|&v| f32::from(v as i8) * d));
        }
        QuantType::Q5_0 => {
            let d = f16_at(b, 0);
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            let qs = &b[6..22];
            let mut hi = vec![0f32; 16];
            for j in 0..16 {
                let xh0 = ((qh >> j) << 4) & 0x10;
                let xh1 = (qh >> (j + 12)) & 0x10;
                let x0 = (u32::from(qs[j] & 0x0F) | xh0) as i32 - 16;
                let x1 = (u32::from(qs[j] >> 4) | xh1) as i32 - 16;
                y.push(x0 as f32 * d);
                hi[j] = x1 as f32 * d;
            }
            y.extend(hi);
        }
        QuantType::Q4K => {
            let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
            let (scales, qs) = (&b[4..16], &b[16..144]);
            for (part, q32) in qs.chunks_exact(32).enumerate() {
                let (sc1, m1) = scale_min(2 * part, scales);
                let (sc2, m2) = scale_min(2 * part + 1, scales);
                let (d1, m1, d2, m2) = (d * sc1, dmin * m1, d * sc2, dmin * m2);
                y.extend(q32.iter().map(|&v| d1 * f32::from(v & 0xF) - m1));
                y.extend(q32.iter().map(|&v| d2 * f32::from(v >> 4) - m2));
            }
        }
        QuantType::Q6K => {
            let d = f16_at(b, 208);
            y.resize(256, 0.0);
            for h in 0..2 {
                let (ql, qh) = (&b[64 * h..64 * h + 64], &b[128 + 32 * h..128 + 32 * h + 32]);
                let sc = &b[192 + 8 * h..192 + 8 * h + 8];
                for l in 0..32 {
                    let is = l / 16;
                    let q1 = i32::from((ql[l] & 0xF) | (qh[l] & 3) << 4) - 32;
                    let q2 = i32::from((ql[l + 32] & 0xF) | ((qh[l] >> 2) & 3) << 4) - 32;
                    let q3 = i32::from((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4) - 32;
                    let q4 = i32::from((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4) - 32;
                    let s = |i: usize| d * f32::from(sc[i] as i8);
                    y[128 * h + l] = s(is) * q1 as f32;
                    y[128 * h + l + 32] = s(is + 2) * q2 as f32;
                    y[128 * h + l + 64] = s(is + 4) * q3 as f32;
                    y[128 * h + l + 96] = s(is + 6) * q4 as f32;
                }
            }
        }
        QuantType::Int4 => {
            // GroupedInt4::dequantize: s · (q − z), four sub-blocks of 32 (low nibbles first).
            let (s, z) = (f32_at(b), i32::from(b[4]));
            for sub in b[5..69].chunks_exact(16) {
                y.extend(sub.iter().map(|&v| s * (i32::from(v & 0xF) - z) as f32));
                y.extend(sub.iter().map(|&v| s * (i32::from(v >> 4) - z) as f32));
            }
        }
        QuantType::Fp8 => {
            let s = f32_at(b);
            y.extend(b[4..132].iter().map(|&c| e4m3_to_f32(c) * s));
        }
    }
    y
}

fn decode(q: QuantType, raw: &[u8]) -> Vec<f32> {
    raw.chunks_exact(q.block_bytes())
        .flat_map(|b| decode_block(q, b))
        .collect()
}

/// `dequant_*` over `raw` on a `grid` of 256-thread blocks (the launcher's: `elementwise`).
fn run_dequant<T: Out>(q: QuantType, raw: &[u8], grid: u32) -> Vec<T> {
    let num_blocks = raw.len() / q.block_bytes();
    let blocks = Aligned::new(raw);
    let mut out = Aligned::new(&vec![T::SENTINEL; num_blocks * q.block_values()]);
    let (b, o) = (blocks.ptr() as usize, out.mut_ptr() as usize);
    let f = T::dequant(q);
    launch(Dim3::x(grid), Dim3::x(256), || unsafe {
        f(b as *const u8, o as *mut T, num_blocks as i64)
    })
    .expect("the dequant launch");
    out.to_vec()
}

/// The launcher's grid: one thread per value, clamped to 65,536 blocks (a grid-stride loop).
fn elementwise(n: usize) -> u32 {
    n.div_ceil(256).clamp(1, 65_536) as u32
}

fn check_dequant<T: Out>(q: QuantType, raw: &[u8], want: &[f32], grid: u32) {
    let got = run_dequant::<T>(q, raw, grid);
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(
            g.bits(),
            T::stored(*w),
            "{q:?} {} grid {grid}: value {i} ({} vs {w})",
            T::NAME,
            f32::from_bits(g.bits())
        );
    }
}

#[test]
fn every_dequant_kernel_gives_candles_values_bit_for_bit() {
    let mut rng = Rng(0x0DE0_0A47);
    for q in QuantType::ALL {
        // A few thousand values, not a whole number of 256-thread blocks.
        let blocks = 4100 / q.block_values() + 1;
        let raw = random_blocks(q, blocks, &mut rng);
        let want = decode(q, &raw);
        let n = want.len();
        assert!(
            !n.is_multiple_of(256) || q.block_values() == 256,
            "{q:?}: a ragged last block"
        );
        check_dequant::<f32>(q, &raw, &want, elementwise(n));
        check_dequant::<u16>(q, &raw, &want, elementwise(n));
        // A grid smaller than the values (the launcher's clamp, reached here at a small size):
        // each thread strides over several.
        check_dequant::<f32>(q, &raw, &want, 3);
    }
}

#[test]
fn the_gemv_twins_chunks_are_the_dequantized_values() {
    // gemv_plan::chunk (what the GEMV and the tiled GEMM factor out: w = a·q − b) against the
    // decoder above, on the same random blocks: the twin the gemv_quant tests compare with holds
    // the dequantizer's weights exactly.
    let mut rng = Rng(0xC4_0C5);
    for q in QuantType::ALL {
        let raw = random_blocks(q, 24, &mut rng);
        let want = decode(q, &raw);
        let (bv, bb) = (q.block_values(), q.block_bytes());
        for (b, block) in raw.chunks_exact(bb).enumerate() {
            for c in 0..bv / CHUNK {
                let ch = chunk(GemvWeights::Packed(q), block, c);
                for e in 0..CHUNK {
                    let w = ch.a * ch.q[e] - ch.b;
                    let v = want[b * bv + c * CHUNK + e];
                    assert_eq!(
                        w.to_bits(),
                        v.to_bits(),
                        "{q:?} block {b} chunk {c} value {e}"
                    );
                }
            }
        }
    }
}

fn check_embed<T: Out>(q: QuantType, vocab: usize, hidden: usize, rng: &mut Rng) {
    let row_bytes = hidden / q.block_values() * q.block_bytes();
    let raw = random_blocks(q, vocab * hidden / q.block_values(), rng);
    assert_eq!(raw.len(), vocab * row_bytes);
    let table = decode(q, &raw);
    // Repeats, the first and last rows, and ids past the vocabulary (a zero row).
    let ids: Vec<u32> = vec![
        3,
        0,
        vocab as u32 - 1,
        3,
        17,
        vocab as u32,
        1_000_000,
        u32::MAX,
    ];
    let blocks = Aligned::new(&raw);
    let mut out = Aligned::new(&vec![T::SENTINEL; ids.len() * hidden]);
    let (i, b, o) = (
        ids.as_ptr() as usize,
        blocks.ptr() as usize,
        out.mut_ptr() as usize,
    );
    let f = T::embed(q);
    // The launcher's `per_row(num_tokens, 256)`: a block per token.
    launch(Dim3::x(ids.len() as u32), Dim3::x(256), || unsafe {
        f(
            i as *const u32,
            b as *const u8,
            o as *mut T,
            hidden as i32,
            vocab as i32,
        )
    })
    .expect("the embed launch");
    let got = out.to_vec();
    for (t, &id) in ids.iter().enumerate() {
        for c in 0..hidden {
            let want = if (id as usize) < vocab {
                table[id as usize * hidden + c]
            } else {
                0.0
            };
            assert_eq!(
                got[t * hidden + c].bits(),
                T::stored(want),
                "{q:?} {} hidden {hidden}: token {t} (id {id}) value {c}",
                T::NAME
            );
        }
    }
}

#[test]
fn every_embed_kernel_gives_the_expanded_tables_rows() {
    let mut rng = Rng(0xE3BED);
    for q in QuantType::ALL {
        // The 0.5B's hidden size where the blocks divide it (896 = 7 · 128 = 28 · 32), the 1.5B's
        // for every type (6 rows of 256 values over 256 threads).
        for hidden in [896usize, 1536] {
            if !hidden.is_multiple_of(q.block_values()) {
                continue;
            }
            check_embed::<f32>(q, 40, hidden, &mut rng);
            check_embed::<u16>(q, 40, hidden, &mut rng);
        }
    }
}
