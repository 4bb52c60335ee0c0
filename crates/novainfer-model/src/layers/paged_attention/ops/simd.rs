//! The vector operations the vectorized kernel ([`super::vectorized`]) is written in; AVX2
//! ([`super::Avx2`], 8 lanes) and AVX-512F ([`super::Avx512`], 16 lanes) implement them.
//!
//! Each operation is one IEEE operation per lane, or an exact conversion, so a body written
//! once gives the same bits at either width wherever it keeps the same order per number
//! (which [`super::vectorized`] documents). Lane `l` of a vector is the number at `p + l`
//! of the memory it was loaded from.
//!
//! qmatmul's `Simd` is the same idea, not the same set: its kernels need integer dot
//! products and widenings, these need division, maximum, rounding, `2ⁿ`, half-precision
//! widening, lane masks and the split into 8-lane halves; the few they share (load, store,
//! splat, mul, fma) are one-line wrappers, not worth a trait across both modules.
//!
//! Inlining: every method is `#[inline(always)]` and called only from `#[inline(always)]`
//! code down from an entry point compiled with the ISA's target features (`mod.rs`); never
//! from a closure, which would be compiled without them (the intrinsic becomes a call with
//! its vectors passed through memory: 20x slower for AVX-512).

use std::arch::x86_64::__m256;

/// One instruction set as the vectorized kernel sees it.
///
/// # Safety
/// Every method may use the ISA's instructions: call it only where they were detected.
/// Pointers must be valid for the `LANES` numbers named.
pub(super) trait Simd: Copy {
    /// f32 lanes per vector, a multiple of 8: the key layout puts `LANES / 8` groups of 8
    /// positions side by side.
    const LANES: usize;
    /// Query rows per register block of the scores and the value pass (at most 8):
    /// `ROW_BLOCK × 2` accumulators, 2 loaded vectors and a broadcast must fit the registers.
    const ROW_BLOCK: usize;
    /// `LANES` f32.
    type V: Copy;
    /// A set of lanes.
    type Mask: Copy;

    unsafe fn zero() -> Self::V;
    unsafe fn splat(x: f32) -> Self::V;
    unsafe fn load(p: *const f32) -> Self::V;
    unsafe fn store(p: *mut f32, v: Self::V);
    unsafe fn add(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn sub(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn mul(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn div(a: Self::V, b: Self::V) -> Self::V;
    /// `a·b + c`, one rounding.
    unsafe fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    /// x86's `max`: `b` where either is NaN or both are zeros (so the operand order counts).
    unsafe fn max(a: Self::V, b: Self::V) -> Self::V;
    /// To the nearest integer, ties to even.
    unsafe fn round(a: Self::V) -> Self::V;
    /// `2ⁿ` for integral `n` in the normal range, built from its exponent bits.
    unsafe fn pow2(n: Self::V) -> Self::V;
    /// `LANES` f16 at `p`, widened (exact).
    unsafe fn load_f16(p: *const u8) -> Self::V;
    /// `LANES` bf16 at `p`, widened (exact).
    unsafe fn load_bf16(p: *const u8) -> Self::V;
    /// `LANES` i8 at `p`, converted (exact).
    unsafe fn load_i8(p: *const u8) -> Self::V;
    /// Lanes `0..n`, `n ≤ LANES`.
    unsafe fn first(n: usize) -> Self::Mask;
    /// `a` in the lanes of `m`, `b` in the others.
    unsafe fn select(m: Self::Mask, a: Self::V, b: Self::V) -> Self::V;
    /// `a` in the lanes of `m`, `+0` in the others.
    unsafe fn zero_unless(m: Self::Mask, a: Self::V) -> Self::V;
    /// Lanes `8i..8i + 8`, `i < LANES / 8` (a constant once unrolled).
    unsafe fn ymm(v: Self::V, i: usize) -> __m256;
}

/// The methods of [`Simd`] that are a single intrinsic on `Self::V`s, as
/// `name(a, b) = intrinsic;`.
macro_rules! lanewise {
    ($($name:ident($($arg:ident),+) = $intrinsic:path;)+) => {
        $(
            #[inline(always)]
            unsafe fn $name($($arg: Self::V),+) -> Self::V {
                // SAFETY: the trait's contract (the ISA was detected).
                unsafe { $intrinsic($($arg),+) }
            }
        )+
    };
}
pub(super) use lanewise;
