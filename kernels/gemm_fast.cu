// gemm_fast_<fmt>: y (T, rows) = x (T, cols) @ W^T (+ bias) for prefill with one bf16 MMA per
// product, the way llama.cpp and vLLM multiply (int8 / FP4 / bf16 activations, float32 sums).
// gemm.cu keeps the float32-exact kernel (x in three bf16 parts) for `--exact`.
//
// Precision: x is rounded to bf16 once, by gemm_x_bf16 (round to nearest even, into a (T, ld)
// buffer whose columns past cols are zero); every dequantized weight value is rounded to bf16
// as it is staged (exact for bf16 and NVFP4 weights, whose global scale the epilogue applies);
// the products are exact in float32 and summed in float32. bf16 keeps 8 significant bits, so
// |y - y_ref| <= (2 * 2^-8 + float32 sum rounding) * sum |x w| against the float32 reference,
// and the kernel equals numpy on the bf16-rounded operands up to summation order.
//
// A block computes 64 tokens x 128 weight rows, stepping over cols 64 at a time. x arrives
// through a GF_STAGES-deep ring of cp.async copies (16 bytes each, two per thread per step,
// issued GF_STAGES - 1 steps ahead); the weights are read into registers one step ahead (a
// 32-value unit per thread: 128 rows x 2 units), dequantized once per tile and stored as bf16
// into a shared tile every warp reads. Tiles are gemm_tiles.cuh's swizzled 128-byte rows, so
// the ldmatrix phases (eight rows of one 16-byte column chunk) hit 32 banks.
//
// Paths: sm_80+ ldmatrix.x4 + `mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32` (8 warps
// as 2 x 4, each 32 tokens x 32 rows: per 16 columns two A and two B ldmatrix, 8 MMAs) and
// cp.async; gfx11 `__builtin_amdgcn_wmma_f32_16x16x16_bf16_w32` (8 waves as 4 x 2, each 16
// tokens x 64 rows) with plain 16-byte copies into the same ring; elsewhere and with
// -DATLAS_PORTABLE fmaf on the same tiles (4 tokens x 8 rows per thread), which the emulator
// runs and which a device compares its tensor-core kernel against at first use
// (ops/native/gemm_check.py). The emulator builds the sm_80 fragment code with
// -DATLAS_EMU_MMA: ldmatrix and the MMA emulated by warp shuffles on the same registers, so
// the fragment layout and the ring are tested without a GPU.
// Grid (ceil(T / 64) * ceil(rows / 128)), block 256, token tiles grouped as in gemm.cu.
#include "gemm_tiles.cuh"

#define GF_BM 64  // tokens per tile
#define GF_BN 128  // weight rows per tile
#define GF_STAGES 3  // x steps in flight (cp.async ring)

#if defined(ATLAS_CUDA) && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 800) && !defined(ATLAS_PORTABLE)
#define GF_FRAGMENTS 1
#elif defined(ATLAS_HIP) && defined(__GFX11__) && !defined(ATLAS_PORTABLE)
#define GF_WMMA_GFX11 1
#elif defined(ATLAS_EMU) && defined(ATLAS_EMU_MMA)
#define GF_FRAGMENTS 1
#endif

// x (T, cols) float32 -> xb (T, ld) bf16, round to nearest even, columns cols..ld-1 zero.
extern "C" __global__ void gemm_x_bf16(const float* __restrict__ x, u16* __restrict__ xb, int T,
                                       int cols, int ld) {
    long long n = (long long)T * ld;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        int t = (int)(i / ld), c = (int)(i % ld);
        xb[i] = c < cols ? f32_to_bf16(x[(long long)t * cols + c]) : (u16)0;
    }
}

struct GfArgs {
    GmArgs w;  // the weight side (gm_weight_unit); w.x unused
    const u16* xb;
    int ld;  // xb's row length (a multiple of GM_BK)
};

// Step s's x tile (64 tokens x 64 columns, 512 chunks of 16 bytes, two per thread) into ring
// slot `xs`. Tokens past T read token T - 1 again: their outputs are never stored.
ATLAS_DEV void gf_issue_x(const GfArgs& a, gm_tile* xs, int tid, int s) {
#pragma unroll
    for (int i = 0; i < 2; i++) {
        int id = tid + 256 * i, r = id >> 3, c = 8 * (id & 7);
        int t = a.w.m0 + r < a.w.T ? a.w.m0 + r : a.w.T - 1;
        gt_copy16(gm_at(xs, r, c), a.xb + (long long)t * a.ld + GM_BK * s + c);
    }
}

// A weight unit (from gm_weight_unit) into the tile as bf16: row tid / 2, columns
// 32 (tid % 2)..+32, four 16-byte stores.
ATLAS_DEV void gf_stage_w(gm_tile* ws, int tid, const float* v) {
#pragma unroll
    for (int q = 0; q < 4; q++) {
        u32 w[4];
#pragma unroll
        for (int i = 0; i < 4; i++)
            w[i] = (u32)f32_to_bf16(v[8 * q + 2 * i]) | ((u32)f32_to_bf16(v[8 * q + 2 * i + 1]) << 16);
        atlas_u4 c = {w[0], w[1], w[2], w[3]};
        *(atlas_u4*)gm_at(ws, tid >> 1, 32 * (tid & 1) + 8 * q) = c;
    }
}

// ---- the multiply of one 64 x 128 x 64 step --------------------------------------------------

#if defined(GF_FRAGMENTS)

// Per warp: tokens 32 wm .. +32 (two m16 tiles), rows 32 wn .. +32 (four n8 tiles).
struct GfAcc {
    float c[2][4][4];
};

ATLAS_DEV void gf_step(GfAcc& acc, const gm_tile* xs, const gm_tile* ws, int tid) {
    int warp = tid >> 5, lane = tid & 31;
    int wm = warp & 1, wn = warp >> 1, j = lane >> 3, r = lane & 7;
#pragma unroll
    for (int k = 0; k < GM_BK; k += 16) {
        u32 a[2][4], b[2][4];
#pragma unroll
        for (int ti = 0; ti < 2; ti++)  // matrices: rows +0 / +8 (j & 1), columns +0 / +8 (j >> 1)
            gt_ldsm4(a[ti], gm_at(xs, 32 * wm + 16 * ti + r + 8 * (j & 1), k + 8 * (j >> 1)));
#pragma unroll
        for (int tj = 0; tj < 2; tj++)  // matrices: b0, b1 of n8 tile 2 tj, then of 2 tj + 1
            gt_ldsm4(b[tj], gm_at(ws, 32 * wn + 16 * tj + r + 8 * (j >> 1), k + 8 * (j & 1)));
#pragma unroll
        for (int ti = 0; ti < 2; ti++)
#pragma unroll
            for (int n = 0; n < 4; n++) gt_mma<false>(acc.c[ti][n], a[ti], &b[n >> 1][2 * (n & 1)]);
    }
}

ATLAS_DEV void gf_epilogue(const GfAcc& acc, float* __restrict__ y, const float* __restrict__ bias,
                           float scale, int T, int rows, int m0, int n0, int tid) {
#pragma unroll
    for (int i = 0; i < 32; i++) {
        int t, r;
        gt_frag_out(tid, i, &t, &r);
        gm_out(y, bias, scale, T, rows, m0 + t, n0 + r, (&acc.c[0][0][0])[i]);
    }
}

#elif defined(GF_WMMA_GFX11)

// Per wave: tokens 16 (wave % 4) .. +16, rows 64 (wave / 4) .. +64 (four 16 x 16 tiles).
// Operands per lane (wave32): A = x row (lane % 16), k 0..15; B = weight row (lane % 16);
// C element e = (token 2 e + lane / 16, row lane % 16).
struct GfAcc {
    gm_v8f c[4];
};

ATLAS_DEV void gf_step(GfAcc& acc, const gm_tile* xs, const gm_tile* ws, int tid) {
    int wave = tid >> 5, lane = tid & 31;
    int m = 16 * (wave & 3) + (lane & 15), nb = 64 * (wave >> 2) + (lane & 15);
#pragma unroll 1
    for (int k = 0; k < GM_BK; k += 16) {
        gm_v16s a = gm_ld16(xs, m, k);
#pragma unroll
        for (int tj = 0; tj < 4; tj++)
            acc.c[tj] = __builtin_amdgcn_wmma_f32_16x16x16_bf16_w32(a, gm_ld16(ws, nb + 16 * tj, k),
                                                                    acc.c[tj]);
    }
}

ATLAS_DEV void gf_epilogue(const GfAcc& acc, float* __restrict__ y, const float* __restrict__ bias,
                           float scale, int T, int rows, int m0, int n0, int tid) {
    int wave = tid >> 5, lane = tid & 31;
#pragma unroll
    for (int j = 0; j < 4; j++)
#pragma unroll
        for (int e = 0; e < 8; e++) {
            int t = m0 + 16 * (wave & 3) + 2 * e + (lane >> 4);
            int r = n0 + 64 * (wave >> 2) + 16 * j + (lane & 15);
            gm_out(y, bias, scale, T, rows, t, r, acc.c[j][e]);
        }
}

#else  // portable: fmaf on the same tiles, 4 tokens x 8 rows per thread

struct GfAcc {
    float c[4][8];
};

ATLAS_DEV void gf_step(GfAcc& acc, const gm_tile* xs, const gm_tile* ws, int tid) {
    int tm = tid >> 4, tn = tid & 15;
#pragma unroll 4
    for (int k = 0; k < GM_BK; k++) {
        float a[4], b[8];
#pragma unroll
        for (int t = 0; t < 4; t++) a[t] = bf16_to_f32(*gm_at(xs, 4 * tm + t, k));
#pragma unroll
        for (int n = 0; n < 8; n++) b[n] = bf16_to_f32(*gm_at(ws, 8 * tn + n, k));
#pragma unroll
        for (int t = 0; t < 4; t++)
#pragma unroll
            for (int n = 0; n < 8; n++) acc.c[t][n] = fmaf(a[t], b[n], acc.c[t][n]);
    }
}

ATLAS_DEV void gf_epilogue(const GfAcc& acc, float* __restrict__ y, const float* __restrict__ bias,
                           float scale, int T, int rows, int m0, int n0, int tid) {
#pragma unroll
    for (int i = 0; i < 32; i++) {
        int t, r;
        gt_thread_out(tid, i, &t, &r);
        gm_out(y, bias, scale, T, rows, m0 + t, n0 + r, (&acc.c[0][0])[i]);
    }
}

#endif

template <int F>
ATLAS_DEV void gemm_fast_body(const u8* __restrict__ W, const u8* __restrict__ S, float gs,
                              const u16* __restrict__ xb, int ld, const float* __restrict__ bias,
                              float* __restrict__ y, int T, int rows, int cols,
                              long long row_bytes, long long srow_bytes) {
    __shared__ __attribute__((aligned(16))) gm_tile xs[GF_STAGES][GF_BM];
    __shared__ __attribute__((aligned(16))) gm_tile ws[GF_BN];
    int tid = threadIdx.x;
    GfArgs a;
    a.w = gm_args<F>(W, S, nullptr, T, rows, cols, row_bytes, srow_bytes, GF_BM, GF_BN);
    a.xb = xb;
    a.ld = ld;
    int steps = (a.w.units + 1) / 2;
    GfAcc acc = {};
    // the ring's first GF_STAGES - 1 steps, one commit group each (empty past the end, so the
    // group count and gt_wait's distance stay the same to the last step)
#pragma unroll
    for (int s = 0; s < GF_STAGES - 1; s++) {
        if (s < steps) gf_issue_x(a, xs[s], tid, s);
        gt_commit();
    }
    float v[32];
    int wrow = a.w.n0 + (tid >> 1);
    gm_weight_unit<F>(a.w, wrow, tid & 1, v);
    gf_stage_w(ws, tid, v);
    for (int s = 0; s < steps; s++) {
        int ahead = s + GF_STAGES - 1;  // its slot was read at step s - 1, before the barrier
        if (ahead < steps) gf_issue_x(a, xs[ahead % GF_STAGES], tid, ahead);
        gt_commit();
        gt_wait<GF_STAGES - 1>();  // step s's copies (this thread's) have landed
        __syncthreads();  // ... everyone's, and the weight tile of step s
        if (s + 1 < steps) gm_weight_unit<F>(a.w, wrow, 2 * (s + 1) + (tid & 1), v);  // in flight
        gf_step(acc, xs[s % GF_STAGES], ws, tid);
        __syncthreads();  // every warp is done with the weight tile and slot s
        if (s + 1 < steps) gf_stage_w(ws, tid, v);
    }
    gf_epilogue(acc, y, bias, F == FMT_NVFP4 ? gs : 1.0f, T, rows, a.w.m0, a.w.n0, tid);
}

#define GEMM_FAST_ENTRY(name, F)                                                                \
    extern "C" __global__ void __launch_bounds__(256)                                           \
        gemm_fast_##name(const u8* __restrict__ W, const u8* __restrict__ S, float gs,          \
                         const u16* __restrict__ xb, int ld, const float* __restrict__ bias,    \
                         float* __restrict__ y, int T, int rows, int cols, long long row_bytes, \
                         long long srow_bytes) {                                                \
        gemm_fast_body<F>(W, S, gs, xb, ld, bias, y, T, rows, cols, row_bytes, srow_bytes);     \
    }
ATLAS_FOR_EACH_FORMAT(GEMM_FAST_ENTRY)
