//! kernels/qkv.cu

extern "C-unwind" {
    pub fn qkv_bias_rope_cache_f32(
        qkv: *const f32,
        bias: *const f32,
        positions: *const i32,
        slot_mapping: *const i64,
        cos_sin: *const f32,
        q_out: *mut f32,
        k_cache: *mut f32,
        v_cache: *mut f32,
        num_heads: i32,
        num_kv_heads: i32,
        head_dim: i32,
        max_positions: i32,
        num_slots: i64,
    );
    pub fn qkv_bias_rope_cache_bf16(
        qkv: *const u16,
        bias: *const f32,
        positions: *const i32,
        slot_mapping: *const i64,
        cos_sin: *const f32,
        q_out: *mut u16,
        k_cache: *mut u16,
        v_cache: *mut u16,
        num_heads: i32,
        num_kv_heads: i32,
        head_dim: i32,
        max_positions: i32,
        num_slots: i64,
    );
}
