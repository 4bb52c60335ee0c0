//! Q6_K weights × Q8_K activations.
//!
//! A ggml Q6_K block covers 256 values in 16 sub-blocks of 16, each with an i8
//! scale: `w = d·sc·(q - 32)`, `q` in 0..=63 split into a low nibble and 2 high
//! bits. We decode `q` at load time and re-split it into planes that one shift and
//! mask turn into chunk `c` (k = 4c..4c+3) of 8 columns. Packed layout, per
//! 8-column group and block (1696 bytes):
//! ```text
//! [ d: f32 × 8 ][ sc: [16 sub][8 col] i8 ][ lo: 32 × 32 B ][ hi: 16 × 32 B ]
//!   lo[i], lane j, byte t: low nibble = q(4i+t) & 15, high nibble = q(128+4i+t) & 15
//!   hi[i], lane j, byte t: bits 2T..2T+1 = q(4(i+16T)+t) >> 4, T = 0..3
//! ```
//! Per (row, column): `isum = Σ_g sc_g·(Σ q·a - 32·Σa_g)` exact in i32, then
//! `acc = fma(f32(isum), dw·da, acc)` per block in order, independent of the tile height.

use std::arch::x86_64::*;

use super::activation::{ActKind, QuantizedActs, K_SUMS, QK_K};
use super::isa::{bcast4, Isa};
use super::Kernel;

pub(super) struct Q6K;

const LO: usize = 32 + 128;
const HI: usize = LO + 1024;

/// The 256 unsigned 6-bit values of one ggml Q6_K block, in k order.
fn decode(raw: &[u8]) -> [u8; QK_K] {
    let (ql, qh) = (&raw[0..128], &raw[128..192]);
    let mut q = [0u8; QK_K];
    for half in 0..2 {
        let (ql, qh, y) = (&ql[64 * half..], &qh[32 * half..], 128 * half);
        for l in 0..32 {
            q[y + l] = (ql[l] & 0xF) | ((qh[l] & 3) << 4);
            q[y + l + 32] = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
            q[y + l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
            q[y + l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
        }
    }
    q
}

impl Kernel for Q6K {
    const ACT: ActKind = ActKind::Q8K;
    const BLOCK_K: usize = QK_K;
    const RAW_BLOCK_BYTES: usize = 210;
    const GROUP_BLOCK_BYTES: usize = HI + 512;

    fn pack_block(cols: &[Option<&[u8]>; 8], out: &mut [u8]) {
        for (j, raw) in cols.iter().enumerate() {
            let Some(raw) = raw else { continue };
            let d = half::f16::from_le_bytes([raw[208], raw[209]]).to_f32();
            out[4 * j..4 * j + 4].copy_from_slice(&d.to_le_bytes());
            for g in 0..16 {
                out[32 + 8 * g + j] = raw[192 + g];
            }
            let q = decode(raw);
            for i in 0..32 {
                for t in 0..4 {
                    out[LO + 32 * i + 4 * j + t] =
                        (q[4 * i + t] & 0xF) | ((q[128 + 4 * i + t] & 0xF) << 4);
                }
            }
            for i in 0..16 {
                for t in 0..4 {
                    out[HI + 32 * i + 4 * j + t] = (0..4).fold(0u8, |acc, hi| {
                        acc | ((q[4 * (i + 16 * hi) + t] >> 4) << (2 * hi))
                    });
                }
            }
        }
    }

    #[inline(always)]
    unsafe fn tile<I: Isa, const R: usize>(
        group: *const u8,
        acts: &QuantizedActs,
        row0: usize,
    ) -> [__m256; R] {
        // SAFETY: `group` points at `acts.nb` packed blocks of this layout and rows
        // `row0..row0+R` exist in `acts` (the driver's contract); all loads are unaligned.
        unsafe {
            let low4 = _mm256_set1_epi8(0x0F);
            let bits45 = _mm256_set1_epi8(0x30);
            let mut facc = [_mm256_setzero_ps(); R];
            for b in 0..acts.nb {
                let blk = group.add(b * Self::GROUP_BLOCK_BYTES);
                let mut isum = [_mm256_setzero_si256(); R];
                for g in 0..16 {
                    let mut acc = [_mm256_setzero_si256(); R];
                    for c in 4 * g..4 * g + 4 {
                        let v = _mm256_loadu_si256(blk.add(LO + 32 * (c % 32)) as *const __m256i);
                        let nib = if c < 32 { v } else { _mm256_srli_epi16::<4>(v) };
                        let h = _mm256_loadu_si256(blk.add(HI + 32 * (c % 16)) as *const __m256i);
                        let u = _mm256_or_si256(
                            _mm256_and_si256(nib, low4),
                            _mm256_and_si256(high_bits(h, c / 16), bits45),
                        );
                        for (r, a) in acc.iter_mut().enumerate() {
                            let at = (row0 + r) * acts.k + b * QK_K + 4 * c;
                            *a = I::dot_u6(*a, u, bcast4(acts.qs.as_ptr().add(at)));
                        }
                    }
                    let sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64(
                        blk.add(32 + 8 * g) as *const __m128i
                    ));
                    for (r, (t, a)) in isum.iter_mut().zip(acc).enumerate() {
                        let sum16 = acts.sums[((row0 + r) * acts.nb + b) * K_SUMS + g];
                        let a = _mm256_sub_epi32(a, _mm256_set1_epi32(32 * sum16));
                        *t = _mm256_add_epi32(*t, _mm256_mullo_epi32(a, sc));
                    }
                }
                let dw = _mm256_loadu_ps(blk as *const f32);
                for (r, (f, t)) in facc.iter_mut().zip(isum).enumerate() {
                    let da = _mm256_set1_ps(acts.d[(row0 + r) * acts.nb + b]);
                    *f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(dw, da), *f);
                }
            }
            facc
        }
    }
}

/// Moves bits 2T..2T+1 of every byte to bits 4..5 (the caller masks the rest);
/// 16-bit shifts by at most 4 never carry a neighbour byte's bits into 4..5.
#[inline(always)]
unsafe fn high_bits(h: __m256i, t: usize) -> __m256i {
    // SAFETY: plain AVX2 shifts on a register value.
    unsafe {
        match t {
            0 => _mm256_slli_epi16::<4>(h),
            1 => _mm256_slli_epi16::<2>(h),
            2 => h,
            _ => _mm256_srli_epi16::<2>(h),
        }
    }
}
