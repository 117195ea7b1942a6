// The fiber scheduler behind atlas_emu.h. Included once into each emulated module.
//
// A fiber starts on its own stack through makecontext/setcontext, once per launch, and runs its
// thread of every block; after that every switch (a thread waiting at a barrier or a shuffle,
// ending, being resumed) is a __builtin_setjmp / __builtin_longjmp pair: swapcontext makes a
// system call per switch, and a warp shuffle is two switches per lane, which made the
// emulator's decode GEMV mostly kernel time.
#include <ucontext.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

extern "C" {
atlas_dim3 threadIdx, blockIdx, blockDim, gridDim;
}

namespace atlas_emu {

enum State { RUNNABLE, AT_BLOCK_BARRIER, AT_WARP_BARRIER, DONE };

// A saved place to go on from: GCC's and clang's own setjmp buffer (frame, stack and resume
// addresses). The builtins save no signal mask and run no cleanup handlers, unlike _longjmp.
typedef void* Jump[5];

// The other half of a switch: __builtin_longjmp may not share a function with the
// __builtin_setjmp whose place it leaves.
__attribute__((noinline)) static void jump(Jump to) { __builtin_longjmp(to, 1); }

struct Fiber {
    ucontext_t ctx;  // the entry on its stack (used once)
    Jump resume;  // where it waits
    bool started = false;
    char* stack = nullptr;
    State state = RUNNABLE;
    atlas_dim3 tid;
};

// Fiber stacks are allocated once per module and reused by every launch: zero-filling fresh
// stacks for each of a launch's 256 threads used to dominate the emulator's run time.
static const size_t kStack = 128 * 1024;
static std::vector<char*> g_stacks;

static Jump g_sched;
static std::vector<Fiber>* g_fibers = nullptr;
static int g_current = -1;
static void (*g_tramp)(void**) = nullptr;
static void** g_args = nullptr;
static unsigned char g_exchange[1024][8];  // one slot per thread for warp shuffles
static int g_error = 0;

static void wait(State s) {
    Fiber& f = (*g_fibers)[g_current];
    f.state = s;
    if (__builtin_setjmp(f.resume) == 0) jump(g_sched);
}

// A fiber runs its thread in every block of the launch: resumed after DONE, it starts over.
static void fiber_main() {
    for (;;) {
        g_tramp(g_args);
        wait(DONE);
    }
}

// Run fiber i until it waits or ends.
static void resume(Fiber& f) {
    if (__builtin_setjmp(g_sched) != 0) return;
    if (f.started) jump(f.resume);
    f.started = true;
    setcontext(&f.ctx);
}

static int linear_tid(const atlas_dim3& t) {
    return (int)(t.x + blockDim.x * (t.y + blockDim.y * t.z));
}

// Release waiters whose barrier is complete; returns false on a barrier that cannot complete.
static bool release() {
    std::vector<Fiber>& fs = *g_fibers;
    int n = (int)fs.size();
    bool any_runnable = false, all_block = true, any_live = false;
    for (auto& f : fs) {
        if (f.state == DONE) continue;
        any_live = true;
        if (f.state == RUNNABLE) any_runnable = true;
        if (f.state != AT_BLOCK_BARRIER) all_block = false;
    }
    if (!any_live || any_runnable) return true;
    if (all_block) {
        for (auto& f : fs)
            if (f.state == AT_BLOCK_BARRIER) f.state = RUNNABLE;
        return true;
    }
    bool released = false;
    for (int w = 0; w < n; w += 32) {
        bool complete = true, waiting = false;
        for (int i = w; i < w + 32 && i < n; i++) {
            if (fs[i].state == DONE) continue;
            if (fs[i].state != AT_WARP_BARRIER) complete = false;
            else waiting = true;
        }
        if (complete && waiting) {
            for (int i = w; i < w + 32 && i < n; i++)
                if (fs[i].state == AT_WARP_BARRIER) fs[i].state = RUNNABLE;
            released = true;
        }
    }
    return released;
}

}  // namespace atlas_emu

extern "C" void atlas_emu_syncthreads() { atlas_emu::wait(atlas_emu::AT_BLOCK_BARRIER); }

extern "C" void atlas_emu_warp_exchange(const void* value, void* out, int size, int src_lane,
                                        int mode) {
    using namespace atlas_emu;
    int me = linear_tid(threadIdx);
    int lane = me & 31;
    int src = (me & ~31) | (mode == 0 ? (lane ^ src_lane) : (src_lane & 31));
    std::memcpy(g_exchange[me], value, size);
    wait(AT_WARP_BARRIER);
    std::memcpy(out, g_exchange[src], size);
    wait(AT_WARP_BARRIER);  // nobody overwrites a slot before everyone has read it
}

// Run a kernel: trampoline(args) in every thread of every block. Returns 0, or 1 on a
// barrier that could never complete (divergent __syncthreads or shuffle).
extern "C" __attribute__((visibility("default"))) int atlas_emu_launch(
    void (*tramp)(void**), unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
    unsigned bz, void** args) {
    using namespace atlas_emu;
    int n = (int)(bx * by * bz);
    if (n <= 0 || n > 1024) return 2;
    gridDim = {gx, gy, gz};
    blockDim = {bx, by, bz};
    g_tramp = tramp;
    g_args = args;
    std::vector<Fiber> fibers(n);
    while ((int)g_stacks.size() < n) g_stacks.push_back(new char[kStack]);
    for (int i = 0; i < n; i++) fibers[i].stack = g_stacks[i];
    g_fibers = &fibers;
    for (int i = 0; i < n; i++) {  // entered once per launch: getcontext is a system call
        Fiber& f = fibers[i];
        f.tid = {(unsigned)(i % bx), (unsigned)((i / bx) % by), (unsigned)(i / (bx * by))};
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = f.stack;
        // Stack tops 128 KB apart share their cache sets: the switches' spills would evict
        // each other. A different 64-byte line of a page for each fiber keeps them apart.
        f.ctx.uc_stack.ss_size = kStack - 64 * (i % 64);
        f.ctx.uc_link = nullptr;
        makecontext(&f.ctx, (void (*)())fiber_main, 0);
    }
    for (unsigned z = 0; z < gz; z++)
        for (unsigned y = 0; y < gy; y++)
            for (unsigned x = 0; x < gx; x++) {
                for (auto& f : fibers) f.state = RUNNABLE;
                blockIdx = {x, y, z};
                for (;;) {
                    bool progressed = false;
                    for (int i = 0; i < n; i++) {
                        if (fibers[i].state != RUNNABLE) continue;
                        g_current = i;
                        threadIdx = fibers[i].tid;
                        resume(fibers[i]);
                        progressed = true;
                    }
                    bool live = false;
                    for (auto& f : fibers) live |= f.state != DONE;
                    if (!live) break;
                    if (!release() && !progressed) {
                        std::fprintf(stderr, "atlas_emu: barrier can never complete in block "
                                             "(%u,%u,%u)\n", x, y, z);
                        g_fibers = nullptr;
                        return 1;
                    }
                }
            }
    g_fibers = nullptr;
    return 0;
}
