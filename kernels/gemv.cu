// gemv_<fmt>: y (T, rows) = x (T, cols) @ W^T (+ bias) for a few tokens (T <= GEMV_MAX_T): the
// decode-time linear layer, bound by reading W once. The weight is dequantized in registers,
// 32 elements (a unit) at a time; nothing is written back.  Reference: numpy_ref.linear on
// the dequantized weight (products within float32 rounding; the summation order differs).
// One logical warp per output row, 8 warps per block: grid (ceil(rows / 8)), block 256.
//
// The row is swept in tiles of 32 units, one unit per lane, so a warp streams contiguous
// bytes. Per tile the block first issues its weight loads, then stages x for the tile in
// shared memory (read from global memory once per block, not once per row, with 16-byte
// loads), then every warp multiplies its row against it. A unit of x sits 36 floats apart in
// shared memory: the 16-byte reads of 8 lanes at a time hit distinct banks. A plain format's
// partial last unit (cols % 32 != 0, small models only) is read one element per lane.
// NVFP4, bf16, f16 and f32 rows that are 16-byte aligned (the allocators align buffers, and
// cols % 32 == 0 makes every row a multiple of 16 bytes) are read with 16-byte loads and
// decoded without branches; NVFP4 multiplies by its block scale once per 16 elements. Other
// formats, and misaligned rows, go through deq32 (quant.cuh).
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

// TT: 1 (the decode step, T == 1 known at compile time) or GEMV_MAX_T (T read at run time).
// The deq32 path has only the second: one body per format keeps its registers unspilled.
template <int F, int TT, bool VEC>
ATLAS_DEV void gemv_body(const u8* __restrict__ W, const u8* __restrict__ S, float gs,
                         const float* __restrict__ x, const float* __restrict__ bias,
                         float* __restrict__ y, int T, int rows, int cols, long long row_bytes,
                         long long srow_bytes, atlas_f4* xs) {
    int r = blockIdx.x * GEMV_WARPS + warp_id();
    bool live = r < rows;  // a warp past the last row still stages x and meets the barriers
    int lane = lane_id();
    const u8* row = W + (long long)(live ? r : 0) * row_bytes;
    const u8* srow = S + (long long)(live ? r : 0) * srow_bytes;
    bool x_aligned = ((unsigned long long)x & 15ull) == 0;
    float gs16 = mul_rn(gs, 16384.0f);  // the 2^14 that e2m1x8_scaled leaves out
    float acc[TT];
#pragma unroll
    for (int t = 0; t < TT; t++) acc[t] = 0.0f;
    int units = cols / 32;
    for (int unit0 = 0; unit0 < units; unit0 += ATLAS_WARP) {
        int u = unit0 + lane;
        bool have = live && u < units;
        float v[32], s[2] = {1.0f, 1.0f};
        if (have) gemv_load<F, VEC>(row, srow, gs16, gs, u, v, s);  // in flight while x stages
        __syncthreads();  // the previous tile's x has been read
        gemv_stage_x<TT>(x, xs, T, cols, unit0, x_aligned);
        __syncthreads();
        if (!have) continue;
#pragma unroll
        for (int t = 0; t < TT; t++) {
            if (TT == 1 || t < T) {
                const atlas_f4* xu = xs + (t * 32 + lane) * GEMV_UNIT_F4;
                if (VEC && F == FMT_NVFP4) {
                    acc[t] = fmaf(gemv_dot16(v, xu, 0), s[0], acc[t]);
                    acc[t] = fmaf(gemv_dot16(v, xu, 16), s[1], acc[t]);
                } else {
                    acc[t] += gemv_dot16(v, xu, 0) + gemv_dot16(v, xu, 16);
                }
            }
        }
    }
    int c = 32 * units + lane;  // a plain format's partial last unit (cols % 32 != 0)
    if (live && c < cols) {
        float wc = deq1<F>(row, c);
#pragma unroll
        for (int t = 0; t < TT; t++)
            if (TT == 1 || t < T) acc[t] = fmaf(wc, x[(long long)t * cols + c], acc[t]);
    }
    if (!live) return;
#pragma unroll
    for (int t = 0; t < TT; t++) {
        if (TT == 1 || t < T) {
            float sum = warp_sum(acc[t]);
            if (lane == 0) y[(long long)t * rows + r] = bias ? sum + bias[r] : sum;
        }
    }
}

#define GEMV_ENTRY(name, F)                                                                     \
    extern "C" __global__ void __launch_bounds__(256)                                           \
        gemv_##name(const u8* __restrict__ W, const u8* __restrict__ S, float gs,               \
                    const float* __restrict__ x, const float* __restrict__ bias,                \
                    float* __restrict__ y, int T, int rows, int cols, long long row_bytes,      \
                    long long srow_bytes) {                                                     \
        __shared__ atlas_f4 xs[GEMV_MAX_T * 32 * GEMV_UNIT_F4];                                 \
        bool vec = gemv_has_vec(F) && gemv_aligned(W, S, row_bytes, srow_bytes, F);             \
        if (vec && T == 1)                                                                      \
            gemv_body<F, 1, true>(W, S, gs, x, bias, y, T, rows, cols, row_bytes, srow_bytes,   \
                                  xs);                                                          \
        else if (vec)                                                                           \
            gemv_body<F, GEMV_MAX_T, true>(W, S, gs, x, bias, y, T, rows, cols, row_bytes,      \
                                           srow_bytes, xs);                                     \
        else                                                                                    \
            gemv_body<F, GEMV_MAX_T, false>(W, S, gs, x, bias, y, T, rows, cols, row_bytes,     \
                                            srow_bytes, xs);                                    \
    }
ATLAS_FOR_EACH_FORMAT(GEMV_ENTRY)
