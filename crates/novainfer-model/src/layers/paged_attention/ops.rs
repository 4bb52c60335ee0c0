//! The arithmetic of the attention kernel, once portable, once in AVX2/FMA/F16C and once in
//! AVX-512F ([`avx512`]).
//!
//! All implementations perform the same IEEE operations in the same order on every
//! number, so they agree bit for bit (tested); only the speed differs:
//! * a score `q·k` is one chain of fused multiply-adds from zero over the dimensions in
//!   order (keys are stored transposed, 8 positions side by side (16 for AVX-512), so the
//!   scores of a query row fill one vector and no horizontal sums are needed);
//! * a tile's maximum is exact whatever the order; `exp` is one polynomial (Cephes' `expf`:
//!   range reduction by `ln 2`, degree-5 polynomial, scaling by `2ⁿ` through the exponent
//!   bits), written once per lane; a tile's sum of exponentials is lane-wise over its
//!   [`VECS`] vectors of 8 (lane `l` of vector `c` is position `8c + l`) as a pairwise tree
//!   ([`tree`]: `((e0+e1)+(e2+e3))+((e4+e5)+(e6+e7))` for 8), then `((h0+h2)+(h1+h3))`
//!   with `h[i] = l[i]+l[i+4]`;
//! * value accumulation is per dimension: `acc·α`, then `acc = fma(e_j, v_j, acc)` in
//!   position order. Positions past a row's own limit carry `e_j = 0`, so a row may run a
//!   few extra (exact no-op) steps when it shares a tile with later rows.

use crate::kv_dtype::{q8_block, KvStorage};

/// Positions per softmax tile (and rows of the K/V scratch): the per-row work of a tile
/// (maximum, rescaling, sums, reloading the running values) is paid once per `TILE` positions.
pub(super) const TILE: usize = 32;
/// Positions side by side in the transposed key scratch (one vector).
pub(super) const GROUP: usize = 8;
/// Vectors of scores per tile.
const VECS: usize = TILE / GROUP;
const _: () = assert!(
    TILE.is_multiple_of(GROUP) && VECS.is_power_of_two(),
    "the softmax sum is a pairwise tree over the tile's vectors"
);

/// Query rows per register block of the scores and the value pass: `ROW_BLOCK × 2`
/// accumulators plus 2 loaded vectors and a broadcast fill 15 of the 16 AVX2 registers.
const ROW_BLOCK: usize = 6;

/// `rows` as the fewest blocks `(first row, rows)` of at most `max`, as even as
/// possible: a block of 1-2 rows has too few accumulators to hide the FMA latency.
fn row_blocks(rows: usize, max: usize) -> impl Iterator<Item = (usize, usize)> {
    let blocks = rows.div_ceil(max);
    (0..blocks).map(move |b| {
        let r0 = rows * b / blocks;
        (r0, rows * (b + 1) / blocks - r0)
    })
}

/// `x` summed as a pairwise tree, `((x0+x1)+(x2+x3))+((x4+x5)+(x6+x7))` for 8 (`N` a
/// power of two); level by level rather than recursive, so that it inlines.
#[inline(always)]
fn tree<T: Copy, const N: usize>(mut x: [T; N], add: impl Fn(T, T) -> T) -> T {
    let mut n = N;
    while n > 1 {
        for i in 0..n / 2 {
            x[i] = add(x[2 * i], x[2 * i + 1]);
        }
        n /= 2;
    }
    x[0]
}

/// What the kernel driver needs from an instruction set.
///
/// # Safety
/// Every method may use instructions of its ISA: call it only where they were detected.
pub(super) trait AttnOps: Copy {
    /// Decodes one row of `dst.len()` numbers from `src` (in `dtype`).
    unsafe fn decode_row(self, dtype: KvStorage, src: &[u8], dst: &mut [f32]);
    /// Lays out the keys of groups `g < groups` (`k`: rows of `hd`, [`GROUP`] rows a group) in
    /// `kt` (`groups·8·hd` floats) the way this ISA's [`AttnOps::scores`] reads them; the
    /// portable layout is `kt[g·8·hd + d·8 + j] = k[(8g + j)·hd + d]`.
    unsafe fn transpose(self, k: &[f32], hd: usize, groups: usize, kt: &mut [f32]);
    /// For query rows `r < rows` (`q`: rows of `hd`) and key groups `g < groups` (`kt` from
    /// [`AttnOps::transpose`]): `s[r·TILE + 8g + l] = Σ_d q[r][d]·k_{8g+l}[d]`.
    unsafe fn scores(
        self,
        q: &[f32],
        hd: usize,
        rows: usize,
        kt: &[f32],
        groups: usize,
        s: &mut [f32],
    );
    /// Scores → exponentials in place: with `m' = max(m, s[..n])`, `s[j] = exp(s[j] − m')`
    /// for `j < n` and 0 after; returns `(m', Σ s)`. `n ≥ 1`.
    unsafe fn softmax(self, s: &mut [f32], m: f32, n: usize) -> (f32, f32);
    /// For rows `r` of `acc` (rows of `hd`): `acc_r = acc_r·alpha[r] + Σ_{j<n} e[r·TILE + j]·v_j`,
    /// `v` rows of `hd`.
    unsafe fn accumulate(
        self,
        acc: &mut [f32],
        hd: usize,
        alpha: &[f32],
        e: &[f32],
        v: &[f32],
        n: usize,
    );
    /// `acc = acc·ca + b·cb` (one fused multiply-add per number).
    unsafe fn merge(self, acc: &mut [f32], ca: f32, b: &[f32], cb: f32);
    /// `out = acc / l`.
    unsafe fn finish(self, acc: &[f32], l: f32, out: &mut [f32]);
}

const EXP_LO: f32 = -87.336_54;
const LOG2E: f32 = std::f32::consts::LOG2_E;
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
const EXP_P: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5, // Cephes: 5.0000001201e-1, which rounds to 0.5 in f32
];

/// `exp(x)` for `x ≤ 0` (smaller than −87.3 gives `exp(−87.3)`, a number that only ever
/// multiplies zeros or vanishes next to 1); bit-identical to one lane of the AVX2 version.
#[inline(always)]
pub(super) fn exp_scalar(x: f32) -> f32 {
    let x = x.max(EXP_LO);
    let n = (x * LOG2E).round_ties_even();
    let r = n.mul_add(-LN2_HI, x);
    let r = n.mul_add(-LN2_LO, r);
    let z = r * r;
    let mut y = EXP_P[0];
    for p in &EXP_P[1..] {
        y = y.mul_add(r, *p);
    }
    let y = y.mul_add(z, r) + 1.0;
    y * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// The portable implementation (any CPU, any head size).
#[derive(Clone, Copy)]
pub(super) struct Scalar;

impl AttnOps for Scalar {
    unsafe fn decode_row(self, dtype: KvStorage, src: &[u8], dst: &mut [f32]) {
        dtype.decode(src, dst);
    }

    unsafe fn transpose(self, k: &[f32], hd: usize, groups: usize, kt: &mut [f32]) {
        for g in 0..groups {
            let (rows, kt) = (&k[g * GROUP * hd..], &mut kt[g * GROUP * hd..]);
            for j in 0..GROUP {
                for d in 0..hd {
                    kt[d * GROUP + j] = rows[j * hd + d];
                }
            }
        }
    }

    unsafe fn scores(
        self,
        q: &[f32],
        hd: usize,
        rows: usize,
        kt: &[f32],
        groups: usize,
        s: &mut [f32],
    ) {
        for r in 0..rows {
            let q = &q[r * hd..(r + 1) * hd];
            for j in 0..groups * GROUP {
                let k = &kt[(j / GROUP) * GROUP * hd + j % GROUP..];
                let mut acc = 0f32;
                for (d, qd) in q.iter().enumerate() {
                    acc = qd.mul_add(k[d * GROUP], acc);
                }
                s[r * TILE + j] = acc;
            }
        }
    }

    unsafe fn softmax(self, s: &mut [f32], m: f32, n: usize) -> (f32, f32) {
        let m = s[..n].iter().fold(m, |a, &b| a.max(b));
        for (j, x) in s[..TILE].iter_mut().enumerate() {
            *x = if j < n { exp_scalar(*x - m) } else { 0.0 };
        }
        let l: [f32; GROUP] = std::array::from_fn(|l| {
            let lane: [f32; VECS] = std::array::from_fn(|c| s[c * GROUP + l]);
            tree(lane, |a, b| a + b)
        });
        let h: [f32; 4] = std::array::from_fn(|i| l[i] + l[i + 4]);
        (m, (h[0] + h[2]) + (h[1] + h[3]))
    }

    unsafe fn accumulate(
        self,
        acc: &mut [f32],
        hd: usize,
        alpha: &[f32],
        e: &[f32],
        v: &[f32],
        n: usize,
    ) {
        for (r, row) in acc.chunks_exact_mut(hd).enumerate() {
            let e = &e[r * TILE..];
            for (d, a) in row.iter_mut().enumerate() {
                let mut x = *a * alpha[r];
                for j in 0..n {
                    x = e[j].mul_add(v[j * hd + d], x);
                }
                *a = x;
            }
        }
    }

    unsafe fn merge(self, acc: &mut [f32], ca: f32, b: &[f32], cb: f32) {
        for (a, b) in acc.iter_mut().zip(b) {
            *a = b.mul_add(cb, *a * ca);
        }
    }

    unsafe fn finish(self, acc: &[f32], l: f32, out: &mut [f32]) {
        for (o, a) in out.iter_mut().zip(acc) {
            *o = a / l;
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) use avx2::Avx2;
#[cfg(target_arch = "x86_64")]
pub(super) use avx512::Avx512;

#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod ymm;

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::ymm::{hmax, tile_sum, transpose_8_rows};
    use super::*;

    /// AVX2 + FMA + F16C; needs `head_dim % 8 == 0`.
    #[derive(Clone, Copy)]
    pub(in super::super) struct Avx2;

    impl Avx2 {
        pub(in super::super) fn detect() -> bool {
            is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
        }
    }

    #[inline(always)]
    unsafe fn exp8(x: __m256) -> __m256 {
        // SAFETY (whole body): the caller runs with AVX2+FMA enabled.
        unsafe {
            let x = _mm256_max_ps(x, _mm256_set1_ps(EXP_LO));
            let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                _mm256_mul_ps(x, _mm256_set1_ps(LOG2E)),
            );
            let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_HI), x);
            let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_LO), r);
            let z = _mm256_mul_ps(r, r);
            let mut y = _mm256_set1_ps(EXP_P[0]);
            for p in &EXP_P[1..] {
                y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(*p));
            }
            let y = _mm256_add_ps(_mm256_fmadd_ps(y, z, r), _mm256_set1_ps(1.0));
            let e = _mm256_slli_epi32::<23>(_mm256_add_epi32(
                _mm256_cvtps_epi32(n),
                _mm256_set1_epi32(127),
            ));
            _mm256_mul_ps(y, _mm256_castsi256_ps(e))
        }
    }

    /// `$f::<R, $c>($args)` for `R = min($rows, ROW_BLOCK)`.
    macro_rules! by_rows {
        ($rows:expr, $f:ident, $c:literal, ($($arg:expr),*)) => {
            match $rows.min(ROW_BLOCK) {
                1 => $f::<1, $c>($($arg),*),
                2 => $f::<2, $c>($($arg),*),
                3 => $f::<3, $c>($($arg),*),
                4 => $f::<4, $c>($($arg),*),
                5 => $f::<5, $c>($($arg),*),
                _ => $f::<6, $c>($($arg),*),
            }
        };
    }

    /// Scores of `R` query rows (`q`, rows of `hd`) against `G` key groups (`kt`, groups of
    /// `8·hd`), into `s` (rows `TILE` apart): `R·G` accumulators, each key vector loaded once
    /// for the `R` rows.
    ///
    /// # Safety
    /// AVX2+FMA; the rows and groups exist.
    #[inline(always)]
    pub(super) unsafe fn score_block<const R: usize, const G: usize>(
        q: *const f32,
        hd: usize,
        kt: *const f32,
        s: *mut f32,
    ) {
        // SAFETY: the caller's contract.
        unsafe {
            let mut acc = [[_mm256_setzero_ps(); G]; R];
            for d in 0..hd {
                let k: [__m256; G] =
                    std::array::from_fn(|g| _mm256_loadu_ps(kt.add(g * GROUP * hd + d * GROUP)));
                for (r, row) in acc.iter_mut().enumerate() {
                    let qb = _mm256_broadcast_ss(&*q.add(r * hd + d));
                    for (x, kg) in row.iter_mut().zip(&k) {
                        *x = _mm256_fmadd_ps(qb, *kg, *x);
                    }
                }
            }
            for (r, row) in acc.iter().enumerate() {
                for (g, x) in row.iter().enumerate() {
                    _mm256_storeu_ps(s.add(r * TILE + g * GROUP), *x);
                }
            }
        }
    }

    /// `R` rows × `C` 8-dim chunks of the value accumulation: each value vector loaded once
    /// for the `R` rows.
    ///
    /// # Safety
    /// AVX2+FMA; the rows, chunks and `n` value rows exist.
    #[inline(always)]
    unsafe fn acc_block<const R: usize, const C: usize>(
        acc: *mut f32,
        hd: usize,
        alpha: *const f32,
        e: *const f32,
        v: *const f32,
        n: usize,
    ) {
        // SAFETY: the caller's contract.
        unsafe {
            let mut a: [[__m256; C]; R] = std::array::from_fn(|r| {
                let al = _mm256_broadcast_ss(&*alpha.add(r));
                std::array::from_fn(|c| _mm256_mul_ps(_mm256_loadu_ps(acc.add(r * hd + 8 * c)), al))
            });
            for j in 0..n {
                let vj: [__m256; C] =
                    std::array::from_fn(|c| _mm256_loadu_ps(v.add(j * hd + 8 * c)));
                for (r, row) in a.iter_mut().enumerate() {
                    let w = _mm256_broadcast_ss(&*e.add(r * TILE + j));
                    for (x, vc) in row.iter_mut().zip(&vj) {
                        *x = _mm256_fmadd_ps(w, *vc, *x);
                    }
                }
            }
            for (r, row) in a.iter().enumerate() {
                for (c, x) in row.iter().enumerate() {
                    _mm256_storeu_ps(acc.add(r * hd + 8 * c), *x);
                }
            }
        }
    }

    impl AttnOps for Avx2 {
        #[inline(always)]
        unsafe fn decode_row(self, dtype: KvStorage, src: &[u8], dst: &mut [f32]) {
            let hd = dst.len();
            debug_assert!(hd.is_multiple_of(8) && src.len() >= dtype.row_bytes(hd));
            let (s, d) = (src.as_ptr(), dst.as_mut_ptr());
            // SAFETY: `src` holds one encoded row of `hd` numbers (checked above in debug
            // builds, guaranteed by the pool's geometry), `dst` holds `hd` floats, and every
            // access below stays inside those; AVX2/F16C were detected.
            unsafe {
                match dtype {
                    KvStorage::F32 => std::ptr::copy_nonoverlapping(s, d.cast::<u8>(), hd * 4),
                    KvStorage::F16 => {
                        for c in 0..hd / 8 {
                            let h = _mm_loadu_si128(s.add(16 * c).cast());
                            _mm256_storeu_ps(d.add(8 * c), _mm256_cvtph_ps(h));
                        }
                    }
                    KvStorage::Bf16 => {
                        for c in 0..hd / 8 {
                            let h = _mm256_cvtepu16_epi32(_mm_loadu_si128(s.add(16 * c).cast()));
                            let f = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(h));
                            _mm256_storeu_ps(d.add(8 * c), f);
                        }
                    }
                    KvStorage::Q8_0 => {
                        let qk = q8_block(hd);
                        for b in 0..hd / qk {
                            let blk = s.add(b * (2 + qk));
                            let bits = u16::from_le_bytes([*blk, *blk.add(1)]);
                            let scale = _mm256_set1_ps(half::f16::from_bits(bits).to_f32());
                            for c in 0..qk / 8 {
                                let q = _mm_loadl_epi64(blk.add(2 + 8 * c).cast());
                                let f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
                                _mm256_storeu_ps(d.add(b * qk + 8 * c), _mm256_mul_ps(f, scale));
                            }
                        }
                    }
                }
            }
        }

        #[inline(always)]
        unsafe fn transpose(self, k: &[f32], hd: usize, groups: usize, kt: &mut [f32]) {
            debug_assert!(hd.is_multiple_of(8) && k.len().min(kt.len()) >= groups * GROUP * hd);
            for g in 0..groups {
                let at = g * GROUP * hd;
                // SAFETY: group g's 8 rows of hd floats in, as many out (checked above).
                unsafe { transpose_8_rows(k.as_ptr().add(at), hd, kt.as_mut_ptr().add(at), GROUP) };
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
            for (r0, nr) in row_blocks(rows, ROW_BLOCK) {
                let (qr, sr) = (q.wrapping_add(r0 * hd), s.wrapping_add(r0 * TILE));
                let mut g0 = 0;
                while g0 < groups {
                    let (k, so) = (
                        kt.wrapping_add(g0 * GROUP * hd),
                        sr.wrapping_add(g0 * GROUP),
                    );
                    // SAFETY: rows r0.., groups g0.. lie inside the slices (checked above).
                    unsafe {
                        if groups - g0 >= 2 {
                            by_rows!(nr, score_block, 2, (qr, hd, k, so));
                        } else {
                            by_rows!(nr, score_block, 1, (qr, hd, k, so));
                        }
                    }
                    g0 += if groups - g0 >= 2 { 2 } else { 1 };
                }
            }
        }

        #[inline(always)]
        unsafe fn softmax(self, s: &mut [f32], m: f32, n: usize) -> (f32, f32) {
            debug_assert!(s.len() >= TILE && (1..=TILE).contains(&n));
            // SAFETY: s holds TILE = VECS·8 floats; AVX2+FMA were detected.
            unsafe {
                let p = s.as_mut_ptr();
                let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
                let n = _mm256_set1_epi32(n as i32);
                let x: [__m256; VECS] = std::array::from_fn(|c| _mm256_loadu_ps(p.add(8 * c)));
                let live: [__m256; VECS] = std::array::from_fn(|c| {
                    let j = _mm256_add_epi32(lane, _mm256_set1_epi32(8 * c as i32));
                    _mm256_castsi256_ps(_mm256_cmpgt_epi32(n, j))
                });
                let ninf = _mm256_set1_ps(f32::NEG_INFINITY);
                let mut mx = _mm256_set1_ps(m);
                for c in 0..VECS {
                    mx = _mm256_max_ps(mx, _mm256_blendv_ps(ninf, x[c], live[c]));
                }
                let m = hmax(mx);
                let mv = _mm256_set1_ps(m);
                let e: [__m256; VECS] =
                    std::array::from_fn(|c| _mm256_and_ps(exp8(_mm256_sub_ps(x[c], mv)), live[c]));
                for (c, ec) in e.iter().enumerate() {
                    _mm256_storeu_ps(p.add(8 * c), *ec);
                }
                (m, tile_sum(e))
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
            debug_assert!(hd.is_multiple_of(8) && alpha.len() >= rows && v.len() >= n * hd);
            debug_assert!(e.len() >= rows * TILE && n <= TILE);
            let (acc, alpha, e, v) = (acc.as_mut_ptr(), alpha.as_ptr(), e.as_ptr(), v.as_ptr());
            let chunks = hd / 8;
            for (r0, nr) in row_blocks(rows, ROW_BLOCK) {
                let (a, al, er) = (
                    acc.wrapping_add(r0 * hd),
                    alpha.wrapping_add(r0),
                    e.wrapping_add(r0 * TILE),
                );
                let mut c0 = 0;
                while c0 < chunks {
                    let (ac, vc) = (a.wrapping_add(8 * c0), v.wrapping_add(8 * c0));
                    // SAFETY: rows r0.., dims 8·c0.. lie inside the slices (checked above).
                    unsafe {
                        if chunks - c0 >= 2 {
                            by_rows!(nr, acc_block, 2, (ac, hd, al, er, vc, n));
                        } else {
                            by_rows!(nr, acc_block, 1, (ac, hd, al, er, vc, n));
                        }
                    }
                    c0 += if chunks - c0 >= 2 { 2 } else { 1 };
                }
            }
        }

        #[inline(always)]
        unsafe fn merge(self, acc: &mut [f32], ca: f32, b: &[f32], cb: f32) {
            // SAFETY: both hold hd floats, a multiple of 8.
            unsafe {
                let (ca, cb) = (_mm256_set1_ps(ca), _mm256_set1_ps(cb));
                for c in 0..acc.len() / 8 {
                    let a = acc.as_mut_ptr().add(8 * c);
                    let x = _mm256_mul_ps(_mm256_loadu_ps(a), ca);
                    let y = _mm256_fmadd_ps(_mm256_loadu_ps(b.as_ptr().add(8 * c)), cb, x);
                    _mm256_storeu_ps(a, y);
                }
            }
        }

        #[inline(always)]
        unsafe fn finish(self, acc: &[f32], l: f32, out: &mut [f32]) {
            // SAFETY: both hold hd floats, a multiple of 8.
            unsafe {
                let l = _mm256_set1_ps(l);
                for c in 0..acc.len() / 8 {
                    let x = _mm256_div_ps(_mm256_loadu_ps(acc.as_ptr().add(8 * c)), l);
                    _mm256_storeu_ps(out.as_mut_ptr().add(8 * c), x);
                }
            }
        }
    }
}
