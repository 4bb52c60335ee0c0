// rope.cu — rotary position embedding, neox style (Qwen2), applied in place to q and k.
// Launcher: crates/novainfer-cuda/src/ops/rope.rs.
//
// Dimension i of a head is rotated together with i + head_dim/2:
//   lo' = lo·cos − hi·sin,   hi' = hi·cos + lo·sin
// cos/sin come from a table the launcher builds on the host with the CPU's own formula
// (angle = pos · θ^(−2i/head_dim) in f64, then rounded to f32), and the products are
// written with explicit round-to-nearest intrinsics (`rope_rotate` in common.cuh, shared with
// qkv.cu) so the compiler cannot contract them into FMAs: in f32 the result is bit-identical
// to the CPU's `Rope::apply`.
//
// One block per token; threads walk the (head, i) pairs of q then k. Element-wise.
// A position outside the table leaves the row unrotated rather than reading out of bounds; the
// runner checks positions on the host first (novainfer_cuda::validate), so this never fires
// in a correct run.
#include "common.cuh"

template <typename T>
__device__ __forceinline__ void rotate_head(T* head, const float* cos, const float* sin, int i,
                                            int half) {
    const float lo = load_f32(head, i);
    const float hi = load_f32(head, i + half);
    float out_lo, out_hi;
    rope_rotate(lo, hi, cos[i], sin[i], out_lo, out_hi);
    store_f32(head, i, out_lo);
    store_f32(head, i + half, out_hi);
}

template <typename T>
__device__ void rope_neox(
    T* __restrict__ q,                  // [num_tokens, num_heads · head_dim]
    T* __restrict__ k,                  // [num_tokens, num_kv_heads · head_dim]
    const i32* __restrict__ positions,  // [num_tokens]
    const float* __restrict__ cos_sin,  // [max_positions, head_dim]: cos (half) | sin (half)
    int num_heads,
    int num_kv_heads,
    int head_dim,
    int max_positions) {
    const i64 token = blockIdx.x;
    const i32 pos = positions[token];
    if (pos < 0 || pos >= max_positions) return;
    const int half = head_dim / 2;
    const float* cos = cos_sin + (i64)pos * head_dim;
    const float* sin = cos + half;
    T* q_row = q + token * num_heads * head_dim;
    T* k_row = k + token * num_kv_heads * head_dim;
    for (int j = threadIdx.x; j < num_heads * half; j += blockDim.x) {
        rotate_head(q_row + (j / half) * head_dim, cos, sin, j % half, half);
    }
    for (int j = threadIdx.x; j < num_kv_heads * half; j += blockDim.x) {
        rotate_head(k_row + (j / half) * head_dim, cos, sin, j % half, half);
    }
}

extern "C" __global__ void rope_neox_f32(float* q, float* k, const i32* positions,
                                         const float* cos_sin, int num_heads, int num_kv_heads,
                                         int head_dim, int max_positions) {
    rope_neox(q, k, positions, cos_sin, num_heads, num_kv_heads, head_dim, max_positions);
}

extern "C" __global__ void rope_neox_bf16(bf16* q, bf16* k, const i32* positions,
                                          const float* cos_sin, int num_heads, int num_kv_heads,
                                          int head_dim, int max_positions) {
    rope_neox(q, k, positions, cos_sin, num_heads, num_kv_heads, head_dim, max_positions);
}
