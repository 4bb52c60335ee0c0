//! kernels/rope.cu

extern "C-unwind" {
    pub fn rope_neox_f32(
        q: *mut f32,
        k: *mut f32,
        positions: *const i32,
        cos_sin: *const f32,
        num_heads: i32,
        num_kv_heads: i32,
        head_dim: i32,
        max_positions: i32,
    );
    pub fn rope_neox_bf16(
        q: *mut u16,
        k: *mut u16,
        positions: *const i32,
        cos_sin: *const f32,
        num_heads: i32,
        num_kv_heads: i32,
        head_dim: i32,
        max_positions: i32,
    );
}
