// qkv.cu — the step after the fused QKV projection: bias, rotary embedding, KV-cache write.
// Launcher: crates/novainfer-cuda/src/ops/qkv.rs.
//
// Input row t of the fused GEMM output holds H query heads, then KVH key heads, then KVH value
// heads, head_dim D each: [T, (H + 2·KVH)·D]. For each token:
//
//   x = qkv[t] + bias                      (f32; bias optional)
//   q heads, k heads: neox RoPE at positions[t]   (rope_rotate, the same table and rounding as
//                                                  rope.cu, so f32 equals the CPU's Rope::apply)
//   q_out[t]                 = rotated q          [T, H·D]
//   k_cache[slot_mapping[t]] = rotated k          [num_slots, KVH·D]
//   v_cache[slot_mapping[t]] = v                  [num_slots, KVH·D]
//
// The value is rounded to T once, on store (the unfused path rounds after the bias add too).
// A negative slot is a padding token of a graph bucket: its k and v go nowhere (vLLM's
// convention), and so does a slot past the pool (a runner bug; host validation catches it).
// A position outside the RoPE table leaves q and k unrotated instead of reading out of
// bounds, like rope.cu. One block per token; element-wise, so batch invariant.
#include "common.cuh"

template <typename T>
__device__ __forceinline__ float biased(const T* row, const float* bias, int i) {
    const float x = load_f32(row, i);
    return bias ? __fadd_rn(x, bias[i]) : x;
}

template <typename T>
__device__ void qkv_bias_rope_cache(
    const T* __restrict__ qkv,            // [num_tokens, (num_heads + 2·num_kv_heads)·head_dim]
    const float* __restrict__ bias,       // [(num_heads + 2·num_kv_heads)·head_dim] or null
    const i32* __restrict__ positions,    // [num_tokens]
    const i64* __restrict__ slot_mapping, // [num_tokens]
    const float* __restrict__ cos_sin,    // [max_positions, head_dim]: cos (half) | sin (half)
    T* __restrict__ q_out,                // [num_tokens, num_heads·head_dim]
    T* __restrict__ k_cache,              // [num_slots, num_kv_heads·head_dim]
    T* __restrict__ v_cache,              // [num_slots, num_kv_heads·head_dim]
    int num_heads,
    int num_kv_heads,
    int head_dim,
    int max_positions,
    i64 num_slots) {
    const i64 token = blockIdx.x;
    const int half = head_dim / 2;
    const int q_len = num_heads * head_dim;
    const int kv_len = num_kv_heads * head_dim;
    const T* row = qkv + token * (q_len + 2 * kv_len);
    const i32 pos = positions[token];
    const bool rotate = pos >= 0 && pos < max_positions;
    const float* cos = cos_sin + (rotate ? (i64)pos * head_dim : 0);
    const float* sin = cos + half;

    T* q_row = q_out + token * q_len;
    for (int j = threadIdx.x; j < num_heads * half; j += blockDim.x) {
        const int i = (j / half) * head_dim + j % half;
        float lo = biased(row, bias, i);
        float hi = biased(row, bias, i + half);
        if (rotate) rope_rotate(lo, hi, cos[j % half], sin[j % half], lo, hi);
        store_f32(q_row, i, lo);
        store_f32(q_row, i + half, hi);
    }

    const i64 slot = slot_mapping[token];
    if (slot < 0 || slot >= num_slots) return;
    T* k_row = k_cache + slot * kv_len;
    T* v_row = v_cache + slot * kv_len;
    for (int j = threadIdx.x; j < num_kv_heads * half; j += blockDim.x) {
        const int i = (j / half) * head_dim + j % half;
        float lo = biased(row, bias, q_len + i);
        float hi = biased(row, bias, q_len + i + half);
        if (rotate) rope_rotate(lo, hi, cos[j % half], sin[j % half], lo, hi);
        store_f32(k_row, i, lo);
        store_f32(k_row, i + half, hi);
    }
    for (int i = threadIdx.x; i < kv_len; i += blockDim.x) {
        store_f32(v_row, i, biased(row, bias, q_len + kv_len + i));
    }
}

#define QKV_KERNEL(T, SUFFIX)                                                                 \
    extern "C" __global__ void qkv_bias_rope_cache_##SUFFIX(                                  \
        const T* qkv, const float* bias, const i32* positions, const i64* slot_mapping,       \
        const float* cos_sin, T* q_out, T* k_cache, T* v_cache, int num_heads,                \
        int num_kv_heads, int head_dim, int max_positions, i64 num_slots) {                   \
        qkv_bias_rope_cache(qkv, bias, positions, slot_mapping, cos_sin, q_out, k_cache,      \
                            v_cache, num_heads, num_kv_heads, head_dim, max_positions,        \
                            num_slots);                                                       \
    }

QKV_KERNEL(float, f32)
QKV_KERNEL(bf16, bf16)
