// reshape_and_cache.cu — writes the new tokens' K and V rows into the paged KV pool.
// Launcher: crates/novainfer-cuda/src/ops/reshape_and_cache.rs.
//
// The pool layout is row-major, as the CPU pool's was before it tiled its keys (the CPU now keeps
// f32/f16/bf16 keys in tiles of 16 slots; the GPU does not: its decode kernels load whole rows):
//
//   k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
//   slot = block_table[pos / block_size] · block_size + pos % block_size
//   row of a slot = num_kv_heads · head_dim contiguous values
//
// A negative slot skips the token: decode batches padded up to a CUDA-graph bucket carry
// padding tokens that must not write anywhere (vLLM's convention). One block per token.
#include "common.cuh"

template <typename T>
__device__ void reshape_and_cache(
    const T* __restrict__ k,                 // [num_tokens, row]
    const T* __restrict__ v,                 // [num_tokens, row]
    T* __restrict__ k_cache,                 // [num_slots, row]
    T* __restrict__ v_cache,                 // [num_slots, row]
    const i64* __restrict__ slot_mapping,    // [num_tokens]
    int row,
    i64 num_slots) {
    const i64 token = blockIdx.x;
    const i64 slot = slot_mapping[token];
    if (slot < 0 || slot >= num_slots) return;
    for (int i = threadIdx.x; i < row; i += blockDim.x) {
        k_cache[slot * row + i] = k[token * row + i];
        v_cache[slot * row + i] = v[token * row + i];
    }
}

extern "C" __global__ void reshape_and_cache_f32(const float* k, const float* v, float* k_cache,
                                                 float* v_cache, const i64* slot_mapping,
                                                 int row, i64 num_slots) {
    reshape_and_cache(k, v, k_cache, v_cache, slot_mapping, row, num_slots);
}

extern "C" __global__ void reshape_and_cache_bf16(const bf16* k, const bf16* v, bf16* k_cache,
                                                  bf16* v_cache, const i64* slot_mapping,
                                                  int row, i64 num_slots) {
    reshape_and_cache(k, v, k_cache, v_cache, slot_mapping, row, num_slots);
}
