// runtime.cpp — the launch and the collectives behind cuemu.h (see there for the model).
#include "cuemu.h"
#include "registry.h"

#include <ucontext.h>

#include <algorithm>
#include <cstdlib>
#include <cstdio>
#include <exception>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace cuemu {
thread_local ThreadState state;
dim3 block_dim{1, 1, 1};
dim3 grid_dim{1, 1, 1};

namespace {
// Every GPU thread of a block is a fiber on the launching OS thread, switched
// cooperatively: a fiber runs until it waits at a collective or returns. That is exact for
// the kernels' semantics (threads only communicate through barriers, shuffles and atomics),
// deterministic, and far cheaper than an OS thread per GPU thread.

// Thrown out of a collective once the launch has failed; the fiber's entry catches it.
struct Abandoned {};

// A fiber's saved context. On x86-64 a switch saves the callee-saved registers, MXCSR and the
// x87 control word on the stack and swaps stack pointers: glibc's swapcontext also saves the
// signal mask with a system call on every switch, which was most of the emulator's time.
// Elsewhere ucontext does it.
#if defined(__x86_64__)
struct Context {
    void* sp = nullptr;
};
extern "C" void cuemu_switch(void** save_sp, void* load_sp);
asm(R"(
    .text
    .p2align 4
    .type cuemu_switch,@function
cuemu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size cuemu_switch, .-cuemu_switch
)");

void switch_context(Context& save, Context& load) { cuemu_switch(&save.sp, load.sp); }

// A stack whose first switch "returns" into `entry` as if called: the frame cuemu_switch pops
// (control words, six registers, a return address), then a null return address for `entry`,
// placed so that the stack is 16-byte aligned at its call site (rsp ≡ 8 mod 16 on entry).
void start_context(Context& c, char* stack, size_t size, void (*entry)()) {
    uintptr_t top = (reinterpret_cast<uintptr_t>(stack) + size) & ~uintptr_t(15);
    // sp ≡ 8 (mod 16): the switch pops eight words, so `entry` starts at rsp = sp + 64 ≡ 8.
    uint64_t* sp = reinterpret_cast<uint64_t*>(top - 88);
    const uint32_t mxcsr = 0x1F80, x87 = 0x037F;                // the ABI's defaults
    sp[0] = mxcsr | (uint64_t)x87 << 32;
    for (int i = 1; i <= 6; i++) sp[i] = 0;  // r15 .. rbp
    sp[7] = reinterpret_cast<uint64_t>(entry);
    sp[8] = 0;  // entry's return address: it never returns
    c.sp = sp;
}
#else
struct Context {
    ucontext_t uc;
};
void switch_context(Context& save, Context& load) { swapcontext(&save.uc, &load.uc); }
void start_context(Context& c, char* stack, size_t size, void (*entry)()) {
    getcontext(&c.uc);
    c.uc.uc_stack.ss_sp = stack;
    c.uc.uc_stack.ss_size = size;
    c.uc.uc_link = nullptr;
    makecontext(&c.uc, entry, 0);
}
#endif

constexpr size_t kStack = 256 * 1024;

struct Warp {
    unsigned arrived = 0;
    unsigned long long generation = 0;
    unsigned exited = 0;  // lanes that have returned (or never exist)
    unsigned absent = 0;  // lanes past the end of the block
    uint32_t slots[32][16];
};

struct Fiber {
    Context ctx;
    char* stack = nullptr;
    ThreadState st;
    bool done = false;
    const char* waiting_at = nullptr;  // a collective's name while waiting in it
};

struct Launch {
    Context scheduler;
    std::vector<Fiber> fibers;
    unsigned current = 0;
    unsigned live = 0;     // fibers of the running block that have not returned
    unsigned arrived = 0;  // at the block barrier
    unsigned long long generation = 0;
    int and_result = 1;
    int and_last = 1;
    unsigned long long progress = 0;  // bumped by every arrival, release and return
    std::vector<Warp> warps;
    bool failed = false;
    std::string error;
    void (*body)(void*) = nullptr;
    void* ctx = nullptr;
    // The order fibers are resumed in each round (see cuemu_launch's `schedule`).
    int schedule = 0;
    uint64_t rng = 0;
    std::vector<unsigned> order;
};

Launch* current = nullptr;
std::mutex launch_lock;  // one launch at a time: `__shared__` arrays are process-wide

void fail(Launch& l, const std::string& why) {
    if (!l.failed) {
        l.failed = true;
        char where[96];
        std::snprintf(where, sizeof where, "block (%u, %u, %u), thread (%u, %u, %u): ", state.block_idx.x,
                      state.block_idx.y, state.block_idx.z, state.thread_idx.x, state.thread_idx.y,
                      state.thread_idx.z);
        l.error = where + why;
    }
}

// Back to the scheduler until `done()`; the scheduler resumes every waiting fiber in turn.
template <typename Done>
void wait_until(Launch& l, Done done, const char* what) {
    Fiber& f = l.fibers[l.current];
    while (!done()) {
        if (l.failed) throw Abandoned{};
        f.waiting_at = what;
        switch_context(f.ctx, l.scheduler);
        f.waiting_at = nullptr;
    }
    if (l.failed) throw Abandoned{};
}

int block_barrier(int predicate) {
    Launch& l = *current;
    if (l.failed) throw Abandoned{};
    const auto gen = l.generation;
    l.and_result &= predicate != 0;
    l.progress++;
    if (++l.arrived == l.live) {
        l.arrived = 0;
        l.and_last = l.and_result;
        l.and_result = 1;
        l.generation++;
        return l.and_last;
    }
    wait_until(l, [&] { return l.generation != gen; }, "__syncthreads");
    return l.and_last;
}

// A barrier over the lanes of `mask` in the caller's warp.
void warp_barrier(Launch& l, unsigned mask, const char* what) {
    Warp& w = l.warps[state.warp];
    if (!(mask >> state.lane & 1u)) {
        fail(l, std::string(what) + ": the calling lane is not in the mask");
        throw Abandoned{};
    }
    if (mask & w.exited) {
        fail(l, std::string(what) + ": the mask names a lane that has returned");
        throw Abandoned{};
    }
    const auto gen = w.generation;
    l.progress++;
    if (++w.arrived == (unsigned)__builtin_popcount(mask)) {
        w.arrived = 0;
        w.generation++;
        return;
    }
    wait_until(l, [&] { return w.generation != gen; }, what);
}

void fiber_exit(Launch& l) {
    l.warps[state.warp].exited |= 1u << state.lane;
    l.live--;
    l.progress++;
    // Threads that returned no longer count at __syncthreads (sm_70+).
    if (l.arrived > 0 && l.arrived == l.live) {
        l.arrived = 0;
        l.and_last = l.and_result;
        l.and_result = 1;
        l.generation++;
    }
}

void fiber_main() {
    Launch& l = *current;
    try {
        l.body(l.ctx);
        fiber_exit(l);
    } catch (const Abandoned&) {
    } catch (const std::exception& e) {
        fail(l, e.what());
    } catch (...) {
        fail(l, "an exception escaped the kernel");
    }
    Fiber& f = l.fibers[l.current];
    f.done = true;
    // Back to the scheduler for good: this context is never resumed.
    switch_context(f.ctx, l.scheduler);
    __builtin_unreachable();
}

// Runs one block to completion (or failure): resumes fibers round-robin; a full round in
// which nothing moved while fibers still wait is a deadlock.
void run_block(Launch& l, uint3 block) {
    const unsigned n = (unsigned)l.fibers.size();
    l.live = n;
    l.arrived = 0;
    l.and_result = 1;
    for (Warp& w : l.warps) {
        w.arrived = 0;
        w.exited = w.absent;
    }
    for (Fiber& f : l.fibers) {
        f.done = false;
        f.waiting_at = nullptr;
        f.st.block_idx = block;
        start_context(f.ctx, f.stack, kStack, fiber_main);
    }
    unsigned remaining = n;
    l.order.resize(n);
    for (unsigned i = 0; i < n; i++) l.order[i] = l.schedule == 1 ? n - 1 - i : i;
    while (remaining > 0) {
        const auto before = l.progress;
        bool any_waiting = false;
        if (l.schedule == 2) {
            // Fisher-Yates with xorshift64: a different interleaving every round.
            for (unsigned i = n - 1; i > 0; i--) {
                l.rng ^= l.rng << 13;
                l.rng ^= l.rng >> 7;
                l.rng ^= l.rng << 17;
                std::swap(l.order[i], l.order[l.rng % (i + 1)]);
            }
        }
        for (unsigned i : l.order) {
            Fiber& f = l.fibers[i];
            if (f.done) continue;
            l.current = i;
            state = f.st;
            switch_context(l.scheduler, f.ctx);
            if (f.done) {
                remaining--;
            } else {
                any_waiting = true;
            }
        }
        if (l.failed) {
            // Let every fiber see the failure and unwind off its stack.
            for (unsigned i = 0; i < n; i++) {
                Fiber& f = l.fibers[i];
                while (!f.done) {
                    l.current = i;
                    state = f.st;
                    switch_context(l.scheduler, f.ctx);
                }
            }
            return;
        }
        if (any_waiting && l.progress == before) {
            for (Fiber& f : l.fibers) {
                if (!f.done && f.waiting_at) {
                    state = f.st;
                    fail(l, std::string("deadlock: waits forever at ") + f.waiting_at);
                    break;
                }
            }
        }
    }
}
}  // namespace

void syncthreads() { block_barrier(1); }
int syncthreads_and(int predicate) { return block_barrier(predicate); }

void warp_exchange(unsigned mask, const uint32_t* mine, int words, uint32_t (*all)[16]) {
    Launch& l = *current;
    if (l.failed) throw Abandoned{};
    Warp& w = l.warps[state.warp];
    std::memcpy(w.slots[state.lane], mine, words * sizeof(uint32_t));
    warp_barrier(l, mask, "a warp collective");
    std::memcpy(all, w.slots, sizeof w.slots);
    // Nobody deposits again before every lane has read.
    warp_barrier(l, mask, "a warp collective");
}

unsigned ballot(unsigned mask, int predicate) {
    uint32_t word = predicate != 0;
    uint32_t all[32][16];
    warp_exchange(mask, &word, 1, all);
    unsigned out = 0;
    for (int lane = 0; lane < 32; lane++) {
        if ((mask >> lane & 1u) && all[lane][0]) out |= 1u << lane;
    }
    return out;
}

void syncwarp(unsigned mask) {
    Launch& l = *current;
    if (l.failed) throw Abandoned{};
    warp_barrier(l, mask, "__syncwarp");
}

void ldmatrix_x4(uint32_t (&r)[4], const void* row_addr, bool trans) {
    uint32_t mine[2];
    const uintptr_t addr = reinterpret_cast<uintptr_t>(row_addr);
    std::memcpy(mine, &addr, sizeof addr);
    uint32_t all[32][16];
    warp_exchange(0xffffffffu, mine, 2, all);
    const unsigned l = state.lane;
    for (int i = 0; i < 4; i++) {
        // Matrix i's rows come from lanes 8i .. 8i + 7.
        auto element = [&](unsigned row, unsigned col) {
            uintptr_t a;
            std::memcpy(&a, all[8 * i + row], sizeof a);
            uint16_t v;
            std::memcpy(&v, reinterpret_cast<const uint16_t*>(a) + col, 2);
            return (uint32_t)v;
        };
        if (!trans) {
            r[i] = element(l / 4, 2 * (l % 4)) | element(l / 4, 2 * (l % 4) + 1) << 16;
        } else {
            r[i] = element(2 * (l % 4), l / 4) | element(2 * (l % 4) + 1, l / 4) << 16;
        }
    }
}

void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    uint32_t mine[6] = {a[0], a[1], a[2], a[3], b0, b1};
    uint32_t all[32][16];
    warp_exchange(0xffffffffu, mine, 6, all);
    // PTX ISA fragment layouts for m16n8k16 with .bf16: group g = lane / 4, t = lane % 4.
    auto bf = [](uint32_t word, int half) { return bits_to_f32((half ? word >> 16 : word & 0xffffu) << 16); };
    auto a_at = [&](int row, int k) {
        const int g = row % 8, t = (k % 8) / 2;
        const int reg = (row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
        return bf(all[g * 4 + t][reg], k % 2);
    };
    auto b_at = [&](int k, int col) {
        const int t = (k % 8) / 2;
        return bf(all[col * 4 + t][4 + (k >= 8 ? 1 : 0)], k % 2);
    };
    const unsigned g = state.lane / 4, t = state.lane % 4;
    for (int i = 0; i < 4; i++) {
        const int row = g + (i >= 2 ? 8 : 0);
        const int col = 2 * t + (i % 2);
        float acc = d[i];
        for (int k = 0; k < 16; k++) acc += a_at(row, k) * b_at(k, col);
        d[i] = acc;
    }
}

// Runs `body(ctx)` as every thread of every block; 0 on success, else the failure is in `error`.
// `schedule` orders the fibers between waits: 0 in thread order, 1 in reverse, 2 shuffled every
// round from `seed`. A kernel whose threads share memory without a barrier between the write
// and the read gives different results under different orders (the GPU promises no order).
extern "C" int cuemu_launch(const unsigned grid[3], const unsigned block[3], void (*body)(void*), void* ctx,
                            int schedule, uint64_t seed, char* error, size_t error_len) {
    std::lock_guard<std::mutex> serial(launch_lock);
    const unsigned threads = block[0] * block[1] * block[2];
    if (threads == 0 || threads > 1024 || grid[0] == 0 || grid[1] == 0 || grid[2] == 0) {
        std::snprintf(error, error_len, "bad launch shape: grid (%u, %u, %u), block (%u, %u, %u)", grid[0],
                      grid[1], grid[2], block[0], block[1], block[2]);
        return 1;
    }
    if (schedule < 0 || schedule > 2) {
        std::snprintf(error, error_len, "unknown schedule %d", schedule);
        return 1;
    }
    Launch l;
    l.body = body;
    l.ctx = ctx;
    l.schedule = schedule;
    l.rng = seed | 1;  // xorshift's state must not be zero
    l.fibers.resize(threads);
    l.warps.resize((threads + 31) / 32);
    // A warp's lanes beyond the block never run; they count as returned.
    if (threads % 32) l.warps.back().absent = ~0u << (threads % 32);
    unsigned n = 0;
    for (unsigned z = 0; z < block[2]; z++) {
        for (unsigned y = 0; y < block[1]; y++) {
            for (unsigned x = 0; x < block[0]; x++, n++) {
                Fiber& f = l.fibers[n];
                f.stack = static_cast<char*>(std::malloc(kStack));
                f.st.thread_idx = uint3{x, y, z};
                f.st.lane = n % 32;
                f.st.warp = n / 32;
            }
        }
    }
    grid_dim = dim3{grid[0], grid[1], grid[2]};
    block_dim = dim3{block[0], block[1], block[2]};
    const ThreadState saved = state;
    current = &l;
    for (unsigned z = 0; z < grid[2] && !l.failed; z++) {
        for (unsigned y = 0; y < grid[1] && !l.failed; y++) {
            for (unsigned x = 0; x < grid[0] && !l.failed; x++) {
                run_block(l, uint3{x, y, z});
            }
        }
    }
    current = nullptr;
    state = saved;
    for (Fiber& f : l.fibers) std::free(f.stack);
    if (l.failed) {
        std::snprintf(error, error_len, "%s", l.error.c_str());
        return 1;
    }
    return 0;
}
}  // namespace cuemu

// ---- The kernel registry (registry.h) ----------------------------------------------------

namespace cuemu {
namespace {
std::map<std::string, Binder>& registry() {
    // Built by static initialisers of the kernel files: a function-local static is ready
    // whichever file registers first.
    static std::map<std::string, Binder> kernels;
    return kernels;
}
}  // namespace

void register_kernel(const char* name, Binder bind) { registry()[name] = bind; }

Binder find_kernel(const char* name) {
    const auto it = registry().find(name);
    return it == registry().end() ? nullptr : it->second;
}
}  // namespace cuemu
