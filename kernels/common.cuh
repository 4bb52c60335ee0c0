// common.cuh — types, bf16/f16 conversions and fixed-order reductions shared by every kernel.
//
// NVRTC compiles each kernels/*.cu at run time with no CUDA headers on the include path
// (the PyPI NVRTC wheel ships none), so this file depends on nothing but compiler builtins:
// bf16 and f16 are raw 16-bit patterns converted by hand, integers are spelled with the
// built-in types. The Rust side splices this file in place of `#include "common.cuh"`.
//
// Batch invariance rests on two rules every kernel follows:
//  1. a reduction's shape is fixed by the size of what is reduced (a row, a head), never by
//     the number of rows, tokens or sequences in the launch; the grid only grows or shrinks;
//  2. reductions use the helpers below, whose order of operations is fixed: strided
//     per-thread partial sums in increasing index order, then an xor butterfly inside each
//     warp, then warp partials combined in warp order by warp 0.
// An xor butterfly leaves the bitwise same value in every lane (each step adds the same two
// operands, and float addition is commutative), so every lane may use the result.
#pragma once

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef int i32;
typedef unsigned long long u64;
typedef long long i64;

// A bf16 value as its bit pattern (the upper half of an f32).
typedef u16 bf16;

#define WARP_SIZE 32
#define FULL_MASK 0xffffffffu
#define NEG_INF (-__int_as_float(0x7f800000))

__device__ __forceinline__ float bf16_to_f32(bf16 h) {
    return __uint_as_float(((u32)h) << 16);
}

// Round to nearest even, NaN kept quiet; the same rounding as `half::bf16::from_f32`.
__device__ __forceinline__ bf16 f32_to_bf16(float f) {
    u32 x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) {
        return (bf16)((x >> 16) | 0x0040u);
    }
    u32 rounding_bias = 0x7fffu + ((x >> 16) & 1u);
    return (bf16)((x + rounding_bias) >> 16);
}

// IEEE binary16 bits to f32, exactly (GGUF block scales are f16).
// An e4m3fn code's value (FP8 weights; twin: quant_type::e4m3_by_bits): its exponent and mantissa bits moved into
// an f32, whose exponent bias is 120 more than the code's 7, then scaled by 2^120, exactly. A subnormal code becomes
// an f32 subnormal, which survives because the kernels are compiled without flush-to-zero. The NaN codes
// (S.1111.111) never reach a kernel: the loaders refuse them.
__device__ __forceinline__ float e4m3_value(u8 code) {
    const u32 bits = ((u32)(code & 0x80u) << 24) | ((u32)(code & 0x7Fu) << 20);
    return __fmul_rn(__uint_as_float(bits), __uint_as_float(0x7B800000u));
}

__device__ __forceinline__ float f16_bits_to_f32(u16 h) {
    u32 sign = ((u32)h & 0x8000u) << 16;
    u32 exp = ((u32)h >> 10) & 0x1fu;
    u32 mant = (u32)h & 0x3ffu;
    if (exp == 0) {
        // Zero or subnormal: mant · 2^-24 is exact in f32.
        float v = (float)mant * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    if (exp == 31) {
        return __uint_as_float(sign | 0x7f800000u | (mant << 13));
    }
    return __uint_as_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

// Loads/stores an activation of either dtype as f32; kernels are written once over `T`.
__device__ __forceinline__ float load_f32(const float* p, i64 i) { return p[i]; }
__device__ __forceinline__ float load_f32(const bf16* p, i64 i) { return bf16_to_f32(p[i]); }
__device__ __forceinline__ void store_f32(float* p, i64 i, float v) { p[i] = v; }
__device__ __forceinline__ void store_f32(bf16* p, i64 i, float v) { p[i] = f32_to_bf16(v); }

// Neox rotation of one (lo, hi) = (x[i], x[i + head_dim/2]) pair by the table's (cos, sin):
//   lo' = lo·cos − hi·sin,   hi' = hi·cos + lo·sin
// Every product and sum is rounded on its own (no FMA contraction), which is what the CPU's
// `Rope::apply` does in f32; rope.cu and qkv.cu both call this, so they round alike.
__device__ __forceinline__ void rope_rotate(float lo, float hi, float c, float s, float& out_lo,
                                            float& out_hi) {
    out_lo = __fsub_rn(__fmul_rn(lo, c), __fmul_rn(hi, s));
    out_hi = __fadd_rn(__fmul_rn(hi, c), __fmul_rn(lo, s));
}

// SwiGLU of one (gate, up) pair in the CPU's formula, g / (1 + exp(-g)) · u, with no fused
// multiply-add, so f32 results match the CPU up to expf; silu_mul.cu and the fused GEMV
// (gemv_quant.cu) both call this, so they round alike.
__device__ __forceinline__ float silu_times(float g, float u) {
    const float silu = __fdiv_rn(g, __fadd_rn(1.0f, expf(-g)));
    return __fmul_rn(silu, u);
}

// `v` as a store to T and a load back give it: rounded to bf16, or unchanged in f32. A fused
// epilogue calls this where the unfused path stores an intermediate, so both round alike.
__device__ __forceinline__ float round_as(const float*, float v) { return v; }
__device__ __forceinline__ float round_as(const bf16*, float v) { return bf16_to_f32(f32_to_bf16(v)); }

__device__ __forceinline__ float warp_sum(float v) {
    for (int offset = WARP_SIZE / 2; offset > 0; offset /= 2) {
        v += __shfl_xor_sync(FULL_MASK, v, offset);
    }
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int offset = WARP_SIZE / 2; offset > 0; offset /= 2) {
        v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, offset));
    }
    return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the
// result. `scratch` holds 32 floats of shared memory; the call synchronises the block twice.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x % WARP_SIZE;
    const int warp = threadIdx.x / WARP_SIZE;
    const int num_warps = blockDim.x / WARP_SIZE;
    v = warp_sum(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    if (warp == 0) {
        // Warp partials in warp order: lane i holds warp i's sum, then one butterfly.
        float w = lane < num_warps ? scratch[lane] : 0.0f;
        w = warp_sum(w);
        if (lane == 0) scratch[0] = w;
    }
    __syncthreads();
    float total = scratch[0];
    __syncthreads();
    return total;
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x % WARP_SIZE;
    const int warp = threadIdx.x / WARP_SIZE;
    const int num_warps = blockDim.x / WARP_SIZE;
    v = warp_max(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float w = lane < num_warps ? scratch[lane] : NEG_INF;
        w = warp_max(w);
        if (lane == 0) scratch[0] = w;
    }
    __syncthreads();
    float total = scratch[0];
    __syncthreads();
    return total;
}

// d += a·b, one m16n8k16 tensor-core tile (sm_80+): bf16 A (row-major 16×16) and B
// (column-major 16×8), f32 C/D, in the PTX ISA's fragment layouts. Under the CPU emulator
// (crates/novainfer-cuemu) the warp exchanges its fragments and multiplies them out.
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
#ifdef NOVAINFER_CUEMU
    cuemu::mma_bf16_16816(d, a, b0, b1);
#else
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}
