// gemv.cuh: what the GEMV kernels share (gemv.cu, the op path; decode.cu, the fused decode
// step): the 16-byte weight loads and their decode, x staged in shared memory, the dot.
#pragma once
#include "quant.cuh"

#define GEMV_MAX_T 8
#define GEMV_WARPS 8
#define GEMV_UNIT_F4 9  // float4 slots per staged unit: 8 of x + 1 of padding

// Whether format F has a 16-byte path here, and whether this weight can take it.
ATLAS_DEV bool gemv_has_vec(int f) {
    return f == FMT_NVFP4 || f == FMT_BF16 || f == FMT_F16 || f == FMT_F32;
}
ATLAS_DEV bool gemv_aligned(const u8* W, const u8* S, long long row_bytes, long long srow_bytes,
                            int f) {
    bool ok = (((unsigned long long)W | (unsigned long long)row_bytes) & 15ull) == 0;
    if (f == FMT_NVFP4) ok = ok && (((unsigned long long)S | (unsigned long long)srow_bytes) & 1ull) == 0;
    return ok;
}

// The unit's 32 weights, in the form the multiply wants them: v (float32, NVFP4 times 2^-14)
// and, for NVFP4, the two block scales times 2^14.
template <int F, bool VEC>
ATLAS_DEV void gemv_load(const u8* __restrict__ row, const u8* __restrict__ srow, float gs16,
                         float gs, int u, float* v, float* s) {
    if (VEC && F == FMT_NVFP4) {
        atlas_u4 q = ((const atlas_u4*)row)[u];  // 32 codes: one 16-byte load
        u32 sc = ((const u16*)srow)[u];          // the unit's two E4M3 block scales
        e2m1x8_scaled(q.x, v);
        e2m1x8_scaled(q.y, v + 8);
        e2m1x8_scaled(q.z, v + 16);
        e2m1x8_scaled(q.w, v + 24);
        e4m3x2_to_f32(sc, &s[0], &s[1]);
        s[0] = mul_rn(s[0], gs16);
        s[1] = mul_rn(s[1], gs16);
    } else if (VEC && (F == FMT_BF16 || F == FMT_F16)) {
        const atlas_u4* p = (const atlas_u4*)row + 4 * u;  // 64 bytes: four 16-byte loads
#pragma unroll
        for (int c = 0; c < 4; c++) {
            atlas_u4 q = p[c];
            u32 wd[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
            for (int k = 0; k < 4; k++) {
                if (F == FMT_BF16) {
                    v[8 * c + 2 * k] = __uint_as_float(wd[k] << 16);
                    v[8 * c + 2 * k + 1] = __uint_as_float(wd[k] & 0xffff0000u);
                } else {
                    h2_to_f32(wd[k], &v[8 * c + 2 * k], &v[8 * c + 2 * k + 1]);
                }
            }
        }
    } else if (VEC && F == FMT_F32) {
        const atlas_f4* p = (const atlas_f4*)row + 8 * u;  // 128 bytes: eight 16-byte loads
#pragma unroll
        for (int c = 0; c < 8; c++) {
            atlas_f4 q = p[c];
            v[4 * c] = q.x;
            v[4 * c + 1] = q.y;
            v[4 * c + 2] = q.z;
            v[4 * c + 3] = q.w;
        }
    } else if (F == FMT_F16) {  // a misaligned row: 2-byte loads, the same exact decode
        const u16* p = (const u16*)row + 32 * u;
#pragma unroll
        for (int i = 0; i < 32; i += 2) h2_to_f32(p[i] | ((u32)p[i + 1] << 16), &v[i], &v[i + 1]);
    } else {
        deq32<F>(row, srow, gs, u, v);
    }
}

// x[t][32 * unit0 .. + 32 * 32) -> xs for t < T: each of the 256 threads copies one float4 of
// each token's tile (the warp reads 512 contiguous bytes); units past the row's end are left.
template <int TT>
ATLAS_DEV void gemv_stage_x(const float* __restrict__ x, atlas_f4* xs, int T, int cols, int unit0,
                            bool x_aligned) {
    int uu = (int)(threadIdx.x >> 3), c = (int)(threadIdx.x & 7);
    if (unit0 + uu >= cols / 32) return;
    const float* src = x + 32 * (unit0 + uu) + 4 * c;
    atlas_f4* dst = xs + uu * GEMV_UNIT_F4 + c;
#pragma unroll
    for (int t = 0; t < TT; t++) {
        if (TT == 1 || t < T) {
            const float* p = src + (long long)t * cols;
            atlas_f4 q;
            if (x_aligned) {
                q = *(const atlas_f4*)p;
            } else {
                q.x = p[0];
                q.y = p[1];
                q.z = p[2];
                q.w = p[3];
            }
            dst[t * 32 * GEMV_UNIT_F4] = q;
        }
    }
}

// sum_i v[i] * x[i] over elements [lo, lo + 16) of a staged unit, in two chains.
ATLAS_DEV float gemv_dot16(const float* v, const atlas_f4* xu, int lo) {
    float a = 0.0f, b = 0.0f;
#pragma unroll
    for (int c = 0; c < 4; c += 2) {
        atlas_f4 p = xu[lo / 4 + c], q = xu[lo / 4 + c + 1];
        const float* e = v + lo + 4 * c;
        a = fmaf(e[0], p.x, a);
        b = fmaf(e[4], q.x, b);
        a = fmaf(e[1], p.y, a);
        b = fmaf(e[5], q.y, b);
        a = fmaf(e[2], p.z, a);
        b = fmaf(e[6], q.z, b);
        a = fmaf(e[3], p.w, a);
        b = fmaf(e[7], q.w, b);
    }
    return a + b;
}

