// gemv_quant.cu — decode products (GEMV, up to GEMV_MAX_ROWS activation rows) straight from packed
// GGUF (and AWQ/GPTQ int4, FP8) blocks or from bf16 rows, and (at the end of the file) a tiled tensor-core GEMM for
// larger steps that decodes packed blocks into shared memory. The GEMV: y[r, col0 + o] = Σ_k x[r, k] · W[o, k], reading each
// weight once (no bf16 copy of a packed matrix), and the same walk with the layer's next step fused into
// its epilogue (gate/up with SiLU·mul; QKV with bias, RoPE and the KV-cache write).
// Launcher: crates/novainfer-cuda/src/ops/gemv_quant.rs; CPU twin (geometry, the exact order of every
// operation, the fused kernels' row pairing): crates/novainfer-cuda/src/gemv_plan.rs. Block layouts:
// dequant.cu.
//
// Work split: one warp per weight row (the fused kernels: per pair of rows), GEMV_WARPS warps per block. A matrix
// comes as runs of rows in one format each (GemvParts): a launch covers a whole fused matrix whatever its tensors'
// types, and a warp's run (so its format) is the same for all its lanes.
// A row is cut into chunks of 8 consecutive values, all inside one (sub-)block with one scale; lane l
// takes chunks l, l + 32, l + 64, ... in that order (a bf16 row's lane loads GEMV_UNROLL of them before
// it uses the first, to keep several 16-byte loads in flight where a packed chunk's decode already issues
// several; the order of the sums is the same either way). Per chunk and
// activation row r:
//     s = Σ q_e · x_e  and (Q4_K only) t = Σ x_e, e in order, each an fmaf / fadd;
//     acc_r = fmaf(a, s, acc_r), then (Q4_K) acc_r = fmaf(−b, t, acc_r)
// with the chunk's integer weights q_e and its scale a (and Q4_K's min b) as dequant.cu computes them
// (d·scale, dmin·min in f32); a bf16 row is chunks of its own values with a = 1. The lanes' partials
// then meet in common.cuh's xor butterfly. So the weights are the dequantizer's exactly, factored out
// of the chunk sums (the f32 sums round differently from the bf16 matrix's product, and are closer to
// the exact one), and a row's result is the same whatever the other rows of the launch: the work of
// row r depends on nothing but x[r]. Every operation is an explicit _rn intrinsic, so no FMA
// contraction can differ from the twin.
//
// A fused epilogue rounds each product as the unfused path's store would (round_as), then runs the
// next kernel's own arithmetic (silu_times, the bias add and rope_rotate), so a fused launch equals the
// GEMV followed by silu_mul.cu or qkv.cu bit for bit.
#include "common.cuh"

#define GEMV_WARPS 4
#define GEMV_MAX_ROWS 8
#define GEMV_CHUNK 8
#define GEMV_UNROLL 4  // bf16 rows; packed ones take 1 (unrolling them grows the binary 4x)

__device__ __forceinline__ float gemv_f16(const u8* p) {
    return f16_bits_to_f32((u16)p[0] | ((u16)p[1] << 8));
}

// One chunk's 8 weights and its factors, w_e = a · q_e − b: a packed block's integers (as floats: exact,
// |q| < 2^7) with its scale(s), or a bf16 row's values with a = 1.
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

// Chunk c (0 .. 16) of an FP8 block: values 8c .. 8c + 7, the codes' values with the block's scale (dequant.cu). The
// codes start 4 bytes into a 132-byte block, so a chunk is two 4-byte-aligned words (the launcher checks the base).
__device__ __forceinline__ Chunk chunk_fp8(const u8* block, int c) {
    Chunk ch;
    ch.a = __uint_as_float(*reinterpret_cast<const u32*>(block));
    ch.b = 0.0f;
    const u32* codes = reinterpret_cast<const u32*>(block + 4 + 8 * c);
    const u32 words[2] = {codes[0], codes[1]};
    for (int e = 0; e < GEMV_CHUNK; ++e) ch.q[e] = e4m3_value((u8)(words[e / 4] >> (8 * (e % 4))));
    return ch;
}

// A bf16 weight row as blocks of one chunk: 8 values (16 bytes, one vector load; the launcher checks
// the alignment), q = the values themselves (exact in f32), a = 1.
__device__ __forceinline__ Chunk chunk_bf16w(const u8* block, int) {
    Chunk ch;
    const uint4 v = *reinterpret_cast<const uint4*>(block);
    const u32 words[4] = {v.x, v.y, v.z, v.w};
    for (int e = 0; e < 4; ++e) {
        ch.q[2 * e] = __uint_as_float(words[e] << 16);
        ch.q[2 * e + 1] = __uint_as_float(words[e] & 0xFFFF0000u);
    }
    ch.a = 1.0f;
    ch.b = 0.0f;
    return ch;
}

// Chunk c's 8 activations of row x (16 bytes; the launcher checks x's alignment).
__device__ __forceinline__ void load_x8(const bf16* xr, float (&xe)[GEMV_CHUNK]) {
    const uint4 v = *reinterpret_cast<const uint4*>(xr);
    const u32 words[4] = {v.x, v.y, v.z, v.w};
    for (int e = 0; e < 4; ++e) {
        xe[2 * e] = __uint_as_float(words[e] << 16);
        xe[2 * e + 1] = __uint_as_float(words[e] & 0xFFFF0000u);
    }
}

// Weight row `row`'s products with the n activation rows of x, warp-summed: on return every lane holds
// acc[r] = Σ_k x[r, k] · W[k] for r < n.
template <int BLOCK_BYTES, int BLOCK_VALUES, Chunk (*CHUNK_FN)(const u8*, int), bool MINS, int UNROLL>
__device__ __forceinline__ void gemv_row(
    const u8* __restrict__ row, const bf16* __restrict__ x, int k, int n, int lane,
    float (&acc)[GEMV_MAX_ROWS]) {
    const int chunks_per_block = BLOCK_VALUES / GEMV_CHUNK;
    const int chunks = k / GEMV_CHUNK;
    for (int r = 0; r < GEMV_MAX_ROWS; ++r) acc[r] = 0.0f;
    for (int c0 = lane; c0 < chunks; c0 += UNROLL * WARP_SIZE) {
        Chunk ch[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int c = c0 + u * WARP_SIZE;
            if (c < chunks) {
                ch[u] = CHUNK_FN(row + (i64)(c / chunks_per_block) * BLOCK_BYTES, c % chunks_per_block);
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int c = c0 + u * WARP_SIZE;
            if (c >= chunks) break;
            for (int r = 0; r < GEMV_MAX_ROWS; ++r) {
                if (r >= n) break;
                float xe[GEMV_CHUNK];
                load_x8(x + (i64)r * k + (i64)c * GEMV_CHUNK, xe);
                float s = 0.0f, t = 0.0f;
#pragma unroll
                for (int e = 0; e < GEMV_CHUNK; ++e) {
                    s = __fmaf_rn(ch[u].q[e], xe[e], s);
                    if (MINS) t = __fadd_rn(t, xe[e]);
                }
                acc[r] = __fmaf_rn(ch[u].a, s, acc[r]);
                if (MINS) acc[r] = __fmaf_rn(-ch[u].b, t, acc[r]);
            }
        }
    }
    for (int r = 0; r < GEMV_MAX_ROWS; ++r) {
        if (r >= n) break;
        acc[r] = warp_sum(acc[r]);
    }
}

// A weight matrix as up to GEMV_MAX_PARTS runs of rows, each in one format (a bf16 matrix is one run; a packed
// one a run per checkpoint tensor, whose types may differ, as Q4_K_M mixes Q4_K and Q6_K). Runs follow each other:
// run p holds rows end[p - 1] .. end[p]. Mirrored by the launcher's `#[repr(C)]` PartsArg.
#define GEMV_MAX_PARTS 4
#define GEMV_Q4_K 0
#define GEMV_Q5_0 1
#define GEMV_Q6_K 2
#define GEMV_Q8_0 3
#define GEMV_INT4 4
#define GEMV_FP8 5
#define GEMV_BF16W 6

struct GemvPart {
    const u8* w;  // the run's rows
    int format;   // GEMV_Q4_K .. GEMV_BF16W
    int end;      // one past the run's last row, counted over the whole matrix
};

struct GemvParts {
    GemvPart part[GEMV_MAX_PARTS];
    int count;
};

__device__ __forceinline__ int gemv_row_bytes(int format, int k) {
    switch (format) {
        case GEMV_Q4_K: return k / 256 * 144;
        case GEMV_Q5_0: return k / 32 * 22;
        case GEMV_Q6_K: return k / 256 * 210;
        case GEMV_Q8_0: return k / 32 * 34;
        case GEMV_INT4: return k / 128 * 69;
        case GEMV_FP8: return k / 128 * 132;
        default: return k * 2;
    }
}

// Row `o` of the matrix (o < the last run's end), whichever run holds it. The format is the same for every lane of
// the warp, so the switch does not diverge. A matrix is packed or bf16 (DENSE) throughout, and each family is a
// kernel of its own: the bf16 path's unrolled loads need twice the registers of the packed ones, which would
// otherwise halve every packed launch's occupancy.
// Row `o` of the matrix (o < the last run's end), whichever run holds it, and that run's format. Unrolled with constant
// indices, so the table stays in the parameter bank (indexing it with a variable would copy it to local memory). The
// ends increase, so the last run whose predecessor ends at or before o is the one holding it.
__device__ __forceinline__ const u8* gemv_row_of(const GemvParts& parts, int o, int k, int& format) {
    const u8* w = parts.part[0].w;
    int row0 = 0;
    format = parts.part[0].format;
#pragma unroll
    for (int q = 1; q < GEMV_MAX_PARTS; ++q) {
        if (q < parts.count && o >= parts.part[q - 1].end) {
            w = parts.part[q].w;
            format = parts.part[q].format;
            row0 = parts.part[q - 1].end;
        }
    }
    return w + (i64)(o - row0) * gemv_row_bytes(format, k);
}

// Row o's products with x, whichever run holds it. The format is the same for every lane of the warp, so the switch
// does not diverge. A matrix is packed or bf16 (DENSE) throughout, and each family is a kernel of its own: the bf16
// path's unrolled loads need twice the registers of the packed ones, which would otherwise halve every packed
// launch's occupancy.
template <bool DENSE>
__device__ __forceinline__ void gemv_any(const GemvParts& parts, int o, const bf16* __restrict__ x, int k, int n,
                                         int lane, float (&acc)[GEMV_MAX_ROWS]) {
    int format;
    const u8* row = gemv_row_of(parts, o, k, format);
    if (DENSE) {
        gemv_row<16, 8, chunk_bf16w, false, GEMV_UNROLL>(row, x, k, n, lane, acc);
        return;
    }
    switch (format) {
        case GEMV_Q4_K: gemv_row<144, 256, chunk_q4_k, true, 1>(row, x, k, n, lane, acc); break;
        case GEMV_Q5_0: gemv_row<22, 32, chunk_q5_0, false, 1>(row, x, k, n, lane, acc); break;
        case GEMV_Q6_K: gemv_row<210, 256, chunk_q6_k, false, 1>(row, x, k, n, lane, acc); break;
        case GEMV_Q8_0: gemv_row<34, 32, chunk_q8_0, false, 1>(row, x, k, n, lane, acc); break;
        case GEMV_FP8: gemv_row<132, 128, chunk_fp8, false, 1>(row, x, k, n, lane, acc); break;
        default: gemv_row<69, 128, chunk_int4, false, 1>(row, x, k, n, lane, acc); break;
    }
}

// y[r, col0 + o] = W[o] · x[r]: one warp per weight row o.
template <typename T, bool DENSE>
__device__ void gemv_plain(
    const GemvParts& w,          // rows 0 .. rows
    const bf16* __restrict__ x,  // [n, k]
    T* __restrict__ y,           // [n, ld]; row o of w lands in column col0 + o
    int rows, int k, int n, int ld, int col0) {
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const int o = blockIdx.x * GEMV_WARPS + warp;
    if (o >= rows) return;
    float acc[GEMV_MAX_ROWS];
    gemv_any<DENSE>(w, o, x, k, n, lane, acc);
    if (lane != 0) return;
    for (int r = 0; r < GEMV_MAX_ROWS; ++r) {
        if (r >= n) break;
        store_f32(y, (i64)r * ld + col0 + o, acc[r]);
    }
}

// out[r, o] = silu(W[o] · x[r]) · (W[f + o] · x[r]) over a gate_up matrix (gate rows 0 .. f, up rows f .. 2f): one
// warp per output column o < f, each product rounded as the gate_up GEMV's store would be, then silu_mul.cu's
// arithmetic.
template <typename T, bool DENSE>
__device__ void gemv_silu(
    const GemvParts& w,          // rows 0 .. 2f
    const bf16* __restrict__ x,  // [n, k]
    T* __restrict__ out,         // [n, f]
    int f, int k, int n) {
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const int o = blockIdx.x * GEMV_WARPS + warp;
    if (o >= f) return;
    float gate[GEMV_MAX_ROWS], up[GEMV_MAX_ROWS];
    gemv_any<DENSE>(w, o, x, k, n, lane, gate);
    gemv_any<DENSE>(w, f + o, x, k, n, lane, up);
    if (lane != 0) return;
    for (int r = 0; r < GEMV_MAX_ROWS; ++r) {
        if (r >= n) break;
        store_f32(out, (i64)r * f + o, silu_times(round_as(out, gate[r]), round_as(out, up[r])));
    }
}

// The fused QKV projection (rows: the q | k | v head list, head_dim each) with qkv.cu's epilogue: + bias, neox RoPE
// of q and k heads at positions[r], q heads to q_out[r], k and v heads to the cache at slot_mapping[r] (a negative
// slot or one past the pool writes nothing; a position outside the table leaves q and k unrotated). One warp per
// rotation pair: pair p is head p / half, rows j and j + half of it (j = p % half), so the warp holds both values
// RoPE mixes; v heads are paired the same way and not rotated.
template <typename T, bool DENSE>
__device__ void gemv_qkv(
    const GemvParts& w,                    // rows 0 .. (num_heads + 2·num_kv_heads)·head_dim
    const bf16* __restrict__ x,            // [n, k]
    const float* __restrict__ bias,        // [(num_heads + 2·num_kv_heads)·head_dim] or null
    const i32* __restrict__ positions,     // [n]
    const i64* __restrict__ slot_mapping,  // [n]
    const float* __restrict__ cos_sin,     // [max_positions, head_dim]: cos (half) | sin (half)
    T* __restrict__ q_out,                 // [n, num_heads·head_dim]
    T* __restrict__ k_cache,               // [num_slots, num_kv_heads·head_dim]
    T* __restrict__ v_cache,               // [num_slots, num_kv_heads·head_dim]
    int num_heads, int num_kv_heads, int head_dim, int k, int n, int max_positions, i64 num_slots) {
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const int half = head_dim / 2;
    const int p = blockIdx.x * GEMV_WARPS + warp;
    if (p >= (num_heads + 2 * num_kv_heads) * half) return;
    const int g = p / half, j = p % half;
    const int lo_row = g * head_dim + j;
    float lo_acc[GEMV_MAX_ROWS], hi_acc[GEMV_MAX_ROWS];
    gemv_any<DENSE>(w, lo_row, x, k, n, lane, lo_acc);
    gemv_any<DENSE>(w, lo_row + half, x, k, n, lane, hi_acc);
    if (lane != 0) return;
    // The head's place in the q | k | v list decides what it is and where it goes.
    const bool is_q = g < num_heads, is_v = g >= num_heads + num_kv_heads;
    const int col = (is_q ? g : g - num_heads - (is_v ? num_kv_heads : 0)) * head_dim + j;
    for (int r = 0; r < GEMV_MAX_ROWS; ++r) {
        if (r >= n) break;
        float lo = round_as(q_out, lo_acc[r]), hi = round_as(q_out, hi_acc[r]);
        if (bias) {
            lo = __fadd_rn(lo, bias[lo_row]);
            hi = __fadd_rn(hi, bias[lo_row + half]);
        }
        const i32 pos = positions[r];
        if (!is_v && pos >= 0 && pos < max_positions) {
            const float* cos = cos_sin + (i64)pos * head_dim;
            rope_rotate(lo, hi, cos[j], cos[half + j], lo, hi);
        }
        T* dst;
        if (is_q) {
            dst = q_out + (i64)r * num_heads * head_dim;
        } else {
            const i64 slot = slot_mapping[r];
            if (slot < 0 || slot >= num_slots) continue;
            dst = (is_v ? v_cache : k_cache) + slot * num_kv_heads * head_dim;
        }
        store_f32(dst, col, lo);
        store_f32(dst, col + half, hi);
    }
}

#define GEMV_KERNELS(T, DENSE, SUFFIX)                                                                            \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * WARP_SIZE)                                          \
        gemv_##SUFFIX(const GemvParts w, const bf16* __restrict__ x, T* __restrict__ y, int rows, int k, int n,   \
                      int ld, int col0) {                                                                         \
        gemv_plain<T, DENSE>(w, x, y, rows, k, n, ld, col0);                                                      \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * WARP_SIZE)                                          \
        gemv_silu_##SUFFIX(const GemvParts w, const bf16* __restrict__ x, T* __restrict__ out, int f, int k,      \
                           int n) {                                                                               \
        gemv_silu<T, DENSE>(w, x, out, f, k, n);                                                                  \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * WARP_SIZE) gemv_qkv_##SUFFIX(                       \
        const GemvParts w, const bf16* __restrict__ x, const float* __restrict__ bias,                            \
        const i32* __restrict__ positions, const i64* __restrict__ slot_mapping,                                  \
        const float* __restrict__ cos_sin, T* __restrict__ q_out, T* __restrict__ k_cache,                        \
        T* __restrict__ v_cache, int num_heads, int num_kv_heads, int head_dim, int k, int n, int max_positions,  \
        i64 num_slots) {                                                                                          \
        gemv_qkv<T, DENSE>(w, x, bias, positions, slot_mapping, cos_sin, q_out, k_cache, v_cache, num_heads,      \
                           num_kv_heads, head_dim, k, n, max_positions, num_slots);                               \
    }

// The suffix names the weights' family and the output dtype; activations are always bf16 (the executor's).
GEMV_KERNELS(float, false, packed_f32)
GEMV_KERNELS(bf16, false, packed_bf16)
GEMV_KERNELS(float, true, bf16w_f32)
GEMV_KERNELS(bf16, true, bf16w_bf16)

// ---------------------------------------------------------------------------------------------------------------------
// Steps of more rows than the GEMV takes (NOVAINFER_CUDA_PACKED_GEMM=tile): y[r, col0 + o] = Σ_k x[r, k] · W[o, k] on
// the tensor cores, W decoded a tile at a time into shared memory, so a block reads its weight rows once, packed,
// instead of the whole matrix being expanded to bf16 in global memory first and read back by cuBLAS.
// Twin: crates/novainfer-cuda/src/gemm_tile.rs (the thread and fragment arithmetic, lane by lane).
//
// A block (GEMM_TILE_THREADS = 4 warps) computes a GEMM_TILE_M × GEMM_TILE_N tile of y: activation rows m0 .. m0 + 64
// by weight rows n0 .. n0 + 64, over the k range blockIdx.z · k_split .. + k_split. A step of few rows over a narrow
// matrix (64 sequences by a 1536-row projection: 24 tiles) would leave most of the GPU idle, so the launcher splits k
// into ranges (gridDim.z, gemm_tile.rs's `splits`): each range's sums go to `partial`, and gemm_packed_reduce adds
// them in range order. Per GEMM_TILE_K step of k, thread p (and p + 128) copies piece p of the x tile
// (row p / 4, 8 values at 8·(p % 4)) and decodes chunk p of the W tile (weight row p / 4, chunk p % 4 of the step)
// into bf16, w = a·q − b rounded once: the expansion's values exactly (dequant.cu computes the same two operations).
// Rows past m or past the matrix are zeros. Warp w multiplies the 32 × 32 quarter at (32·(w / 2), 32·(w % 2)) with
// mma.sync m16n8k16 (bf16 in, f32 accumulate): 2 × 4 tiles, fragments loaded from shared memory 4 bytes at a time
// in the PTX ISA's layout (g = lane / 4, t = lane % 4):
//   A (x, 16 × 16, row-major):  a0 (g, 2t..2t+1)  a1 (g+8, 2t..)  a2 (g, 2t+8..)  a3 (g+8, 2t+8..)
//   B (Wᵀ, 16 × 8, a W row is a column):  b0 (k 2t..2t+1, n g)  b1 (k 2t+8.., n g)
//   D (16 × 8 f32):  d0, d1 (g, 2t, 2t+1)  d2, d3 (g+8, 2t, 2t+1)
// The sums' order is the tensor cores', not the GEMV's or cuBLAS's: the result equals the bf16 path's within f32
// rounding, and a row's result does not depend on the other rows of its step (each row's products are its own).
#define GEMM_TILE_M 64
#define GEMM_TILE_N 64
#define GEMM_TILE_K 32
#define GEMM_TILE_THREADS 128
// A shared row holds GEMM_TILE_K values and 8 of padding: 80 bytes, so the 8 rows g of a fragment load start on
// different bank groups, and every 16-byte piece stays aligned.
#define GEMM_TILE_ROW (GEMM_TILE_K + 8)

// Chunk c (8 values) of a packed weight row in `format`.
__device__ __forceinline__ Chunk packed_chunk(int format, const u8* row, int c) {
    switch (format) {
        case GEMV_Q4_K: return chunk_q4_k(row + (i64)(c / 32) * 144, c % 32);
        case GEMV_Q5_0: return chunk_q5_0(row + (i64)(c / 4) * 22, c % 4);
        case GEMV_Q6_K: return chunk_q6_k(row + (i64)(c / 32) * 210, c % 32);
        case GEMV_Q8_0: return chunk_q8_0(row + (i64)(c / 4) * 34, c % 4);
        case GEMV_FP8: return chunk_fp8(row + (i64)(c / 16) * 132, c % 16);
        default: return chunk_int4(row + (i64)(c / 16) * 69, c % 16);
    }
}

__device__ __forceinline__ u32 bf16_pair(float lo, float hi) {
    return (u32)f32_to_bf16(lo) | ((u32)f32_to_bf16(hi) << 16);
}

__device__ __forceinline__ u32 shared_word(const bf16* p) { return *reinterpret_cast<const u32*>(p); }

template <typename T>
__device__ void gemm_packed_tile(
    const GemvParts& w,          // rows 0 .. rows, packed
    const bf16* __restrict__ x,  // [m, k]
    T* __restrict__ y,           // [m, ld]; row o of w lands in column col0 + o
    float* __restrict__ partial, // [gridDim.z, m, rows] when k is split, else unused
    int rows, int k, int m, int ld, int col0, int k_split) {
    __shared__ __align__(16) bf16 xs[GEMM_TILE_M * GEMM_TILE_ROW];
    __shared__ __align__(16) bf16 ws[GEMM_TILE_N * GEMM_TILE_ROW];
    const int tid = threadIdx.x, warp = tid / WARP_SIZE, lane = tid % WARP_SIZE;
    const int n0 = blockIdx.x * GEMM_TILE_N, m0 = blockIdx.y * GEMM_TILE_M;
    const int wm = (warp / 2) * 32, wn = (warp % 2) * 32;
    const int g = lane / 4, t = lane % 4;
    constexpr int PIECES = GEMM_TILE_K / 8;  // 8-value pieces (chunks) of a tile row per step
    // Indexed with constants only (every loop over it unrolled), so it stays in registers.
    float acc[2][4][4];
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int ni = 0; ni < 4; ++ni)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mi][ni][e] = 0.0f;
    const int k_begin = blockIdx.z * k_split, k_end = min(k, k_begin + k_split);
    for (int k0 = k_begin; k0 < k_end; k0 += GEMM_TILE_K) {
        for (int p = tid; p < GEMM_TILE_M * PIECES; p += GEMM_TILE_THREADS) {
            const int r = p / PIECES, piece = p % PIECES;
            uint4 v = make_uint4(0u, 0u, 0u, 0u);
            if (m0 + r < m) v = *reinterpret_cast<const uint4*>(x + (i64)(m0 + r) * k + k0 + 8 * piece);
            *reinterpret_cast<uint4*>(xs + r * GEMM_TILE_ROW + 8 * piece) = v;
        }
        for (int p = tid; p < GEMM_TILE_N * PIECES; p += GEMM_TILE_THREADS) {
            const int r = p / PIECES, piece = p % PIECES;
            uint4 v = make_uint4(0u, 0u, 0u, 0u);
            if (n0 + r < rows) {
                int format;
                const u8* row = gemv_row_of(w, n0 + r, k, format);
                const Chunk ch = packed_chunk(format, row, k0 / 8 + piece);
                float wv[GEMV_CHUNK];
                for (int e = 0; e < GEMV_CHUNK; ++e) wv[e] = __fsub_rn(__fmul_rn(ch.a, ch.q[e]), ch.b);
                v = make_uint4(bf16_pair(wv[0], wv[1]), bf16_pair(wv[2], wv[3]), bf16_pair(wv[4], wv[5]),
                               bf16_pair(wv[6], wv[7]));
            }
            *reinterpret_cast<uint4*>(ws + r * GEMM_TILE_ROW + 8 * piece) = v;
        }
        __syncthreads();
#pragma unroll
        for (int ks = 0; ks < GEMM_TILE_K; ks += 16) {
            u32 a[2][4];
#pragma unroll
            for (int mi = 0; mi < 2; ++mi) {
                const bf16* base = xs + (wm + 16 * mi + g) * GEMM_TILE_ROW + ks + 2 * t;
                a[mi][0] = shared_word(base);
                a[mi][1] = shared_word(base + 8 * GEMM_TILE_ROW);
                a[mi][2] = shared_word(base + 8);
                a[mi][3] = shared_word(base + 8 * GEMM_TILE_ROW + 8);
            }
#pragma unroll
            for (int ni = 0; ni < 4; ++ni) {
                const bf16* base = ws + (wn + 8 * ni + g) * GEMM_TILE_ROW + ks + 2 * t;
                const u32 b0 = shared_word(base), b1 = shared_word(base + 8);
#pragma unroll
                for (int mi = 0; mi < 2; ++mi) mma_bf16_16816(acc[mi][ni], a[mi], b0, b1);
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) {
            const int c = n0 + wn + 8 * ni + 2 * t;
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int r = m0 + wm + 16 * mi + g + 8 * half;
                if (r >= m) continue;
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    if (c + j >= rows) continue;
                    if (gridDim.z == 1) {
                        store_f32(y, (i64)r * ld + col0 + c + j, acc[mi][ni][2 * half + j]);
                    } else {
                        partial[((i64)blockIdx.z * m + r) * rows + c + j] = acc[mi][ni][2 * half + j];
                    }
                }
            }
        }
    }
}

// y[r, col0 + o] = the k ranges' partial sums added in range order (a fixed order: the result does not depend on
// timing). A thread per output, looping over the grid.
template <typename T>
__device__ void gemm_packed_reduce(const float* __restrict__ partial, T* __restrict__ y, int rows, int m, int splits,
                                   int ld, int col0) {
    const i64 total = (i64)m * rows;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        const i64 r = i / rows, o = i % rows;
        float sum = partial[i];
        for (int z = 1; z < splits; ++z) sum = __fadd_rn(sum, partial[(i64)z * total + i]);
        store_f32(y, r * ld + col0 + o, sum);
    }
}

#define GEMM_TILE_KERNELS(T, SUFFIX)                                                                               \
    extern "C" __global__ void __launch_bounds__(GEMM_TILE_THREADS)                                               \
        gemm_packed_##SUFFIX(const GemvParts w, const bf16* __restrict__ x, T* __restrict__ y,                    \
                             float* __restrict__ partial, int rows, int k, int m, int ld, int col0, int k_split) { \
        gemm_packed_tile<T>(w, x, y, partial, rows, k, m, ld, col0, k_split);                                    \
    }                                                                                                             \
    extern "C" __global__ void gemm_packed_reduce_##SUFFIX(const float* __restrict__ partial, T* __restrict__ y,  \
                                                           int rows, int m, int splits, int ld, int col0) {       \
        gemm_packed_reduce<T>(partial, y, rows, m, splits, ld, col0);                                             \
    }

GEMM_TILE_KERNELS(float, f32)
GEMM_TILE_KERNELS(bf16, bf16)
