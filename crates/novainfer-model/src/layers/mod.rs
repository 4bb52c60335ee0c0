//! Building blocks of the Qwen2 forward pass on CPU.
//!
//! Activations are row-major `f32` slices `[rows, features]`; candle is used
//! where it is strong (dense and quantized matmuls), plain loops where we want
//! exact control over the arithmetic (norms, RoPE, attention).

pub mod attention;
pub mod dense;
#[cfg(all(
    test,
    target_arch = "x86_64",
    target_os = "linux",
    not(debug_assertions)
))]
mod inlining_tests;
pub mod linear;
pub mod ops;
pub(crate) mod paged_attention;
pub(crate) mod parallel;
#[cfg(target_arch = "x86_64")]
pub mod qmatmul;
#[cfg(not(target_arch = "x86_64"))]
#[path = "qmatmul_stub.rs"]
pub mod qmatmul;

pub use attention::{attention, AttentionShape, KvView, QueryRow};
pub use linear::{Embedding, Linear};
