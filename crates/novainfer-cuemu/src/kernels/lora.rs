//! kernels/lora.cu

/// `LoraPair` in kernels/lora.cu (and `lora_plan::LoraPair` on the cudarc side): two device
/// addresses (`a`: `[rank, in]`, `bt`: `[rank, out]`, f32; 0 where the adapter leaves the
/// projection alone), the rank and the scale. The kernels read an array of them by pointer.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct LoraPair {
    pub a: u64,
    pub bt: u64,
    pub rank: i32,
    pub scale: f32,
}
// Two 8-byte pointers, an int and a float: 24 bytes on both sides.
const _: () = assert!(std::mem::size_of::<LoraPair>() == 24);
const _: () = assert!(std::mem::align_of::<LoraPair>() == 8);

extern "C-unwind" {
    pub fn lora_shrink_f32(
        x: *const f32,
        row_slot: *const i32,
        pairs: *const LoraPair,
        t: *mut f32,
        in_features: i32,
        num_slots: i32,
        max_rank: i32,
    );
    pub fn lora_shrink_bf16(
        x: *const u16,
        row_slot: *const i32,
        pairs: *const LoraPair,
        t: *mut f32,
        in_features: i32,
        num_slots: i32,
        max_rank: i32,
    );
    pub fn lora_expand_f32(
        t: *const f32,
        row_slot: *const i32,
        pairs: *const LoraPair,
        y: *mut f32,
        out_features: i32,
        y_stride: i32,
        offset: i32,
        num_slots: i32,
        max_rank: i32,
    );
    pub fn lora_expand_bf16(
        t: *const f32,
        row_slot: *const i32,
        pairs: *const LoraPair,
        y: *mut u16,
        out_features: i32,
        y_stride: i32,
        offset: i32,
        num_slots: i32,
        max_rank: i32,
    );
}
