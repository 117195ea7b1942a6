// gemm_<fmt>: y (T, rows) = x (T, cols) @ W^T (+ bias) for many tokens (prefill). Tiled in
// shared memory: a block computes 64 tokens x 64 rows, stepping over cols 32 at a time; the
// weight tile is dequantized into shared memory (float32) and each thread accumulates a 4 x 4
// register tile with fmaf (a plain format's partial last unit is padded with zeros).  Reference: numpy_ref.linear on the dequantized weight.
// Grid (ceil(rows / 64), ceil(T / 64)), block 256.
#include "quant.cuh"

#define GM_BM 64  // tokens per tile
#define GM_BN 64  // weight rows per tile
#define GM_BK 32  // columns per step (one unit)

template <int F>
ATLAS_DEV void gemm_body(const u8* __restrict__ W, const u8* __restrict__ S, float gs,
                         const float* __restrict__ x, const float* __restrict__ bias,
                         float* __restrict__ y, int T, int rows, int cols, long long row_bytes,
                         long long srow_bytes) {
    __shared__ float xs[GM_BK][GM_BM + 4];  // transposed: xs[k][token]
    __shared__ float ws[GM_BK][GM_BN + 4];  // transposed: ws[k][row]
    int tid = threadIdx.x;
    int n0 = blockIdx.x * GM_BN, m0 = blockIdx.y * GM_BM;
    int tm = tid / 16, tn = tid % 16;  // this thread's 4x4 tile: tokens 4tm.., rows 4tn..
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) acc[i][j] = 0.0f;
    // only plain formats have a partial last unit; block formats keep the unguarded loads
    const bool plain = F == FMT_F32 || F == FMT_F16 || F == FMT_BF16;
    int units = plain ? units_of(cols) : cols / 32;
    for (int u = 0; u < units; u++) {
        // x tile: 64 tokens x 32 columns, 8 elements per thread, coalesced along columns
#pragma unroll
        for (int e = 0; e < (GM_BM * GM_BK) / 256; e++) {
            int idx = tid + 256 * e;
            int m = idx / GM_BK, k = idx % GM_BK;
            int t = m0 + m;
            int c = 32 * u + k;
            xs[k][m] = t < T && (!plain || c < cols) ? x[(long long)t * cols + c] : 0.0f;
        }
        // weight tile: 64 rows, one thread dequantizes one row's unit
        if (tid < GM_BN) {
            int r = n0 + tid;
            float v[32];
            if (r < rows) {
                deq_unit<F>(W + r * row_bytes, S + r * srow_bytes, gs, u, cols, v);
            } else {
#pragma unroll
                for (int k = 0; k < 32; k++) v[k] = 0.0f;
            }
#pragma unroll
            for (int k = 0; k < 32; k++) ws[k][tid] = v[k];
        }
        __syncthreads();
#pragma unroll 8
        for (int k = 0; k < GM_BK; k++) {
            float a[4], b[4];
#pragma unroll
            for (int i = 0; i < 4; i++) a[i] = xs[k][4 * tm + i];
#pragma unroll
            for (int j = 0; j < 4; j++) b[j] = ws[k][4 * tn + j];
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
        int t = m0 + 4 * tm + i;
        if (t >= T) continue;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int r = n0 + 4 * tn + j;
            if (r < rows) y[(long long)t * rows + r] = bias ? acc[i][j] + bias[r] : acc[i][j];
        }
    }
}

#define GEMM_ENTRY(name, F)                                                                     \
    extern "C" __global__ void __launch_bounds__(256)                                           \
        gemm_##name(const u8* __restrict__ W, const u8* __restrict__ S, float gs,               \
                    const float* __restrict__ x, const float* __restrict__ bias,                \
                    float* __restrict__ y, int T, int rows, int cols, long long row_bytes,      \
                    long long srow_bytes) {                                                     \
        gemm_body<F>(W, S, gs, x, bias, y, T, rows, cols, row_bytes, srow_bytes);               \
    }
ATLAS_FOR_EACH_FORMAT(GEMM_ENTRY)
