// gemm_<fmt>: y (T, rows) = x (T, cols) @ W^T (+ bias) for many tokens (prefill), on tensor
// cores. A block computes 64 tokens x 64 weight rows, stepping over cols 64 at a time (two
// 32-element units). Each step every thread stages once: threads 0..127 dequantize one weight
// unit each (16-byte loads where the format and alignment allow, else quant.cuh's deq32),
// threads 128..255 load 32 x values as float4s; the next step's values are fetched into
// registers while the tensor cores work on the current tile.
//
// Precision (bf16x3, like 3xTF32): every x value is split into three bf16 parts by truncation,
// x = x0 + x1 + x2 exactly (8 + 8 + 8 of float32's 24 significant bits), and every weight
// value into as many parts as its dequantized values need: one for bf16 and for NVFP4 (E2M1 x
// E4M3 has at most 6 significant bits; the float32 global scale is applied in the epilogue),
// two for f16 (11 bits), Q4_0 and Q5_0 (f16 scale x code - 8 or - 16: 14, 15 bits), three for
// the rest (f32; Q8_0's 18 bits; Q4_1, Q5_1 and the K-quants, whose scale x code - min is a
// rounded float32).
// Every product x_i w_j with i + j <= 2 is accumulated in float32, the smallest first: 3, 5
// or 6 MMAs per tile. What is left out (i + j >= 3) is below 2^-24 of |x w|, so the GEMM is
// float32 GEMM up to summation order and matches numpy_ref.linear like the float32 kernels.
// Each step's MMAs sum into a fresh accumulator that is then added to the running one with a
// float32 add: a tensor core's own accumulation rounding spans at most 64 columns.
//
// Paths: sm_80+ `mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32` (8 warps as 2 x 4, each
// 32 tokens x 16 rows); gfx11 `__builtin_amdgcn_wmma_f32_16x16x16_bf16_w32` (8 waves as 4 x 2,
// each 16 tokens x 32 rows); elsewhere, and with -DATLAS_PORTABLE, the same splits, the same
// products in the same order and the same per-step sums with fmaf (4 x 4 outputs per thread):
// the CPU emulator runs that one, and on a device it is the reference the tensor-core kernel
// is checked against at first use (ops/native/gemm_check.py).
// Grid (ceil(T / 64) * ceil(rows / 64)), block 256, in groups of GM_GROUP token tiles: a group
// walks every weight tile with its 8 token tiles side by side, so each weight tile is read from
// DRAM once per 512 tokens (L2 serves the other token tiles) while the group's x (512 x cols
// float32, 10 MB at cols = 5120) stays in L2. Reference: numpy_ref.linear.
#include "gemm_tiles.cuh"

#define GM_BM 64  // tokens per tile
#define GM_BN 64  // weight rows per tile
#define GM_XP 3   // bf16 parts of x
#define GM_SUM 2  // products x_i w_j with i + j <= GM_SUM are kept

#if defined(ATLAS_CUDA) && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 800) && !defined(ATLAS_PORTABLE)
#define GM_MMA_SM80 1
#elif defined(ATLAS_HIP) && defined(__GFX11__) && !defined(ATLAS_PORTABLE)
#define GM_WMMA_GFX11 1
#endif

// The bf16 parts a format's dequantized weights need to be exact (see the top).
template <int F>
ATLAS_DEV constexpr int gm_wparts() {
    if (F == FMT_BF16 || F == FMT_NVFP4) return 1;
    return F == FMT_F16 || F == FMT_Q4_0 || F == FMT_Q5_0 ? 2 : 3;
}

// v = p[0] + p[1] + p[2] exactly, each a bf16 (for normal floats): the top 8 significant bits,
// the next 8, the last 8. Truncation keeps each remainder exact in float32.
ATLAS_DEV void gm_split(float v, u16* p) {
    u32 b0 = __float_as_uint(v);
    float r = sub_rn(v, __uint_as_float(b0 & 0xffff0000u));
    u32 b1 = __float_as_uint(r);
    float l = sub_rn(r, __uint_as_float(b1 & 0xffff0000u));
    p[0] = (u16)(b0 >> 16);
    p[1] = (u16)(b1 >> 16);
    p[2] = (u16)(__float_as_uint(l) >> 16);
}

typedef struct __attribute__((aligned(8))) {
    u32 x, y;
} gm_u2;

// n consecutive floats (n = 4 or 8) -> the first P parts of row r, columns c0.. (c0 % n == 0).
template <int P, int N>
ATLAS_DEV void gm_store(gm_tile (*t)[GM_BM], int r, int c0, const float* v) {
    u32 w[GM_XP][N / 2];
#pragma unroll
    for (int i = 0; i < N / 2; i++) {
        u16 a[GM_XP], b[GM_XP];
        gm_split(v[2 * i], a);
        gm_split(v[2 * i + 1], b);
#pragma unroll
        for (int p = 0; p < P; p++) w[p][i] = (u32)a[p] | ((u32)b[p] << 16);
    }
#pragma unroll
    for (int p = 0; p < P; p++) {
        if (N == 8) {
            atlas_u4 q = {w[p][0], w[p][1], w[p][2], w[p][3]};
            *(atlas_u4*)gm_at(t[p], r, c0) = q;
        } else {
            gm_u2 q = {w[p][0], w[p][1]};
            *(gm_u2*)gm_at(t[p], r, c0) = q;
        }
    }
}

// What thread `tid` stages for step `s` into v[0..31]: a weight unit (tid < 128: row
// n0 + tid / 2, unit 2s + tid % 2) or 8 float4s of x (tid >= 128: element e of the 64 x 64 x
// tile at index (tid - 128) + 128 e, 16 float4s per token, so a warp reads whole rows).
template <int F>
ATLAS_DEV void gm_fetch(const GmArgs& a, int tid, int s, float* v) {
    if (tid < 128) {
        gm_weight_unit<F>(a, a.n0 + (tid >> 1), 2 * s + (tid & 1), v);
        return;
    }
#pragma unroll
    for (int e = 0; e < 8; e++) {
        int idx = tid - 128 + 128 * e;
        int t = a.m0 + (idx >> 4), c = GM_BK * s + 4 * (idx & 15);
        const float* p = a.x + (long long)t * a.cols + c;
        if (t < a.T && a.xvec && c + 4 <= a.cols) {
            atlas_f4 f = *(const atlas_f4*)p;
            v[4 * e] = f.x;
            v[4 * e + 1] = f.y;
            v[4 * e + 2] = f.z;
            v[4 * e + 3] = f.w;
        } else {
#pragma unroll
            for (int i = 0; i < 4; i++) v[4 * e + i] = t < a.T && c + i < a.cols ? p[i] : 0.0f;
        }
    }
}

// Step s's values (from gm_fetch) into the shared tiles: a weight unit as WP parts, or 8 x 4
// x values as GM_XP parts.
template <int WP>
ATLAS_DEV void gm_stage(gm_tile (*xs)[GM_BM], gm_tile (*ws)[GM_BN], int tid, const float* v) {
    if (tid < 128) {
#pragma unroll
        for (int q = 0; q < 4; q++) gm_store<WP, 8>(ws, tid >> 1, 32 * (tid & 1) + 8 * q, v + 8 * q);
        return;
    }
#pragma unroll
    for (int e = 0; e < 8; e++) {
        int idx = tid - 128 + 128 * e;
        gm_store<GM_XP, 4>(xs, idx >> 4, 4 * (idx & 15), v + 4 * e);
    }
}

// The kept products x_i * w_j (i + j <= GM_SUM, j < WP), smallest first; BODY uses i and j.
// Every path multiplies in this order (after unrolling, i and j are constants).
#define GM_PRODUCTS(WP, BODY)                                    \
    _Pragma("unroll") for (int s_ = GM_SUM; s_ >= 0; s_--)      \
    _Pragma("unroll") for (int j = (WP) - 1; j >= 0; j--) {     \
        const int i = s_ - j;                                    \
        if (i >= 0 && i < GM_XP) {                               \
            BODY;                                                \
        }                                                        \
    }

// ---- the multiply of one 64 x 64 x 64 step ---------------------------------------------------
//
// gm_step adds one step's products to the running sums: they are summed from zero (tensor-core
// accumulation over at most 64 columns), then added to `acc` with float32 adds.

#if defined(GM_MMA_SM80)

// Per warp: tokens 32 wm .. +32 (two m16 tiles), rows 16 wn .. +16 (two n8 tiles).
struct GmAcc {
    float c[2][2][4];
};

ATLAS_DEV u32 gm_ld32(const u16* p) { return *(const u32*)p; }

ATLAS_DEV void gm_zero(GmAcc& acc) {
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 2; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc.c[i][j][e] = 0.0f;
}

// Fragments as gemm_tiles.cuh's gt_mma takes them: A the row-major x tile, B the weight
// tile (one row per n).
template <int WP>
ATLAS_DEV void gm_step(GmAcc& acc, gm_tile (*xs)[GM_BM], gm_tile (*ws)[GM_BN], int tid) {
    int warp = tid >> 5, lane = tid & 31;
    int wm = warp & 1, wn = warp >> 1, g = lane >> 2, q = lane & 3;
    GmAcc d;
    gm_zero(d);
#pragma unroll
    for (int k = 0; k < GM_BK; k += 16) {
        u32 a[GM_XP][2][4], b[WP][2][2];
#pragma unroll
        for (int p = 0; p < GM_XP; p++)
#pragma unroll
            for (int ti = 0; ti < 2; ti++) {
                int m = 32 * wm + 16 * ti + g;
                a[p][ti][0] = gm_ld32(gm_at(xs[p], m, k + 2 * q));
                a[p][ti][1] = gm_ld32(gm_at(xs[p], m + 8, k + 2 * q));
                a[p][ti][2] = gm_ld32(gm_at(xs[p], m, k + 8 + 2 * q));
                a[p][ti][3] = gm_ld32(gm_at(xs[p], m + 8, k + 8 + 2 * q));
            }
#pragma unroll
        for (int p = 0; p < WP; p++)
#pragma unroll
            for (int tj = 0; tj < 2; tj++) {
                int n = 16 * wn + 8 * tj + g;
                b[p][tj][0] = gm_ld32(gm_at(ws[p], n, k + 2 * q));
                b[p][tj][1] = gm_ld32(gm_at(ws[p], n, k + 8 + 2 * q));
            }
#pragma unroll
        for (int ti = 0; ti < 2; ti++)
#pragma unroll
            for (int tj = 0; tj < 2; tj++) GM_PRODUCTS(WP, gt_mma<false>(d.c[ti][tj], a[i][ti], b[j][tj]))
    }
#pragma unroll
    for (int ti = 0; ti < 2; ti++)
#pragma unroll
        for (int tj = 0; tj < 2; tj++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc.c[ti][tj][e] = add_rn(acc.c[ti][tj][e], d.c[ti][tj][e]);
}

// C fragment: c0 = (g, 2q), c1 = (g, 2q + 1), c2 = (g + 8, 2q), c3 = (g + 8, 2q + 1).
ATLAS_DEV void gm_epilogue(const GmAcc& acc, float* __restrict__ y, const float* __restrict__ bias,
                           float scale, int T, int rows, int m0, int n0, int tid) {
    int warp = tid >> 5, lane = tid & 31;
    int wm = warp & 1, wn = warp >> 1, g = lane >> 2, q = lane & 3;
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 2; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int t = m0 + 32 * wm + 16 * i + g + 8 * (e >> 1);
                int r = n0 + 16 * wn + 8 * j + 2 * q + (e & 1);
                gm_out(y, bias, scale, T, rows, t, r, acc.c[i][j][e]);
            }
}

#elif defined(GM_WMMA_GFX11)

// Per wave: tokens 16 wm .. +16, rows 32 wn .. +32 (two 16 x 16 tiles). Operands per lane
// (wave32): A = x row (lane % 16), k 0..15; B = weight row (lane % 16), k 0..15; C element e
// = (token 2 e + lane / 16, row lane % 16). Both half-waves hold the same A and B.

struct GmAcc {
    gm_v8f c[2];
};

ATLAS_DEV void gm_zero(GmAcc& acc) {
#pragma unroll
    for (int j = 0; j < 2; j++)
#pragma unroll
        for (int e = 0; e < 8; e++) acc.c[j][e] = 0.0f;
}

template <int WP>
ATLAS_DEV void gm_step(GmAcc& acc, gm_tile (*xs)[GM_BM], gm_tile (*ws)[GM_BN], int tid) {
    int wave = tid >> 5, lane = tid & 31;
    int m = 16 * (wave & 3) + (lane & 15), nb = 32 * (wave >> 2) + (lane & 15);
    GmAcc d;
    gm_zero(d);
    // one k16 slice at a time: unrolled, the compiler hoists every slice's LDS loads and runs
    // out of VGPRs
#pragma unroll 1
    for (int k = 0; k < GM_BK; k += 16) {
        gm_v16s a[GM_XP], b[WP];
#pragma unroll
        for (int p = 0; p < GM_XP; p++) a[p] = gm_ld16(xs[p], m, k);
#pragma unroll
        for (int tj = 0; tj < 2; tj++) {
#pragma unroll
            for (int p = 0; p < WP; p++) b[p] = gm_ld16(ws[p], nb + 16 * tj, k);
            GM_PRODUCTS(WP, d.c[tj] = __builtin_amdgcn_wmma_f32_16x16x16_bf16_w32(a[i], b[j], d.c[tj]))
        }
    }
#pragma unroll
    for (int tj = 0; tj < 2; tj++)
#pragma unroll
        for (int e = 0; e < 8; e++) acc.c[tj][e] = add_rn(acc.c[tj][e], d.c[tj][e]);
}

ATLAS_DEV void gm_epilogue(const GmAcc& acc, float* __restrict__ y, const float* __restrict__ bias,
                           float scale, int T, int rows, int m0, int n0, int tid) {
    int wave = tid >> 5, lane = tid & 31;
#pragma unroll
    for (int j = 0; j < 2; j++)
#pragma unroll
        for (int e = 0; e < 8; e++) {
            int t = m0 + 16 * (wave & 3) + 2 * e + (lane >> 4);
            int r = n0 + 32 * (wave >> 2) + 16 * j + (lane & 15);
            gm_out(y, bias, scale, T, rows, t, r, acc.c[j][e]);
        }
}

#else  // portable: fmaf on the same tiles, 4 x 4 outputs per thread (tokens 4 tm.., rows 4 tn..)

struct GmAcc {
    float c[4][4];
};

ATLAS_DEV void gm_zero(GmAcc& acc) {
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) acc.c[i][j] = 0.0f;
}

template <int WP>
ATLAS_DEV void gm_step(GmAcc& acc, gm_tile (*xs)[GM_BM], gm_tile (*ws)[GM_BN], int tid) {
    int tm = tid >> 4, tn = tid & 15;
    GmAcc d;
    gm_zero(d);
#pragma unroll 4
    for (int k = 0; k < GM_BK; k++) {
        float a[GM_XP][4], b[WP][4];
#pragma unroll
        for (int t = 0; t < 4; t++) {
#pragma unroll
            for (int p = 0; p < GM_XP; p++) a[p][t] = bf16_to_f32(*gm_at(xs[p], 4 * tm + t, k));
#pragma unroll
            for (int p = 0; p < WP; p++) b[p][t] = bf16_to_f32(*gm_at(ws[p], 4 * tn + t, k));
        }
#pragma unroll
        for (int ti = 0; ti < 4; ti++)
#pragma unroll
            for (int tj = 0; tj < 4; tj++) {
                float c = d.c[ti][tj];
                GM_PRODUCTS(WP, c = fmaf(a[i][ti], b[j][tj], c))
                d.c[ti][tj] = c;
            }
    }
#pragma unroll
    for (int ti = 0; ti < 4; ti++)
#pragma unroll
        for (int tj = 0; tj < 4; tj++) acc.c[ti][tj] = add_rn(acc.c[ti][tj], d.c[ti][tj]);
}

ATLAS_DEV void gm_epilogue(const GmAcc& acc, float* __restrict__ y, const float* __restrict__ bias,
                           float scale, int T, int rows, int m0, int n0, int tid) {
    int tm = tid >> 4, tn = tid & 15;
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
            gm_out(y, bias, scale, T, rows, m0 + 4 * tm + i, n0 + 4 * tn + j, acc.c[i][j]);
}

#endif

template <int F>
ATLAS_DEV void gemm_body(const u8* __restrict__ W, const u8* __restrict__ S, float gs,
                         const float* __restrict__ x, const float* __restrict__ bias,
                         float* __restrict__ y, int T, int rows, int cols, long long row_bytes,
                         long long srow_bytes) {
    const int WP = gm_wparts<F>();
    __shared__ __attribute__((aligned(16))) gm_tile xs[GM_XP][GM_BM];
    __shared__ __attribute__((aligned(16))) gm_tile ws[WP][GM_BN];
    int tid = threadIdx.x;
    GmArgs a = gm_args<F>(W, S, x, T, rows, cols, row_bytes, srow_bytes, GM_BM, GM_BN);
    int steps = (a.units + 1) / 2;
    GmAcc acc;
    gm_zero(acc);
    float v[32];
    gm_fetch<F>(a, tid, 0, v);
    for (int s = 0; s < steps; s++) {
        gm_stage<WP>(xs, ws, tid, v);
        __syncthreads();
        if (s + 1 < steps) gm_fetch<F>(a, tid, s + 1, v);  // in flight during the multiply
        gm_step<WP>(acc, xs, ws, tid);
        __syncthreads();
    }
    gm_epilogue(acc, y, bias, F == FMT_NVFP4 ? gs : 1.0f, T, rows, a.m0, a.n0, tid);
}

// Two blocks per SM (one stages while the other multiplies). ptxas aims at that on sm_12x by
// itself, and there, without being told, spills a few bytes in one format; elsewhere the
// register count is left to it (one block of 256 threads per SM at worst).
#if defined(ATLAS_CUDA) && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 1200)
#define GM_BOUNDS __launch_bounds__(256, 2)
#else
#define GM_BOUNDS __launch_bounds__(256)
#endif

#define GEMM_ENTRY(name, F)                                                                     \
    extern "C" __global__ void GM_BOUNDS                                                        \
        gemm_##name(const u8* __restrict__ W, const u8* __restrict__ S, float gs,               \
                    const float* __restrict__ x, const float* __restrict__ bias,                \
                    float* __restrict__ y, int T, int rows, int cols, long long row_bytes,      \
                    long long srow_bytes) {                                                     \
        gemm_body<F>(W, S, gs, x, bias, y, T, rows, cols, row_bytes, srow_bytes);               \
    }
ATLAS_FOR_EACH_FORMAT(GEMM_ENTRY)
