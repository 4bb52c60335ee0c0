//! The kernel's arithmetic on 512-bit registers (AVX-512F): per number the same IEEE
//! operations in the same order as [`super::Scalar`] and [`super::Avx2`], 16 lanes at a time.
//!
//! Where the width could have changed the order, and why it does not:
//! * scores: [`Avx512::transpose`] lays the keys out 16 positions side by side (two groups
//!   of 8 interleaved), so a vector holds 16 scores of one query row, each still its own FMA
//!   chain from zero over `d` in order; a tile's last group, when the number of groups is
//!   odd, keeps the 8-wide layout and runs the AVX2 block;
//! * the softmax sum: the documented order works on the tile's [`VECS`] vectors of 8 (lane
//!   `l` of vector `c` is position `8c + l`). Lanes `0..8` of our 16-lane vector `k` are
//!   positions `16k..16k+8`, i.e. vector `2k` of 8, and lanes `8..16` are vector `2k + 1`;
//!   so the exponentials are split back into those `VECS` halves, in order, and summed by
//!   the very code AVX2 uses ([`tile_sum`]). Adding the two 16-lane vectors of a tile
//!   first would pair vector 0 with 2 and 1 with 3, which is *not* the documented
//!   `(e0+e1)+(e2+e3)`. The maximum is exact in any order, but it is folded in the AVX2
//!   order too, so that even a signed zero comes out the same;
//! * `exp16` is `exp8` operation for operation: `roundscale` with 0 fraction bits and
//!   round-to-nearest-even is `round` to nearest, and `n` is integral, so its conversion to
//!   an integer is exact in both;
//! * decoding (f16 → f32 and bf16 → f32 are exact, q8_0 is one exact conversion and one
//!   multiplication), the value pass (`acc·α`, then FMAs in position order), merging and
//!   finishing work per number: the width changes nothing.
//!
//! No closure here holds an intrinsic (register arrays are filled by loops, not
//! `std::array::from_fn`): a closure is compiled without its caller's target features, so
//! an AVX-512 intrinsic inside one is not inlined but called, its vectors passed through
//! memory (the first version ran 20x slower than AVX2 that way). AVX2 intrinsics are safe
//! there only because the crate's baseline (x86-64-v3) has AVX2.
//! `layers::inlining_tests` checks the compiled test binary for such calls.
//!
//! The kernel checks it against the portable path at run time before using it
//! (`self_check`), and the selector keeps it only where it is also the faster one.

use std::arch::x86_64::*;

use super::avx2::score_block;
use super::ymm::{hmax, tile_sum, transpose_8_rows};
use super::*;

/// Positions (or dimensions) per 512-bit vector.
const LANES: usize = 16;
/// 16-lane vectors of scores per tile.
const ZMMS: usize = TILE / LANES;
const _: () = assert!(
    ZMMS * 2 == VECS,
    "a 16-lane vector is two of the documented 8-lane ones"
);

/// Query rows per register block of the scores and the value pass: `ROW_BLOCK_512 × 2`
/// accumulators plus 2 loaded vectors and a broadcast take 19 of the 32 registers (larger
/// blocks would fit; not measured).
const ROW_BLOCK_512: usize = 8;

/// AVX-512F (with AVX2/FMA/F16C, which every AVX-512 CPU has, for the 8-wide parts);
/// needs `head_dim % 16 == 0`.
#[derive(Clone, Copy)]
pub(in super::super) struct Avx512;

impl Avx512 {
    pub(in super::super) fn detect() -> bool {
        is_x86_feature_detected!("avx512f") && super::Avx2::detect()
    }
}

/// `exp8` on 16 lanes, operation for operation.
///
/// # Safety
/// AVX-512F.
#[inline(always)]
unsafe fn exp16(x: __m512) -> __m512 {
    // SAFETY (whole body): the caller runs with AVX-512F enabled.
    unsafe {
        let x = _mm512_max_ps(x, _mm512_set1_ps(EXP_LO));
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm512_mul_ps(x, _mm512_set1_ps(LOG2E)),
        );
        let r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_HI), x);
        let r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_LO), r);
        let z = _mm512_mul_ps(r, r);
        let mut y = _mm512_set1_ps(EXP_P[0]);
        for p in &EXP_P[1..] {
            y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(*p));
        }
        let y = _mm512_add_ps(_mm512_fmadd_ps(y, z, r), _mm512_set1_ps(1.0));
        let e = _mm512_slli_epi32::<23>(_mm512_add_epi32(
            _mm512_cvtps_epi32(n),
            _mm512_set1_epi32(127),
        ));
        _mm512_mul_ps(y, _mm512_castsi512_ps(e))
    }
}

/// Lanes `0..8` and `8..16` of `x`.
///
/// # Safety
/// AVX-512F.
#[inline(always)]
unsafe fn halves(x: __m512) -> [__m256; 2] {
    // SAFETY: the caller's contract.
    unsafe {
        let hi = _mm512_extractf64x4_pd::<1>(_mm512_castps_pd(x));
        [_mm512_castps512_ps256(x), _mm256_castpd_ps(hi)]
    }
}

/// `$f::<R, $c>($args)` for `R = min($rows, ROW_BLOCK_512)`.
macro_rules! by_rows {
    ($rows:expr, $f:ident, $c:literal, ($($arg:expr),*)) => {
        match $rows.min(ROW_BLOCK_512) {
            1 => $f::<1, $c>($($arg),*),
            2 => $f::<2, $c>($($arg),*),
            3 => $f::<3, $c>($($arg),*),
            4 => $f::<4, $c>($($arg),*),
            5 => $f::<5, $c>($($arg),*),
            6 => $f::<6, $c>($($arg),*),
            7 => $f::<7, $c>($($arg),*),
            _ => $f::<8, $c>($($arg),*),
        }
    };
}

/// Scores of `R` query rows (`q`, rows of `hd`) against `P` pairs of key groups (`kt`, pairs
/// of `16·hd` in the 16-wide layout), into `s` (rows `TILE` apart).
///
/// # Safety
/// AVX-512F; the rows and pairs exist.
#[inline(always)]
unsafe fn score_block16<const R: usize, const P: usize>(
    q: *const f32,
    hd: usize,
    kt: *const f32,
    s: *mut f32,
) {
    // SAFETY: the caller's contract.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); P]; R];
        for d in 0..hd {
            let mut k = [_mm512_setzero_ps(); P];
            for (p, kp) in k.iter_mut().enumerate() {
                *kp = _mm512_loadu_ps(kt.add(p * LANES * hd + d * LANES));
            }
            for (r, row) in acc.iter_mut().enumerate() {
                let qb = _mm512_set1_ps(*q.add(r * hd + d));
                for (x, kp) in row.iter_mut().zip(&k) {
                    *x = _mm512_fmadd_ps(qb, *kp, *x);
                }
            }
        }
        for (r, row) in acc.iter().enumerate() {
            for (p, x) in row.iter().enumerate() {
                _mm512_storeu_ps(s.add(r * TILE + p * LANES), *x);
            }
        }
    }
}

/// `R` rows × `C` 16-dim chunks of the value accumulation: each value vector loaded once
/// for the `R` rows.
///
/// # Safety
/// AVX-512F; the rows, chunks and `n` value rows exist.
#[inline(always)]
unsafe fn acc_block16<const R: usize, const C: usize>(
    acc: *mut f32,
    hd: usize,
    alpha: *const f32,
    e: *const f32,
    v: *const f32,
    n: usize,
) {
    // SAFETY: the caller's contract.
    unsafe {
        let mut a = [[_mm512_setzero_ps(); C]; R];
        for (r, row) in a.iter_mut().enumerate() {
            let al = _mm512_set1_ps(*alpha.add(r));
            for (c, x) in row.iter_mut().enumerate() {
                *x = _mm512_mul_ps(_mm512_loadu_ps(acc.add(r * hd + LANES * c)), al);
            }
        }
        for j in 0..n {
            let mut vj = [_mm512_setzero_ps(); C];
            for (c, x) in vj.iter_mut().enumerate() {
                *x = _mm512_loadu_ps(v.add(j * hd + LANES * c));
            }
            for (r, row) in a.iter_mut().enumerate() {
                let w = _mm512_set1_ps(*e.add(r * TILE + j));
                for (x, vc) in row.iter_mut().zip(&vj) {
                    *x = _mm512_fmadd_ps(w, *vc, *x);
                }
            }
        }
        for (r, row) in a.iter().enumerate() {
            for (c, x) in row.iter().enumerate() {
                _mm512_storeu_ps(acc.add(r * hd + LANES * c), *x);
            }
        }
    }
}

impl AttnOps for Avx512 {
    #[inline(always)]
    unsafe fn decode_row(self, dtype: KvStorage, src: &[u8], dst: &mut [f32]) {
        let hd = dst.len();
        debug_assert!(hd.is_multiple_of(LANES) && src.len() >= dtype.row_bytes(hd));
        let (s, d) = (src.as_ptr(), dst.as_mut_ptr());
        // SAFETY: `src` holds one encoded row of `hd` numbers (checked above in debug builds,
        // guaranteed by the pool's geometry), `dst` holds `hd` floats, and every access below
        // stays inside those (q8_0 blocks are multiples of 16 when `hd` is); AVX-512F was
        // detected.
        unsafe {
            match dtype {
                KvStorage::F32 => std::ptr::copy_nonoverlapping(s, d.cast::<u8>(), hd * 4),
                KvStorage::F16 => {
                    for c in 0..hd / LANES {
                        let h = _mm256_loadu_si256(s.add(32 * c).cast());
                        _mm512_storeu_ps(d.add(LANES * c), _mm512_cvtph_ps(h));
                    }
                }
                KvStorage::Bf16 => {
                    for c in 0..hd / LANES {
                        let h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(s.add(32 * c).cast()));
                        let f = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(h));
                        _mm512_storeu_ps(d.add(LANES * c), f);
                    }
                }
                KvStorage::Q8_0 => {
                    let qk = q8_block(hd);
                    for b in 0..hd / qk {
                        let blk = s.add(b * (2 + qk));
                        let bits = u16::from_le_bytes([*blk, *blk.add(1)]);
                        let scale = _mm512_set1_ps(half::f16::from_bits(bits).to_f32());
                        for c in 0..qk / LANES {
                            let q = _mm_loadu_si128(blk.add(2 + LANES * c).cast());
                            let f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
                            _mm512_storeu_ps(d.add(b * qk + LANES * c), _mm512_mul_ps(f, scale));
                        }
                    }
                }
            }
        }
    }

    /// Groups `2p` and `2p + 1` side by side: `kt[p·16·hd + d·16 + l] = k[(16p + l)·hd + d]`;
    /// a last odd group `g` in the portable layout at `g·8·hd`.
    #[inline(always)]
    unsafe fn transpose(self, k: &[f32], hd: usize, groups: usize, kt: &mut [f32]) {
        debug_assert!(hd.is_multiple_of(8) && k.len().min(kt.len()) >= groups * GROUP * hd);
        let paired = groups / 2 * 2;
        for g in 0..groups {
            let (at, stride) = if g < paired {
                ((g / 2) * LANES * hd + (g % 2) * GROUP, LANES)
            } else {
                (g * GROUP * hd, GROUP)
            };
            // SAFETY: group g's 8 rows of hd floats in; out, hd lines inside the first
            // groups·8·hd floats of kt (checked above).
            unsafe {
                transpose_8_rows(
                    k.as_ptr().add(g * GROUP * hd),
                    hd,
                    kt.as_mut_ptr().add(at),
                    stride,
                )
            };
        }
    }

    #[inline(always)]
    unsafe fn scores(
        self,
        q: &[f32],
        hd: usize,
        rows: usize,
        kt: &[f32],
        groups: usize,
        s: &mut [f32],
    ) {
        debug_assert!(q.len() >= rows * hd && kt.len() >= groups * GROUP * hd);
        debug_assert!(s.len() >= rows * TILE && groups <= TILE / GROUP);
        let (q, kt, s) = (q.as_ptr(), kt.as_ptr(), s.as_mut_ptr());
        let pairs = groups / 2;
        for (r0, nr) in row_blocks(rows, ROW_BLOCK_512) {
            let (qr, sr) = (q.wrapping_add(r0 * hd), s.wrapping_add(r0 * TILE));
            let mut p0 = 0;
            while p0 < pairs {
                let (k, so) = (
                    kt.wrapping_add(p0 * LANES * hd),
                    sr.wrapping_add(p0 * LANES),
                );
                // SAFETY: rows r0.., pairs p0.. lie inside the slices (checked above).
                unsafe {
                    if pairs - p0 >= 2 {
                        by_rows!(nr, score_block16, 2, (qr, hd, k, so));
                    } else {
                        by_rows!(nr, score_block16, 1, (qr, hd, k, so));
                    }
                }
                p0 += if pairs - p0 >= 2 { 2 } else { 1 };
            }
            if groups % 2 == 1 {
                let g = groups - 1;
                let (k, so) = (kt.wrapping_add(g * GROUP * hd), sr.wrapping_add(g * GROUP));
                // SAFETY: as above; AVX2/FMA come with AVX-512F here.
                unsafe { by_rows!(nr, score_block, 1, (qr, hd, k, so)) };
            }
        }
    }

    #[inline(always)]
    unsafe fn softmax(self, s: &mut [f32], m: f32, n: usize) -> (f32, f32) {
        debug_assert!(s.len() >= TILE && (1..=TILE).contains(&n));
        // SAFETY: s holds TILE = ZMMS·16 floats; AVX-512F (and AVX) were detected.
        unsafe {
            let p = s.as_mut_ptr();
            let mut x = [_mm512_setzero_ps(); ZMMS];
            for (k, xk) in x.iter_mut().enumerate() {
                *xk = _mm512_loadu_ps(p.add(LANES * k));
            }
            // Lane l of vector k is position 16k + l, live below n.
            let live: [__mmask16; ZMMS] = std::array::from_fn(|k| {
                let left = n.saturating_sub(LANES * k).min(LANES);
                ((1u32 << left) - 1) as __mmask16
            });
            let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
            // AVX2's fold: its vector c of 8 is half c % 2 of our vector c / 2.
            let mut mx = _mm256_set1_ps(m);
            for (xk, lk) in x.iter().zip(&live) {
                for h in halves(_mm512_mask_blend_ps(*lk, ninf, *xk)) {
                    mx = _mm256_max_ps(mx, h);
                }
            }
            let m = hmax(mx);
            let mv = _mm512_set1_ps(m);
            let mut e = [_mm512_setzero_ps(); ZMMS];
            for ((ek, xk), lk) in e.iter_mut().zip(&x).zip(&live) {
                *ek = _mm512_maskz_mov_ps(*lk, exp16(_mm512_sub_ps(*xk, mv)));
            }
            for (k, ek) in e.iter().enumerate() {
                _mm512_storeu_ps(p.add(LANES * k), *ek);
            }
            // The documented vectors of 8, in order (see the module docs).
            let mut e8 = [_mm256_setzero_ps(); VECS];
            for (c, h) in e8.iter_mut().enumerate() {
                *h = halves(e[c / 2])[c % 2];
            }
            (m, tile_sum(e8))
        }
    }

    #[inline(always)]
    unsafe fn accumulate(
        self,
        acc: &mut [f32],
        hd: usize,
        alpha: &[f32],
        e: &[f32],
        v: &[f32],
        n: usize,
    ) {
        let rows = acc.len() / hd;
        debug_assert!(hd.is_multiple_of(LANES) && alpha.len() >= rows && v.len() >= n * hd);
        debug_assert!(e.len() >= rows * TILE && n <= TILE);
        let (acc, alpha, e, v) = (acc.as_mut_ptr(), alpha.as_ptr(), e.as_ptr(), v.as_ptr());
        let chunks = hd / LANES;
        for (r0, nr) in row_blocks(rows, ROW_BLOCK_512) {
            let (a, al, er) = (
                acc.wrapping_add(r0 * hd),
                alpha.wrapping_add(r0),
                e.wrapping_add(r0 * TILE),
            );
            let mut c0 = 0;
            while c0 < chunks {
                let (ac, vc) = (a.wrapping_add(LANES * c0), v.wrapping_add(LANES * c0));
                // SAFETY: rows r0.., dims 16·c0.. lie inside the slices (checked above).
                unsafe {
                    if chunks - c0 >= 2 {
                        by_rows!(nr, acc_block16, 2, (ac, hd, al, er, vc, n));
                    } else {
                        by_rows!(nr, acc_block16, 1, (ac, hd, al, er, vc, n));
                    }
                }
                c0 += if chunks - c0 >= 2 { 2 } else { 1 };
            }
        }
    }

    #[inline(always)]
    unsafe fn merge(self, acc: &mut [f32], ca: f32, b: &[f32], cb: f32) {
        debug_assert!(acc.len().is_multiple_of(LANES) && b.len() >= acc.len());
        // SAFETY: both hold hd floats, a multiple of 16.
        unsafe {
            let (ca, cb) = (_mm512_set1_ps(ca), _mm512_set1_ps(cb));
            for c in 0..acc.len() / LANES {
                let a = acc.as_mut_ptr().add(LANES * c);
                let x = _mm512_mul_ps(_mm512_loadu_ps(a), ca);
                let y = _mm512_fmadd_ps(_mm512_loadu_ps(b.as_ptr().add(LANES * c)), cb, x);
                _mm512_storeu_ps(a, y);
            }
        }
    }

    #[inline(always)]
    unsafe fn finish(self, acc: &[f32], l: f32, out: &mut [f32]) {
        debug_assert!(acc.len().is_multiple_of(LANES) && out.len() >= acc.len());
        // SAFETY: both hold hd floats, a multiple of 16.
        unsafe {
            let l = _mm512_set1_ps(l);
            for c in 0..acc.len() / LANES {
                let x = _mm512_div_ps(_mm512_loadu_ps(acc.as_ptr().add(LANES * c)), l);
                _mm512_storeu_ps(out.as_mut_ptr().add(LANES * c), x);
            }
        }
    }
}
