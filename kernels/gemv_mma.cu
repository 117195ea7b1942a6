// gemv_mma_<fmt>: y (T, rows) = x (T, cols) @ W^T (+ bias) for 2 <= T <= 8 (an MTP verify) on
// the tensor cores, for the formats whose decoded codes are f16 halves (every quantized one).
// gemv.cu's gemv_t8 multiplies each decoded weight with every token (T FFMAs a weight); here a
// weight costs its decode and an eighth of an MMA whatever T is, and each lane keeps T == 1's
// weight loads in flight (four lane units: one tile of four rows).
//
// Precision: the codes are exact f16 halves (gemv.cuh: q * 2^-24 and the like; NVFP4's E2M1
// times its E4M3 block scale, exact in f16); x is scaled per token by a power of two (its
// largest |x| to [2^14, 2^15)) and split into two f16 parts, hi + lo, which keep 22 of its 24
// bits; the MMA's products are exact and summed in float32. So y is the float32 product within
// ~2^-22 of sum |x w| beyond float32's own rounding: a verify agrees with the T == 1 decode as
// gemv_t8 does. The block multipliers and offsets (gemv.cuh's dA, mA, ...) are applied per
// 16-column slice in float32, as gemv.cuh applies them per half.
//
// gemv_mma_x prepares x once per call: the B fragments of both parts, in the order of the MMA's
// registers (per 16-column slice s and lane 4 g + q: token g's b0 and b1 of part hi, then of lo;
// tokens >= T zero), each slice's scaled sum per token (the offsets' sums), and the factor 2^e
// that takes each token's scaling back. Within a slice the columns are in the order the decoders
// pair them in their f16 words (`pairing`), so a word of decoded halves is a fragment word.
//
// A block multiplies 32 rows, two groups of 16 (the MMA's M), four rows per warp, a tile of 32
// units (1,024 columns) at a time: for each group, every warp decodes its two rows' lane units
// into the shared tile (64 slices x 16 rows of f16, with their multipliers and offsets) and
// issues the next tile's loads for them, then each warp multiplies 8 of the 64 slices for all 16
// rows: ldmatrix.x4 for A, its x fragments for B, two MMAs (hi and lo). The partial sums of the 8
// warps are added in shared memory at the end. A tile's slice block is 32 chunks of 16 bytes
// (16 rows x 2), chunk (2 r + c) of row r stored at ((2 r + c) ^ (r >> 2 & 1)) ^ gvm_swz(s): the
// eight rows of an ldmatrix phase hit distinct banks, and so do the eight lanes of each 16-byte
// store (their slices differ in gvm_swz for every lane layout of gemv.cuh's gv_lane).
// Paths: sm_80+ `mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32`; the emulator builds the
// same fragment code with -DATLAS_EMU_MMA (gemm_tiles.cuh's gt_mma and gt_ldsm4 emulated). Other
// targets have only gemv_mma_x: the launcher takes gemv_t8 there, and on a device compares
// the two once (ops/native/gemm_check.py, kind "verify").
// Grid (ceil(rows / 32)), block 256; gemv_mma_x: grid (8, runs of slices), block 256.
#include "gemm_tiles.cuh"
#include "gemv.cuh"

#define GVM_TOKENS 8     // the MMA's N
#define GVM_SLICES 64    // 16-column slices per tile of 32 units
#define GVM_GROUP 16     // rows per MMA (its M)
#define GVM_ROWS 32      // rows per block: two groups, four rows per warp
#define GVM_SC_ROW 65    // float2 multipliers per shared row: 64 slices and one of padding
#define GVM_PAIR_NIB 0   // gv_nib8 and its kin: a word holds elements (i, i + 2) of 4
#define GVM_PAIR_FP4 1   // e2m1x8_halves: elements (i, i + 4) of 8

#if defined(ATLAS_CUDA) && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 800) && !defined(ATLAS_PORTABLE)
#define GVM_SM80 1
#define GVM_FRAGMENTS 1
#elif defined(ATLAS_EMU) && defined(ATLAS_EMU_MMA)
#define GVM_FRAGMENTS 1
#endif

// The column of slot p (0..15) of a slice: slots 2j, 2j + 1 are the low and high half of a
// decoder's word j.
ATLAS_DEV int gvm_slot_column(int p, int pairing) {
    if (pairing == GVM_PAIR_FP4) return (p & 8) | ((p & 1) << 2) | ((p >> 1) & 3);
    return (p & ~3) | ((p & 1) << 1) | ((p >> 1) & 1);
}

// x (T, cols) -> xf, xsum, xscale (the top of this file). Block (t, j): token t, the j-th of
// gridDim.y runs of slices (each block finds the token's largest |x| itself: one read of the
// row from L2 instead of a second launch).
extern "C" __global__ void gemv_mma_x(const float* __restrict__ x, u32* __restrict__ xf,
                                      float* __restrict__ xsum, float* __restrict__ xscale, int T,
                                      int cols, int pairing) {
    __shared__ float red[32];
    int t = blockIdx.x, tid = threadIdx.x;
    const float* xt = x + (long long)t * cols;
    float amax = 0.0f;
    if (t < T)
        for (int c = tid; c < cols; c += blockDim.x) amax = fmaxf(amax, fabsf(xt[c]));
    amax = block_max(amax, red);
    int e = 0;
    if (amax > 0.0f && amax <= 3.4e38f) frexpf(amax, &e);  // amax in [2^(e-1), 2^e)
    int up = 15 - e;                                         // largest |x| -> [2^14, 2^15)
    int slices = (cols + 1023) / 1024 * GVM_SLICES;
    int per = (slices + gridDim.y - 1) / gridDim.y, s0 = blockIdx.y * per;
    int s1 = min(slices, s0 + per);
    for (int i = 4 * s0 + tid; i < 4 * s1; i += blockDim.x) {
        int s = i >> 2, q = i & 3;
        u32 w[4];
#pragma unroll
        for (int j = 0; j < 2; j++) {  // b0: slots 2q, 2q + 1; b1: 2q + 8, 2q + 9
            u16 hi[2], lo[2];
#pragma unroll
            for (int h = 0; h < 2; h++) {
                int c = 16 * s + gvm_slot_column(2 * q + 8 * j + h, pairing);
                float v = t < T && c < cols ? ldexpf(xt[c], up) : 0.0f;
                hi[h] = f32_to_f16(v);
                lo[h] = f32_to_f16(v - f16_to_f32(hi[h]));
            }
            w[j] = hi[0] | ((u32)hi[1] << 16);
            w[2 + j] = lo[0] | ((u32)lo[1] << 16);
        }
        atlas_u4 o = {w[0], w[1], w[2], w[3]};
        ((atlas_u4*)xf)[s * 32 + 4 * t + q] = o;
    }
    for (int s = s0 + tid; s < s1; s += blockDim.x) {
        float sum = 0.0f;
        for (int k = 0; k < 16; k++) {
            int c = 16 * s + k;
            if (t < T && c < cols) sum += ldexpf(xt[c], up);
        }
        xsum[s * GVM_TOKENS + t] = sum;
    }
    if (tid == 0 && blockIdx.y == 0) xscale[t] = ldexpf(1.0f, -up);
}

#if defined(GVM_FRAGMENTS)

// Both halves of two f16 words multiplied: exact wherever the products are f16 values.
ATLAS_DEV u32 gvm_hmul2(u32 a, u32 b) {
#if defined(GVM_SM80)
    u32 d;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
#else
    u16 lo = f32_to_f16(f16_to_f32((u16)a) * f16_to_f32((u16)b));
    u16 hi = f32_to_f16(f16_to_f32((u16)(a >> 16)) * f16_to_f32((u16)(b >> 16)));
    return lo | ((u32)hi << 16);
#endif
}

// A lane unit as f16 words for the shared tile: words 0..7 half A's slots, 8..15 half B's.
template <int F>
struct GvmHalves {
    u32 w[16];
    float dA, dB, mA, mB;
    __device__ __forceinline__ void put(u32 h, int lo, int) {
        w[F == FMT_NVFP4 ? ((lo >> 3) << 2) | (lo & 3) : ((lo >> 2) << 1) | (lo & 1)] = h;
    }
};

// A half's multiplier and offset in shared memory (and, as a pair of floats, two tokens' sums
// of x); 8-byte aligned, so one 64-bit access each.
struct alignas(8) GvmScale {
    float d, m;
};

// The stored position (16-byte chunk) of chunk c of row r of slice s (the top of this file).
ATLAS_DEV int gvm_swz(int s) { return ((s >> 1) & 7) ^ ((s & 1) ? 7 : 0); }
ATLAS_DEV int gvm_chunk(int s, int r, int c) {
    return s * 32 + (((2 * r + c) ^ ((r >> 2) & 1)) ^ gvm_swz(s));
}

template <int F>
ATLAS_DEV void gvm_body(const u8* __restrict__ W, const u8* __restrict__ S, float gs,
                        const u32* __restrict__ xf, const float* __restrict__ xsum,
                        const float* __restrict__ xscale, const float* __restrict__ bias,
                        float* __restrict__ y, int T, int rows, int cols, long long row_bytes,
                        long long srow_bytes) {
    // NVFP4's block scales are folded into its halves; the other formats keep a multiplier and
    // an offset per half (per slice)
    const bool scaled = F != FMT_NVFP4;
    __shared__ atlas_u4 at[GVM_SLICES * 32];  // one group's A tile, 32 KB
    __shared__ GvmScale sc[scaled ? GVM_GROUP * GVM_SC_ROW : 1];
    int warp = warp_id(), lane = lane_id(), g = lane >> 2, q = lane & 3;
    int r0 = blockIdx.x * GVM_ROWS;
    GvLane L = gv_lane<F>(lane);  // L.sa, L.sb: the slices of the lane's halves
    const u8* wrow[2][2];
    const u8* srow[2][2];
#pragma unroll
    for (int p = 0; p < 2; p++)
#pragma unroll
        for (int j = 0; j < 2; j++) {  // rows past the end read the last row; never stored
            int r = min(r0 + GVM_GROUP * p + 2 * warp + j, rows - 1);
            wrow[p][j] = W + (long long)r * row_bytes;
            srow[p][j] = S + (long long)r * srow_bytes;
        }
    int units = cols / 32, tiles = (units + 31) / 32;
    // A lane past the row's end reads the row's last unit (K-quants: block), which the zeros
    // of x there cancel: no checks in the loop (the loaders reject non-finite weights)
    GvRaw raw[2][2];
#pragma unroll
    for (int p = 0; p < 2; p++)
#pragma unroll
        for (int j = 0; j < 2; j++)
            gv_fetch<F, GV_CLAMPED>(wrow[p][j], srow[p][j], 0, units, lane, raw[p][j]);
    float acc[2][4] = {};
    // where this lane stores its halves' chunks (rows 2 warp + j) and the rows it addresses
    // for ldmatrix.x4: matrices (rows 0-7 | 8-15) x (chunk 0 | 1), of the warp's 8 slices
    atlas_u4* st[2][4];
#pragma unroll
    for (int j = 0; j < 2; j++)
#pragma unroll
        for (int c = 0; c < 4; c++)  // half (c >> 1), chunk (c & 1)
            st[j][c] = &at[gvm_chunk(c < 2 ? L.sa : L.sb, 2 * warp + j, c & 1)];
    int lr = (lane & 7) + 8 * ((lane >> 3) & 1), lc = lane >> 4;
    const atlas_u4* ld[8];
#pragma unroll
    for (int i = 0; i < 8; i++) ld[i] = &at[gvm_chunk(8 * warp + i, lr, lc)];
    const atlas_u4* xf4 = (const atlas_u4*)xf;
    for (int tile = 0; tile < tiles; tile++) {
        int unit0 = 32 * tile;
        atlas_u4 xb[8];  // this warp's 8 slices' x fragments (token g; zero past T)
        GvmScale xs[8];  // their sums, tokens 2q (d), 2q + 1 (m)
#pragma unroll
        for (int i = 0; i < 8; i++) {
            int s = GVM_SLICES * tile + 8 * warp + i;
            atlas_u4 z = {0u, 0u, 0u, 0u};
            xb[i] = g < T ? ld_u4_readonly(xf4 + s * 32 + lane) : z;
            if (scaled) xs[i] = *(const GvmScale*)(xsum + s * GVM_TOKENS + 2 * q);
        }
#pragma unroll
        for (int p = 0; p < 2; p++) {
#pragma unroll
            for (int j = 0; j < 2; j++) {
                GvmHalves<F> h;
                gv_decode<F>(raw[p][j], lane, h);
                if (!scaled) {  // E2M1 x 2^-14 times the E4M3 scale: exact in f16
                    u32 sA = f32_to_f16(h.dA), sB = f32_to_f16(h.dB);
                    sA |= sA << 16;
                    sB |= sB << 16;
#pragma unroll
                    for (int k = 0; k < 16; k++) h.w[k] = gvm_hmul2(h.w[k], k < 8 ? sA : sB);
                }
                int rr = 2 * warp + j;
#pragma unroll
                for (int c = 0; c < 4; c++) {
                    atlas_u4 v = {h.w[4 * c], h.w[4 * c + 1], h.w[4 * c + 2], h.w[4 * c + 3]};
                    *st[j][c] = v;
                }
                if (scaled) {
                    sc[rr * GVM_SC_ROW + L.sa] = GvmScale{h.dA, h.mA};
                    sc[rr * GVM_SC_ROW + L.sb] = GvmScale{h.dB, h.mB};
                }
                if (tile + 1 < tiles)  // the next tile's loads, in flight during the MMAs
                    gv_fetch<F, GV_CLAMPED>(wrow[p][j], srow[p][j], unit0 + 32, units, lane,
                                            raw[p][j]);
            }
            __syncthreads();
#pragma unroll
            for (int i = 0; i < 8; i++) {
                int s = 8 * warp + i;
                u32 a[4];
                gt_ldsm4(a, ld[i]);
                const u32* b = &xb[i].x;
                if (scaled) {
                    float c[4] = {};
                    gt_mma<true>(c, a, b);
                    gt_mma<true>(c, a, b + 2);
                    GvmScale d0 = sc[g * GVM_SC_ROW + s], d8 = sc[(g + 8) * GVM_SC_ROW + s];
                    acc[p][0] = fmaf(c[0], d0.d, fmaf(-d0.m, xs[i].d, acc[p][0]));
                    acc[p][1] = fmaf(c[1], d0.d, fmaf(-d0.m, xs[i].m, acc[p][1]));
                    acc[p][2] = fmaf(c[2], d8.d, fmaf(-d8.m, xs[i].d, acc[p][2]));
                    acc[p][3] = fmaf(c[3], d8.d, fmaf(-d8.m, xs[i].m, acc[p][3]));
                } else {
                    gt_mma<true>(acc[p], a, b);
                    gt_mma<true>(acc[p], a, b + 2);
                }
            }
            __syncthreads();
        }
    }
    // the 8 warps' sums of each (row, token), in the A tile's memory
    float* red = (float*)at;
#pragma unroll
    for (int p = 0; p < 2; p++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            red[(warp * GVM_ROWS + GVM_GROUP * p + g + 8 * (e >> 1)) * GVM_TOKENS + 2 * q +
                (e & 1)] = acc[p][e];
    __syncthreads();
    int row = threadIdx.x >> 3, t = threadIdx.x & 7, r = r0 + row;
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < GEMV_WARPS; w++) sum += red[(w * GVM_ROWS + row) * GVM_TOKENS + t];
    if (t < T && r < rows) {
        float o = mul_rn(mul_rn(sum, gemv_row_scale<F, true>(gs)), xscale[t]);
        y[(long long)t * rows + r] = bias ? o + bias[r] : o;
    }
}

#define GVM_ENTRY(name, F)                                                                      \
    extern "C" __global__ void __launch_bounds__(256, 1) gemv_mma_##name(                       \
        const u8* __restrict__ W, const u8* __restrict__ S, float gs,                           \
        const u32* __restrict__ xf, const float* __restrict__ xsum,                             \
        const float* __restrict__ xscale, const float* __restrict__ bias, float* __restrict__ y, \
        int T, int rows, int cols, long long row_bytes, long long srow_bytes) {                 \
        gvm_body<F>(W, S, gs, xf, xsum, xscale, bias, y, T, rows, cols, row_bytes, srow_bytes); \
    }
GVM_ENTRY(q4_0, FMT_Q4_0)
GVM_ENTRY(q4_1, FMT_Q4_1)
GVM_ENTRY(q8_0, FMT_Q8_0)
GVM_ENTRY(q4_k, FMT_Q4_K)
GVM_ENTRY(q5_k, FMT_Q5_K)
GVM_ENTRY(q6_k, FMT_Q6_K)
GVM_ENTRY(nvfp4, FMT_NVFP4)
GVM_ENTRY(q5_0, FMT_Q5_0)
GVM_ENTRY(q5_1, FMT_Q5_1)
GVM_ENTRY(q3_k, FMT_Q3_K)
GVM_ENTRY(iq4_nl, FMT_IQ4_NL)
GVM_ENTRY(iq4_xs, FMT_IQ4_XS)

#endif  // GVM_FRAGMENTS
