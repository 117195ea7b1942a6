// gemm_fp4_nvfp4: y (T, rows) = x (T, cols) @ W^T (+ bias) for NVFP4 weights with NVFP4
// activations (W4A4, `ATLAS_PREFILL=fp4`): Blackwell's block-scaled FP4 MMA (sm_120a /
// sm_121a: `mma.sync.aligned.m16n8k64.row.col.kind::mxf4nvf4.block_scale.scale_vec::4X`, SASS
// `OMMA.SF.16864`), as vLLM's `cutlass_scaled_fp4_mm` multiplies. cols % 128 == 0, the weight
// rows 16-byte aligned (ops/native/weights.py sends other weights to gemm_fast.cu).
//
// x is quantized per token by gemm_x_nvfp4 as NVIDIA's recipe quantizes activations: a float32
// global scale xg = amax(row) / (448 * 6) (1 for a zero row), per 16 columns an E4M3 scale
// s = e4m3(amax(block) / (6 xg)) and E2M1 codes e2m1(x / (s xg)) (round to nearest even,
// saturating at 6). The MMA multiplies codes and scales exactly and sums in float32; the
// epilogue multiplies by xg and the weight's global scale.
//
// A block computes 64 tokens x 128 weight rows, 128 columns a step: the step's x codes
// (64 x 64 bytes), weight codes (128 x 64 bytes) and both sides' scales (8 bytes a row) all
// arrive by cp.async through a 3-slot ring, two steps ahead; nothing is decoded outside the
// tensor cores. Code tiles are 64-byte rows with 16-byte chunk c stored at c ^ ((r / 2) % 4),
// so the eight rows of an ldmatrix phase hit 32 banks. The E2M1 fragments of m16n8k64 are those
// of bf16 m16n8k16 with bytes for elements (a register holds 8 codes of one row: a0 rows g,
// codes 8q.., a1 rows g + 8, a2 / a3 codes 32 + 8q..; b0 / b1 likewise for column g), so
// ldmatrix.x4 loads them; lane 4g + q passes the 4 scale bytes (one per 16 codes) of A row
// g + 8 (q % 2) and of B column g.
//
// Paths: sm_120a / sm_121a the block-scaled MMA (8 warps as 2 x 4, each 32 tokens x 32 rows:
// per 64 columns two A and two B ldmatrix.x4, 8 MMAs); elsewhere and with -DATLAS_PORTABLE the
// same tiles decoded to float32 and multiplied with fmaf (4 tokens x 8 rows per thread), which
// the emulator runs and a device checks its MMA against at first use; the emulator builds the
// MMA's fragment code with -DATLAS_EMU_MMA (ldmatrix and the MMA emulated by warp shuffles).
#include "gemm_tiles.cuh"

#define G4_BM 64  // tokens per tile
#define G4_BN 128  // weight rows per tile
#define G4_BK 128  // columns per step (64 bytes of codes and 8 scales a row)
#define G4_STAGES 3

// (the block-scaled MMA exists on the architecture-specific targets only: sm_120a, sm_121a)
#if defined(ATLAS_CUDA) && !defined(ATLAS_PORTABLE) && defined(__CUDA_ARCH_SPECIFIC__) && \
    __CUDA_ARCH_SPECIFIC__ >= 1200 && __CUDA_ARCH_SPECIFIC__ < 1300
#define G4_OMMA 1
#define G4_FRAGMENTS 1
#elif defined(ATLAS_EMU) && defined(ATLAS_EMU_MMA)
#define G4_FRAGMENTS 1
#endif

// E2M1 code of v (|v| rounded to the nearest of 0, .5, 1, 1.5, 2, 3, 4, 6, ties to the even
// code, saturating; bit 3 the sign).
ATLAS_DEV u32 e2m1_code(float v) {
    float a = fabsf(v);
    u32 i = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) +
            (a > 5.0f);
    return i | (v < 0.0f ? 8u : 0u);
}

// x (T, cols) float32 -> codes xq (T, cols / 2: two per byte, the lower column in the low
// nibble), E4M3 scales xs (T, cols / 16) and global scales xg (T). One block per token.
extern "C" __global__ void __launch_bounds__(256)
    gemm_x_nvfp4(const float* __restrict__ x, u8* __restrict__ xq, u8* __restrict__ xs,
                 float* __restrict__ xg, int T, int cols) {
    __shared__ float red[32];
    int t = blockIdx.x;
    if (t >= T) return;  // one block per token
    const float* row = x + (long long)t * cols;
    float amax = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) amax = fmaxf(amax, fabsf(row[c]));
    amax = block_max(amax, red);
    float g = amax > 0.0f ? amax / (448.0f * 6.0f) : 1.0f;
    if (threadIdx.x == 0) xg[t] = g;
    for (int b = threadIdx.x; b < cols / 16; b += blockDim.x) {
        const float* v = row + 16 * b;
        float bmax = 0.0f;
#pragma unroll
        for (int i = 0; i < 16; i++) bmax = fmaxf(bmax, fabsf(v[i]));
        u8 sc = f32_to_e4m3(bmax / (6.0f * g));
        float d = mul_rn(e4m3_to_f32(sc), g);
        u32 w[2] = {0u, 0u};
#pragma unroll
        for (int i = 0; i < 16; i++) w[i >> 3] |= (d > 0.0f ? e2m1_code(v[i] / d) : 0u) << (4 * (i & 7));
        u32* out = (u32*)(xq + (long long)t * (cols / 2) + 8 * b);
        out[0] = w[0];
        out[1] = w[1];
        xs[(long long)t * (cols / 16) + b] = sc;
    }
}

typedef u8 g4_row[64];  // one step of a row's codes: 128 E2M1

ATLAS_DEV u8* g4_at(g4_row* t, int r, int chunk) { return &t[r][16 * (chunk ^ ((r >> 1) & 3))]; }
ATLAS_DEV const u8* g4_at(const g4_row* t, int r, int chunk) {
    return &t[r][16 * (chunk ^ ((r >> 1) & 3))];
}

struct G4Stage {
    g4_row x[G4_BM];
    g4_row w[G4_BN];
    u32 xs[G4_BM][2];  // word j: the 4 scales of columns 64 j .. 64 j + 63
    u32 ws[G4_BN][2];
};

struct G4Args {
    const u8 *W, *S, *xq, *xs;
    int T, rows, cols, m0, n0;
    long long row_bytes, srow_bytes;
};

// Step s into a ring slot: x codes (256 chunks, one per thread), weight codes (512, two per
// thread), x scales (threads 0..63) and weight scales (threads 64..191), 8 bytes a row.
// Rows past T / rows read the last one again: their outputs are never stored.
ATLAS_DEV void g4_issue(const G4Args& a, G4Stage& st, int tid, int s) {
    int r = tid >> 2, c = tid & 3;
    int t = a.m0 + r < a.T ? a.m0 + r : a.T - 1;
    gt_copy16(g4_at(st.x, r, c), a.xq + (long long)t * (a.cols / 2) + 64 * s + 16 * c);
#pragma unroll
    for (int i = 0; i < 2; i++) {
        int wr = r + 64 * i, n = a.n0 + wr < a.rows ? a.n0 + wr : a.rows - 1;
        gt_copy16(g4_at(st.w, wr, c), a.W + n * a.row_bytes + 64 * s + 16 * c);
    }
    if (tid < 64) {
        int tt = a.m0 + tid < a.T ? a.m0 + tid : a.T - 1;
        gt_copy8(st.xs[tid], a.xs + (long long)tt * (a.cols / 16) + 8 * s);
    } else if (tid < 192) {
        int wr = tid - 64, n = a.n0 + wr < a.rows ? a.n0 + wr : a.rows - 1;
        gt_copy8(st.ws[wr], a.S + n * a.srow_bytes + 8 * s);
    }
}

ATLAS_DEV void g4_out(float* __restrict__ y, const float* __restrict__ bias,
                      const float* __restrict__ xg, float gs, int T, int rows, int t, int r,
                      float acc) {
    if (t < T && r < rows) {
        float o = mul_rn(mul_rn(acc, xg[t]), gs);
        y[(long long)t * rows + r] = bias ? o + bias[r] : o;
    }
}

#if defined(G4_FRAGMENTS)

// Per warp: tokens 32 wm .. +32 (two m16 tiles), rows 32 wn .. +32 (four n8 tiles).
struct G4Acc {
    float c[2][4][4];
};

// c (16 x 8) += (a sa) (16 x 64) (b sb) (64 x 8), E2M1 codes, E4M3 scales per 16 codes.
ATLAS_DEV void g4_mma(float* c, const u32* a, const u32* b, u32 sa, u32 sb) {
#if defined(G4_OMMA)
    asm volatile(
        "mma.sync.aligned.m16n8k64.row.col.kind::mxf4nvf4.block_scale.scale_vec::4X.f32.e2m1."
        "e2m1.f32.ue4m3 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3}, %10, {0, 0}, %11, "
        "{0, 0};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(sa), "r"(sb));
#else
    // the definition on the same registers: element (row, k) of A is nibble k % 8 of register
    // row / 8 + 2 (k / 32) in lane 4 (row % 8) + k / 8 % 4; its scale is byte k / 16 of the
    // scale word of lane 4 (row % 8) + row / 8; B likewise with lane 4 n + k / 8 % 4, scale
    // lane 4 n
    int lane = lane_id();
    for (int e = 0; e < 4; e++) {
        int row = (lane >> 2) + 8 * (e >> 1), n = 2 * (lane & 3) + (e & 1);
        u32 sar = atlas_emu_shfl(sa, 4 * (row & 7) + (row >> 3));
        u32 sbr = atlas_emu_shfl(sb, 4 * n);
        float sum = c[e];
        for (int k8 = 0; k8 < 8; k8++) {
            u32 aw = atlas_emu_shfl(a[(row >> 3) + 2 * (k8 >> 2)], 4 * (row & 7) + (k8 & 3));
            u32 bw = atlas_emu_shfl(b[k8 >> 2], 4 * n + (k8 & 3));
            float s = mul_rn(e4m3_to_f32((u8)(sar >> (8 * (k8 >> 1)))),
                             e4m3_to_f32((u8)(sbr >> (8 * (k8 >> 1)))));
            for (int i = 0; i < 8; i++) {
                float p = mul_rn(e2m1_to_f32(aw >> (4 * i)), e2m1_to_f32(bw >> (4 * i)));
                sum = fmaf(p, s, sum);
            }
        }
        c[e] = sum;
    }
#endif
}

ATLAS_DEV void g4_step(G4Acc& acc, const G4Stage& st, int tid) {
    int warp = tid >> 5, lane = tid & 31;
    int wm = warp & 1, wn = warp >> 1, j = lane >> 3, r = lane & 7, g = lane >> 2, q = lane & 3;
#pragma unroll
    for (int k = 0; k < 2; k++) {  // 64 columns: 32 bytes, chunks 2k and 2k + 1
        u32 a[2][4], b[2][4], sa[2], sb[4];
#pragma unroll
        for (int ti = 0; ti < 2; ti++) {  // matrices: rows +0 / +8 (j & 1), chunk 2k + j / 2
            int m = 32 * wm + 16 * ti;
            gt_ldsm4(a[ti], g4_at(st.x, m + r + 8 * (j & 1), 2 * k + (j >> 1)));
            sa[ti] = st.xs[m + g + 8 * (q & 1)][k];
        }
#pragma unroll
        for (int tj = 0; tj < 2; tj++)  // matrices: b0, b1 of n8 tile 2 tj, then of 2 tj + 1
            gt_ldsm4(b[tj], g4_at(st.w, 32 * wn + 16 * tj + r + 8 * (j >> 1), 2 * k + (j & 1)));
#pragma unroll
        for (int n = 0; n < 4; n++) sb[n] = st.ws[32 * wn + 8 * n + g][k];
#pragma unroll
        for (int ti = 0; ti < 2; ti++)
#pragma unroll
            for (int n = 0; n < 4; n++)
                g4_mma(acc.c[ti][n], a[ti], &b[n >> 1][2 * (n & 1)], sa[ti], sb[n]);
    }
}

ATLAS_DEV void g4_epilogue(const G4Acc& acc, float* __restrict__ y, const float* __restrict__ bias,
                           const float* __restrict__ xg, float gs, const G4Args& a, int tid) {
#pragma unroll
    for (int i = 0; i < 32; i++) {
        int t, r;
        gt_frag_out(tid, i, &t, &r);
        g4_out(y, bias, xg, gs, a.T, a.rows, a.m0 + t, a.n0 + r, (&acc.c[0][0][0])[i]);
    }
}

#else  // portable: the codes decoded and multiplied with fmaf, 4 tokens x 8 rows per thread

struct G4Acc {
    float c[4][8];
};

// column k of row r of a code tile with its scale words, as float32 (exact: E2M1 x E4M3)
ATLAS_DEV float g4_value(const g4_row* codes, const u32 (*scales)[2], int r, int k) {
    u32 byte = g4_at(codes, r, k >> 5)[(k & 31) >> 1];
    u32 sc = scales[r][k >> 6] >> (8 * ((k >> 4) & 3));
    return mul_rn(e2m1_to_f32(byte >> (4 * (k & 1))), e4m3_to_f32((u8)sc));
}

ATLAS_DEV void g4_step(G4Acc& acc, const G4Stage& st, int tid) {
    int tm = tid >> 4, tn = tid & 15;
    for (int k = 0; k < G4_BK; k++) {
        float a[4], b[8];
#pragma unroll
        for (int t = 0; t < 4; t++) a[t] = g4_value(st.x, st.xs, 4 * tm + t, k);
#pragma unroll
        for (int n = 0; n < 8; n++) b[n] = g4_value(st.w, st.ws, 8 * tn + n, k);
#pragma unroll
        for (int t = 0; t < 4; t++)
#pragma unroll
            for (int n = 0; n < 8; n++) acc.c[t][n] = fmaf(a[t], b[n], acc.c[t][n]);
    }
}

ATLAS_DEV void g4_epilogue(const G4Acc& acc, float* __restrict__ y, const float* __restrict__ bias,
                           const float* __restrict__ xg, float gs, const G4Args& a, int tid) {
#pragma unroll
    for (int i = 0; i < 32; i++) {
        int t, r;
        gt_thread_out(tid, i, &t, &r);
        g4_out(y, bias, xg, gs, a.T, a.rows, a.m0 + t, a.n0 + r, (&acc.c[0][0])[i]);
    }
}

#endif

extern "C" __global__ void __launch_bounds__(256)
    gemm_fp4_nvfp4(const u8* __restrict__ W, const u8* __restrict__ S, float gs,
                   const u8* __restrict__ xq, const u8* __restrict__ xs,
                   const float* __restrict__ xg, const float* __restrict__ bias,
                   float* __restrict__ y, int T, int rows, int cols, long long row_bytes,
                   long long srow_bytes) {
    __shared__ __attribute__((aligned(16))) G4Stage ring[G4_STAGES];
    int tid = threadIdx.x;
    G4Args a;
    a.W = W;
    a.S = S;
    a.xq = xq;
    a.xs = xs;
    a.T = T;
    a.rows = rows;
    a.cols = cols;
    a.row_bytes = row_bytes;
    a.srow_bytes = srow_bytes;
    gm_tile_origin(T, rows, G4_BM, G4_BN, &a.m0, &a.n0);
    int steps = cols / G4_BK;
    G4Acc acc = {};
#pragma unroll
    for (int s = 0; s < G4_STAGES - 1; s++) {  // one commit group per step, empty past the end
        if (s < steps) g4_issue(a, ring[s], tid, s);
        gt_commit();
    }
    for (int s = 0; s < steps; s++) {
        int ahead = s + G4_STAGES - 1;  // its slot was read at step s - 1, before the barrier
        if (ahead < steps) g4_issue(a, ring[ahead % G4_STAGES], tid, ahead);
        gt_commit();
        gt_wait<G4_STAGES - 1>();  // step s's copies (this thread's) have landed
        __syncthreads();  // ... everyone's
        g4_step(acc, ring[s % G4_STAGES], tid);
        __syncthreads();  // every warp is done with slot s
    }
    g4_epilogue(acc, y, bias, xg, gs, a, tid);
}
