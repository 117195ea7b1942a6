// CPU emulation of the CUDA execution model, for tests only (compiled by g++ with -DATLAS_EMU).
//
// Every thread of a block is a fiber (ucontext) on one OS thread; blocks run one after another.
// __syncthreads and warp shuffles switch fibers until every live thread of the block (or warp)
// has arrived, and a barrier that can never complete (divergent __syncthreads) aborts with a
// message instead of hanging. __shared__ variables are function-level statics: one copy, which
// is right because only one block runs at a time. The runner lives in atlas_emu.cpp.
#pragma once
#include <math.h>

#include <cmath>
#include <algorithm>
#include <cstring>

struct atlas_dim3 {
    unsigned x, y, z;
};

extern "C" {
extern atlas_dim3 threadIdx, blockIdx, blockDim, gridDim;
void atlas_emu_syncthreads();
void atlas_emu_warp_exchange(const void* value, void* out, int size, int src_lane, int mode);
}

#define __global__ __attribute__((visibility("default")))
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)
#define __syncthreads() atlas_emu_syncthreads()

using std::max;
using std::min;

inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline void sincosf(float x, float* s, float* c) {
    *s = std::sin(x);
    *c = std::cos(x);
}
inline float __expf(float x) { return std::exp(x); }
inline float __int_as_float(int i) {
    float f;
    std::memcpy(&f, &i, 4);
    return f;
}
inline float __uint_as_float(unsigned u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline unsigned __float_as_uint(float f) {
    unsigned u;
    std::memcpy(&u, &f, 4);
    return u;
}

// Fibers never preempt each other, so a plain read-modify-write is atomic here.
inline int atomicAdd(int* p, int v) {
    int old = *p;
    *p += v;
    return old;
}

// mode 0: read lane (my_lane ^ src_lane); mode 1: read lane src_lane
template <typename T>
inline T atlas_emu_shfl_xor(T v, int o) {
    T out;
    static_assert(sizeof(T) <= 8, "shuffle of at most 8 bytes");
    atlas_emu_warp_exchange(&v, &out, (int)sizeof(T), o, 0);
    return out;
}
template <typename T>
inline T atlas_emu_shfl(T v, int src) {
    T out;
    static_assert(sizeof(T) <= 8, "shuffle of at most 8 bytes");
    atlas_emu_warp_exchange(&v, &out, (int)sizeof(T), src, 1);
    return out;
}
