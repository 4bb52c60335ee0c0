//! Q5_0 weights × Q8_0 activations.
//!
//! Packed layout, per 16-column group and 32-value block (384 bytes); every
//! 64-byte row holds 4 bytes (or one f32) per column, column j at bytes 4j..4j+4:
//! ```text
//! [ d: f32 × 16 ][ qs: 4 × 64 B ][ qh: 64 B ]
//!   qs[i], column j = ggml qs[4i..4i+4]: low nibbles are k = 4i..4i+3 (chunk i),
//!          high nibbles k = 16+4i.. (chunk i+4)
//!   qh,    column j, byte t, bit c = fifth bit of the value at k = 4c+t
//! ```
//! so chunk `c` (k = 4c..4c+3) of all columns is one shift/mask away. Values are
//! kept unsigned (`u = w + 16`, 0..=31) and `16·Σa` is subtracted once per block,
//! which keeps the int sums exact.
//!
//! Per (row, column) the f32 work is `acc = fma(f32(sumi_b), dw_b·da_b, acc)`
//! over blocks in order, whatever the tile height or vector width: this is what
//! makes a row's result independent of the batch.
//!
//! Plain AVX2 has its own tile ([`tile_avx2`]): the generic one widens every chunk's pair
//! sums with a `madd` by ones; here four chunks' pair sums (each ≤ 2·31·127 = 7874) add up
//! in i16 (≤ 31496, exact) and one `madd` by ones per four chunks widens them: the same exact
//! block sum, the same f32 operations, so the same bits.

use std::arch::x86_64::*;
use std::ops::Range;

use super::activation::{ActKind, QuantizedActs, QK8_0};
use super::simd::{Avx2, Simd};
use super::{Kernel, GROUP};

pub(super) struct Q5_0;

const QS: usize = 4 * GROUP;
const QH: usize = QS + 4 * 4 * GROUP;

impl Kernel for Q5_0 {
    const ACT: ActKind = ActKind::Q8_0;
    const BLOCK_K: usize = QK8_0;
    const RAW_BLOCK_BYTES: usize = 2 + 4 + 16;
    const GROUP_BLOCK_BYTES: usize = QH + 4 * GROUP;
    const WIDE_TILE: usize = 8;

    amx_rows_by!(flat_rows);

    fn pack_block(cols: &[Option<&[u8]>; GROUP], out: &mut [u8]) {
        for (j, raw) in cols.iter().enumerate() {
            let Some(raw) = raw else { continue };
            let d = half::f16::from_le_bytes([raw[0], raw[1]]).to_f32();
            out[4 * j..4 * j + 4].copy_from_slice(&d.to_le_bytes());
            let qh = u32::from_le_bytes([raw[2], raw[3], raw[4], raw[5]]);
            let qs = &raw[6..22];
            for i in 0..4 {
                let dst = QS + 4 * GROUP * i + 4 * j;
                out[dst..dst + 4].copy_from_slice(&qs[4 * i..4 * i + 4]);
            }
            for t in 0..4 {
                let byte =
                    (0..8).fold(0u8, |acc, c| acc | ((((qh >> (4 * c + t)) & 1) as u8) << c));
                out[QH + 4 * j + t] = byte;
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
        // SAFETY: `group` points at `acts.nb` packed blocks of this layout, columns
        // `col_off..col_off+LANES` lie in the group and rows `row0..row0+R` exist in
        // `acts` (the driver's contract); the CPU supports `S`.
        unsafe {
            let low4 = S::splat8(0x0F);
            let bit4 = S::splat8(0x10);
            for b in blocks {
                let blk = group.add(b * Self::GROUP_BLOCK_BYTES + 4 * col_off);
                let qh = S::load(blk.add(QH));
                let split = two_chains::<S, R>();
                let mut acc2 = [[S::zero(); R]; 2];
                for c in 0..8 {
                    let v = S::load(blk.add(QS + 4 * GROUP * (c % 4)));
                    let nib = if c < 4 { v } else { S::shr16::<4>(v) };
                    let u = S::or(S::and(nib, low4), S::and(high_bit::<S>(qh, c), bit4));
                    for (r, a) in acc2[if split { c % 2 } else { 0 }].iter_mut().enumerate() {
                        let at = (row0 + r) * acts.k + b * QK8_0 + 4 * c;
                        *a = S::dot_u6(*a, u, S::bcast4(acts.qs.as_ptr().add(at)));
                    }
                }
                let acc: [S::I; R] = std::array::from_fn(|r| S::add32(acc2[0][r], acc2[1][r]));
                let dw = S::loadf(blk);
                for (r, (f, a)) in facc.iter_mut().zip(acc).enumerate() {
                    let i = (row0 + r) * acts.nb + b;
                    let sumi = S::sub32(a, S::splat32(16 * acts.sums[i]));
                    let scale = S::mul(dw, S::splatf(acts.d[i]));
                    *f = S::fma(S::cvt(sumi), scale, *f);
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

/// Whether an `R`-row generic tile adds a block's 8 chunks in two chains (even and odd)
/// rather than one: with few rows the chain of `vpdpbusd` latencies is what a block waits for
/// (1 row in L2 on an Emerald Rapids core: 34.9 -> 38.9 GB/s; Q8_0's same loop did not gain);
/// more rows have chains enough, and twice their accumulators spill (AVX-512 at 8 rows: a
/// 128-row product took 1.75 ms, not 1.08; 256-bit code has half the registers). The chains
/// are integer sums, so the bits are the same either way.
#[inline(always)]
const fn two_chains<S: Simd, const R: usize>() -> bool {
    R <= if S::LANES >= 16 { 4 } else { 1 }
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
    // SAFETY: `group` points at `acts.nb` packed blocks, the columns lie in the group,
    // rows `row0..row0+R` exist in `acts` (so every activation read below is in bounds),
    // and the caller runs with AVX2/FMA enabled.
    unsafe {
        let low4 = _mm256_set1_epi8(0x0F);
        let bit4 = _mm256_set1_epi8(0x10);
        let ones = _mm256_set1_epi16(1);
        for b in blocks {
            let blk = group.add(b * Q5_0::GROUP_BLOCK_BYTES + 4 * col_off);
            let qh = _mm256_loadu_si256(blk.add(QH) as *const __m256i);
            let acts_at: [*const u8; R] = std::array::from_fn(|r| {
                acts.qs.as_ptr().add((row0 + r) * acts.k + b * QK8_0) as *const u8
            });
            let mut acc = [_mm256_setzero_si256(); R];
            for half in 0..2 {
                let mut p16 = [_mm256_setzero_si256(); R];
                for i in 0..4 {
                    let c = 4 * half + i;
                    let v = _mm256_loadu_si256(blk.add(QS + 4 * GROUP * i) as *const __m256i);
                    let nib = if half == 0 {
                        v
                    } else {
                        _mm256_srli_epi16::<4>(v)
                    };
                    let u = _mm256_or_si256(
                        _mm256_and_si256(nib, low4),
                        _mm256_and_si256(high_bit::<Avx2>(qh, c), bit4),
                    );
                    for (p, &at) in p16.iter_mut().zip(&acts_at) {
                        let x = _mm256_set1_epi32(std::ptr::read_unaligned(
                            at.add(4 * c) as *const i32
                        ));
                        *p = _mm256_add_epi16(*p, _mm256_maddubs_epi16(u, x));
                    }
                }
                for (a, p) in acc.iter_mut().zip(p16) {
                    *a = _mm256_add_epi32(*a, _mm256_madd_epi16(p, ones));
                }
            }
            let dw = _mm256_loadu_ps(blk as *const f32);
            for (r, (f, a)) in facc.iter_mut().zip(acc).enumerate() {
                let i = (row0 + r) * acts.nb + b;
                let sumi = _mm256_sub_epi32(a, _mm256_set1_epi32(16 * *acts.sums.get_unchecked(i)));
                let scale = _mm256_mul_ps(dw, _mm256_set1_ps(*acts.d.get_unchecked(i)));
                *f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), scale, *f);
            }
        }
        facc
    }
}

/// Moves bit `c` of every qh byte to bit 4 (the caller masks the rest); 16-bit
/// shifts by at most 4 never carry a neighbour byte's bit into bit 4.
#[inline(always)]
pub(super) unsafe fn high_bit<S: Simd>(qh: S::I, c: usize) -> S::I {
    // SAFETY: register shifts; the caller's ISA contract holds.
    unsafe {
        match c {
            0 => S::shl16::<4>(qh),
            1 => S::shl16::<3>(qh),
            2 => S::shl16::<2>(qh),
            3 => S::shl16::<1>(qh),
            4 => qh,
            5 => S::shr16::<1>(qh),
            6 => S::shr16::<2>(qh),
            _ => S::shr16::<3>(qh),
        }
    }
}

impl super::amx::FlatBlocks for Q5_0 {
    const SIGNED: bool = false;
    const WEIGHTS: Option<usize> = None;

    #[inline(always)]
    unsafe fn unpack(blk: *const u8, out: &mut [u8; 8 * super::amx::ROW_BYTES]) {
        use super::simd::Avx512;
        // SAFETY: `blk` is one packed block (the caller's contract); AVX-512 is enabled. The
        // same `u = w + 16` per chunk as `tile`.
        unsafe {
            let low4 = Avx512::splat8(0x0F);
            let bit4 = Avx512::splat8(0x10);
            let qh = Avx512::load(blk.add(QH));
            for c in 0..8 {
                let v = Avx512::load(blk.add(QS + 4 * GROUP * (c % 4)));
                let nib = if c < 4 { v } else { Avx512::shr16::<4>(v) };
                let u = Avx512::or(
                    Avx512::and(nib, low4),
                    Avx512::and(high_bit::<Avx512>(qh, c), bit4),
                );
                _mm512_storeu_si512(out.as_mut_ptr().add(64 * c) as *mut __m512i, u);
            }
        }
    }

    #[inline(always)]
    unsafe fn exact(c: __m512i, acts: &QuantizedActs, i: usize) -> __m512i {
        // SAFETY: AVX-512 is enabled (the caller's contract). `Σ (w + 16)·a - 16·Σa`, as `tile`.
        unsafe { _mm512_sub_epi32(c, _mm512_set1_epi32(16 * acts.sums[i])) }
    }
}
