// gemv_quant.cu — decode products straight from packed GGUF (and AWQ/GPTQ int4) blocks: y[r, col0 + o] = Σ_k x[r, k] · W[o, k]
// for up to GEMV_MAX_ROWS activation rows, reading each weight block once (no bf16 copy of the matrix).
// Launcher: crates/novainfer-cuda/src/ops/gemv_quant.rs; CPU twin (geometry and the exact order of every
// operation): crates/novainfer-cuda/src/gemv_plan.rs. Block layouts: dequant.cu.
//
// Work split: one warp per weight row, GEMV_WARPS rows per block; grid.x = ceil(rows / GEMV_WARPS).
// A row is cut into chunks of 8 consecutive values, all inside one (sub-)block with one scale; lane l
// takes chunks l, l + 32, l + 64, ... in that order. Per chunk and activation row r:
//     s = Σ q_e · x_e  and (Q4_K only) t = Σ x_e, e in order, each an fmaf / fadd;
//     acc_r = fmaf(a, s, acc_r), then (Q4_K) acc_r = fmaf(−b, t, acc_r)
// with the chunk's integer weights q_e and its scale a (and Q4_K's min b) as dequant.cu computes them
// (d·scale, dmin·min in f32). The lanes' partials then meet in common.cuh's xor butterfly. So the
// weights are the dequantizer's exactly, factored out of the chunk sums (the f32 sums round
// differently from the bf16 matrix's product, and are closer to the exact one), and a row's result is
// the same whatever the other rows of the launch: the work of row r depends on nothing but x[r].
// Every operation is an explicit _rn intrinsic, so no FMA contraction can differ from the twin.
#include "common.cuh"

#define GEMV_WARPS 4
#define GEMV_MAX_ROWS 8
#define GEMV_CHUNK 8

__device__ __forceinline__ float gemv_f16(const u8* p) {
    return f16_bits_to_f32((u16)p[0] | ((u16)p[1] << 8));
}

// One chunk's 8 integer weights (as floats: exact, |q| < 2^7) and its factors: w_e = a · q_e − b.
struct Chunk {
    float q[GEMV_CHUNK];
    float a;
    float b;  // 0 except Q4_K
};

// Chunk c (0 .. 4) of a Q8_0 block: values 8c .. 8c + 7.
__device__ __forceinline__ Chunk chunk_q8_0(const u8* block, int c) {
    Chunk ch;
    ch.a = gemv_f16(block);
    ch.b = 0.0f;
    for (int e = 0; e < GEMV_CHUNK; ++e) ch.q[e] = (float)(i8)block[2 + 8 * c + e];
    return ch;
}

// Chunk c (0 .. 4) of a Q5_0 block: values j = 8c .. 8c + 7, q = (nibble | bit j of qh << 4) − 16.
__device__ __forceinline__ Chunk chunk_q5_0(const u8* block, int c) {
    Chunk ch;
    ch.a = gemv_f16(block);
    ch.b = 0.0f;
    const u32 qh = (u32)block[2] | ((u32)block[3] << 8) | ((u32)block[4] << 16) | ((u32)block[5] << 24);
    const u8* qs = block + 6;
    for (int e = 0; e < GEMV_CHUNK; ++e) {
        const int j = 8 * c + e;
        const int low = j < 16 ? (qs[j] & 0x0F) : (qs[j - 16] >> 4);
        const int high = ((qh >> j) & 1u) << 4;
        ch.q[e] = (float)((low | high) - 16);
    }
    return ch;
}

__device__ __forceinline__ void gemv_scale_min_k4(int j, const u8* q, int& sc, int& m) {
    if (j < 4) {
        sc = q[j] & 63;
        m = q[j + 4] & 63;
    } else {
        sc = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
        m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// Chunk c (0 .. 32) of a Q4_K block: values e = 8c .. 8c + 7 of sub-block 8c / 32.
__device__ __forceinline__ Chunk chunk_q4_k(const u8* block, int c) {
    Chunk ch;
    const int e0 = 8 * c;
    const int part = e0 / 64, idx0 = e0 % 64;
    const int sub = 2 * part + (idx0 >= 32 ? 1 : 0);
    int sc, m;
    gemv_scale_min_k4(sub, block + 4, sc, m);
    ch.a = __fmul_rn(gemv_f16(block), (float)sc);
    ch.b = __fmul_rn(gemv_f16(block + 2), (float)m);
    const u8* qs = block + 16 + 32 * part;
    for (int e = 0; e < GEMV_CHUNK; ++e) {
        const int idx = idx0 + e;
        const u8 byte = qs[idx % 32];
        ch.q[e] = (float)(idx < 32 ? (byte & 0x0F) : (byte >> 4));
    }
    return ch;
}

// Chunk c (0 .. 32) of a Q6_K block: values e = 8c .. 8c + 7 (one half h, one g, one scale).
__device__ __forceinline__ Chunk chunk_q6_k(const u8* block, int c) {
    Chunk ch;
    const int e0 = 8 * c;
    const int h = e0 / 128, g = (e0 % 128) / 32, l0 = e0 % 32;
    const u8* ql = block + 64 * h + ((g & 1) ? 32 : 0);
    const u8* qh = block + 128 + 32 * h;
    const i8* scales = (const i8*)(block + 192);
    ch.a = __fmul_rn(gemv_f16(block + 208), (float)scales[8 * h + l0 / 16 + 2 * g]);
    ch.b = 0.0f;
    for (int e = 0; e < GEMV_CHUNK; ++e) {
        const int l = l0 + e;
        const int low = (g < 2) ? (ql[l] & 0x0F) : (ql[l] >> 4);
        const int high = (qh[l] >> (2 * g)) & 3;
        ch.q[e] = (float)((low | (high << 4)) - 32);
    }
    return ch;
}

// Chunk c (0 .. 16) of an int4 block: values 8c .. 8c + 7 of sub-block 8c / 32, q − z (dequant.cu).
__device__ __forceinline__ Chunk chunk_int4(const u8* block, int c) {
    Chunk ch;
    ch.a = __uint_as_float((u32)block[0] | ((u32)block[1] << 8) | ((u32)block[2] << 16) |
                           ((u32)block[3] << 24));
    ch.b = 0.0f;
    const int e0 = 8 * c, t = e0 / 32, c0 = e0 % 32, z = block[4];
    const u8* qs = block + 5 + 16 * t;
    for (int e = 0; e < GEMV_CHUNK; ++e) {
        const int j = c0 + e;
        const int q = j < 16 ? (qs[j] & 0x0F) : (qs[j - 16] >> 4);
        ch.q[e] = (float)(q - z);
    }
    return ch;
}

template <typename T, int BLOCK_BYTES, int BLOCK_VALUES, Chunk (*CHUNK_FN)(const u8*, int), bool MINS>
__device__ void gemv_quant(
    const u8* __restrict__ w,    // [rows, k / BLOCK_VALUES blocks]
    const bf16* __restrict__ x,  // [n, k]
    T* __restrict__ y,           // [n, ld]; row o of w lands in column col0 + o
    int rows, int k, int n, int ld, int col0) {
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const int o = blockIdx.x * GEMV_WARPS + warp;
    if (o >= rows) {
        return;
    }
    const int chunks_per_block = BLOCK_VALUES / GEMV_CHUNK;
    const int chunks = k / GEMV_CHUNK;
    const u8* row = w + (i64)o * (k / BLOCK_VALUES) * BLOCK_BYTES;
    float acc[GEMV_MAX_ROWS];
    for (int r = 0; r < GEMV_MAX_ROWS; ++r) acc[r] = 0.0f;
    for (int c = lane; c < chunks; c += WARP_SIZE) {
        const Chunk ch = CHUNK_FN(row + (i64)(c / chunks_per_block) * BLOCK_BYTES, c % chunks_per_block);
        for (int r = 0; r < GEMV_MAX_ROWS; ++r) {
            if (r >= n) break;
            const bf16* xr = x + (i64)r * k + (i64)c * GEMV_CHUNK;
            float s = 0.0f, t = 0.0f;
            for (int e = 0; e < GEMV_CHUNK; ++e) {
                const float xe = bf16_to_f32(xr[e]);
                s = __fmaf_rn(ch.q[e], xe, s);
                if (MINS) t = __fadd_rn(t, xe);
            }
            acc[r] = __fmaf_rn(ch.a, s, acc[r]);
            if (MINS) acc[r] = __fmaf_rn(-ch.b, t, acc[r]);
        }
    }
    for (int r = 0; r < GEMV_MAX_ROWS; ++r) {
        if (r >= n) break;
        const float v = warp_sum(acc[r]);
        if (lane == 0) store_f32(y, (i64)r * ld + col0 + o, v);
    }
}

#define GEMV_KERNEL(NAME, BLOCK_BYTES, BLOCK_VALUES, CHUNK_FN, MINS, T, SUFFIX)                     \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * WARP_SIZE) gemv_##NAME##_##SUFFIX(    \
        const u8* __restrict__ w, const bf16* __restrict__ x, T* __restrict__ y, int rows, int k,  \
        int n, int ld, int col0) {                                                                 \
        gemv_quant<T, BLOCK_BYTES, BLOCK_VALUES, CHUNK_FN, MINS>(w, x, y, rows, k, n, ld, col0);   \
    }

#define GEMV_KERNELS(T, SUFFIX)                                        \
    GEMV_KERNEL(q8_0, 34, 32, chunk_q8_0, false, T, SUFFIX)            \
    GEMV_KERNEL(q5_0, 22, 32, chunk_q5_0, false, T, SUFFIX)            \
    GEMV_KERNEL(q4_k, 144, 256, chunk_q4_k, true, T, SUFFIX)           \
    GEMV_KERNEL(q6_k, 210, 256, chunk_q6_k, false, T, SUFFIX)          \
    GEMV_KERNEL(int4, 69, 128, chunk_int4, false, T, SUFFIX)

// The suffix names the output dtype; activations are always bf16 (the executor's).
GEMV_KERNELS(float, f32)
GEMV_KERNELS(bf16, bf16)
