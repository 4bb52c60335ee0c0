//! kernels/sampling.cu

/// `SampleParams` in kernels/sampling.cu (the cudarc side's is
/// `novainfer_cuda::sample_params::SampleParams`, same fields in the same order).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct SampleParams {
    pub seed: u64,
    pub offset: u64,
    pub inv_temperature: f32,
    pub top_p: f32,
    pub min_p: f32,
    pub top_k: i32,
}
const _: () = assert!(std::mem::size_of::<SampleParams>() == 32);

/// `RowEdit` in kernels/sampling.cu (`novainfer_cuda::sample_params::RowEdit`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct RowEdit {
    pub token_id: u32,
    pub output_count: u32,
    pub flags: u32,
    pub bias: f32,
}
const _: () = assert!(std::mem::size_of::<RowEdit>() == 16);

/// `RowPenalties` in kernels/sampling.cu (`novainfer_cuda::sample_params::RowPenalties`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct RowPenalties {
    pub repetition: f32,
    pub frequency: f32,
    pub presence: f32,
    pub pad: f32,
}
const _: () = assert!(std::mem::size_of::<RowPenalties>() == 16);

extern "C-unwind" {
    pub fn mask_rows_f32(
        logits: *mut f32,
        masks_at: *const i32,
        masks: *const u32,
        words: i32,
        vocab: i32,
    );
    pub fn mask_rows_bf16(
        logits: *mut u16,
        masks_at: *const i32,
        masks: *const u32,
        words: i32,
        vocab: i32,
    );
    pub fn argmax_f32(logits: *const f32, out: *mut u32, vocab: i32);
    pub fn argmax_bf16(logits: *const u16, out: *mut u32, vocab: i32);
    pub fn sample_f32(
        logits: *const f32,
        params: *const SampleParams,
        scratch: *mut f32,
        out: *mut u32,
        vocab: i32,
    );
    pub fn sample_bf16(
        logits: *const u16,
        params: *const SampleParams,
        scratch: *mut f32,
        out: *mut u32,
        vocab: i32,
    );
    pub fn adjust_rows_f32(
        logits: *const f32,
        adjusted: *mut f32,
        offsets: *const i32,
        edits: *const RowEdit,
        penalties: *const RowPenalties,
        vocab: i32,
    );
    pub fn adjust_rows_bf16(
        logits: *const u16,
        adjusted: *mut f32,
        offsets: *const i32,
        edits: *const RowEdit,
        penalties: *const RowPenalties,
        vocab: i32,
    );
    pub fn draw_f32(
        logits: *const f32,
        adjusted: *const f32,
        offsets: *const i32,
        params: *const SampleParams,
        modes: *const i32,
        tops: *const i32,
        scratch: *mut f32,
        ids: *mut u32,
        logprobs: *mut f32,
        top_ids: *mut u32,
        top_lps: *mut f32,
        ranks: *mut u32,
        vocab: i32,
    );
    pub fn draw_bf16(
        logits: *const u16,
        adjusted: *const f32,
        offsets: *const i32,
        params: *const SampleParams,
        modes: *const i32,
        tops: *const i32,
        scratch: *mut f32,
        ids: *mut u32,
        logprobs: *mut f32,
        top_ids: *mut u32,
        top_lps: *mut f32,
        ranks: *mut u32,
        vocab: i32,
    );
}
