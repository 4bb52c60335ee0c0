//! kernels/paged_attention.cu

/// `AttnShape` in kernels/paged_attention.cu (and its mirror in
/// `novainfer_cuda::ops::paged_attention`), passed by value.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct AttnShape {
    pub num_heads: i32,
    pub num_kv_heads: i32,
    pub block_size: i32,
    pub num_blocks: i32,
    /// Row stride of `block_tables`.
    pub max_blocks_per_seq: i32,
    /// Split stride of the decode scratch.
    pub max_splits: i32,
    pub scale: f32,
}
const _: () = assert!(std::mem::size_of::<AttnShape>() == 28);

/// The four kernels `ATTENTION_KERNELS(T, SUFFIX, HD)` defines for one dtype and head dim.
macro_rules! attention_kernels {
    ($t:ty, $decode:ident, $grouped:ident, $merge:ident, $prefill:ident) => {
        extern "C-unwind" {
            pub fn $decode(
                q: *const $t,
                k_cache: *const $t,
                v_cache: *const $t,
                block_tables: *const i32,
                seq_lens: *const i32,
                part_acc: *mut f32,
                part_ml: *mut f32,
                shape: AttnShape,
            );
            pub fn $grouped(
                q: *const $t,
                k_cache: *const $t,
                v_cache: *const $t,
                block_tables: *const i32,
                seq_lens: *const i32,
                part_acc: *mut f32,
                part_ml: *mut f32,
                shape: AttnShape,
            );
            pub fn $merge(
                seq_lens: *const i32,
                part_acc: *const f32,
                part_ml: *const f32,
                out: *mut $t,
                shape: AttnShape,
            );
            pub fn $prefill(
                q: *const $t,
                k_cache: *const $t,
                v_cache: *const $t,
                block_tables: *const i32,
                seq_lens: *const i32,
                query_start_loc: *const i32,
                positions: *const i32,
                out: *mut $t,
                num_tokens: i32,
                num_seqs: i32,
                shape: AttnShape,
            );
        }
    };
}

attention_kernels!(
    f32,
    paged_attention_decode_f32_hd64,
    paged_attention_decode_grouped_f32_hd64,
    paged_attention_merge_f32_hd64,
    paged_attention_prefill_f32_hd64
);
attention_kernels!(
    f32,
    paged_attention_decode_f32_hd128,
    paged_attention_decode_grouped_f32_hd128,
    paged_attention_merge_f32_hd128,
    paged_attention_prefill_f32_hd128
);
attention_kernels!(
    u16,
    paged_attention_decode_bf16_hd64,
    paged_attention_decode_grouped_bf16_hd64,
    paged_attention_merge_bf16_hd64,
    paged_attention_prefill_bf16_hd64
);
attention_kernels!(
    u16,
    paged_attention_decode_bf16_hd128,
    paged_attention_decode_grouped_bf16_hd128,
    paged_attention_merge_bf16_hd128,
    paged_attention_prefill_bf16_hd128
);
attention_kernels!(
    u16,
    paged_attention_decode_bf16_hd256,
    paged_attention_decode_grouped_bf16_hd256,
    paged_attention_merge_bf16_hd256,
    paged_attention_prefill_bf16_hd256
);
