//! Q6_K weights × Q8_K activations.
//!
//! A ggml Q6_K block covers 256 values in 16 sub-blocks of 16, each with an i8
//! scale: `w = d·sc·(q - 32)`, `q` in 0..=63 split into a low nibble and 2 high
//! bits. We decode `q` at load time and re-split it into planes that one shift and
//! mask turn into chunk `c` (k = 4c..4c+3) of all columns. Packed layout, per
//! 16-column group and block (3456 bytes; column j at bytes 4j..4j+4 of each plane row):
//! ```text
//! [ d: f32 × 16 ][ sc: [16 sub][16 col] i8 ][ lo: 32 × 64 B ][ hi: 16 × 64 B ][ offset: i32 × 16 ]
//!   lo[i], byte t: low nibble = q(4i+t) & 15, high nibble = q(128+4i+t) & 15
//!   hi[i], byte t: bits 2T..2T+1 = q(4(i+16T)+t) >> 4, T = 0..3
//!   offset = 128·Σ_g sc_g·Σ (q - 32)   (read by the AVX2 tile only)
//! ```
//! Per (row, column): `isum = Σ_g sc_g·(Σ q·a - 32·Σa_g)` exact in i32, then
//! `acc = fma(f32(isum), dw·da, acc)` per block in order, independent of the tile
//! height and vector width.
//!
//! Plain AVX2 has its own tile ([`Kernel::tile_avx2`] below): without `vpdpbusd` the
//! generic form costs a widening `madd` per 4 k-values and a `mullo` per sub-block and
//! row, and its three accumulator sets overflow the 16 ymm registers. The AVX2 tile
//! multiplies `a + 128` (u8) by `q - 32` (i8) with `maddubs`, adds two chunks' pair sums
//! in i16 (|255·32·2·2| = 32640 fits), applies the sub-block scale in the widening `madd`
//! itself (`(sc, sc)` i16 pairs), and subtracts the weights-only `offset` once per block:
//! `Σ sc·Σ (a + 128)(q - 32) - offset` is the same integer `isum`, followed by the same f32
//! operations, so it is bit-identical to the generic tile.
//!
//! A single row (decode) has its own AVX2 kernel, [`row16_avx2`]: it unpacks each chunk for
//! both 8-column halves against one activation broadcast and prefetches the weights ahead,
//! which took the m = 1 stream of a past-the-cache matrix from ~9 to ~21 GB/s on one Zen 3 core.

use std::arch::x86_64::*;

use std::ops::Range;

use super::activation::{ActKind, QuantizedActs, K_SUMS, QK_K};
use super::simd::Simd;
use super::{prefetch, Kernel, GROUP};

pub(super) struct Q6K;

const SC: usize = 4 * GROUP;
const LO: usize = SC + 16 * GROUP;
const HI: usize = LO + 32 * 4 * GROUP;
const OFFSET: usize = HI + 16 * 4 * GROUP;

/// The 256 unsigned 6-bit values of one ggml Q6_K block, in k order.
pub(super) fn decode(raw: &[u8]) -> [u8; QK_K] {
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
    const GROUP_BLOCK_BYTES: usize = OFFSET + 4 * GROUP;
    const WIDE_TILE: usize = 4;
    const AVX2_TILE: usize = 6;

    amx_rows_by!(scaled_rows);

    fn pack_block(cols: &[Option<&[u8]>; GROUP], out: &mut [u8]) {
        for (j, raw) in cols.iter().enumerate() {
            let Some(raw) = raw else { continue };
            let d = half::f16::from_le_bytes([raw[208], raw[209]]).to_f32();
            out[4 * j..4 * j + 4].copy_from_slice(&d.to_le_bytes());
            for g in 0..16 {
                out[SC + GROUP * g + j] = raw[192 + g];
            }
            let q = decode(raw);
            for i in 0..32 {
                for t in 0..4 {
                    out[LO + 4 * GROUP * i + 4 * j + t] =
                        (q[4 * i + t] & 0xF) | ((q[128 + 4 * i + t] & 0xF) << 4);
                }
            }
            // 128·Σ_g sc_g·Σ (q - 32): what the AVX2 tile's `a + 128` adds to the block sum.
            let offset: i32 = (0..16)
                .map(|g| {
                    let sc = i32::from(raw[192 + g] as i8);
                    let sum: i32 = q[16 * g..16 * g + 16]
                        .iter()
                        .map(|&v| i32::from(v) - 32)
                        .sum();
                    128 * sc * sum
                })
                .sum();
            out[OFFSET + 4 * j..OFFSET + 4 * j + 4].copy_from_slice(&offset.to_le_bytes());
            for i in 0..16 {
                for t in 0..4 {
                    out[HI + 4 * GROUP * i + 4 * j + t] = (0..4).fold(0u8, |acc, hi| {
                        acc | ((q[4 * (i + 16 * hi) + t] >> 4) << (2 * hi))
                    });
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
/// ([`Kernel::stream_tile`]), so the block asks for the lines
/// ahead ([`super::prefetch`]) a quarter at a time, between its sub-blocks.
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
    // SAFETY: the caller's contract: rows `row0..row0 + R` and blocks `blocks` exist in
    // `acts`, so each row's pointers below address its block's 256 values and 16 sums.
    unsafe {
        for b in blocks {
            let blk = group.add(b * Q6K::GROUP_BLOCK_BYTES);
            let row = |r: usize| Row {
                qs: acts.qs.as_ptr().add((row0 + r) * acts.k + b * QK_K),
                sums: acts.sums.as_ptr().add(((row0 + r) * acts.nb + b) * K_SUMS),
            };
            let rows: [Row; R] = std::array::from_fn(row);
            let mut isum = [S::zero(); R];
            quarter_generic::<S, R, 0, STREAM>(blk, col_off, &rows, &mut isum);
            quarter_generic::<S, R, 1, STREAM>(blk, col_off, &rows, &mut isum);
            quarter_generic::<S, R, 2, STREAM>(blk, col_off, &rows, &mut isum);
            quarter_generic::<S, R, 3, STREAM>(blk, col_off, &rows, &mut isum);
            let dw = S::loadf(blk.add(4 * col_off));
            for (r, (f, t)) in facc.iter_mut().zip(isum).enumerate() {
                let da = S::splatf(*acts.d.get_unchecked((row0 + r) * acts.nb + b));
                *f = S::fma(S::cvt(t), S::mul(dw, da), *f);
            }
        }
        facc
    }
}

/// One row's inputs for one block: its 256 activations and 16 sub-block sums.
#[derive(Clone, Copy)]
struct Row {
    qs: *const i8,
    sums: *const i32,
}

/// Sub-blocks `4T..4T+4` of one block (chunks `16T..16T+16`) into `isum`, in order:
/// `Σ_g sc_g·(Σ q·a - 32·Σa_g)` per row and column. `T` is a constant so that the chunk's
/// nibble and high-bit field are fixed shifts: with the quarter a run-time value (a loop over
/// all 16 sub-blocks) the compiler kept the loop and chose each shift by a branch, and the
/// 1-row stream of an in-cache matrix computed at ~22 GB/s on one core.
///
/// # Safety
/// `blk` is a packed block and `col_off + S::LANES ≤ GROUP`; every `rows[r]` points at its
/// row's activations and sums of this block.
#[inline(always)]
unsafe fn quarter_generic<S: Simd, const R: usize, const T: usize, const STREAM: bool>(
    blk: *const u8,
    col_off: usize,
    rows: &[Row; R],
    isum: &mut [S::I; R],
) {
    // SAFETY: the caller's contract; every offset below stays inside the block or the rows.
    unsafe {
        if STREAM {
            // 4 steps of 14 lines cover the 54-line block. (A line per chunk instead, as decode
            // attention asks, streamed ~5% slower and computed 16% slower in cache.)
            prefetch::ahead(blk, 64 * 14 * T, 14);
        }
        let planes = blk.add(4 * col_off);
        let low4 = S::splat8(0x0F);
        let bits45 = S::splat8(0x30);
        for s in 0..4 {
            let g = 4 * T + s;
            let mut acc = [S::zero(); R];
            for j in 0..4 {
                let i = 4 * s + j;
                let c = 16 * T + i;
                let v = S::load(planes.add(LO + 4 * GROUP * (16 * (T % 2) + i)));
                let nib = if T < 2 { v } else { S::shr16::<4>(v) };
                let h = S::load(planes.add(HI + 4 * GROUP * i));
                let u = S::or(S::and(nib, low4), S::and(high_bits::<S>(h, T), bits45));
                for (a, row) in acc.iter_mut().zip(rows) {
                    *a = S::dot_u6(*a, u, S::bcast4(row.qs.add(4 * c)));
                }
            }
            let sc = S::i8_i32(blk.add(SC + GROUP * g + col_off));
            for ((t, a), row) in isum.iter_mut().zip(acc).zip(rows) {
                let a = S::sub32(a, S::splat32(32 * *row.sums.add(g)));
                *t = S::add32(*t, S::mullo32(a, sc));
            }
        }
    }
}

/// One row × all 16 columns of a group on plain AVX2 (decode): each chunk's 64-byte plane
/// rows are unpacked for both 8-column halves at once, against one broadcast of the
/// activations, with software prefetches ahead ([`super::prefetch`]). Per column the
/// same integer `isum` and f32 operations as [`tile_avx2`], so the same bits.
///
/// # Safety
/// `group` points at `acts.nb` packed blocks, row `row` exists in `acts`, AVX2 is enabled.
#[inline(always)]
unsafe fn row16_avx2(group: *const u8, acts: &QuantizedActs, row: usize) -> [__m256; 2] {
    // SAFETY: the caller's contract; every read below stays inside block `b` or row `row`.
    unsafe {
        let mut facc = [_mm256_setzero_ps(); 2];
        for b in 0..acts.nb {
            let blk = group.add(b * Q6K::GROUP_BLOCK_BYTES);
            let a = acts.qs_u8.as_ptr().add(row * acts.k + b * QK_K);
            let mut isum = [_mm256_setzero_si256(); 2];
            quarter16_avx2::<0>(blk, a, &mut isum);
            quarter16_avx2::<1>(blk, a, &mut isum);
            quarter16_avx2::<2>(blk, a, &mut isum);
            quarter16_avx2::<3>(blk, a, &mut isum);
            let da = _mm256_set1_ps(*acts.d.get_unchecked(row * acts.nb + b));
            for (h, (f, t)) in facc.iter_mut().zip(isum).enumerate() {
                let offset = _mm256_loadu_si256(blk.add(OFFSET + 32 * h) as *const __m256i);
                let dw = _mm256_loadu_ps(blk.add(32 * h) as *const f32);
                let t = _mm256_sub_epi32(t, offset);
                *f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(dw, da), *f);
            }
        }
        facc
    }
}

/// [`quarter_avx2`] for one row and both column halves.
///
/// # Safety
/// `blk` is a packed block, `a` the row's `a + 128` bytes of this block; AVX2 is enabled.
#[inline(always)]
unsafe fn quarter16_avx2<const T: usize>(blk: *const u8, a: *const u8, isum: &mut [__m256i; 2]) {
    // SAFETY: the caller's contract; every offset below stays inside the block.
    unsafe {
        for s in 0..4 {
            // 16 steps of 4 lines cover the 54-line block (3456 bytes).
            prefetch::ahead(blk, 256 * (4 * T + s), 4);
            let sc16 = _mm_loadu_si128(blk.add(SC + GROUP * (4 * T + s)) as *const __m128i);
            let scv = [
                _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(sc16, sc16)),
                _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(sc16, sc16)),
            ];
            for pair in 0..2 {
                let i = 4 * s + 2 * pair;
                let at = a.add(64 * T + 4 * i);
                let a0 = _mm256_set1_epi32(std::ptr::read_unaligned(at as *const i32));
                let a1 = _mm256_set1_epi32(std::ptr::read_unaligned(at.add(4) as *const i32));
                for (h, t) in isum.iter_mut().enumerate() {
                    let planes = blk.add(32 * h);
                    let p = _mm256_add_epi16(
                        _mm256_maddubs_epi16(a0, chunk_avx2::<T>(planes, i)),
                        _mm256_maddubs_epi16(a1, chunk_avx2::<T>(planes, i + 1)),
                    );
                    *t = _mm256_add_epi32(*t, _mm256_madd_epi16(p, scv[h]));
                }
            }
        }
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
    // SAFETY: `group` points at `acts.nb` packed blocks, the columns lie in the group,
    // rows `row0..row0+R` exist in `acts` (so every activation read below is in bounds),
    // and the caller runs with AVX2/FMA enabled.
    unsafe {
        for b in blocks {
            let blk = group.add(b * Q6K::GROUP_BLOCK_BYTES);
            let planes = blk.add(4 * col_off);
            let acts_at: [*const u8; R] =
                std::array::from_fn(|r| acts.qs_u8.as_ptr().add((row0 + r) * acts.k + b * QK_K));
            let mut isum = [_mm256_setzero_si256(); R];
            quarter_avx2::<0, R>(blk.add(col_off), planes, &acts_at, &mut isum);
            quarter_avx2::<1, R>(blk.add(col_off), planes, &acts_at, &mut isum);
            quarter_avx2::<2, R>(blk.add(col_off), planes, &acts_at, &mut isum);
            quarter_avx2::<3, R>(blk.add(col_off), planes, &acts_at, &mut isum);
            let offset = _mm256_loadu_si256(planes.add(OFFSET) as *const __m256i);
            let dw = _mm256_loadu_ps(planes as *const f32);
            for (r, (f, t)) in facc.iter_mut().zip(isum).enumerate() {
                let t = _mm256_sub_epi32(t, offset);
                let da = _mm256_set1_ps(*acts.d.get_unchecked((row0 + r) * acts.nb + b));
                *f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(dw, da), *f);
            }
        }
        facc
    }
}

/// Sub-blocks `4T..4T+4` (chunks `16T..16T+16`, whose high bits sit at field `T` of the
/// `hi` plane and whose low bits in the low (`T < 2`) or high nibbles of `lo`) into `isum`:
/// `Σ sc·Σ (a + 128)·(q - 32)` per row and column.
///
/// # Safety
/// `blk_cols` is the block plus `col_off` (the scales), `planes` the block plus
/// `4·col_off`; `acts_at[r]` points at row r's `a + 128` bytes of this block; AVX2 is enabled.
#[inline(always)]
unsafe fn quarter_avx2<const T: usize, const R: usize>(
    blk_cols: *const u8,
    planes: *const u8,
    acts_at: &[*const u8; R],
    isum: &mut [__m256i; R],
) {
    // SAFETY: the caller's contract; every offset below stays inside one packed block.
    unsafe {
        for s in 0..4 {
            let sc8 = _mm_loadl_epi64(blk_cols.add(SC + GROUP * (4 * T + s)) as *const __m128i);
            // (sc, sc) as i16 in every 32-bit lane.
            let scv = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(sc8, sc8));
            for pair in 0..2 {
                let i = 4 * s + 2 * pair;
                let (w0, w1) = (chunk_avx2::<T>(planes, i), chunk_avx2::<T>(planes, i + 1));
                for (t, &a) in isum.iter_mut().zip(acts_at) {
                    let a = a.add(64 * T + 4 * i);
                    let a0 = _mm256_set1_epi32(std::ptr::read_unaligned(a as *const i32));
                    let a1 = _mm256_set1_epi32(std::ptr::read_unaligned(a.add(4) as *const i32));
                    // Pair sums ≤ 255·32·2 = 16320, two chunks' ≤ 32640: exact in i16.
                    let p = _mm256_add_epi16(
                        _mm256_maddubs_epi16(a0, w0),
                        _mm256_maddubs_epi16(a1, w1),
                    );
                    *t = _mm256_add_epi32(*t, _mm256_madd_epi16(p, scv));
                }
            }
        }
    }
}

/// Chunk `16T + i` (k = 64T + 4i..+4) of the 8 columns whose plane bytes start at `planes`,
/// as signed `q - 32` in every byte.
///
/// # Safety
/// `planes` is a packed block plus `4·col_off` with `col_off + 8 ≤ 16`; AVX2 is enabled.
#[inline(always)]
unsafe fn chunk_avx2<const T: usize>(planes: *const u8, i: usize) -> __m256i {
    // SAFETY: the caller's contract; both rows lie inside the block.
    unsafe {
        let v =
            _mm256_loadu_si256(planes.add(LO + 4 * GROUP * (16 * (T % 2) + i)) as *const __m256i);
        let nib = if T < 2 { v } else { _mm256_srli_epi16::<4>(v) };
        let h = _mm256_loadu_si256(planes.add(HI + 4 * GROUP * i) as *const __m256i);
        let h = match T {
            0 => _mm256_slli_epi16::<4>(h),
            1 => _mm256_slli_epi16::<2>(h),
            2 => h,
            _ => _mm256_srli_epi16::<2>(h),
        };
        let low4 = _mm256_set1_epi8(0x0F);
        let bits45 = _mm256_set1_epi8(0x30);
        let q = _mm256_or_si256(_mm256_and_si256(nib, low4), _mm256_and_si256(h, bits45));
        _mm256_sub_epi8(q, _mm256_set1_epi8(32))
    }
}

/// Moves bits 2T..2T+1 of every byte to bits 4..5 (the caller masks the rest);
/// 16-bit shifts by at most 4 never carry a neighbour byte's bits into 4..5.
#[inline(always)]
unsafe fn high_bits<S: Simd>(h: S::I, t: usize) -> S::I {
    // SAFETY: register shifts; the caller's ISA contract holds.
    unsafe {
        match t {
            0 => S::shl16::<4>(h),
            1 => S::shl16::<2>(h),
            2 => h,
            _ => S::shr16::<2>(h),
        }
    }
}

impl super::amx::ScaledBlocks for Q6K {
    const HI_SIGNED: bool = true;

    #[inline(always)]
    unsafe fn unpack_scaled(blk: *const u8, out: &mut [u8; 8 * 1024]) {
        use super::amx::{put, scale16, split_scaled};
        use super::simd::Avx512 as S;
        // SAFETY: `blk` is one packed block (the caller's contract); AVX-512 is enabled.
        unsafe {
            let low4 = S::splat8(0x0F);
            let bits45 = S::splat8(0x30);
            let bias = S::splat8(32);
            // Chunk c (tile c / 16, row c % 16) as `tile_generic` decodes it, less 32, times
            // its sub-block's i8 scale: `v = sc·(q - 32)`, |v| ≤ 4096.
            for c in 0..64 {
                let v = S::load(blk.add(LO + 4 * GROUP * (c % 32)));
                let nib = if c < 32 { v } else { S::shr16::<4>(v) };
                let h = S::load(blk.add(HI + 4 * GROUP * (c % 16)));
                let u = S::or(S::and(nib, low4), S::and(high_bits::<S>(h, c / 16), bits45));
                let q = _mm512_sub_epi8(u, bias);
                let sc = scale16(S::i8_i32(blk.add(SC + GROUP * (c / 4))));
                let (lo, hi) = split_scaled(q, sc, true);
                put(out, c / 16, c % 16, lo);
                put(out, 4 + c / 16, c % 16, hi);
            }
        }
    }

    /// `dw`.
    type Block = __m512;

    #[inline(always)]
    unsafe fn block(blk: *const u8) -> __m512 {
        use super::simd::Avx512 as S;
        // SAFETY: the caller's contract.
        unsafe { S::loadf(blk) }
    }

    #[inline(always)]
    unsafe fn finish(
        dw: __m512,
        acts: &QuantizedActs,
        row: usize,
        b: usize,
        isum: __m512i,
        f: __m512,
    ) -> __m512 {
        use super::simd::Avx512 as S;
        // SAFETY: the caller's contract. `tile_generic`'s f32 work for one row.
        unsafe {
            let da = S::splatf(acts.d[row * acts.nb + b]);
            S::fma(S::cvt(isum), S::mul(dw, da), f)
        }
    }
}
