//! Q5_0 weights × Q8_0 activations.
//!
//! Packed layout, per 8-column group and 32-value block (192 bytes):
//! ```text
//! [ d: f32 × 8 ][ qs: 4 × 32 B ][ qh: 32 B ]
//!   qs[i], lane j (4 bytes) = column j's ggml qs[4i..4i+4]: low nibbles are
//!          k = 4i..4i+3 (chunk i), high nibbles k = 16+4i.. (chunk i+4)
//!   qh,    lane j, byte t, bit c = fifth bit of column j's value at k = 4c+t
//! ```
//! so chunk `c` (k = 4c..4c+3) of all 8 columns is one shift/mask away, with
//! lane j holding column j. Values are kept unsigned (`u = w + 16`, 0..=31) and
//! `16·Σa` is subtracted once per block, which keeps the int sums exact.
//!
//! Per (row, column) the f32 work is `acc = fma(f32(sumi_b), dw_b·da_b, acc)`
//! over blocks in order, whatever the tile height: this is what makes a row's
//! result independent of the batch.

use std::arch::x86_64::*;

use super::activation::{ActKind, QuantizedActs, QK8_0};
use super::isa::{bcast4, Isa};
use super::Kernel;

pub(super) struct Q5_0;

const RAW_BLOCK: usize = 2 + 4 + 16;

impl Kernel for Q5_0 {
    const ACT: ActKind = ActKind::Q8_0;
    const BLOCK_K: usize = QK8_0;
    const RAW_BLOCK_BYTES: usize = RAW_BLOCK;
    const GROUP_BLOCK_BYTES: usize = 32 + 128 + 32;

    fn pack_block(cols: &[Option<&[u8]>; 8], out: &mut [u8]) {
        for (j, raw) in cols.iter().enumerate() {
            let Some(raw) = raw else { continue };
            let d = half::f16::from_le_bytes([raw[0], raw[1]]).to_f32();
            out[4 * j..4 * j + 4].copy_from_slice(&d.to_le_bytes());
            let qh = u32::from_le_bytes([raw[2], raw[3], raw[4], raw[5]]);
            let qs = &raw[6..22];
            for i in 0..4 {
                let dst = 32 + 32 * i + 4 * j;
                out[dst..dst + 4].copy_from_slice(&qs[4 * i..4 * i + 4]);
            }
            for t in 0..4 {
                let byte =
                    (0..8).fold(0u8, |acc, c| acc | ((((qh >> (4 * c + t)) & 1) as u8) << c));
                out[160 + 4 * j + t] = byte;
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
            let bit4 = _mm256_set1_epi8(0x10);
            let mut facc = [_mm256_setzero_ps(); R];
            for b in 0..acts.nb {
                let blk = group.add(b * Self::GROUP_BLOCK_BYTES);
                let qh = _mm256_loadu_si256(blk.add(160) as *const __m256i);
                let mut acc = [_mm256_setzero_si256(); R];
                for c in 0..8 {
                    let v = _mm256_loadu_si256(blk.add(32 + 32 * (c % 4)) as *const __m256i);
                    let nib = if c < 4 { v } else { _mm256_srli_epi16::<4>(v) };
                    let u = _mm256_or_si256(
                        _mm256_and_si256(nib, low4),
                        _mm256_and_si256(high_bit(qh, c), bit4),
                    );
                    for (r, a) in acc.iter_mut().enumerate() {
                        let s = bcast4(acts.qs.as_ptr().add((row0 + r) * acts.k + b * 32 + 4 * c));
                        *a = I::dot_u6(*a, u, s);
                    }
                }
                let dw = _mm256_loadu_ps(blk as *const f32);
                for (r, (f, a)) in facc.iter_mut().zip(acc).enumerate() {
                    let i = (row0 + r) * acts.nb + b;
                    let sumi = _mm256_sub_epi32(a, _mm256_set1_epi32(16 * acts.sums[i]));
                    let scale = _mm256_mul_ps(dw, _mm256_set1_ps(acts.d[i]));
                    *f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), scale, *f);
                }
            }
            facc
        }
    }
}

/// Moves bit `c` of every qh byte to bit 4 (the other bits are masked off by the caller).
/// 16-bit shifts by at most 4 never carry a neighbour byte's bit into bit 4.
#[inline(always)]
unsafe fn high_bit(qh: __m256i, c: usize) -> __m256i {
    // SAFETY: plain AVX2 shifts on a register value.
    unsafe {
        match c {
            0 => _mm256_slli_epi16::<4>(qh),
            1 => _mm256_slli_epi16::<3>(qh),
            2 => _mm256_slli_epi16::<2>(qh),
            3 => _mm256_slli_epi16::<1>(qh),
            4 => qh,
            5 => _mm256_srli_epi16::<1>(qh),
            6 => _mm256_srli_epi16::<2>(qh),
            _ => _mm256_srli_epi16::<3>(qh),
        }
    }
}
