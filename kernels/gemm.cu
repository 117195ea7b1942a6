// gemm_<fmt>: y (T, rows) = x (T, cols) @ W^T (+ bias) for many tokens (prefill), on tensor
// cores. A block computes 64 tokens x 64 weight rows, stepping over cols 64 at a time (two
// 32-element units). Each step every thread stages once: threads 0..127 dequantize one weight
// unit each (16-byte loads where the format and alignment allow, else quant.cuh's deq_unit),
// threads 128..255 load 32 x values as float4s; the next step's values are fetched into
// registers while the tensor cores work on the current tile.
//
// Precision: shared memory holds bf16 tiles, but every value is split into a bf16 high part and
// a bf16 low part (v = hi + lo to 16 significant bits), and the product is accumulated in
// float32 as x_hi*w_hi + x_lo*w_hi + x_hi*w_lo: within ~2^-17 of float32, so the GEMM matches
// numpy_ref.linear at the same tolerance as the float32 kernels. Formats whose dequantized
// values are exact in bf16 (bf16; NVFP4's E2M1 x E4M3, the float32 global scale applied at the
// end) skip the w_lo term: two MMAs per tile instead of three.
//
// Paths: sm_80+ `mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32` (8 warps as 2 x 4, each
// 32 tokens x 16 rows); gfx11 `__builtin_amdgcn_wmma_f32_16x16x16_bf16_w32` (8 waves as 4 x 2,
// each 16 tokens x 32 rows); elsewhere, and with -DATLAS_PORTABLE, the same tiles multiplied
// with fmaf (4 x 4 outputs per thread): the CPU emulator runs that one, and on a device it is
// the reference the tensor-core kernel is checked against at first use (ops/gemm_check.py).
// Grid (ceil(rows / 64), ceil(T / 64)), block 256. Reference: numpy_ref.linear.
#include "quant.cuh"

#define GM_BM 64           // tokens per tile
#define GM_BN 64           // weight rows per tile
#define GM_BK 64           // columns per step (two units)
#define GM_LD (GM_BK + 8)  // row pitch in bf16: 144 bytes, 16-byte aligned, conflict-free reads

#if defined(ATLAS_CUDA) && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 800) && !defined(ATLAS_PORTABLE)
#define GM_MMA_SM80 1
#elif defined(ATLAS_HIP) && defined(__GFX11__) && !defined(ATLAS_PORTABLE)
#define GM_WMMA_GFX11 1
#endif

typedef u16 gm_tile[GM_LD];

// v = hi + lo, both bf16; lo is the rounding error of hi (exact in float32), 0 when v is bf16.
ATLAS_DEV void gm_split(float v, u16* hi, u16* lo) {
    u16 h = f32_to_bf16(v);
    *hi = h;
    *lo = f32_to_bf16(v - bf16_to_f32(h));
}

// 32 floats -> row `r`, columns [c0, c0 + 32) of the hi / lo tiles, as 16-byte stores.
ATLAS_DEV void gm_store32(gm_tile* hi, gm_tile* lo, bool with_lo, int r, int c0, const float* v) {
#pragma unroll
    for (int q = 0; q < 4; q++) {
        u32 h[4], l[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            u16 h0, h1, l0, l1;
            gm_split(v[8 * q + 2 * i], &h0, &l0);
            gm_split(v[8 * q + 2 * i + 1], &h1, &l1);
            h[i] = (u32)h0 | ((u32)h1 << 16);
            l[i] = (u32)l0 | ((u32)l1 << 16);
        }
        atlas_u4 hv = {h[0], h[1], h[2], h[3]};
        *(atlas_u4*)&hi[r][c0 + 8 * q] = hv;
        if (with_lo) {
            atlas_u4 lv = {l[0], l[1], l[2], l[3]};
            *(atlas_u4*)&lo[r][c0 + 8 * q] = lv;
        }
    }
}

// Unit u of a weight row into v[0..31] with 16-byte loads (the caller checked that the row is
// 16-byte aligned and the unit whole). NVFP4 without its global scale: E2M1 x E4M3, exact.
template <int F>
ATLAS_DEV bool gm_unit_vec(const u8* __restrict__ row, const u8* __restrict__ srow, int u,
                           float* v) {
    if (F == FMT_NVFP4) {
        atlas_u4 c = *((const atlas_u4*)row + u);
        float s0, s1;
        e4m3x2_to_f32(ld_u16(srow + 2 * u), &s0, &s1);
        s0 = mul_rn(s0, 16384.0f);  // e2m1x8_scaled's values are E2M1 x 2^-14
        s1 = mul_rn(s1, 16384.0f);
        u32 w[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
        for (int q = 0; q < 4; q++) {
            e2m1x8_scaled(w[q], v + 8 * q);
#pragma unroll
            for (int i = 0; i < 8; i++) v[8 * q + i] = mul_rn(v[8 * q + i], q < 2 ? s0 : s1);
        }
        return true;
    } else if (F == FMT_BF16 || F == FMT_F16) {
        const atlas_u4* p = (const atlas_u4*)row + 4 * u;
#pragma unroll
        for (int q = 0; q < 4; q++) {
            atlas_u4 c = p[q];
            u32 w[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
            for (int i = 0; i < 4; i++) {
                if (F == FMT_BF16) {
                    v[8 * q + 2 * i] = __uint_as_float(w[i] << 16);
                    v[8 * q + 2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
                } else {
                    h2_to_f32(w[i], &v[8 * q + 2 * i], &v[8 * q + 2 * i + 1]);
                }
            }
        }
        return true;
    } else if (F == FMT_F32) {
        const atlas_f4* p = (const atlas_f4*)row + 8 * u;
#pragma unroll
        for (int q = 0; q < 8; q++) {
            atlas_f4 c = p[q];
            v[4 * q] = c.x;
            v[4 * q + 1] = c.y;
            v[4 * q + 2] = c.z;
            v[4 * q + 3] = c.w;
        }
        return true;
    }
    return false;  // GGUF blocks (18, 20, 34, 144... bytes) are not 16-byte aligned
}

struct GmArgs {
    const u8* W;
    const u8* S;
    const float* x;
    int T, rows, cols, units, m0, n0;
    long long row_bytes, srow_bytes;
    bool wvec, xvec;  // 16-byte loads allowed for the weight rows / for x
};

// What thread `tid` stages for step `s` into v[0..31]: a weight unit (tid < 128: row
// n0 + tid / 2, unit 2s + tid % 2) or 8 float4s of x (tid >= 128: element e of the 64 x 64 x
// tile at index (tid - 128) + 128 e, 16 float4s per token, so a warp reads whole rows).
template <int F>
ATLAS_DEV void gm_fetch(const GmArgs& a, int tid, int s, float* v) {
    if (tid < 128) {
        int r = a.n0 + (tid >> 1), u = 2 * s + (tid & 1);
        const bool plain = F == FMT_F32 || F == FMT_F16 || F == FMT_BF16;
        if (r >= a.rows || u >= a.units) {
#pragma unroll
            for (int i = 0; i < 32; i++) v[i] = 0.0f;
            return;
        }
        const u8* row = a.W + r * a.row_bytes;
        const u8* srow = a.S + r * a.srow_bytes;
        bool whole = !plain || 32 * u + 32 <= a.cols;
        if (a.wvec && whole && gm_unit_vec<F>(row, srow, u, v)) return;
        if (plain) {  // unaligned rows, or a partial last unit: element by element
#pragma unroll
            for (int i = 0; i < 32; i++) v[i] = 32 * u + i < a.cols ? deq1<F>(row, 32 * u + i) : 0.0f;
            return;
        }
        deq32<F>(row, srow, 1.0f, u, v);  // NVFP4's global scale comes at the end
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

ATLAS_DEV void gm_stage(gm_tile* xh, gm_tile* xl, gm_tile* wh, gm_tile* wl, bool w_lo, int tid,
                        const float* v) {
    if (tid < 128) {
        gm_store32(wh, wl, w_lo, tid >> 1, 32 * (tid & 1), v);
        return;
    }
#pragma unroll
    for (int e = 0; e < 8; e++) {
        int idx = tid - 128 + 128 * e;
        int m = idx >> 4, c = 4 * (idx & 15);
        u16 h[4], l[4];
#pragma unroll
        for (int i = 0; i < 4; i++) gm_split(v[4 * e + i], &h[i], &l[i]);
        *(u32*)&xh[m][c] = (u32)h[0] | ((u32)h[1] << 16);
        *(u32*)&xh[m][c + 2] = (u32)h[2] | ((u32)h[3] << 16);
        *(u32*)&xl[m][c] = (u32)l[0] | ((u32)l[1] << 16);
        *(u32*)&xl[m][c + 2] = (u32)l[2] | ((u32)l[3] << 16);
    }
}

ATLAS_DEV void gm_out(float* __restrict__ y, const float* __restrict__ bias, float scale, int T,
                      int rows, int t, int r, float acc) {
    if (t < T && r < rows) {
        float o = mul_rn(acc, scale);
        y[(long long)t * rows + r] = bias ? o + bias[r] : o;
    }
}

// ---- the multiply of one 64 x 64 x 64 step ---------------------------------------------------

#if defined(GM_MMA_SM80)

// Per warp: tokens 32 wm .. +32 (two m16 tiles), rows 16 wn .. +16 (two n8 tiles).
struct GmAcc {
    float c[2][2][4];
};

ATLAS_DEV u32 gm_ld32(const u16* p) { return *(const u32*)p; }

ATLAS_DEV void gm_mma(float* c, const u32* a, const u32* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

ATLAS_DEV void gm_zero(GmAcc& acc) {
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 2; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc.c[i][j][e] = 0.0f;
}

// Fragments as the PTX ISA lays them out for m16n8k16: lane = 4 g + q; A (row-major x tile)
// a0 = (g, 2q..), a1 = (g + 8, 2q..), a2 = (g, 2q + 8..), a3 = (g + 8, 2q + 8..); B (the weight
// tile, one row per n) b0 = (k 2q.., n g), b1 = (k 2q + 8.., n g).
template <bool W_LO>
ATLAS_DEV void gm_step(GmAcc& acc, const gm_tile* xh, const gm_tile* xl, const gm_tile* wh,
                       const gm_tile* wl, int tid) {
    int warp = tid >> 5, lane = tid & 31;
    int wm = warp & 1, wn = warp >> 1, g = lane >> 2, q = lane & 3;
#pragma unroll
    for (int k = 0; k < GM_BK; k += 16) {
        u32 ah[2][4], al[2][4], bh[2][2], bl[2][2];
#pragma unroll
        for (int i = 0; i < 2; i++) {
            int m = 32 * wm + 16 * i + g;
            ah[i][0] = gm_ld32(&xh[m][k + 2 * q]);
            ah[i][1] = gm_ld32(&xh[m + 8][k + 2 * q]);
            ah[i][2] = gm_ld32(&xh[m][k + 8 + 2 * q]);
            ah[i][3] = gm_ld32(&xh[m + 8][k + 8 + 2 * q]);
            al[i][0] = gm_ld32(&xl[m][k + 2 * q]);
            al[i][1] = gm_ld32(&xl[m + 8][k + 2 * q]);
            al[i][2] = gm_ld32(&xl[m][k + 8 + 2 * q]);
            al[i][3] = gm_ld32(&xl[m + 8][k + 8 + 2 * q]);
        }
#pragma unroll
        for (int j = 0; j < 2; j++) {
            int n = 16 * wn + 8 * j + g;
            bh[j][0] = gm_ld32(&wh[n][k + 2 * q]);
            bh[j][1] = gm_ld32(&wh[n][k + 8 + 2 * q]);
            if (W_LO) {
                bl[j][0] = gm_ld32(&wl[n][k + 2 * q]);
                bl[j][1] = gm_ld32(&wl[n][k + 8 + 2 * q]);
            }
        }
#pragma unroll
        for (int i = 0; i < 2; i++)
#pragma unroll
            for (int j = 0; j < 2; j++) {
                // the small terms first: they are added to a smaller running sum
                if (W_LO) gm_mma(acc.c[i][j], ah[i], bl[j]);
                gm_mma(acc.c[i][j], al[i], bh[j]);
                gm_mma(acc.c[i][j], ah[i], bh[j]);
            }
    }
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
typedef short gm_v16s __attribute__((ext_vector_type(16)));
typedef float gm_v8f __attribute__((ext_vector_type(8)));
typedef struct __attribute__((aligned(16))) {
    atlas_u4 lo, hi;
} gm_u8x;

struct GmAcc {
    gm_v8f c[2];
};

ATLAS_DEV gm_v16s gm_ld16(const u16* p) {
    gm_u8x v = {((const atlas_u4*)p)[0], ((const atlas_u4*)p)[1]};
    return __builtin_bit_cast(gm_v16s, v);
}

ATLAS_DEV void gm_zero(GmAcc& acc) {
#pragma unroll
    for (int j = 0; j < 2; j++)
#pragma unroll
        for (int e = 0; e < 8; e++) acc.c[j][e] = 0.0f;
}

template <bool W_LO>
ATLAS_DEV void gm_step(GmAcc& acc, const gm_tile* xh, const gm_tile* xl, const gm_tile* wh,
                       const gm_tile* wl, int tid) {
    int wave = tid >> 5, lane = tid & 31;
    int m = 16 * (wave & 3) + (lane & 15), nb = 32 * (wave >> 2) + (lane & 15);
#pragma unroll
    for (int k = 0; k < GM_BK; k += 16) {
        gm_v16s ah = gm_ld16(&xh[m][k]), al = gm_ld16(&xl[m][k]);
#pragma unroll
        for (int j = 0; j < 2; j++) {
            gm_v16s bh = gm_ld16(&wh[nb + 16 * j][k]);
            if (W_LO) {
                gm_v16s bl = gm_ld16(&wl[nb + 16 * j][k]);
                acc.c[j] = __builtin_amdgcn_wmma_f32_16x16x16_bf16_w32(ah, bl, acc.c[j]);
            }
            acc.c[j] = __builtin_amdgcn_wmma_f32_16x16x16_bf16_w32(al, bh, acc.c[j]);
            acc.c[j] = __builtin_amdgcn_wmma_f32_16x16x16_bf16_w32(ah, bh, acc.c[j]);
        }
    }
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

template <bool W_LO>
ATLAS_DEV void gm_step(GmAcc& acc, const gm_tile* xh, const gm_tile* xl, const gm_tile* wh,
                       const gm_tile* wl, int tid) {
    int tm = tid >> 4, tn = tid & 15;
#pragma unroll 4
    for (int k = 0; k < GM_BK; k++) {
        float ah[4], al[4], bh[4], bl[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            ah[i] = bf16_to_f32(xh[4 * tm + i][k]);
            al[i] = bf16_to_f32(xl[4 * tm + i][k]);
            bh[i] = bf16_to_f32(wh[4 * tn + i][k]);
            bl[i] = W_LO ? bf16_to_f32(wl[4 * tn + i][k]) : 0.0f;
        }
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int j = 0; j < 4; j++) {
                float c = acc.c[i][j];
                if (W_LO) c = fmaf(ah[i], bl[j], c);
                c = fmaf(al[i], bh[j], c);
                acc.c[i][j] = fmaf(ah[i], bh[j], c);
            }
    }
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
    __shared__ __attribute__((aligned(16))) gm_tile xh[GM_BM], xl[GM_BM];
    __shared__ __attribute__((aligned(16))) gm_tile wh[GM_BN], wl[GM_BN];
    // bf16 holds every bf16 weight and every NVFP4 E2M1 x E4M3 product: no low part
    const bool w_lo = !(F == FMT_BF16 || F == FMT_NVFP4);
    const bool plain = F == FMT_F32 || F == FMT_F16 || F == FMT_BF16;
    int tid = threadIdx.x;
    GmArgs a;
    a.W = W;
    a.S = S;
    a.x = x;
    a.T = T;
    a.rows = rows;
    a.cols = cols;
    a.units = plain ? units_of(cols) : cols / 32;
    a.m0 = blockIdx.y * GM_BM;
    a.n0 = blockIdx.x * GM_BN;
    a.row_bytes = row_bytes;
    a.srow_bytes = srow_bytes;
    a.wvec = ((unsigned long long)W & 15ull) == 0 && (row_bytes & 15) == 0;
    a.xvec = ((unsigned long long)x & 15ull) == 0 && (cols & 3) == 0;
    int steps = (a.units + 1) / 2;
    GmAcc acc;
    gm_zero(acc);
    float v[32];
    gm_fetch<F>(a, tid, 0, v);
    for (int s = 0; s < steps; s++) {
        gm_stage(xh, xl, wh, wl, w_lo, tid, v);
        __syncthreads();
        if (s + 1 < steps) gm_fetch<F>(a, tid, s + 1, v);  // in flight during the multiply
        gm_step<w_lo>(acc, xh, xl, wh, wl, tid);
        __syncthreads();
    }
    gm_epilogue(acc, y, bias, F == FMT_NVFP4 ? gs : 1.0f, T, rows, a.m0, a.n0, tid);
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
