//! kernels/silu_mul.cu

extern "C-unwind" {
    pub fn silu_mul_f32(
        gate: *const f32,
        up: *const f32,
        out: *mut f32,
        d: i32,
        in_stride: i32,
        num_elems: i64,
    );
    pub fn silu_mul_bf16(
        gate: *const u16,
        up: *const u16,
        out: *mut u16,
        d: i32,
        in_stride: i32,
        num_elems: i64,
    );
}
