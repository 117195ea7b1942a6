// Gated DeltaNet (Qwen3.5 linear attention) pieces; the math is in docs/formats.md (Qwen3.5).
//
// causal_conv1d: depthwise causal conv over time, no bias, optional fused SiLU.
//   x (T, C), w (C, K) with w[:, K-1] on the current token, state (K-1, C) the inputs before x;
//   out (T, C); new_state (K-1, C) the last K-1 inputs (may alias state).
//   Reference: numpy_ref.causal_conv1d (then numpy_ref.silu when act == 1).
//   Grid (ceil(C / 256)), block 256: one thread per channel, K <= 8.
// gdn_recurrent: the gated delta rule token by token (short runs; the chunked kernels below
//   take prefills from native_gdn.CHUNKED_MIN_T tokens). q, k (T, nk, dk) L2-normalised;
//   v (T, nv, dv); g, beta (T, nv); state (nv, dk, dv) f32 updated in place; out (T, nv, dv).
//   Value head h uses key head h / (nv / nk). Per token: S *= exp(g); d = (v - k.S) * beta;
//   S += k (x) d; o = (q*scale).S. Reference: numpy_ref.gated_delta_rule. Grid (nv), block
//   256: thread (part, j) holds rows part*R..part*R+R-1 of column j of S in registers,
//   np = min(256 / dv, dk) parts of R = dk / np <= 64 rows (small heads leave threads idle).
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

// ---- chunked prefill (the UT / WY form of numpy_ref.gated_delta_rule_chunked) ---------------
// Two launches per run of up to a few thousand tokens, 64-token chunks (the last one padded
// with zero q, k, v, beta and g, which contributes nothing):
// gdn_chunk_prep, grid (nchunks, nv), block 256, every chunk in parallel: the cumulative
//   log-decay cum; A = strict_lower(beta_i k_i.k_j e^(cum_i - cum_j)); T = (I + A)^-1 by forward
//   substitution; the WY factors U = T (v beta), W = T (k beta e^cum); the intra-chunk
//   attention P = lower((q scale).k_j e^(cum_i - cum_j)). Scratch per (head, chunk): W (64,
//   dk), U (64, dv), P (64, 64), cum (64). dk <= 128.
// gdn_chunk_scan, grid (nv, ceil(dv / 32)), block 256, chunks in order: a block holds a
//   32-column slab of its head's state S (dk, 32) in shared memory (the delta rule never mixes
//   columns) and per chunk computes v_new = U - W S, out = (q scale e^cum) S + P v_new,
//   S = e^last S + (k e^(last - cum))^T v_new; S written back in place at the end.
#define GDN_C 64      // tokens per chunk
#define GDN_CDK 128   // largest key head dim of the chunked kernels
#define GDN_CB 32     // state columns per scan block
#define GDN_TK 32     // inner-dimension tile

extern "C" __global__ void __launch_bounds__(256)
    gdn_chunk_prep(const float* __restrict__ q, const float* __restrict__ k,
                   const float* __restrict__ v, const float* __restrict__ g,
                   const float* __restrict__ beta, float* __restrict__ wbuf,
                   float* __restrict__ ubuf, float* __restrict__ pbuf, float* __restrict__ cbuf,
                   int T, int nk, int nv, int dk, int dv, float scale) {
    __shared__ float cs[GDN_C];
    __shared__ float bs[GDN_C];
    __shared__ float ecs[GDN_C];  // e^cum
    __shared__ float ash[GDN_C][GDN_C + 1];
    __shared__ float big[2 * GDN_C * (GDN_TK + 1)];  // Gram tiles of k and q, then T
    float(*ksh)[GDN_TK + 1] = (float(*)[GDN_TK + 1])big;
    float(*qsh)[GDN_TK + 1] = (float(*)[GDN_TK + 1])(big + GDN_C * (GDN_TK + 1));
    float(*tsh)[GDN_C + 1] = (float(*)[GDN_C + 1])big;
    int c = blockIdx.x, h = blockIdx.y, tid = threadIdx.x, nch = gridDim.x;
    int hk = h / (nv / nk), c0 = c * GDN_C, n = min(GDN_C, T - c0);
    long long blk = (long long)h * nch + c;  // (head, chunk) index into the scratch
    if (tid < GDN_C) {
        bs[tid] = tid < n ? beta[(long long)(c0 + tid) * nv + h] : 0.0f;
        cs[tid] = tid < n ? g[(long long)(c0 + tid) * nv + h] : 0.0f;
    }
    __syncthreads();
    if (tid == 0)  // sequential, as numpy's cumsum
        for (int t = 1; t < GDN_C; t++) cs[t] += cs[t - 1];
    __syncthreads();
    if (tid < GDN_C) ecs[tid] = expf(cs[tid]);  // read after the Gram phase's barriers
    // Gram matrices k k^T and q k^T: thread (ty, tx) owns rows ty + 16a, columns tx + 16b
    int ty = tid / 16, tx = tid % 16;
    float kk[4][4], qk[4][4];
#pragma unroll
    for (int a = 0; a < 4; a++)
#pragma unroll
        for (int b = 0; b < 4; b++) kk[a][b] = qk[a][b] = 0.0f;
    for (int r0 = 0; r0 < dk; r0 += GDN_TK) {
        __syncthreads();  // the previous tile is consumed
        for (int e = tid; e < GDN_C * GDN_TK; e += blockDim.x) {
            int t = e / GDN_TK, r = e % GDN_TK;
            bool in = t < n && r0 + r < dk;
            long long at = ((long long)(c0 + t) * nk + hk) * dk + r0 + r;
            ksh[t][r] = in ? k[at] : 0.0f;
            qsh[t][r] = in ? q[at] * scale : 0.0f;
        }
        __syncthreads();
#pragma unroll 4
        for (int r = 0; r < GDN_TK; r++) {
            float kj[4];
#pragma unroll
            for (int b = 0; b < 4; b++) kj[b] = ksh[tx + 16 * b][r];
#pragma unroll
            for (int a = 0; a < 4; a++) {
                float ki = ksh[ty + 16 * a][r], qi = qsh[ty + 16 * a][r];
#pragma unroll
                for (int b = 0; b < 4; b++) {
                    kk[a][b] = fmaf(ki, kj[b], kk[a][b]);
                    qk[a][b] = fmaf(qi, kj[b], qk[a][b]);
                }
            }
        }
    }
    float* pout = pbuf + blk * GDN_C * GDN_C;
#pragma unroll
    for (int a = 0; a < 4; a++) {
        int i = ty + 16 * a;
#pragma unroll
        for (int b = 0; b < 4; b++) {
            int j = tx + 16 * b;
            float pair = j <= i ? expf(cs[i] - cs[j]) : 0.0f;
            ash[i][j] = j < i ? bs[i] * kk[a][b] * pair : 0.0f;
            pout[i * GDN_C + j] = qk[a][b] * pair;
        }
    }
    __syncthreads();  // A complete; the Gram tiles are dead, big becomes T
    // T = (I + A)^-1, row by row: T[i][col] = [i == col] - sum_{col <= j < i} A[i][j] T[j][col];
    // four adjacent lanes share a column and split the sum
    int col = tid / 4, quarter = tid % 4;
    for (int i = 0; i < GDN_C; i++) {
        float acc = 0.0f;
        for (int j = col + quarter; j < i; j += 4) acc = fmaf(ash[i][j], tsh[j][col], acc);
        acc += warp_xor(acc, 1);
        acc += warp_xor(acc, 2);
        if (quarter == 0) tsh[i][col] = col < i ? -acc : (col == i ? 1.0f : 0.0f);
        __syncthreads();
    }
    // U = T (v beta), W = T (k beta e^cum): 64 right-hand columns at a time staged in ash (A
    // is dead), the thread's 4 x 4 outputs as in the Gram phase; columns x < dv are U's
    float(*rsh)[GDN_C + 1] = ash;
    for (int x0 = 0; x0 < dv + dk; x0 += GDN_C) {
        __syncthreads();  // T complete / the previous tile is consumed
        for (int e = tid; e < GDN_C * GDN_C; e += blockDim.x) {
            int t = e / GDN_C, x = x0 + e % GDN_C;
            float val = 0.0f;
            if (t < n && x < dv)
                val = v[((long long)(c0 + t) * nv + h) * dv + x] * bs[t];
            else if (t < n && x < dv + dk)
                val = k[((long long)(c0 + t) * nk + hk) * dk + x - dv] * bs[t] * ecs[t];
            rsh[t][e % GDN_C] = val;
        }
        __syncthreads();
        float acc[4][4];
#pragma unroll
        for (int a = 0; a < 4; a++)
#pragma unroll
            for (int b = 0; b < 4; b++) acc[a][b] = 0.0f;
#pragma unroll 4
        for (int t = 0; t < GDN_C; t++) {
            float rt[4];
#pragma unroll
            for (int b = 0; b < 4; b++) rt[b] = rsh[t][tx + 16 * b];
#pragma unroll
            for (int a = 0; a < 4; a++) {
                float ti = tsh[ty + 16 * a][t];
#pragma unroll
                for (int b = 0; b < 4; b++) acc[a][b] = fmaf(ti, rt[b], acc[a][b]);
            }
        }
#pragma unroll
        for (int b = 0; b < 4; b++) {
            int x = x0 + tx + 16 * b;
#pragma unroll
            for (int a = 0; a < 4; a++) {
                int i = ty + 16 * a;
                if (x < dv)
                    ubuf[(blk * GDN_C + i) * dv + x] = acc[a][b];
                else if (x < dv + dk)
                    wbuf[(blk * GDN_C + i) * dk + x - dv] = acc[a][b];
            }
        }
    }
    if (tid < GDN_C) cbuf[blk * GDN_C + tid] = cs[tid];
}

// acc[a] (token row tg + 8a, this thread's column j) += sum_r x[tg + 8a][r] * y[r][j]
ATLAS_DEV void gdn_tile_mac(float (&acc)[8], const float (*x)[GDN_TK], const float* y, int ystride,
                            int tg, int j) {
#pragma unroll 8
    for (int r = 0; r < GDN_TK; r++) {
        float yr = y[r * ystride + j];
#pragma unroll
        for (int a = 0; a < 8; a++) acc[a] = fmaf(x[tg + 8 * a][r], yr, acc[a]);
    }
}

extern "C" __global__ void __launch_bounds__(256)
    gdn_chunk_scan(const float* __restrict__ q, const float* __restrict__ k,
                   const float* __restrict__ wbuf, const float* __restrict__ ubuf,
                   const float* __restrict__ pbuf, const float* __restrict__ cbuf,
                   float* __restrict__ state, float* __restrict__ out, int T, int nk, int nv,
                   int dk, int dv, float scale) {
    __shared__ float ssh[GDN_CDK][GDN_CB];  // the state slab S[:, j0 : j0 + 32]
    __shared__ float vn[GDN_C][GDN_CB];     // v_new of the chunk
    __shared__ float xa[GDN_C][GDN_TK];     // staged tiles: W, then k e^(last - cum), P
    __shared__ float xb[GDN_C][GDN_TK];     // staged tiles: q scale e^cum
    __shared__ float cs[GDN_C];
    int h = blockIdx.x, j0 = blockIdx.y * GDN_CB, tid = threadIdx.x;
    int hk = h / (nv / nk), nch = (T + GDN_C - 1) / GDN_C;
    int j = tid % GDN_CB, tg = tid / GDN_CB;  // column; token (or state row) group of 8
    bool colok = j0 + j < dv;
    int dkp = (dk + GDN_TK - 1) / GDN_TK * GDN_TK;  // rows dk..dkp-1 of ssh stay zero
    float* st = state + (long long)h * dk * dv;
    for (int r = tg; r < dkp; r += 8)
        ssh[r][j] = (r < dk && colok) ? st[(long long)r * dv + j0 + j] : 0.0f;
    for (int c = 0; c < nch; c++) {
        int c0 = c * GDN_C, n = min(GDN_C, T - c0);
        long long blk = (long long)h * nch + c;
        const float* wc = wbuf + blk * GDN_C * dk;
        __syncthreads();  // the previous chunk's vn and cs are consumed
        if (tid < GDN_C) cs[tid] = cbuf[blk * GDN_C + tid];
        float va[8], oa[8];
#pragma unroll
        for (int a = 0; a < 8; a++) va[a] = oa[a] = 0.0f;
        for (int r0 = 0; r0 < dkp; r0 += GDN_TK) {  // W S and (q scale e^cum) S together
            __syncthreads();
            for (int e = tid; e < GDN_C * GDN_TK; e += blockDim.x) {
                int t = e / GDN_TK, r = e % GDN_TK;
                bool in = t < n && r0 + r < dk;
                float qv = in ? q[((long long)(c0 + t) * nk + hk) * dk + r0 + r] * scale : 0.0f;
                xa[t][r] = r0 + r < dk ? wc[t * dk + r0 + r] : 0.0f;
                xb[t][r] = qv * expf(cs[t]);
            }
            __syncthreads();
            gdn_tile_mac(va, xa, &ssh[r0][0], GDN_CB, tg, j);
            gdn_tile_mac(oa, xb, &ssh[r0][0], GDN_CB, tg, j);
        }
        const float* uc = ubuf + blk * GDN_C * dv;
#pragma unroll
        for (int a = 0; a < 8; a++) {
            int t = tg + 8 * a;
            vn[t][j] = colok ? uc[t * dv + j0 + j] - va[a] : 0.0f;
        }
        const float* pc = pbuf + blk * GDN_C * GDN_C;
        for (int s0 = 0; s0 < GDN_C; s0 += GDN_TK) {  // + P v_new
            __syncthreads();
            for (int e = tid; e < GDN_C * GDN_TK; e += blockDim.x)
                xa[e / GDN_TK][e % GDN_TK] = pc[(e / GDN_TK) * GDN_C + s0 + e % GDN_TK];
            __syncthreads();
            gdn_tile_mac(oa, xa, &vn[s0][0], GDN_CB, tg, j);
        }
#pragma unroll
        for (int a = 0; a < 8; a++) {
            int t = tg + 8 * a;
            if (t < n && colok) out[((long long)(c0 + t) * nv + h) * dv + j0 + j] = oa[a];
        }
        float last = cs[GDN_C - 1], dlast = expf(last);
        for (int r0 = 0; r0 < dkp; r0 += GDN_TK) {  // S = e^last S + (k e^(last - cum))^T v_new
            __syncthreads();
            for (int e = tid; e < GDN_C * GDN_TK; e += blockDim.x) {
                int t = e / GDN_TK, r = e % GDN_TK;
                bool in = t < n && r0 + r < dk;
                float kv = in ? k[((long long)(c0 + t) * nk + hk) * dk + r0 + r] : 0.0f;
                xa[t][r] = kv * expf(last - cs[t]);
            }
            __syncthreads();
#pragma unroll
            for (int a = 0; a < GDN_TK / 8; a++) {
                int r = tg + 8 * a;
                float acc = 0.0f;
#pragma unroll 8
                for (int t = 0; t < GDN_C; t++) acc = fmaf(xa[t][r], vn[t][j], acc);
                ssh[r0 + r][j] = ssh[r0 + r][j] * dlast + acc;
            }
        }
    }
    __syncthreads();
    for (int r = tg; r < dk; r += 8)
        if (colok) st[(long long)r * dv + j0 + j] = ssh[r][j];
}
