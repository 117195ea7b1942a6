// atlas_common.cuh: the one compatibility header every kernel includes.
//
// The same kernel source compiles under NVRTC and nvcc (CUDA), hiprtc and clang -x hip (HIP),
// and g++ for the CPU emulator used by tests (ATLAS_EMU). Kernels use only what this header
// defines beyond plain C++: thread/block indices, __syncthreads, __shared__ (static sizes only),
// float math functions, and the helpers below. No standard headers: NVRTC and hiprtc have none.
//
// Rules kept here (see kernels/README.md):
// - Warp-level code works on *logical warps of 32 lanes*. xor/broadcast shuffles with width 32
//   stay inside a 32-lane half on wave64 AMD parts, so the same code is right on wave32 (gfx11,
//   all NVIDIA) and wave64 (gfx9) hardware. Block sizes are multiples of 32.
// - bf16 and fp16 are plain 16-bit storage decoded with bit operations: no cuda_bf16.h /
//   hip_bf16.h (HIP 5 lacks __hip_bfloat16, NVRTC wheels ship no headers).
// - Vendor intrinsics and inline PTX only inside a guarded #if with a portable #else.
#pragma once

#if defined(ATLAS_EMU)
#include "emu/atlas_emu.h"
#elif defined(__HIPCC_RTC__) || defined(__HIP__) || defined(__HIPCC__)
#define ATLAS_HIP 1
#if !defined(__HIPCC_RTC__)
#include <hip/hip_runtime.h>  // hiprtc has these built in
#endif
// HIP clang contracts a*b+c into fma by default; dequantization must round like numpy, so
// contraction is off in this file and hot loops call fmaf explicitly.
#pragma clang fp contract(off)
#else
#define ATLAS_CUDA 1
#endif

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef int i32;

#define ATLAS_WARP 32

#define ATLAS_DEV static __device__ __forceinline__ __attribute__((unused))

// ---- float bits and exactly rounded arithmetic (never contracted into an fma) ----------------

ATLAS_DEV float atlas_inf() { return __int_as_float(0x7f800000); }

#if defined(ATLAS_CUDA)
ATLAS_DEV float mul_rn(float a, float b) { return __fmul_rn(a, b); }
ATLAS_DEV float add_rn(float a, float b) { return __fadd_rn(a, b); }
ATLAS_DEV float sub_rn(float a, float b) { return __fsub_rn(a, b); }
#else
ATLAS_DEV float mul_rn(float a, float b) { return a * b; }
ATLAS_DEV float add_rn(float a, float b) { return a + b; }
ATLAS_DEV float sub_rn(float a, float b) { return a - b; }
#endif

// x rotated right by n (0 <= n < 32), and the bits of a where M is set with those of b where it
// is not: one instruction each on NVIDIA (SHF.R.W; LOP3, which ptxas makes two of when it
// sees the mask used elsewhere as well).
#if defined(ATLAS_CUDA) && !defined(ATLAS_PORTABLE)
ATLAS_DEV u32 rotr32(u32 x, int n) { return __funnelshift_r(x, x, n); }
template <u32 M>
ATLAS_DEV u32 bitsel(u32 a, u32 b) {
    u32 d;
    asm("lop3.b32 %0, %1, %2, %3, 0xE2;" : "=r"(d) : "r"(a), "n"(M), "r"(b));
    return d;
}
#else
ATLAS_DEV u32 rotr32(u32 x, int n) { return (x >> n) | (x << ((32 - n) & 31)); }
template <u32 M>
ATLAS_DEV u32 bitsel(u32 a, u32 b) { return (a & M) | (b & ~M); }
#endif

// ---- 16-bit floats ------------------------------------------------------------------------

// bf16 is the top half of a float32.
ATLAS_DEV float bf16_to_f32(u16 h) { return __uint_as_float(((u32)h) << 16); }

// float32 -> bf16, round to nearest even; NaN stays a (quiet) NaN.
ATLAS_DEV u16 f32_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (u16)(u >> 16);
}

// IEEE half -> float32, exactly (subnormals, inf and NaN included).
ATLAS_DEV float f16_to_f32(u16 h) {
    u32 sign = ((u32)(h & 0x8000u)) << 16;
    u32 exp = (h >> 10) & 0x1fu;
    u32 man = h & 0x3ffu;
    if (exp == 0x1fu) return __uint_as_float(sign | 0x7f800000u | (man << 13));
    if (exp == 0) {
        // subnormal (or zero): man * 2^-24, exact in float32
        float v = (float)man * 5.9604644775390625e-08f;
        return sign ? -v : v;
    }
    return __uint_as_float(sign | ((exp + 112u) << 23) | (man << 13));
}

// float32 -> IEEE half, round to nearest even (subnormals included, overflow to infinity).
ATLAS_DEV u16 f32_to_f16(float f) {
#if defined(ATLAS_CUDA) && !defined(ATLAS_PORTABLE)
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#else
    u32 u = __float_as_uint(f), sign = (u >> 16) & 0x8000u;
    u &= 0x7fffffffu;
    if (u > 0x7f800000u) return (u16)(sign | 0x7e00u);   // NaN
    if (u >= 0x477ff000u) return (u16)(sign | 0x7c00u);  // >= 65520: infinity
    if (u >= 0x38800000u) {                              // normal: rebias, round 13 bits off
        u32 r = u - 0x38000000u;
        r += 0xfffu + ((r >> 13) & 1u);
        return (u16)(sign | (r >> 13));
    }
    // subnormal (or zero): the value in units of 2^-24, rounded to nearest even
    return (u16)(sign | (u32)rintf(__uint_as_float(u) * 16777216.0f));
#endif
}

// ---- FP8 E4M3 (float8_e4m3fn: bias 7, no infinities, S.1111.111 is NaN) ---------------------

ATLAS_DEV float e4m3_to_f32_portable(u8 b) {
    u32 sign = ((u32)(b & 0x80u)) << 24;
    u32 exp = (b >> 3) & 0xfu;
    u32 man = b & 0x7u;
    if (exp == 0xfu && man == 0x7u) return __uint_as_float(sign | 0x7fc00000u);
    if (exp == 0) {
        float v = (float)man * 0.001953125f;  // man/8 * 2^-6
        return sign ? -v : v;
    }
    return __uint_as_float(sign | ((exp + 120u) << 23) | (man << 20));
}

#if defined(ATLAS_CUDA) && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 890) && !defined(ATLAS_PORTABLE)
// Ada/Hopper/Blackwell convert e4m3 in hardware (to f16x2; f16 -> f32 is exact).
ATLAS_DEV float e4m3_to_f32(u8 b) {
    unsigned short in = (unsigned short)b;
    unsigned int h2;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(in));
    return f16_to_f32((u16)(h2 & 0xffffu));
}
#else
ATLAS_DEV float e4m3_to_f32(u8 b) { return e4m3_to_f32_portable(b); }
#endif

// float32 -> e4m3, round to nearest even, saturating to +-448 (the "satfinite" conversion that
// KV-cache writers use); NaN -> NaN.
ATLAS_DEV u8 f32_to_e4m3(float f) {
    u32 u = __float_as_uint(f);
    u8 sign = (u8)((u >> 24) & 0x80u);
    u32 a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (u8)(sign | 0x7fu);
    float x = __uint_as_float(a);
    if (x >= 464.0f) return (u8)(sign | 0x7eu);  // 448 is the largest; >= 464 rounds past it
    if (x < 0.015625f) {
        // subnormal range: multiples of 2^-9; round x * 512 to nearest even integer
        float q = x * 512.0f;
        u32 n = (u32)q;
        float frac = q - (float)n;
        if (frac > 0.5f || (frac == 0.5f && (n & 1u))) n += 1u;
        return (u8)(sign | n);  // n == 8 encodes 2^-6, the smallest normal: still correct
    }
    // normal: keep 3 mantissa bits of the float32, round to nearest even
    u32 e = (a >> 23) - 120u;  // e4m3 exponent field, 1..15
    u32 m = a & 0x7fffffu;
    u32 keep = m >> 20;
    u32 rest = m & 0xfffffu;
    if (rest > 0x80000u || (rest == 0x80000u && (keep & 1u))) keep += 1u;
    if (keep == 8u) { keep = 0u; e += 1u; }
    u32 code = (e << 3) | keep;
    if (code > 0x7eu) code = 0x7eu;
    return (u8)(sign | code);
}

// ---- E2M1 (NVFP4 element): bit 3 sign, bits 0-2 index into {0,.5,1,1.5,2,3,4,6} -------------

ATLAS_DEV float e2m1_to_f32(u32 code) {
    u32 i = code & 7u;
    // 0, .5, 1, 1.5 | 2, 3 | 4, 6
    float v = (i < 4u) ? 0.5f * (float)i : (i < 6u ? (float)(i - 2u) : (float)(2u * i - 8u));
    return (code & 8u) ? -v : v;
}

// ---- warp and block reductions over logical 32-lane warps --------------------------------

// T is float or int (the argmax reduction exchanges indices too).
template <typename T>
ATLAS_DEV T warp_xor(T v, int o) {
#if defined(ATLAS_CUDA)
    return __shfl_xor_sync(0xffffffffu, v, o);
#elif defined(ATLAS_HIP)
    return __shfl_xor(v, o, ATLAS_WARP);
#else
    return atlas_emu_shfl_xor(v, o);
#endif
}

// The value `v` of lane `src` (0..31) of this logical warp.
ATLAS_DEV float warp_bcast(float v, int src) {
#if defined(ATLAS_CUDA)
    return __shfl_sync(0xffffffffu, v, src);
#elif defined(ATLAS_HIP)
    return __shfl(v, src, ATLAS_WARP);
#else
    return atlas_emu_shfl(v, src);
#endif
}

ATLAS_DEV float warp_sum(float v) {
#pragma unroll
    for (int o = ATLAS_WARP / 2; o > 0; o >>= 1) v += warp_xor(v, o);
    return v;
}

ATLAS_DEV float warp_max(float v) {
#pragma unroll
    for (int o = ATLAS_WARP / 2; o > 0; o >>= 1) v = fmaxf(v, warp_xor(v, o));
    return v;
}

ATLAS_DEV int lane_id() { return (int)(threadIdx.x & (ATLAS_WARP - 1)); }
ATLAS_DEV int warp_id() { return (int)(threadIdx.x / ATLAS_WARP); }

// Sum of `v` over the block (blockDim.x a multiple of 32, at most 1024); every thread gets it.
// `red` is caller-provided shared scratch of at least 32 floats.
ATLAS_DEV float block_sum(float v, float* red) {
    int nw = (int)(blockDim.x / ATLAS_WARP);
    v = warp_sum(v);
    __syncthreads();  // red may still be read by a previous call
    if (lane_id() == 0) red[warp_id()] = v;
    __syncthreads();
    float t = lane_id() < nw ? red[lane_id()] : 0.0f;
    return warp_sum(t);
}

ATLAS_DEV float block_max(float v, float* red) {
    int nw = (int)(blockDim.x / ATLAS_WARP);
    v = warp_max(v);
    __syncthreads();
    if (lane_id() == 0) red[warp_id()] = v;
    __syncthreads();
    float t = lane_id() < nw ? red[lane_id()] : -atlas_inf();
    return warp_max(t);
}

ATLAS_DEV float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }
ATLAS_DEV float siluf_(float x) { return x / (1.0f + expf(-x)); }
// log(1 + exp(x)) without overflow, as numpy's logaddexp(0, x)
ATLAS_DEV float softplusf_(float x) { return fmaxf(x, 0.0f) + log1pf(expf(-fabsf(x))); }
