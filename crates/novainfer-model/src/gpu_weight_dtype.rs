//! How the CUDA executor holds a checkpoint's quantized matrices (`gpu_weight_dtype`).
//!
//! * `bf16` (the default): every matrix expanded to bf16 at load, cuBLAS for every product.
//!   Three times a Q4_K_M file's bytes in device memory, and a decode step reads them all.
//! * `native`: Q4_K, Q5_0, Q6_K and Q8_0 matrices, and AWQ/GPTQ int4 ones (not act-order),
//!   stay as the file's blocks; steps of up to 8 rows (decode) multiply them in place
//!   (`kernels/gemv_quant.cu`, reading each block once), larger ones expand each matrix into a
//!   bf16 scratch first and run cuBLAS. A packed embedding table expands only each step's token
//!   rows, and a tied head is that table, so the weights take about the file's size (plus the
//!   scratch, as large as the largest matrix: the vocabulary head). A row's
//!   result depends on which of the two paths its step took (as in vLLM; the bf16 path is batch
//!   invariant), so greedy tokens can differ between a request alone and in a large batch.
//!
//! The CPU always runs quantized blocks natively and ignores this.

use crate::error::{ModelError, Result};

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum GpuWeightDtype {
    #[default]
    Bf16,
    Native,
}

impl GpuWeightDtype {
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "bf16" => Ok(Self::Bf16),
            "native" => Ok(Self::Native),
            other => Err(ModelError::config(
                "gpu_weight_dtype",
                format!("unknown gpu_weight_dtype {other:?}; expected \"bf16\" or \"native\""),
            )),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Bf16 => "bf16",
            Self::Native => "native",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spellings_round_trip_and_unknown_ones_name_the_choices() {
        for d in [GpuWeightDtype::Bf16, GpuWeightDtype::Native] {
            assert_eq!(GpuWeightDtype::parse(d.as_str()).expect("known"), d);
        }
        let e = GpuWeightDtype::parse("int4")
            .expect_err("unknown")
            .to_string();
        assert!(e.contains("int4") && e.contains("native"), "{e}");
    }
}
