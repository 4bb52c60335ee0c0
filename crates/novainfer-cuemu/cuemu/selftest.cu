// selftest.cu — kernels that pin the emulator's own semantics (tests/emulator.rs): shuffles,
// ballots, barriers over returned threads, the deadlocks it must report, and ldmatrix + mma
// used the way CUTLASS and flash-attention use them (A row-major through ldmatrix.x4, B
// through ldmatrix.x4 of its transpose), which must multiply matrices.
#include "common.cuh"

extern "C" __global__ void st_shuffles(int* out) {
    const int lane = threadIdx.x % 32;
    const int base = threadIdx.x * 4;
    out[base + 0] = __shfl_xor_sync(FULL_MASK, lane * 10, 5);
    out[base + 1] = __shfl_up_sync(FULL_MASK, lane * 10, 3);
    out[base + 2] = __shfl_down_sync(FULL_MASK, lane * 10, 3);
    out[base + 3] = (int)__ballot_sync(FULL_MASK, lane % 3 == 0);
}

// Every thread gets the block's sum (common.cuh's fixed-order reduction) and its AND.
extern "C" __global__ void st_block_sum(const float* x, float* sums, int* ands) {
    __shared__ float scratch[32];
    const float v = x[blockIdx.x * blockDim.x + threadIdx.x];
    sums[blockIdx.x * blockDim.x + threadIdx.x] = block_sum(v, scratch);
    ands[blockIdx.x * blockDim.x + threadIdx.x] = __syncthreads_and(v > -0.5f);
}

// Half the block returns early; the rest still meet at the barrier (sm_70+ semantics).
extern "C" __global__ void st_early_return(int* out) {
    __shared__ int seen;
    if (threadIdx.x == 0) seen = 0;
    __syncthreads();
    if (threadIdx.x % 2) return;
    atomicAdd(&seen, 1);
    __syncthreads();
    out[threadIdx.x] = seen;
}

// Warp 0 waits at __syncthreads, warp 1's low half in a shuffle its high half never joins.
extern "C" __global__ void st_deadlock(int* out) {
    if (threadIdx.x < 32 || threadIdx.x >= 48) {
        __syncthreads();
    } else {
        out[threadIdx.x] = __shfl_xor_sync(FULL_MASK, (int)threadIdx.x, 1);
    }
}

// A full-warp shuffle after some lanes have returned.
extern "C" __global__ void st_shuffle_after_return(int* out) {
    if (threadIdx.x >= 16) return;
    out[threadIdx.x] = __shfl_xor_sync(FULL_MASK, (int)threadIdx.x, 1);
}

// D[16×16] = A[16×16] · B[16×16] with one warp: A row-major, B given as Bt (row n holds
// column n of B), both bf16; two m16n8k16 tiles along n.
extern "C" __global__ void st_mma(const bf16* a, const bf16* bt, float* d) {
    __shared__ __align__(16) bf16 as[16 * 16];
    __shared__ __align__(16) bf16 bs[16 * 16];
    const int lane = threadIdx.x;
    for (int i = lane; i < 256; i += 32) {
        as[i] = a[i];
        bs[i] = bt[i];
    }
    __syncwarp();
    u32 af[4];
    // Lanes 0-15 address rows 0-15 at column 0, lanes 16-31 the same rows at column 8.
    cuemu::ldmatrix_x4(af, &as[(lane % 16) * 16 + (lane / 16) * 8], false);
    // Matrices: (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15).
    u32 bf[4];
    const int m = lane / 8, r = lane % 8;
    cuemu::ldmatrix_x4(bf, &bs[((m / 2) * 8 + r) * 16 + (m % 2) * 8], false);
    const int g = lane / 4, t = lane % 4;
    for (int tile = 0; tile < 2; tile++) {
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        mma_bf16_16816(acc, af, bf[2 * tile], bf[2 * tile + 1]);
        const int col = tile * 8 + 2 * t;
        d[g * 16 + col] = acc[0];
        d[g * 16 + col + 1] = acc[1];
        d[(g + 8) * 16 + col] = acc[2];
        d[(g + 8) * 16 + col + 1] = acc[3];
    }
}

// ldmatrix .trans of a row-major 8×8 tile: lane l gets column l/4, rows 2(l%4) and 2(l%4)+1.
extern "C" __global__ void st_ldmatrix_trans(const bf16* x, u32* out) {
    __shared__ __align__(16) bf16 xs[4 * 64];
    for (int i = threadIdx.x; i < 256; i += 32) xs[i] = x[i];
    __syncwarp();
    u32 r[4];
    const int lane = threadIdx.x;
    cuemu::ldmatrix_x4(r, &xs[(lane / 8) * 64 + (lane % 8) * 8], true);
    for (int i = 0; i < 4; i++) out[lane * 4 + i] = r[i];
}

// A race: thread t reads its neighbour's shared slot with no barrier after the writes, so
// what it sees depends on whether t + 1 has run yet.
extern "C" __global__ void st_race(int* out) {
    __shared__ int slot[64];
    slot[threadIdx.x] = -1;
    __syncthreads();
    slot[threadIdx.x] = (int)threadIdx.x;
    out[threadIdx.x] = slot[(threadIdx.x + 1) % 64];
}
