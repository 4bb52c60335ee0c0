// dequant.cu — GGUF (ggml) quantized weights, AWQ/GPTQ int4 and FP8 blocks to bf16 (or f32): at load time, and
// per step for a packed matrix's larger steps (gpu_weight_dtype="native").
// Launcher: crates/novainfer-cuda/src/ops/dequant.rs.
//
// Block layouts (little endian, blocks packed back to back with no padding, so a block may
// start at any byte: multi-byte fields are assembled from bytes, never loaded as u16):
//
//   Q8_0  34 B / 32 values:  d f16 | qs i8[32]                 y[j] = qs[j] · d
//   Q5_0  22 B / 32 values:  d f16 | qh u32 | qs u8[16]        y[j]    = ((qs[j] & 15) | bit j of qh << 4) − 16) · d
//                                                             y[j+16] = ((qs[j] >> 4) | bit j+16 of qh << 4) − 16) · d
//   Q4_K 144 B / 256 values: d f16 | dmin f16 | scales u8[12] | qs u8[128]
//        8 sub-blocks of 32 with 6-bit (scale, min) pairs packed in `scales`;
//        chunk c (64 values) uses qs[32c .. 32c+32]: low nibbles for sub-block 2c, high for 2c+1;
//        y = d·scale · q − dmin·min
//   Q6_K 210 B / 256 values: ql u8[128] | qh u8[64] | scales i8[16] | d f16
//        half h (128 values), l in 0..32:  y[l + 32g] = d · scales[8h + l/16 + 2g] · (q_g − 32)
//        with q_0 = ql[64h+l] & 15, q_1 = ql[64h+l+32] & 15, q_2 = ql[64h+l] >> 4, q_3 = ql[64h+l+32] >> 4,
//        each completed by bits 2g, 2g+1 of qh[32h+l] as bits 4, 5
//
// The f32 arithmetic is candle's (`k_quants.rs`, `to_float`), operation for operation, with
// explicit round-to-nearest intrinsics so no FMA contraction changes a bit: the f32 output
// equals `QTensor::dequantize` exactly and the bf16 output is that value rounded.
// One thread per output value; element-wise, so batch invariance does not arise.
#include "common.cuh"

__device__ __forceinline__ float load_f16(const u8* p) {
    return f16_bits_to_f32((u16)p[0] | ((u16)p[1] << 8));
}

__device__ __forceinline__ float q8_0_value(const u8* block, int j) {
    return __fmul_rn((float)(i8)block[2 + j], load_f16(block));
}

__device__ __forceinline__ float q5_0_value(const u8* block, int j) {
    const u32 qh = (u32)block[2] | ((u32)block[3] << 8) | ((u32)block[4] << 16) |
                   ((u32)block[5] << 24);
    const u8* qs = block + 6;
    const int low = j < 16 ? (qs[j] & 0x0F) : (qs[j - 16] >> 4);
    const int high = ((qh >> j) & 1u) << 4;
    return __fmul_rn((float)((low | high) - 16), load_f16(block));
}

// ggml's get_scale_min_k4: the 6-bit scale and min of sub-block `j` (0..8).
__device__ __forceinline__ void scale_min_k4(int j, const u8* q, int& sc, int& m) {
    if (j < 4) {
        sc = q[j] & 63;
        m = q[j + 4] & 63;
    } else {
        sc = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
        m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

__device__ __forceinline__ float q4_k_value(const u8* block, int e) {
    const float d = load_f16(block);
    const float dmin = load_f16(block + 2);
    const u8* scales = block + 4;
    const u8* qs = block + 16;
    const int chunk = e / 64;
    const int idx = e % 64;
    const int sub = 2 * chunk + (idx >= 32 ? 1 : 0);
    const u8 byte = qs[32 * chunk + (idx % 32)];
    const int q = idx < 32 ? (byte & 0x0F) : (byte >> 4);
    int sc, m;
    scale_min_k4(sub, scales, sc, m);
    const float d1 = __fmul_rn(d, (float)sc);
    const float m1 = __fmul_rn(dmin, (float)m);
    return __fsub_rn(__fmul_rn(d1, (float)q), m1);
}

__device__ __forceinline__ float q6_k_value(const u8* block, int e) {
    const u8* ql = block;
    const u8* qh = block + 128;
    const i8* scales = (const i8*)(block + 192);
    const float d = load_f16(block + 208);
    const int h = e / 128;
    const int g = (e % 128) / 32;
    const int l = e % 32;
    const u8 low_byte = ql[64 * h + l + ((g & 1) ? 32 : 0)];
    const int low = (g < 2) ? (low_byte & 0x0F) : (low_byte >> 4);
    const int high = (qh[32 * h + l] >> (2 * g)) & 3;
    const int q = (low | (high << 4)) - 32;
    const float sc = (float)scales[8 * h + l / 16 + 2 * g];
    return __fmul_rn(__fmul_rn(d, sc), (float)q);
}

// AWQ/GPTQ grouped int4 (crates/novainfer-model/src/int4.rs): 69 B / 128 values,
//   s f32 | z u8 | 4 sub-blocks × 16 B; sub-block t, byte j: value 32t + j low nibble, 32t + 16 + j high
//   y = s · (q − z), one rounding (GroupedInt4::dequantize)
__device__ __forceinline__ float int4_value(const u8* block, int e) {
    const float s = __uint_as_float((u32)block[0] | ((u32)block[1] << 8) | ((u32)block[2] << 16) |
                                    ((u32)block[3] << 24));
    const int t = e / 32, c = e % 32;
    const u8 byte = block[5 + 16 * t + c % 16];
    const int q = c < 16 ? (byte & 0x0F) : (byte >> 4);
    return __fmul_rn(s, (float)(q - (int)block[4]));
}

// FP8 e4m3 weights (crates/novainfer-model/src/fp8_blocks.rs): 132 B / 128 values,
//   s f32 | 128 e4m3fn codes;  y = e4m3(code) · s, one rounding (Fp8Blocks::dequantize)
__device__ __forceinline__ float fp8_value(const u8* block, int e) {
    const float s = __uint_as_float((u32)block[0] | ((u32)block[1] << 8) | ((u32)block[2] << 16) |
                                    ((u32)block[3] << 24));
    return __fmul_rn(e4m3_value(block[4 + e]), s);
}

#define DEQUANT_KERNEL(NAME, BLOCK_BYTES, BLOCK_VALUES, VALUE_FN, T, SUFFIX)                 \
    extern "C" __global__ void dequant_##NAME##_##SUFFIX(                                    \
        const u8* __restrict__ blocks, /* [num_blocks · BLOCK_BYTES] */                      \
        T* __restrict__ out,           /* [num_blocks · BLOCK_VALUES] */                     \
        i64 num_blocks) {                                                                    \
        const i64 total = num_blocks * BLOCK_VALUES;                                         \
        for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total;                  \
             i += (i64)gridDim.x * blockDim.x) {                                             \
            const u8* block = blocks + (i / BLOCK_VALUES) * BLOCK_BYTES;                     \
            store_f32(out, i, VALUE_FN(block, (int)(i % BLOCK_VALUES)));                     \
        }                                                                                    \
    }

// Token rows of a packed embedding table (gpu_weight_dtype="native"): out[t] = row token_ids[t]
// expanded, the same values as the whole-table expansion above. One block per token, threads over
// the row; an id outside the vocabulary gives a zero row (the runner validates ids first).
#define EMBED_KERNEL(NAME, BLOCK_BYTES, BLOCK_VALUES, VALUE_FN, T, SUFFIX)                   \
    extern "C" __global__ void embed_##NAME##_##SUFFIX(                                       \
        const u32* __restrict__ token_ids, const u8* __restrict__ blocks, T* __restrict__ out, \
        int hidden, int vocab_size) {                                                         \
        const i64 token = blockIdx.x;                                                         \
        const u32 id = token_ids[token];                                                      \
        const bool valid = id < (u32)vocab_size;                                              \
        const u8* row = blocks + (i64)id * (hidden / BLOCK_VALUES) * BLOCK_BYTES;             \
        for (int i = threadIdx.x; i < hidden; i += blockDim.x) {                              \
            const float v =                                                                   \
                valid ? VALUE_FN(row + (i / BLOCK_VALUES) * BLOCK_BYTES, i % BLOCK_VALUES)   \
                      : 0.0f;                                                                 \
            store_f32(out, token * hidden + i, v);                                            \
        }                                                                                     \
    }

#define DEQUANT_KERNELS(T, SUFFIX)                                \
    DEQUANT_KERNEL(q8_0, 34, 32, q8_0_value, T, SUFFIX)           \
    DEQUANT_KERNEL(q5_0, 22, 32, q5_0_value, T, SUFFIX)           \
    DEQUANT_KERNEL(q4_k, 144, 256, q4_k_value, T, SUFFIX)         \
    DEQUANT_KERNEL(q6_k, 210, 256, q6_k_value, T, SUFFIX)         \
    DEQUANT_KERNEL(int4, 69, 128, int4_value, T, SUFFIX)           \
    DEQUANT_KERNEL(fp8, 132, 128, fp8_value, T, SUFFIX)            \
    EMBED_KERNEL(q8_0, 34, 32, q8_0_value, T, SUFFIX)              \
    EMBED_KERNEL(q5_0, 22, 32, q5_0_value, T, SUFFIX)              \
    EMBED_KERNEL(q4_k, 144, 256, q4_k_value, T, SUFFIX)            \
    EMBED_KERNEL(q6_k, 210, 256, q6_k_value, T, SUFFIX)            \
    EMBED_KERNEL(int4, 69, 128, int4_value, T, SUFFIX)             \
    EMBED_KERNEL(fp8, 132, 128, fp8_value, T, SUFFIX)

DEQUANT_KERNELS(float, f32)
DEQUANT_KERNELS(bf16, bf16)
