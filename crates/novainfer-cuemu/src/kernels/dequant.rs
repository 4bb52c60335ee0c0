//! kernels/dequant.cu

macro_rules! dequant_kernels {
    ($t:ty, $($dequant:ident, $embed:ident);* $(;)?) => {
        extern "C-unwind" {
            $(
                pub fn $dequant(blocks: *const u8, out: *mut $t, num_blocks: i64);
                pub fn $embed(
                    token_ids: *const u32,
                    blocks: *const u8,
                    out: *mut $t,
                    hidden: i32,
                    vocab_size: i32,
                );
            )*
        }
    };
}

dequant_kernels!(f32,
    dequant_q8_0_f32, embed_q8_0_f32;
    dequant_q5_0_f32, embed_q5_0_f32;
    dequant_q4_k_f32, embed_q4_k_f32;
    dequant_q6_k_f32, embed_q6_k_f32;
    dequant_int4_f32, embed_int4_f32;
    dequant_fp8_f32, embed_fp8_f32;
);
dequant_kernels!(u16,
    dequant_q8_0_bf16, embed_q8_0_bf16;
    dequant_q5_0_bf16, embed_q5_0_bf16;
    dequant_q4_k_bf16, embed_q4_k_bf16;
    dequant_q6_k_bf16, embed_q6_k_bf16;
    dequant_int4_bf16, embed_int4_bf16;
    dequant_fp8_bf16, embed_fp8_bf16;
);
