//! kernels/embedding.cu

extern "C-unwind" {
    pub fn embedding_gather_bf16(
        token_ids: *const u32,
        table: *const u16,
        out: *mut u16,
        hidden: i32,
        vocab_size: i32,
    );
    pub fn embedding_gather_f32(
        token_ids: *const u32,
        table: *const u16,
        out: *mut f32,
        hidden: i32,
        vocab_size: i32,
    );
}
