//! The `extern "C"` kernels of `kernels/*.cu` as the emulator library exports them, one
//! module per kernel file, with the argument structs they take by value. Signatures copy the
//! `.cu` files' (bf16 is `u16`); a kernel declared wrongly reads garbage, so each one a test
//! uses is declared once, in its file's module.
#![allow(clippy::too_many_arguments)]

pub mod dequant;
pub mod embedding;
pub mod flash_prefill;
pub mod gather;
pub mod gemv_quant;
pub mod lora;
pub mod paged_attention;
pub mod qkv;
pub mod reshape_and_cache;
pub mod rms_norm;
pub mod rope;
pub mod sampling;
pub mod silu_mul;
