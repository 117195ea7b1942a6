// The fused decode step (backend/ops/native/decoder.py): one token through a whole layer in
// five or six launches instead of ~25. Every position and length is read from device memory
// (`pos`: the token's position, which is the cache length before it), so the same launch list
// replays as a graph at every step.
//
// dgemv_<fmt>: y (rows) = W x for T == 1 with what runs next to it fused in:
//   - a prologue on x as it is staged in shared memory (a body each, chosen at the entry):
//     none; x * pw, pw the attention output gate's sigmoid (qk_rope_kv writes it) or an RMSNorm
//     weight (the host passes 1 + w for Qwen3.5's unit-offset norms), and for RMSNorm sum(x^2)
//     accumulated on the way (the scalar rsqrt(mean(x^2) + eps) factors out of the dot and is
//     applied once per row at the end).
//   - W as up to DG_SEGS matrices of one format stacked by rows (qkv|z|b|a of a Gated DeltaNet
//     layer, q|k|v of attention), described by a device table `segs` of DG_SEG_WORDS int64 per
//     matrix: data, scales, row_bytes, srow_bytes, end row (cumulative), global-scale bits.
//   - an epilogue: store (plus a bias per row where `bias` is given); add into y (the residual stream, in place); SwiGLU, silu(row r of
//     matrix 0) * (row r of matrix 1), rows = matrix 0's; and, for rows < conv_rows, the Gated
//     DeltaNet causal conv of that channel with its state shifted in place, then SiLU (each
//     channel is one warp's row, so the in-place shift has no other reader).
//   - xn_out (optional): block 0 writes the normed x (the final hidden state beside the
//     lm_head logits); bump (optional): block 0 adds 1 to the position counter at the end of
//     the step.
//   Each warp takes DG_WARP_ROWS output rows; x is staged DG_CHUNK_TILES tiles (8,192 columns)
//   at a time, and the weight loop (gemv.cuh gemv_tiles) runs over them without barriers,
//   asking L2 for the weight bytes two iterations ahead as it multiplies (gv_prefetch).
//   Reference: numpy_ref.rms_norm / sigmoid, then numpy_ref.linear on the dequantized W, then
//   numpy_ref.silu_mul / causal_conv1d + silu. Grid (ceil(rows / DG_BLOCK_ROWS)), block
//   256.
// gdn_decode: the rest of a Gated DeltaNet layer for one token, one block per value head h:
//   l2norm of q, k (the conv output), beta = sigmoid(b), g = A * softplus(a + dt_bias), the
//   recurrent state update in place (as gdn_recurrent), then RMSNormGated with z.
//   proj (C + nv*dv + 2*nv): [conv(q|k|v) (C) | z (nv*dv) | b (nv) | a (nv)]; state (nv, dk, dv);
//   out (nv, dv). Reference: numpy_ref.l2norm, gated_delta_rule, rms_norm_gated. Grid (nv),
//   block GDN_DEC_THREADS (512). Thread (part, j) holds state rows part*32 .. part*32 + 31 of
//   column j, rows past dk zero (q and k zero-padded there too), so its loops have a constant
//   trip count: a 128 x 128 head is 4 parts x 128 columns. 256 threads of up to 64 rows, the
//   count known only at run time, took 255 registers and spilled 188 bytes on sm_121.
// qk_rope_kv_<kv>: q/k RMSNorm (optional), partial neox RoPE at position *pos, K/V appended to
//   the cache at *pos; q copied out contiguous (and sigmoid of gated attention's output gate).
//   qkv: [q (nh * hd, or nh * 2hd with each head's gate after it) | k (nkv*hd) | v (nkv*hd)].
//   Reference: numpy_ref.rms_norm, rope, cache.KVCache.update. Grid (nh + 2 * nkv), block 128.
#include "gdn.cuh"
#include "gemv.cuh"

#define DG_NONE 0
#define DG_NORM 1
#define DG_MUL 2
#define DG_STORE 0
#define DG_ADD 1
#define DG_SWIGLU 2
#define DG_SEGS 4
#define DG_SEG_WORDS 6
#define DG_KMAX 8
#define DG_WARP_ROWS 2                              // output rows per warp
#define DG_BLOCK_ROWS (DG_WARP_ROWS * GEMV_WARPS)  // output rows per block
#define DG_CHUNK_TILES 8  // tiles of x staged at once (8,192 columns, 39 KB with their sums)

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

// dgemv's staging: x, with MUL times pw, and then also the sum of x^2 (RMSNorm's) returned;
// zeros past the row's end. VEC: x and pw are 16-byte aligned (dg_entry checks).
template <bool MUL, bool SUMS, bool VEC>
struct DgStage {
    const float* x;
    const float* pw;
    int cols;
    __device__ __forceinline__ atlas_f4 load(const float* p, int i) const {
        if (VEC) return ld_f4_readonly(p + i);
        atlas_f4 q = {p[i], p[i + 1], p[i + 2], p[i + 3]};
        return q;
    }
    __device__ __forceinline__ float operator()(atlas_f4* xs, float* xsum, int unit0) const {
        int uu = (int)(threadIdx.x >> 3), c = (int)(threadIdx.x & 7);
        int i = 32 * (unit0 + uu) + 4 * c;
        atlas_f4 v = {0.0f, 0.0f, 0.0f, 0.0f}, q = v;
        if (unit0 + uu < cols / 32) {
            q = v = load(x, i);
            if (MUL) {
                atlas_f4 w = load(pw, i);
                q.x *= w.x;
                q.y *= w.y;
                q.z *= w.z;
                q.w *= w.w;
            }
        }
        gemv_put_x<SUMS>(q, true, xs, xsum, uu, c);
        if (!MUL) return 0.0f;
        return fmaf(v.w, v.w, fmaf(v.z, v.z, fmaf(v.y, v.y, v.x * v.x)));
    }
};

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
    int pro;
    float eps;
    int epi;
    float* y;
    int rows, cols;
    float* xn_out;
    i32* bump;
    const float* conv_w;
    float* conv_st;
    int conv_rows, K;
    const float* bias;  // added to a stored row (q/k/v biases); null: none
};

ATLAS_DEV GvRow dg_row(const DgSeg& g, int r) {
    GvRow row = {g.W + (long long)r * g.rb, g.S + (long long)r * g.srb, g.gs};
    return row;
}

// Output row k (< DG_WARP_ROWS) of the warp: b * DG_BLOCK_ROWS + GEMV_WARPS * k + w.
ATLAS_DEV int dg_out_row(int k) { return blockIdx.x * DG_BLOCK_ROWS + GEMV_WARPS * k + warp_id(); }

// Row m of W (m < 2: the SwiGLU pair's matrix) behind output row r; a row past the last
// reads row 0.
ATLAS_DEV GvRow dg_w_row(const DgArgs& a, int r, int m) {
    int s0 = 0, lr = r < a.rows ? r : 0;
    if (a.epi == DG_SWIGLU) {
        s0 = m;
    } else {
        while (s0 < a.nseg - 1 && lr >= dg_seg(a.segs, s0).end) s0++;
        if (s0) lr -= dg_seg(a.segs, s0 - 1).end;
    }
    return dg_row(dg_seg(a.segs, s0), lr);
}

// Units of a row asked of L2 at once: an iteration's (U = 2) or two (U = 1, the SwiGLU pair's
// four rows: half the prefetch instructions); they are asked for two such blocks ahead, so
// wherever ptxas puts the request in an iteration, a whole iteration's work comes between it
// and the loads.
#define DG_AHEAD 64

// The warp's NR rows' bytes of units [unit0, unit0 + DG_AHEAD) asked of L2 (gv_prefetch).
template <int F, int NR>
ATLAS_DEV void dg_prefetch(const GvRow (&rows)[NR], int unit0, int lane) {
#pragma unroll
    for (int k = 0; k < NR; k++) gv_prefetch<F, DG_AHEAD>(rows[k].w, rows[k].s, unit0, lane);
}

// The dots of NR rows of W, each warp its own (live: whether the first is a real row), against
// x with MUL's prologue (x * pw, and the sum of x^2 for RMSNorm), scaled into d; returns the
// RMSNorm scale (1 without). Every thread of the block calls it.
template <int F, bool VEC, bool MUL, int NR>
ATLAS_DEV float dg_dots(const DgArgs& a, const GvRow (&rows)[NR], bool live, float* d,
                        atlas_f4* xs, float* xsum, float* red) {
    const bool sums = VEC && GvFmt<F>::sums;
    const int lane_units = F == FMT_F32 ? 2 : 4;  // per lane and iteration, as in gemv.cu
    const int U = VEC && NR < lane_units ? lane_units / NR : 1;  // tiles per iteration
    int lane = lane_id();
    GvLane L = VEC ? gv_lane<F>(lane) : gv_lane<FMT_F32>(lane);
    float acc[NR][2], ss = 0.0f;
#pragma unroll
    for (int k = 0; k < NR; k++) acc[k][0] = acc[k][1] = 0.0f;
    // x staged a chunk of up to DG_CHUNK_TILES tiles at a time, then the weight loop over the
    // chunk without barriers; the 16-byte path reads past the row's end as its last unit
    // (GV_CLAMPED), x staged as zeros there, and asks L2 for its bytes two iterations ahead
    // (the first before x is staged), so a warp's next weights are in flight while it
    // multiplies; the fallback checks
    const int MODE = VEC ? GV_CLAMPED : GV_CHECKED;
    int units = a.cols / 32;
    DgStage<MUL, sums, VEC> stage = {a.x, a.pw, a.cols};
    if (VEC && DG_AHEAD <= units) dg_prefetch<F, NR>(rows, 0, lane);
    if (VEC && 2 * DG_AHEAD <= units) dg_prefetch<F, NR>(rows, DG_AHEAD, lane);
    for (int c0 = 0; c0 < units; c0 += 32 * DG_CHUNK_TILES) {
        int n = min(units - c0, 32 * DG_CHUNK_TILES);
        int tiles = (n + 32 * U - 1) / (32 * U) * U;  // whole iterations
        __syncthreads();  // the previous chunk has been read
        for (int t = 0; t < tiles; t++)
            ss += stage(xs + t * GEMV_TILE_F4, xsum + 64 * t, c0 + 32 * t);
        __syncthreads();
        for (int u = 0; u < n; u += U * ATLAS_WARP) {
            // two blocks ahead, at each block's first iteration (every one when U = 2, known
            // at compile time); a row's last, partial block of DG_AHEAD units is not asked for
            int ahead = c0 + u + 2 * DG_AHEAD;
            bool opens = 32 * U == DG_AHEAD || (c0 + u) % DG_AHEAD == 0;
            if (VEC && opens && ahead + DG_AHEAD <= units) dg_prefetch<F, NR>(rows, ahead, lane);
            gemv_tiles<F, 1, NR, VEC, U, MODE>(rows, 1, units, c0 + u, live, lane, L,
                                               xs + (u / 32) * GEMV_TILE_F4, xsum + 2 * u, acc,
                                               GvPrestaged());  // two sums of 16 per unit
        }
    }
    int tail = a.cols - 32 * units;  // a plain format's partial last unit (cols % 32 != 0)
    int c = 32 * units + lane;
    if (live && c < a.cols) {
        float xc = MUL ? a.x[c] * a.pw[c] : a.x[c];
#pragma unroll
        for (int k = 0; k < NR; k++) acc[k][0] = fmaf(deq1<F>(rows[k].w, c), xc, acc[k][0]);
    }
    float scale = 1.0f;
    if (MUL && a.pro == DG_NORM) {  // block-uniform
        if ((int)threadIdx.x < tail) {
            float xv = a.x[32 * units + threadIdx.x];
            ss = fmaf(xv, xv, ss);
        }
        ss = block_sum(ss, red);
        scale = rsqrtf(ss / (float)a.cols + a.eps);
    }
#pragma unroll
    for (int k = 0; k < NR; k++) {
        d[k] = warp_sum(acc[k][0] + acc[k][1]) * gemv_row_scale<F, VEC>(rows[k].gs);
        d[k] *= scale;
    }
    return scale;
}

// The epilogue of output row r (lane 0 of its warp): d0 its dot, d1 the SwiGLU pair's.
ATLAS_DEV void dg_store(const DgArgs& a, int r, float d0, float d1) {
    if (r < a.conv_rows) a.y[r] = dg_conv(a.conv_w, a.conv_st, a.conv_rows, a.K, r, d0);
    else if (a.epi == DG_ADD) a.y[r] = a.y[r] + d0;
    else if (a.epi == DG_SWIGLU) a.y[r] = siluf_(d0) * d1;
    else a.y[r] = a.bias ? d0 + a.bias[r] : d0;  // after the product, as linear(x, W, b)
}

// The 16-byte path: all of a warp's rows against each staged tile (PAIR: the SwiGLU pair's
// two rows of W per output row); f32, whose lane units take 8 loads each, one output row at a
// time, which keeps its loads in registers.
template <int F, bool MUL, bool PAIR>
ATLAS_DEV float dg_body(const DgArgs& a, atlas_f4* xs, float* xsum, float* red) {
    const int M = PAIR ? 2 : 1, WR = F == FMT_F32 ? 1 : DG_WARP_ROWS, NR = WR * M;
    float scale = 1.0f;
#pragma unroll 1
    for (int k0 = 0; k0 < DG_WARP_ROWS; k0 += WR) {
        GvRow rows[NR];
#pragma unroll
        for (int k = 0; k < NR; k++) rows[k] = dg_w_row(a, dg_out_row(k0 + k / M), k % M);
        float d[NR];
        bool live = dg_out_row(k0) < a.rows;
        scale = dg_dots<F, true, MUL, NR>(a, rows, live, d, xs, xsum, red);
#pragma unroll
        for (int k = 0; k < WR; k++)
            if (dg_out_row(k0 + k) < a.rows && lane_id() == 0)
                dg_store(a, dg_out_row(k0 + k), d[M * k], d[M * k + M - 1]);
    }
    return scale;
}

// The fallback (deq32's byte loads, x read with 4-byte loads): one row of W at a time, which
// keeps its code small.
template <int F, bool MUL>
ATLAS_DEV float dg_fallback(const DgArgs& a, atlas_f4* xs, float* xsum, float* red) {
    float scale = 1.0f;
#pragma unroll 1
    for (int k = 0; k < DG_WARP_ROWS; k++) {
        int r = dg_out_row(k);
        float d0 = 0.0f, d1 = 0.0f;
#pragma unroll 1
        for (int m = 0; m < (a.epi == DG_SWIGLU ? 2 : 1); m++) {
            GvRow row[1] = {dg_w_row(a, r, m)};
            float d[1];
            scale = dg_dots<F, false, MUL, 1>(a, row, r < a.rows, d, xs, xsum, red);
            d1 = d[0];  // the pair: d0 is the first pass's
            if (m == 0) d0 = d[0];
        }
        if (r < a.rows && lane_id() == 0) dg_store(a, r, d0, d1);
    }
    return scale;
}

template <int F>
ATLAS_DEV float dg_pick(const DgArgs& a, bool vec, atlas_f4* xs, float* xsum, float* red) {
    bool mul = a.pro != DG_NONE || a.epi == DG_SWIGLU;
    if (!vec) {
        if (mul) return dg_fallback<F, true>(a, xs, xsum, red);
        return dg_fallback<F, false>(a, xs, xsum, red);
    }
    if (a.epi == DG_SWIGLU) return dg_body<F, true, true>(a, xs, xsum, red);  // the MLP's gate|up
    if (mul) return dg_body<F, true, false>(a, xs, xsum, red);
    return dg_body<F, false, false>(a, xs, xsum, red);
}

template <int F>
ATLAS_DEV void dg_entry(const DgArgs& a) {
    __shared__ atlas_f4 xs[DG_CHUNK_TILES * GEMV_TILE_F4];
    __shared__ float xsum[GvFmt<F>::sums ? DG_CHUNK_TILES * 64 : 1];
    __shared__ float red[32];
    bool vec = (((unsigned long long)a.x | (unsigned long long)a.pw) & 15ull) == 0;
    for (int s = 0; s < a.nseg; s++) {
        DgSeg g = dg_seg(a.segs, s);
        vec = vec && gemv_aligned(g.W, g.S, g.rb, g.srb, F);
    }
    float scale = dg_pick<F>(a, vec, xs, xsum, red);
    if (blockIdx.x == 0 && a.xn_out) {  // the normed x, as rms_norm writes it
        for (int i = threadIdx.x; i < a.cols; i += blockDim.x)
            a.xn_out[i] = a.x[i] * scale * a.pw[i];
    }
    if (blockIdx.x == 0 && threadIdx.x == 0 && a.bump) *a.bump += 1;
}

// Two blocks (16 warps) per SM, 128 registers, where ptxas keeps them unspilled (NVRTC 13.5
// spills 8-16 bytes of Q4_0 and Q4_1 there: one block, 8 warps). With two blocks of DG_AHEAD
// units of each of its 2 rows asked of L2 ahead, a warp has 4.5 KB of NVFP4 weights in flight:
// >= 24 KB per SM either way (tests/test_kernels_sass.py). Unbounded, ptxas gave Q5_K 168 and
// Q6_K 147 registers (~4% fewer instructions).
#define DG_MIN_BLOCKS(F) ((F) == FMT_Q4_0 || (F) == FMT_Q4_1 ? 1 : 2)
#define DGEMV_ENTRY(name, F)                                                                    \
    extern "C" __global__ void __launch_bounds__(256, DG_MIN_BLOCKS(F))                         \
        dgemv_##name(const long long* __restrict__ segs, int nseg, const float* x,              \
                     const float* pw, int pro, float eps, int epi, float* y, int rows,          \
                     int cols, float* xn_out, i32* bump, const float* conv_w, float* conv_st,   \
                     int conv_rows, int K, const float* bias) {                                 \
        DgArgs a = {segs,   nseg, x,      pw,      pro,       eps, epi, y, rows, cols,          \
                    xn_out, bump, conv_w, conv_st, conv_rows, K, bias};                         \
        dg_entry<F>(a);                                                                         \
    }
ATLAS_FOR_EACH_FORMAT(DGEMV_ENTRY)

#define GDN_DEC_THREADS 512
#define GDN_DEC_RMAX 32  // state rows per thread
#define GDN_DEC_KMAX (256 + GDN_DEC_RMAX)  // dk <= 256, zero-padded to whole parts

extern "C" __global__ void __launch_bounds__(GDN_DEC_THREADS)
    gdn_decode(const float* __restrict__ proj, const float* __restrict__ A,
               const float* __restrict__ dt_bias, float* __restrict__ state,
               const float* __restrict__ norm_w, float* __restrict__ out, int nk, int nv, int dk,
               int dv, float scale, float eps) {
    __shared__ float qsh[GDN_DEC_KMAX];
    __shared__ float ksh[GDN_DEC_KMAX];
    __shared__ float vsh[256];
    __shared__ float red[GDN_DEC_THREADS];
    __shared__ float red32[32];
    int h = blockIdx.x, tid = threadIdx.x;
    int hk = h / (nv / nk);
    int C = 2 * nk * dk + nv * dv;
    int np = (dk + GDN_DEC_RMAX - 1) / GDN_DEC_RMAX;  // row parts
    for (int i = dk + tid; i < np * GDN_DEC_RMAX; i += blockDim.x) qsh[i] = ksh[i] = 0.0f;
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
    int j = tid % dv, part = tid / dv;
    bool active = part < np;
    int rows = active ? min(dk - part * GDN_DEC_RMAX, GDN_DEC_RMAX) : 0;  // real rows held
    float S[GDN_DEC_RMAX];
    float* st = state + ((long long)h * dk + part * GDN_DEC_RMAX) * dv + j;
    __syncthreads();  // q, k, v staged
#pragma unroll
    for (int r = 0; r < GDN_DEC_RMAX; r++) S[r] = r < rows ? st[r * dv] * decay : 0.0f;
    float op = gdn_delta_update(S, ksh, qsh, vsh, red, b, part, GDN_DEC_RMAX, j, dv, np, tid,
                                active);
#pragma unroll
    for (int r = 0; r < GDN_DEC_RMAX; r++)
        if (r < rows) st[r * dv] = S[r];
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
            if (gated) gate_out[(long long)b * hd + d] = sigmoidf_(src[hd + d]);
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
