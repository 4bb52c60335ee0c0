// gather.cu — picks rows of a matrix: out[i] = x[rows[i]] (the rows to sample before the
// final norm and the LM head). Launcher: crates/novainfer-cuda/src/ops/gather.rs.
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
