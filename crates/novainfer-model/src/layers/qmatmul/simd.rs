//! The vector operations the kernels are written in, for three instruction sets:
//! AVX2 and AVX-VNNI on 256-bit registers (8 output columns per register) and
//! AVX-512-VNNI on 512-bit registers (16 columns).
//!
//! Invariants that keep results bit-identical across implementations:
//! * integer dot products are exact everywhere: AVX2's i16 pair sums cannot
//!   saturate because `dot_u6` weights are ≤ 63, activations lie in -127..=127,
//!   and `dot_s8` uses |w|·sign tricks with |w| ≤ 128;
//! * each f32 lane sees the same IEEE operations (cvt, mul, fma) whatever the width.

use std::arch::x86_64::*;
use std::ops::Range;

use super::activation::QuantizedActs;
use super::Kernel;

/// One instruction set as seen by the kernels. Lane `l` of every vector belongs to
/// output column `l` of the columns being computed.
pub(super) trait Simd: Copy {
    /// Columns per vector (8 or 16).
    const LANES: usize;
    /// `dot_s8` adds this to every weight; callers subtract `S8_OFFSET·Σa` per block.
    const S8_OFFSET: i32;
    type I: Copy;
    type F: Copy;

    // Every method: # Safety — the CPU must support the implementing ISA, and
    // pointers must be readable/writable for the bytes named.

    /// `LANES·4` bytes.
    unsafe fn load(p: *const u8) -> Self::I;
    /// `LANES` f32.
    unsafe fn loadf(p: *const u8) -> Self::F;
    unsafe fn store(p: *mut f32, v: Self::F);
    unsafe fn zero() -> Self::I;
    unsafe fn zerof() -> Self::F;
    unsafe fn splat8(v: i8) -> Self::I;
    unsafe fn splat32(v: i32) -> Self::I;
    unsafe fn splatf(v: f32) -> Self::F;
    /// Four activation bytes at `p` in every lane.
    unsafe fn bcast4(p: *const i8) -> Self::I;
    unsafe fn and(a: Self::I, b: Self::I) -> Self::I;
    unsafe fn or(a: Self::I, b: Self::I) -> Self::I;
    unsafe fn add32(a: Self::I, b: Self::I) -> Self::I;
    unsafe fn sub32(a: Self::I, b: Self::I) -> Self::I;
    unsafe fn mullo32(a: Self::I, b: Self::I) -> Self::I;
    unsafe fn shl16<const S: i32>(a: Self::I) -> Self::I;
    unsafe fn shr16<const S: i32>(a: Self::I) -> Self::I;
    /// `acc + Σ_{t<4} u·s` per lane, unsigned `u ≤ 63`, signed `s`.
    unsafe fn dot_u6(acc: Self::I, u: Self::I, s: Self::I) -> Self::I;
    /// `acc + Σ_{t<4} (w + S8_OFFSET)·s` per lane, signed `w`.
    unsafe fn dot_s8(acc: Self::I, w: Self::I, s: Self::I) -> Self::I;
    /// `LANES` u8 / i8 at `p`, widened to i32 lanes.
    unsafe fn u8_i32(p: *const u8) -> Self::I;
    unsafe fn i8_i32(p: *const u8) -> Self::I;
    /// `2·LANES` u8 at `p`, widened to i16 (two per lane).
    unsafe fn u8_i16(p: *const u8) -> Self::I;
    /// i16 pair dot product per lane.
    unsafe fn madd16(a: Self::I, b: Self::I) -> Self::I;
    unsafe fn cvt(a: Self::I) -> Self::F;
    unsafe fn mul(a: Self::F, b: Self::F) -> Self::F;
    /// `a·b + c`, one rounding.
    unsafe fn fma(a: Self::F, b: Self::F, c: Self::F) -> Self::F;
    /// `c - a·b`, one rounding.
    unsafe fn fnma(a: Self::F, b: Self::F, c: Self::F) -> Self::F;

    /// `K`'s tile on this ISA: [`Kernel::tile`], or on plain AVX2 [`Kernel::tile_avx2`]
    /// (a format's hand-written kernel where it has one). Contract of [`Kernel::tile`].
    #[inline(always)]
    unsafe fn kernel_tile<K: Kernel, const R: usize>(
        group: *const u8,
        col_off: usize,
        acts: &QuantizedActs,
        row0: usize,
        blocks: Range<usize>,
        facc: [Self::F; R],
    ) -> [Self::F; R] {
        // SAFETY: forwarded.
        unsafe { K::tile::<Self, R>(group, col_off, acts, row0, blocks, facc) }
    }
}

/// Plain AVX2 (the crate's baseline, x86-64-v3).
#[derive(Clone, Copy)]
pub(super) struct Avx2;
/// AVX-VNNI: `vpdpbusd` on 256-bit registers.
#[derive(Clone, Copy)]
pub(super) struct Vnni256;
/// AVX-512 (F, BW, VNNI): 16 columns per register.
#[derive(Clone, Copy)]
pub(super) struct Avx512;

/// The 256-bit operations shared by `Avx2` and `Vnni256`, which differ only in the dot products.
macro_rules! ymm_common {
    () => {
        const LANES: usize = 8;
        type I = __m256i;
        type F = __m256;
        // SAFETY (all methods below): AVX2/FMA are the build baseline and detected at
        // run time; loads/stores are unaligned and cover exactly the bytes documented.
        #[inline(always)]
        unsafe fn load(p: *const u8) -> __m256i {
            unsafe { _mm256_loadu_si256(p as *const __m256i) }
        }
        #[inline(always)]
        unsafe fn loadf(p: *const u8) -> __m256 {
            unsafe { _mm256_loadu_ps(p as *const f32) }
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: __m256) {
            unsafe { _mm256_storeu_ps(p, v) }
        }
        #[inline(always)]
        unsafe fn zero() -> __m256i {
            unsafe { _mm256_setzero_si256() }
        }
        #[inline(always)]
        unsafe fn zerof() -> __m256 {
            unsafe { _mm256_setzero_ps() }
        }
        #[inline(always)]
        unsafe fn splat8(v: i8) -> __m256i {
            unsafe { _mm256_set1_epi8(v) }
        }
        #[inline(always)]
        unsafe fn splat32(v: i32) -> __m256i {
            unsafe { _mm256_set1_epi32(v) }
        }
        #[inline(always)]
        unsafe fn splatf(v: f32) -> __m256 {
            unsafe { _mm256_set1_ps(v) }
        }
        #[inline(always)]
        unsafe fn bcast4(p: *const i8) -> __m256i {
            unsafe { _mm256_set1_epi32(std::ptr::read_unaligned(p as *const i32)) }
        }
        #[inline(always)]
        unsafe fn and(a: __m256i, b: __m256i) -> __m256i {
            unsafe { _mm256_and_si256(a, b) }
        }
        #[inline(always)]
        unsafe fn or(a: __m256i, b: __m256i) -> __m256i {
            unsafe { _mm256_or_si256(a, b) }
        }
        #[inline(always)]
        unsafe fn add32(a: __m256i, b: __m256i) -> __m256i {
            unsafe { _mm256_add_epi32(a, b) }
        }
        #[inline(always)]
        unsafe fn sub32(a: __m256i, b: __m256i) -> __m256i {
            unsafe { _mm256_sub_epi32(a, b) }
        }
        #[inline(always)]
        unsafe fn mullo32(a: __m256i, b: __m256i) -> __m256i {
            unsafe { _mm256_mullo_epi32(a, b) }
        }
        #[inline(always)]
        unsafe fn shl16<const S: i32>(a: __m256i) -> __m256i {
            unsafe { _mm256_slli_epi16::<S>(a) }
        }
        #[inline(always)]
        unsafe fn shr16<const S: i32>(a: __m256i) -> __m256i {
            unsafe { _mm256_srli_epi16::<S>(a) }
        }
        #[inline(always)]
        unsafe fn u8_i32(p: *const u8) -> __m256i {
            unsafe { _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i)) }
        }
        #[inline(always)]
        unsafe fn i8_i32(p: *const u8) -> __m256i {
            unsafe { _mm256_cvtepi8_epi32(_mm_loadl_epi64(p as *const __m128i)) }
        }
        #[inline(always)]
        unsafe fn u8_i16(p: *const u8) -> __m256i {
            unsafe { _mm256_cvtepu8_epi16(_mm_loadu_si128(p as *const __m128i)) }
        }
        #[inline(always)]
        unsafe fn madd16(a: __m256i, b: __m256i) -> __m256i {
            unsafe { _mm256_madd_epi16(a, b) }
        }
        #[inline(always)]
        unsafe fn cvt(a: __m256i) -> __m256 {
            unsafe { _mm256_cvtepi32_ps(a) }
        }
        #[inline(always)]
        unsafe fn mul(a: __m256, b: __m256) -> __m256 {
            unsafe { _mm256_mul_ps(a, b) }
        }
        #[inline(always)]
        unsafe fn fma(a: __m256, b: __m256, c: __m256) -> __m256 {
            unsafe { _mm256_fmadd_ps(a, b, c) }
        }
        #[inline(always)]
        unsafe fn fnma(a: __m256, b: __m256, c: __m256) -> __m256 {
            unsafe { _mm256_fnmadd_ps(a, b, c) }
        }
    };
}

impl Simd for Avx2 {
    const S8_OFFSET: i32 = 0;
    ymm_common!();

    #[inline(always)]
    unsafe fn kernel_tile<K: Kernel, const R: usize>(
        group: *const u8,
        col_off: usize,
        acts: &QuantizedActs,
        row0: usize,
        blocks: Range<usize>,
        facc: [__m256; R],
    ) -> [__m256; R] {
        // SAFETY: forwarded.
        unsafe { K::tile_avx2::<R>(group, col_off, acts, row0, blocks, facc) }
    }

    #[inline(always)]
    unsafe fn dot_u6(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
        // SAFETY: AVX2 baseline; u ≤ 63 keeps each i16 pair sum ≤ 16002.
        unsafe {
            let pairs = _mm256_maddubs_epi16(u, s);
            _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
        }
    }

    #[inline(always)]
    unsafe fn dot_s8(acc: __m256i, w: __m256i, s: __m256i) -> __m256i {
        // SAFETY: AVX2 baseline; |w| ≤ 128 and |s| ≤ 127 keep each i16 pair sum ≤ 32512.
        unsafe {
            let pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(s, w));
            _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
        }
    }
}

impl Simd for Vnni256 {
    const S8_OFFSET: i32 = 128;
    ymm_common!();

    #[inline(always)]
    unsafe fn dot_u6(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
        // SAFETY: only instantiated inside `#[target_feature(enable = "avxvnni")]`
        // entry points, which run after `is_x86_feature_detected!("avxvnni")`.
        unsafe { _mm256_dpbusd_avx_epi32(acc, u, s) }
    }

    #[inline(always)]
    unsafe fn dot_s8(acc: __m256i, w: __m256i, s: __m256i) -> __m256i {
        // SAFETY: as above; xor 0x80 maps i8 w to the u8 w + 128.
        unsafe { _mm256_dpbusd_avx_epi32(acc, _mm256_xor_si256(w, _mm256_set1_epi8(-128)), s) }
    }
}

// SAFETY (all methods below): only instantiated inside
// `#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]` entry points, which run
// after those features were detected; loads/stores are unaligned and cover exactly
// the bytes documented on the trait.
impl Simd for Avx512 {
    const LANES: usize = 16;
    const S8_OFFSET: i32 = 128;
    type I = __m512i;
    type F = __m512;

    #[inline(always)]
    unsafe fn load(p: *const u8) -> __m512i {
        unsafe { _mm512_loadu_si512(p as *const __m512i) }
    }
    #[inline(always)]
    unsafe fn loadf(p: *const u8) -> __m512 {
        unsafe { _mm512_loadu_ps(p as *const f32) }
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: __m512) {
        unsafe { _mm512_storeu_ps(p, v) }
    }
    #[inline(always)]
    unsafe fn zero() -> __m512i {
        unsafe { _mm512_setzero_si512() }
    }
    #[inline(always)]
    unsafe fn zerof() -> __m512 {
        unsafe { _mm512_setzero_ps() }
    }
    #[inline(always)]
    unsafe fn splat8(v: i8) -> __m512i {
        unsafe { _mm512_set1_epi8(v) }
    }
    #[inline(always)]
    unsafe fn splat32(v: i32) -> __m512i {
        unsafe { _mm512_set1_epi32(v) }
    }
    #[inline(always)]
    unsafe fn splatf(v: f32) -> __m512 {
        unsafe { _mm512_set1_ps(v) }
    }
    #[inline(always)]
    unsafe fn bcast4(p: *const i8) -> __m512i {
        unsafe { _mm512_set1_epi32(std::ptr::read_unaligned(p as *const i32)) }
    }
    #[inline(always)]
    unsafe fn and(a: __m512i, b: __m512i) -> __m512i {
        unsafe { _mm512_and_si512(a, b) }
    }
    #[inline(always)]
    unsafe fn or(a: __m512i, b: __m512i) -> __m512i {
        unsafe { _mm512_or_si512(a, b) }
    }
    #[inline(always)]
    unsafe fn add32(a: __m512i, b: __m512i) -> __m512i {
        unsafe { _mm512_add_epi32(a, b) }
    }
    #[inline(always)]
    unsafe fn sub32(a: __m512i, b: __m512i) -> __m512i {
        unsafe { _mm512_sub_epi32(a, b) }
    }
    #[inline(always)]
    unsafe fn mullo32(a: __m512i, b: __m512i) -> __m512i {
        unsafe { _mm512_mullo_epi32(a, b) }
    }
    #[inline(always)]
    unsafe fn shl16<const S: i32>(a: __m512i) -> __m512i {
        // The immediate form takes a u32 const; the count-register form avoids the cast.
        unsafe { _mm512_sll_epi16(a, _mm_cvtsi32_si128(S)) }
    }
    #[inline(always)]
    unsafe fn shr16<const S: i32>(a: __m512i) -> __m512i {
        unsafe { _mm512_srl_epi16(a, _mm_cvtsi32_si128(S)) }
    }
    #[inline(always)]
    unsafe fn dot_u6(acc: __m512i, u: __m512i, s: __m512i) -> __m512i {
        unsafe { _mm512_dpbusd_epi32(acc, u, s) }
    }
    #[inline(always)]
    unsafe fn dot_s8(acc: __m512i, w: __m512i, s: __m512i) -> __m512i {
        unsafe { _mm512_dpbusd_epi32(acc, _mm512_xor_si512(w, _mm512_set1_epi8(-128)), s) }
    }
    #[inline(always)]
    unsafe fn u8_i32(p: *const u8) -> __m512i {
        unsafe { _mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i)) }
    }
    #[inline(always)]
    unsafe fn i8_i32(p: *const u8) -> __m512i {
        unsafe { _mm512_cvtepi8_epi32(_mm_loadu_si128(p as *const __m128i)) }
    }
    #[inline(always)]
    unsafe fn u8_i16(p: *const u8) -> __m512i {
        unsafe { _mm512_cvtepu8_epi16(_mm256_loadu_si256(p as *const __m256i)) }
    }
    #[inline(always)]
    unsafe fn madd16(a: __m512i, b: __m512i) -> __m512i {
        unsafe { _mm512_madd_epi16(a, b) }
    }
    #[inline(always)]
    unsafe fn cvt(a: __m512i) -> __m512 {
        unsafe { _mm512_cvtepi32_ps(a) }
    }
    #[inline(always)]
    unsafe fn mul(a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_mul_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn fma(a: __m512, b: __m512, c: __m512) -> __m512 {
        unsafe { _mm512_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    unsafe fn fnma(a: __m512, b: __m512, c: __m512) -> __m512 {
        unsafe { _mm512_fnmadd_ps(a, b, c) }
    }
}

/// An implementation of the kernels (see [`select`](super::select) for which one runs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum IsaChoice {
    Avx2,
    Vnni256,
    Avx512,
    /// AMX tiles for whole 16-row tiles of a product, AVX-512 for the rest ([`super::amx`]).
    Amx,
}

impl IsaChoice {
    /// The name `NOVAINFER_QMATMUL_ISA` and the logs use.
    pub(super) fn name(self) -> &'static str {
        match self {
            Self::Avx2 => "avx2",
            Self::Vnni256 => "vnni256",
            Self::Avx512 => "avx512",
            Self::Amx => "amx",
        }
    }

    /// Whether its few-row products (decode, verify) stream the weights with software
    /// prefetches: AVX2's row and few-row paths and AVX-512's few-row path do (AMX runs few
    /// rows on the latter); VNNI-256 runs them through the prefill driver, whose reads go at
    /// the hardware prefetchers' pace.
    pub(super) fn streams_few_rows(self) -> bool {
        !matches!(self, Self::Vnni256)
    }
}

/// The implementations this CPU can run, AVX2 (the baseline) first; empty when even
/// AVX2+FMA is missing (candle's kernels run then).
pub(super) fn available() -> Vec<IsaChoice> {
    if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")) {
        return Vec::new();
    }
    let mut v = vec![IsaChoice::Avx2];
    if is_x86_feature_detected!("avxvnni") {
        v.push(IsaChoice::Vnni256);
    }
    if is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vnni")
    {
        v.push(IsaChoice::Avx512);
        if super::amx::available() {
            v.push(IsaChoice::Amx);
        }
    }
    v
}
