//! The arithmetic of the attention kernel, once portable and once in AVX2/FMA/F16C.
//!
//! Both implementations perform the same IEEE operations in the same order on every
//! number, so they agree bit for bit (tested); only the speed differs:
//! * a score `q·k` is 8 partial sums (lane `l` takes dimensions `d ≡ l mod 8`, each a
//!   chain of fused multiply-adds from zero), then `((p0+p1)+(p2+p3)) + ((p4+p5)+(p6+p7))`;
//! * `exp` is one polynomial (Cephes' `expf`: range reduction by `ln 2`, degree-5
//!   polynomial, scaling by `2ⁿ` through the exponent bits), written once per lane;
//! * value accumulation is per dimension: `acc·α`, then `acc = fma(e_j, v_j, acc)` in
//!   position order.

use crate::kv_dtype::{q8_block, KvStorage};

/// Positions per softmax tile (and rows of the K/V scratch).
pub(super) const TILE: usize = 32;

/// What the kernel driver needs from an instruction set.
///
/// # Safety
/// Every method may use instructions of its ISA: call it only where they were detected.
pub(super) trait AttnOps: Copy {
    /// Decodes one row of `dst.len()` numbers from `src` (in `dtype`).
    unsafe fn decode_row(self, dtype: KvStorage, src: &[u8], dst: &mut [f32]);
    /// `s[j] = q·k_j` for `j < n` (`k`: rows of `q.len()`, at least `n` rounded up to 8 of them).
    unsafe fn scores(self, q: &[f32], k: &[f32], n: usize, s: &mut [f32; TILE]);
    /// `s[j] = exp(s[j] − m)` for `j < n`.
    unsafe fn exp_sub(self, s: &mut [f32; TILE], m: f32, n: usize);
    /// `acc = acc·alpha + Σ_{j<n} e[j]·v_j`, `v` rows of `acc.len()`.
    unsafe fn accumulate(self, acc: &mut [f32], alpha: f32, e: &[f32; TILE], v: &[f32], n: usize);
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

    unsafe fn scores(self, q: &[f32], k: &[f32], n: usize, s: &mut [f32; TILE]) {
        let hd = q.len();
        for (j, out) in s.iter_mut().enumerate().take(n) {
            let row = &k[j * hd..(j + 1) * hd];
            let mut p = [0f32; 8];
            for (l, acc) in p.iter_mut().enumerate() {
                for d in (l..hd).step_by(8) {
                    *acc = q[d].mul_add(row[d], *acc);
                }
            }
            *out = ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
        }
    }

    unsafe fn exp_sub(self, s: &mut [f32; TILE], m: f32, n: usize) {
        for x in &mut s[..n] {
            *x = exp_scalar(*x - m);
        }
    }

    unsafe fn accumulate(self, acc: &mut [f32], alpha: f32, e: &[f32; TILE], v: &[f32], n: usize) {
        let hd = acc.len();
        for (d, a) in acc.iter_mut().enumerate() {
            let mut x = *a * alpha;
            for j in 0..n {
                x = e[j].mul_add(v[j * hd + d], x);
            }
            *a = x;
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
        unsafe fn scores(self, q: &[f32], k: &[f32], n: usize, s: &mut [f32; TILE]) {
            let hd = q.len();
            debug_assert!(k.len() >= n.div_ceil(8) * 8 * hd);
            // SAFETY: rows `j0..j0+8` of `k` exist for every chunk (the scratch holds TILE
            // rows); `q` holds `hd` floats, a multiple of 8; AVX2+FMA were detected.
            unsafe {
                for j0 in (0..n).step_by(8) {
                    let mut p = [_mm256_setzero_ps(); 8];
                    let base = k.as_ptr().add(j0 * hd);
                    for c in 0..hd / 8 {
                        let qc = _mm256_loadu_ps(q.as_ptr().add(8 * c));
                        for (j, acc) in p.iter_mut().enumerate() {
                            let kc = _mm256_loadu_ps(base.add(j * hd + 8 * c));
                            *acc = _mm256_fmadd_ps(qc, kc, *acc);
                        }
                    }
                    // Lane j of the result is ((p0+p1)+(p2+p3)) + ((p4+p5)+(p6+p7)) of row j.
                    let a = _mm256_hadd_ps(p[0], p[1]);
                    let b = _mm256_hadd_ps(p[2], p[3]);
                    let c = _mm256_hadd_ps(p[4], p[5]);
                    let d = _mm256_hadd_ps(p[6], p[7]);
                    let e = _mm256_hadd_ps(a, b);
                    let f = _mm256_hadd_ps(c, d);
                    let lo = _mm256_permute2f128_ps::<0x20>(e, f);
                    let hi = _mm256_permute2f128_ps::<0x31>(e, f);
                    _mm256_storeu_ps(s.as_mut_ptr().add(j0), _mm256_add_ps(lo, hi));
                }
            }
        }

        #[inline(always)]
        unsafe fn exp_sub(self, s: &mut [f32; TILE], m: f32, n: usize) {
            // SAFETY: chunks of 8 starting below n ≤ TILE (a multiple of 8) lie inside `s`.
            unsafe {
                let m = _mm256_set1_ps(m);
                for j0 in (0..n).step_by(8) {
                    let p = s.as_mut_ptr().add(j0);
                    _mm256_storeu_ps(p, exp8(_mm256_sub_ps(_mm256_loadu_ps(p), m)));
                }
            }
        }

        #[inline(always)]
        unsafe fn accumulate(
            self,
            acc: &mut [f32],
            alpha: f32,
            e: &[f32; TILE],
            v: &[f32],
            n: usize,
        ) {
            let hd = acc.len();
            debug_assert!(v.len() >= n * hd);
            // SAFETY: `acc` holds hd floats (a multiple of 8), `v` holds n rows of hd.
            unsafe {
                let alpha = _mm256_set1_ps(alpha);
                let mut c0 = 0;
                // Eight independent accumulators hide the FMA latency; the rest one by one.
                while c0 + 8 <= hd / 8 {
                    let a = acc.as_mut_ptr().add(8 * c0);
                    let mut r: [__m256; 8] = std::array::from_fn(|c| {
                        _mm256_mul_ps(_mm256_loadu_ps(a.add(8 * c)), alpha)
                    });
                    for (j, &w) in e.iter().enumerate().take(n) {
                        let w = _mm256_set1_ps(w);
                        let row = v.as_ptr().add(j * hd + 8 * c0);
                        for (c, x) in r.iter_mut().enumerate() {
                            *x = _mm256_fmadd_ps(w, _mm256_loadu_ps(row.add(8 * c)), *x);
                        }
                    }
                    for (c, x) in r.iter().enumerate() {
                        _mm256_storeu_ps(a.add(8 * c), *x);
                    }
                    c0 += 8;
                }
                for c in c0..hd / 8 {
                    let a = acc.as_mut_ptr().add(8 * c);
                    let mut x = _mm256_mul_ps(_mm256_loadu_ps(a), alpha);
                    for (j, &w) in e.iter().enumerate().take(n) {
                        let vj = _mm256_loadu_ps(v.as_ptr().add(j * hd + 8 * c));
                        x = _mm256_fmadd_ps(_mm256_set1_ps(w), vj, x);
                    }
                    _mm256_storeu_ps(a, x);
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
