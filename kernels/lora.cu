// lora.cu — LoRA updates on the rows of a step, each row with its own adapter (the shape of
// Punica's SGMV, written plainly): shrink t[r, j] = s · Σ_k x[r, k] · A[j, k], then expand
// y[r, offset + c] += Σ_j t[r, j] · Bᵀ[j, c]. Launchers: crates/novainfer-cuda/src/ops/lora.rs;
// CPU twin: crates/novainfer-cuda/src/lora_plan.rs.
//
// Each row names a slot (-1: the base model only). A slot's matrices are f32, the adapter file's
// values exactly (bf16 files widened), found through a table of `LoraPair`s indexed by slot, one
// table per (layer, projection). The scale multiplies t, as on the CPU, so A and B stay as
// stored. Every sum runs in an order fixed by the adapter's shapes (a row's k-stride per lane,
// then the butterfly; j in increasing order), never by the rows in the launch: a row's update
// is the same alone and in any batch (rule 1 of common.cuh).
#include "common.cuh"

// One projection of one resident adapter. Mirrored by `LoraPair` in ops/lora.rs (24 bytes).
struct LoraPair {
    const float* a;   // [rank, in]; null where the adapter leaves this projection alone
    const float* bt;  // [rank, out]: B transposed, so a warp reads consecutive output columns
    int rank;
    float scale;
};

#define LORA_SHRINK_WARPS 4
#define LORA_EXPAND_THREADS 256

// grid (rows, ceil(max_rank / LORA_SHRINK_WARPS)), LORA_SHRINK_WARPS warps: warp w of block
// (r, b) computes t[r, b * LORA_SHRINK_WARPS + w]. Rows without an adapter, and ranks past a
// row's adapter's, get 0 (the expand never reads them; zeros keep t deterministic).
template <typename T>
__device__ void lora_shrink(
    const T* __restrict__ x,           // [rows, in_features]
    const i32* __restrict__ row_slot,  // [rows]
    const LoraPair* __restrict__ pairs,  // [num_slots]
    float* __restrict__ t,             // [rows, max_rank]
    int in_features,
    int num_slots,
    int max_rank) {
    const int r = blockIdx.x;
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const int j = blockIdx.y * LORA_SHRINK_WARPS + warp;
    if (j >= max_rank) {
        return;
    }
    float* out = t + (i64)r * max_rank + j;
    const i32 slot = row_slot[r];
    if (slot < 0 || slot >= num_slots) {
        if (lane == 0) *out = 0.0f;
        return;
    }
    const LoraPair p = pairs[slot];
    if (p.a == nullptr || j >= p.rank) {
        if (lane == 0) *out = 0.0f;
        return;
    }
    const T* xr = x + (i64)r * in_features;
    const float* aj = p.a + (i64)j * in_features;
    float acc = 0.0f;
    for (int k = lane; k < in_features; k += WARP_SIZE) {
        acc += load_f32(xr, k) * aj[k];
    }
    acc = warp_sum(acc);
    if (lane == 0) *out = p.scale * acc;
}

// grid (rows, ceil(out_features / LORA_EXPAND_THREADS)): thread c of block (r, b) adds row r's
// update to column offset + b * LORA_EXPAND_THREADS + c of y (row stride y_stride: a column
// range of a fused q|k|v or gate|up output). Rows go on x, whose limit is 2^31 - 1, not y's
// 65,535: a step's rows are its batched tokens, which may exceed that.
template <typename T>
__device__ void lora_expand(
    const float* __restrict__ t,       // [rows, max_rank]
    const i32* __restrict__ row_slot,  // [rows]
    const LoraPair* __restrict__ pairs,  // [num_slots]
    T* __restrict__ y,                 // [rows, y_stride]
    int out_features,
    int y_stride,
    int offset,
    int num_slots,
    int max_rank) {
    const int r = blockIdx.x;
    const int c = blockIdx.y * LORA_EXPAND_THREADS + threadIdx.x;
    const i32 slot = row_slot[r];
    if (c >= out_features || slot < 0 || slot >= num_slots) {
        return;
    }
    const LoraPair p = pairs[slot];
    if (p.a == nullptr) {
        return;
    }
    const float* tr = t + (i64)r * max_rank;
    float acc = 0.0f;
    // t holds max_rank numbers a row; the model sizes it for every resident rank, and this bound keeps a
    // larger one from reading the next row's.
    const int rank = min(p.rank, max_rank);
    for (int j = 0; j < rank; ++j) {
        acc += tr[j] * p.bt[(i64)j * out_features + c];
    }
    const i64 at = (i64)r * y_stride + offset + c;
    store_f32(y, at, load_f32(y, at) + acc);
}

extern "C" __global__ void lora_shrink_f32(const float* x, const i32* row_slot, const LoraPair* pairs,
                                           float* t, int in_features, int num_slots, int max_rank) {
    lora_shrink(x, row_slot, pairs, t, in_features, num_slots, max_rank);
}

extern "C" __global__ void lora_shrink_bf16(const bf16* x, const i32* row_slot, const LoraPair* pairs,
                                            float* t, int in_features, int num_slots, int max_rank) {
    lora_shrink(x, row_slot, pairs, t, in_features, num_slots, max_rank);
}

extern "C" __global__ void lora_expand_f32(const float* t, const i32* row_slot, const LoraPair* pairs,
                                           float* y, int out_features, int y_stride, int offset,
                                           int num_slots, int max_rank) {
    lora_expand(t, row_slot, pairs, y, out_features, y_stride, offset, num_slots, max_rank);
}

extern "C" __global__ void lora_expand_bf16(const float* t, const i32* row_slot, const LoraPair* pairs,
                                            bf16* y, int out_features, int y_stride, int offset,
                                            int num_slots, int max_rank) {
    lora_expand(t, row_slot, pairs, y, out_features, y_stride, offset, num_slots, max_rank);
}
