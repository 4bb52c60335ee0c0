// flash_prefill.cu — causal GQA prefill attention on tensor cores (FlashAttention-2 style)
// over the paged bf16 KV pool. Launcher: crates/novainfer-cuda/src/ops/flash_prefill.rs.
// CPU twin of every index below: crates/novainfer-cuda/src/flash_plan.rs (tested in CI).
//
// UNVERIFIED ON A GPU: written and compiled (NVRTC, sm_80/sm_90) on a machine without one.
// The executor runs it only with NOVAINFER_CUDA_PREFILL=flash; see docs/benchmarks.md.
//
// Inputs are those of `paged_attention_prefill` (kernels/paged_attention.cu): q
// [num_tokens, num_heads, HD]; the pool [num_blocks, block_size, num_kv_heads, HD] read
// through block_tables [num_seqs, max_blocks_per_seq]; sequence s owns tokens
// [qsl[s], qsl[s+1]); token t attends to positions 0 .. limit(t) − 1 with
//   limit(t) = min(positions[t] + 1, seq_lens[s])
// so a chunk of a prompt (or a prompt after a cached prefix) reads its history straight
// from the pool: nothing is copied.
//
// Work split. The query rows of one KV head's group are packed: packed row p of sequence s
// is token qsl[s] + p / group, query head kv_head · group + p % group. A CTA (4 warps) takes
// FLASH_BLOCK_M = 64 packed rows of one sequence and one KV head, so each K/V tile it loads
// serves every query head of the group (GQA reads each key once per CTA, not once per
// head). grid = (an upper bound on the tiles, num_kv_heads); CTA x finds its (sequence,
// first packed row) by a warp scan over the per-sequence tile counts (`locate_tile`); the
// CTAs past the last tile return at once. Warp w owns packed rows 16w .. 16w + 15: one m16
// row block of `mma.sync.m16n8k16` (bf16 in, f32 accumulate).
//
// Key tiles are FLASH_BLOCK_N = 64 positions at absolute multiples of 64 (0, 64, …), the
// same boundaries whatever chunk or CTA a row is in. With kv_end = max limit and
// full_end = min limit over the CTA's rows, tile [k0, k0 + 64):
//   k0 ≥ kv_end                       skipped (no row sees any of it)
//   k0 + 64 ≤ full_end, all present   full: no mask is evaluated
//   otherwise                         masked: key j of row r counts iff j < limit(r) and
//                                     its block-table entry names a block of the pool
// A masked-out key scores −inf, contributes p = 0, and its K/V are zero-filled by cp.async
// (0 · V stays 0; a stale NaN could not). So a row's result depends only on its q and its
// history: how the prompt was chunked and which rows share its CTA change nothing (the
// full and masked paths do the same arithmetic on the unmasked keys).
//
// Per tile (single K and V buffers, FA2's overlap):
//   wait K_j; barrier (also: every warp is done with V_{j−1}); issue V_j
//   S = Q·K_jᵀ (f32)                               ldmatrix (K rows are B's columns)
//   online softmax per row, exp2 with scale·log2(e) folded in:
//     m' = max(m, max_j s), a = 2^((m − m')·c), p_j = bf16(2^(s_j·c − m'·c))
//     l = l·a + Σ p_j (of the rounded p, so numerator and denominator use the same weights)
//   wait V_j; barrier (every warp is done with K_j); issue K_{j+1}
//   O = O·a + P·V_j                                P from S's registers; ldmatrix.trans for V
// out = O / l (quad-summed l), zeros for a row with no visible key (as the legacy kernel).
#include "common.cuh"

#define FLASH_BLOCK_M 64
#define FLASH_BLOCK_N 64
#define FLASH_WARPS 4
// bf16 of padding after each shared K/V/Q row: a row stride of HD + 8 elements puts the 8
// row addresses of an ldmatrix phase on 8 different 16-byte bank groups.
#define FLASH_PAD 8

struct FlashShape {
    int num_heads;
    int num_kv_heads;
    int block_size;
    int num_blocks;
    int max_blocks_per_seq;  // row stride of block_tables
    float scale_log2;        // log2(e) / sqrt(head_dim)
};

// ---- PTX wrappers ------------------------------------------------------------------------

#ifndef NOVAINFER_CUEMU
__device__ __forceinline__ u32 smem_u32(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
#endif

// 16 bytes global → shared, asynchronously; `valid` false writes 16 zero bytes instead
// (src-size 0: nothing is read).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
#ifdef NOVAINFER_CUEMU
    // A copy that has landed by the time the wait returns: the emulator copies at once.
    if (valid) {
        memcpy(smem, gmem, 16);
    } else {
        memset(smem, 0, 16);
    }
#else
    const int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(smem)),
                 "l"(gmem), "r"(n)
                 : "memory");
#endif
}
#ifdef NOVAINFER_CUEMU
__device__ __forceinline__ void cp_async_commit() {}
__device__ __forceinline__ void cp_async_wait_all() {}
#else
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }
#endif

// Four 8×8 b16 matrices; lanes 8i .. 8i + 7 give the row addresses of matrix i, and lane l
// receives, in register i, row l / 4, columns 2(l % 4), 2(l % 4) + 1 of matrix i (with
// .trans: column l / 4, rows 2(l % 4), 2(l % 4) + 1).
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], const void* row_addr) {
#ifdef NOVAINFER_CUEMU
    cuemu::ldmatrix_x4(r, row_addr, false);
#else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(row_addr))
                 : "memory");
#endif
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], const void* row_addr) {
#ifdef NOVAINFER_CUEMU
    cuemu::ldmatrix_x4(r, row_addr, true);
#else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(row_addr))
                 : "memory");
#endif
}

// 2^x, approximate (2 ulp), 2^−inf = +0.
__device__ __forceinline__ float ex2(float x) {
#ifdef NOVAINFER_CUEMU
    return exp2f(x);
#else
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
#endif
}

// (lo, hi) rounded to nearest-even bf16 and packed lo | hi << 16: the A fragment's order
// (the lower half holds the lower column).
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
#ifdef NOVAINFER_CUEMU
    return (u32)f32_to_bf16(lo) | ((u32)f32_to_bf16(hi) << 16);
#else
    u32 d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
#endif
}
__device__ __forceinline__ float lo_f32(u32 packed) { return __uint_as_float(packed << 16); }
__device__ __forceinline__ float hi_f32(u32 packed) { return __uint_as_float(packed & 0xffff0000u); }

// ---- Index arithmetic (mirrored by flash_plan.rs) ----------------------------------------

// Packed-row tiles of one sequence of n tokens.
__device__ __forceinline__ int seq_tiles(int n, int group) {
    return n > 0 ? (n * group + FLASH_BLOCK_M - 1) / FLASH_BLOCK_M : 0;
}

// The (sequence, first packed row) of CTA `cta`: sequences in order, each cut into
// seq_tiles() tiles. Every lane of the calling warp gets the answer; false past the last
// tile. 32 sequences per step: lane l counts sequence base + l, an inclusive shuffle scan
// adds them up, and a ballot finds the first sequence whose running total passes `cta`.
__device__ bool locate_tile(const i32* __restrict__ qsl, int num_seqs, int group, int cta,
                            int& seq, int& first_row) {
    const int lane = threadIdx.x % WARP_SIZE;
    int before = 0;
    for (int base = 0; base < num_seqs; base += WARP_SIZE) {
        const int s = base + lane;
        const int tiles = s < num_seqs ? seq_tiles(qsl[s + 1] - qsl[s], group) : 0;
        int incl = tiles;
#pragma unroll
        for (int o = 1; o < WARP_SIZE; o *= 2) {
            const int t = __shfl_up_sync(FULL_MASK, incl, o);
            if (lane >= o) incl += t;
        }
        const int total = __shfl_sync(FULL_MASK, incl, WARP_SIZE - 1);
        if (cta < before + total) {
            const u32 hit = __ballot_sync(FULL_MASK, before + incl > cta);
            const int l = __ffs(hit) - 1;
            const int excl = __shfl_sync(FULL_MASK, incl - tiles, l);
            seq = base + l;
            first_row = (cta - before - excl) * FLASH_BLOCK_M;
            return true;
        }
        before += total;
    }
    return false;
}

// Slot of position `pos` of a sequence, or −1 past its table row or for a block outside the
// pool (a runner bug: the key is masked, never read out of bounds). Same as paged_attention.cu.
__device__ __forceinline__ i64 flash_slot(const i32* table, int pos, const FlashShape& s) {
    const int index = pos / s.block_size;
    if (pos < 0 || index >= s.max_blocks_per_seq) return -1;
    const i32 block = table[index];
    if (block < 0 || block >= s.num_blocks) return -1;
    return (i64)block * s.block_size + pos % s.block_size;
}

// Issues the cp.async of one 64-key tile of K or V of `kv_head` (keys ≥ kv_end and keys
// without a slot are zero-filled). Thread t copies 16-byte pieces t, t + 128, …; piece c is
// piece c % PIECES of key c / PIECES. With `present`, records which keys have a slot.
// Returns whether every key this thread touched has one.
template <int HD>
__device__ __forceinline__ bool load_kv_tile(bf16* dst, const bf16* __restrict__ cache,
                                             const i32* __restrict__ table, const FlashShape& s,
                                             int kv_head, int k0, int kv_end, i32* present) {
    constexpr int PIECES = HD / 8;
    constexpr int ROW = HD + FLASH_PAD;
    const i64 kv_row = (i64)s.num_kv_heads * HD;
    bool ok = true;
#pragma unroll 4
    for (int c = threadIdx.x; c < FLASH_BLOCK_N * PIECES; c += FLASH_WARPS * WARP_SIZE) {
        const int key = c / PIECES;
        const int piece = c % PIECES;
        const int pos = k0 + key;
        const i64 slot = pos < kv_end ? flash_slot(table, pos, s) : -1;
        const bf16* src = slot >= 0 ? cache + slot * kv_row + (i64)kv_head * HD + piece * 8 : cache;
        cp_async16(dst + key * ROW + piece * 8, src, slot >= 0);
        ok = ok && slot >= 0;
        if (present != nullptr && piece == 0) present[key] = slot >= 0;
    }
    return ok;
}

template <int HD>
__device__ void flash_prefill(const bf16* __restrict__ q, const bf16* __restrict__ k_cache,
                              const bf16* __restrict__ v_cache, const i32* __restrict__ block_tables,
                              const i32* __restrict__ seq_lens, const i32* __restrict__ qsl,
                              const i32* __restrict__ positions, bf16* __restrict__ out,
                              int num_tokens, int num_seqs, FlashShape shape) {
    constexpr int ROW = HD + FLASH_PAD;
    constexpr int PIECES = HD / 8;
    constexpr int NT = FLASH_BLOCK_N / 8;  // 8-key n-tiles of S
    constexpr int DT = HD / 8;             // 8-dim n-tiles of O
    static_assert(FLASH_BLOCK_M == 16 * FLASH_WARPS, "one m16 row block per warp");
    static_assert(FLASH_BLOCK_M == FLASH_BLOCK_N, "Q is staged in the K buffer");
    __shared__ __align__(16) bf16 ks[FLASH_BLOCK_N * ROW];
    __shared__ __align__(16) bf16 vs[FLASH_BLOCK_N * ROW];
    __shared__ i32 limit_s[FLASH_BLOCK_M];  // limit of each packed row, −1: no such row
    __shared__ i32 present[FLASH_BLOCK_N];

    const int lane = threadIdx.x % WARP_SIZE;
    const int warp = threadIdx.x / WARP_SIZE;
    const int g = lane / 4;   // mma groupID: fragment rows g and g + 8
    const int tig = lane % 4; // thread in group: fragment columns 2·tig, 2·tig + 1
    if (blockDim.x != FLASH_WARPS * WARP_SIZE) return;  // launcher bug: uniform for the block
    const int group = shape.num_heads / shape.num_kv_heads;
    const int kv_head = blockIdx.y;
    int seq, first_row;
    if (!locate_tile(qsl, num_seqs, group, blockIdx.x, seq, first_row)) return;
    const int token0 = qsl[seq];
    const int packed_rows = (qsl[seq + 1] - token0) * group;
    const i32* table = block_tables + (i64)seq * shape.max_blocks_per_seq;

    // Row limits, and Q into the K buffer (zeros for rows past the sequence).
    if (threadIdx.x < FLASH_BLOCK_M) {
        const int p = first_row + threadIdx.x;
        int lim = -1;
        if (p < packed_rows) {
            const int token = token0 + p / group;
            // A token past the launch (query_start_loc disagrees with positions: a runner
            // bug) is no row: nothing is read or stored for it.
            lim = token < num_tokens ? max(0, min(positions[token] + 1, seq_lens[seq])) : -1;
        }
        limit_s[threadIdx.x] = lim;
    }
    for (int c = threadIdx.x; c < FLASH_BLOCK_M * PIECES; c += FLASH_WARPS * WARP_SIZE) {
        const int r = c / PIECES;
        const int p = first_row + r;
        const int token = token0 + p / group;
        const bool valid = p < packed_rows && token < num_tokens;
        const int head = kv_head * group + p % group;
        const bf16* src = valid ? q + ((i64)token * shape.num_heads + head) * HD + (c % PIECES) * 8 : q;
        cp_async16(ks + r * ROW + (c % PIECES) * 8, src, valid);
    }
    cp_async_commit();
    cp_async_wait_all();
    __syncthreads();

    // kv_end = max limit, full_end = min limit over the CTA's rows (every warp alike).
    int hi = max(limit_s[lane], limit_s[lane + 32]);
    int lo_a = limit_s[lane] < 0 ? 0x7fffffff : limit_s[lane];
    int lo_b = limit_s[lane + 32] < 0 ? 0x7fffffff : limit_s[lane + 32];
    int lo = min(lo_a, lo_b);
#pragma unroll
    for (int o = WARP_SIZE / 2; o > 0; o /= 2) {
        hi = max(hi, __shfl_xor_sync(FULL_MASK, hi, o));
        lo = min(lo, __shfl_xor_sync(FULL_MASK, lo, o));
    }
    const int kv_end = max(hi, 0);
    const int full_end = lo;
    const int r0 = warp * 16 + g;  // this thread's fragment rows r0, r0 + 8
    const int lim0 = limit_s[r0];
    const int lim1 = limit_s[r0 + 8];

    // Q fragments: A operand of k-step kk holds rows 16w .., dims 16kk ..; lane l addresses
    // row (l % 8) + 8·((l / 8) % 2), column 8·(l / 16) of the 16×16 block.
    u32 qf[HD / 16][4];
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
        const int row = warp * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
        const int col = kk * 16 + (lane / 16) * 8;
        ldmatrix_x4(qf[kk], ks + row * ROW + col);
    }
    __syncthreads();  // every warp holds its Q before K overwrites the buffer

    float o[DT][4];
#pragma unroll
    for (int d = 0; d < DT; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.0f;
    float m0 = NEG_INF, m1 = NEG_INF;  // running max of the raw scores of rows r0, r0 + 8
    float l0 = 0.0f, l1 = 0.0f;        // this thread's share of Σ p (its 2 columns per n-tile)
    const float c = shape.scale_log2;

    const int num_tiles = (kv_end + FLASH_BLOCK_N - 1) / FLASH_BLOCK_N;
    bool k_ok = true;
    if (num_tiles > 0) {
        k_ok = load_kv_tile<HD>(ks, k_cache, table, shape, kv_head, 0, kv_end, present);
        cp_async_commit();
    }
    for (int j = 0; j < num_tiles; ++j) {
        const int k0 = j * FLASH_BLOCK_N;
        cp_async_wait_all();
        const bool all_present = __syncthreads_and(k_ok) != 0;
        load_kv_tile<HD>(vs, v_cache, table, shape, kv_head, k0, kv_end, nullptr);
        cp_async_commit();

        // S = Q·Kᵀ. K rows are B's columns: lane l addresses key 8·(l / 16) + l % 8, dim
        // 8·((l / 8) % 2) of the 16-key × 16-dim block, giving (b0, b1) of keys n0 .. n0 + 7
        // in registers 0, 1 and of keys n0 + 8 .. n0 + 15 in 2, 3.
        float s[NT][4];
#pragma unroll
        for (int n = 0; n < NT; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
#pragma unroll
            for (int kk = 0; kk < HD / 16; ++kk) {
                u32 b[4];
                const int key = np * 16 + (lane % 8) + (lane / 16) * 8;
                const int dim = kk * 16 + ((lane / 8) % 2) * 8;
                ldmatrix_x4(b, ks + key * ROW + dim);
                mma_bf16_16816(s[2 * np], qf[kk], b[0], b[1]);
                mma_bf16_16816(s[2 * np + 1], qf[kk], b[2], b[3]);
            }
        }

        // The mask, on diagonal tiles and tiles with a key missing from the pool only.
        if (!(k0 + FLASH_BLOCK_N <= full_end && all_present)) {
#pragma unroll
            for (int n = 0; n < NT; ++n) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int key = n * 8 + tig * 2 + e;
                    const bool here = present[key] != 0;
                    if (!(here && k0 + key < lim0)) s[n][e] = NEG_INF;
                    if (!(here && k0 + key < lim1)) s[n][2 + e] = NEG_INF;
                }
            }
        }

        // Online softmax; a row's 64 scores live in its quad (4 lanes × 8 n-tiles × 2).
        float mx0 = NEG_INF, mx1 = NEG_INF;
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            mx0 = fmaxf(mx0, fmaxf(s[n][0], s[n][1]));
            mx1 = fmaxf(mx1, fmaxf(s[n][2], s[n][3]));
        }
#pragma unroll
        for (int off = 1; off < 4; off *= 2) {
            mx0 = fmaxf(mx0, __shfl_xor_sync(FULL_MASK, mx0, off));
            mx1 = fmaxf(mx1, __shfl_xor_sync(FULL_MASK, mx1, off));
        }
        const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
        // Subtract 0 while a row has seen only −inf: 2^(−inf) = 0, never 2^NaN.
        const float ref0 = mn0 == NEG_INF ? 0.0f : mn0;
        const float ref1 = mn1 == NEG_INF ? 0.0f : mn1;
        const float alpha0 = ex2(__fmul_rn(__fsub_rn(m0, ref0), c));
        const float alpha1 = ex2(__fmul_rn(__fsub_rn(m1, ref1), c));
        const float neg0 = -__fmul_rn(ref0, c), neg1 = -__fmul_rn(ref1, c);
        m0 = mn0;
        m1 = mn1;
        // P as the A operand of P·V: k-step kk (keys 16kk ..) takes S n-tiles 2kk, 2kk + 1.
        u32 pa[FLASH_BLOCK_N / 16][4];
        float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            const u32 top = pack_bf16x2(ex2(__fmaf_rn(s[n][0], c, neg0)), ex2(__fmaf_rn(s[n][1], c, neg0)));
            const u32 bot = pack_bf16x2(ex2(__fmaf_rn(s[n][2], c, neg1)), ex2(__fmaf_rn(s[n][3], c, neg1)));
            sum0 = __fadd_rn(__fadd_rn(sum0, lo_f32(top)), hi_f32(top));
            sum1 = __fadd_rn(__fadd_rn(sum1, lo_f32(bot)), hi_f32(bot));
            pa[n / 2][(n % 2) * 2] = top;      // a0 (n even) / a2 (n odd): row g
            pa[n / 2][(n % 2) * 2 + 1] = bot;  // a1 / a3: row g + 8
        }
        l0 = __fmaf_rn(l0, alpha0, sum0);
        l1 = __fmaf_rn(l1, alpha1, sum1);
#pragma unroll
        for (int d = 0; d < DT; ++d) {
            o[d][0] = __fmul_rn(o[d][0], alpha0);
            o[d][1] = __fmul_rn(o[d][1], alpha0);
            o[d][2] = __fmul_rn(o[d][2], alpha1);
            o[d][3] = __fmul_rn(o[d][3], alpha1);
        }

        cp_async_wait_all();
        __syncthreads();  // V_j is in; every warp is done reading K_j
        if (j + 1 < num_tiles) {
            k_ok = load_kv_tile<HD>(ks, k_cache, table, shape, kv_head, k0 + FLASH_BLOCK_N,
                                    kv_end, present);
            cp_async_commit();
        }

        // O += P·V. V rows are B's rows (keys), so .trans: lane l addresses key
        // 8·((l / 8) % 2) + l % 8, dim 8·(l / 16) of the 16-key × 16-dim block, giving (b0, b1)
        // of dims d0 .. d0 + 7 in registers 0, 1 and of dims d0 + 8 .. d0 + 15 in 2, 3.
#pragma unroll
        for (int kk = 0; kk < FLASH_BLOCK_N / 16; ++kk) {
#pragma unroll
            for (int dp = 0; dp < DT / 2; ++dp) {
                u32 b[4];
                const int key = kk * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
                const int dim = dp * 16 + (lane / 16) * 8;
                ldmatrix_x4_trans(b, vs + key * ROW + dim);
                mma_bf16_16816(o[2 * dp], pa[kk], b[0], b[1]);
                mma_bf16_16816(o[2 * dp + 1], pa[kk], b[2], b[3]);
            }
        }
    }

    // l over the quad (lane order fixed: (t0 + t1) + (t2 + t3) in every lane), then O / l.
    l0 = __fadd_rn(l0, __shfl_xor_sync(FULL_MASK, l0, 1));
    l0 = __fadd_rn(l0, __shfl_xor_sync(FULL_MASK, l0, 2));
    l1 = __fadd_rn(l1, __shfl_xor_sync(FULL_MASK, l1, 1));
    l1 = __fadd_rn(l1, __shfl_xor_sync(FULL_MASK, l1, 2));
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int r = r0 + half * 8;
        const int lim = half == 0 ? lim0 : lim1;
        const float l = half == 0 ? l0 : l1;
        if (lim < 0) continue;  // past the sequence's rows
        const int p = first_row + r;
        const int token = token0 + p / group;
        const int head = kv_head * group + p % group;
        const bool empty = lim == 0 || l == 0.0f;
        u32* dst = reinterpret_cast<u32*>(out + ((i64)token * shape.num_heads + head) * HD);
#pragma unroll
        for (int d = 0; d < DT; ++d) {
            const float x = empty ? 0.0f : __fdiv_rn(o[d][half * 2], l);
            const float y = empty ? 0.0f : __fdiv_rn(o[d][half * 2 + 1], l);
            dst[(d * 8 + tig * 2) / 2] = (u32)f32_to_bf16(x) | ((u32)f32_to_bf16(y) << 16);
        }
    }
}

#define FLASH_KERNELS(HD)                                                                        \
    extern "C" __global__ void __launch_bounds__(FLASH_WARPS * WARP_SIZE)                      \
        flash_prefill_bf16_hd##HD(const bf16* q, const bf16* k_cache, const bf16* v_cache,      \
                                  const i32* block_tables, const i32* seq_lens,                \
                                  const i32* query_start_loc, const i32* positions, bf16* out, \
                                  int num_tokens, int num_seqs, FlashShape shape) {           \
        flash_prefill<HD>(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,        \
                          positions, out, num_tokens, num_seqs, shape);                        \
    }

FLASH_KERNELS(64)
FLASH_KERNELS(128)
