// Gated DeltaNet (Qwen3.5 linear attention) pieces; the math is in docs/formats.md (Qwen3.5).
//
// causal_conv1d: depthwise causal conv over time, no bias, optional fused SiLU.
//   x (T, C), w (C, K) with w[:, K-1] on the current token, state (K-1, C) the inputs before x;
//   out (T, C); new_state (K-1, C) the last K-1 inputs (may alias state).
//   Reference: numpy_ref.causal_conv1d (then numpy_ref.silu when act == 1).
//   Grid (ceil(C / 256)), block 256: one thread per channel, K <= 8.
// gdn_recurrent: the gated delta rule token by token (decode, and prefill until a chunked
//   kernel lands). q, k (T, nk, dk) L2-normalised; v (T, nv, dv); g, beta (T, nv); state
//   (nv, dk, dv) f32 updated in place; out (T, nv, dv). Value head h uses key head
//   h / (nv / nk). Per token: S *= exp(g); d = (v - k.S) * beta; S += k (x) d; o = (q*scale).S.
//   Reference: numpy_ref.gated_delta_rule. Grid (nv), block 256: thread (part, j) holds rows
//   part*R..part*R+R-1 of column j of S in registers, np = min(256 / dv, dk) parts of
//   R = dk / np <= 64 rows (small heads leave threads idle).
#include "atlas_common.cuh"
#include "gdn.cuh"

#define CONV_KMAX 8
#define GDN_RMAX 64

extern "C" __global__ void __launch_bounds__(256)
    causal_conv1d(const float* __restrict__ x, const float* __restrict__ w,
                  const float* state, float* out, float* new_state, int T, int C, int K,
                  int act) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float hist[CONV_KMAX - 1];
    float wc[CONV_KMAX];
#pragma unroll
    for (int j = 0; j < CONV_KMAX; j++) wc[j] = j < K ? w[(long long)c * K + j] : 0.0f;
#pragma unroll
    for (int j = 0; j < CONV_KMAX - 1; j++) hist[j] = j < K - 1 ? state[(long long)j * C + c] : 0.0f;
    for (int t = 0; t < T; t++) {
        float xt = x[(long long)t * C + c];
        float acc = 0.0f;
#pragma unroll
        for (int j = 0; j < CONV_KMAX - 1; j++)
            if (j < K - 1) acc = fmaf(wc[j], hist[j], acc);
        acc = fmaf(wc[K - 1], xt, acc);
        out[(long long)t * C + c] = act ? siluf_(acc) : acc;
#pragma unroll
        for (int j = 0; j < CONV_KMAX - 2; j++)
            if (j < K - 2) hist[j] = hist[j + 1];
        if (K >= 2) {
#pragma unroll
            for (int j = 0; j < CONV_KMAX - 1; j++)
                if (j == K - 2) hist[j] = xt;
        }
    }
#pragma unroll
    for (int j = 0; j < CONV_KMAX - 1; j++)
        if (j < K - 1) new_state[(long long)j * C + c] = hist[j];
}

extern "C" __global__ void __launch_bounds__(256)
    gdn_recurrent(const float* __restrict__ q, const float* __restrict__ k,
                  const float* __restrict__ v, const float* __restrict__ g,
                  const float* __restrict__ beta, float* __restrict__ state,
                  float* __restrict__ out, int T, int nk, int nv, int dk, int dv, float scale) {
    __shared__ float qsh[256];
    __shared__ float ksh[256];
    __shared__ float vsh[256];
    __shared__ float red[256];
    int h = blockIdx.x, tid = threadIdx.x;
    int hk = h / (nv / nk);
    int np = min((int)blockDim.x / dv, dk);  // row parts
    int R = dk / np;           // rows per thread
    int j = tid % dv, part = tid / dv;
    bool active = part < np;
    float S[GDN_RMAX];
    float* st = state + (long long)h * dk * dv;
#pragma unroll
    for (int r = 0; r < GDN_RMAX; r++)
        S[r] = (active && r < R) ? st[(long long)(part * R + r) * dv + j] : 0.0f;
    for (int t = 0; t < T; t++) {
        __syncthreads();  // the previous token's shared data is consumed
        for (int i = tid; i < dk; i += blockDim.x) {
            qsh[i] = q[((long long)t * nk + hk) * dk + i] * scale;
            ksh[i] = k[((long long)t * nk + hk) * dk + i];
        }
        for (int i = tid; i < dv; i += blockDim.x) vsh[i] = v[((long long)t * nv + h) * dv + i];
        __syncthreads();
        float decay = expf(g[(long long)t * nv + h]);
        float b = beta[(long long)t * nv + h];
#pragma unroll
        for (int r = 0; r < GDN_RMAX; r++) S[r] *= decay;
        float op = gdn_delta_update(S, ksh, qsh, vsh, red, b, part, R, j, dv, np, tid, active);
        if (active) red[tid] = op;
        __syncthreads();
        if (active && part == 0) {
            float o = 0.0f;
            for (int p = 0; p < np; p++) o += red[p * dv + j];
            out[((long long)t * nv + h) * dv + j] = o;
        }
    }
#pragma unroll
    for (int r = 0; r < GDN_RMAX; r++)
        if (active && r < R) st[(long long)(part * R + r) * dv + j] = S[r];
}
