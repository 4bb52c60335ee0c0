//! kernels/rms_norm.cu

extern "C-unwind" {
    pub fn rms_norm_f32(x: *const f32, weight: *const f32, out: *mut f32, dim: i32, eps: f32);
    pub fn rms_norm_bf16(x: *const u16, weight: *const f32, out: *mut u16, dim: i32, eps: f32);
    pub fn add_rms_norm_f32(
        x: *const f32,
        residual: *mut f32,
        weight: *const f32,
        out: *mut f32,
        dim: i32,
        eps: f32,
    );
    pub fn add_rms_norm_bf16(
        x: *const u16,
        residual: *mut u16,
        weight: *const f32,
        out: *mut u16,
        dim: i32,
        eps: f32,
    );
}
