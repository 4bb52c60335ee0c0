//! The quantized block formats the device runs, shared by the launchers (`ops::dequant`,
//! `ops::gemv_quant`, `gemv_plan::GemvWeights`) and the CPU twins, which build without CUDA: the GGUF types of the demo
//! models, and AWQ/GPTQ grouped int4 (`novainfer_model::int4`'s blocks: an f32 scale, a u8
//! zero point and 128 nibbles).

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantType {
    Q4K,
    Q5_0,
    Q6K,
    Q8_0,
    Int4,
}

impl QuantType {
    /// In the order of the context's dequant table ([`Self::index`]).
    pub const ALL: [QuantType; 5] = [
        QuantType::Q4K,
        QuantType::Q5_0,
        QuantType::Q6K,
        QuantType::Q8_0,
        QuantType::Int4,
    ];

    pub fn index(self) -> usize {
        match self {
            QuantType::Q4K => 0,
            QuantType::Q5_0 => 1,
            QuantType::Q6K => 2,
            QuantType::Q8_0 => 3,
            QuantType::Int4 => 4,
        }
    }

    pub fn block_bytes(self) -> usize {
        match self {
            QuantType::Q4K => 144,
            QuantType::Q5_0 => 22,
            QuantType::Q6K => 210,
            QuantType::Q8_0 => 34,
            QuantType::Int4 => 4 + 1 + 64,
        }
    }

    pub fn block_values(self) -> usize {
        match self {
            QuantType::Q4K | QuantType::Q6K => 256,
            QuantType::Q5_0 | QuantType::Q8_0 => 32,
            QuantType::Int4 => 128,
        }
    }

    pub fn kernel_base(self) -> &'static str {
        match self {
            QuantType::Q4K => "dequant_q4_k",
            QuantType::Q5_0 => "dequant_q5_0",
            QuantType::Q6K => "dequant_q6_k",
            QuantType::Q8_0 => "dequant_q8_0",
            QuantType::Int4 => "dequant_int4",
        }
    }

    /// The packed embedding gather's entry point without its dtype suffix (`kernels/dequant.cu`).
    pub fn embed_base(self) -> &'static str {
        match self {
            QuantType::Q4K => "embed_q4_k",
            QuantType::Q5_0 => "embed_q5_0",
            QuantType::Q6K => "embed_q6_k",
            QuantType::Q8_0 => "embed_q8_0",
            QuantType::Int4 => "embed_int4",
        }
    }
}

/// ggml's `get_scale_min_k4`: the 6-bit scale and min of Q4_K sub-block `j` (0..8) from the
/// block's 12 scale bytes.
pub fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_lists_each_type_at_its_table_index() {
        for (i, q) in QuantType::ALL.iter().enumerate() {
            assert_eq!(q.index(), i, "{q:?}");
        }
    }
}
