// What the prefill GEMMs share (gemm.cu: float32-exact, bf16x3; gemm_fast.cu: one bf16 MMA
// per product): the swizzled 64-column bf16 tiles in shared memory and the weight unit a thread
// dequantizes into registers (16-byte loads where the format and alignment allow, else
// quant.cuh's deq32).
#pragma once
#include "quant.cuh"

#define GM_BK 64  // columns per step (two 32-element units)
#define GM_GROUP 8  // token tiles that share each weight tile (gemm.cu's top says why)

// The first token and weight row of this block's BM x BN tile. Blocks walk the weight tiles in
// groups of GM_GROUP token tiles side by side, so each weight tile is read from DRAM once per
// group (L2 serves the group's other token tiles) while the group's x stays in L2.
ATLAS_DEV void gm_tile_origin(int T, int rows, int bm, int bn, int* m0, int* n0) {
    int m_tiles = (T + bm - 1) / bm, n_tiles = (rows + bn - 1) / bn;
    int group = blockIdx.x / (GM_GROUP * n_tiles), in_group = blockIdx.x % (GM_GROUP * n_tiles);
    int size = m_tiles - GM_GROUP * group < GM_GROUP ? m_tiles - GM_GROUP * group : GM_GROUP;
    *m0 = (GM_GROUP * group + in_group % size) * bm;
    *n0 = (in_group / size) * bn;
}

// Output (t, r) of a tile times `scale` (NVFP4's global scale, else 1) plus the bias, if the
// tile's element is inside y.
ATLAS_DEV void gm_out(float* __restrict__ y, const float* __restrict__ bias, float scale, int T,
                      int rows, int t, int r, float acc) {
    if (t < T && r < rows) {
        float o = mul_rn(acc, scale);
        y[(long long)t * rows + r] = bias ? o + bias[r] : o;
    }
}

// ---- shared-memory staging: cp.async and ldmatrix on sm_80+ ---------------------------------

#if defined(ATLAS_CUDA) && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 800) && !defined(ATLAS_PORTABLE)
#define GT_ASYNC 1

ATLAS_DEV u32 gt_smem(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
ATLAS_DEV void gt_copy16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(gt_smem(dst)), "l"(src));
}
ATLAS_DEV void gt_copy8(void* dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(gt_smem(dst)), "l"(src));
}
ATLAS_DEV void gt_commit() { asm volatile("cp.async.commit_group;"); }
// every commit group but the newest N has landed (this thread's copies)
template <int N>
ATLAS_DEV void gt_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N));
}
#else  // plain copies, done when issued
ATLAS_DEV void gt_copy16(void* dst, const void* src) { *(atlas_u4*)dst = *(const atlas_u4*)src; }
ATLAS_DEV void gt_copy8(void* dst, const void* src) {
    ((u32*)dst)[0] = ((const u32*)src)[0];
    ((u32*)dst)[1] = ((const u32*)src)[1];
}
ATLAS_DEV void gt_commit() {}
template <int N>
ATLAS_DEV void gt_wait() {}
#endif

#if defined(ATLAS_EMU)
// The m16n8k16 MMA by its definition on the same registers (gt_mma's fragments), for the
// emulator's -DATLAS_EMU_MMA builds: each element's A row and B column fetched from the lanes
// that hold them, k-pair by k-pair.
template <bool F16>
ATLAS_DEV void gt_mma_emu(float* c, const u32* a, const u32* b) {
    int lane = lane_id();
    for (int kp = 0; kp < 8; kp++)
        for (int e = 0; e < 4; e++) {
            int row = (lane >> 2) + 8 * (e >> 1), n = 2 * (lane & 3) + (e & 1);
            u32 aw = atlas_emu_shfl(a[(row >> 3) + 2 * (kp >> 2)], 4 * (row & 7) + (kp & 3));
            u32 bw = atlas_emu_shfl(b[kp >> 2], 4 * n + (kp & 3));
            for (int h = 0; h < 2; h++) {
                u16 ah = (u16)(aw >> (16 * h)), bh = (u16)(bw >> (16 * h));
                float av = F16 ? f16_to_f32(ah) : bf16_to_f32(ah);
                float bv = F16 ? f16_to_f32(bh) : bf16_to_f32(bh);
                c[e] = fmaf(av, bv, c[e]);
            }
        }
}
#endif

#if defined(GT_ASYNC) || defined(ATLAS_EMU)
// c (16 x 8) += a (16 x 16) b (16 x 8), float32 accumulation; F16: the 16-bit operands are IEEE
// halves, else bf16. Fragments as the PTX ISA lays them out for m16n8k16 (lane = 4 g + q):
// a0 = (g, 2q..), a1 = (g + 8, 2q..), a2 = (g, 2q + 8..), a3 = (g + 8, 2q + 8..);
// b0 = (k 2q.., n g), b1 = (k 2q + 8.., n g); c0 = (g, 2q), c1 = (g, 2q + 1), c2 = (g + 8, 2q),
// c3 = (g + 8, 2q + 1). The instruction on sm_80+, its emulation (gt_mma_emu) elsewhere.
template <bool F16>
ATLAS_DEV void gt_mma(float* c, const u32* a, const u32* b) {
#if defined(GT_ASYNC)
    if constexpr (F16)
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
            "{%8,%9}, {%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    else
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
            "{%8,%9}, {%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    gt_mma_emu<F16>(c, a, b);
#endif
}
#endif

#if defined(GT_ASYNC) || defined(ATLAS_EMU)
// ldmatrix.x4 (b16): lane l gives the address of row l % 8 of matrix l / 8 (16 bytes);
// register j of lane l receives word l % 4 of row l / 4 of matrix j. The emulator fetches the
// same words through warp shuffles of the addresses.
ATLAS_DEV void gt_ldsm4(u32* r, const void* row) {
#if defined(GT_ASYNC)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(gt_smem(row)));
#else
    int lane = lane_id();
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const u32* p = (const u32*)atlas_emu_shfl(row, 8 * j + (lane >> 2));
        r[j] = p[lane & 3];
    }
#endif
}
#endif

// A tile row is 64 bf16 = 128 bytes = eight 16-byte chunks, unpadded: 3 x parts and up to 3
// weight parts fill 48 KB, the static shared memory limit. Chunk c of row r is stored at chunk
// c ^ (r & 7), so the eight rows of an MMA fragment load hit 32 different banks.
typedef u16 gm_tile[GM_BK];

ATLAS_DEV u16* gm_at(gm_tile* t, int r, int c) {
    return &t[r][((((c >> 3) ^ r) & 7) << 3) | (c & 7)];
}
ATLAS_DEV const u16* gm_at(const gm_tile* t, int r, int c) {
    return &t[r][((((c >> 3) ^ r) & 7) << 3) | (c & 7)];
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
    } else if (F == FMT_Q6_K) {  // deq32's values, from 16-byte loads of the split rows
        int h = (u & 7) >> 2, k = u & 3;
        const u8* b = row + ROW_BYTES_Q6_K * (u >> 3);
        const atlas_u4* ql = (const atlas_u4*)(b + 64 * h + 32 * (k & 1));
        const atlas_u4* qh = (const atlas_u4*)(b + 128 + 32 * h);
        const i8* sc = (const i8*)(b + 192);
        float d = f16_to_f32(ld_u16(srow + SCALE_BYTES_Q6_K * (u >> 3)));
        int p = q6k_scale(8 * h + 2 * k);  // the second half's scale is at p + 2
        float dsc0 = mul_rn(d, (float)sc[p]), dsc1 = mul_rn(d, (float)sc[p + 2]);
        int lshift = k >= 2 ? 4 : 0;
#pragma unroll
        for (int c = 0; c < 2; c++) {
            atlas_u4 L = ql[c], H = qh[c];
            u32 lw[4] = {L.x, L.y, L.z, L.w}, hw[4] = {H.x, H.y, H.z, H.w};
#pragma unroll
            for (int e = 0; e < 16; e++) {
                u32 lo = (lw[e >> 2] >> (8 * (e & 3) + lshift)) & 15u;
                u32 hi = (hw[e >> 2] >> (8 * (e & 3) + 2 * k)) & 3u;
                v[16 * c + e] = mul_rn(c ? dsc1 : dsc0, (float)((int)(lo | (hi << 4)) - 32));
            }
        }
        return true;
    }
    return false;  // Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (16-byte code units too), Q3_K, Q4_K, Q5_K: deq32
}

struct GmArgs {
    const u8* W;
    const u8* S;
    const float* x;
    int T, rows, cols, units, m0, n0;
    long long row_bytes, srow_bytes;
    bool wvec, xvec;  // 16-byte loads allowed for the weight rows / for x
};

// Unit u (32 values) of weight row r into v, zeros past the matrix; NVFP4 without its global
// scale (the epilogue applies it).
template <int F>
ATLAS_DEV void gm_weight_unit(const GmArgs& a, int r, int u, float* v) {
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
        // unconditional loads (past the row's end, its first element again): no branch
        // per element, so the 32 addresses need not all be live at once
#pragma unroll
        for (int i = 0; i < 32; i++) {
            int c = 32 * u + i;
            float e = deq1<F>(row, c < a.cols ? c : 0);
            v[i] = c < a.cols ? e : 0.0f;
        }
        return;
    }
    deq32<F>(row, srow, 1.0f, u, v);
}

// A block's GmArgs: the weight and its units, this block's tile origin (bm x bn tiles), and x
// where the kernel reads float32 x itself (gemm.cu; nullptr where x arrives otherwise).
template <int F>
ATLAS_DEV GmArgs gm_args(const u8* W, const u8* S, const float* x, int T, int rows, int cols,
                         long long row_bytes, long long srow_bytes, int bm, int bn) {
    const bool plain = F == FMT_F32 || F == FMT_F16 || F == FMT_BF16;
    GmArgs a;
    a.W = W;
    a.S = S;
    a.x = x;
    a.T = T;
    a.rows = rows;
    a.cols = cols;
    a.units = plain ? units_of(cols) : cols / 32;
    gm_tile_origin(T, rows, bm, bn, &a.m0, &a.n0);
    a.row_bytes = row_bytes;
    a.srow_bytes = srow_bytes;
    a.wvec = ((unsigned long long)W & 15ull) == 0 && (row_bytes & 15) == 0;
    a.xvec = ((unsigned long long)x & 15ull) == 0 && (cols & 3) == 0;  // unread without x
    return a;
}

// Where output i (0..31) of thread `tid` sits in a 64-token x 128-row tile (gemm_fast.cu,
// gemm_fp4.cu). The MMA builds: 8 warps as 2 x 4 of 32 tokens x 32 rows, i = 16 ti + 4 n + e
// for m16 tile ti, n8 tile n and C element e (gt_mma's layout); the portable builds: 4
// tokens x 8 rows a thread, i = 8 t + n.
ATLAS_DEV void gt_frag_out(int tid, int i, int* t, int* r) {
    int warp = tid >> 5, lane = tid & 31, e = i & 3;
    *t = 32 * (warp & 1) + 16 * (i >> 4) + (lane >> 2) + 8 * (e >> 1);
    *r = 32 * (warp >> 1) + 8 * ((i >> 2) & 3) + 2 * (lane & 3) + (e & 1);
}
ATLAS_DEV void gt_thread_out(int tid, int i, int* t, int* r) {
    *t = 4 * (tid >> 4) + (i >> 3);
    *r = 8 * (tid & 15) + (i & 7);
}

#if defined(ATLAS_HIP) && defined(__GFX11__)
// WMMA operands: 16 bf16 of one tile row, and the 8 float32 of a C tile per lane.
typedef short gm_v16s __attribute__((ext_vector_type(16)));
typedef float gm_v8f __attribute__((ext_vector_type(8)));
typedef struct __attribute__((aligned(16))) {
    atlas_u4 lo, hi;
} gm_u8x;

// Columns k..k+15 of row r: two 16-byte chunks, each where the swizzle put it.
ATLAS_DEV gm_v16s gm_ld16(const gm_tile* t, int r, int k) {
    gm_u8x v = {*(const atlas_u4*)gm_at(t, r, k), *(const atlas_u4*)gm_at(t, r, k + 8)};
    return __builtin_bit_cast(gm_v16s, v);
}
#endif
