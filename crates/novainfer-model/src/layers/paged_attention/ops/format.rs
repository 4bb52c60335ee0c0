//! Each KV dtype's numbers loaded straight into vectors, so that the kernel reads K and V
//! where they lie in the pool instead of through a decoded f32 copy of every tile (whose
//! stores were a fifth of a decode step's attention time).
//!
//! A load gives the bits [`crate::kv_dtype::KvStorage::decode`] gives: f16 and bf16 widen
//! exactly, q8_0 is one exact conversion and one multiplication by the block's f16 scale
//! widened.

use super::simd::Simd;
use crate::kv_dtype::q8_block;

/// One KV dtype as the vectorized kernel loads it.
///
/// # Safety
/// `S`'s ISA; `row` valid for the dtype's `row_bytes(hd)`; `d + S::LANES ≤ hd`, `d` a
/// multiple of `S::LANES` (so a q8_0 load stays inside one block, whose size is a multiple
/// of the lanes when `hd` is).
pub(super) trait Format {
    /// Numbers `d..d + S::LANES` of the `hd`-long row at `row`.
    unsafe fn load<S: Simd>(row: *const u8, d: usize, hd: usize) -> S::V;
}

pub(super) struct F32;
pub(super) struct F16;
pub(super) struct Bf16;
pub(super) struct Q8_0;

impl Format for F32 {
    #[inline(always)]
    unsafe fn load<S: Simd>(row: *const u8, d: usize, _hd: usize) -> S::V {
        // SAFETY: the trait's contract.
        unsafe { S::load(row.cast::<f32>().add(d)) }
    }
}

impl Format for F16 {
    #[inline(always)]
    unsafe fn load<S: Simd>(row: *const u8, d: usize, _hd: usize) -> S::V {
        // SAFETY: the trait's contract.
        unsafe { S::load_f16(row.add(2 * d)) }
    }
}

impl Format for Bf16 {
    #[inline(always)]
    unsafe fn load<S: Simd>(row: *const u8, d: usize, _hd: usize) -> S::V {
        // SAFETY: the trait's contract.
        unsafe { S::load_bf16(row.add(2 * d)) }
    }
}

impl Format for Q8_0 {
    #[inline(always)]
    unsafe fn load<S: Simd>(row: *const u8, d: usize, hd: usize) -> S::V {
        let qk = q8_block(hd);
        // SAFETY: the trait's contract: block `d / qk` of the row holds lanes d..d + LANES.
        unsafe {
            let block = row.add(d / qk * (2 + qk));
            let bits = u16::from_le_bytes([*block, *block.add(1)]);
            let scale = S::splat(half::f16::from_bits(bits).to_f32());
            S::mul(S::load_i8(block.add(2 + d % qk)), scale)
        }
    }
}

/// `$body` with the type `$f` the [`Format`] of `$dtype` (one copy of `$body` per format).
macro_rules! by_format {
    ($dtype:expr, |$f:ident| $body:expr) => {{
        use $crate::layers::paged_attention::ops::format as fmt;
        match $dtype {
            $crate::kv_dtype::KvStorage::F32 => {
                type $f = fmt::F32;
                $body
            }
            $crate::kv_dtype::KvStorage::F16 => {
                type $f = fmt::F16;
                $body
            }
            $crate::kv_dtype::KvStorage::Bf16 => {
                type $f = fmt::Bf16;
                $body
            }
            $crate::kv_dtype::KvStorage::Q8_0 => {
                type $f = fmt::Q8_0;
                $body
            }
        }
    }};
}
pub(super) use by_format;

/// `$body` with the type `$f` the [`Format`] of `$dtype`, a [`crate::paged_kv::TiledDtype`].
macro_rules! by_tiled {
    ($dtype:expr, |$f:ident| $body:expr) => {{
        use $crate::layers::paged_attention::ops::format as fmt;
        match $dtype {
            $crate::paged_kv::TiledDtype::F32 => {
                type $f = fmt::F32;
                $body
            }
            $crate::paged_kv::TiledDtype::F16 => {
                type $f = fmt::F16;
                $body
            }
            $crate::paged_kv::TiledDtype::Bf16 => {
                type $f = fmt::Bf16;
                $body
            }
        }
    }};
}
pub(super) use by_tiled;
