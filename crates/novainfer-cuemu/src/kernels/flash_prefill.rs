//! kernels/flash_prefill.cu

/// `FlashShape` in kernels/flash_prefill.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct FlashShape {
    pub num_heads: i32,
    pub num_kv_heads: i32,
    pub block_size: i32,
    pub num_blocks: i32,
    pub max_blocks_per_seq: i32,
    pub scale_log2: f32,
}

extern "C-unwind" {
    pub fn flash_prefill_bf16_hd64(
        q: *const u16,
        k_cache: *const u16,
        v_cache: *const u16,
        block_tables: *const i32,
        seq_lens: *const i32,
        query_start_loc: *const i32,
        positions: *const i32,
        out: *mut u16,
        num_tokens: i32,
        num_seqs: i32,
        shape: FlashShape,
    );
    pub fn flash_prefill_bf16_hd128(
        q: *const u16,
        k_cache: *const u16,
        v_cache: *const u16,
        block_tables: *const i32,
        seq_lens: *const i32,
        query_start_loc: *const i32,
        positions: *const i32,
        out: *mut u16,
        num_tokens: i32,
        num_seqs: i32,
        shape: FlashShape,
    );
}
