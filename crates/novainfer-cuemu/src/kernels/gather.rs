//! kernels/gather.cu

extern "C-unwind" {
    pub fn gather_rows_f32(
        x: *const f32,
        rows: *const i32,
        out: *mut f32,
        d: i32,
        num_src_rows: i32,
    );
    pub fn gather_rows_bf16(
        x: *const u16,
        rows: *const i32,
        out: *mut u16,
        d: i32,
        num_src_rows: i32,
    );
    pub fn gather_columns_f32(x: *const f32, order: *const u32, out: *mut f32, d: i32);
    pub fn gather_columns_bf16(x: *const u16, order: *const u32, out: *mut u16, d: i32);
    pub fn chain_tokens(
        drawn: *const u32,
        pairs: *const i32,
        token_ids: *mut u32,
        count: i32,
        drawn_rows: i32,
        num_tokens: i32,
    );
}
