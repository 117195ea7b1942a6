// gemv_<fmt>: y (T, rows) = x (T, cols) @ W^T (+ bias) for a few tokens (T <= GEMV_MAX_T): the
// decode-time linear layer, bound by reading W once. The weight is dequantized in registers,
// 32 elements at a time; nothing is written back.  Reference: numpy_ref.linear on the
// dequantized weight.
// One logical warp per output row, 8 warps per block: grid (ceil(rows / 8)), block 256.
// Lanes take the row's 32-element units round robin; x is read through the cache. A plain
// format's partial last unit (cols % 32 != 0) is read one element per lane.
#include "quant.cuh"

#define GEMV_MAX_T 8
#define GEMV_WARPS 8

template <int F>
ATLAS_DEV void gemv_body(const u8* __restrict__ W, const u8* __restrict__ S, float gs,
                         const float* __restrict__ x, const float* __restrict__ bias,
                         float* __restrict__ y, int T, int rows, int cols, long long row_bytes,
                         long long srow_bytes) {
    int r = blockIdx.x * GEMV_WARPS + warp_id();
    if (r >= rows) return;  // a whole warp leaves together: no block barrier below
    int lane = lane_id();
    const u8* row = W + r * row_bytes;
    const u8* srow = S + r * srow_bytes;
    float acc[GEMV_MAX_T];
#pragma unroll
    for (int t = 0; t < GEMV_MAX_T; t++) acc[t] = 0.0f;
    int units = cols / 32;
    for (int u = lane; u < units; u += ATLAS_WARP) {
        float v[32];
        deq32<F>(row, srow, gs, u, v);
#pragma unroll
        for (int t = 0; t < GEMV_MAX_T; t++) {
            if (t < T) {
                const float* xt = x + (long long)t * cols + 32 * u;
                float a = acc[t];
#pragma unroll
                for (int i = 0; i < 32; i++) a = fmaf(v[i], xt[i], a);
                acc[t] = a;
            }
        }
    }
    int c = 32 * units + lane;  // the partial unit: plain formats only
    if (c < cols) {
        float wc = deq1<F>(row, c);
#pragma unroll
        for (int t = 0; t < GEMV_MAX_T; t++)
            if (t < T) acc[t] = fmaf(wc, x[(long long)t * cols + c], acc[t]);
    }
#pragma unroll
    for (int t = 0; t < GEMV_MAX_T; t++) {
        if (t < T) {
            float s = warp_sum(acc[t]);
            if (lane == 0) y[(long long)t * rows + r] = bias ? s + bias[r] : s;
        }
    }
}

#define GEMV_ENTRY(name, F)                                                                     \
    extern "C" __global__ void __launch_bounds__(256)                                           \
        gemv_##name(const u8* __restrict__ W, const u8* __restrict__ S, float gs,               \
                    const float* __restrict__ x, const float* __restrict__ bias,                \
                    float* __restrict__ y, int T, int rows, int cols, long long row_bytes,      \
                    long long srow_bytes) {                                                     \
        gemv_body<F>(W, S, gs, x, bias, y, T, rows, cols, row_bytes, srow_bytes);               \
    }
ATLAS_FOR_EACH_FORMAT(GEMV_ENTRY)
