//! Activation rows quantized to int8 the way ggml (and candle) do it, so our
//! kernels see the same integers as candle's `QMatMul` and differ from it only
//! in the order of the f32 sums.
//!
//! * Q8_0 style (for Q5_0/Q8_0 weights): 32-value blocks, `d = f16(amax/127)`,
//!   `q = round(x/d)` with the unrounded `d`; we keep `Σq` per block for the
//!   kernels' offset corrections.
//! * Q8_K style (for Q4_K/Q6_K weights): 256-value blocks, `d = max/-127` of the
//!   signed extreme, `q = clamp(round(x/d))` (|q| ≤ 127: `max` itself maps to
//!   -127); we keep the 16-value sums, the 32-value sums packed as i16 pairs for
//!   `madd_epi16` (Q4_K's mins), and `q + 128` as u8 (Q6_K's AVX2 kernel, whose
//!   `maddubs` wants the unsigned operand on the activation side).
//!
//! Rows are quantized independently: a row's integers never depend on the others.

use half::f16;

pub(super) const QK8_0: usize = 32;
pub(super) const QK_K: usize = 256;
/// Per Q8_K block: 16 sums of 16 values, then at [`K_PAIRS32`] 4 i32 holding
/// (sum32[2t], sum32[2t+1]) as i16.
pub(super) const K_SUMS: usize = 16 + 4;
pub(super) const K_PAIRS32: usize = 16;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ActKind {
    Q8_0,
    Q8K,
}

/// `m` rows of `k` quantized activations.
#[derive(Default)]
pub(super) struct QuantizedActs {
    pub k: usize,
    /// Blocks per row (`k / 32` or `k / 256`).
    pub nb: usize,
    /// `[m, k]`.
    pub qs: Vec<i8>,
    /// Q8_K only: `qs + 128` as u8, `[m, k]` (empty for Q8_0).
    pub qs_u8: Vec<u8>,
    /// `[m, nb]` block scales.
    pub d: Vec<f32>,
    /// `[m, nb]` (Q8_0: Σq) or `[m, nb, K_SUMS]` (Q8_K).
    pub sums: Vec<i32>,
}

impl QuantizedActs {
    #[cfg(test)]
    pub fn new(kind: ActKind, x: &[f32], m: usize, k: usize) -> Self {
        let mut acts = Self::default();
        acts.fill(kind, x, m, k);
        acts
    }

    /// Quantizes `x` (`[m, k]`) into these buffers, reusing their capacity.
    pub fn fill(&mut self, kind: ActKind, x: &[f32], m: usize, k: usize) {
        match kind {
            ActKind::Q8_0 => self.q8_0(x, m, k),
            ActKind::Q8K => self.q8k(x, m, k),
        }
    }

    /// Sizes the buffers for `m` rows of `k` values in blocks of `block` (`sums_per_block` each;
    /// `qs_u8` only for Q8_K).
    ///
    /// What the buffers held stays where they keep their length: every block writes all of its
    /// values, scale and sums (zeroing them first was 3.5% of a 1.5B prefill, with the
    /// products' outputs).
    fn reset(&mut self, m: usize, k: usize, block: usize, sums_per_block: usize, with_u8: bool) {
        self.k = k;
        self.nb = k / block;
        let blocks = m * self.nb;
        self.qs.resize(m * k, 0);
        self.qs_u8.resize(if with_u8 { m * k } else { 0 }, 0);
        self.d.resize(blocks, 0.0);
        self.sums.resize(blocks * sums_per_block, 0);
    }

    fn q8_0(&mut self, x: &[f32], m: usize, k: usize) {
        self.reset(m, k, QK8_0, 1, false);
        let dst = BlockDst::new(self);
        for_blocks(m * self.nb, x.len(), |b| {
            let xb = &x[b * QK8_0..(b + 1) * QK8_0];
            // SAFETY: AVX2 was detected before any packed matrix (the only caller) was built.
            let amax = unsafe { abs_max_avx2(xb) };
            let scale = amax / 127.0;
            let inv = if scale != 0.0 { 1.0 / scale } else { 0.0 };
            // SAFETY: block `b` owns these parts of the buffers (`BlockDst`); the slice holds
            // one 32-value block; AVX2 was detected before any packed matrix (the only
            // caller) was built.
            unsafe {
                let qb = dst.qs(b * QK8_0, QK8_0);
                *dst.sums(b, 1).get_unchecked_mut(0) = round_block_avx2(xb, inv, qb);
                *dst.d(b) = f16::from_f32(scale).to_f32();
            }
        });
    }

    fn q8k(&mut self, x: &[f32], m: usize, k: usize) {
        self.reset(m, k, QK_K, K_SUMS, true);
        let dst = BlockDst::new(self);
        for_blocks(m * self.nb, x.len(), |b| {
            let xb = &x[b * QK_K..(b + 1) * QK_K];
            // SAFETY: block `b` owns these parts of the buffers (`BlockDst`).
            let (qb, sums, d) = unsafe { (dst.qs(b * QK_K, QK_K), dst.sums(b, K_SUMS), dst.d(b)) };
            // The signed value of largest magnitude (first one on ties), as ggml picks it.
            // SAFETY: AVX2 was detected before any packed matrix was built.
            let (amax, max) = unsafe { signed_abs_max_avx2(xb) };
            if amax == 0.0 {
                qb.fill(0);
                sums.fill(0);
                *d = 0.0;
                // SAFETY: as above.
                unsafe { dst.qs_u8(b * QK_K, QK_K) }.fill(0x80);
                return;
            }
            let iscale = -127f32 / max;
            // `round(iscale·v)` clamped to i8, 32 values at a time (the packs saturate, which
            // is the clamp); bit-identical to the scalar definition (tested below).
            for (x32, q32) in xb.chunks_exact(QK8_0).zip(qb.chunks_exact_mut(QK8_0)) {
                // SAFETY: 32 values each; AVX2 was detected before any packed matrix was built.
                unsafe { round_block_avx2(x32, iscale, q32) };
            }
            *d = 1.0 / iscale;
            let s16: [i32; 16] = std::array::from_fn(|g| {
                qb[16 * g..16 * g + 16].iter().map(|&q| i32::from(q)).sum()
            });
            sums[..16].copy_from_slice(&s16);
            for t in 0..4 {
                let lo = (s16[4 * t] + s16[4 * t + 1]) as i16;
                let hi = (s16[4 * t + 2] + s16[4 * t + 3]) as i16;
                sums[K_PAIRS32 + t] = i16_pair(lo, hi);
            }
            // SAFETY: as above.
            let u8s = unsafe { dst.qs_u8(b * QK_K, QK_K) };
            for (u, &q) in u8s.iter_mut().zip(qb.iter()) {
                *u = (q as u8) ^ 0x80;
            }
        });
    }
}

/// Inputs of fewer values are quantized on the calling thread: a fork/join of the pool costs
/// more than a decode row's quantization. Above it (prefill) the blocks are shared out: on
/// one thread, quantizing a 512-token prompt's rows was ~6% of a 1.5B prefill, the other
/// thread idle meanwhile.
const PARALLEL_VALUES: usize = 1 << 16;

/// Runs `f` for every block in `0..blocks`, on the pool when the input has `values` ≥
/// [`PARALLEL_VALUES`].
fn for_blocks(blocks: usize, values: usize, f: impl Fn(usize) + Sync) {
    let run = |range: std::ops::Range<usize>| range.for_each(&f);
    if values >= PARALLEL_VALUES {
        candle_core::utils::barrier_pool().execute_chunked(blocks, run);
    } else {
        run(0..blocks);
    }
}

/// The buffers of a [`QuantizedActs`] sized by `reset`, as raw parts that blocks write
/// concurrently: block `b` writes only its own values, scale and sums.
#[derive(Clone, Copy)]
struct BlockDst {
    qs: *mut i8,
    qs_u8: *mut u8,
    d: *mut f32,
    sums: *mut i32,
}

// SAFETY: the pointers are only dereferenced at disjoint per-block ranges (see the methods'
// contracts), while the `QuantizedActs` they come from is not otherwise touched.
unsafe impl Send for BlockDst {}
unsafe impl Sync for BlockDst {}

impl BlockDst {
    fn new(acts: &mut QuantizedActs) -> Self {
        Self {
            qs: acts.qs.as_mut_ptr(),
            qs_u8: acts.qs_u8.as_mut_ptr(),
            d: acts.d.as_mut_ptr(),
            sums: acts.sums.as_mut_ptr(),
        }
    }

    // # Safety (all four): the range lies inside the buffer `reset` sized, and belongs to the
    // calling block alone.
    #[allow(clippy::mut_from_ref)]
    unsafe fn qs(&self, at: usize, len: usize) -> &mut [i8] {
        // SAFETY: the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.qs.add(at), len) }
    }

    #[allow(clippy::mut_from_ref)]
    unsafe fn qs_u8(&self, at: usize, len: usize) -> &mut [u8] {
        // SAFETY: the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.qs_u8.add(at), len) }
    }

    #[allow(clippy::mut_from_ref)]
    unsafe fn d(&self, b: usize) -> &mut f32 {
        // SAFETY: the caller's contract.
        unsafe { &mut *self.d.add(b) }
    }

    #[allow(clippy::mut_from_ref)]
    unsafe fn sums(&self, b: usize, per_block: usize) -> &mut [i32] {
        // SAFETY: the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.sums.add(b * per_block), per_block) }
    }
}

/// One i32 holding `lo` in its low and `hi` in its high 16 bits (a `madd_epi16` operand).
fn i16_pair(lo: i16, hi: i16) -> i32 {
    i32::from(lo as u16) | (i32::from(hi) << 16)
}

/// `max |v|` over `x`, skipping NaNs: what
/// `x.iter().fold(0.0, |a, v| a.max(v.abs()))` gives (a maximum is exact in any order, and
/// `max_ps` returns its second operand, the running maximum, when the first is NaN). The
/// scalar fold is a chain of dependent `max`es that the compiler may not reorder: on a
/// decode row it took longer than a small matrix's whole product.
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2")]
unsafe fn abs_max_avx2(x: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    // SAFETY: the caller guarantees AVX2; every load reads 8 of `x`'s values.
    unsafe {
        let sign = _mm256_set1_ps(-0.0);
        let mut acc = [_mm256_setzero_ps(); 4];
        let eights = x.chunks_exact(8);
        let rest = eights.remainder();
        for (i, v) in eights.enumerate() {
            let abs = _mm256_andnot_ps(sign, _mm256_loadu_ps(v.as_ptr()));
            acc[i % 4] = _mm256_max_ps(abs, acc[i % 4]);
        }
        let m = _mm256_max_ps(_mm256_max_ps(acc[0], acc[1]), _mm256_max_ps(acc[2], acc[3]));
        let lanes: [f32; 8] = std::mem::transmute(m);
        lanes.iter().chain(rest).fold(0f32, |a, v| a.max(v.abs()))
    }
}

/// `(max |v|, v)` for the first `v` of `x` of largest magnitude,
/// NaNs skipped, `(0, 0)` when there is none: the scalar scan
/// `if amax < v.abs() { amax = v.abs(); max = v }`, from [`abs_max_avx2`] and a search for
/// the first value that reaches it.
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2")]
unsafe fn signed_abs_max_avx2(x: &[f32]) -> (f32, f32) {
    use std::arch::x86_64::*;
    // SAFETY: the caller guarantees AVX2; every load reads 8 of `x`'s values.
    unsafe {
        let amax = abs_max_avx2(x);
        if amax == 0.0 {
            return (0.0, 0.0);
        }
        let sign = _mm256_set1_ps(-0.0);
        let target = _mm256_set1_ps(amax);
        let eights = x.chunks_exact(8);
        let rest = eights.remainder();
        for (i, v) in eights.enumerate() {
            let abs = _mm256_andnot_ps(sign, _mm256_loadu_ps(v.as_ptr()));
            let hits = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_EQ_OQ>(abs, target));
            if hits != 0 {
                return (amax, x[8 * i + hits.trailing_zeros() as usize]);
            }
        }
        let found = rest.iter().find(|v| v.abs() == amax);
        (
            amax,
            *found.expect("the maximum of the values is one of them"),
        )
    }
}

/// `q = round(x·inv)` (ties away from zero, like `f32::round`) for one 32-value
/// block; returns `Σq`. Bit-identical to the scalar loop: `x·inv` is the same
/// IEEE product and `x·inv - trunc(x·inv)` is exact, so the tie test is exact.
///
/// # Safety
/// The CPU must support AVX2; `x` and `q` must hold 32 values.
#[target_feature(enable = "avx2,fma")]
unsafe fn round_block_avx2(x: &[f32], inv: f32, q: &mut [i8]) -> i32 {
    use std::arch::x86_64::*;
    debug_assert!(x.len() == QK8_0 && q.len() == QK8_0);
    // SAFETY: the caller guarantees AVX2 and 32 readable/writable values.
    unsafe {
        let inv = _mm256_set1_ps(inv);
        let sign = _mm256_set1_ps(-0.0);
        let half = _mm256_set1_ps(0.5);
        let one = _mm256_set1_ps(1.0);
        let mut ints = [_mm256_setzero_si256(); 4];
        for (i, out) in ints.iter_mut().enumerate() {
            let v = _mm256_mul_ps(_mm256_loadu_ps(x.as_ptr().add(8 * i)), inv);
            let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(v);
            let frac = _mm256_andnot_ps(sign, _mm256_sub_ps(v, t));
            let up = _mm256_cmp_ps::<_CMP_GE_OQ>(frac, half);
            let step = _mm256_or_ps(_mm256_and_ps(v, sign), one);
            *out = _mm256_cvttps_epi32(_mm256_add_ps(t, _mm256_and_ps(up, step)));
        }
        let w16a = _mm256_packs_epi32(ints[0], ints[1]);
        let w16b = _mm256_packs_epi32(ints[2], ints[3]);
        let w8 = _mm256_packs_epi16(w16a, w16b);
        // packs work per 128-bit lane; this restores the k order.
        let ordered = _mm256_permutevar8x32_epi32(w8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(q.as_mut_ptr() as *mut __m256i, ordered);
        let total = _mm256_add_epi32(
            _mm256_add_epi32(ints[0], ints[1]),
            _mm256_add_epi32(ints[2], ints[3]),
        );
        let lanes: [i32; 8] = std::mem::transmute(total);
        lanes.iter().sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Q8_K rows quantize to ggml's integers: `clamp(round(x·(-127/max)))`, ties included.
    #[test]
    fn q8k_rounding_matches_scalar_round() {
        let mut x: Vec<f32> = (0..2048)
            .map(|i| ((i * 7919 % 2001) as f32 - 1000.0) / 77.0)
            .collect();
        // A block whose extreme is negative, and one with exact ties (max -127 → iscale 1).
        x[256..264].copy_from_slice(&[-127.0, 0.5, -0.5, 1.5, -1.5, 126.5, -126.5, 2.4999998]);
        x[512..768].iter_mut().for_each(|v| *v = 0.0);
        let acts = QuantizedActs::new(ActKind::Q8K, &x, 1, x.len());
        for (b, (xb, qb)) in x
            .chunks_exact(QK_K)
            .zip(acts.qs.chunks_exact(QK_K))
            .enumerate()
        {
            let (mut amax, mut max) = (0f32, 0f32);
            for &v in xb {
                if amax < v.abs() {
                    amax = v.abs();
                    max = v;
                }
            }
            let want: Vec<i8> = if amax == 0.0 {
                vec![0; QK_K]
            } else {
                let iscale = -127f32 / max;
                xb.iter()
                    .map(|&v| (iscale * v).round().clamp(-128.0, 127.0) as i8)
                    .collect()
            };
            assert_eq!(qb, &want[..], "block {b}");
            let u8s: Vec<u8> = want.iter().map(|&q| (q as u8) ^ 0x80).collect();
            assert_eq!(
                &acts.qs_u8[b * QK_K..(b + 1) * QK_K],
                &u8s[..],
                "block {b} as u8"
            );
        }
    }

    /// A prompt's rows quantized on the pool (past `PARALLEL_VALUES`) equal each row
    /// quantized alone on the calling thread, every buffer, zero blocks included.
    #[test]
    fn rows_quantized_together_on_the_pool_equal_each_alone() {
        let (m, k) = (40, 2048);
        let mut x: Vec<f32> = (0..m * k)
            .map(|i| ((i * 7919 % 2003) as f32 - 1001.0) / 53.0)
            .collect();
        x[3 * k..3 * k + 512].iter_mut().for_each(|v| *v = 0.0);
        assert!(m * k >= PARALLEL_VALUES && k < PARALLEL_VALUES);
        for kind in [ActKind::Q8_0, ActKind::Q8K] {
            let all = QuantizedActs::new(kind, &x, m, k);
            let per_block = if kind == ActKind::Q8K { K_SUMS } else { 1 };
            for r in 0..m {
                let one = QuantizedActs::new(kind, &x[r * k..(r + 1) * k], 1, k);
                let nb = all.nb;
                assert_eq!(&all.qs[r * k..(r + 1) * k], &one.qs[..], "{kind:?} row {r}");
                assert_eq!(&all.d[r * nb..(r + 1) * nb], &one.d[..], "{kind:?} row {r}");
                let sums = &all.sums[r * nb * per_block..(r + 1) * nb * per_block];
                assert_eq!(sums, &one.sums[..], "{kind:?} row {r}");
                if kind == ActKind::Q8K {
                    assert_eq!(&all.qs_u8[r * k..(r + 1) * k], &one.qs_u8[..]);
                } else {
                    assert!(all.qs_u8.is_empty());
                }
            }
        }
    }

    /// Buffers that held other rows (`reset` no longer zeroes them) quantize to what fresh
    /// ones do, zero blocks included.
    #[test]
    fn reused_buffers_quantize_like_fresh_ones() {
        let (m, k) = (3, 1024);
        let before: Vec<f32> = (0..m * k).map(|i| (i % 97) as f32 - 40.5).collect();
        let mut x: Vec<f32> = (0..m * k)
            .map(|i| ((i * 31 % 211) as f32 - 105.0) / 9.0)
            .collect();
        x[k..k + 512].iter_mut().for_each(|v| *v = 0.0);
        for kind in [ActKind::Q8_0, ActKind::Q8K] {
            let fresh = QuantizedActs::new(kind, &x, m, k);
            let mut reused = QuantizedActs::new(kind, &before, m, k);
            reused.fill(kind, &x, m, k);
            assert_eq!(reused.qs, fresh.qs, "{kind:?}");
            assert_eq!(reused.qs_u8, fresh.qs_u8, "{kind:?}");
            assert_eq!(reused.d, fresh.d, "{kind:?}");
            assert_eq!(reused.sums, fresh.sums, "{kind:?}");
        }
    }

    /// The SIMD maxima equal the scalar scans they replace: NaNs skipped, the first of equal
    /// magnitudes (of either sign) kept, zeros and negative zeros giving (0, 0).
    #[test]
    fn abs_maxima_match_the_scalar_scans() {
        if !is_x86_feature_detected!("avx2") {
            return;
        }
        let scalar = |x: &[f32]| {
            let (mut amax, mut max) = (0f32, 0f32);
            for &v in x {
                if amax < v.abs() {
                    amax = v.abs();
                    max = v;
                }
            }
            (amax, max, x.iter().fold(0f32, |a, v| a.max(v.abs())))
        };
        let mut cases: Vec<Vec<f32>> = vec![vec![0.0; 32], vec![-0.0; 256], vec![f32::NAN; 32]];
        let mut ties = vec![0.5f32; 256];
        (ties[17], ties[40], ties[200]) = (-3.0, 3.0, -3.0);
        cases.push(ties);
        let mut nans: Vec<f32> = (0..256).map(|i| (i as f32 - 100.0) / 7.0).collect();
        (nans[0], nans[9], nans[255]) = (f32::NAN, -f32::NAN, -200.0);
        cases.push(nans);
        // Lengths past the last 8: the largest in the tail, and a tie the tail does not win.
        cases.push((0..13).map(|i| i as f32 - 2.0).collect());
        cases.push(vec![
            1.0, -9.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0, 9.0, -9.0, 3.0,
        ]);
        for seed in 0..20u32 {
            let x: Vec<f32> = (0..256u32)
                .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed * 97) % 4001) as f32)
                .map(|v| (v - 2000.0) / 13.0)
                .collect();
            cases.push(x);
        }
        for (i, x) in cases.iter().enumerate() {
            let (amax, max, folded) = scalar(x);
            // SAFETY: AVX2 was detected above.
            let (got_amax, got_max) = unsafe { signed_abs_max_avx2(x) };
            assert_eq!(
                (got_amax.to_bits(), got_max.to_bits()),
                (amax.to_bits(), max.to_bits()),
                "case {i}"
            );
            // SAFETY: as above.
            assert_eq!(
                unsafe { abs_max_avx2(x) }.to_bits(),
                folded.to_bits(),
                "case {i}"
            );
        }
    }

    /// The SIMD rounding must give the integers of the scalar definition, ties included.
    #[test]
    fn q8_0_rounding_matches_scalar_round() {
        let mut x: Vec<f32> = (0..4096)
            .map(|i| ((i * 7919 % 2001) as f32 - 1000.0) / 77.0)
            .collect();
        // Exact ties after scaling (amax 127 → inv 1): ±0.5, ±1.5, ±126.5.
        x[..8].copy_from_slice(&[127.0, 0.5, -0.5, 1.5, -1.5, 126.5, -126.5, 2.4999998]);
        let acts = QuantizedActs::new(ActKind::Q8_0, &x, 1, x.len());
        for (b, (xb, qb)) in x.chunks_exact(32).zip(acts.qs.chunks_exact(32)).enumerate() {
            let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
            let scale = amax / 127.0;
            let inv = if scale != 0.0 { 1.0 / scale } else { 0.0 };
            let want: Vec<i8> = xb.iter().map(|&v| (v * inv).round() as i8).collect();
            assert_eq!(qb, &want[..], "block {b}");
            let sum: i32 = want.iter().map(|&q| i32::from(q)).sum();
            assert_eq!(acts.sums[b], sum, "block {b}");
        }
    }
}
