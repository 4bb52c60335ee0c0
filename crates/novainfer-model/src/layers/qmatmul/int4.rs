//! Grouped int4 weights ([`crate::int4`]: AWQ and GPTQ, `w = s·(q − z)` per 128 input
//! channels) × Q8_0 activations.
//!
//! Packed layout, per 16-column group and 128-value block (1104 bytes, 4.31 bits a weight);
//! every 64-byte row holds 4 bytes (or one f32) per column, column j at bytes 4j..4j+4:
//! ```text
//! [ qs: 4 sub-blocks × 4 × 64 B ][ d: f32 × 16 ][ z: u8 × 16 ]
//!   sub-block t (k = 32t..32t+31), word i, column j = the raw sub-block's bytes 4i..4i+4:
//!   low nibbles are k = 32t+4i..+3 (chunk i), high nibbles k = 32t+16+4i.. (chunk i+4)
//! ```
//! so a sub-block is Q5_0's low-nibble plane without its fifth bit, and each sub-block meets
//! one Q8_0 activation block.
//!
//! The zero point stays an integer: per (row, column, sub-block) the exact
//! `sumi = Σ q·a − z·Σa` (`|Σa| ≤ 32·127` fits the i16 half of a `madd`, `z ≤ 16`), then
//! `acc = fma(f32(sumi), d·d_a, acc)` sub-block by sub-block, whatever the tile height or
//! vector width: what makes a row's result independent of the batch, and the integers the
//! checkpoint's own.
//!
//! Plain AVX2 has its own tile ([`tile_avx2`]): a sub-block's eight chunk pair sums (each
//! ≤ 2·15·127 = 3810) add up in i16 (≤ 30480, exact) and one `madd` by ones widens them.

use std::arch::x86_64::*;
use std::ops::Range;

use super::activation::{ActKind, QuantizedActs, QK8_0};
use super::simd::{Avx2, Simd};
use super::{Kernel, GROUP};
use crate::int4::{BLOCK_BYTES, GROUP_K};

pub(super) struct Int4;

/// Bytes of one sub-block's nibbles for the 16 columns.
const SUB: usize = 4 * 4 * GROUP;
/// Sub-blocks (Q8_0 activation blocks) per 128-value block.
const SUBS: usize = GROUP_K / QK8_0;
const D: usize = SUBS * SUB;
const Z: usize = D + 4 * GROUP;

impl Kernel for Int4 {
    const ACT: ActKind = ActKind::Q8_0;
    const BLOCK_K: usize = GROUP_K;
    const RAW_BLOCK_BYTES: usize = BLOCK_BYTES;
    const GROUP_BLOCK_BYTES: usize = Z + GROUP;
    const WIDE_TILE: usize = 8;

    fn pack_block(cols: &[Option<&[u8]>; GROUP], out: &mut [u8]) {
        for (j, raw) in cols.iter().enumerate() {
            let Some(raw) = raw else { continue };
            out[D + 4 * j..D + 4 * j + 4].copy_from_slice(&raw[0..4]);
            out[Z + j] = raw[4];
            for t in 0..SUBS {
                for i in 0..4 {
                    let dst = SUB * t + 4 * GROUP * i + 4 * j;
                    let src = 5 + 16 * t + 4 * i;
                    out[dst..dst + 4].copy_from_slice(&raw[src..src + 4]);
                }
            }
        }
    }

    #[inline(always)]
    unsafe fn tile<S: Simd, const R: usize>(
        group: *const u8,
        col_off: usize,
        acts: &QuantizedActs,
        row0: usize,
        blocks: Range<usize>,
        mut facc: [S::F; R],
    ) -> [S::F; R] {
        // SAFETY: `group` points at `k / 128` packed blocks of this layout, columns
        // `col_off..col_off+LANES` lie in the group and rows `row0..row0+R` exist in
        // `acts` (the driver's contract); the CPU supports `S`.
        unsafe {
            let low4 = S::splat8(0x0F);
            for b in blocks {
                let base = group.add(b * Self::GROUP_BLOCK_BYTES);
                let blk = base.add(4 * col_off);
                let dw = S::loadf(blk.add(D));
                let z = S::u8_i32(base.add(Z + col_off));
                for t in 0..SUBS {
                    let mut acc = [S::zero(); R];
                    for c in 0..8 {
                        let v = S::load(blk.add(SUB * t + 4 * GROUP * (c % 4)));
                        let u = if c < 4 {
                            S::and(v, low4)
                        } else {
                            S::and(S::shr16::<4>(v), low4)
                        };
                        for (r, a) in acc.iter_mut().enumerate() {
                            let at = (row0 + r) * acts.k + b * GROUP_K + QK8_0 * t + 4 * c;
                            *a = S::dot_u6(*a, u, S::bcast4(acts.qs.as_ptr().add(at)));
                        }
                    }
                    for (r, (f, a)) in facc.iter_mut().zip(acc).enumerate() {
                        let i = (row0 + r) * acts.nb + SUBS * b + t;
                        let zsum = S::madd16(z, S::splat32(acts.sums[i] & 0xFFFF));
                        let scale = S::mul(dw, S::splatf(acts.d[i]));
                        *f = S::fma(S::cvt(S::sub32(a, zsum)), scale, *f);
                    }
                }
            }
            facc
        }
    }

    #[inline(always)]
    unsafe fn tile_avx2<const R: usize>(
        group: *const u8,
        col_off: usize,
        acts: &QuantizedActs,
        row0: usize,
        blocks: Range<usize>,
        facc: [__m256; R],
    ) -> [__m256; R] {
        // SAFETY: forwarded.
        unsafe { tile_avx2::<R>(group, col_off, acts, row0, blocks, facc) }
    }
}

/// Rows `row0..row0+R` × columns `col_off..col_off+8` on plain AVX2 (see the module docs).
///
/// # Safety
/// [`Kernel::tile`]'s contract with `S = Avx2`.
#[inline(always)]
unsafe fn tile_avx2<const R: usize>(
    group: *const u8,
    col_off: usize,
    acts: &QuantizedActs,
    row0: usize,
    blocks: Range<usize>,
    mut facc: [__m256; R],
) -> [__m256; R] {
    // SAFETY: `group` points at the packed blocks, the columns lie in the group, rows
    // `row0..row0+R` exist in `acts` (so every activation read below is in bounds), and the
    // caller runs with AVX2/FMA enabled.
    unsafe {
        let low4 = _mm256_set1_epi8(0x0F);
        let ones = _mm256_set1_epi16(1);
        for b in blocks {
            let base = group.add(b * Int4::GROUP_BLOCK_BYTES);
            let blk = base.add(4 * col_off);
            let dw = _mm256_loadu_ps(blk.add(D) as *const f32);
            let z = Avx2::u8_i32(base.add(Z + col_off));
            for t in 0..SUBS {
                let acts_at: [*const u8; R] = std::array::from_fn(|r| {
                    acts.qs
                        .as_ptr()
                        .add((row0 + r) * acts.k + b * GROUP_K + QK8_0 * t)
                        as *const u8
                });
                let mut p16 = [_mm256_setzero_si256(); R];
                for i in 0..4 {
                    let v = _mm256_loadu_si256(blk.add(SUB * t + 4 * GROUP * i) as *const __m256i);
                    let lo = _mm256_and_si256(v, low4);
                    let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), low4);
                    for (p, &at) in p16.iter_mut().zip(&acts_at) {
                        let a_lo = _mm256_set1_epi32(std::ptr::read_unaligned(
                            at.add(4 * i) as *const i32
                        ));
                        let a_hi = _mm256_set1_epi32(std::ptr::read_unaligned(
                            at.add(16 + 4 * i) as *const i32
                        ));
                        *p = _mm256_add_epi16(*p, _mm256_maddubs_epi16(lo, a_lo));
                        *p = _mm256_add_epi16(*p, _mm256_maddubs_epi16(hi, a_hi));
                    }
                }
                for (r, (f, p)) in facc.iter_mut().zip(p16).enumerate() {
                    let i = (row0 + r) * acts.nb + SUBS * b + t;
                    let sum = *acts.sums.get_unchecked(i);
                    let zsum = _mm256_madd_epi16(z, _mm256_set1_epi32(sum & 0xFFFF));
                    let sumi = _mm256_sub_epi32(_mm256_madd_epi16(p, ones), zsum);
                    let scale = _mm256_mul_ps(dw, _mm256_set1_ps(*acts.d.get_unchecked(i)));
                    *f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), scale, *f);
                }
            }
        }
        facc
    }
}
