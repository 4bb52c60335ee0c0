//! How the lm_head (the `[vocab, hidden]` output projection) is stored (`lm_head_dtype`).
//!
//! A batch-1 decode step reads every weight once, and the lm_head is the largest single
//! matrix: 151,936 × 1,536 for the Qwen2.5 1.5B shape, 467 MB in f16, which is 40 % of what
//! an AWQ int4 checkpoint of that model reads per token (AWQ and GPTQ leave the head, tied to
//! the embedding or not, in f16). A Q4_K_M GGUF of the same model holds it in Q6_K. So:
//! * `auto` keeps the checkpoint's head exactly (in the load `dtype`);
//! * `q8_0` quantizes a dense head to Q8_0 at load (8.5 bits per weight: each weight moves by
//!   at most half a step of its 32-weight block, `amax/254`), llama.cpp's option for its
//!   output tensor. Lossy, so opt-in. A head the checkpoint already quantized (GGUF) is kept
//!   as it is; a tied embedding keeps its table for lookups and the head gets its own copy.

use crate::error::{ModelError, Result};

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum LmHeadDtype {
    #[default]
    Auto,
    Q8_0,
}

impl LmHeadDtype {
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(Self::Auto),
            "q8_0" => Ok(Self::Q8_0),
            other => Err(ModelError::config(
                "lm_head_dtype",
                format!("unknown lm_head_dtype {other:?}; expected \"auto\" or \"q8_0\""),
            )),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Q8_0 => "q8_0",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spellings_round_trip_and_unknown_ones_name_the_choices() {
        for d in [LmHeadDtype::Auto, LmHeadDtype::Q8_0] {
            assert_eq!(LmHeadDtype::parse(d.as_str()).expect("known"), d);
        }
        let e = LmHeadDtype::parse("q4_k").expect_err("unknown").to_string();
        assert!(e.contains("q4_k") && e.contains("q8_0"), "{e}");
    }
}
