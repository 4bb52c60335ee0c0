//! Q8_0 weights × Q8_0 activations.
//!
//! Packed layout, per 8-column group and 32-value block (288 bytes):
//! `[ d: f32 × 8 ][ qs: 8 × 32 B ]` where `qs[c]`, lane j = column j's
//! `qs[4c..4c+4]` (chunk c). The ISA's `dot_s8` may add a fixed offset to the
//! weights (VNNI needs unsigned ones); `S8_OFFSET·Σa` is subtracted per block,
//! so the int sums are exact and ISA-independent. The f32 accumulation order
//! is the same as Q5_0's (see there).

use std::arch::x86_64::*;

use super::activation::{ActKind, QuantizedActs, QK8_0};
use super::isa::{bcast4, Isa};
use super::Kernel;

pub(super) struct Q8_0;

impl Kernel for Q8_0 {
    const ACT: ActKind = ActKind::Q8_0;
    const BLOCK_K: usize = QK8_0;
    const RAW_BLOCK_BYTES: usize = 2 + 32;
    const GROUP_BLOCK_BYTES: usize = 32 + 256;

    fn pack_block(cols: &[Option<&[u8]>; 8], out: &mut [u8]) {
        for (j, raw) in cols.iter().enumerate() {
            let Some(raw) = raw else { continue };
            let d = half::f16::from_le_bytes([raw[0], raw[1]]).to_f32();
            out[4 * j..4 * j + 4].copy_from_slice(&d.to_le_bytes());
            for c in 0..8 {
                let dst = 32 + 32 * c + 4 * j;
                out[dst..dst + 4].copy_from_slice(&raw[2 + 4 * c..6 + 4 * c]);
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
            let mut facc = [_mm256_setzero_ps(); R];
            for b in 0..acts.nb {
                let blk = group.add(b * Self::GROUP_BLOCK_BYTES);
                let mut acc = [_mm256_setzero_si256(); R];
                for c in 0..8 {
                    let w = _mm256_loadu_si256(blk.add(32 + 32 * c) as *const __m256i);
                    for (r, a) in acc.iter_mut().enumerate() {
                        let s = bcast4(acts.qs.as_ptr().add((row0 + r) * acts.k + b * 32 + 4 * c));
                        *a = I::dot_s8(*a, w, s);
                    }
                }
                let dw = _mm256_loadu_ps(blk as *const f32);
                for (r, (f, a)) in facc.iter_mut().zip(acc).enumerate() {
                    let i = (row0 + r) * acts.nb + b;
                    let offset = _mm256_set1_epi32(I::S8_OFFSET * acts.sums[i]);
                    let sumi = _mm256_sub_epi32(a, offset);
                    let scale = _mm256_mul_ps(dw, _mm256_set1_ps(acts.d[i]));
                    *f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), scale, *f);
                }
            }
            facc
        }
    }
}
