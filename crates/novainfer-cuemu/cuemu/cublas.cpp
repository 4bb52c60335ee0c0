// cublas.cpp — a fake libcublas.so.13 and libcublasLt.so.13 over the emulator (see driver_api.h).
//
// cudarc (`dynamic-loading`) dlopens both libraries by name and looks each symbol up on its first
// call, so this file only has to provide what NovaInfer reaches, with the C ABI of CUDA 13's
// cublas_api.h / cublasLt.h (as cudarc's bindings, `cuda-13000`, declare it):
//
//   cuBLAS   (cudarc's CudaBlas, crates/novainfer-cuda/src/blas.rs, ops/gemm.rs):
//            cublasCreate_v2, cublasDestroy_v2, cublasSetStream_v2, cublasSetWorkspace_v2,
//            cublasGemmEx (bf16 × bf16 → bf16 or f32, COMPUTE_32F, T/N)
//   cuBLASLt (crates/novainfer-cuda/src/blas_lt.rs, opt-in with NOVAINFER_CUDA_GEMM=lt):
//            cublasLtCreate, cublasLtDestroy, cublasLtMatmulDesc{Create,SetAttribute,Destroy},
//            cublasLtMatrixLayout{Create,Destroy}, cublasLtMatmulPreference{Create,SetAttribute,
//            Destroy}, cublasLtMatmulAlgoGetHeuristic, cublasLtMatmulAlgoConfigGetAttribute,
//            cublasLtMatmul
//
// plus their cheap neighbours (the Get* twins, pointer and math modes, strided-batched GemmEx,
// Sgemm, versions and status strings), so that a small change on the Rust side does not meet a
// missing symbol (cudarc panics on one). NovaInfer's FP8 weights never reach cuBLAS (its own
// kernels dequantize them), so the FP8 types and the scale attributes are refused with
// CUBLAS_STATUS_NOT_SUPPORTED rather than emulated.
//
// Execution. Device pointers are host pointers. Every GEMM is checked at call time (a bad
// argument is the call's status, as with the real library) and its work is then handed to
// `cuemu::enqueue` on the handle's stream (cuBLAS) or the call's stream (cuBLASLt), never run
// directly: outside a capture the fake driver runs it at once, inside one it is recorded with
// everything it needs copied into it (descriptors may be destroyed before the graph replays),
// and it runs at each launch. Scalars follow the pointer mode: host-mode alpha/beta are read at
// the call, device-mode ones when the work runs (so a replayed graph sees their new values).
//
// Numerics (what the tests compare against). Inputs are widened to f32 exactly; each output
// element is one f32 sum of f32 products in increasing k order, starting from +0 (bf16 and f16
// products are exact in f32, so that is a tensor core's result up to its own summation order);
// then alpha·sum (+ beta·C, only when beta != 0: with beta == 0, C is never read and may hold
// NaN), rounded once to the output type, to nearest even. A cuBLASLt algorithm with split-K
// (the heuristic offers one where a GPU would) sums each k-chunk separately, in order, and adds
// the chunk sums in chunk order in f32 (CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE), as the GPU does:
// it is how NovaInfer's "no split-K" choice in blas_lt.rs gets exercised.
// Products and sums must stay separate roundings: the build passes -ffp-contract=off (GCC's
// ISO modes default to it too); clang gets the pragma below.
//
// Speed. Plain C++ (GCC/clang vector extensions, no intrinsics): operands are packed to f32
// panels, an 8×4 register tile runs over k in blocks, and row blocks are shared among up to
// `hardware_concurrency` threads (CUEMU_BLAS_THREADS overrides). Every element's arithmetic is
// the same whatever the blocking or the thread count, so results do not depend on either.

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <new>
#include <thread>
#include <vector>

#include "driver_api.h"

#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif

// ---------------------------------------------------------------------------------------------
// The C ABI: CUDA 13's enums (only the members used here; a fixed `int` underlying type so that
// any value a caller passes is representable) and handle types.

enum cublasStatus_t : int {
    CUBLAS_STATUS_SUCCESS = 0,
    CUBLAS_STATUS_NOT_INITIALIZED = 1,
    CUBLAS_STATUS_ALLOC_FAILED = 3,
    CUBLAS_STATUS_INVALID_VALUE = 7,
    CUBLAS_STATUS_ARCH_MISMATCH = 8,
    CUBLAS_STATUS_MAPPING_ERROR = 11,
    CUBLAS_STATUS_EXECUTION_FAILED = 13,
    CUBLAS_STATUS_INTERNAL_ERROR = 14,
    CUBLAS_STATUS_NOT_SUPPORTED = 15,
    CUBLAS_STATUS_LICENSE_ERROR = 16,
};
enum cublasOperation_t : int { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1, CUBLAS_OP_C = 2, CUBLAS_OP_CONJG = 3 };
enum cudaDataType_t : int {
    CUDA_R_32F = 0,
    CUDA_R_64F = 1,
    CUDA_R_16F = 2,
    CUDA_R_8I = 3,
    CUDA_R_16BF = 14,
    CUDA_R_8F_E4M3 = 28,
    CUDA_R_8F_E5M2 = 29,
};
typedef cudaDataType_t cudaDataType;
enum cublasComputeType_t : int {
    CUBLAS_COMPUTE_16F = 64,
    CUBLAS_COMPUTE_32F = 68,
    CUBLAS_COMPUTE_32F_PEDANTIC = 69,
    CUBLAS_COMPUTE_64F = 70,
    CUBLAS_COMPUTE_32F_FAST_16F = 74,
    CUBLAS_COMPUTE_32F_FAST_16BF = 75,
    CUBLAS_COMPUTE_32F_FAST_TF32 = 77,
};
enum cublasGemmAlgo_t : int {
    CUBLAS_GEMM_DEFAULT = -1,
    CUBLAS_GEMM_ALGO0 = 0,
    CUBLAS_GEMM_ALGO23 = 23,
    CUBLAS_GEMM_DEFAULT_TENSOR_OP = 99,
    CUBLAS_GEMM_ALGO15_TENSOR_OP = 115,
    CUBLAS_GEMM_AUTOTUNE = 999,
};
enum cublasMath_t : int { CUBLAS_DEFAULT_MATH = 0 };
enum cublasPointerMode_t : int { CUBLAS_POINTER_MODE_HOST = 0, CUBLAS_POINTER_MODE_DEVICE = 1 };
enum cublasAtomicsMode_t : int { CUBLAS_ATOMICS_NOT_ALLOWED = 0, CUBLAS_ATOMICS_ALLOWED = 1 };

struct CUstream_st;
typedef CUstream_st* cudaStream_t;

struct cublasContext;  // defined below
typedef cublasContext* cublasHandle_t;

// cuBLASLt: the opaque objects are whatever this library allocates (the *Init variants that
// place them in caller storage are not provided), so they are our own structs.
struct cublasLtContext;
typedef cublasLtContext* cublasLtHandle_t;
struct LtDesc;
typedef LtDesc* cublasLtMatmulDesc_t;
struct LtLayout;
typedef LtLayout* cublasLtMatrixLayout_t;
struct LtPref;
typedef LtPref* cublasLtMatmulPreference_t;

// These two are real structs in the caller's memory: their layout is the ABI.
struct cublasLtMatmulAlgo_t {
    uint64_t data[8];
};
struct cublasLtMatmulHeuristicResult_t {
    cublasLtMatmulAlgo_t algo;
    size_t workspaceSize;
    cublasStatus_t state;
    float wavesCount;
    int reserved[4];
};
static_assert(sizeof(cublasLtMatmulAlgo_t) == 64, "cublasLtMatmulAlgo_t is 8 u64");
static_assert(sizeof(cublasLtMatmulHeuristicResult_t) == 96, "cudarc's cublasLtMatmulHeuristicResult_t");
static_assert(offsetof(cublasLtMatmulHeuristicResult_t, workspaceSize) == 64, "ABI");
static_assert(offsetof(cublasLtMatmulHeuristicResult_t, state) == 72, "ABI");
static_assert(offsetof(cublasLtMatmulHeuristicResult_t, wavesCount) == 76, "ABI");

// cuBLASLt attribute ids (cublasLtMatmulDescAttributes_t & co. in CUDA 13.0).
enum : int {
    DESC_COMPUTE_TYPE = 0,
    DESC_SCALE_TYPE = 1,
    DESC_POINTER_MODE = 2,
    DESC_TRANSA = 3,
    DESC_TRANSB = 4,
    DESC_TRANSC = 5,
    DESC_FILL_MODE = 6,
    DESC_EPILOGUE = 7,
    DESC_A_SCALE_POINTER = 17,
    DESC_B_SCALE_POINTER = 18,
    DESC_C_SCALE_POINTER = 19,
    DESC_D_SCALE_POINTER = 20,
    DESC_AMAX_D_POINTER = 21,
    DESC_D_OUT_SCALE_POINTER = 36,
};
enum : int {
    LAYOUT_TYPE = 0,
    LAYOUT_ORDER = 1,
    LAYOUT_ROWS = 2,
    LAYOUT_COLS = 3,
    LAYOUT_LD = 4,
    LAYOUT_BATCH_COUNT = 5,
    LAYOUT_STRIDED_BATCH_OFFSET = 6,
    LAYOUT_PLANE_OFFSET = 7,
    LAYOUT_BATCH_MODE = 8,
};
enum : int { PREF_MAX_WORKSPACE_BYTES = 1, PREF_REDUCTION_SCHEME_MASK = 3 };
enum : int {
    ALGO_CONFIG_ID = 0,
    ALGO_CONFIG_TILE_ID = 1,
    ALGO_CONFIG_SPLITK_NUM = 2,
    ALGO_CONFIG_REDUCTION_SCHEME = 3,
    ALGO_CONFIG_CTA_SWIZZLING = 4,
    ALGO_CONFIG_CUSTOM_OPTION = 5,
    ALGO_CONFIG_STAGES_ID = 6,
    ALGO_CONFIG_INNER_SHAPE_ID = 7,
    ALGO_CONFIG_CLUSTER_SHAPE_ID = 8,
};
enum : int { ORDER_COL = 0, ORDER_ROW = 1 };
enum : int { FILL_MODE_FULL = 2 };
enum : int { EPILOGUE_DEFAULT = 1 };
enum : int { LT_POINTER_MODE_HOST = 0, LT_POINTER_MODE_DEVICE = 1 };
enum : int { REDUCTION_NONE = 0, REDUCTION_INPLACE = 1, REDUCTION_COMPUTE_TYPE = 2, REDUCTION_MASK_ALL = 7 };
enum : int { BATCH_MODE_STRIDED = 0 };
enum : int { TILE_64x128 = 17, TILE_128x128 = 20 };

// The version this fake claims (CUBLAS_VERSION = major·10000 + minor·100 + patch).
constexpr int kVersion = 130000;

// ---------------------------------------------------------------------------------------------
// Library objects.

struct cublasContext {
    uint32_t magic;
    void* stream;  // null: the legacy default stream
    void* workspace;
    size_t workspace_bytes;
    int math_mode;
    int pointer_mode;
    int atomics_mode;
};
struct cublasLtContext {
    uint32_t magic;
};

namespace {

// Tags that catch a handle that was never created (or a descriptor passed where another kind
// is expected) with a status instead of a crash; destroy clears them.
constexpr uint32_t kBlasMagic = 0x53414c42;    // "BLAS"
constexpr uint32_t kLtMagic = 0x4c54484e;      // "NHTL"
constexpr uint32_t kDescMagic = 0x43534544;    // "DESC"
constexpr uint32_t kLayoutMagic = 0x5459414c;  // "LAYT"
constexpr uint32_t kPrefMagic = 0x46455250;    // "PREF"
// Algorithms this fake made carry this in data[0]; cublasLtMatmul refuses others.
constexpr uint64_t kAlgoMagic = 0x6f676c612d756d65ull;  // "emu-algo"

// cuBLASLt keeps each attribute at a fixed size and refuses any other (INVALID_VALUE). Every
// attribute here fits 8 bytes, so an object is a table of u64 slots indexed by attribute id;
// `size[id] == 0` marks an id that does not exist.
constexpr int kMaxAttr = 40;
struct AttrTable {
    uint8_t size[kMaxAttr];
};

constexpr AttrTable make_desc_table() {
    AttrTable t{};
    for (int id : {0, 1, 2, 3, 4, 5, 6, 7, 15, 22, 26, 31, 32, 33, 34, 35, 37}) t.size[id] = 4;
    for (int id : {8, 10, 11, 12, 13, 14, 17, 18, 19, 20, 21, 23, 24, 36, 38}) t.size[id] = 8;
    t.size[25] = 1;  // CUBLASLT_MATMUL_DESC_FAST_ACCUM: int8_t
    return t;
}
constexpr AttrTable make_layout_table() {
    AttrTable t{};
    for (int id : {LAYOUT_TYPE, LAYOUT_ORDER, LAYOUT_BATCH_COUNT, LAYOUT_BATCH_MODE}) t.size[id] = 4;
    for (int id : {LAYOUT_ROWS, LAYOUT_COLS, LAYOUT_LD, LAYOUT_STRIDED_BATCH_OFFSET, LAYOUT_PLANE_OFFSET})
        t.size[id] = 8;
    return t;
}
constexpr AttrTable make_pref_table() {
    AttrTable t{};
    for (int id : {0, 3, 5, 6, 7, 8, 9}) t.size[id] = 4;  // 9: MAX_WAVES_COUNT is a float
    for (int id : {1, 12}) t.size[id] = 8;
    return t;
}
constexpr AttrTable kDescAttrs = make_desc_table();
constexpr AttrTable kLayoutAttrs = make_layout_table();
constexpr AttrTable kPrefAttrs = make_pref_table();

struct Attrs {
    uint64_t slot[kMaxAttr] = {};
    template <typename T>
    T get(int id) const {
        T v;
        static_assert(sizeof(T) <= 8, "attributes fit a slot");
        std::memcpy(&v, &slot[id], sizeof v);
        return v;
    }
    template <typename T>
    void put(int id, T v) {
        slot[id] = 0;
        std::memcpy(&slot[id], &v, sizeof v);
    }
};

cublasStatus_t set_attr(const AttrTable& table, Attrs& attrs, int id, const void* buf, size_t bytes) {
    if (id < 0 || id >= kMaxAttr || table.size[id] == 0) return CUBLAS_STATUS_INVALID_VALUE;
    if (!buf || bytes != table.size[id]) return CUBLAS_STATUS_INVALID_VALUE;
    attrs.slot[id] = 0;
    std::memcpy(&attrs.slot[id], buf, bytes);
    return CUBLAS_STATUS_SUCCESS;
}

// cuBLASLt's Get contract: size 0 with sizeWritten asks for the size; otherwise the size must
// be the attribute's.
cublasStatus_t get_attr(const AttrTable& table, const Attrs& attrs, int id, void* buf, size_t bytes,
                        size_t* written) {
    if (id < 0 || id >= kMaxAttr || table.size[id] == 0) return CUBLAS_STATUS_INVALID_VALUE;
    const size_t size = table.size[id];
    if (bytes == 0) {
        if (!written) return CUBLAS_STATUS_INVALID_VALUE;
        *written = size;
        return CUBLAS_STATUS_SUCCESS;
    }
    if (written) *written = size;
    if (!buf || bytes != size) return CUBLAS_STATUS_INVALID_VALUE;
    std::memcpy(buf, &attrs.slot[id], size);
    return CUBLAS_STATUS_SUCCESS;
}

}  // namespace

struct LtDesc {
    uint32_t magic;
    Attrs attrs;
};
struct LtLayout {
    uint32_t magic;
    Attrs attrs;
};
struct LtPref {
    uint32_t magic;
    Attrs attrs;
};

namespace {

bool live(const cublasContext* h) { return h && h->magic == kBlasMagic; }
bool live(const cublasLtContext* h) { return h && h->magic == kLtMagic; }
bool live(const LtDesc* d) { return d && d->magic == kDescMagic; }
bool live(const LtLayout* l) { return l && l->magic == kLayoutMagic; }
bool live(const LtPref* p) { return p && p->magic == kPrefMagic; }

// ---------------------------------------------------------------------------------------------
// Element types.

float bf16_to_f32(uint16_t h) {
    const uint32_t u = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

uint16_t f32_to_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x0040u);  // NaN stays a (quiet) NaN
    u += 0x7fffu + ((u >> 16) & 1u);  // to nearest, ties to even; overflow carries into infinity
    return uint16_t(u >> 16);
}

float f16_to_f32(uint16_t h) {
    const uint32_t sign = uint32_t(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu;
    const uint32_t man = h & 0x3ffu;
    uint32_t u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        u = sign | ((exp + 112u) << 23) | (man << 13);
    } else {
        // Zero or subnormal: man · 2⁻²⁴, exact in f32.
        float f = float(man) * (1.0f / 16777216.0f);
        std::memcpy(&u, &f, 4);
        u |= sign;
    }
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

uint16_t f32_to_f16(float f) {
    uint32_t x;
    std::memcpy(&x, &f, 4);
    const uint16_t sign = uint16_t((x >> 16) & 0x8000u);
    x &= 0x7fffffffu;
    if (x >= 0x7f800000u) {  // infinity, or NaN kept quiet
        return x == 0x7f800000u ? uint16_t(sign | 0x7c00u) : uint16_t(sign | 0x7e00u | ((x >> 13) & 0x3ffu));
    }
    if (x >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // ≥ 65520 rounds to infinity
    if (x < 0x38800000u) {
        // Below the smallest normal (2⁻¹⁴): a multiple of 2⁻²⁴. The scaling is exact, and the
        // default rounding mode rounds to nearest even; 1024 lands on the smallest normal's code.
        float a;
        std::memcpy(&a, &x, 4);
        const float units = __builtin_nearbyintf(a * 16777216.0f);
        return uint16_t(sign | uint16_t(units));
    }
    uint32_t h = ((((x >> 23) - 112u) << 10) | ((x >> 13) & 0x3ffu));
    const uint32_t rest = x & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // a carry moves into the exponent, as it should
    return uint16_t(sign | h);
}

float load(int type, const void* base, int64_t idx) {
    const unsigned char* p = static_cast<const unsigned char*>(base);
    if (type == CUDA_R_32F) {
        float f;
        std::memcpy(&f, p + idx * 4, 4);
        return f;
    }
    uint16_t h;
    std::memcpy(&h, p + idx * 2, 2);
    return type == CUDA_R_16BF ? bf16_to_f32(h) : f16_to_f32(h);
}

void store(int type, void* base, int64_t idx, float v) {
    unsigned char* p = static_cast<unsigned char*>(base);
    if (type == CUDA_R_32F) {
        std::memcpy(p + idx * 4, &v, 4);
        return;
    }
    const uint16_t h = type == CUDA_R_16BF ? f32_to_bf16(v) : f32_to_f16(v);
    std::memcpy(p + idx * 2, &h, 2);
}

template <int T>
inline float load_as(const unsigned char* p, int64_t idx) {
    if constexpr (T == CUDA_R_32F) {
        float f;
        std::memcpy(&f, p + idx * 4, 4);
        return f;
    } else {
        uint16_t h;
        std::memcpy(&h, p + idx * 2, 2);
        if constexpr (T == CUDA_R_16BF) return bf16_to_f32(h);
        else return f16_to_f32(h);
    }
}

// The input types this emulation multiplies (f32 accumulation, f32 scalars), and the outputs
// each allows: its own type or f32 — cuBLAS's COMPUTE_32F table minus the integer and FP8 rows.
bool supported_types(int a, int b, int c) {
    const bool input = a == CUDA_R_32F || a == CUDA_R_16F || a == CUDA_R_16BF;
    return input && b == a && (c == a || c == CUDA_R_32F);
}
bool supported_compute(int compute) {
    // FAST_TF32/16F/16BF would round inputs on a GPU; plain f32 here would be silently better,
    // so they are refused rather than approximated.
    return compute == CUBLAS_COMPUTE_32F || compute == CUBLAS_COMPUTE_32F_PEDANTIC;
}

// ---------------------------------------------------------------------------------------------
// One GEMM, as both libraries describe it once their arguments are checked:
//   D[i, j] = alpha · Σ_l op(A)[i, l] · op(B)[l, j] + beta · C[i, j]
// with op(A) m×k, op(B) k×n, C and D m×n, each operand given by element strides (so transposes,
// leading dimensions and row/column order are all just strides) and a batch stride.

struct Matrix {
    const void* base;
    int type;
    int64_t rs, cs;  // element (r, c) is at base + (r·rs + c·cs) elements
    int64_t stride;  // between batch entries, in elements
};

struct Scalar {
    bool deferred;  // device pointer mode: read when the work runs
    const float* ptr;
    float value;
    float get() const { return deferred ? *ptr : value; }
};

struct Problem {
    int64_t m, n, k, batch;
    Matrix a, b, c, d;
    Scalar alpha, beta;
    int64_t split_k;  // ≥ 1
};

// An operand as stored, seen through op(): transposing swaps the strides.
Matrix operand(const void* base, int type, int64_t rs, int64_t cs, int64_t stride, bool transpose) {
    return transpose ? Matrix{base, type, cs, rs, stride} : Matrix{base, type, rs, cs, stride};
}

constexpr int TI = 8;     // rows of a register tile (two 4-wide vectors)
constexpr int TJ = 4;     // columns of a register tile
constexpr int MI = 64;    // rows a task packs (MI / TI register panels)
constexpr int64_t JC = 512;  // columns at most a task covers (bounds its buffers)
constexpr int64_t KC = 256;  // k block: the A block (KC × MI) stays in L2, a B panel (KC × TJ) in L1

typedef float v4 __attribute__((vector_size(16)));

// acc[jj·TI + ii] += Σ_l a[l·TI + ii] · b[l·TJ + jj] over l < len, one element at a time in l
// order: the vectors run across independent elements, never across l.
void micro_kernel(const float* a, const float* b, int64_t len, float* acc) {
    v4 c[TJ][2];
    std::memcpy(c, acc, sizeof c);
    for (int64_t l = 0; l < len; ++l) {
        v4 a0, a1;
        std::memcpy(&a0, a + l * TI, 16);
        std::memcpy(&a1, a + l * TI + 4, 16);
        for (int jj = 0; jj < TJ; ++jj) {
            const float s = b[l * TJ + jj];
            const v4 bv = {s, s, s, s};
            const v4 p0 = a0 * bv;
            const v4 p1 = a1 * bv;
            c[jj][0] = c[jj][0] + p0;
            c[jj][1] = c[jj][1] + p1;
        }
    }
    std::memcpy(acc, c, sizeof c);
}

// op(B) of one batch entry as panels of TJ columns: out[(jp·k + l)·TJ + jj] = op(B)[l, jp·TJ + jj],
// zero past n.
template <int T>
void pack_b_as(const Matrix& b, int64_t bi, int64_t k, int64_t n, float* out) {
    const unsigned char* base = static_cast<const unsigned char*>(b.base);
    const int64_t off = bi * b.stride;
    const int64_t panels = (n + TJ - 1) / TJ;
    for (int64_t jp = 0; jp < panels; ++jp) {
        float* dst = out + jp * k * TJ;
        for (int jj = 0; jj < TJ; ++jj) {
            const int64_t j = jp * TJ + jj;
            if (j >= n) {
                for (int64_t l = 0; l < k; ++l) dst[l * TJ + jj] = 0.0f;
                continue;
            }
            const int64_t col = off + j * b.cs;
            for (int64_t l = 0; l < k; ++l) dst[l * TJ + jj] = load_as<T>(base, col + l * b.rs);
        }
    }
}

// Rows [i0, i0 + MI) of op(A) as panels of TI rows: out[(ip·k + l)·TI + ii], zero past m.
template <int T>
void pack_a_as(const Matrix& a, int64_t bi, int64_t k, int64_t m, int64_t i0, float* out) {
    const unsigned char* base = static_cast<const unsigned char*>(a.base);
    const int64_t off = bi * a.stride;
    for (int ip = 0; ip < MI / TI; ++ip) {
        float* dst = out + int64_t(ip) * k * TI;
        for (int ii = 0; ii < TI; ++ii) {
            const int64_t i = i0 + ip * TI + ii;
            if (i >= m) {
                for (int64_t l = 0; l < k; ++l) dst[l * TI + ii] = 0.0f;
                continue;
            }
            const int64_t row = off + i * a.rs;
            for (int64_t l = 0; l < k; ++l) dst[l * TI + ii] = load_as<T>(base, row + l * a.cs);
        }
    }
}

void pack_b(const Matrix& b, int64_t bi, int64_t k, int64_t n, float* out) {
    switch (b.type) {
        case CUDA_R_32F: return pack_b_as<CUDA_R_32F>(b, bi, k, n, out);
        case CUDA_R_16BF: return pack_b_as<CUDA_R_16BF>(b, bi, k, n, out);
        default: return pack_b_as<CUDA_R_16F>(b, bi, k, n, out);
    }
}
void pack_a(const Matrix& a, int64_t bi, int64_t k, int64_t m, int64_t i0, float* out) {
    switch (a.type) {
        case CUDA_R_32F: return pack_a_as<CUDA_R_32F>(a, bi, k, m, i0, out);
        case CUDA_R_16BF: return pack_a_as<CUDA_R_16BF>(a, bi, k, m, i0, out);
        default: return pack_a_as<CUDA_R_16F>(a, bi, k, m, i0, out);
    }
}

// The output of element (i, j) from its sum: alpha·sum, plus beta·C only when beta != 0.
inline void write_out(const Problem& p, int64_t bi, int64_t i, int64_t j, float sum, float alpha, float beta) {
    float v = alpha * sum;
    if (beta != 0.0f) {
        const float c = load(p.c.type, p.c.base, bi * p.c.stride + i * p.c.rs + j * p.c.cs);
        const float bc = beta * c;
        v = v + bc;
    }
    store(p.d.type, const_cast<void*>(p.d.base), bi * p.d.stride + i * p.d.rs + j * p.d.cs, v);
}

struct TaskBuffers {
    std::vector<float> a;      // MI × k
    std::vector<float> acc;    // MI × JC: one k-chunk's sums
    std::vector<float> total;  // MI × JC: the chunk sums added up (split-K only)
};

// Rows [i0, i0 + MI) × columns [j0, j0 + JC) of one batch entry.
void run_task(const Problem& p, int64_t bi, const float* bpack, int64_t i0, int64_t j0, float alpha, float beta,
              TaskBuffers& buf) {
    const int64_t k = p.k;
    const int64_t jn = std::min(JC, p.n - j0);
    const int64_t jpanels = (jn + TJ - 1) / TJ;
    const int64_t ipanels = std::min<int64_t>(MI / TI, (p.m - i0 + TI - 1) / TI);
    const int64_t tile = TI * TJ;
    pack_a(p.a, bi, k, p.m, i0, buf.a.data());

    // Split-K: chunks of a whole number of 32-element steps, the last one shorter.
    const int64_t splits = std::max<int64_t>(1, p.split_k);
    const int64_t chunk = splits == 1 ? k : ((k + splits - 1) / splits + 31) / 32 * 32;
    float* acc = buf.acc.data();
    float* total = buf.total.data();
    const size_t tiles_bytes = size_t(jpanels * ipanels * tile) * sizeof(float);
    for (int64_t s = 0; s < splits; ++s) {
        const int64_t ks = std::min(k, s * chunk);
        const int64_t ke = splits == 1 ? k : std::min(k, ks + chunk);
        std::memset(acc, 0, tiles_bytes);
        for (int64_t kb = ks; kb < ke; kb += KC) {
            const int64_t len = std::min(KC, ke - kb);
            for (int64_t jp = 0; jp < jpanels; ++jp) {
                const float* bp = bpack + ((j0 / TJ + jp) * k + kb) * TJ;
                for (int64_t ip = 0; ip < ipanels; ++ip) {
                    micro_kernel(buf.a.data() + (ip * k + kb) * TI, bp, len, acc + (jp * ipanels + ip) * tile);
                }
            }
        }
        if (splits > 1) {
            // The reduction step: chunk sums added in chunk order, in f32.
            const int64_t count = jpanels * ipanels * tile;
            if (s == 0) std::memcpy(total, acc, tiles_bytes);
            else
                for (int64_t e = 0; e < count; ++e) total[e] = total[e] + acc[e];
        }
    }
    const float* sums = splits > 1 ? total : acc;
    for (int64_t jp = 0; jp < jpanels; ++jp) {
        for (int jj = 0; jj < TJ; ++jj) {
            const int64_t j = j0 + jp * TJ + jj;
            if (j >= p.n) break;
            for (int64_t ip = 0; ip < ipanels; ++ip) {
                const float* t = sums + (jp * ipanels + ip) * tile + jj * TI;
                for (int ii = 0; ii < TI; ++ii) {
                    const int64_t i = i0 + ip * TI + ii;
                    if (i >= p.m) break;
                    write_out(p, bi, i, j, t[ii], alpha, beta);
                }
            }
        }
    }
}

unsigned thread_limit() {
    static const unsigned limit = [] {
        if (const char* env = std::getenv("CUEMU_BLAS_THREADS")) {
            const long v = std::strtol(env, nullptr, 10);
            if (v >= 1) return unsigned(std::min(v, 256L));
        }
        const unsigned hw = std::thread::hardware_concurrency();
        return hw == 0 ? 1u : std::min(hw, 16u);
    }();
    return limit;
}

// One batch entry, its tasks shared among threads (the calling one included). Each task
// writes its own block of D, so the threads need no other coordination.
void run_entry(const Problem& p, int64_t bi, float alpha, float beta) {
    if (alpha == 0.0f || p.k == 0) {
        // No products to add (BLAS's quick return): D = beta·C, and C unread when beta == 0.
        for (int64_t j = 0; j < p.n; ++j)
            for (int64_t i = 0; i < p.m; ++i) {
                float v = 0.0f;
                if (beta != 0.0f) v = beta * load(p.c.type, p.c.base, bi * p.c.stride + i * p.c.rs + j * p.c.cs);
                store(p.d.type, const_cast<void*>(p.d.base), bi * p.d.stride + i * p.d.rs + j * p.d.cs, v);
            }
        return;
    }
    const int64_t jpanels_all = (p.n + TJ - 1) / TJ;
    std::vector<float> bpack(size_t(jpanels_all * TJ * p.k));
    pack_b(p.b, bi, p.k, p.n, bpack.data());

    const int64_t row_blocks = (p.m + MI - 1) / MI;
    const int64_t col_blocks = (p.n + JC - 1) / JC;
    const int64_t tasks = row_blocks * col_blocks;
    const double macs = double(p.m) * double(p.n) * double(p.k);
    unsigned workers = macs < double(1 << 22) ? 1u : thread_limit();
    workers = unsigned(std::min<int64_t>(workers, tasks));

    // Every buffer is allocated here, before any thread starts: a failed allocation is an
    // exception on this thread (reported by the caller), never inside a worker.
    std::vector<TaskBuffers> buffers(workers);
    for (TaskBuffers& b : buffers) {
        b.a.resize(size_t(MI * p.k));
        b.acc.resize(size_t(MI * JC));
        if (p.split_k > 1) b.total.resize(size_t(MI * JC));
    }
    std::atomic<int64_t> next{0};
    auto work = [&](TaskBuffers& buf) {
        for (int64_t t = next.fetch_add(1); t < tasks; t = next.fetch_add(1)) {
            run_task(p, bi, bpack.data(), (t / col_blocks) * MI, (t % col_blocks) * JC, alpha, beta, buf);
        }
    };
    std::vector<std::thread> helpers;
    for (unsigned w = 1; w < workers; ++w) {
        try {
            helpers.emplace_back(work, std::ref(buffers[w]));
        } catch (...) {
            break;  // no more threads to be had: the ones running (and this one) finish the tasks
        }
    }
    work(buffers[0]);
    for (std::thread& t : helpers) t.join();
}

// The work a GEMM call enqueues. It cannot return a status (the stream has run on by then), so
// a failure here, which can only be memory for the packed operands, is reported on stderr.
void run_problem(const Problem& p) {
    try {
        const float alpha = p.alpha.get();
        const float beta = p.beta.get();
        for (int64_t bi = 0; bi < p.batch; ++bi) run_entry(p, bi, alpha, beta);
    } catch (const std::exception& e) {
        std::fprintf(stderr, "cuemu cublas: a %lldx%lldx%lld GEMM failed: %s\n", (long long)p.m, (long long)p.n,
                     (long long)p.k, e.what());
    } catch (...) {
        std::fprintf(stderr, "cuemu cublas: a %lldx%lldx%lld GEMM failed\n", (long long)p.m, (long long)p.n,
                     (long long)p.k);
    }
}

cublasStatus_t submit(void* stream, const Problem& p) {
    if (p.m == 0 || p.n == 0 || p.batch == 0) return CUBLAS_STATUS_SUCCESS;
    try {
        cuemu::enqueue(stream, [p] { run_problem(p); });
    } catch (...) {
        return CUBLAS_STATUS_ALLOC_FAILED;
    }
    return CUBLAS_STATUS_SUCCESS;
}

Scalar scalar(const void* ptr, bool device_mode) {
    const float* f = static_cast<const float*>(ptr);
    return device_mode ? Scalar{true, f, 0.0f} : Scalar{false, nullptr, *f};
}

// ---------------------------------------------------------------------------------------------
// cuBLAS's GEMM, for GemmEx, its strided-batched form and Sgemm.

bool valid_op(int op) { return op == CUBLAS_OP_N || op == CUBLAS_OP_T || op == CUBLAS_OP_C; }

bool valid_algo(int algo) {
    return (algo >= CUBLAS_GEMM_DEFAULT && algo <= CUBLAS_GEMM_ALGO23) ||
           (algo >= CUBLAS_GEMM_DEFAULT_TENSOR_OP && algo <= CUBLAS_GEMM_ALGO15_TENSOR_OP) ||
           algo == CUBLAS_GEMM_AUTOTUNE;
}

cublasStatus_t blas_gemm(cublasHandle_t handle, int transa, int transb, int m, int n, int k, const void* alpha,
                         const void* A, int a_type, int lda, long long stride_a, const void* B, int b_type, int ldb,
                         long long stride_b, const void* beta, void* C, int c_type, int ldc, long long stride_c,
                         int batch, int compute, int algo) {
    if (!live(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (transa == CUBLAS_OP_CONJG || transb == CUBLAS_OP_CONJG) return CUBLAS_STATUS_NOT_SUPPORTED;
    if (!valid_op(transa) || !valid_op(transb)) return CUBLAS_STATUS_INVALID_VALUE;
    if (m < 0 || n < 0 || k < 0 || batch < 0) return CUBLAS_STATUS_INVALID_VALUE;
    // op(X) = X for N; T and C (conjugate transpose: the transpose for real types) swap.
    const bool ta = transa != CUBLAS_OP_N;
    const bool tb = transb != CUBLAS_OP_N;
    if (lda < std::max(1, ta ? k : m) || ldb < std::max(1, tb ? n : k) || ldc < std::max(1, m))
        return CUBLAS_STATUS_INVALID_VALUE;
    if (!alpha || !beta) return CUBLAS_STATUS_INVALID_VALUE;
    if (!valid_algo(algo)) return CUBLAS_STATUS_INVALID_VALUE;
    if (!supported_compute(compute) || !supported_types(a_type, b_type, c_type)) return CUBLAS_STATUS_NOT_SUPPORTED;
    if (m == 0 || n == 0 || batch == 0) return CUBLAS_STATUS_SUCCESS;
    if (!C || (k > 0 && (!A || !B))) return CUBLAS_STATUS_INVALID_VALUE;

    Problem p{};
    p.m = m;
    p.n = n;
    p.k = k;
    p.batch = batch;
    // Column-major: stored X[r, c] is at r + c·ld.
    p.a = operand(A, a_type, 1, lda, stride_a, ta);
    p.b = operand(B, b_type, 1, ldb, stride_b, tb);
    p.c = Matrix{C, c_type, 1, ldc, stride_c};
    p.d = p.c;
    const bool device = handle->pointer_mode == CUBLAS_POINTER_MODE_DEVICE;
    p.alpha = scalar(alpha, device);
    p.beta = scalar(beta, device);
    p.split_k = 1;  // cuBLAS's own heuristic may split k on a GPU; this fake never does
    return submit(handle->stream, p);
}

// ---------------------------------------------------------------------------------------------
// cuBLASLt: descriptors to a Problem, and the algorithms the heuristic offers.

// What an algorithm of this fake records in cublasLtMatmulAlgo_t::data (callers copy it as
// opaque bytes; ConfigGet/SetAttribute read and write the fields).
struct AlgoFields {
    uint64_t magic;
    int32_t id;
    uint32_t tile;
    uint32_t split_k;
    uint32_t reduction;
    uint32_t swizzle;
    uint32_t custom;
    uint32_t stages;
    uint16_t inner;
    uint16_t cluster;
};
static_assert(sizeof(AlgoFields) <= sizeof(cublasLtMatmulAlgo_t), "the fields fit the algorithm");

AlgoFields read_algo(const cublasLtMatmulAlgo_t* algo) {
    AlgoFields f;
    std::memcpy(&f, algo->data, sizeof f);
    return f;
}
void write_algo(cublasLtMatmulAlgo_t* algo, const AlgoFields& f) {
    std::memset(algo->data, 0, sizeof algo->data);
    std::memcpy(algo->data, &f, sizeof f);
}

struct LtView {  // a layout's matrix: its size as stored, and the strides of its order
    int type;
    int64_t rows, cols, rs, cs, batch, stride;
};

cublasStatus_t view_layout(const LtLayout* l, LtView* out) {
    const Attrs& at = l->attrs;
    const uint64_t rows = at.get<uint64_t>(LAYOUT_ROWS);
    const uint64_t cols = at.get<uint64_t>(LAYOUT_COLS);
    const int64_t ld = at.get<int64_t>(LAYOUT_LD);
    const int32_t order = at.get<int32_t>(LAYOUT_ORDER);
    const int32_t batch = at.get<int32_t>(LAYOUT_BATCH_COUNT);
    // Far beyond any real matrix, and keeps every index product inside int64.
    constexpr uint64_t kMaxDim = uint64_t(1) << 31;
    if (rows > kMaxDim || cols > kMaxDim || batch < 1) return CUBLAS_STATUS_INVALID_VALUE;
    if (order != ORDER_COL && order != ORDER_ROW) return CUBLAS_STATUS_NOT_SUPPORTED;  // the tiled orders (COL32, …)
    if (at.get<int32_t>(LAYOUT_BATCH_MODE) != BATCH_MODE_STRIDED) return CUBLAS_STATUS_NOT_SUPPORTED;
    if (at.get<int64_t>(LAYOUT_PLANE_OFFSET) != 0) return CUBLAS_STATUS_NOT_SUPPORTED;  // planar complex
    const int64_t r = int64_t(rows), c = int64_t(cols);
    if (ld < std::max<int64_t>(1, order == ORDER_COL ? r : c)) return CUBLAS_STATUS_INVALID_VALUE;
    out->type = at.get<int32_t>(LAYOUT_TYPE);
    out->rows = r;
    out->cols = c;
    out->rs = order == ORDER_COL ? 1 : ld;
    out->cs = order == ORDER_COL ? ld : 1;
    out->batch = batch;
    out->stride = at.get<int64_t>(LAYOUT_STRIDED_BATCH_OFFSET);
    return CUBLAS_STATUS_SUCCESS;
}

// Checks a matmul's descriptors and fills `p` but for its pointers, scalars and split-K.
cublasStatus_t lt_problem(const LtDesc* desc, const LtLayout* al, const LtLayout* bl, const LtLayout* cl,
                          const LtLayout* dl, Problem* p, bool* device_scalars) {
    if (!live(desc) || !live(al) || !live(bl) || !live(dl) || (cl && !live(cl))) return CUBLAS_STATUS_INVALID_VALUE;
    if (!cl) cl = dl;
    const Attrs& at = desc->attrs;
    const int transa = at.get<int32_t>(DESC_TRANSA);
    const int transb = at.get<int32_t>(DESC_TRANSB);
    if (!valid_op(transa) || !valid_op(transb) || at.get<int32_t>(DESC_TRANSC) != CUBLAS_OP_N)
        return CUBLAS_STATUS_NOT_SUPPORTED;
    if (!supported_compute(at.get<int32_t>(DESC_COMPUTE_TYPE)) || at.get<int32_t>(DESC_SCALE_TYPE) != CUDA_R_32F)
        return CUBLAS_STATUS_NOT_SUPPORTED;
    const int pointer_mode = at.get<int32_t>(DESC_POINTER_MODE);
    if (pointer_mode != LT_POINTER_MODE_HOST && pointer_mode != LT_POINTER_MODE_DEVICE)
        return CUBLAS_STATUS_NOT_SUPPORTED;  // the per-row alpha vector modes
    // No epilogue (bias, activations, aux outputs), no triangular fill, no FP8 scaling.
    if (at.get<uint32_t>(DESC_EPILOGUE) != EPILOGUE_DEFAULT || at.get<int32_t>(DESC_FILL_MODE) != FILL_MODE_FULL)
        return CUBLAS_STATUS_NOT_SUPPORTED;
    for (int id : {DESC_A_SCALE_POINTER, DESC_B_SCALE_POINTER, DESC_C_SCALE_POINTER, DESC_D_SCALE_POINTER,
                   DESC_AMAX_D_POINTER, DESC_D_OUT_SCALE_POINTER})
        if (at.get<uint64_t>(id) != 0) return CUBLAS_STATUS_NOT_SUPPORTED;

    LtView a, b, c, d;
    const LtLayout* layouts[4] = {al, bl, cl, dl};
    LtView* views[4] = {&a, &b, &c, &d};
    for (int x = 0; x < 4; ++x) {
        const cublasStatus_t st = view_layout(layouts[x], views[x]);
        if (st != CUBLAS_STATUS_SUCCESS) return st;
    }
    if (c.type != d.type || !supported_types(a.type, b.type, d.type)) return CUBLAS_STATUS_NOT_SUPPORTED;
    const bool ta = transa != CUBLAS_OP_N, tb = transb != CUBLAS_OP_N;
    const int64_t m = ta ? a.cols : a.rows, k = ta ? a.rows : a.cols;
    const int64_t kb = tb ? b.cols : b.rows, n = tb ? b.rows : b.cols;
    if (kb != k || d.rows != m || d.cols != n || c.rows != m || c.cols != n) return CUBLAS_STATUS_INVALID_VALUE;
    if (a.batch != d.batch || b.batch != d.batch || c.batch != d.batch) return CUBLAS_STATUS_INVALID_VALUE;

    p->m = m;
    p->n = n;
    p->k = k;
    p->batch = d.batch;
    p->a = operand(nullptr, a.type, a.rs, a.cs, a.stride, ta);
    p->b = operand(nullptr, b.type, b.rs, b.cs, b.stride, tb);
    p->c = Matrix{nullptr, c.type, c.rs, c.cs, c.stride};
    p->d = Matrix{nullptr, d.type, d.rs, d.cs, d.stride};
    p->split_k = 1;
    *device_scalars = pointer_mode == LT_POINTER_MODE_DEVICE;
    return CUBLAS_STATUS_SUCCESS;
}

// Split-K needs room for every chunk's f32 sums.
size_t split_workspace(const Problem& p, int64_t splits) {
    return splits <= 1 ? 0 : size_t(p.m) * size_t(p.n) * size_t(p.batch) * sizeof(float) * size_t(splits);
}

struct Candidate {
    AlgoFields fields;
    size_t workspace;
    float waves;
};

// What a Hopper-sized GPU (132 SMs, 128×128 tiles) might be offered: the plain kernel, and when
// k is long enough a split-K one, ranked first when the output has too few tiles to fill the
// GPU (the small-m decode shapes of blas_lt.rs's doc). Both compute the same product here, up
// to the chunked summation order of split-K.
std::vector<Candidate> candidates(const Problem& p, uint64_t max_workspace, uint32_t reduction_mask) {
    constexpr int64_t kSms = 132;
    const int64_t tiles = std::max<int64_t>(1, (p.m + 127) / 128 * ((p.n + 127) / 128) * p.batch);
    std::vector<Candidate> out;
    const Candidate plain{{kAlgoMagic, 0, TILE_128x128, 1, REDUCTION_NONE, 0, 0, 0, 0, 0}, 0, float(tiles) / kSms};
    const int64_t splits = std::clamp<int64_t>(std::min(kSms / tiles, p.k / 1024), 2, 8);
    const Candidate split{{kAlgoMagic, 1, TILE_64x128, uint32_t(splits), REDUCTION_COMPUTE_TYPE, 0, 0, 0, 0, 0},
                          split_workspace(p, splits), float(tiles * splits) / kSms};
    const bool can_split =
        p.k >= 2048 && (reduction_mask & REDUCTION_COMPUTE_TYPE) != 0 && split.workspace <= max_workspace;
    if (can_split && tiles < kSms / 2) out.push_back(split);
    out.push_back(plain);
    if (can_split && tiles >= kSms / 2) out.push_back(split);
    return out;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// cuBLAS entry points.

extern "C" {

cublasStatus_t cublasCreate_v2(cublasHandle_t* handle) {
    if (!handle) return CUBLAS_STATUS_INVALID_VALUE;
    cublasContext* h = new (std::nothrow) cublasContext{kBlasMagic, nullptr, nullptr, 0, CUBLAS_DEFAULT_MATH,
                                                        CUBLAS_POINTER_MODE_HOST, CUBLAS_ATOMICS_NOT_ALLOWED};
    if (!h) return CUBLAS_STATUS_ALLOC_FAILED;
    *handle = h;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy_v2(cublasHandle_t handle) {
    if (!live(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
    handle->magic = 0;
    delete handle;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGetVersion_v2(cublasHandle_t handle, int* version) {
    if (!live(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (!version) return CUBLAS_STATUS_INVALID_VALUE;
    *version = kVersion;
    return CUBLAS_STATUS_SUCCESS;
}

// As in cuBLAS, binding a stream drops a user workspace (blas.rs sets its own afterwards).
cublasStatus_t cublasSetStream_v2(cublasHandle_t handle, cudaStream_t stream) {
    if (!live(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
    handle->stream = stream;
    handle->workspace = nullptr;
    handle->workspace_bytes = 0;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGetStream_v2(cublasHandle_t handle, cudaStream_t* stream) {
    if (!live(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (!stream) return CUBLAS_STATUS_INVALID_VALUE;
    *stream = static_cast<cudaStream_t>(handle->stream);
    return CUBLAS_STATUS_SUCCESS;
}

// Recorded only: the emulated GEMMs need no scratch on the "device".
cublasStatus_t cublasSetWorkspace_v2(cublasHandle_t handle, void* workspace, size_t bytes) {
    if (!live(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (!workspace && bytes != 0) return CUBLAS_STATUS_INVALID_VALUE;
    handle->workspace = workspace;
    handle->workspace_bytes = bytes;
    return CUBLAS_STATUS_SUCCESS;
}

// Recorded only: every mode computes the same f32 product here (on a GPU, TF32 mode would
// round f32 inputs; nothing in NovaInfer multiplies f32 inputs).
cublasStatus_t cublasSetMathMode(cublasHandle_t handle, cublasMath_t mode) {
    if (!live(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
    handle->math_mode = mode;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGetMathMode(cublasHandle_t handle, cublasMath_t* mode) {
    if (!live(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (!mode) return CUBLAS_STATUS_INVALID_VALUE;
    *mode = cublasMath_t(handle->math_mode);
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetPointerMode_v2(cublasHandle_t handle, cublasPointerMode_t mode) {
    if (!live(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (mode != CUBLAS_POINTER_MODE_HOST && mode != CUBLAS_POINTER_MODE_DEVICE) return CUBLAS_STATUS_INVALID_VALUE;
    handle->pointer_mode = mode;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGetPointerMode_v2(cublasHandle_t handle, cublasPointerMode_t* mode) {
    if (!live(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (!mode) return CUBLAS_STATUS_INVALID_VALUE;
    *mode = cublasPointerMode_t(handle->pointer_mode);
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetAtomicsMode(cublasHandle_t handle, cublasAtomicsMode_t mode) {
    if (!live(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (mode != CUBLAS_ATOMICS_NOT_ALLOWED && mode != CUBLAS_ATOMICS_ALLOWED) return CUBLAS_STATUS_INVALID_VALUE;
    handle->atomics_mode = mode;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGetAtomicsMode(cublasHandle_t handle, cublasAtomicsMode_t* mode) {
    if (!live(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (!mode) return CUBLAS_STATUS_INVALID_VALUE;
    *mode = cublasAtomicsMode_t(handle->atomics_mode);
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n,
                            int k, const void* alpha, const void* A, cudaDataType Atype, int lda, const void* B,
                            cudaDataType Btype, int ldb, const void* beta, void* C, cudaDataType Ctype, int ldc,
                            cublasComputeType_t computeType, cublasGemmAlgo_t algo) {
    return blas_gemm(handle, transa, transb, m, n, k, alpha, A, Atype, lda, 0, B, Btype, ldb, 0, beta, C, Ctype, ldc,
                     0, 1, computeType, algo);
}

cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb,
                                          int m, int n, int k, const void* alpha, const void* A, cudaDataType Atype,
                                          int lda, long long strideA, const void* B, cudaDataType Btype, int ldb,
                                          long long strideB, const void* beta, void* C, cudaDataType Ctype, int ldc,
                                          long long strideC, int batchCount, cublasComputeType_t computeType,
                                          cublasGemmAlgo_t algo) {
    return blas_gemm(handle, transa, transb, m, n, k, alpha, A, Atype, lda, strideA, B, Btype, ldb, strideB, beta, C,
                     Ctype, ldc, strideC, batchCount, computeType, algo);
}

cublasStatus_t cublasSgemm_v2(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n,
                              int k, const float* alpha, const float* A, int lda, const float* B, int ldb,
                              const float* beta, float* C, int ldc) {
    return blas_gemm(handle, transa, transb, m, n, k, alpha, A, CUDA_R_32F, lda, 0, B, CUDA_R_32F, ldb, 0, beta, C,
                     CUDA_R_32F, ldc, 0, 1, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
}

cublasStatus_t cublasSgemmStridedBatched(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb,
                                         int m, int n, int k, const float* alpha, const float* A, int lda,
                                         long long strideA, const float* B, int ldb, long long strideB,
                                         const float* beta, float* C, int ldc, long long strideC, int batchCount) {
    return blas_gemm(handle, transa, transb, m, n, k, alpha, A, CUDA_R_32F, lda, strideA, B, CUDA_R_32F, ldb, strideB,
                     beta, C, CUDA_R_32F, ldc, strideC, batchCount, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
}

static const char* status_name(cublasStatus_t status) {
    switch (status) {
        case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
        case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
        case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
        case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
        case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
        case CUBLAS_STATUS_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR";
        case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
        case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
        case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
        case CUBLAS_STATUS_LICENSE_ERROR: return "CUBLAS_STATUS_LICENSE_ERROR";
    }
    return "CUBLAS_STATUS_UNKNOWN";
}

static const char* status_string(cublasStatus_t status) {
    switch (status) {
        case CUBLAS_STATUS_SUCCESS: return "the operation completed successfully";
        case CUBLAS_STATUS_NOT_INITIALIZED: return "the library was not initialized";
        case CUBLAS_STATUS_ALLOC_FAILED: return "the resource allocation failed";
        case CUBLAS_STATUS_INVALID_VALUE: return "an invalid numeric value was used as an argument";
        case CUBLAS_STATUS_ARCH_MISMATCH: return "an absent device architectural feature is required";
        case CUBLAS_STATUS_MAPPING_ERROR: return "an access to GPU memory space failed";
        case CUBLAS_STATUS_EXECUTION_FAILED: return "the GPU program failed to execute";
        case CUBLAS_STATUS_INTERNAL_ERROR: return "an internal operation failed";
        case CUBLAS_STATUS_NOT_SUPPORTED: return "the functionality requested is not supported";
        case CUBLAS_STATUS_LICENSE_ERROR: return "an error was detected when checking the current licensing";
    }
    return "unknown error";
}

const char* cublasGetStatusName(cublasStatus_t status) { return status_name(status); }
const char* cublasGetStatusString(cublasStatus_t status) { return status_string(status); }

// ---------------------------------------------------------------------------------------------
// cuBLASLt entry points.

cublasStatus_t cublasLtCreate(cublasLtHandle_t* handle) {
    if (!handle) return CUBLAS_STATUS_INVALID_VALUE;
    cublasLtContext* h = new (std::nothrow) cublasLtContext{kLtMagic};
    if (!h) return CUBLAS_STATUS_ALLOC_FAILED;
    *handle = h;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtDestroy(cublasLtHandle_t handle) {
    if (!live(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
    handle->magic = 0;
    delete handle;
    return CUBLAS_STATUS_SUCCESS;
}

size_t cublasLtGetVersion(void) { return size_t(kVersion); }

const char* cublasLtGetStatusName(cublasStatus_t status) { return status_name(status); }
const char* cublasLtGetStatusString(cublasStatus_t status) { return status_string(status); }

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* desc, cublasComputeType_t computeType,
                                        cudaDataType_t scaleType) {
    if (!desc) return CUBLAS_STATUS_INVALID_VALUE;
    LtDesc* d = new (std::nothrow) LtDesc{kDescMagic, {}};
    if (!d) return CUBLAS_STATUS_ALLOC_FAILED;
    // cuBLASLt's defaults; every other attribute starts as zero (null pointers, N, host mode).
    d->attrs.put<int32_t>(DESC_COMPUTE_TYPE, computeType);
    d->attrs.put<int32_t>(DESC_SCALE_TYPE, scaleType);
    d->attrs.put<int32_t>(DESC_FILL_MODE, FILL_MODE_FULL);
    d->attrs.put<uint32_t>(DESC_EPILOGUE, EPILOGUE_DEFAULT);
    *desc = d;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t desc) {
    if (!live(desc)) return CUBLAS_STATUS_INVALID_VALUE;
    desc->magic = 0;
    delete desc;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t desc, int attr, const void* buf, size_t bytes) {
    if (!live(desc)) return CUBLAS_STATUS_INVALID_VALUE;
    return set_attr(kDescAttrs, desc->attrs, attr, buf, bytes);
}

cublasStatus_t cublasLtMatmulDescGetAttribute(cublasLtMatmulDesc_t desc, int attr, void* buf, size_t bytes,
                                              size_t* written) {
    if (!live(desc)) return CUBLAS_STATUS_INVALID_VALUE;
    return get_attr(kDescAttrs, desc->attrs, attr, buf, bytes, written);
}

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* layout, cudaDataType type, uint64_t rows,
                                          uint64_t cols, int64_t ld) {
    if (!layout) return CUBLAS_STATUS_INVALID_VALUE;
    LtLayout* l = new (std::nothrow) LtLayout{kLayoutMagic, {}};
    if (!l) return CUBLAS_STATUS_ALLOC_FAILED;
    l->attrs.put<uint32_t>(LAYOUT_TYPE, uint32_t(type));
    l->attrs.put<int32_t>(LAYOUT_ORDER, ORDER_COL);
    l->attrs.put<uint64_t>(LAYOUT_ROWS, rows);
    l->attrs.put<uint64_t>(LAYOUT_COLS, cols);
    l->attrs.put<int64_t>(LAYOUT_LD, ld);
    l->attrs.put<int32_t>(LAYOUT_BATCH_COUNT, 1);
    *layout = l;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t layout) {
    if (!live(layout)) return CUBLAS_STATUS_INVALID_VALUE;
    layout->magic = 0;
    delete layout;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutSetAttribute(cublasLtMatrixLayout_t layout, int attr, const void* buf,
                                                size_t bytes) {
    if (!live(layout)) return CUBLAS_STATUS_INVALID_VALUE;
    return set_attr(kLayoutAttrs, layout->attrs, attr, buf, bytes);
}

cublasStatus_t cublasLtMatrixLayoutGetAttribute(cublasLtMatrixLayout_t layout, int attr, void* buf, size_t bytes,
                                                size_t* written) {
    if (!live(layout)) return CUBLAS_STATUS_INVALID_VALUE;
    return get_attr(kLayoutAttrs, layout->attrs, attr, buf, bytes, written);
}

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* pref) {
    if (!pref) return CUBLAS_STATUS_INVALID_VALUE;
    LtPref* p = new (std::nothrow) LtPref{kPrefMagic, {}};
    if (!p) return CUBLAS_STATUS_ALLOC_FAILED;
    // No workspace unless the caller offers some (cuBLASLt's default), every reduction scheme.
    p->attrs.put<uint64_t>(PREF_MAX_WORKSPACE_BYTES, 0);
    p->attrs.put<uint32_t>(PREF_REDUCTION_SCHEME_MASK, REDUCTION_MASK_ALL);
    *pref = p;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref) {
    if (!live(pref)) return CUBLAS_STATUS_INVALID_VALUE;
    pref->magic = 0;
    delete pref;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t pref, int attr, const void* buf,
                                                    size_t bytes) {
    if (!live(pref)) return CUBLAS_STATUS_INVALID_VALUE;
    return set_attr(kPrefAttrs, pref->attrs, attr, buf, bytes);
}

cublasStatus_t cublasLtMatmulPreferenceGetAttribute(cublasLtMatmulPreference_t pref, int attr, void* buf,
                                                    size_t bytes, size_t* written) {
    if (!live(pref)) return CUBLAS_STATUS_INVALID_VALUE;
    return get_attr(kPrefAttrs, pref->attrs, attr, buf, bytes, written);
}

cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
                                              cublasLtMatrixLayout_t Adesc, cublasLtMatrixLayout_t Bdesc,
                                              cublasLtMatrixLayout_t Cdesc, cublasLtMatrixLayout_t Ddesc,
                                              cublasLtMatmulPreference_t pref, int requested,
                                              cublasLtMatmulHeuristicResult_t* results, int* returned) {
    if (!live(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (!returned || !results || requested <= 0 || (pref && !live(pref))) return CUBLAS_STATUS_INVALID_VALUE;
    *returned = 0;
    Problem p{};
    bool device_scalars = false;
    const cublasStatus_t st = lt_problem(desc, Adesc, Bdesc, Cdesc, Ddesc, &p, &device_scalars);
    if (st != CUBLAS_STATUS_SUCCESS) return st;
    const uint64_t max_ws = pref ? pref->attrs.get<uint64_t>(PREF_MAX_WORKSPACE_BYTES) : 0;
    const uint32_t mask = pref ? pref->attrs.get<uint32_t>(PREF_REDUCTION_SCHEME_MASK) : uint32_t(REDUCTION_MASK_ALL);
    std::vector<Candidate> found;
    try {
        found = candidates(p, max_ws, mask);
    } catch (...) {
        return CUBLAS_STATUS_ALLOC_FAILED;
    }
    const int count = std::min<int>(requested, int(found.size()));
    for (int r = 0; r < count; ++r) {
        cublasLtMatmulHeuristicResult_t& out = results[r];
        std::memset(&out, 0, sizeof out);
        write_algo(&out.algo, found[size_t(r)].fields);
        out.workspaceSize = found[size_t(r)].workspace;
        out.state = CUBLAS_STATUS_SUCCESS;
        out.wavesCount = found[size_t(r)].waves;
    }
    *returned = count;
    return count > 0 ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_NOT_SUPPORTED;
}

cublasStatus_t cublasLtMatmulAlgoConfigGetAttribute(const cublasLtMatmulAlgo_t* algo, int attr, void* buf,
                                                    size_t bytes, size_t* written) {
    if (!algo) return CUBLAS_STATUS_INVALID_VALUE;
    const AlgoFields f = read_algo(algo);
    uint32_t u32 = 0;
    uint16_t u16 = 0;
    const void* src = &u32;
    size_t size = 4;
    switch (attr) {
        case ALGO_CONFIG_ID: std::memcpy(&u32, &f.id, 4); break;
        case ALGO_CONFIG_TILE_ID: u32 = f.tile; break;
        case ALGO_CONFIG_SPLITK_NUM: u32 = f.split_k; break;
        case ALGO_CONFIG_REDUCTION_SCHEME: u32 = f.reduction; break;
        case ALGO_CONFIG_CTA_SWIZZLING: u32 = f.swizzle; break;
        case ALGO_CONFIG_CUSTOM_OPTION: u32 = f.custom; break;
        case ALGO_CONFIG_STAGES_ID: u32 = f.stages; break;
        case ALGO_CONFIG_INNER_SHAPE_ID: u16 = f.inner, src = &u16, size = 2; break;
        case ALGO_CONFIG_CLUSTER_SHAPE_ID: u16 = f.cluster, src = &u16, size = 2; break;
        default: return CUBLAS_STATUS_INVALID_VALUE;
    }
    if (bytes == 0) {
        if (!written) return CUBLAS_STATUS_INVALID_VALUE;
        *written = size;
        return CUBLAS_STATUS_SUCCESS;
    }
    if (written) *written = size;
    if (!buf || bytes != size) return CUBLAS_STATUS_INVALID_VALUE;
    std::memcpy(buf, src, size);
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulAlgoConfigSetAttribute(cublasLtMatmulAlgo_t* algo, int attr, const void* buf,
                                                    size_t bytes) {
    if (!algo || !buf) return CUBLAS_STATUS_INVALID_VALUE;
    AlgoFields f = read_algo(algo);
    const size_t size = (attr == ALGO_CONFIG_INNER_SHAPE_ID || attr == ALGO_CONFIG_CLUSTER_SHAPE_ID) ? 2 : 4;
    if (bytes != size) return CUBLAS_STATUS_INVALID_VALUE;
    uint32_t u32 = 0;
    uint16_t u16 = 0;
    if (size == 4) std::memcpy(&u32, buf, 4);
    else std::memcpy(&u16, buf, 2);
    switch (attr) {
        case ALGO_CONFIG_ID: std::memcpy(&f.id, &u32, 4); break;
        case ALGO_CONFIG_TILE_ID: f.tile = u32; break;
        case ALGO_CONFIG_SPLITK_NUM: f.split_k = u32; break;
        case ALGO_CONFIG_REDUCTION_SCHEME: f.reduction = u32; break;
        case ALGO_CONFIG_CTA_SWIZZLING: f.swizzle = u32; break;
        case ALGO_CONFIG_CUSTOM_OPTION: f.custom = u32; break;
        case ALGO_CONFIG_STAGES_ID: f.stages = u32; break;
        case ALGO_CONFIG_INNER_SHAPE_ID: f.inner = u16; break;
        case ALGO_CONFIG_CLUSTER_SHAPE_ID: f.cluster = u16; break;
        default: return CUBLAS_STATUS_INVALID_VALUE;
    }
    write_algo(algo, f);
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmul(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, const void* alpha, const void* A,
                              cublasLtMatrixLayout_t Adesc, const void* B, cublasLtMatrixLayout_t Bdesc,
                              const void* beta, const void* C, cublasLtMatrixLayout_t Cdesc, void* D,
                              cublasLtMatrixLayout_t Ddesc, const cublasLtMatmulAlgo_t* algo, void* workspace,
                              size_t workspaceSizeInBytes, cudaStream_t stream) {
    if (!live(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
    Problem p{};
    bool device_scalars = false;
    const cublasStatus_t st = lt_problem(desc, Adesc, Bdesc, Cdesc, Ddesc, &p, &device_scalars);
    if (st != CUBLAS_STATUS_SUCCESS) return st;
    if (!alpha || !beta) return CUBLAS_STATUS_INVALID_VALUE;
    if (workspaceSizeInBytes != 0 && !workspace) return CUBLAS_STATUS_INVALID_VALUE;

    AlgoFields f;
    if (algo) {
        f = read_algo(algo);
        if (f.magic != kAlgoMagic) return CUBLAS_STATUS_INVALID_VALUE;  // not from this library's heuristic
    } else {
        // No algorithm: cuBLASLt asks its own heuristic, within the workspace given.
        std::vector<Candidate> found;
        try {
            found = candidates(p, workspaceSizeInBytes, REDUCTION_MASK_ALL);
        } catch (...) {
            return CUBLAS_STATUS_ALLOC_FAILED;
        }
        f = found.front().fields;
    }
    p.split_k = std::max<int64_t>(1, f.split_k);
    // Split-K is emulated for chunk sums reduced in f32; the in-place and output-type schemes
    // round partial sums to the output type, which this emulation does not model.
    if (p.split_k > 1 && f.reduction != REDUCTION_COMPUTE_TYPE) return CUBLAS_STATUS_NOT_SUPPORTED;
    if (workspaceSizeInBytes < split_workspace(p, p.split_k)) return CUBLAS_STATUS_INVALID_VALUE;

    if (p.m > 0 && p.n > 0) {
        if (!D || (p.k > 0 && (!A || !B))) return CUBLAS_STATUS_INVALID_VALUE;
        // C is read only for a nonzero beta; a host-mode beta is known now.
        const bool may_read_c = device_scalars || *static_cast<const float*>(beta) != 0.0f;
        if (may_read_c && !C) return CUBLAS_STATUS_INVALID_VALUE;
    }
    // In place (C == D) only with one layout, as cuBLASLt requires.
    if (C && C == D) {
        const Matrix &c = p.c, &d = p.d;
        if (c.type != d.type || c.rs != d.rs || c.cs != d.cs || c.stride != d.stride)
            return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    p.a.base = A;
    p.b.base = B;
    p.c.base = C;
    p.d.base = D;
    p.alpha = scalar(alpha, device_scalars);
    p.beta = scalar(beta, device_scalars);
    return submit(stream, p);
}

}  // extern "C"
