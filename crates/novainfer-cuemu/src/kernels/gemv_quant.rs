//! kernels/gemv_quant.cu

/// `GEMV_MAX_PARTS` in kernels/gemv_quant.cu.
pub const MAX_PARTS: usize = 4;

/// `GemvPart` in kernels/gemv_quant.cu: a run of rows in one format (`GEMV_Q4_K` .. `GEMV_BF16W`,
/// `gemv_plan::GemvWeights::index`), `end` one past its last row over the whole matrix.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct GemvPart {
    pub w: *const u8,
    pub format: i32,
    pub end: i32,
}

/// `GemvParts` in kernels/gemv_quant.cu (the launcher's `PartsArg`), passed by value.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct GemvParts {
    pub part: [GemvPart; MAX_PARTS],
    pub count: i32,
}

// The launcher's `PartsArg` asserts the same sizes: a pointer, two ints; four of them and the count.
const _: () = assert!(std::mem::size_of::<GemvPart>() == 16);
const _: () = assert!(std::mem::size_of::<GemvParts>() == 16 * MAX_PARTS + 8);

// SAFETY: the pointers are host memory the test keeps alive across the launch; the emulated
// threads only read through them.
unsafe impl Sync for GemvParts {}
unsafe impl Send for GemvParts {}

macro_rules! gemv_kernels {
    ($t:ty, $plain:ident, $silu:ident, $qkv:ident) => {
        extern "C-unwind" {
            pub fn $plain(
                w: GemvParts,
                x: *const u16,
                y: *mut $t,
                rows: i32,
                k: i32,
                n: i32,
                ld: i32,
                col0: i32,
            );
            pub fn $silu(w: GemvParts, x: *const u16, out: *mut $t, f: i32, k: i32, n: i32);
            pub fn $qkv(
                w: GemvParts,
                x: *const u16,
                bias: *const f32,
                positions: *const i32,
                slot_mapping: *const i64,
                cos_sin: *const f32,
                q_out: *mut $t,
                k_cache: *mut $t,
                v_cache: *mut $t,
                num_heads: i32,
                num_kv_heads: i32,
                head_dim: i32,
                k: i32,
                n: i32,
                max_positions: i32,
                num_slots: i64,
            );
        }
    };
}

gemv_kernels!(
    f32,
    gemv_packed_f32,
    gemv_silu_packed_f32,
    gemv_qkv_packed_f32
);
gemv_kernels!(
    u16,
    gemv_packed_bf16,
    gemv_silu_packed_bf16,
    gemv_qkv_packed_bf16
);
gemv_kernels!(f32, gemv_bf16w_f32, gemv_silu_bf16w_f32, gemv_qkv_bf16w_f32);
gemv_kernels!(
    u16,
    gemv_bf16w_bf16,
    gemv_silu_bf16w_bf16,
    gemv_qkv_bf16w_bf16
);

macro_rules! gemm_kernels {
    ($t:ty, $tile:ident, $reduce:ident) => {
        extern "C-unwind" {
            pub fn $tile(
                w: GemvParts,
                x: *const u16,
                y: *mut $t,
                partial: *mut f32,
                rows: i32,
                k: i32,
                m: i32,
                ld: i32,
                col0: i32,
                k_split: i32,
            );
            pub fn $reduce(
                partial: *const f32,
                y: *mut $t,
                rows: i32,
                m: i32,
                splits: i32,
                ld: i32,
                col0: i32,
            );
        }
    };
}

gemm_kernels!(f32, gemm_packed_f32, gemm_packed_reduce_f32);
gemm_kernels!(u16, gemm_packed_bf16, gemm_packed_reduce_bf16);
