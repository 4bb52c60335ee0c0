//! The arithmetic of the attention kernel, once portable and once in AVX2/FMA/F16C.
//!
//! Both implementations perform the same IEEE operations in the same order on every
//! number, so they agree bit for bit (tested); only the speed differs:
//! * a score `q·k` is 8 partial sums (lane `l` takes dimensions `d ≡ l mod 8`, each a
//!   chain of fused multiply-adds from zero), then `((p0+p1)+(p2+p3)) + ((p4+p5)+(p6+p7))`;
//! * a tile's maximum is exact whatever the order; `exp` is one polynomial (Cephes' `expf`:
//!   range reduction by `ln 2`, degree-5 polynomial, scaling by `2ⁿ` through the exponent
//!   bits), written once per lane; a tile's sum of exponentials is a plain left-to-right sum;
//! * value accumulation is per dimension: `acc·α`, then `acc = fma(e_j, v_j, acc)` in
//!   position order. Positions past a row's own limit carry `e_j = 0`, so a row may run a
//!   few extra (exact no-op) steps when it shares a tile with later rows.

use crate::kv_dtype::{q8_block, KvStorage};

/// Positions per softmax tile (and rows of the K/V scratch).
pub(super) const TILE: usize = 32;
/// Positions per vector of scores: a tile's scores are computed for whole groups.
pub(super) const GROUP: usize = 8;
const _: () = assert!(
    TILE == 4 * GROUP,
    "the AVX2 softmax holds a tile in 4 vectors"
);

/// What the kernel driver needs from an instruction set.
///
/// # Safety
/// Every method may use instructions of its ISA: call it only where they were detected.
pub(super) trait AttnOps: Copy {
    /// Decodes one row of `dst.len()` numbers from `src` (in `dtype`).
    unsafe fn decode_row(self, dtype: KvStorage, src: &[u8], dst: &mut [f32]);
    /// For query rows `r < rows` (`q`: rows of `hd`) and key rows `j < groups·8` (`k`: rows
    /// of `hd`): `s[r·TILE + j] = q_r·k_j`.
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

    unsafe fn scores(
        self,
        q: &[f32],
        hd: usize,
        rows: usize,
        k: &[f32],
        groups: usize,
        s: &mut [f32],
    ) {
        for r in 0..rows {
            let q = &q[r * hd..(r + 1) * hd];
            for j in 0..groups * GROUP {
                let row = &k[j * hd..(j + 1) * hd];
                let mut p = [0f32; 8];
                for (l, acc) in p.iter_mut().enumerate() {
                    for d in (l..hd).step_by(8) {
                        *acc = q[d].mul_add(row[d], *acc);
                    }
                }
                s[r * TILE + j] = ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
            }
        }
    }

    unsafe fn softmax(self, s: &mut [f32], m: f32, n: usize) -> (f32, f32) {
        let m = s[..n].iter().fold(m, |a, &b| a.max(b));
        for (j, x) in s[..TILE].iter_mut().enumerate() {
            *x = if j < n { exp_scalar(*x - m) } else { 0.0 };
        }
        (m, s[..n].iter().fold(0f32, |a, &b| a + b))
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
mod avx2 {
    use std::arch::x86_64::*;

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

    /// Scores of `R` query rows (`q`, rows of `hd`) against `P` key rows (`k`, rows of `hd`),
    /// `R·P = 8`: one vector of 8 lane-wise partial sums per (row, key), each loaded vector
    /// used `P` or `R` times; lane `i` of the reduced vector is the score of pair `i`
    /// (row-major), stored at `s[r·TILE + p]`.
    ///
    /// # Safety
    /// AVX2+FMA; the rows exist, `hd % 8 == 0`.
    #[inline(always)]
    unsafe fn score_block<const R: usize, const P: usize>(
        q: *const f32,
        hd: usize,
        k: *const f32,
        s: *mut f32,
    ) {
        const { assert!(R * P == 8) };
        // SAFETY: the caller's contract.
        unsafe {
            let mut p = [_mm256_setzero_ps(); 8];
            for c in 0..hd / 8 {
                let kc: [__m256; P] =
                    std::array::from_fn(|j| _mm256_loadu_ps(k.add(j * hd + 8 * c)));
                for r in 0..R {
                    let qc = _mm256_loadu_ps(q.add(r * hd + 8 * c));
                    for (j, kj) in kc.iter().enumerate() {
                        p[r * P + j] = _mm256_fmadd_ps(qc, *kj, p[r * P + j]);
                    }
                }
            }
            // Lane i of the result is ((p0+p1)+(p2+p3)) + ((p4+p5)+(p6+p7)) of vector i.
            let a = _mm256_hadd_ps(p[0], p[1]);
            let b = _mm256_hadd_ps(p[2], p[3]);
            let c = _mm256_hadd_ps(p[4], p[5]);
            let d = _mm256_hadd_ps(p[6], p[7]);
            let e = _mm256_hadd_ps(a, b);
            let f = _mm256_hadd_ps(c, d);
            let lo = _mm256_permute2f128_ps::<0x20>(e, f);
            let hi = _mm256_permute2f128_ps::<0x31>(e, f);
            let x = _mm256_add_ps(lo, hi);
            if R == 1 {
                _mm256_storeu_ps(s, x);
            } else {
                _mm_storeu_ps(s, _mm256_castps256_ps128(x));
                _mm_storeu_ps(s.add(TILE), _mm256_extractf128_ps::<1>(x));
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
        unsafe fn scores(
            self,
            q: &[f32],
            hd: usize,
            rows: usize,
            k: &[f32],
            groups: usize,
            s: &mut [f32],
        ) {
            debug_assert!(hd.is_multiple_of(8) && q.len() >= rows * hd);
            debug_assert!(k.len() >= groups * GROUP * hd && s.len() >= rows * TILE);
            let (q, k, s) = (q.as_ptr(), k.as_ptr(), s.as_mut_ptr());
            let mut r0 = 0;
            // SAFETY: rows r0.., key rows < groups·8 lie inside the slices (checked above).
            unsafe {
                while r0 + 2 <= rows {
                    for j0 in (0..groups * GROUP).step_by(4) {
                        score_block::<2, 4>(
                            q.add(r0 * hd),
                            hd,
                            k.add(j0 * hd),
                            s.add(r0 * TILE + j0),
                        );
                    }
                    r0 += 2;
                }
                if r0 < rows {
                    for j0 in (0..groups * GROUP).step_by(8) {
                        score_block::<1, 8>(
                            q.add(r0 * hd),
                            hd,
                            k.add(j0 * hd),
                            s.add(r0 * TILE + j0),
                        );
                    }
                }
            }
        }

        #[inline(always)]
        unsafe fn softmax(self, s: &mut [f32], m: f32, n: usize) -> (f32, f32) {
            debug_assert!(s.len() >= TILE && (1..=TILE).contains(&n));
            // SAFETY: s holds TILE = 4·8 floats; AVX2+FMA were detected.
            unsafe {
                let p = s.as_mut_ptr();
                let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
                let nv = _mm256_set1_epi32(n as i32);
                let x: [__m256; 4] = std::array::from_fn(|c| _mm256_loadu_ps(p.add(8 * c)));
                let live: [__m256; 4] = std::array::from_fn(|c| {
                    let j = _mm256_add_epi32(lane, _mm256_set1_epi32(8 * c as i32));
                    _mm256_castsi256_ps(_mm256_cmpgt_epi32(nv, j))
                });
                let ninf = _mm256_set1_ps(f32::NEG_INFINITY);
                let mut mx = _mm256_set1_ps(m);
                for c in 0..4 {
                    mx = _mm256_max_ps(mx, _mm256_blendv_ps(ninf, x[c], live[c]));
                }
                let t = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps::<1>(mx));
                let t = _mm_max_ps(t, _mm_movehl_ps(t, t));
                let t = _mm_max_ss(t, _mm_shuffle_ps::<1>(t, t));
                let m = _mm_cvtss_f32(t);
                let mv = _mm256_set1_ps(m);
                let e: [__m256; 4] =
                    std::array::from_fn(|c| _mm256_and_ps(exp8(_mm256_sub_ps(x[c], mv)), live[c]));
                for (c, ec) in e.iter().enumerate() {
                    _mm256_storeu_ps(p.add(8 * c), *ec);
                }
                // Left to right, as the portable path (a serial chain, but exact to it).
                let sum = s[..n].iter().fold(0f32, |a, &b| a + b);
                (m, sum)
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
            let mut r0 = 0;
            while r0 < rows {
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
                        match (rows - r0, chunks - c0 >= 2) {
                            (1, true) => acc_block::<1, 2>(ac, hd, al, er, vc, n),
                            (2, true) => acc_block::<2, 2>(ac, hd, al, er, vc, n),
                            (3, true) => acc_block::<3, 2>(ac, hd, al, er, vc, n),
                            (_, true) => acc_block::<4, 2>(ac, hd, al, er, vc, n),
                            (1, false) => acc_block::<1, 1>(ac, hd, al, er, vc, n),
                            (2, false) => acc_block::<2, 1>(ac, hd, al, er, vc, n),
                            (3, false) => acc_block::<3, 1>(ac, hd, al, er, vc, n),
                            (_, false) => acc_block::<4, 1>(ac, hd, al, er, vc, n),
                        }
                    }
                    c0 += if chunks - c0 >= 2 { 2 } else { 1 };
                }
                r0 += (rows - r0).min(4);
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
