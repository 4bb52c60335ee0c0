//! How the CUDA executor runs a step's linear layers: a decode step's ([`DecodeLinear`]), and a
//! larger step's over a packed matrix ([`PackedGemm`]).
//!
//! The fused path is opt-in until a GPU run has verified it (its kernels against the
//! separate ones bit for bit, its tokens against the separate path's):
//! `NOVAINFER_CUDA_DECODE_LINEAR=fused`. So is the tiled GEMM over packed weights
//! (`NOVAINFER_CUDA_PACKED_GEMM=tile`). The CPU executor has its own kernels and ignores both
//! choices.

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

/// The environment variable choosing [`PackedGemm`].
pub const PACKED_GEMM_ENV: &str = "NOVAINFER_CUDA_PACKED_GEMM";

/// How a step of more than [`MAX_ROWS`] rows multiplies by a packed matrix (GGUF blocks, int4,
/// FP8; `gpu_weight_dtype`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum PackedGemm {
    /// The matrix expanded to bf16 in a scratch as large as the largest packed matrix, then
    /// cuBLAS: every step writes and reads the whole matrix in bf16 besides the blocks.
    #[default]
    Expand,
    /// The tiled tensor-core GEMM (`gemv_quant.cu`'s `gemm_packed`), each block decoding its
    /// weight tile into shared memory: the blocks are read, nothing is written back, and no
    /// scratch is allocated.
    Tile,
}

impl PackedGemm {
    /// The choice `value` (the variable's, if set) names; anything else is an error naming the
    /// variable.
    pub fn parse(value: &str) -> Result<Self, String> {
        match value.trim() {
            "" | "expand" => Ok(Self::Expand),
            "tile" => Ok(Self::Tile),
            other => Err(format!(
                "{PACKED_GEMM_ENV}={other:?}: expected `expand` or `tile`"
            )),
        }
    }

    /// The choice [`PACKED_GEMM_ENV`] names in this process's environment (read when an engine
    /// loads).
    pub fn from_env() -> Result<Self, String> {
        Self::parse(&std::env::var(PACKED_GEMM_ENV).unwrap_or_default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expand_unless_tile_is_named() {
        assert_eq!(PackedGemm::default(), PackedGemm::Expand);
        assert_eq!(PackedGemm::parse(""), Ok(PackedGemm::Expand));
        assert_eq!(PackedGemm::parse("expand"), Ok(PackedGemm::Expand));
        assert_eq!(PackedGemm::parse(" tile "), Ok(PackedGemm::Tile));
        let err = PackedGemm::parse("mma").expect_err("not a choice");
        assert!(
            err.contains(PACKED_GEMM_ENV) && err.contains("tile"),
            "{err}"
        );
    }

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
