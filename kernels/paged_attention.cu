// paged_attention.cu — causal attention over the paged KV pool, for decode and for
// (chunked) prefill, with grouped-query heads. Launcher: crates/novainfer-cuda/src/ops/paged_attention.rs.
//
// K/V of the step's own tokens are written into the pool first (reshape_and_cache), so
// every query row reads its whole history through its sequence's block table:
//
//   query row (token t, head h) at position p attends to positions 0..=p of its sequence
//   key/value of position j: pool[block_table[j / block_size] · block_size + j % block_size]
//                                [h / (num_heads / num_kv_heads)][0..head_dim]
//
// The canonical computation of one row — the thing that makes results batch invariant
// and identical between the decode and the prefill kernel — is fixed by absolute positions:
//
//   positions 0 … p, cut into splits of ATTN_SPLIT positions:  [0, 512) [512, 1024) … [.., p]
//   each split, cut into tiles of 32 positions, one key per lane:
//       scores s_j = (q · k_j) · scale        lanes own dims lane, lane+32, …; xor butterfly
//       online softmax inside the split       (m, l, acc) rescaled once per tile
//   splits merged in increasing order         (M, L, ACC) ← merge(M, L, ACC, m_s, l_s, acc_s)
//   out = ACC / L
//
// One warp computes one split of one row with `attend_split`; the decode kernels run the
// splits of a row in parallel (one warp each, partials in f32 scratch) and a second kernel
// merges them in split order; the prefill kernel runs them one after the other in one warp
// and merges as it goes. The grouped decode kernel (`decode_grouped`) puts the warps of the
// query heads sharing a KV head in one block, which stages each K/V row in shared memory
// once for all of them; the per-head one (`decode_splits`) reads the pool from each warp.
// All call the same `attend_split` and `merge` with every rounding spelled out
// (`__fmaf_rn`, `__fmul_rn`) — only where the K/V values are read from differs, never the
// values — so a row's bits depend only on q, its history and p — not on the batch, on how
// its prompt was chunked, or on which kernel ran it.
//
// Defences (the runner validates on the host, these keep a bad value from faulting):
//  * a block-table entry is read only below max_blocks_per_seq, and a block id outside the
//    pool masks the key (`slot_of`);
//  * masked keys score −inf; a tile, split or merge that has seen only −inf scores keeps
//    (m = −inf, l = 0, acc = 0) instead of computing exp(−inf − −inf) = NaN (`exp_ref`), and
//    a row with l = 0 stores zeros.
#include "common.cuh"

#define ATTN_TILE WARP_SIZE
#define ATTN_SPLIT 512
#define ATTN_WARPS 4

template <int HD>
struct AttnState {
    float m;             // running max of the scores seen
    float l;             // Σ exp(s − m)
    float acc[HD / 32];  // Σ exp(s − m) · v, dims lane + 32·r
};

template <int HD>
__device__ __forceinline__ void state_init(AttnState<HD>& st) {
    st.m = NEG_INF;
    st.l = 0.0f;
#pragma unroll
    for (int r = 0; r < HD / 32; ++r) st.acc[r] = 0.0f;
}

// The reference a running max is subtracted from: the max itself, or 0 while nothing but
// −inf has been seen, so that exp(−inf − ref) is 0 rather than exp(NaN). With a finite max
// the arithmetic is unchanged.
__device__ __forceinline__ float exp_ref(float m) { return m == NEG_INF ? 0.0f : m; }

// `total` ← `total` ⊕ `part`. Starting from the initial state, the first merge is exact.
template <int HD>
__device__ __forceinline__ void merge(AttnState<HD>& total, const AttnState<HD>& part) {
    const float m_new = fmaxf(total.m, part.m);
    const float ref = exp_ref(m_new);
    const float a = expf(__fsub_rn(total.m, ref));
    const float b = expf(__fsub_rn(part.m, ref));
    total.l = __fmaf_rn(total.l, a, __fmul_rn(part.l, b));
#pragma unroll
    for (int r = 0; r < HD / 32; ++r) {
        total.acc[r] = __fmaf_rn(total.acc[r], a, __fmul_rn(part.acc[r], b));
    }
    total.m = m_new;
}

struct KvLayout {
    int block_size;
    int num_blocks;
    int max_blocks_per_seq;  // length of one block-table row
    int kv_row;              // num_kv_heads · head_dim: values per slot
    int kv_head;             // which KV head this query head reads
};

// Slot of position `pos`, or −1 when the position lies past the block-table row or the table
// names a block outside the pool (a runner bug; the key is then masked instead of read out
// of bounds).
__device__ __forceinline__ i64 slot_of(const i32* block_table, int pos, const KvLayout& kv) {
    const int index = pos / kv.block_size;
    if (pos < 0 || index >= kv.max_blocks_per_seq) return -1;
    const i32 block = block_table[index];
    if (block < 0 || block >= kv.num_blocks) return -1;
    return (i64)block * kv.block_size + pos % kv.block_size;
}

// Where `attend_split` reads keys and values from. `begin_tile(tile, end)` is called by every
// warp before tile `tile` of a split ending at `end`; `tile_score` gives lane j the score of
// the tile's key j; `row(j)` is the offset of tile key j in `value`'s array, or −1 for a
// masked key. The two sources hand `attend_split` the same values (the shared one holds the
// pool's T values, widened by the same conversion) and compute a score with the same IEEE
// operations on the same operands, so the bits cannot depend on which one a kernel uses.
template <typename T, int HD>
struct PoolKv {  // straight from the pool: one warp, no cooperation
    const T* __restrict__ k_cache;
    const T* __restrict__ v_cache;
    const i32* __restrict__ block_table;
    KvLayout kv;
    int tile;

    __device__ __forceinline__ void begin_tile(int t, int /*end*/) { tile = t; }
    __device__ __forceinline__ i64 row(int j) const {
        const i64 slot = slot_of(block_table, tile + j, kv);
        return slot < 0 ? -1 : slot * kv.kv_row + (i64)kv.kv_head * HD;
    }
    __device__ __forceinline__ float key(i64 row, int d) const { return load_f32(k_cache, row + d); }
    __device__ __forceinline__ float value(i64 row, int d) const { return load_f32(v_cache, row + d); }

    // The canonical score of the tile's keys: for key j, lane l sums its dims l + 32·r in r
    // order (`__fmaf_rn` from 0), `warp_sum`'s xor butterfly adds the 32 partials, the sum is
    // multiplied by `scale`; lane j keeps key j's score (−inf when masked, and past n).
    __device__ __forceinline__ float tile_score(const float (&q)[HD / 32], int n, float scale) const {
        const int lane = threadIdx.x % WARP_SIZE;
        float my_score = NEG_INF;
        for (int j = 0; j < n; ++j) {
            const i64 row = this->row(j);
            float partial = 0.0f;
            if (row >= 0) {
#pragma unroll
                for (int r = 0; r < HD / 32; ++r) {
                    partial = __fmaf_rn(q[r], key(row, lane + 32 * r), partial);
                }
            }
            const float s = __fmul_rn(warp_sum(partial), scale);
            if (lane == j) my_score = row >= 0 ? s : NEG_INF;
        }
        return my_score;
    }
};

// One warp: positions [begin, end) of one row, `q` already in registers (dims lane + 32·r).
// Every rounding is spelled out; this function *is* the canonical computation of a split.
template <int HD, typename Kv>
__device__ void attend_split(const float (&q)[HD / 32], Kv& src, int begin, int end, float scale,
                             AttnState<HD>& st) {
    const int lane = threadIdx.x % WARP_SIZE;
    state_init(st);
    for (int tile = begin; tile < end; tile += ATTN_TILE) {
        src.begin_tile(tile, end);
        const int n = min(ATTN_TILE, end - tile);
        const float my_score = src.tile_score(q, n, scale);
        const float m_new = fmaxf(st.m, warp_max(my_score));
        const float ref = exp_ref(m_new);
        const float p = lane < n ? expf(__fsub_rn(my_score, ref)) : 0.0f;
        const float alpha = expf(__fsub_rn(st.m, ref));
        st.l = __fmaf_rn(st.l, alpha, warp_sum(p));
#pragma unroll
        for (int r = 0; r < HD / 32; ++r) st.acc[r] = __fmul_rn(st.acc[r], alpha);
        for (int j = 0; j < n; ++j) {
            const float pj = __shfl_sync(FULL_MASK, p, j);
            const i64 row = src.row(j);
            if (row < 0) continue;
#pragma unroll
            for (int r = 0; r < HD / 32; ++r) {
                st.acc[r] = __fmaf_rn(pj, src.value(row, lane + 32 * r), st.acc[r]);
            }
        }
        st.m = m_new;
    }
}

template <typename T, int HD>
__device__ __forceinline__ void load_q(const T* q_row, float (&q)[HD / 32]) {
    const int lane = threadIdx.x % WARP_SIZE;
#pragma unroll
    for (int r = 0; r < HD / 32; ++r) q[r] = load_f32(q_row, lane + 32 * r);
}

// Writes ACC / L, or zeros for an empty history (padding sequences of a graph bucket) or
// one whose every key was masked (l = 0: no unmasked key contributes exp(0) = 1).
template <typename T, int HD>
__device__ __forceinline__ void store_out(const AttnState<HD>& st, T* out_row, bool empty) {
    const int lane = threadIdx.x % WARP_SIZE;
    empty = empty || st.l == 0.0f;
#pragma unroll
    for (int r = 0; r < HD / 32; ++r) {
        store_f32(out_row, lane + 32 * r, empty ? 0.0f : __fdiv_rn(st.acc[r], st.l));
    }
}

struct AttnShape {
    int num_heads;
    int num_kv_heads;
    int block_size;
    int num_blocks;
    int max_blocks_per_seq;  // row stride of block_tables
    int max_splits;          // ⌈max seq_len / ATTN_SPLIT⌉: split stride of the scratch
    float scale;
};

__device__ __forceinline__ KvLayout kv_layout(const AttnShape& s, int head, int hd) {
    KvLayout kv;
    kv.block_size = s.block_size;
    kv.num_blocks = s.num_blocks;
    kv.max_blocks_per_seq = s.max_blocks_per_seq;
    kv.kv_row = s.num_kv_heads * hd;
    kv.kv_head = head / (s.num_heads / s.num_kv_heads);
    return kv;
}

// A split's (m, l, acc) into the decode scratch, for `decode_merge`.
template <int HD>
__device__ __forceinline__ void store_part(const AttnState<HD>& st, float* part_acc,
                                           float* part_ml, i64 part, int lane) {
#pragma unroll
    for (int r = 0; r < HD / 32; ++r) part_acc[part * HD + lane + 32 * r] = st.acc[r];
    if (lane == 0) {
        part_ml[part * 2] = st.m;
        part_ml[part * 2 + 1] = st.l;
    }
}

// Decode, phase 1. grid (⌈num_heads / ATTN_WARPS⌉, num_seqs, max_splits), ATTN_WARPS warps;
// warp w computes split blockIdx.z of head blockIdx.x · ATTN_WARPS + w of sequence blockIdx.y.
template <typename T, int HD>
__device__ void decode_splits(
    const T* __restrict__ q,              // [num_seqs, num_heads, HD]: one token per sequence
    const T* __restrict__ k_cache,        // [num_blocks, block_size, num_kv_heads, HD]
    const T* __restrict__ v_cache,        // [num_blocks, block_size, num_kv_heads, HD]
    const i32* __restrict__ block_tables, // [num_seqs, max_blocks_per_seq]
    const i32* __restrict__ seq_lens,     // [num_seqs]: history length including this token
    float* __restrict__ part_acc,         // [num_seqs, num_heads, max_splits, HD]
    float* __restrict__ part_ml,          // [num_seqs, num_heads, max_splits, 2]: m, l
    AttnShape shape) {
    const int lane = threadIdx.x % WARP_SIZE;
    const int head = blockIdx.x * ATTN_WARPS + threadIdx.x / WARP_SIZE;
    const int seq = blockIdx.y;
    const int split = blockIdx.z;
    if (head >= shape.num_heads) return;
    const int ctx = seq_lens[seq];
    const int begin = split * ATTN_SPLIT;
    if (begin >= ctx) return;
    const int end = min(begin + ATTN_SPLIT, ctx);
    float qr[HD / 32];
    load_q<T, HD>(q + ((i64)seq * shape.num_heads + head) * HD, qr);
    PoolKv<T, HD> src{k_cache, v_cache, block_tables + (i64)seq * shape.max_blocks_per_seq,
                      kv_layout(shape, head, HD), begin};
    AttnState<HD> st;
    attend_split<HD>(qr, src, begin, end, shape.scale, st);
    store_part<HD>(st, part_acc, part_ml,
                   ((i64)seq * shape.num_heads + head) * shape.max_splits + split, lane);
}

// ---- Decode, phase 1, grouped by KV head -------------------------------------------------
//
// The per-head kernel above reads each K/V row once per query head; with grouped-query
// attention `group` = num_heads / num_kv_heads heads read the same rows (7 for
// Qwen2.5-0.5B, 6 for the 1.5B). Here one block of `group` warps (or of a part of the
// group, see `decode_grouped`) takes one (KV head, sequence, split): the block copies the
// split's keys and values into shared memory with 16-byte loads, stage_keys() positions at
// a time (every thread has several loads in flight), and each warp then runs `attend_split` for its own query head over the staged copy, with
// the scores of a tile computed one key per lane (`StagedKv::tile_score`) rather than one
// key per warp-wide butterfly. The copy holds the pool's T values unchanged, widened exactly
// as the pool source widens them, and each score is the same IEEE operations in the same
// order, so every row gets the bits the per-head and prefill kernels give it.

// Query heads per KV head the grouped kernel takes (one warp each); the launcher uses the
// per-head kernel beyond that.
#define ATTN_MAX_GROUP 16
// Shared memory for one stage of K and V together, before the rows are padded by 16 bytes.
#define ATTN_STAGE_BYTES 32768
// 16-byte pieces of K (and as many of V) each thread loads per round of the staging loop.
#define STAGE_UNROLL 4

// Positions staged at once: a whole number of tiles that divides ATTN_SPLIT, so a stage never
// straddles a split (splits start at multiples of ATTN_SPLIT, stages at multiples of this
// from the split's start).
template <typename T, int HD>
__host__ __device__ constexpr int stage_keys() {
    return ATTN_STAGE_BYTES / (2 * HD * (int)sizeof(T)) < ATTN_TILE
               ? ATTN_TILE
               : ATTN_STAGE_BYTES / (2 * HD * (int)sizeof(T)) / ATTN_TILE * ATTN_TILE;
}

// 16 bytes, loaded and stored as one vector access.
struct alignas(16) Pack16 {
    u32 w[4];
};

// Element e of a Pack16 of T, widened to f32 exactly as `load_f32` widens it.
__device__ __forceinline__ float unpack(const Pack16& p, int e, const float*) {
    return __uint_as_float(p.w[e]);
}
__device__ __forceinline__ float unpack(const Pack16& p, int e, const bf16*) {
    return bf16_to_f32((bf16)(e % 2 == 0 ? p.w[e / 2] & 0xffffu : p.w[e / 2] >> 16));
}

// The sum `warp_sum` leaves in every lane, from the 32 lane partials held by one thread:
// the xor butterfly with offsets 16, 8, 4, 2, 1 adds, in lane 0's view,
//   a_i = p_i + p_{i+16} (i < 16), b_i = a_i + a_{i+8} (i < 8), c_i = b_i + b_{i+4} (i < 4),
//   d_i = c_i + c_{i+2} (i < 2), d_0 + d_1
// (lane 0 adds lane 8's a_8 = p_8 + p_24 to its a_0, and so on), and every lane ends with
// the same bits (each step adds the same two operands, and + is commutative).
// (Five loops with constant bounds, so that the array stays in registers.)
__device__ __forceinline__ float butterfly_sum(float (&p)[WARP_SIZE]) {
#pragma unroll
    for (int i = 0; i < 16; ++i) p[i] = __fadd_rn(p[i], p[i + 16]);
#pragma unroll
    for (int i = 0; i < 8; ++i) p[i] = __fadd_rn(p[i], p[i + 8]);
#pragma unroll
    for (int i = 0; i < 4; ++i) p[i] = __fadd_rn(p[i], p[i + 4]);
#pragma unroll
    for (int i = 0; i < 2; ++i) p[i] = __fadd_rn(p[i], p[i + 2]);
    return __fadd_rn(p[0], p[1]);
}

template <typename T, int HD>
struct StagedKv {
    static constexpr int KEYS = stage_keys<T, HD>();
    static constexpr int PIECES = HD * (int)sizeof(T) / 16;  // 16-byte pieces per K (or V) row
    static constexpr int PER_PIECE = 16 / (int)sizeof(T);    // elements per piece
    // A staged row is padded by one piece: lane j reads row j in `tile_score`, and a stride of
    // PIECES + 1 pieces puts the 8 lanes of each quarter-warp's 16-byte reads on 8 different
    // bank groups.
    static constexpr int ROW_PIECES = PIECES + 1;
    static constexpr int ROW = ROW_PIECES * PER_PIECE;  // elements per staged row
    static_assert((HD * (int)sizeof(T)) % 16 == 0, "a K/V row is a whole number of 16 bytes");
    static_assert(KEYS % ATTN_TILE == 0 && ATTN_SPLIT % KEYS == 0, "stages tile the split");

    const T* __restrict__ k_cache;
    const T* __restrict__ v_cache;
    const i32* __restrict__ block_table;
    KvLayout kv;
    int begin;     // the split's first position; stages start at begin + KEYS·i
    T* ks;         // shared [KEYS · ROW]: staged key of stage position i at ks[i · ROW]
    T* vs;         // shared [KEYS · ROW]
    i32* present;  // shared [KEYS]: 0 where the position is masked (no slot)
    const T* qs;   // shared [HD]: this warp's query row, as stored in q
    int offset;    // stage position of the current tile's key 0

    // Called by every thread of the block with the same (tile, end): the block's warps all
    // walk the same split, so the barriers are reached uniformly.
    __device__ __forceinline__ void begin_tile(int tile, int end) {
        offset = (tile - begin) % KEYS;
        if (offset != 0) return;
        const int count = min(KEYS, end - tile);
        __syncthreads();  // every warp is done reading the previous stage
        const int total = count * PIECES;
        // STAGE_UNROLL pieces of K and of V per thread are loaded before any is stored, so
        // 2·STAGE_UNROLL 16-byte loads per thread are in flight at once.
        for (int first = threadIdx.x; first < total; first += STAGE_UNROLL * blockDim.x) {
            Pack16 k[STAGE_UNROLL], v[STAGE_UNROLL];
            i32 ok[STAGE_UNROLL];
#pragma unroll
            for (int u = 0; u < STAGE_UNROLL; ++u) {
                const int c = first + u * blockDim.x;
                k[u] = Pack16{{0u, 0u, 0u, 0u}};
                v[u] = Pack16{{0u, 0u, 0u, 0u}};
                ok[u] = 0;
                if (c < total) {
                    const int i = c / PIECES;
                    const i64 slot = slot_of(block_table, tile + i, kv);
                    if (slot >= 0) {
                        const i64 at = slot * kv.kv_row + (i64)kv.kv_head * HD;
                        k[u] = reinterpret_cast<const Pack16*>(k_cache + at)[c - i * PIECES];
                        v[u] = reinterpret_cast<const Pack16*>(v_cache + at)[c - i * PIECES];
                        ok[u] = 1;
                    }
                }
            }
#pragma unroll
            for (int u = 0; u < STAGE_UNROLL; ++u) {
                const int c = first + u * blockDim.x;
                if (c < total) {
                    // Piece c is piece c % PIECES of stage position i = c / PIECES.
                    const int i = c / PIECES;
                    const int at = i * ROW_PIECES + (c - i * PIECES);
                    reinterpret_cast<Pack16*>(ks)[at] = k[u];
                    reinterpret_cast<Pack16*>(vs)[at] = v[u];
                    if (c - i * PIECES == 0) present[i] = ok[u];
                }
            }
        }
        __syncthreads();  // the stage is complete before any warp reads it
    }
    // Tile key j is stage position offset + j < count (a tile never runs past the split's end,
    // and a stage holds every position of the split from its start up to KEYS).
    __device__ __forceinline__ i64 row(int j) const {
        const int i = offset + j;
        return present[i] ? (i64)i * ROW : -1;
    }
    __device__ __forceinline__ float value(i64 row, int d) const { return load_f32(vs, row + d); }

    // `PoolKv::tile_score`'s bits with one key per lane instead of one key per step of the
    // warp: lane j forms the 32 partials p_l = Σ_r q[l + 32·r]·k_j[l + 32·r] itself (each in r
    // order with `__fmaf_rn` from 0, reading its key row 16 bytes at a time), adds them in
    // the butterfly's order, and multiplies by `scale`. No shuffles: 32 keys in flight per
    // warp instead of one.
    __device__ __forceinline__ float tile_score(const float (&)[HD / 32], int n,
                                                float scale) const {
        const int j = threadIdx.x % WARP_SIZE;
        if (j >= n || !present[offset + j]) return NEG_INF;
        const Pack16* k_row = reinterpret_cast<const Pack16*>(ks) + (offset + j) * ROW_PIECES;
        const Pack16* q_row = reinterpret_cast<const Pack16*>(qs);
        float p[WARP_SIZE];
#pragma unroll
        for (int l = 0; l < WARP_SIZE; ++l) p[l] = 0.0f;
        // Dim d = c · PER_PIECE + e feeds partial d % 32, after dims d − 32, d − 64, … .
#pragma unroll
        for (int c = 0; c < PIECES; ++c) {
            const Pack16 kp = k_row[c];
            const Pack16 qp = q_row[c];  // the same address in every lane: a broadcast
#pragma unroll
            for (int e = 0; e < PER_PIECE; ++e) {
                const int l = (c * PER_PIECE + e) % WARP_SIZE;
                p[l] = __fmaf_rn(unpack(qp, e, (const T*)nullptr), unpack(kp, e, (const T*)nullptr),
                                 p[l]);
            }
        }
        return __fmul_rn(butterfly_sum(p), scale);
    }
};

// grid (num_kv_heads · parts, num_seqs, max_splits), W ≤ group warps (W = blockDim.x / 32,
// parts = ⌈group / W⌉): block x takes heads part·W … part·W + W − 1 of the group of KV head
// x / parts (part = x % parts), one warp each. W = group reads each K/V row once; a smaller
// W makes `parts` times the blocks (the launcher's choice when the batch is too small to
// fill the GPU), each staging its own copy. A warp past the group's last head (when W does
// not divide the group) runs its block's last head again for the barriers and stores
// nothing. Writes the same partials as `decode_splits`, merged by `decode_merge`.
template <typename T, int HD>
__device__ void decode_grouped(
    const T* __restrict__ q,              // [num_seqs, num_heads, HD]
    const T* __restrict__ k_cache,        // [num_blocks, block_size, num_kv_heads, HD], 16-byte aligned
    const T* __restrict__ v_cache,        // [num_blocks, block_size, num_kv_heads, HD], 16-byte aligned
    const i32* __restrict__ block_tables, // [num_seqs, max_blocks_per_seq]
    const i32* __restrict__ seq_lens,     // [num_seqs]
    float* __restrict__ part_acc,         // [num_seqs, num_heads, max_splits, HD]
    float* __restrict__ part_ml,          // [num_seqs, num_heads, max_splits, 2]
    AttnShape shape) {
    using Kv = StagedKv<T, HD>;
    __shared__ __align__(16) T ks[Kv::KEYS * Kv::ROW];
    __shared__ __align__(16) T vs[Kv::KEYS * Kv::ROW];
    __shared__ __align__(16) T qs[ATTN_MAX_GROUP * HD];
    __shared__ i32 present[Kv::KEYS];
    static_assert(sizeof(ks) + sizeof(vs) + sizeof(qs) + sizeof(present) <= 48 * 1024,
                  "static shared memory");
    const int lane = threadIdx.x % WARP_SIZE;
    const int warp = threadIdx.x / WARP_SIZE;
    const int group = shape.num_heads / shape.num_kv_heads;
    const int per_block = blockDim.x / WARP_SIZE;
    // Every condition below is the same for the whole block, so no warp is left at a
    // barrier. A launch of another shape (a launcher bug) writes nothing rather than
    // attending with the wrong heads or past `qs`.
    if (blockDim.x % WARP_SIZE != 0 || per_block < 1 || per_block > group ||
        per_block > ATTN_MAX_GROUP)
        return;
    const int parts = (group + per_block - 1) / per_block;
    const int kv_head = blockIdx.x / parts;
    if (kv_head >= shape.num_kv_heads) return;
    const int in_group = (blockIdx.x % parts) * per_block + warp;
    const bool stores = in_group < group;
    const int head = kv_head * group + min(in_group, group - 1);
    const int seq = blockIdx.y;
    const int split = blockIdx.z;
    const int ctx = seq_lens[seq];
    const int begin = split * ATTN_SPLIT;
    if (begin >= ctx) return;
    const int end = min(begin + ATTN_SPLIT, ctx);
    const T* q_row = q + ((i64)seq * shape.num_heads + head) * HD;
    T* q_mine = qs + warp * HD;
    // The query as stored (T), widened at each use as `load_q` widens it.
#pragma unroll
    for (int r = 0; r < HD / 32; ++r) q_mine[lane + 32 * r] = q_row[lane + 32 * r];
    __syncwarp();  // the warp reads its whole row in `tile_score`
    const float no_q[HD / 32] = {};  // `tile_score` of the staged source reads `qs` instead
    Kv src{k_cache, v_cache, block_tables + (i64)seq * shape.max_blocks_per_seq,
           kv_layout(shape, head, HD), begin, ks, vs, present, q_mine, 0};
    AttnState<HD> st;
    attend_split<HD>(no_q, src, begin, end, shape.scale, st);
    if (!stores) return;
    store_part<HD>(st, part_acc, part_ml,
                   ((i64)seq * shape.num_heads + head) * shape.max_splits + split, lane);
}

// Decode, phase 2. grid (num_heads, num_seqs), one warp: merges the splits in order.
template <typename T, int HD>
__device__ void decode_merge(const i32* __restrict__ seq_lens, const float* __restrict__ part_acc,
                             const float* __restrict__ part_ml,
                             T* __restrict__ out,  // [num_seqs, num_heads, HD]
                             AttnShape shape) {
    const int lane = threadIdx.x % WARP_SIZE;
    const int head = blockIdx.x;
    const int seq = blockIdx.y;
    const int ctx = seq_lens[seq];
    // The launcher refuses a batch whose host-known max_seq_len exceeds the scratch; a device
    // seq_len that still does (the host and device disagree: a runner bug) is clamped so it
    // costs accuracy, never an out-of-bounds read.
    const int num_splits = min((ctx + ATTN_SPLIT - 1) / ATTN_SPLIT, shape.max_splits);
    AttnState<HD> total;
    state_init(total);
    for (int s = 0; s < num_splits; ++s) {
        const i64 part = ((i64)seq * shape.num_heads + head) * shape.max_splits + s;
        AttnState<HD> p;
        p.m = part_ml[part * 2];
        p.l = part_ml[part * 2 + 1];
#pragma unroll
        for (int r = 0; r < HD / 32; ++r) p.acc[r] = part_acc[part * HD + lane + 32 * r];
        merge(total, p);
    }
    store_out<T, HD>(total, out + ((i64)seq * shape.num_heads + head) * HD, ctx <= 0);
}

// Prefill / chunked prefill / mixed batches. grid ⌈num_tokens · num_heads / ATTN_WARPS⌉,
// ATTN_WARPS warps; warp w takes row blockIdx.x · ATTN_WARPS + w = token · num_heads + head.
template <typename T, int HD>
__device__ void prefill(
    const T* __restrict__ q,                 // [num_tokens, num_heads, HD]
    const T* __restrict__ k_cache,
    const T* __restrict__ v_cache,
    const i32* __restrict__ block_tables,    // [num_seqs, max_blocks_per_seq]
    const i32* __restrict__ seq_lens,        // [num_seqs]
    const i32* __restrict__ query_start_loc, // [num_seqs + 1]: sequence s owns tokens [qsl[s], qsl[s+1])
    const i32* __restrict__ positions,       // [num_tokens]
    T* __restrict__ out,                     // [num_tokens, num_heads, HD]
    int num_tokens,
    int num_seqs,
    AttnShape shape) {
    const i64 row = (i64)blockIdx.x * ATTN_WARPS + threadIdx.x / WARP_SIZE;
    if (row >= (i64)num_tokens * shape.num_heads) return;
    const int token = (int)(row / shape.num_heads);
    const int head = (int)(row % shape.num_heads);
    // The sequence owning `token`: the last s with query_start_loc[s] <= token.
    int lo = 0, hi = num_seqs - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (query_start_loc[mid] <= token) lo = mid; else hi = mid - 1;
    }
    const int seq = lo;
    const int ctx = min(positions[token] + 1, seq_lens[seq]);
    float qr[HD / 32];
    load_q<T, HD>(q + row * HD, qr);
    PoolKv<T, HD> src{k_cache, v_cache, block_tables + (i64)seq * shape.max_blocks_per_seq,
                      kv_layout(shape, head, HD), 0};
    AttnState<HD> total;
    state_init(total);
    for (int begin = 0; begin < ctx; begin += ATTN_SPLIT) {
        AttnState<HD> part;
        attend_split<HD>(qr, src, begin, min(begin + ATTN_SPLIT, ctx), shape.scale, part);
        merge(total, part);
    }
    store_out<T, HD>(total, out + row * HD, ctx <= 0);
}

#define ATTENTION_KERNELS(T, SUFFIX, HD)                                                       \
    extern "C" __global__ void paged_attention_decode_##SUFFIX##_hd##HD(                       \
        const T* q, const T* k_cache, const T* v_cache, const i32* block_tables,               \
        const i32* seq_lens, float* part_acc, float* part_ml, AttnShape shape) {               \
        decode_splits<T, HD>(q, k_cache, v_cache, block_tables, seq_lens, part_acc, part_ml,   \
                             shape);                                                           \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(ATTN_MAX_GROUP * WARP_SIZE)                 \
        paged_attention_decode_grouped_##SUFFIX##_hd##HD(                                      \
            const T* q, const T* k_cache, const T* v_cache, const i32* block_tables,           \
            const i32* seq_lens, float* part_acc, float* part_ml, AttnShape shape) {           \
        decode_grouped<T, HD>(q, k_cache, v_cache, block_tables, seq_lens, part_acc, part_ml,  \
                              shape);                                                          \
    }                                                                                          \
    extern "C" __global__ void paged_attention_merge_##SUFFIX##_hd##HD(                        \
        const i32* seq_lens, const float* part_acc, const float* part_ml, T* out,              \
        AttnShape shape) {                                                                     \
        decode_merge<T, HD>(seq_lens, part_acc, part_ml, out, shape);                          \
    }                                                                                          \
    extern "C" __global__ void paged_attention_prefill_##SUFFIX##_hd##HD(                      \
        const T* q, const T* k_cache, const T* v_cache, const i32* block_tables,               \
        const i32* seq_lens, const i32* query_start_loc, const i32* positions, T* out,         \
        int num_tokens, int num_seqs, AttnShape shape) {                                       \
        prefill<T, HD>(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,           \
                       positions, out, num_tokens, num_seqs, shape);                           \
    }

ATTENTION_KERNELS(float, f32, 64)
ATTENTION_KERNELS(float, f32, 128)
ATTENTION_KERNELS(bf16, bf16, 64)
ATTENTION_KERNELS(bf16, bf16, 128)
ATTENTION_KERNELS(bf16, bf16, 256)
