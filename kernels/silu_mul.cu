// silu_mul.cu — SwiGLU activation: out = silu(gate) · up.
// Launcher: crates/novainfer-cuda/src/ops/silu_mul.rs.
//
// gate and up are read through a row stride so both layouts work: two separate [rows, d]
// tensors (stride d) or one fused gate_up projection [rows, 2d] (up = gate + d, stride 2d).
// Element-wise; each output depends only on its own two inputs, in the CPU's formula
// (common.cuh's silu_times), so f32 results match the CPU up to expf.
#include "common.cuh"

template <typename T>
__device__ void silu_mul(
    const T* __restrict__ gate,  // [rows, in_stride], first d columns used
    const T* __restrict__ up,    // [rows, in_stride], first d columns used
    T* __restrict__ out,         // [rows, d]
    int d,
    int in_stride,
    i64 num_elems) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < num_elems;
         i += (i64)gridDim.x * blockDim.x) {
        const i64 row = i / d;
        const i64 col = i % d;
        const float g = load_f32(gate, row * in_stride + col);
        const float u = load_f32(up, row * in_stride + col);
        store_f32(out, i, silu_times(g, u));
    }
}

extern "C" __global__ void silu_mul_f32(
    const float* gate, const float* up, float* out, int d, int in_stride, i64 num_elems) {
    silu_mul(gate, up, out, d, in_stride, num_elems);
}

extern "C" __global__ void silu_mul_bf16(
    const bf16* gate, const bf16* up, bf16* out, int d, int in_stride, i64 num_elems) {
    silu_mul(gate, up, out, d, in_stride, num_elems);
}
