// The fused decode step (backend/ops/native_decoder.py): one token through a whole layer in
// five or six launches instead of ~25. Every position and length is read from device memory
// (`pos`: the token's position, which is the cache length before it), so the same launch list
// replays as a graph at every step.
//
// dgemv_<fmt>: y (rows) = W x for T == 1 with what runs next to it fused in:
//   - a prologue on x as it is staged in shared memory: none; RMSNorm (x * w or x * (1 + w),
//     sum(x^2) accumulated on the way; the scalar rsqrt(mean(x^2) + eps) factors out of the dot
//     and is applied once per row at the end); or the attention output gate x * sigmoid(g).
//   - W as up to DG_SEGS matrices of one format stacked by rows (qkv|z|b|a of a Gated DeltaNet
//     layer, q|k|v of attention), described by a device table `segs` of DG_SEG_WORDS int64 per
//     matrix: data, scales, row_bytes, srow_bytes, end row (cumulative), global-scale bits.
//   - an epilogue: store; add into y (the residual stream, in place); SwiGLU, silu(row r of
//     matrix 0) * (row r of matrix 1), rows = matrix 0's; and, for rows < conv_rows, the Gated
//     DeltaNet causal conv of that channel with its state shifted in place, then SiLU (each
//     channel is one warp's row, so the in-place shift has no other reader).
//   - xn_out (optional): block 0 writes the normed x (the final hidden state beside the
//     lm_head logits); bump (optional): block 0 adds 1 to the position counter at the end of
//     the step.
//   Reference: numpy_ref.rms_norm / sigmoid, then numpy_ref.linear on the dequantized W, then
//   numpy_ref.silu_mul / causal_conv1d + silu. Grid (ceil(rows / 8)), block 256.
// gdn_decode: the rest of a Gated DeltaNet layer for one token, one block per value head h:
//   l2norm of q, k (the conv output), beta = sigmoid(b), g = A * softplus(a + dt_bias), the
//   recurrent state update in place (as gdn_recurrent), then RMSNormGated with z.
//   proj (C + nv*dv + 2*nv): [conv(q|k|v) (C) | z (nv*dv) | b (nv) | a (nv)]; state (nv, dk, dv);
//   out (nv, dv). Reference: numpy_ref.l2norm, gated_delta_rule, rms_norm_gated. Grid (nv),
//   block 256; the same size limits as gdn_recurrent.
// qk_rope_kv_<kv>: q/k RMSNorm (optional), partial neox RoPE at position *pos, K/V appended to
//   the cache at *pos; q (and the output gate of gated attention) copied out contiguous.
//   qkv: [q (nh * hd, or nh * 2hd with each head's gate after it) | k (nkv*hd) | v (nkv*hd)].
//   Reference: numpy_ref.rms_norm, rope, cache.KVCache.update. Grid (nh + 2 * nkv), block 128.
#include "gdn.cuh"
#include "gemv.cuh"

#define DG_NONE 0
#define DG_NORM 1
#define DG_GATE 2
#define DG_STORE 0
#define DG_ADD 1
#define DG_SWIGLU 2
#define DG_SEGS 4
#define DG_SEG_WORDS 6
#define DG_KMAX 8

struct DgSeg {
    const u8* W;
    const u8* S;
    long long rb, srb;
    int end;
    float gs;
};

ATLAS_DEV DgSeg dg_seg(const long long* __restrict__ t, int s) {
    const long long* p = t + s * DG_SEG_WORDS;
    DgSeg g;
    g.W = (const u8*)(unsigned long long)p[0];
    g.S = (const u8*)(unsigned long long)p[1];
    g.rb = p[2];
    g.srb = p[3];
    g.end = (int)p[4];
    g.gs = __int_as_float((int)p[5]);
    return g;
}

ATLAS_DEV float dg_pro(int pro, float xv, const float* __restrict__ pw, int i, int unit_w) {
    if (pro == DG_NORM) return xv * (unit_w ? 1.0f + pw[i] : pw[i]);
    if (pro == DG_GATE) return xv * sigmoidf_(pw[i]);
    return xv;
}

// Stage x[32 * unit0 ..) with the prologue applied (and, with SUMS, its per-16 sums); returns
// this thread's sum of x^2 there. Every thread of the block calls it.
template <bool SUMS>
ATLAS_DEV float dg_stage(const float* __restrict__ x, const float* __restrict__ pw, int pro,
                         int unit_w, atlas_f4* xs, float* xsum, int cols, int unit0) {
    int uu = (int)(threadIdx.x >> 3), c = (int)(threadIdx.x & 7);
    bool ok = unit0 + uu < cols / 32;
    if (!SUMS && !ok) return 0.0f;
    int i = 32 * (unit0 + uu) + 4 * c;
    float a = 0.0f, b = 0.0f, d = 0.0f, e = 0.0f;
    atlas_f4 q = {0.0f, 0.0f, 0.0f, 0.0f};
    if (ok) {
        a = x[i];
        b = x[i + 1];
        d = x[i + 2];
        e = x[i + 3];
        q.x = dg_pro(pro, a, pw, i, unit_w);
        q.y = dg_pro(pro, b, pw, i + 1, unit_w);
        q.z = dg_pro(pro, d, pw, i + 2, unit_w);
        q.w = dg_pro(pro, e, pw, i + 3, unit_w);
    }
    gemv_put_x<SUMS>(q, ok, xs, xsum, uu, c);
    return fmaf(e, e, fmaf(d, d, fmaf(b, b, a * a)));
}

// The conv of channel r (weights w (C, K), state st (K-1, C)) on the new input xt; shifts the
// channel's state in place. The order of causal_conv1d's sums.
ATLAS_DEV float dg_conv(const float* __restrict__ w, float* st, int C, int K, int r, float xt) {
    float acc = 0.0f;
    for (int j = 0; j < K - 1; j++) acc = fmaf(w[(long long)r * K + j], st[(long long)j * C + r], acc);
    acc = fmaf(w[(long long)r * K + K - 1], xt, acc);
    for (int j = 0; j + 1 < K - 1; j++) st[(long long)j * C + r] = st[(long long)(j + 1) * C + r];
    if (K >= 2) st[(long long)(K - 2) * C + r] = xt;
    return siluf_(acc);
}

struct DgArgs {
    const long long* segs;
    int nseg;
    const float* x;
    const float* pw;
    int pro, unit_w;
    float eps;
    int epi;
    float* y;
    int rows, cols;
    float* xn_out;
    i32* bump;
    const float* conv_w;
    float* conv_st;
    int conv_rows, K;
};

template <int F, bool VEC>
ATLAS_DEV void dg_body(const DgArgs& a, atlas_f4* xs, float* xsum, float* red) {
    const bool sums = VEC && GvFmt<F>::sums;
    int r = blockIdx.x * GEMV_WARPS + warp_id();
    bool live = r < a.rows;  // a warp past the last row still stages x and meets the barriers
    int lane = lane_id();
    bool pair = a.epi == DG_SWIGLU;
    int s0 = 0, lr = live ? r : 0;
    if (!pair) {
        while (s0 < a.nseg - 1 && lr >= dg_seg(a.segs, s0).end) s0++;
        if (s0) lr -= dg_seg(a.segs, s0 - 1).end;
    }
    DgSeg A = dg_seg(a.segs, s0), B = dg_seg(a.segs, pair ? 1 : s0);
    const u8* rowA = A.W + (long long)lr * A.rb;
    const u8* srowA = A.S + (long long)lr * A.srb;
    const u8* rowB = B.W + (long long)lr * B.rb;
    const u8* srowB = B.S + (long long)lr * B.srb;
    GvLane L = VEC ? gv_lane<F>(lane) : gv_lane<FMT_F32>(lane);
    float acc0[2] = {0.0f, 0.0f}, acc1[2] = {0.0f, 0.0f}, ss = 0.0f;
    int units = a.cols / 32;
    for (int unit0 = 0; unit0 < units; unit0 += ATLAS_WARP) {
        bool have = live && (VEC ? gv_have<F>(unit0, lane, units) : unit0 + lane < units);
        GvRaw rawA, rawB;
        GvUnit g;
        if (VEC && live) {  // in flight while x stages
            gv_fetch<F>(rowA, srowA, unit0, units, lane, rawA);
            if (pair) gv_fetch<F>(rowB, srowB, unit0, units, lane, rawB);
        }
        __syncthreads();  // the previous tile's x and weight bytes have been read
        ss += dg_stage<sums>(a.x, a.pw, a.pro, a.unit_w, xs, xsum, a.cols, unit0);
        __syncthreads();
        if (!have) continue;
        if (VEC) gv_decode<F>(rawA, lane, g);
        else gemv_deq<F>(rowA, srowA, A.gs, unit0 + lane, g);
        gemv_dot<F, VEC>(g, L, xs, xsum, acc0);
        if (pair) {
            if (VEC) gv_decode<F>(rawB, lane, g);
            else gemv_deq<F>(rowB, srowB, B.gs, unit0 + lane, g);
            gemv_dot<F, VEC>(g, L, xs, xsum, acc1);
        }
    }
    int tail = a.cols - 32 * units;  // a plain format's partial last unit (cols % 32 != 0)
    int c = 32 * units + lane;
    if (live && c < a.cols) {
        float xc = dg_pro(a.pro, a.x[c], a.pw, c, a.unit_w);
        acc0[0] = fmaf(deq1<F>(rowA, c), xc, acc0[0]);
        if (pair) acc1[0] = fmaf(deq1<F>(rowB, c), xc, acc1[0]);
    }
    float scale = 1.0f;
    if (a.pro == DG_NORM) {  // block-uniform
        if ((int)threadIdx.x < tail) {
            float xv = a.x[32 * units + threadIdx.x];
            ss = fmaf(xv, xv, ss);
        }
        ss = block_sum(ss, red);
        scale = rsqrtf(ss / (float)a.cols + a.eps);
    }
    if (blockIdx.x == 0 && a.xn_out) {  // the normed x, as rms_norm writes it
        for (int i = threadIdx.x; i < a.cols; i += blockDim.x)
            a.xn_out[i] = a.x[i] * scale * (a.unit_w ? 1.0f + a.pw[i] : a.pw[i]);
    }
    if (blockIdx.x == 0 && threadIdx.x == 0 && a.bump) *a.bump += 1;
    if (!live) return;
    float d0 = warp_sum(acc0[0] + acc0[1]) * gemv_row_scale<F, VEC>(A.gs) * scale;
    float d1 = pair ? warp_sum(acc1[0] + acc1[1]) * gemv_row_scale<F, VEC>(B.gs) * scale : 0.0f;
    if (lane != 0) return;
    if (r < a.conv_rows) a.y[r] = dg_conv(a.conv_w, a.conv_st, a.conv_rows, a.K, r, d0);
    else if (a.epi == DG_ADD) a.y[r] = a.y[r] + d0;
    else if (pair) a.y[r] = siluf_(d0) * d1;
    else a.y[r] = d0;
}

template <int F>
ATLAS_DEV void dg_entry(const DgArgs& a) {
    __shared__ atlas_f4 xs[GEMV_TILE_F4];
    __shared__ float xsum[64];
    __shared__ float red[32];
    bool vec = true;
    for (int s = 0; s < a.nseg; s++) {
        DgSeg g = dg_seg(a.segs, s);
        vec = vec && gemv_aligned(g.W, g.S, g.rb, g.srb, F);
    }
    if (vec) dg_body<F, true>(a, xs, xsum, red);
    else dg_body<F, false>(a, xs, xsum, red);
}

#define DGEMV_ENTRY(name, F)                                                                    \
    extern "C" __global__ void __launch_bounds__(256)                                           \
        dgemv_##name(const long long* __restrict__ segs, int nseg, const float* x,              \
                     const float* pw, int pro, int unit_w, float eps, int epi, float* y,        \
                     int rows, int cols, float* xn_out, i32* bump, const float* conv_w,         \
                     float* conv_st, int conv_rows, int K) {                                    \
        DgArgs a = {segs, nseg, x,  pw,     pro,  unit_w, eps,     epi,      y,                 \
                    rows, cols, xn_out, bump, conv_w, conv_st, conv_rows, K};                   \
        dg_entry<F>(a);                                                                         \
    }
ATLAS_FOR_EACH_FORMAT(DGEMV_ENTRY)

#define GDN_DEC_RMAX 64

extern "C" __global__ void __launch_bounds__(256)
    gdn_decode(const float* __restrict__ proj, const float* __restrict__ A,
               const float* __restrict__ dt_bias, float* __restrict__ state,
               const float* __restrict__ norm_w, float* __restrict__ out, int nk, int nv, int dk,
               int dv, float scale, float eps) {
    __shared__ float qsh[256];
    __shared__ float ksh[256];
    __shared__ float vsh[256];
    __shared__ float red[256];
    __shared__ float red32[32];
    int h = blockIdx.x, tid = threadIdx.x;
    int hk = h / (nv / nk);
    int C = 2 * nk * dk + nv * dv;
    float qq = 0.0f, kk = 0.0f;
    for (int i = tid; i < dk; i += blockDim.x) {
        float qv = proj[(long long)hk * dk + i], kv = proj[(long long)nk * dk + hk * dk + i];
        qsh[i] = qv;
        ksh[i] = kv;
        qq = fmaf(qv, qv, qq);
        kk = fmaf(kv, kv, kk);
    }
    for (int i = tid; i < dv; i += blockDim.x) vsh[i] = proj[2LL * nk * dk + (long long)h * dv + i];
    float qinv = rsqrtf(block_sum(qq, red32) + 1e-6f);  // numpy_ref.l2norm's eps
    float kinv = rsqrtf(block_sum(kk, red32) + 1e-6f);
    for (int i = tid; i < dk; i += blockDim.x) {
        qsh[i] = qsh[i] * qinv * scale;
        ksh[i] = ksh[i] * kinv;
    }
    const float* zb = proj + C;
    float b = sigmoidf_(zb[(long long)nv * dv + h]);
    float decay = expf(A[h] * softplusf_(zb[(long long)nv * dv + nv + h] + dt_bias[h]));
    int np = min((int)blockDim.x / dv, dk);  // row parts, as gdn_recurrent
    int R = dk / np;
    int j = tid % dv, part = tid / dv;
    bool active = part < np;
    float S[GDN_DEC_RMAX];
    float* st = state + (long long)h * dk * dv;
    __syncthreads();  // q, k, v staged
#pragma unroll
    for (int r = 0; r < GDN_DEC_RMAX; r++)
        S[r] = (active && r < R) ? st[(long long)(part * R + r) * dv + j] * decay : 0.0f;
    float op = gdn_delta_update(S, ksh, qsh, vsh, red, b, part, R, j, dv, np, tid, active);
#pragma unroll
    for (int r = 0; r < GDN_DEC_RMAX; r++)
        if (active && r < R) st[(long long)(part * R + r) * dv + j] = S[r];
    if (active) red[tid] = op;
    __syncthreads();
    float o = 0.0f;
    if (active && part == 0)
        for (int p = 0; p < np; p++) o += red[p * dv + j];
    // RMSNormGated over the head's dv outputs
    float oss = block_sum(active && part == 0 ? o * o : 0.0f, red32);
    float inv = rsqrtf(oss / (float)dv + eps);
    if (active && part == 0)
        out[(long long)h * dv + j] = o * inv * norm_w[j] * siluf_(zb[(long long)h * dv + j]);
}

template <int KV>
ATLAS_DEV void kv_store(void* cache, long long i, float v) {
    if (KV == 0) ((u16*)cache)[i] = f32_to_bf16(v);
    else if (KV == 2) ((float*)cache)[i] = v;
    else ((u8*)cache)[i] = f32_to_e4m3(v);
}

template <int KV>
ATLAS_DEV void qk_rope_kv_body(const float* __restrict__ qkv, const float* __restrict__ qn_w,
                               const float* __restrict__ kn_w, int unit_w, float eps,
                               const float* __restrict__ inv_freq, int rot,
                               const i32* __restrict__ pos_ptr, float* __restrict__ q_out,
                               float* __restrict__ gate_out, void* kc, void* vc, float kscale,
                               float vscale, int nh, int nkv, int hd, int cap, int gated) {
    __shared__ float xh[256];
    __shared__ float red[32];
    int b = blockIdx.x, tid = threadIdx.x;
    int pos = *pos_ptr;
    long long qsz = (long long)nh * hd * (gated ? 2 : 1);
    const float* src;
    const float* nw = 0;
    if (b < nh) {
        src = qkv + (long long)b * hd * (gated ? 2 : 1);
        nw = qn_w;
    } else if (b < nh + nkv) {
        src = qkv + qsz + (long long)(b - nh) * hd;
        nw = kn_w;
    } else {
        src = qkv + qsz + (long long)(nkv + b - nh - nkv) * hd;
    }
    if (b >= nh + nkv) {  // v: straight into the cache
        int h = b - nh - nkv;
        for (int d = tid; d < hd; d += blockDim.x)
            kv_store<KV>(vc, ((long long)h * cap + pos) * hd + d, src[d] / vscale);
        return;
    }
    float ss = 0.0f;
    for (int d = tid; d < hd; d += blockDim.x) {
        xh[d] = src[d];
        ss = fmaf(src[d], src[d], ss);
    }
    if (nw) {  // block-uniform
        float scale = rsqrtf(block_sum(ss, red) / (float)hd + eps);
        for (int d = tid; d < hd; d += blockDim.x)
            xh[d] = xh[d] * scale * (unit_w ? 1.0f + nw[d] : nw[d]);
    }
    __syncthreads();
    float p = (float)pos;
    int half = rot / 2;
    for (int i = tid; i < half; i += blockDim.x) {
        float s, c;
        sincosf(p * inv_freq[i], &s, &c);
        float x1 = xh[i], x2 = xh[i + half];
        xh[i] = x1 * c - x2 * s;
        xh[i + half] = x2 * c + x1 * s;
    }
    __syncthreads();
    if (b < nh) {
        for (int d = tid; d < hd; d += blockDim.x) {
            q_out[(long long)b * hd + d] = xh[d];
            if (gated) gate_out[(long long)b * hd + d] = src[hd + d];
        }
    } else {
        int h = b - nh;
        for (int d = tid; d < hd; d += blockDim.x)
            kv_store<KV>(kc, ((long long)h * cap + pos) * hd + d, xh[d] / kscale);
    }
}

#define QK_ROPE_KV_ENTRY(KVNAME, KV)                                                            \
    extern "C" __global__ void __launch_bounds__(128) qk_rope_kv_##KVNAME(                      \
        const float* __restrict__ qkv, const float* __restrict__ qn_w,                          \
        const float* __restrict__ kn_w, int unit_w, float eps,                                  \
        const float* __restrict__ inv_freq, int rot, const i32* __restrict__ pos_ptr,           \
        float* __restrict__ q_out, float* __restrict__ gate_out, void* kc, void* vc,            \
        float kscale, float vscale, int nh, int nkv, int hd, int cap, int gated) {              \
        qk_rope_kv_body<KV>(qkv, qn_w, kn_w, unit_w, eps, inv_freq, rot, pos_ptr, q_out,        \
                            gate_out, kc, vc, kscale, vscale, nh, nkv, hd, cap, gated);         \
    }
QK_ROPE_KV_ENTRY(bf16, 0)
QK_ROPE_KV_ENTRY(fp8, 1)
QK_ROPE_KV_ENTRY(f32, 2)
