//! AVX-512F: the vectorized kernel on 512-bit registers, 16 lanes.
//!
//! [`super::vectorized`] says why the width changes no number's order of operations; the
//! parts of it that are this ISA's own: `round` is `roundscale` with 0 fraction bits and
//! round-to-nearest-even, the same as AVX2's `round` to nearest; lane sets are mask
//! registers, and masking with them gives the same bits as AVX2's all-ones lanes (blend,
//! and `+0` for `and`).
//!
//! The kernel checks it against the portable path at run time before using it
//! (`self_check`), and the selector keeps it only where it is also the faster one.

use std::arch::x86_64::*;

use super::simd::{lanewise, Simd};

/// AVX-512F (with AVX2/FMA/F16C, which every AVX-512 CPU has, for the 8-wide parts);
/// needs `head_dim % 16 == 0`.
#[derive(Clone, Copy)]
pub(in super::super) struct Avx512;

impl Avx512 {
    pub(in super::super) fn detect() -> bool {
        is_x86_feature_detected!("avx512f") && super::Avx2::detect()
    }
}

// SAFETY (every method): called only where AVX-512F (and AVX2/FMA/F16C) were detected, from
// code compiled with those features (the trait's contract); loads and stores cover exactly
// the lanes documented on the trait.
impl Simd for Avx512 {
    const LANES: usize = 16;
    /// 8 × 2 accumulators + 2 loaded vectors + a broadcast take 19 of the 32 registers.
    /// Blocks of 12 fit too, but prefill ran 4% slower with them (Xeon, `kernel_timing`,
    /// 512 tokens at depth 4,096, both shapes); decode's 6-7 rows are one block either way.
    const ROW_BLOCK: usize = 8;
    type V = __m512;
    type Mask = __mmask16;

    lanewise! {
        add(a, b) = _mm512_add_ps;
        sub(a, b) = _mm512_sub_ps;
        mul(a, b) = _mm512_mul_ps;
        div(a, b) = _mm512_div_ps;
        fma(a, b, c) = _mm512_fmadd_ps;
        max(a, b) = _mm512_max_ps;
        round(a) = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>;
    }

    #[inline(always)]
    unsafe fn zero() -> __m512 {
        unsafe { _mm512_setzero_ps() }
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> __m512 {
        unsafe { _mm512_set1_ps(x) }
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m512 {
        unsafe { _mm512_loadu_ps(p) }
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: __m512) {
        unsafe { _mm512_storeu_ps(p, v) }
    }
    #[inline(always)]
    unsafe fn pow2(n: __m512) -> __m512 {
        unsafe {
            let e = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
            _mm512_castsi512_ps(_mm512_slli_epi32::<23>(e))
        }
    }
    #[inline(always)]
    unsafe fn load_f16(p: *const u8) -> __m512 {
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())) }
    }
    #[inline(always)]
    unsafe fn load_bf16(p: *const u8) -> __m512 {
        unsafe {
            let h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p.cast()));
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(h))
        }
    }
    #[inline(always)]
    unsafe fn load_i8(p: *const u8) -> __m512 {
        unsafe { _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p.cast()))) }
    }
    #[inline(always)]
    unsafe fn first(n: usize) -> __mmask16 {
        debug_assert!(n <= Self::LANES);
        ((1u32 << n) - 1) as __mmask16
    }
    #[inline(always)]
    unsafe fn select(m: __mmask16, a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_mask_blend_ps(m, b, a) }
    }
    #[inline(always)]
    unsafe fn zero_unless(m: __mmask16, a: __m512) -> __m512 {
        unsafe { _mm512_maskz_mov_ps(m, a) }
    }
    #[inline(always)]
    unsafe fn ymm(v: __m512, i: usize) -> __m256 {
        debug_assert!(i < 2);
        unsafe {
            if i == 0 {
                _mm512_castps512_ps256(v)
            } else {
                _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)))
            }
        }
    }
}
