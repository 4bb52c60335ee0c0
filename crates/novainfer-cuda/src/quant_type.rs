//! The quantized block formats the device runs, shared by the launchers (`ops::dequant`,
//! `ops::gemv_quant`, `gemv_plan::GemvWeights`) and the CPU twins, which build without CUDA: the GGUF types of the demo
//! models, AWQ/GPTQ grouped int4 (`novainfer_model::int4`'s blocks: an f32 scale, a u8
//! zero point and 128 nibbles) and FP8 e4m3 (`novainfer_model::fp8_blocks`: an f32 scale and
//! 128 codes).

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantType {
    Q4K,
    Q5_0,
    Q6K,
    Q8_0,
    Int4,
    Fp8,
}

impl QuantType {
    /// In the order of the context's dequant table ([`Self::index`]).
    pub const ALL: [QuantType; 6] = [
        QuantType::Q4K,
        QuantType::Q5_0,
        QuantType::Q6K,
        QuantType::Q8_0,
        QuantType::Int4,
        QuantType::Fp8,
    ];

    pub fn index(self) -> usize {
        match self {
            QuantType::Q4K => 0,
            QuantType::Q5_0 => 1,
            QuantType::Q6K => 2,
            QuantType::Q8_0 => 3,
            QuantType::Int4 => 4,
            QuantType::Fp8 => 5,
        }
    }

    pub fn block_bytes(self) -> usize {
        match self {
            QuantType::Q4K => 144,
            QuantType::Q5_0 => 22,
            QuantType::Q6K => 210,
            QuantType::Q8_0 => 34,
            QuantType::Int4 => 4 + 1 + 64,
            QuantType::Fp8 => 4 + 128,
        }
    }

    pub fn block_values(self) -> usize {
        match self {
            QuantType::Q4K | QuantType::Q6K => 256,
            QuantType::Q5_0 | QuantType::Q8_0 => 32,
            QuantType::Int4 | QuantType::Fp8 => 128,
        }
    }

    pub fn kernel_base(self) -> &'static str {
        match self {
            QuantType::Q4K => "dequant_q4_k",
            QuantType::Q5_0 => "dequant_q5_0",
            QuantType::Q6K => "dequant_q6_k",
            QuantType::Q8_0 => "dequant_q8_0",
            QuantType::Int4 => "dequant_int4",
            QuantType::Fp8 => "dequant_fp8",
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
            QuantType::Fp8 => "embed_fp8",
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

/// An `e4m3fn` code's value, exactly (the OCP FP8 format of every FP8 checkpoint: sign, 4
/// exponent bits biased by 7, 3 mantissa bits, no infinities; `S.1111.111` is NaN).
pub fn e4m3_to_f32(code: u8) -> f32 {
    let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
    let (exp, man) = (i32::from((code >> 3) & 0xF), f32::from(code & 7));
    match (exp, code & 7) {
        (15, 7) => f32::NAN,
        (0, _) => sign * man / 8.0 * (-6f32).exp2(),
        _ => sign * (1.0 + man / 8.0) * ((exp - 7) as f32).exp2(),
    }
}

/// The kernels' decoding of an e4m3 code (`e4m3_value` in common.cuh): the code's exponent and
/// mantissa bits moved into an f32 (whose exponent bias is 120 more), then scaled by 2^120,
/// exactly; subnormal codes become f32 subnormals, which the kernels keep (they are compiled
/// without flush-to-zero). Equals [`e4m3_to_f32`] for every code but the two NaNs, which no
/// block holds (the loaders refuse them).
pub fn e4m3_by_bits(code: u8) -> f32 {
    let bits = (u32::from(code & 0x80) << 24) | (u32::from(code & 0x7F) << 20);
    f32::from_bits(bits) * f32::from_bits(0x7B80_0000)
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

    #[test]
    fn the_kernels_e4m3_decoding_is_the_formats_value_for_every_finite_code() {
        assert_eq!(f32::from_bits(0x7B80_0000), 2f32.powi(120));
        for code in 0..=255u8 {
            let want = e4m3_to_f32(code);
            if want.is_nan() {
                assert!(code & 0x7F == 0x7F, "{code:#x}");
                continue;
            }
            assert_eq!(e4m3_by_bits(code).to_bits(), want.to_bits(), "{code:#04x}");
        }
        // The extremes: the largest value, the smallest subnormal, and negative zero's sign.
        assert_eq!(e4m3_to_f32(0x7E), 448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert!(e4m3_by_bits(0x80).is_sign_negative());
    }
}
