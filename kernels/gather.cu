// gather.cu — picks rows of a matrix: out[i] = x[rows[i]] (the rows to sample before the
// final norm and the LM head), or its columns in a given order. Launcher:
// crates/novainfer-cuda/src/ops/gather.rs.
//
// One block per output row, a straight copy: batch invariance does not arise. A row index
// outside x gives a zero row instead of an out-of-bounds read (the runner builds the indices
// on the host from the batch it scheduled, so this never fires in a correct run).
#include "common.cuh"

template <typename T>
__device__ void gather_rows(
    const T* __restrict__ x,      // [num_src_rows, d]
    const i32* __restrict__ rows, // [num_out_rows]
    T* __restrict__ out,          // [num_out_rows, d]
    int d,
    int num_src_rows) {
    const i64 i = blockIdx.x;
    const i32 r = rows[i];
    const bool valid = r >= 0 && r < num_src_rows;
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        out[i * d + c] = valid ? x[(i64)r * d + c] : (T)0;
    }
}

extern "C" __global__ void gather_rows_f32(const float* x, const i32* rows, float* out, int d,
                                           int num_src_rows) {
    gather_rows(x, rows, out, d, num_src_rows);
}

extern "C" __global__ void gather_rows_bf16(const bf16* x, const i32* rows, bf16* out, int d,
                                            int num_src_rows) {
    gather_rows(x, rows, out, d, num_src_rows);
}

// A matrix's input in the order its columns are stored: out[r, j] = x[r, order[j]] (GPTQ
// act-order keeps its int4 columns sorted by group; the CPU permutes its input the same way,
// layers/linear.rs). One block per row. The loader checks that `order` is a permutation of
// 0..d; an index outside the row gives zero rather than an out-of-bounds read.
template <typename T>
__device__ void gather_columns(
    const T* __restrict__ x,        // [rows, d]
    const u32* __restrict__ order,  // [d]
    T* __restrict__ out,            // [rows, d]
    int d) {
    const i64 r = blockIdx.x;
    for (int j = threadIdx.x; j < d; j += blockDim.x) {
        const u32 c = order[j];
        out[r * d + j] = c < (u32)d ? x[r * d + c] : (T)0;
    }
}

extern "C" __global__ void gather_columns_f32(const float* x, const u32* order, float* out, int d) {
    gather_columns(x, order, out, d);
}

extern "C" __global__ void gather_columns_bf16(const bf16* x, const u32* order, bf16* out, int d) {
    gather_columns(x, order, out, d);
}

// A step's input tokens that the step enqueued before it drew, taken on the device (async
// scheduling: the host enqueues step N + 1 before it reads N's tokens back). pairs[2i] is a
// token row of this step, pairs[2i + 1] a sampled row of the step before, whose drawn id is
// still in `drawn`. Launcher: ops/gather.rs::chain_tokens. The host validates the pairs; one
// outside either buffer is skipped rather than read or written out of bounds.
extern "C" __global__ void chain_tokens(const u32* __restrict__ drawn, const i32* __restrict__ pairs,
                                        u32* __restrict__ token_ids, int count, int drawn_rows,
                                        int num_tokens) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < count; i += gridDim.x * blockDim.x) {
        const i32 to = pairs[2 * i], from = pairs[2 * i + 1];
        if (to < 0 || to >= num_tokens || from < 0 || from >= drawn_rows) continue;
        token_ids[to] = drawn[from];
    }
}
