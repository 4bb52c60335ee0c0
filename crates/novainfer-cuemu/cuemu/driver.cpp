// driver.cpp — a fake libcuda.so.1 over the emulator, enough of the CUDA driver API for
// cudarc and NovaInfer's CUDA code to run on the CPU (tests only; see driver_api.h).
//
// One device, "cuemu", compute capability 9.0 (NVRTC builds sm_90 code that nobody runs:
// cuModuleGetFunction finds kernels by name in the emulator's registry). Device memory is
// host memory from aligned_alloc; a CUdeviceptr is its address. Every stream operation runs
// at once on the calling thread, in call order, which is one legal schedule of a CUDA
// program; while a stream captures a graph its operations are recorded instead, with their
// arguments copied, and run at each cuGraphLaunch. A kernel launch that fails in the
// emulator (a deadlock, say) returns CUDA_ERROR_LAUNCH_FAILED and prints why.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "driver_api.h"
#include "registry.h"

namespace cuemu {
extern "C" int cuemu_launch(const unsigned grid[3], const unsigned block[3], void (*body)(void*), void* ctx,
                            int schedule, uint64_t seed, char* error, size_t error_len);
}

namespace {
typedef int CUresult;
constexpr CUresult CUDA_SUCCESS = 0;
constexpr CUresult CUDA_ERROR_INVALID_VALUE = 1;
constexpr CUresult CUDA_ERROR_OUT_OF_MEMORY = 2;
constexpr CUresult CUDA_ERROR_INVALID_DEVICE = 101;
constexpr CUresult CUDA_ERROR_INVALID_HANDLE = 400;
constexpr CUresult CUDA_ERROR_NOT_FOUND = 500;
constexpr CUresult CUDA_ERROR_LAUNCH_FAILED = 719;
constexpr CUresult CUDA_ERROR_STREAM_CAPTURE_INVALIDATED = 901;

typedef unsigned long long CUdeviceptr;
typedef int CUdevice;

struct Graph {
    std::vector<std::function<CUresult()>> ops;
};
struct Stream {
    Graph* capture = nullptr;  // non-null while capturing
};
struct Event {
    std::chrono::steady_clock::time_point at{};
};
struct Module {};
struct Function {
    std::string name;
    cuemu::Binder bind;
};
struct Context {};

Context the_context;
Stream legacy_stream;
std::mutex memory_lock;
std::unordered_map<void*, size_t> allocations;  // for cuMemGetInfo's free figure
size_t allocated = 0;
constexpr size_t kTotalMemory = size_t(64) << 30;  // what cuMemGetInfo reports

Stream* stream_of(void* s) { return s ? static_cast<Stream*>(s) : &legacy_stream; }

// Runs `op` now, or records it when the stream is capturing.
CUresult submit(void* s, std::function<CUresult()> op) {
    Stream* stream = stream_of(s);
    if (stream->capture) {
        stream->capture->ops.push_back(std::move(op));
        return CUDA_SUCCESS;
    }
    return op();
}

void* device_alloc(size_t bytes) {
    // 256 bytes, as cudaMalloc aligns; never null for zero bytes.
    const size_t rounded = (bytes + 255) / 256 * 256;
    void* p = std::aligned_alloc(256, rounded ? rounded : 256);
    if (p) {
        std::lock_guard<std::mutex> lock(memory_lock);
        allocations[p] = rounded;
        allocated += rounded;
    }
    return p;
}

void device_free(void* p) {
    if (!p) return;
    {
        std::lock_guard<std::mutex> lock(memory_lock);
        const auto it = allocations.find(p);
        if (it != allocations.end()) {
            allocated -= it->second;
            allocations.erase(it);
        }
    }
    std::free(p);
}

struct LaunchBody {
    cuemu::Bound run;
};

// The order a block's threads run in (runtime.cpp's `schedule`), from CUEMU_SCHEDULE as the
// Rust side reads it: forward, reverse, shuffle or shuffle:SEED.
struct Order {
    int kind = 0;
    uint64_t seed = 0;
};
Order order_from_env() {
    const char* v = std::getenv("CUEMU_SCHEDULE");
    if (!v || !*v || !std::strcmp(v, "forward")) return {0, 0};
    if (!std::strcmp(v, "reverse")) return {1, 0};
    if (!std::strcmp(v, "shuffle")) return {2, 1};
    if (!std::strncmp(v, "shuffle:", 8)) return {2, std::strtoull(v + 8, nullptr, 10)};
    std::fprintf(stderr, "cuemu: CUEMU_SCHEDULE=%s is not forward, reverse, shuffle or shuffle:SEED\n", v);
    std::abort();
}
const Order launch_order = order_from_env();
void run_body(void* ctx) { static_cast<LaunchBody*>(ctx)->run(); }
}  // namespace

namespace cuemu {
void enqueue(void* stream, std::function<void()> op) {
    submit(stream, [op = std::move(op)]() {
        op();
        return CUDA_SUCCESS;
    });
}
}  // namespace cuemu

extern "C" {
CUresult cuInit(unsigned) { return CUDA_SUCCESS; }
// NVRTC dlopens libcuda.so.1 too and asks it for the driver's private export tables; there
// are none here, which NVRTC takes as a driver it need not consult.
CUresult cuGetExportTable(const void** table, const void*) {
    *table = nullptr;
    return CUDA_ERROR_NOT_FOUND;
}
CUresult cuDriverGetVersion(int* v) {
    *v = 13000;
    return CUDA_SUCCESS;
}
CUresult cuDeviceGetCount(int* n) {
    *n = 1;
    return CUDA_SUCCESS;
}
CUresult cuDeviceGet(CUdevice* d, int ordinal) {
    if (ordinal != 0) return CUDA_ERROR_INVALID_DEVICE;
    *d = 0;
    return CUDA_SUCCESS;
}
CUresult cuDeviceGetName(char* name, int len, CUdevice) {
    std::snprintf(name, len, "cuemu (kernels emulated on the CPU)");
    return CUDA_SUCCESS;
}
CUresult cuDeviceGetUuid(void* uuid, CUdevice) {
    std::memset(uuid, 0, 16);
    return CUDA_SUCCESS;
}
CUresult cuDeviceGetUuid_v2(void* uuid, CUdevice d) { return cuDeviceGetUuid(uuid, d); }
CUresult cuDeviceTotalMem_v2(size_t* bytes, CUdevice) {
    *bytes = kTotalMemory;
    return CUDA_SUCCESS;
}
CUresult cuDeviceGetAttribute(int* v, int attribute, CUdevice) {
    switch (attribute) {
        case 1: *v = 1024; break;                  // max threads per block
        case 2: case 3: *v = 1024; break;          // max block dim x, y
        case 4: *v = 64; break;                    // max block dim z
        case 5: *v = 2147483647; break;            // max grid dim x
        case 6: case 7: *v = 65535; break;         // max grid dim y, z
        case 8: *v = 48 * 1024; break;             // shared memory per block
        case 10: *v = 32; break;                   // warp size
        // Four multiprocessors: launchers that size grids by them stay small under emulation.
        case 16: *v = 4; break;
        case 75: *v = 9; break;                    // compute capability
        case 76: *v = 0; break;
        case 81: *v = 228 * 1024; break;           // shared memory per multiprocessor
        case 97: *v = 227 * 1024; break;           // opt-in shared memory per block
        case 115: *v = 0; break;                   // memory pools: no (plain cuMemAlloc)
        default: *v = 0; break;
    }
    return CUDA_SUCCESS;
}
CUresult cuDevicePrimaryCtxRetain(void** ctx, CUdevice) {
    *ctx = &the_context;
    return CUDA_SUCCESS;
}
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice) { return CUDA_SUCCESS; }
CUresult cuCtxSetCurrent(void*) { return CUDA_SUCCESS; }
CUresult cuCtxGetCurrent(void** ctx) {
    *ctx = &the_context;
    return CUDA_SUCCESS;
}
CUresult cuCtxSynchronize() { return CUDA_SUCCESS; }
CUresult cuCtxSetFlags(unsigned) { return CUDA_SUCCESS; }
CUresult cuCtxGetStreamPriorityRange(int* least, int* greatest) {
    *least = 0;
    *greatest = 0;
    return CUDA_SUCCESS;
}
CUresult cuGetErrorName(CUresult e, const char** s) {
    static thread_local char buf[48];
    std::snprintf(buf, sizeof buf, "CUEMU_ERROR_%d", e);
    *s = buf;
    return CUDA_SUCCESS;
}
CUresult cuGetErrorString(CUresult e, const char** s) {
    switch (e) {
        case CUDA_ERROR_LAUNCH_FAILED: *s = "an emulated kernel launch failed (see stderr)"; break;
        case CUDA_ERROR_NOT_FOUND: *s = "no such kernel in the emulator"; break;
        default: return cuGetErrorName(e, s);
    }
    return CUDA_SUCCESS;
}

// ---- streams and events ----
CUresult cuStreamCreate(void** s, unsigned) {
    *s = new Stream();
    return CUDA_SUCCESS;
}
CUresult cuStreamCreateWithPriority(void** s, unsigned flags, int) { return cuStreamCreate(s, flags); }
CUresult cuStreamDestroy_v2(void* s) {
    delete static_cast<Stream*>(s);
    return CUDA_SUCCESS;
}
CUresult cuStreamSynchronize(void*) { return CUDA_SUCCESS; }
CUresult cuStreamWaitEvent(void*, void*, unsigned) { return CUDA_SUCCESS; }
CUresult cuStreamQuery(void*) { return CUDA_SUCCESS; }
CUresult cuEventCreate(void** e, unsigned) {
    *e = new Event();
    return CUDA_SUCCESS;
}
CUresult cuEventDestroy_v2(void* e) {
    delete static_cast<Event*>(e);
    return CUDA_SUCCESS;
}
CUresult cuEventRecord(void* e, void* s) {
    Event* ev = static_cast<Event*>(e);
    return submit(s, [ev]() {
        ev->at = std::chrono::steady_clock::now();
        return CUDA_SUCCESS;
    });
}
CUresult cuEventRecordWithFlags(void* e, void* s, unsigned) { return cuEventRecord(e, s); }
CUresult cuEventQuery(void*) { return CUDA_SUCCESS; }
CUresult cuEventSynchronize(void*) { return CUDA_SUCCESS; }
CUresult cuEventElapsedTime(float* ms, void* a, void* b) {
    const auto d = static_cast<Event*>(b)->at - static_cast<Event*>(a)->at;
    *ms = std::chrono::duration<float, std::milli>(d).count();
    return CUDA_SUCCESS;
}
CUresult cuEventElapsedTime_v2(float* ms, void* a, void* b) { return cuEventElapsedTime(ms, a, b); }
CUresult cuLaunchHostFunc(void* s, void (*fn)(void*), void* data) {
    return submit(s, [fn, data]() {
        fn(data);
        return CUDA_SUCCESS;
    });
}

// ---- memory ----
CUresult cuMemAlloc_v2(CUdeviceptr* p, size_t bytes) {
    void* mem = device_alloc(bytes);
    if (!mem) return CUDA_ERROR_OUT_OF_MEMORY;
    *p = reinterpret_cast<CUdeviceptr>(mem);
    return CUDA_SUCCESS;
}
CUresult cuMemAllocAsync(CUdeviceptr* p, size_t bytes, void*) { return cuMemAlloc_v2(p, bytes); }
CUresult cuMemFree_v2(CUdeviceptr p) {
    device_free(reinterpret_cast<void*>(p));
    return CUDA_SUCCESS;
}
CUresult cuMemFreeAsync(CUdeviceptr p, void*) { return cuMemFree_v2(p); }
CUresult cuMemHostAlloc(void** p, size_t bytes, unsigned) {
    *p = device_alloc(bytes);
    return *p ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}
CUresult cuMemAllocHost_v2(void** p, size_t bytes) { return cuMemHostAlloc(p, bytes, 0); }
CUresult cuMemFreeHost(void* p) {
    device_free(p);
    return CUDA_SUCCESS;
}
CUresult cuMemHostRegister_v2(void*, size_t, unsigned) { return CUDA_SUCCESS; }
CUresult cuMemHostUnregister(void*) { return CUDA_SUCCESS; }
CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total) {
    std::lock_guard<std::mutex> lock(memory_lock);
    *total = kTotalMemory;
    *free_bytes = allocated < kTotalMemory ? kTotalMemory - allocated : 0;
    return CUDA_SUCCESS;
}
static CUresult copy(void* dst, const void* src, size_t bytes, void* s) {
    return submit(s, [dst, src, bytes]() {
        std::memmove(dst, src, bytes);
        return CUDA_SUCCESS;
    });
}
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t n, void* s) {
    return copy(reinterpret_cast<void*>(dst), src, n, s);
}
CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void* src, size_t n) { return cuMemcpyHtoDAsync_v2(dst, src, n, nullptr); }
CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t n, void* s) {
    return copy(dst, reinterpret_cast<const void*>(src), n, s);
}
CUresult cuMemcpyDtoH_v2(void* dst, CUdeviceptr src, size_t n) { return cuMemcpyDtoHAsync_v2(dst, src, n, nullptr); }
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, void* s) {
    return copy(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), n, s);
}
CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) { return cuMemcpyDtoDAsync_v2(dst, src, n, nullptr); }
CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, void* s) { return cuMemcpyDtoDAsync_v2(dst, src, n, s); }
CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char v, size_t n, void* s) {
    return submit(s, [dst, v, n]() {
        std::memset(reinterpret_cast<void*>(dst), v, n);
        return CUDA_SUCCESS;
    });
}
CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char v, size_t n) { return cuMemsetD8Async(dst, v, n, nullptr); }
CUresult cuMemsetD32Async(CUdeviceptr dst, unsigned v, size_t n, void* s) {
    return submit(s, [dst, v, n]() {
        unsigned* p = reinterpret_cast<unsigned*>(dst);
        for (size_t i = 0; i < n; i++) p[i] = v;
        return CUDA_SUCCESS;
    });
}
CUresult cuPointerGetAttribute(void*, int, CUdeviceptr) { return CUDA_ERROR_INVALID_VALUE; }

// ---- modules and launches ----
CUresult cuModuleLoadData(void** m, const void*) {
    *m = new Module();
    return CUDA_SUCCESS;
}
CUresult cuModuleLoadDataEx(void** m, const void* image, unsigned, void*, void*) { return cuModuleLoadData(m, image); }
CUresult cuModuleUnload(void* m) {
    delete static_cast<Module*>(m);
    return CUDA_SUCCESS;
}
CUresult cuModuleGetFunction(void** f, void*, const char* name) {
    const cuemu::Binder bind = cuemu::find_kernel(name);
    if (!bind) {
        std::fprintf(stderr, "cuemu: no kernel named %s\n", name);
        return CUDA_ERROR_NOT_FOUND;
    }
    *f = new Function{name, bind};
    return CUDA_SUCCESS;
}
CUresult cuFuncGetAttribute(int* v, int attribute, void*) {
    // Max threads per block (0) is what launchers ask; registers and sizes are zero here.
    *v = attribute == 0 ? 1024 : 0;
    return CUDA_SUCCESS;
}
CUresult cuFuncSetAttribute(void*, int, int) { return CUDA_SUCCESS; }
CUresult cuFuncSetCacheConfig(void*, int) { return CUDA_SUCCESS; }
CUresult cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shared_bytes, void* s, void** params, void** extra) {
    if (!f || extra) return CUDA_ERROR_INVALID_VALUE;
    if (shared_bytes) {
        // Every kernel here sizes its shared memory statically (a `static` array in the emulator).
        std::fprintf(stderr, "cuemu: dynamic shared memory is not emulated\n");
        return CUDA_ERROR_INVALID_VALUE;
    }
    Function* fn = static_cast<Function*>(f);
    LaunchBody body{fn->bind(params)};  // arguments copied now, as CUDA does
    const std::string name = fn->name;
    return submit(s, [body = std::move(body), name, gx, gy, gz, bx, by, bz]() mutable {
        const unsigned g[3] = {gx, gy, gz}, b[3] = {bx, by, bz};
        char why[512];
        if (cuemu::cuemu_launch(g, b, run_body, &body, launch_order.kind, launch_order.seed, why, sizeof why) != 0) {
            std::fprintf(stderr, "cuemu: %s <<<(%u,%u,%u),(%u,%u,%u)>>> failed: %s\n", name.c_str(), gx, gy, gz,
                         bx, by, bz, why);
            return CUDA_ERROR_LAUNCH_FAILED;
        }
        return CUDA_SUCCESS;
    });
}

// ---- graphs ----
CUresult cuStreamBeginCapture_v2(void* s, int) {
    Stream* stream = stream_of(s);
    if (stream->capture) return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
    stream->capture = new Graph();
    return CUDA_SUCCESS;
}
CUresult cuStreamEndCapture(void* s, void** graph) {
    Stream* stream = stream_of(s);
    if (!stream->capture) return CUDA_ERROR_INVALID_VALUE;
    *graph = stream->capture;
    stream->capture = nullptr;
    return CUDA_SUCCESS;
}
CUresult cuStreamIsCapturing(void* s, int* status) {
    *status = stream_of(s)->capture ? 1 : 0;
    return CUDA_SUCCESS;
}
CUresult cuGraphInstantiateWithFlags(void** exec, void* graph, unsigned long long) {
    if (!graph) return CUDA_ERROR_INVALID_HANDLE;
    *exec = new Graph(*static_cast<Graph*>(graph));
    return CUDA_SUCCESS;
}
CUresult cuGraphUpload(void*, void*) { return CUDA_SUCCESS; }
CUresult cuGraphLaunch(void* exec, void* s) {
    Graph* g = static_cast<Graph*>(exec);
    return submit(s, [g]() {
        for (auto& op : g->ops) {
            const CUresult r = op();
            if (r != CUDA_SUCCESS) return r;
        }
        return CUDA_SUCCESS;
    });
}
CUresult cuGraphExecDestroy(void* exec) {
    delete static_cast<Graph*>(exec);
    return CUDA_SUCCESS;
}
CUresult cuGraphDestroy(void* graph) {
    delete static_cast<Graph*>(graph);
    return CUDA_SUCCESS;
}
}  // extern "C"
