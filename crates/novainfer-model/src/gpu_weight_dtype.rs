//! How the CUDA executor holds a checkpoint's quantized matrices (`gpu_weight_dtype`).
//!
//! * `auto` (the default): FP8 matrices (FP8 checkpoints, `quantization="fp8"`) as `native`
//!   holds them, every other format as `bf16` does. Expanding FP8 would double its bytes and
//!   round its values to bf16; the other formats stay expanded until the packed path's GPU
//!   figures are in.
//! * `bf16`: every matrix expanded to bf16 at load, cuBLAS for every product.
//!   Three times a Q4_K_M file's bytes in device memory, and a decode step reads them all.
//! * `native`: Q4_K, Q5_0, Q6_K and Q8_0 matrices, AWQ/GPTQ int4 ones (act-order ones with their
//!   input order, when a fused matrix's parts share it) and FP8 ones stay as the file's blocks; steps of up to 8 rows (decode) multiply them in place
//!   (`kernels/gemv_quant.cu`, reading each block once), larger ones expand each matrix into a
//!   bf16 scratch first and run cuBLAS. A packed embedding table expands only each step's token
//!   rows, and a tied head is that table, so the weights take about the file's size (plus the
//!   scratch, as large as the largest matrix: the vocabulary head). A row's
//!   result depends on which of the two paths its step took (as in vLLM; the bf16 path is batch
//!   invariant), so greedy tokens can differ between a request alone and in a large batch.
//!
//! The CPU always runs quantized blocks natively and ignores this.

use novainfer_cuda::quant_type::QuantType;

use crate::error::{ModelError, Result};

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum GpuWeightDtype {
    #[default]
    Auto,
    Bf16,
    Native,
}

impl GpuWeightDtype {
    pub const ALL: [GpuWeightDtype; 3] = [Self::Auto, Self::Bf16, Self::Native];

    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(Self::Auto),
            "bf16" => Ok(Self::Bf16),
            "native" => Ok(Self::Native),
            other => Err(ModelError::config(
                "gpu_weight_dtype",
                format!(
                    "unknown gpu_weight_dtype {other:?}; expected \"auto\", \"bf16\" or \"native\""
                ),
            )),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Bf16 => "bf16",
            Self::Native => "native",
        }
    }

    /// Whether a matrix of `kind` blocks stays packed on the device (its rows being whole
    /// blocks), rather than expanded to bf16.
    pub fn keeps_packed(self, kind: QuantType) -> bool {
        match self {
            Self::Auto => kind == QuantType::Fp8,
            Self::Bf16 => false,
            Self::Native => true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spellings_round_trip_and_unknown_ones_name_the_choices() {
        for d in GpuWeightDtype::ALL {
            assert_eq!(GpuWeightDtype::parse(d.as_str()).expect("known"), d);
        }
        let e = GpuWeightDtype::parse("int4")
            .expect_err("unknown")
            .to_string();
        assert!(e.contains("int4") && e.contains("native"), "{e}");
    }

    #[test]
    fn auto_keeps_only_fp8_packed() {
        for kind in QuantType::ALL {
            assert_eq!(
                GpuWeightDtype::Auto.keeps_packed(kind),
                kind == QuantType::Fp8
            );
            assert!(!GpuWeightDtype::Bf16.keeps_packed(kind));
            assert!(GpuWeightDtype::Native.keeps_packed(kind));
        }
    }
}
