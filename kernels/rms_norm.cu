// rms_norm.cu — RMSNorm, optionally fused with the residual add that precedes it.
// Launcher: crates/novainfer-cuda/src/ops/rms_norm.rs.
//
//   rms_norm:      out = x · rsqrt(mean(x²) + eps) · w
//   add_rms_norm:  residual += x;  out = rms_norm(residual)      (vLLM's fused_add_rms_norm)
//
// One block of RMS_THREADS threads per row, whatever the number of rows: thread t sums
// elements t, t + RMS_THREADS, … in index order, then `block_sum` combines the partials in
// a fixed order. The sum of squares of a row therefore never depends on the batch.
// The norm is taken of the residual as stored (rounded to T), so that the value the next
// layer adds to is exactly the value that was normalised.
#include "common.cuh"

#define RMS_THREADS 256

template <typename T>
__device__ void rms_norm_row(
    const T* __restrict__ x,         // [dim], one row
    const float* __restrict__ weight,  // [dim]
    T* __restrict__ out,             // [dim], one row
    int dim,
    float eps,
    float* scratch) {
    float partial = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float v = load_f32(x, i);
        partial = __fmaf_rn(v, v, partial);
    }
    const float total = block_sum(partial, scratch);
    const float scale = rsqrtf(__fadd_rn(__fdiv_rn(total, (float)dim), eps));
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        store_f32(out, i, __fmul_rn(__fmul_rn(load_f32(x, i), scale), weight[i]));
    }
}

template <typename T>
__device__ void rms_norm(const T* x, const float* weight, T* out, int dim, float eps) {
    __shared__ float scratch[WARP_SIZE];
    const i64 row = blockIdx.x;
    rms_norm_row(x + row * dim, weight, out + row * dim, dim, eps, scratch);
}

template <typename T>
__device__ void add_rms_norm(
    const T* __restrict__ x,      // [rows, dim]
    T* __restrict__ residual,     // [rows, dim], updated in place to residual + x
    const float* __restrict__ weight,
    T* __restrict__ out,          // [rows, dim]
    int dim,
    float eps) {
    __shared__ float scratch[WARP_SIZE];
    const i64 row = blockIdx.x;
    T* res = residual + row * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        store_f32(res, i, __fadd_rn(load_f32(res, i), load_f32(x + row * dim, i)));
    }
    // Each thread reads back only elements it wrote, but make the ordering explicit.
    __syncthreads();
    rms_norm_row(res, weight, out + row * dim, dim, eps, scratch);
}

#define RMS_NORM_KERNELS(T, SUFFIX)                                                       \
    extern "C" __global__ void rms_norm_##SUFFIX(                                         \
        const T* x, const float* weight, T* out, int dim, float eps) {                    \
        rms_norm(x, weight, out, dim, eps);                                               \
    }                                                                                     \
    extern "C" __global__ void add_rms_norm_##SUFFIX(                                     \
        const T* x, T* residual, const float* weight, T* out, int dim, float eps) {       \
        add_rms_norm(x, residual, weight, out, dim, eps);                                 \
    }

RMS_NORM_KERNELS(float, f32)
RMS_NORM_KERNELS(bf16, bf16)
