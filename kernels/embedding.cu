// embedding.cu — token embedding gather from a bf16 table.
// Launcher: crates/novainfer-cuda/src/ops/embedding.rs.
//
// One block per token; threads copy the row in strides of blockDim. No arithmetic beyond a
// dtype conversion, so batch invariance is trivial. An id outside the vocabulary yields a
// zero row instead of reading out of bounds (the runner validates ids on the host first).
#include "common.cuh"

template <typename T>
__device__ void embedding_gather(
    const u32* __restrict__ token_ids,  // [num_tokens]
    const bf16* __restrict__ table,     // [vocab_size, hidden]
    T* __restrict__ out,                // [num_tokens, hidden]
    int hidden,
    int vocab_size) {
    const i64 token = blockIdx.x;
    const u32 id = token_ids[token];
    const bool valid = id < (u32)vocab_size;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        float v = valid ? bf16_to_f32(table[(i64)id * hidden + i]) : 0.0f;
        store_f32(out, token * hidden + i, v);
    }
}

extern "C" __global__ void embedding_gather_bf16(
    const u32* token_ids, const bf16* table, bf16* out, int hidden, int vocab_size) {
    embedding_gather(token_ids, table, out, hidden, vocab_size);
}

extern "C" __global__ void embedding_gather_f32(
    const u32* token_ids, const bf16* table, float* out, int hidden, int vocab_size) {
    embedding_gather(token_ids, table, out, hidden, vocab_size);
}
