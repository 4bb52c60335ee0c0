//! AVX2 + FMA + F16C: the vectorized kernel on 256-bit registers, 8 lanes.

use std::arch::x86_64::*;

use super::simd::{lanewise, Simd};

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

// SAFETY (every method): called only where AVX2/FMA/F16C were detected (the trait's
// contract); loads and stores cover exactly the lanes documented on the trait.
impl Simd for Avx2 {
    const LANES: usize = 8;
    /// 6 × 2 accumulators + 2 loaded vectors + a broadcast: 15 of the 16 registers.
    const ROW_BLOCK: usize = 6;
    type V = __m256;
    /// All ones in the lanes of the set.
    type Mask = __m256;

    lanewise! {
        add(a, b) = _mm256_add_ps;
        sub(a, b) = _mm256_sub_ps;
        mul(a, b) = _mm256_mul_ps;
        div(a, b) = _mm256_div_ps;
        fma(a, b, c) = _mm256_fmadd_ps;
        max(a, b) = _mm256_max_ps;
        round(a) = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>;
    }

    #[inline(always)]
    unsafe fn zero() -> __m256 {
        unsafe { _mm256_setzero_ps() }
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> __m256 {
        unsafe { _mm256_set1_ps(x) }
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m256 {
        unsafe { _mm256_loadu_ps(p) }
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: __m256) {
        unsafe { _mm256_storeu_ps(p, v) }
    }
    #[inline(always)]
    unsafe fn pow2(n: __m256) -> __m256 {
        unsafe {
            let e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
            _mm256_castsi256_ps(_mm256_slli_epi32::<23>(e))
        }
    }
    #[inline(always)]
    unsafe fn load_f16(p: *const u8) -> __m256 {
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
    }
    #[inline(always)]
    unsafe fn load_bf16(p: *const u8) -> __m256 {
        unsafe {
            let h = _mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast()));
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(h))
        }
    }
    #[inline(always)]
    unsafe fn load_i8(p: *const u8) -> __m256 {
        unsafe { _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p.cast()))) }
    }
    #[inline(always)]
    unsafe fn first(n: usize) -> __m256 {
        unsafe {
            let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n as i32), lane))
        }
    }
    #[inline(always)]
    unsafe fn select(m: __m256, a: __m256, b: __m256) -> __m256 {
        unsafe { _mm256_blendv_ps(b, a, m) }
    }
    #[inline(always)]
    unsafe fn zero_unless(m: __m256, a: __m256) -> __m256 {
        unsafe { _mm256_and_ps(a, m) }
    }
    #[inline(always)]
    unsafe fn ymm(v: __m256, i: usize) -> __m256 {
        debug_assert_eq!(i, 0);
        v
    }
}
