//! Q4_K weights × Q8_K activations.
//!
//! A ggml Q4_K block covers 256 values in 8 sub-blocks of 32, each with a 6-bit
//! scale `sc` and min `m`: `w = d·sc·q - dmin·m`, `q` in 0..=15. Packed layout,
//! per 16-column group and block (2432 bytes; `[..][col]`, column innermost):
//! ```text
//! [ d: f32 × 16 ][ dmin: f32 × 16 ][ sc: [8 sub][16 col] u8 ][ m: [4 t][16 col][2] u8 ]
//! [ qs: [4 p][8 i][16 col] × 4 B ]
//!   qs[p][i][j] = column j's ggml qs[32p+4i..+4]: low nibbles are chunk i of
//!   sub-block 2p, high nibbles chunk i of sub-block 2p+1
//! ```
//! Per (row, column): `isum = Σ_s sc_s·Σ q·a` and `imin = Σ_s m_s·Σa_s` are exact
//! i32; then `acc = fma(f32(isum), dw·da, acc); acc = fnma(f32(imin), dmin·da, acc)`
//! per block in order, independent of the tile height and vector width.
//!
//! Plain AVX2 has its own kernels: [`tile_avx2`] (prefill, 6 rows × 8 columns) and
//! [`row16_avx2`] (decode, 1 row × 16 columns). Both add a sub-block's 8 chunk products in
//! i16 and apply its scale inside the widening `madd`, where the generic tile spends a `madd`
//! by ones per chunk and a `mullo` per sub-block; same integers, same f32 operations.

use std::arch::x86_64::*;
use std::ops::Range;

use super::activation::{ActKind, QuantizedActs, K_PAIRS32, K_SUMS, QK_K};
use super::simd::Simd;
use super::{prefetch, Kernel, GROUP};

pub(super) struct Q4K;

const DMIN: usize = 4 * GROUP;
const SC: usize = DMIN + 4 * GROUP;
const MINS: usize = SC + 8 * GROUP;
const QS: usize = MINS + 4 * 2 * GROUP;

/// ggml's `get_scale_min_k4`: the 6-bit (scale, min) of sub-block `j`.
pub(super) fn scale_min(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

impl Kernel for Q4K {
    const ACT: ActKind = ActKind::Q8K;
    const BLOCK_K: usize = QK_K;
    const RAW_BLOCK_BYTES: usize = 144;
    const GROUP_BLOCK_BYTES: usize = QS + 32 * 4 * GROUP;
    const WIDE_TILE: usize = 6;
    const AVX2_TILE: usize = 6;

    amx_rows_by!(scaled_rows);

    fn pack_block(cols: &[Option<&[u8]>; GROUP], out: &mut [u8]) {
        for (j, raw) in cols.iter().enumerate() {
            let Some(raw) = raw else { continue };
            let d = half::f16::from_le_bytes([raw[0], raw[1]]).to_f32();
            let dmin = half::f16::from_le_bytes([raw[2], raw[3]]).to_f32();
            out[4 * j..4 * j + 4].copy_from_slice(&d.to_le_bytes());
            out[DMIN + 4 * j..DMIN + 4 * j + 4].copy_from_slice(&dmin.to_le_bytes());
            let scales = &raw[4..16];
            for s in 0..8 {
                let (sc, m) = scale_min(s, scales);
                out[SC + GROUP * s + j] = sc;
                out[MINS + 2 * GROUP * (s / 2) + 2 * j + s % 2] = m;
            }
            let qs = &raw[16..144];
            for p in 0..4 {
                for i in 0..8 {
                    let dst = QS + 4 * GROUP * (8 * p + i) + 4 * j;
                    let src = 32 * p + 4 * i;
                    out[dst..dst + 4].copy_from_slice(&qs[src..src + 4]);
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
        facc: [S::F; R],
    ) -> [S::F; R] {
        // SAFETY: forwarded.
        unsafe { tile_generic::<S, R, false>(group, col_off, acts, row0, blocks, facc) }
    }

    #[inline(always)]
    unsafe fn stream_tile<S: Simd, const R: usize>(
        group: *const u8,
        acts: &QuantizedActs,
        row0: usize,
        b: usize,
        facc: [S::F; R],
    ) -> [S::F; R] {
        // SAFETY: forwarded.
        unsafe { tile_generic::<S, R, true>(group, 0, acts, row0, b..b + 1, facc) }
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

    #[inline(always)]
    unsafe fn row_avx2(
        group: *const u8,
        acts: &QuantizedActs,
        row: usize,
        _both: bool,
    ) -> [__m256; 2] {
        // SAFETY: forwarded (a padding half reads the group's zeroed padding columns).
        unsafe { row16_avx2(group, acts, row) }
    }
}

/// [`Kernel::tile`] for any [`Simd`]; `STREAM`: the weights come from memory
/// ([`Kernel::stream_tile`]), so the block asks for the lines ahead ([`super::prefetch`])
/// a quarter at a time, between its sub-block pairs.
///
/// # Safety
/// [`Kernel::tile`]'s contract.
#[inline(always)]
unsafe fn tile_generic<S: Simd, const R: usize, const STREAM: bool>(
    group: *const u8,
    col_off: usize,
    acts: &QuantizedActs,
    row0: usize,
    blocks: Range<usize>,
    mut facc: [S::F; R],
) -> [S::F; R] {
    // SAFETY: the caller's contract.
    unsafe {
        let low4 = S::splat8(0x0F);
        for b in blocks {
            let blk = group.add(b * Q4K::GROUP_BLOCK_BYTES);
            let mut isum = [S::zero(); R];
            for p in 0..4 {
                // Sub-blocks 2p (low nibbles) and 2p + 1 (high) from one load of each plane
                // row. (Splitting each row's chains further, to hide `vpdpbusd`'s latency at one
                // row, changed nothing measurable on Zen 5 once the prefetches were spread.)
                if STREAM {
                    // 4 steps of 10 lines cover the 38-line block, as in `row16_avx2`.
                    prefetch::ahead(blk, 640 * p, 10);
                }
                let mut lo = [S::zero(); R];
                let mut hi = [S::zero(); R];
                for i in 0..8 {
                    let v = S::load(blk.add(QS + 4 * GROUP * (8 * p + i) + 4 * col_off));
                    let ql = S::and(v, low4);
                    let qh = S::and(S::shr16::<4>(v), low4);
                    for r in 0..R {
                        let at = acts
                            .qs
                            .as_ptr()
                            .add((row0 + r) * acts.k + b * QK_K + 64 * p + 4 * i);
                        lo[r] = S::dot_u6(lo[r], ql, S::bcast4(at));
                        hi[r] = S::dot_u6(hi[r], qh, S::bcast4(at.add(32)));
                    }
                }
                let sc_lo = S::u8_i32(blk.add(SC + GROUP * 2 * p + col_off));
                let sc_hi = S::u8_i32(blk.add(SC + GROUP * (2 * p + 1) + col_off));
                for (t, (l, h)) in isum.iter_mut().zip(lo.into_iter().zip(hi)) {
                    *t = S::add32(*t, S::mullo32(l, sc_lo));
                    *t = S::add32(*t, S::mullo32(h, sc_hi));
                }
            }
            let dw = S::loadf(blk.add(4 * col_off));
            let dmin = S::loadf(blk.add(DMIN + 4 * col_off));
            for (r, (f, t)) in facc.iter_mut().zip(isum).enumerate() {
                let i = (row0 + r) * acts.nb + b;
                let sums = &acts.sums[i * K_SUMS + K_PAIRS32..i * K_SUMS + K_PAIRS32 + 4];
                let mut imin = S::zero();
                for (p, &pair) in sums.iter().enumerate() {
                    let m = S::u8_i16(blk.add(MINS + 2 * GROUP * p + 2 * col_off));
                    imin = S::add32(imin, S::madd16(m, S::splat32(pair)));
                }
                let da = S::splatf(acts.d[i]);
                *f = S::fma(S::cvt(t), S::mul(dw, da), *f);
                *f = S::fnma(S::cvt(imin), S::mul(dmin, da), *f);
            }
        }
        facc
    }
}

/// One row × all 16 columns of a group on plain AVX2 (decode), with software prefetches
/// ahead ([`super::prefetch`]). Each sub-block's 8 chunk products (pair sums
/// ≤ 2·15·127) add up in i16 (≤ 8·3810 = 30480, exact since |a| ≤ 127), and the scale
/// multiplies inside the widening `madd` (`(sc, sc)` pairs): the same exact `isum` and
/// `imin` as [`Kernel::tile`], then the same f32 operations, so the same bits.
///
/// # Safety
/// `group` points at `acts.nb` packed blocks, row `row` exists in `acts`, AVX2 is enabled.
#[inline(always)]
unsafe fn row16_avx2(group: *const u8, acts: &QuantizedActs, row: usize) -> [__m256; 2] {
    // SAFETY: the caller's contract; every read below stays inside block `b` or row `row`.
    unsafe {
        let low4 = _mm256_set1_epi8(0x0F);
        let mut facc = [_mm256_setzero_ps(); 2];
        for b in 0..acts.nb {
            let blk = group.add(b * Q4K::GROUP_BLOCK_BYTES);
            let a = acts.qs.as_ptr().add(row * acts.k + b * QK_K) as *const u8;
            let mut isum = [_mm256_setzero_si256(); 2];
            for p in 0..4 {
                // 4 steps of 10 lines cover the 38-line block (2432 bytes).
                prefetch::ahead(blk, 640 * p, 10);
                let mut lo = [_mm256_setzero_si256(); 2];
                let mut hi = [_mm256_setzero_si256(); 2];
                for i in 0..8 {
                    let at = a.add(64 * p + 4 * i);
                    let a_lo = _mm256_set1_epi32(std::ptr::read_unaligned(at as *const i32));
                    let a_hi =
                        _mm256_set1_epi32(std::ptr::read_unaligned(at.add(32) as *const i32));
                    for h in 0..2 {
                        let v = _mm256_loadu_si256(
                            blk.add(QS + 4 * GROUP * (8 * p + i) + 32 * h) as *const __m256i
                        );
                        let ql = _mm256_and_si256(v, low4);
                        let qh = _mm256_and_si256(_mm256_srli_epi16::<4>(v), low4);
                        lo[h] = _mm256_add_epi16(lo[h], _mm256_maddubs_epi16(ql, a_lo));
                        hi[h] = _mm256_add_epi16(hi[h], _mm256_maddubs_epi16(qh, a_hi));
                    }
                }
                for s in 0..2 {
                    let sc8 = _mm_loadu_si128(blk.add(SC + GROUP * (2 * p + s)) as *const __m128i);
                    let sc = [
                        _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(sc8, sc8)),
                        _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(sc8, sc8)),
                    ];
                    let acc = if s == 0 { lo } else { hi };
                    for h in 0..2 {
                        isum[h] = _mm256_add_epi32(isum[h], _mm256_madd_epi16(acc[h], sc[h]));
                    }
                }
            }
            let i = row * acts.nb + b;
            let sums = acts.sums.as_ptr().add(i * K_SUMS + K_PAIRS32);
            let da = _mm256_set1_ps(*acts.d.get_unchecked(i));
            for h in 0..2 {
                let mut imin = _mm256_setzero_si256();
                for p in 0..4 {
                    let m = _mm256_cvtepu8_epi16(_mm_loadu_si128(
                        blk.add(MINS + 2 * GROUP * p + 16 * h) as *const __m128i,
                    ));
                    imin = _mm256_add_epi32(
                        imin,
                        _mm256_madd_epi16(m, _mm256_set1_epi32(*sums.add(p))),
                    );
                }
                let dw = _mm256_loadu_ps(blk.add(32 * h) as *const f32);
                let dmin = _mm256_loadu_ps(blk.add(DMIN + 32 * h) as *const f32);
                facc[h] =
                    _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[h]), _mm256_mul_ps(dw, da), facc[h]);
                facc[h] =
                    _mm256_fnmadd_ps(_mm256_cvtepi32_ps(imin), _mm256_mul_ps(dmin, da), facc[h]);
            }
        }
        facc
    }
}

/// Rows `row0..row0+R` × columns `col_off..col_off+8` on plain AVX2 (prefill). The generic
/// tile spends a widening `madd` by ones per 4 k-values and row and a `mullo` per sub-block
/// and row; here each sub-block's 8 chunk products (`maddubs` of the u4 quants against the
/// signed activations, pair sums ≤ 2·15·127) add up in i16 (≤ 8·3810 = 30480, exact), and
/// the 6-bit scale multiplies inside the one widening `madd` per sub-block (`(sc, sc)`
/// pairs). The mins term takes 4 `madd`s per row and block against the activation row's
/// 32-value sums (computed once per row when it is quantized). Same exact `isum` and `imin` as [`Kernel::tile`],
/// then the same f32 operations, so the same bits.
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
        for b in blocks {
            let blk = group.add(b * Q4K::GROUP_BLOCK_BYTES);
            let acts_at: [*const u8; R] = std::array::from_fn(|r| {
                acts.qs.as_ptr().add((row0 + r) * acts.k + b * QK_K) as *const u8
            });
            let mut isum = [_mm256_setzero_si256(); R];
            for p in 0..4 {
                sub_block_avx2::<false, R>(blk, col_off, p, &acts_at, &mut isum);
                sub_block_avx2::<true, R>(blk, col_off, p, &acts_at, &mut isum);
            }
            let mins: [__m256i; 4] = std::array::from_fn(|p| {
                _mm256_cvtepu8_epi16(_mm_loadu_si128(
                    blk.add(MINS + 2 * GROUP * p + 2 * col_off) as *const __m128i
                ))
            });
            let dw = _mm256_loadu_ps(blk.add(4 * col_off) as *const f32);
            let dmin = _mm256_loadu_ps(blk.add(DMIN + 4 * col_off) as *const f32);
            for (r, (f, t)) in facc.iter_mut().zip(isum).enumerate() {
                let i = (row0 + r) * acts.nb + b;
                let sums = acts.sums.as_ptr().add(i * K_SUMS + K_PAIRS32);
                let mut imin = _mm256_madd_epi16(mins[0], _mm256_set1_epi32(*sums));
                for (p, &m) in mins.iter().enumerate().skip(1) {
                    imin = _mm256_add_epi32(
                        imin,
                        _mm256_madd_epi16(m, _mm256_set1_epi32(*sums.add(p))),
                    );
                }
                let da = _mm256_set1_ps(*acts.d.get_unchecked(i));
                *f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(dw, da), *f);
                *f = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(imin), _mm256_mul_ps(dmin, da), *f);
            }
        }
        facc
    }
}

/// Sub-block `2p` (`HIGH` false: the low nibbles of plane rows `8p..8p+8`) or `2p + 1`
/// (`HIGH`: the high nibbles) into `isum`: `sc·Σ q·a` per row and column.
///
/// # Safety
/// `blk` is a packed block with `col_off + 8 ≤ 16`; `acts_at[r]` points at row r's 256
/// activations of this block; AVX2 is enabled.
#[inline(always)]
unsafe fn sub_block_avx2<const HIGH: bool, const R: usize>(
    blk: *const u8,
    col_off: usize,
    p: usize,
    acts_at: &[*const u8; R],
    isum: &mut [__m256i; R],
) {
    // SAFETY: the caller's contract; every offset below stays inside the block or the rows.
    unsafe {
        let low4 = _mm256_set1_epi8(0x0F);
        let s = 2 * p + usize::from(HIGH);
        let mut acc = [_mm256_setzero_si256(); R];
        for i in 0..8 {
            let v = _mm256_loadu_si256(
                blk.add(QS + 4 * GROUP * (8 * p + i) + 4 * col_off) as *const __m256i
            );
            let q = if HIGH {
                _mm256_and_si256(_mm256_srli_epi16::<4>(v), low4)
            } else {
                _mm256_and_si256(v, low4)
            };
            for (a, &at) in acc.iter_mut().zip(acts_at) {
                let x = _mm256_set1_epi32(std::ptr::read_unaligned(
                    at.add(32 * s + 4 * i) as *const i32
                ));
                *a = _mm256_add_epi16(*a, _mm256_maddubs_epi16(q, x));
            }
        }
        let sc8 = _mm_loadl_epi64(blk.add(SC + GROUP * s + col_off) as *const __m128i);
        // (sc, sc) as i16 in every 32-bit lane: both pair sums of a lane are one column's.
        let scv = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(sc8, sc8));
        for (t, a) in isum.iter_mut().zip(acc) {
            *t = _mm256_add_epi32(*t, _mm256_madd_epi16(a, scv));
        }
    }
}

impl super::amx::ScaledBlocks for Q4K {
    const HI_SIGNED: bool = false;

    #[inline(always)]
    unsafe fn unpack_scaled(blk: *const u8, out: &mut [u8; 8 * 1024]) {
        use super::amx::{put, scale16, split_scaled};
        // SAFETY: `blk` is one packed block (the caller's contract); AVX-512 is enabled.
        unsafe {
            let low4 = _mm512_set1_epi8(0x0F);
            // Tile j holds sub-blocks 2j (rows 0-7: low nibbles of plane j) and 2j + 1 (rows
            // 8-15: high nibbles); `v = sc·q` ≤ 63·15.
            for j in 0..4 {
                let sc = |s: usize| {
                    scale16(_mm512_cvtepu8_epi32(_mm_loadu_si128(
                        blk.add(SC + GROUP * s) as *const __m128i,
                    )))
                };
                let (sc_lo, sc_hi) = (sc(2 * j), sc(2 * j + 1));
                for i in 0..8 {
                    let v =
                        _mm512_loadu_si512(blk.add(QS + 4 * GROUP * (8 * j + i)) as *const __m512i);
                    let ql = _mm512_and_si512(v, low4);
                    let qh = _mm512_and_si512(_mm512_srli_epi16::<4>(v), low4);
                    let (lo, hi) = split_scaled(ql, sc_lo, false);
                    put(out, j, i, lo);
                    put(out, 4 + j, i, hi);
                    let (lo, hi) = split_scaled(qh, sc_hi, false);
                    put(out, j, 8 + i, lo);
                    put(out, 4 + j, 8 + i, hi);
                }
            }
        }
    }

    /// `dw`, `dmin` and the four sub-block pairs' mins as i16 pairs.
    type Block = (__m512, __m512, [__m512i; 4]);

    #[inline(always)]
    unsafe fn block(blk: *const u8) -> Self::Block {
        use super::simd::Avx512 as S;
        // SAFETY: the caller's contract.
        unsafe {
            let mins = std::array::from_fn(|p| S::u8_i16(blk.add(MINS + 2 * GROUP * p)));
            (S::loadf(blk), S::loadf(blk.add(DMIN)), mins)
        }
    }

    #[inline(always)]
    unsafe fn finish(
        (dw, dmin, mins): Self::Block,
        acts: &QuantizedActs,
        row: usize,
        b: usize,
        isum: __m512i,
        f: __m512,
    ) -> __m512 {
        use super::simd::Avx512 as S;
        // SAFETY: the caller's contract. `tile_generic`'s f32 work for one row, the same
        // operations in the same order.
        unsafe {
            let i = row * acts.nb + b;
            let sums = &acts.sums[i * K_SUMS + K_PAIRS32..i * K_SUMS + K_PAIRS32 + 4];
            let mut imin = S::zero();
            for (m, &pair) in mins.into_iter().zip(sums) {
                imin = S::add32(imin, S::madd16(m, S::splat32(pair)));
            }
            let da = S::splatf(acts.d[i]);
            let f = S::fma(S::cvt(isum), S::mul(dw, da), f);
            S::fnma(S::cvt(imin), S::mul(dmin, da), f)
        }
    }
}
