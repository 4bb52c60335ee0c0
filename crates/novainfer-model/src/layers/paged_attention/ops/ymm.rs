//! The parts of the vectorized kernel that stay 8 lanes wide at every width: the documented
//! order of a tile's maximum and sum is in vectors of [`GROUP`] positions (so a wider ISA
//! splits its vectors back into those), and the keys are decoded and transposed 8 rows at a
//! time.
//! AVX2 intrinsics are safe in these (and in the closure of [`tree`]) for every ISA: the
//! crate's baseline, x86-64-v3, has AVX2, so they inline wherever they are called.

use std::arch::x86_64::*;

use super::format::Format;
use super::{tree, Avx2, GROUP, VECS};

const _: () = assert!(GROUP == 8, "one __m256 is one group of positions");

/// The largest of `mx`'s lanes (exact in any order).
///
/// # Safety
/// AVX.
#[inline(always)]
pub(super) unsafe fn hmax(mx: __m256) -> f32 {
    // SAFETY: the caller's contract.
    unsafe {
        let t = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps::<1>(mx));
        let t = _mm_max_ps(t, _mm_movehl_ps(t, t));
        let t = _mm_max_ss(t, _mm_shuffle_ps::<1>(t, t));
        _mm_cvtss_f32(t)
    }
}

/// A tile's sum of exponentials in the documented order, `e[c]` its vector `c` (lane `l`
/// is position `8c + l`): lane-wise [`tree`], then `(h0+h2)+(h1+h3)`, `h[i] = l[i]+l[i+4]`.
///
/// # Safety
/// AVX.
#[inline(always)]
pub(super) unsafe fn tile_sum(e: [__m256; VECS]) -> f32 {
    // SAFETY: the caller's contract.
    unsafe {
        let l = tree(e, |a, b| _mm256_add_ps(a, b));
        let h = _mm_add_ps(_mm256_castps256_ps128(l), _mm256_extractf128_ps::<1>(l));
        let g = _mm_add_ps(h, _mm_movehl_ps(h, h));
        let sum = _mm_add_ss(g, _mm_shuffle_ps::<1>(g, g));
        _mm_cvtss_f32(sum)
    }
}

/// Decodes and transposes the 8 rows of `hd` numbers at `rows` (`F`-encoded) into lines of
/// `stride` floats: `dst[d·stride + j] = row_j[d]`, the rest of each line untouched.
///
/// # Safety
/// AVX2/FMA/F16C; `hd` a multiple of 8; the rows valid for `F`'s `row_bytes(hd)` and the
/// `hd` lines writable.
#[inline(always)]
pub(super) unsafe fn transpose_8_rows<F: Format>(
    rows: &[*const u8; 8],
    hd: usize,
    dst: *mut f32,
    stride: usize,
) {
    // SAFETY: the caller's contract.
    unsafe {
        for c in 0..hd / 8 {
            let mut r = [_mm256_setzero_ps(); 8];
            for (x, row) in r.iter_mut().zip(rows) {
                *x = F::load::<Avx2>(*row, 8 * c, hd);
            }
            let t0 = _mm256_unpacklo_ps(r[0], r[1]);
            let t1 = _mm256_unpackhi_ps(r[0], r[1]);
            let t2 = _mm256_unpacklo_ps(r[2], r[3]);
            let t3 = _mm256_unpackhi_ps(r[2], r[3]);
            let t4 = _mm256_unpacklo_ps(r[4], r[5]);
            let t5 = _mm256_unpackhi_ps(r[4], r[5]);
            let t6 = _mm256_unpacklo_ps(r[6], r[7]);
            let t7 = _mm256_unpackhi_ps(r[6], r[7]);
            let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
            let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
            let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
            let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
            let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
            let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
            let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
            let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
            // Column d = 8c + i of the 8 rows.
            let cols = [
                _mm256_permute2f128_ps::<0x20>(u0, u4),
                _mm256_permute2f128_ps::<0x20>(u1, u5),
                _mm256_permute2f128_ps::<0x20>(u2, u6),
                _mm256_permute2f128_ps::<0x20>(u3, u7),
                _mm256_permute2f128_ps::<0x31>(u0, u4),
                _mm256_permute2f128_ps::<0x31>(u1, u5),
                _mm256_permute2f128_ps::<0x31>(u2, u6),
                _mm256_permute2f128_ps::<0x31>(u3, u7),
            ];
            for (i, col) in cols.iter().enumerate() {
                _mm256_storeu_ps(dst.add((8 * c + i) * stride), *col);
            }
        }
    }
}
