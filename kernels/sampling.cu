// sampling.cu — greedy argmax, and temperature / top-k / top-p / min-p sampling with a
// per-row counter-based RNG; `draw` runs either per row of a step and adds the token's raw
// logprob, so a step returns ids instead of logits. Launcher: crates/novainfer-cuda/src/ops/sampling.rs.
//
// One block of SAMPLE_THREADS threads per row, whatever the number of rows; thread t owns
// the contiguous ids [t·chunk, (t+1)·chunk). Every sum is per-thread in id order, then a
// fixed-order block reduction or a sequential prefix by thread 0; counts are integers.
// So a row's token depends only on its logits, its parameters and (seed, offset).
//
// Semantics follow the CPU sampler (crates/novainfer-model/src/sampler): NaN counts as
// −inf; d = (x − max) · (1/temperature) ≤ 0 ranks tokens (d descending, then id ascending,
// a total order); top-k keeps the first k ranks; top-p then keeps the shortest rank prefix
// of the top-k tokens holding top_p of their mass; min-p keeps d ≥ ln(min_p). The rank cut
// of top-k and top-p is a pair (key, id) found by radix select / binary search on
// key = bits(|d|) (monotone: a smaller key ranks higher) plus the id among equal keys.
// The draw walks the survivors in id order (not rank order, unlike the CPU) against
// u · Σw with u from Philox4x32-10 (key = seed, counter = offset): the same distribution,
// a different stream than the CPU's ChaCha8.
#include "common.cuh"

#define SAMPLE_THREADS 1024

// Ranks at or above (key, id) survive.
struct RankCut {
    u32 key;
    u32 id;
};

// Per-row parameters; the Rust twin is `SampleParams` in ops/sampling.rs (32 bytes).
struct SampleParams {
    u64 seed;
    u64 offset;             // which draw of this sequence (its number of sampled tokens)
    float inv_temperature;  // > 0
    float top_p;            // (0, 1]; 1 disables
    float min_p;            // [0, 1]; 0 disables
    i32 top_k;              // ≤ 0 or ≥ vocab disables
};

__device__ __forceinline__ float sanitize(float x) {
    // NaN → −inf, +inf → f32::MAX (as the CPU's `row_math::sanitize`).
    if (x != x) return NEG_INF;
    if (x == -NEG_INF) return 3.4028234663852886e38f;
    return x;
}

__device__ __forceinline__ u32 key_of(float d) { return __float_as_uint(fabsf(d)); }

__device__ __forceinline__ bool survives(u32 key, u32 id, RankCut c) {
    return key < c.key || (key == c.key && id <= c.id);
}

// Philox4x32-10 (Salmon et al., SC'11; Random123): 10 rounds of two 32×32→64 products.
__device__ void philox4x32_10(u32 ctr[4], u32 key0, u32 key1) {
    for (int round = 0; round < 10; ++round) {
        if (round > 0) {
            key0 += 0x9E3779B9u;
            key1 += 0xBB67AE85u;
        }
        const u32 hi0 = __umulhi(0xD2511F53u, ctr[0]);
        const u32 lo0 = 0xD2511F53u * ctr[0];
        const u32 hi1 = __umulhi(0xCD9E8D57u, ctr[2]);
        const u32 lo1 = 0xCD9E8D57u * ctr[2];
        const u32 c1 = ctr[1], c3 = ctr[3];
        ctr[0] = hi1 ^ c1 ^ key0;
        ctr[1] = lo1;
        ctr[2] = hi0 ^ c3 ^ key1;
        ctr[3] = lo0;
    }
}

// A uniform float in [0, 1): the top 24 bits of the first Philox word.
__device__ __forceinline__ float philox_uniform(u64 seed, u64 offset) {
    u32 ctr[4] = {(u32)offset, (u32)(offset >> 32), 0u, 0u};
    philox4x32_10(ctr, (u32)seed, (u32)(seed >> 32));
    return (float)(ctr[0] >> 8) * 5.9604644775390625e-8f;
}

__device__ __forceinline__ u32 block_sum_u32(u32 v, u32* scratch) {
    // Integer sums are exact in any order; the shape mirrors block_sum.
    const int lane = threadIdx.x % WARP_SIZE;
    const int warp = threadIdx.x / WARP_SIZE;
    for (int o = WARP_SIZE / 2; o > 0; o /= 2) v += __shfl_xor_sync(FULL_MASK, v, o);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    if (warp == 0) {
        u32 w = lane < (int)(blockDim.x / WARP_SIZE) ? scratch[lane] : 0u;
        for (int o = WARP_SIZE / 2; o > 0; o /= 2) w += __shfl_xor_sync(FULL_MASK, w, o);
        if (lane == 0) scratch[0] = w;
    }
    __syncthreads();
    const u32 total = scratch[0];
    __syncthreads();
    return total;
}

struct RowCtx {
    const float* d;   // [vocab]: (x − max) · inv_temperature, in the scratch buffer
    int vocab;
    int begin, end;   // this thread's ids
    float log_min_p;  // −inf when min-p is off
};

// Inside the rank cut (top-k and top-p only look at ranks).
__device__ __forceinline__ bool in_cut(const RowCtx& r, int i, RankCut cut) {
    return survives(key_of(r.d[i]), (u32)i, cut);
}

// A candidate of the draw: inside the cut and past min-p, which applies last.
__device__ __forceinline__ bool alive(const RowCtx& r, int i, RankCut cut) {
    return in_cut(r, i, cut) && r.d[i] >= r.log_min_p;
}

// Σ exp(d) over ids inside `cut` with key ≤ max_key, in a fixed order.
__device__ float mass(const RowCtx& r, RankCut cut, u32 max_key, float* fscratch) {
    float s = 0.0f;
    for (int i = r.begin; i < r.end; ++i) {
        if (in_cut(r, i, cut) && key_of(r.d[i]) <= max_key) s = __fadd_rn(s, expf(r.d[i]));
    }
    return block_sum(s, fscratch);
}

// The id of the n-th (1-based, n ≥ 1) token inside `cut` with key `key`, in id order.
__device__ u32 nth_id_with_key(const RowCtx& r, RankCut cut, u32 key, u32 n, u32* counts,
                               u32* result) {
    u32 c = 0;
    for (int i = r.begin; i < r.end; ++i) c += (in_cut(r, i, cut) && key_of(r.d[i]) == key);
    counts[threadIdx.x] = c;
    __syncthreads();
    if (threadIdx.x == 0) {
        u32 before = 0;
        result[0] = blockDim.x;  // owner thread
        for (u32 t = 0; t < blockDim.x; ++t) {
            if (before + counts[t] >= n) {
                result[0] = t;
                result[1] = n - before;
                break;
            }
            before += counts[t];
        }
        result[2] = cut.id;  // fallback: keep the old cut (n larger than the tie count)
    }
    __syncthreads();
    if (threadIdx.x == result[0]) {
        u32 seen = 0;
        for (int i = r.begin; i < r.end; ++i) {
            if (in_cut(r, i, cut) && key_of(r.d[i]) == key && ++seen == result[1]) {
                result[2] = (u32)i;
                break;
            }
        }
    }
    __syncthreads();
    const u32 id = result[2];
    __syncthreads();
    return id;
}

// Top-k as a rank cut: radix select of the k-th smallest key (8 bits a pass), then the id.
__device__ RankCut top_k_cut(const RowCtx& r, int k, u32* hist, u32* counts, u32* result) {
    const RankCut all = {0xffffffffu, 0xffffffffu};
    u32 prefix = 0;
    u32 remaining = (u32)k;
    for (int pass = 0; pass < 4; ++pass) {
        const int shift = 24 - 8 * pass;
        const u32 high_mask = pass == 0 ? 0u : (0xffffffffu << (shift + 8));
        for (int b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0;
        __syncthreads();
        for (int i = r.begin; i < r.end; ++i) {
            const u32 key = key_of(r.d[i]);
            if ((key & high_mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1u);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            u32 below = 0;
            for (u32 b = 0; b < 256; ++b) {
                if (below + hist[b] >= remaining) {
                    result[0] = prefix | (b << shift);
                    result[1] = remaining - below;
                    break;
                }
                below += hist[b];
            }
        }
        __syncthreads();
        prefix = result[0];
        remaining = result[1];
        __syncthreads();
    }
    RankCut cut;
    cut.key = prefix;
    cut.id = nth_id_with_key(r, all, prefix, remaining, counts, result);
    return cut;
}

// Top-p within `cut`: the shortest rank prefix holding top_p of the mass.
__device__ RankCut top_p_cut(const RowCtx& r, RankCut cut, float top_p, float* fscratch,
                             u32* counts, u32* result) {
    const float target = __fmul_rn(top_p, mass(r, cut, 0xffffffffu, fscratch));
    u32 lo = 0, hi = 0x7f800000u;
    while (lo < hi) {
        const u32 mid = lo + (hi - lo) / 2;
        if (mass(r, cut, mid, fscratch) >= target) hi = mid; else lo = mid + 1;
    }
    const float below = lo == 0 ? 0.0f : mass(r, cut, lo - 1, fscratch);
    u32 ties = 0;
    for (int i = r.begin; i < r.end; ++i) ties += (in_cut(r, i, cut) && key_of(r.d[i]) == lo);
    ties = block_sum_u32(ties, counts);
    const float w = expf(-__uint_as_float(lo));
    u32 needed = ties;
    if (w > 0.0f) {
        const float n = ceilf(__fdiv_rn(__fsub_rn(target, below), w));
        needed = n < 1.0f ? 1u : (n >= (float)ties ? ties : (u32)n);
    }
    if (ties == 0) return cut;
    RankCut out;
    out.key = lo;
    out.id = nth_id_with_key(r, cut, lo, needed, counts, result);
    return out;
}

template <typename T>
__device__ void sample_row(const T* __restrict__ logits,   // [rows, vocab]
                           const SampleParams* __restrict__ params,  // [rows]
                           float* __restrict__ scratch,    // [rows, vocab]
                           u32* __restrict__ out,          // [rows]
                           int vocab) {
    __shared__ float fscratch[WARP_SIZE];
    __shared__ u32 hist[256];
    __shared__ u32 counts[SAMPLE_THREADS];
    __shared__ float partial[SAMPLE_THREADS];
    __shared__ u32 result[4];
    const i64 row = blockIdx.x;
    const SampleParams p = params[row];
    const T* x = logits + row * vocab;
    const int chunk = (vocab + blockDim.x - 1) / blockDim.x;
    RowCtx r;
    r.d = scratch + row * vocab;
    r.vocab = vocab;
    r.begin = min((int)threadIdx.x * chunk, vocab);
    r.end = min(r.begin + chunk, vocab);
    r.log_min_p = p.min_p > 0.0f ? logf(p.min_p) : NEG_INF;

    float local_max = NEG_INF;
    for (int i = r.begin; i < r.end; ++i) local_max = fmaxf(local_max, sanitize(load_f32(x, i)));
    const float max = block_max(local_max, fscratch);
    if (max == NEG_INF) {
        if (threadIdx.x == 0) out[row] = 0;
        return;
    }
    float* d = scratch + row * vocab;
    for (int i = r.begin; i < r.end; ++i) {
        d[i] = __fmul_rn(__fsub_rn(sanitize(load_f32(x, i)), max), p.inv_temperature);
    }
    __syncthreads();

    RankCut cut = {0xffffffffu, 0xffffffffu};
    if (p.top_k > 0 && p.top_k < vocab) cut = top_k_cut(r, p.top_k, hist, counts, result);
    if (p.top_p < 1.0f) cut = top_p_cut(r, cut, p.top_p, fscratch, counts, result);

    // The draw: thread sums in id order, a sequential prefix by thread 0, then one chunk.
    float s = 0.0f;
    int last_alive = -1;
    for (int i = r.begin; i < r.end; ++i) {
        if (alive(r, i, cut)) {
            s = __fadd_rn(s, expf(d[i]));
            if (d[i] > NEG_INF) last_alive = i;
        }
    }
    partial[threadIdx.x] = s;
    counts[threadIdx.x] = (u32)(last_alive + 1);
    __syncthreads();
    if (threadIdx.x == 0) {
        float total = 0.0f;
        u32 fallback = 0;
        for (u32 t = 0; t < blockDim.x; ++t) {
            const float before = total;
            total = __fadd_rn(total, partial[t]);
            partial[t] = before;  // now the exclusive prefix
            if (counts[t] > 0) fallback = counts[t] - 1;
        }
        const float target = __fmul_rn(philox_uniform(p.seed, p.offset), total);
        result[0] = blockDim.x;
        result[1] = fallback;
        for (u32 t = 0; t < blockDim.x; ++t) {
            const float end = t + 1 < blockDim.x ? partial[t + 1] : total;
            if (end > target) {
                result[0] = t;
                break;
            }
        }
        fscratch[0] = target;
    }
    __syncthreads();
    if (threadIdx.x == result[0]) {
        // The walk repeats this thread's own sum s (from 0, same order) and adds it to the prefix the
        // way thread 0 did: at its last live id it reaches exactly the `end` that chose this thread,
        // so it always crosses the target. Summing from the prefix instead rounds differently and can
        // stop short, leaving the row's last live id as the draw.
        // Twin: crates/novainfer-cuda/src/draw_walk.rs.
        const float target = fscratch[0];
        const float before = partial[threadIdx.x];
        float local = 0.0f;
        for (int i = r.begin; i < r.end; ++i) {
            if (!alive(r, i, cut)) continue;
            local = __fadd_rn(local, expf(d[i]));
            if (__fadd_rn(before, local) > target) {
                result[1] = (u32)i;
                break;
            }
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) out[row] = result[1];
}

// Greedy: the first index of the maximum (lowest id on ties), NaN as −inf.
template <typename T>
__device__ void argmax_row(const T* __restrict__ logits, u32* __restrict__ out, int vocab) {
    __shared__ float best_v[WARP_SIZE];
    __shared__ u32 best_i[WARP_SIZE];
    const i64 row = blockIdx.x;
    const T* x = logits + row * vocab;
    float v = NEG_INF;
    u32 idx = 0xffffffffu;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float xi = sanitize(load_f32(x, i));
        if (xi > v || (xi == v && (u32)i < idx)) {
            v = xi;
            idx = (u32)i;
        }
    }
    // (max, lowest index) is associative and exact, so the tree shape cannot change it.
    for (int o = WARP_SIZE / 2; o > 0; o /= 2) {
        const float ov = __shfl_xor_sync(FULL_MASK, v, o);
        const u32 oi = __shfl_xor_sync(FULL_MASK, idx, o);
        if (ov > v || (ov == v && oi < idx)) {
            v = ov;
            idx = oi;
        }
    }
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    if (lane == 0) {
        best_v[warp] = v;
        best_i[warp] = idx;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x / WARP_SIZE); ++w) {
            if (best_v[w] > v || (best_v[w] == v && best_i[w] < idx)) {
                v = best_v[w];
                idx = best_i[w];
            }
        }
        out[row] = idx == 0xffffffffu ? 0u : idx;
    }
}

// The raw logprob of row `blockIdx.x`'s token ids[row]: x[id] − max − ln Σ exp(x − max) over
// the sanitized row, the engine sampler's `log_softmax` of the raw logits (sums per thread in
// id order, then the block's fixed tree, as everywhere here). −inf for an all −inf row or an
// id past the vocabulary.
template <typename T>
__device__ void token_logprob_row(const T* __restrict__ logits, const u32* ids,
                                  float* __restrict__ out, int vocab) {
    __shared__ float fscratch[WARP_SIZE];
    const i64 row = blockIdx.x;
    const T* x = logits + row * vocab;
    const int chunk = (vocab + blockDim.x - 1) / blockDim.x;
    const int begin = min((int)threadIdx.x * chunk, vocab);
    const int end = min(begin + chunk, vocab);
    float local_max = NEG_INF;
    for (int i = begin; i < end; ++i) local_max = fmaxf(local_max, sanitize(load_f32(x, i)));
    const float max = block_max(local_max, fscratch);
    if (max == NEG_INF) {
        if (threadIdx.x == 0) out[row] = NEG_INF;
        return;
    }
    float s = 0.0f;
    for (int i = begin; i < end; ++i) s = __fadd_rn(s, expf(__fsub_rn(sanitize(load_f32(x, i)), max)));
    const float total = block_sum(s, fscratch);
    if (threadIdx.x == 0) {
        const u32 id = ids[row];
        const float xi = id < (u32)vocab ? sanitize(load_f32(x, (int)id)) : NEG_INF;
        out[row] = __fsub_rn(__fsub_rn(xi, max), logf(total));
    }
}

// One token's change before a drawn row is sampled (`RowEdit` in sample_params.rs, 16 bytes):
// penalise (EDIT_PENALIZE), add `bias`, then −inf (EDIT_MASK), the engine sampler's order.
struct RowEdit {
    u32 token_id;
    u32 output_count;
    u32 flags;
    float bias;
};
#define EDIT_PENALIZE 1u
#define EDIT_IN_PROMPT 2u
#define EDIT_MASK 4u

// The penalty strengths of a row (`RowPenalties`, 16 bytes).
struct RowPenalties {
    float repetition;
    float frequency;
    float presence;
    float pad;
};

// The engine sampler's penalty rule with its roundings (`RowPenalties::penalize`): repetition
// divides a positive logit and multiplies a negative one, then frequency × count and presence
// are subtracted, each product and difference rounded on its own (no fused multiply-add).
__device__ __forceinline__ float penalize(float x, RowPenalties p, bool in_prompt, u32 count) {
    if (in_prompt || count > 0) x = x > 0.0f ? __fdiv_rn(x, p.repetition) : __fmul_rn(x, p.repetition);
    if (count > 0) {
        x = __fsub_rn(x, __fmul_rn(p.frequency, (float)count));
        x = __fsub_rn(x, p.presence);
    }
    return x;
}

// grid (rows), a block per row. A drawn row with edits (offsets[row] < offsets[row + 1]) is
// copied, sanitized, into `adjusted` and its edits applied; other rows are left alone (`draw`
// samples them from the raw logits). Each edit names a distinct token, so threads may apply
// them in any order.
template <typename T>
__device__ void adjust_row(const T* __restrict__ logits, float* __restrict__ adjusted,
                           const i32* __restrict__ offsets, const RowEdit* __restrict__ edits,
                           const RowPenalties* __restrict__ penalties, int vocab) {
    const i64 row = blockIdx.x;
    const int begin = offsets[row], end = offsets[row + 1];
    if (begin >= end) return;
    const T* x = logits + row * vocab;
    float* y = adjusted + row * vocab;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) y[i] = sanitize(load_f32(x, i));
    __syncthreads();
    const RowPenalties p = penalties[row];
    for (int e = begin + threadIdx.x; e < end; e += blockDim.x) {
        const RowEdit edit = edits[e];
        if (edit.token_id >= (u32)vocab) continue;
        float v = y[edit.token_id];
        if (edit.flags & EDIT_PENALIZE) {
            v = penalize(v, p, (edit.flags & EDIT_IN_PROMPT) != 0, edit.output_count);
        }
        v = __fadd_rn(v, edit.bias);
        if (edit.flags & EDIT_MASK) v = NEG_INF;
        y[edit.token_id] = v;
    }
}

// Most top logprobs a row returns (vLLM's and the engine's MAX_LOGPROBS).
#define MAX_TOP_LOGPROBS 20

// For a row that asked for logprobs (n ≥ 0; −1: none): the chosen token's rank in the raw row
// (how many ids have a logit at least its own, vLLM's count) into ranks[row], and the n most
// likely tokens (value descending, then id ascending: `top_k_cut`'s rank order) with their raw
// logprobs into top_ids / top_lps[row · MAX_TOP_LOGPROBS ..]. `scratch` holds the row's
// x − max for the rank cut. Sums as in `token_logprob_row`.
template <typename T>
__device__ void top_logprobs_row(const T* __restrict__ logits, const u32* ids, int n,
                                 float* __restrict__ scratch, u32* __restrict__ top_ids,
                                 float* __restrict__ top_lps, u32* __restrict__ ranks, int vocab) {
    __shared__ float fscratch[WARP_SIZE];
    __shared__ u32 hist[256];
    __shared__ u32 counts[SAMPLE_THREADS];
    __shared__ u32 result[4];
    __shared__ u32 picked[MAX_TOP_LOGPROBS];
    __shared__ u32 num_picked;
    if (n < 0) return;
    n = min(min(n, MAX_TOP_LOGPROBS), vocab);
    const i64 row = blockIdx.x;
    const T* x = logits + row * vocab;
    const int chunk = (vocab + blockDim.x - 1) / blockDim.x;
    RowCtx r;
    r.d = scratch + row * vocab;
    r.vocab = vocab;
    r.begin = min((int)threadIdx.x * chunk, vocab);
    r.end = min(r.begin + chunk, vocab);
    r.log_min_p = NEG_INF;
    float local_max = NEG_INF;
    for (int i = r.begin; i < r.end; ++i) local_max = fmaxf(local_max, sanitize(load_f32(x, i)));
    const float max = block_max(local_max, fscratch);
    const u32 chosen = ids[row];
    const float xc = chosen < (u32)vocab ? sanitize(load_f32(x, (int)chosen)) : NEG_INF;
    u32 at_least = 0;
    float s = 0.0f;
    for (int i = r.begin; i < r.end; ++i) {
        const float v = sanitize(load_f32(x, i));
        at_least += v >= xc;
        if (max != NEG_INF) s = __fadd_rn(s, expf(__fsub_rn(v, max)));
    }
    at_least = block_sum_u32(at_least, counts);
    const float total = block_sum(s, fscratch);
    if (threadIdx.x == 0) ranks[row] = at_least;
    if (n == 0) return;
    float* d = scratch + row * vocab;
    for (int i = r.begin; i < r.end; ++i) d[i] = __fsub_rn(sanitize(load_f32(x, i)), max);
    if (threadIdx.x == 0) num_picked = 0;
    __syncthreads();
    RankCut cut = {0xffffffffu, 0xffffffffu};
    if (n < vocab) cut = top_k_cut(r, n, hist, counts, result);
    for (int i = r.begin; i < r.end; ++i) {
        if (in_cut(r, i, cut)) {
            const u32 slot = atomicAdd(&num_picked, 1u);
            if (slot < MAX_TOP_LOGPROBS) picked[slot] = (u32)i;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        const int m = min((int)num_picked, n);
        // Insertion sort of at most 20 ids by (key ascending, id ascending).
        for (int a = 1; a < m; ++a) {
            const u32 id = picked[a];
            const u32 key = key_of(d[id]);
            int b = a - 1;
            while (b >= 0 && (key_of(d[picked[b]]) > key ||
                              (key_of(d[picked[b]]) == key && picked[b] > id))) {
                picked[b + 1] = picked[b];
                --b;
            }
            picked[b + 1] = id;
        }
        const float log_total = max == NEG_INF ? 0.0f : logf(total);
        for (int k = 0; k < m; ++k) {
            top_ids[row * MAX_TOP_LOGPROBS + k] = picked[k];
            top_lps[row * MAX_TOP_LOGPROBS + k] =
                max == NEG_INF ? NEG_INF : __fsub_rn(d[picked[k]], log_total);
        }
    }
}

// grid (rows): a row with a grammar mask (masks_at[row] ≥ 0: its words start at
// masks[masks_at[row] · words]) gets −inf, in place, for every id whose bit is clear and every id
// past the words: the engine's `apply_mask`, before anything else reads the row (its logprobs
// are then those of the masked row, as on the host).
template <typename T>
__device__ void mask_row(T* __restrict__ logits, const i32* __restrict__ masks_at,
                         const u32* __restrict__ masks, int words, int vocab) {
    const i64 row = blockIdx.x;
    const i32 at = masks_at[row];
    if (at < 0) return;
    const u32* w = masks + (i64)at * words;
    T* x = logits + row * vocab;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const bool allowed = i / 32 < words && ((w[i / 32] >> (i % 32)) & 1u);
        if (!allowed) store_f32(x, i, NEG_INF);
    }
}

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    mask_rows_f32(float* logits, const i32* masks_at, const u32* masks, int words, int vocab) {
    mask_row(logits, masks_at, masks, words, vocab);
}
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    mask_rows_bf16(bf16* logits, const i32* masks_at, const u32* masks, int words, int vocab) {
    mask_row(logits, masks_at, masks, words, vocab);
}

// What `draw` does with a row (`DrawMode` in ops/sampling.rs).
#define DRAW_SKIP 0    // a row the engine samples from its logits: left alone
#define DRAW_GREEDY 1  // argmax_row
#define DRAW_RANDOM 2  // sample_row with params[row]

// One step's draws in one launch, a row per block: the token (greedy or sampled, by the row's
// mode, which is the same for the whole block) into ids[row], then its raw logprob into
// logprobs[row]. A row with edits is drawn from its `adjusted` copy (`adjust_rows` ran
// first), the logprob always from the raw logits. A row's result depends on its logits, its
// params, edits and mode only.
template <typename T>
__device__ void draw_row(const T* __restrict__ logits, const float* __restrict__ adjusted,
                         const i32* __restrict__ offsets, const SampleParams* __restrict__ params,
                         const i32* __restrict__ modes, const i32* __restrict__ tops,
                         float* __restrict__ scratch, u32* __restrict__ ids,
                         float* __restrict__ logprobs, u32* __restrict__ top_ids,
                         float* __restrict__ top_lps, u32* __restrict__ ranks, int vocab) {
    const i64 row = blockIdx.x;
    const i32 mode = modes[row];
    const bool edited = offsets[row] < offsets[row + 1];
    if (mode == DRAW_GREEDY) {
        if (edited) argmax_row(adjusted, ids, vocab); else argmax_row(logits, ids, vocab);
    } else if (mode == DRAW_RANDOM) {
        if (edited) sample_row(adjusted, params, scratch, ids, vocab);
        else sample_row(logits, params, scratch, ids, vocab);
    } else {
        return;
    }
    __syncthreads();  // thread 0's ids[row] is visible to the block from here
    token_logprob_row(logits, ids, logprobs, vocab);
    __syncthreads();  // the sample's scratch is free for the rank cut
    top_logprobs_row(logits, ids, tops[row], scratch, top_ids, top_lps, ranks, vocab);
}

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) argmax_f32(const float* logits, u32* out, int vocab) {
    argmax_row(logits, out, vocab);
}
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) argmax_bf16(const bf16* logits, u32* out, int vocab) {
    argmax_row(logits, out, vocab);
}
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) sample_f32(const float* logits, const SampleParams* params,
                                      float* scratch, u32* out, int vocab) {
    sample_row(logits, params, scratch, out, vocab);
}
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) sample_bf16(const bf16* logits, const SampleParams* params,
                                       float* scratch, u32* out, int vocab) {
    sample_row(logits, params, scratch, out, vocab);
}
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    adjust_rows_f32(const float* logits, float* adjusted, const i32* offsets, const RowEdit* edits,
                    const RowPenalties* penalties, int vocab) {
    adjust_row(logits, adjusted, offsets, edits, penalties, vocab);
}
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    adjust_rows_bf16(const bf16* logits, float* adjusted, const i32* offsets, const RowEdit* edits,
                     const RowPenalties* penalties, int vocab) {
    adjust_row(logits, adjusted, offsets, edits, penalties, vocab);
}
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    draw_f32(const float* logits, const float* adjusted, const i32* offsets,
             const SampleParams* params, const i32* modes, const i32* tops, float* scratch,
             u32* ids, float* logprobs, u32* top_ids, float* top_lps, u32* ranks, int vocab) {
    draw_row(logits, adjusted, offsets, params, modes, tops, scratch, ids, logprobs, top_ids,
             top_lps, ranks, vocab);
}
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    draw_bf16(const bf16* logits, const float* adjusted, const i32* offsets,
              const SampleParams* params, const i32* modes, const i32* tops, float* scratch,
              u32* ids, float* logprobs, u32* top_ids, float* top_lps, u32* ranks, int vocab) {
    draw_row(logits, adjusted, offsets, params, modes, tops, scratch, ids, logprobs, top_ids,
             top_lps, ranks, vocab);
}
