//! The one integer primitive every kernel is built from: a 4-way u8×i8 dot
//! product accumulated into eight i32 lanes, on AVX2 or on AVX-VNNI.
//!
//! Invariant: both implementations return the exact same integers for the
//! inputs the kernels feed them (AVX2's i16 pair sums cannot saturate because
//! `dot_u6` weights are ≤ 63 and activations lie in -127..=127), so which ISA ran
//! never changes a result bit.

use std::arch::x86_64::*;

/// An instruction set the kernels can be instantiated for.
pub(super) trait Isa: Copy {
    /// `acc + Σ_{t<4} u[4l+t]·s[4l+t]` per lane `l`, for unsigned `u ≤ 63` and signed `s`.
    ///
    /// # Safety
    /// The CPU must support the implementing ISA.
    unsafe fn dot_u6(acc: __m256i, u: __m256i, s: __m256i) -> __m256i;

    /// `acc + Σ_{t<4} (w[4l+t] + S8_OFFSET)·s[4l+t]` per lane, for signed `w`;
    /// callers subtract `S8_OFFSET·Σs` once per block.
    ///
    /// # Safety
    /// The CPU must support the implementing ISA.
    unsafe fn dot_s8(acc: __m256i, w: __m256i, s: __m256i) -> __m256i;

    const S8_OFFSET: i32;
}

/// Plain AVX2 (the crate's baseline, x86-64-v3).
#[derive(Clone, Copy)]
pub(super) struct Avx2;

/// AVX-VNNI: `vpdpbusd` fuses multiply, pair-add and accumulate with no i16 stage.
#[derive(Clone, Copy)]
pub(super) struct Vnni;

impl Isa for Avx2 {
    const S8_OFFSET: i32 = 0;

    #[inline(always)]
    unsafe fn dot_u6(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
        // SAFETY: AVX2 is the build baseline (target-cpu=x86-64-v3) and checked at run time.
        unsafe {
            let pairs = _mm256_maddubs_epi16(u, s);
            _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
        }
    }

    #[inline(always)]
    unsafe fn dot_s8(acc: __m256i, w: __m256i, s: __m256i) -> __m256i {
        // SAFETY: as above. |w| ≤ 128 and |s| ≤ 127 keep each i16 pair sum ≤ 32512.
        unsafe {
            let pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(s, w));
            _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
        }
    }
}

impl Isa for Vnni {
    const S8_OFFSET: i32 = 128;

    #[inline(always)]
    unsafe fn dot_u6(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
        // SAFETY: only instantiated inside `#[target_feature(enable = "avxvnni")]` entry
        // points that run after `is_x86_feature_detected!("avxvnni")`.
        unsafe { _mm256_dpbusd_avx_epi32(acc, u, s) }
    }

    #[inline(always)]
    unsafe fn dot_s8(acc: __m256i, w: __m256i, s: __m256i) -> __m256i {
        // SAFETY: as above; xor 0x80 maps i8 w to the u8 w + 128.
        unsafe { _mm256_dpbusd_avx_epi32(acc, _mm256_xor_si256(w, _mm256_set1_epi8(-128)), s) }
    }
}

/// Which implementation this CPU gets; `None` when even AVX2+FMA is missing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum IsaChoice {
    Avx2,
    Vnni,
}

pub(super) fn detect() -> Option<IsaChoice> {
    if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")) {
        return None;
    }
    if std::env::var_os("NOVAINFER_NO_VNNI").is_none() && is_x86_feature_detected!("avxvnni") {
        Some(IsaChoice::Vnni)
    } else {
        Some(IsaChoice::Avx2)
    }
}

/// Four activation bytes at `p` broadcast to every lane.
///
/// # Safety
/// `p..p+4` must be readable.
#[inline(always)]
pub(super) unsafe fn bcast4(p: *const i8) -> __m256i {
    // SAFETY: the caller guarantees four readable bytes; no alignment is assumed.
    unsafe { _mm256_set1_epi32(std::ptr::read_unaligned(p as *const i32)) }
}
