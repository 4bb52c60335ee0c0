//! kernels/reshape_and_cache.cu

extern "C-unwind" {
    pub fn reshape_and_cache_f32(
        k: *const f32,
        v: *const f32,
        k_cache: *mut f32,
        v_cache: *mut f32,
        slot_mapping: *const i64,
        row: i32,
        num_slots: i64,
    );
    pub fn reshape_and_cache_bf16(
        k: *const u16,
        v: *const u16,
        k_cache: *mut u16,
        v_cache: *mut u16,
        slot_mapping: *const i64,
        row: i32,
        num_slots: i64,
    );
}
