//! How the CUDA executor runs a decode step's linear layers.
//!
//! The fused path is opt-in until a GPU run has verified it (its kernels against the
//! separate ones bit for bit, its tokens against the separate path's):
//! `NOVAINFER_CUDA_DECODE_LINEAR=fused`. The CPU executor has its own kernels and ignores
//! the choice.

use novainfer_cuda::gemv_plan::MAX_ROWS;

/// The environment variable choosing [`DecodeLinear`].
pub const DECODE_LINEAR_ENV: &str = "NOVAINFER_CUDA_DECODE_LINEAR";

/// How a step of up to [`MAX_ROWS`] rows multiplies by the layer's matrices.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum DecodeLinear {
    /// cuBLAS for a bf16 matrix, the packed GEMV for a packed one, each product followed by
    /// its own bias/RoPE/cache-write and SiLU·mul kernels.
    #[default]
    Separate,
    /// The GEMV for every matrix (bf16 too: cuBLAS at one row may add a split-K reduce
    /// launch), with the QKV bias, RoPE and cache write, and the SiLU·mul of gate and up, in
    /// the GEMV's epilogue: two launches a layer fewer, more where cuBLAS split a GEMM.
    Fused,
}

impl DecodeLinear {
    /// The choice `value` (the variable's, if set) names; anything else is an error naming
    /// the variable, rather than a silent default.
    pub fn parse(value: &str) -> Result<Self, String> {
        match value.trim() {
            "" | "separate" => Ok(Self::Separate),
            "fused" => Ok(Self::Fused),
            other => Err(format!(
                "{DECODE_LINEAR_ENV}={other:?}: expected `separate` or `fused`"
            )),
        }
    }

    /// The choice [`DECODE_LINEAR_ENV`] names in this process's environment (read when an
    /// engine loads, like the graph mode, so each engine may choose).
    pub fn from_env() -> Result<Self, String> {
        Self::parse(&std::env::var(DECODE_LINEAR_ENV).unwrap_or_default())
    }

    /// Whether a step of `rows` rows runs fused: up to the GEMV's rows, and no LoRA (its
    /// updates land between the product and the epilogue, so they need the product stored).
    pub fn fuses(self, rows: usize, lora: bool) -> bool {
        self == Self::Fused && rows <= MAX_ROWS && !lora
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn separate_unless_fused_is_named() {
        assert_eq!(DecodeLinear::default(), DecodeLinear::Separate);
        assert_eq!(DecodeLinear::parse("").ok(), Some(DecodeLinear::Separate));
        assert_eq!(
            DecodeLinear::parse("separate").ok(),
            Some(DecodeLinear::Separate)
        );
        assert_eq!(
            DecodeLinear::parse(" fused ").ok(),
            Some(DecodeLinear::Fused)
        );
        let err = DecodeLinear::parse("yes").expect_err("not a choice");
        assert!(
            err.contains(DECODE_LINEAR_ENV) && err.contains("fused"),
            "{err}"
        );
    }

    #[test]
    fn only_small_steps_without_lora_fuse() {
        let fused = DecodeLinear::Fused;
        assert!(fused.fuses(1, false));
        assert!(fused.fuses(MAX_ROWS, false));
        assert!(!fused.fuses(MAX_ROWS + 1, false));
        assert!(!fused.fuses(1, true));
        assert!(!DecodeLinear::Separate.fuses(1, false));
    }
}
