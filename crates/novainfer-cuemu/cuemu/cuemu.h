// cuemu.h — what a kernels/*.cu file needs from CUDA, on the CPU, so the kernels' own source
// runs in `cargo test` on a machine without a GPU.
//
// The build force-includes this header and compiles each kernel file as C++ with
// NOVAINFER_CUEMU defined. A launch (runtime.cpp) runs every thread of a block as a fiber
// on the launching thread, switched when it waits at a collective, blocks one after another:
//  - `__shared__` is `static`: one array per kernel instantiation, shared by the threads of
//    the block running (launches are serialised, so no two blocks ever use it at once);
//  - `__syncthreads` is a barrier over the block's live threads (a thread that has returned
//    no longer counts, as on sm_70+);
//  - warp collectives (shuffles, ballots, `__syncwarp`, ldmatrix, mma.sync) are a barrier
//    over the lanes their mask names, with an exchange area per warp;
//  - `cp.async` (flash_prefill.cu's wrapper) copies at once, so a read of its destination
//    before the wait is not caught here;
//  - a barrier that can never complete (a thread that never arrives: a divergent
//    `__syncthreads`, or a shuffle whose mask names a lane that left) fails the launch,
//    naming the block, the thread and what it waits at, instead of hanging.
// Numerics: `__fmul_rn` and friends are plain IEEE operations (the file is compiled with
// -ffp-contract=off, so nothing else contracts either); mma.sync multiplies bf16 exactly
// and accumulates in f32 in k order, which a tensor core does to within its own rounding.
#pragma once

#include <cmath>
#include <math.h>  // expf, logf, ... in the global namespace, as in CUDA
#include <cstdint>
#include <cstring>

#define __device__
#define __host__
#define __global__
#define __forceinline__ inline
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)

struct uint3 {
    unsigned int x, y, z;
};
struct dim3 {
    unsigned int x, y, z;
};
// Vector types with CUDA's alignment (16 bytes: a 128-bit load).
struct alignas(16) uint4 {
    unsigned int x, y, z, w;
};
struct alignas(16) int4 {
    int x, y, z, w;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }
inline int4 make_int4(int x, int y, int z, int w) { return int4{x, y, z, w}; }

namespace cuemu {
struct ThreadState {
    uint3 thread_idx;
    uint3 block_idx;
    unsigned lane;
    unsigned warp;
};
extern thread_local ThreadState state;
extern dim3 block_dim;
extern dim3 grid_dim;

void syncthreads();
int syncthreads_and(int predicate);
// Every lane named by `mask` deposits `value` and gets back all the lanes' deposits.
void warp_exchange(unsigned mask, const uint32_t* mine, int words, uint32_t (*all)[16]);

template <typename T>
inline T shfl(unsigned mask, T v, int src_lane) {
    static_assert(sizeof(T) <= 4, "shuffles move 32-bit values");
    uint32_t word = 0;
    std::memcpy(&word, &v, sizeof(T));
    uint32_t all[32][16];
    warp_exchange(mask, &word, 1, all);
    T out;
    std::memcpy(&out, &all[src_lane & 31][0], sizeof(T));
    return out;
}

unsigned ballot(unsigned mask, int predicate);
void syncwarp(unsigned mask);

// ldmatrix .x4 (and .trans): lanes 8i .. 8i + 7 give the rows of matrix i.
void ldmatrix_x4(uint32_t (&r)[4], const void* row_addr, bool trans);
// mma.sync.m16n8k16.row.col.f32.bf16.bf16.f32, d += a·b.
void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);

inline float bits_to_f32(uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline uint32_t f32_to_bits(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
}
}  // namespace cuemu

#define threadIdx (cuemu::state.thread_idx)
#define blockIdx (cuemu::state.block_idx)
#define blockDim (cuemu::block_dim)
#define gridDim (cuemu::grid_dim)

inline void __syncthreads() { cuemu::syncthreads(); }
inline int __syncthreads_and(int p) { return cuemu::syncthreads_and(p); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { cuemu::syncwarp(mask); }
template <typename T>
inline T __shfl_sync(unsigned mask, T v, int src) {
    return cuemu::shfl(mask, v, src);
}
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask) {
    return cuemu::shfl(mask, v, (int)cuemu::state.lane ^ lane_mask);
}
template <typename T>
inline T __shfl_up_sync(unsigned mask, T v, unsigned delta) {
    // A lane below `delta` keeps its own value, as on the GPU.
    const int lane = (int)cuemu::state.lane;
    const T up = cuemu::shfl(mask, v, lane - (int)delta < 0 ? lane : lane - (int)delta);
    return up;
}
template <typename T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned delta) {
    const int lane = (int)cuemu::state.lane;
    return cuemu::shfl(mask, v, lane + (int)delta > 31 ? lane : lane + (int)delta);
}
inline unsigned __ballot_sync(unsigned mask, int p) { return cuemu::ballot(mask, p); }

inline float __int_as_float(int i) { return cuemu::bits_to_f32((uint32_t)i); }
inline float __uint_as_float(unsigned u) { return cuemu::bits_to_f32(u); }
inline unsigned __float_as_uint(float f) { return cuemu::f32_to_bits(f); }
inline int __float_as_int(float f) { return (int)cuemu::f32_to_bits(f); }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((uint64_t)a * b) >> 32); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
// CUDA's integer min/max overloads take mixed operands (int and long long, say).
template <typename A, typename B>
inline auto min(A a, B b) -> decltype(a + b) {
    return b < a ? b : a;
}
template <typename A, typename B>
inline auto max(A a, B b) -> decltype(a + b) {
    return a < b ? b : a;
}

inline unsigned atomicAdd(unsigned* p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
inline float atomicAdd(float* p, float v) {
    uint32_t expected = __atomic_load_n(reinterpret_cast<uint32_t*>(p), __ATOMIC_RELAXED);
    while (true) {
        const uint32_t desired = cuemu::f32_to_bits(cuemu::bits_to_f32(expected) + v);
        if (__atomic_compare_exchange_n(reinterpret_cast<uint32_t*>(p), &expected, desired, false,
                                        __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
            return cuemu::bits_to_f32(expected);
        }
    }
}
