// Prefill attention on tensor cores: attn_prefill_<kv>_hd<HD> (included by attention.cu).
//
// Same contract as attn_<kv>_hd<HD> (causal GQA against the cache, split-K partials for
// attn_combine) for prefill (T >= native_attention.PREFILL_MIN_T new tokens). A block of 4
// warps owns up to 64 query rows of one KV head (row = t * G + g, so a group's heads share every
// K/V tile); each warp owns 16 rows, or for the wide heads 1/DSPLIT of the head dims of 16 rows
// (the DSPLIT warps add their partial scores through shared memory, and the block makes DSPLIT
// passes). Keys are staged KT at a time into shared memory as bf16 pairs (K row-major, V
// transposed, so both are the MMA's "col" operand); fp8 and f32 caches are converted while
// staging. S = Q K^T and O += P V run on 16x16 bf16 MMA
// tiles with float32 accumulation, and the online softmax is float32 in registers.
//
// Precision: bf16 K/V (and fp8, whose 4-bit significands are exact in bf16) are exact
// operands. Q and P are float32; each is split x = hi + lo into two bf16 (hi = bf16(x),
// lo = bf16(x - hi), 16 significant bits together) and both halves are multiplied, so the scores
// and the output keep float32-level accuracy. An f32 cache is split the same way and adds the
// hi*lo cross term (hi*hi + hi*lo + lo*hi). The K scale is folded into q and the V scale into
// the output.
//
// Fragment layouts (one warp of 32 lanes; "pair" = two bf16 packed in a u32, the lower index in
// the low half):
// - NVIDIA mma.sync m16n8k16 (sm_80+): C 16x8, lane (g = lane / 4, c = lane % 4) holds rows
//   g, g + 8 x columns 2c, 2c + 1; A words: rows g / g + 8, k-pairs c / c + 4; B words: column
//   g, k-pairs c, c + 4. P's C fragments are already A fragments (no data movement).
// - AMD WMMA 16x16x16 wave32 (gfx11): C 16x16, lane holds column lane % 16 of rows
//   2e + lane / 16 (e = 0..7); A: row lane % 16, all 8 k-pairs (lanes 16-31 hold the same);
//   B: column lane % 16, all 8 k-pairs. P goes from C to A layout through shared memory.
// The portable build (ATLAS_PORTABLE, other GPUs, the emulator) runs the same kernel and the
// same fragments with the MMA emulated by warp shuffles, float32 products and sums; the
// emulator builds the AMD layout with -DATLAS_EMU_WMMA so the tests cover both.

#if defined(__GFX11__) || defined(ATLAS_EMU_WMMA)
#define TC_AMD 1
#define TC_N 16  // columns of a C fragment
#define TC_CE 8  // C elements per lane
#define TC_AW 8  // u32 words (bf16 pairs) per A fragment
#define TC_BW 8  // ... per B fragment
#define TC_SLOTS 8  // distinct rows per lane
#else
#define TC_AMD 0
#define TC_N 8
#define TC_CE 4
#define TC_AW 4
#define TC_BW 2
#define TC_SLOTS 2
#endif

#if !defined(ATLAS_PORTABLE) && defined(ATLAS_CUDA) && defined(__CUDA_ARCH__) && \
    (__CUDA_ARCH__ >= 800) && !TC_AMD
#define TC_HW_MMA 1  // mma.sync.m16n8k16 bf16
#elif !defined(ATLAS_PORTABLE) && defined(ATLAS_HIP) && defined(__GFX11__)
#define TC_HW_WMMA 1  // v_wmma_f32_16x16x16_bf16
#endif

// Thread and block indices and the barrier. On HIP straight from the compiler builtins (what
// the HIP headers' threadIdx / __syncthreads become once the device libraries are linked), so
// that code generation without those libraries (the ISA tests) inlines them too instead of
// emitting calls that clobber registers.
#define ATTN_PREFILL_THREADS 128
#if defined(ATLAS_HIP)
ATLAS_DEV int attn_tid() { return (int)__builtin_amdgcn_workitem_id_x(); }
ATLAS_DEV int attn_bx() { return (int)__builtin_amdgcn_workgroup_id_x(); }
ATLAS_DEV int attn_by() { return (int)__builtin_amdgcn_workgroup_id_y(); }
ATLAS_DEV int attn_bz() { return (int)__builtin_amdgcn_workgroup_id_z(); }
ATLAS_DEV void attn_sync() {
    __builtin_amdgcn_fence(__ATOMIC_RELEASE, "workgroup");
    __builtin_amdgcn_s_barrier();
    __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "workgroup");
}
#else
ATLAS_DEV int attn_tid() { return (int)threadIdx.x; }
ATLAS_DEV int attn_bx() { return (int)blockIdx.x; }
ATLAS_DEV int attn_by() { return (int)blockIdx.y; }
ATLAS_DEV int attn_bz() { return (int)blockIdx.z; }
ATLAS_DEV void attn_sync() { __syncthreads(); }
#endif
ATLAS_DEV int attn_lane() { return attn_tid() & (ATLAS_WARP - 1); }

#define ATTN_PREFILL_ROWS 64  // query rows per block

// 16- and 8-byte load units (no vector-type header is shared by every compiler here)
struct alignas(16) AttnU4 {
    u32 x, y, z, w;
};
struct alignas(8) AttnU2 {
    u32 x, y;
};

struct TcA {
    u32 w[TC_AW];
};
struct TcB {
    u32 w[TC_BW];
};

// Where this lane's C element e, A word i and B word i sit in their tiles.
ATLAS_DEV int tc_c_row(int lane, int e) {
    return TC_AMD ? 2 * e + (lane >> 4) : (lane >> 2) + 8 * (e >> 1);
}
ATLAS_DEV int tc_c_col(int lane, int e) { return TC_AMD ? (lane & 15) : 2 * (lane & 3) + (e & 1); }
ATLAS_DEV int tc_slot(int e) { return TC_AMD ? e : e >> 1; }  // which of the lane's rows
ATLAS_DEV int tc_a_row(int lane, int i) { return TC_AMD ? (lane & 15) : (lane >> 2) + 8 * (i & 1); }
ATLAS_DEV int tc_a_kp(int lane, int i) { return TC_AMD ? i : (lane & 3) + 4 * (i >> 1); }
ATLAS_DEV int tc_b_col(int lane) { return TC_AMD ? (lane & 15) : (lane >> 2); }
ATLAS_DEV int tc_b_kp(int lane, int i) { return TC_AMD ? i : (lane & 3) + 4 * i; }

ATLAS_DEV u32 pack_bf16(u16 lo, u16 hi) { return (u32)lo | ((u32)hi << 16); }
ATLAS_DEV float bf16_lo(u32 w) { return __uint_as_float(w << 16); }
ATLAS_DEV float bf16_hi(u32 w) { return __uint_as_float(w & 0xffff0000u); }

// float32 -> bf16 round to nearest even, as f32_to_bf16 but with a select for NaN instead of
// a branch (it runs for every Q, P and f32-cache element).
ATLAS_DEV u16 bf16_rn(float f) {
    u32 u = __float_as_uint(f);
    u32 r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (u16)((u & 0x7fffffffu) > 0x7f800000u ? ((u >> 16) | 0x40u) : r);
}

// x = hi + lo, both bf16 (hi rounded to nearest, lo the rounded remainder).
ATLAS_DEV void split_bf16(float x, u16* hi, u16* lo) {
    *hi = bf16_rn(x);
    *lo = bf16_rn(x - bf16_to_f32(*hi));
}

ATLAS_DEV u32 warp_read_u32(u32 v, int src) {
    return __float_as_uint(warp_bcast(__uint_as_float(v), src));
}

// c (16 x TC_N) += a (16 x 16) * b (16 x TC_N), bf16 operands, float32 accumulation.
ATLAS_DEV void tc_mma(float* c, const TcA& a, const TcB& b) {
#if defined(TC_HW_MMA)
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a.w[0]), "r"(a.w[1]), "r"(a.w[2]), "r"(a.w[3]), "r"(b.w[0]), "r"(b.w[1]));
#elif defined(TC_HW_WMMA)
    typedef short v16s __attribute__((ext_vector_type(16)));
    typedef u32 v8u __attribute__((ext_vector_type(8)));
    typedef float v8f __attribute__((ext_vector_type(8)));
    v8u aw, bw;
    v8f cv;
#pragma unroll
    for (int i = 0; i < 8; i++) aw[i] = a.w[i], bw[i] = b.w[i], cv[i] = c[i];
    cv = __builtin_amdgcn_wmma_f32_16x16x16_bf16_w32(__builtin_bit_cast(v16s, aw),
                                                     __builtin_bit_cast(v16s, bw), cv);
#pragma unroll
    for (int i = 0; i < 8; i++) c[i] = cv[i];
#else
    // The MMA's definition on the same fragments: every lane fetches the A row and B column
    // of each of its C elements from the lanes that hold them (the word index is the same on
    // every lane, so one shuffle per word serves the warp).
    // (not unrolled: the reference build's compile time stays small)
    int lane = attn_lane();
#pragma unroll 1
    for (int kp = 0; kp < 8; kp++) {
#pragma unroll 1
        for (int e = 0; e < TC_CE; e++) {
            int r = tc_c_row(lane, e), n = tc_c_col(lane, e);
            u32 aw, bw;
            if (TC_AMD) {
                aw = warp_read_u32(a.w[kp], r);
                bw = b.w[kp];  // this lane holds column lane % 16
            } else {
                aw = warp_read_u32(a.w[(r >> 3) + 2 * (kp >> 2)], (r & 7) * 4 + (kp & 3));
                bw = warp_read_u32(b.w[kp >> 2], n * 4 + (kp & 3));
            }
            c[e] = fmaf(bf16_lo(aw), bf16_lo(bw), c[e]);
            c[e] = fmaf(bf16_hi(aw), bf16_hi(bw), c[e]);
        }
    }
#endif
}

// B fragment of columns col0.. from a shared word array [column][stride], k-pairs kp0..kp0+7.
ATLAS_DEV void tc_load_b(TcB& b, const u32* base, int stride, int col0, int kp0, int lane) {
    const u32* p = base + (col0 + tc_b_col(lane)) * stride + kp0;
#pragma unroll
    for (int i = 0; i < TC_BW; i++) b.w[i] = p[tc_b_kp(lane, i)];
}

// Two e4m3 codes (low byte = lower index) as a bf16 pair: e4m3 values have 4 significant bits,
// exact in bf16. sm_89+ converts both in one instruction (to f16x2; f16 -> f32 is exact).
ATLAS_DEV u32 e4m3x2_to_bf16x2(u32 two) {
#if defined(ATLAS_CUDA) && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 890) && !defined(ATLAS_PORTABLE)
    unsigned int h2;
    unsigned short in = (unsigned short)two;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(in));
    return pack_bf16(bf16_rn(f16_to_f32((u16)(h2 & 0xffffu))),
                     bf16_rn(f16_to_f32((u16)(h2 >> 16))));
#else
    return pack_bf16(bf16_rn(e4m3_to_f32_portable((u8)two)),
                     bf16_rn(e4m3_to_f32_portable((u8)(two >> 8))));
#endif
}

// Eight consecutive cache elements at idx (a multiple of 8) as four bf16 pairs, hi and lo parts
// (lo only for an f32 cache). bf16: one 16-byte load; fp8: 8 bytes; f32: 2 x 16 bytes.
template <int KV>
ATLAS_DEV void stage8(const void* __restrict__ c, long long idx, u32* hi, u32* lo) {
    if (KV == KV_BF16) {
        const AttnU4 v = *(const AttnU4*)((const u16*)c + idx);
        hi[0] = v.x, hi[1] = v.y, hi[2] = v.z, hi[3] = v.w;
    } else if (KV == KV_FP8) {
        const AttnU2 v = *(const AttnU2*)((const u8*)c + idx);
        hi[0] = e4m3x2_to_bf16x2(v.x), hi[1] = e4m3x2_to_bf16x2(v.x >> 16);
        hi[2] = e4m3x2_to_bf16x2(v.y), hi[3] = e4m3x2_to_bf16x2(v.y >> 16);
    } else {
        const AttnU4* f = (const AttnU4*)((const float*)c + idx);
        AttnU4 v0 = f[0], v1 = f[1];
        u32 bits[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
        float x[8];
#pragma unroll
        for (int i = 0; i < 8; i++) x[i] = __uint_as_float(bits[i]);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            u16 h0, l0, h1, l1;
            split_bf16(x[2 * i], &h0, &l0);
            split_bf16(x[2 * i + 1], &h1, &l1);
            hi[i] = pack_bf16(h0, h1);
            lo[i] = pack_bf16(l0, l1);
        }
    }
}

template <int HD, int KV>
struct PrefillShape {
    static const int PARTS = KV == KV_F32 ? 2 : 1;  // bf16 parts per staged element
    // warps sharing 16 rows, each multiplying HD / DSPLIT dims (registers: the Q fragments and
    // the output accumulators of 16 rows x HDW stay under the budget without spilling)
    static const int DSPLIT = TC_AMD ? (HD >= 256 ? 4 : (HD >= 64 ? 2 : 1)) : (HD >= 256 ? 2 : 1);
    static const int HDW = HD / DSPLIT;  // head dims per warp
    static const int KT = TC_AMD ? (PARTS * HD <= 128 ? 32 : 16)
                                 : (PARTS * HD <= 128 ? 64 : (PARTS * HD <= 256 ? 32 : 16));
    static const int KSTR = HD / 2 + 4;  // words per staged key (+4: conflict-free B loads)
    static const int VSTR = KT / 2 + 4;  // words per staged value dim
    static const int NJ = KT / TC_N;     // C fragments per score tile
    static const int NO = HDW / TC_N;    // C fragments of the output
    static const int BM = 16 * 4 / DSPLIT;  // query rows per pass (a block makes DSPLIT passes)
};

// Stage keys k0..k0+KT-1 (zeros past k_end): K as [key][d] pairs, V as [d][key] pairs.
template <int HD, int KV>
ATLAS_DEV void stage_kv(const void* __restrict__ kc, const void* __restrict__ vc, int hk, int cap,
                        int k0, int k_end, u32* ks, u32* vt) {
    typedef PrefillShape<HD, KV> S;
    const int KT = S::KT, KSTR = S::KSTR, VSTR = S::VSTR;
    // K: one (key, 8 dims) chunk per step
#pragma unroll 1
    for (int e = attn_tid(); e < KT * (HD / 8); e += ATTN_PREFILL_THREADS) {
        int j = e / (HD / 8), d = (e % (HD / 8)) * 8;
        u32 hi[4] = {0, 0, 0, 0}, lo[4] = {0, 0, 0, 0};
        if (k0 + j < k_end) stage8<KV>(kc, ((long long)hk * cap + k0 + j) * HD + d, hi, lo);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            ks[j * KSTR + d / 2 + i] = hi[i];
            if (S::PARTS == 2) ks[KT * KSTR + j * KSTR + d / 2 + i] = lo[i];
        }
    }
    // V transposed: one (key pair, 8 dims) chunk per step
#pragma unroll 1
    for (int e = attn_tid(); e < (KT / 2) * (HD / 8); e += ATTN_PREFILL_THREADS) {
        int p = e % (KT / 2), d = (e / (KT / 2)) * 8;
        u32 h0[4] = {0, 0, 0, 0}, l0[4] = {0, 0, 0, 0}, h1[4] = {0, 0, 0, 0}, l1[4] = {0, 0, 0, 0};
        int ka = k0 + 2 * p;
        if (ka < k_end) stage8<KV>(vc, ((long long)hk * cap + ka) * HD + d, h0, l0);
        if (ka + 1 < k_end) stage8<KV>(vc, ((long long)hk * cap + ka + 1) * HD + d, h1, l1);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            int sh = (i & 1) * 16;
            // dim d+i of keys ka (low half) and ka + 1 (high half)
            vt[(d + i) * VSTR + p] =
                ((h0[i / 2] >> sh) & 0xffffu) | (((h1[i / 2] >> sh) & 0xffffu) << 16);
            if (S::PARTS == 2)
                vt[HD * VSTR + (d + i) * VSTR + p] =
                    ((l0[i / 2] >> sh) & 0xffffu) | (((l1[i / 2] >> sh) & 0xffffu) << 16);
        }
    }
}

// P (this warp's score tile after the softmax, C layout) -> the A fragments (hi, lo) of keys
// 16 kk .. 16 kk + 15. `ps` is this warp's 16 x 16 float scratch (AMD only).
template <int NJ>
ATLAS_DEV void p_to_a(const float (&p)[NJ][TC_CE], int kk, TcA& ah, TcA& al, float* ps, int lane) {
#if TC_AMD
    // 16 keys = one C fragment; C -> A is a transpose of lanes: through shared memory
    attn_sync();  // the previous step's reads of ps are done (every warp runs this loop)
#pragma unroll
    for (int e = 0; e < TC_CE; e++) ps[tc_c_row(lane, e) * TC_N + tc_c_col(lane, e)] = p[kk][e];
    attn_sync();
#pragma unroll
    for (int i = 0; i < TC_AW; i++) {
        int r = tc_a_row(lane, i), kp = tc_a_kp(lane, i);
        u16 h0, l0, h1, l1;
        split_bf16(ps[r * TC_N + 2 * kp], &h0, &l0);
        split_bf16(ps[r * TC_N + 2 * kp + 1], &h1, &l1);
        ah.w[i] = pack_bf16(h0, h1);
        al.w[i] = pack_bf16(l0, l1);
    }
#else
    (void)ps, (void)lane;
    // A word i: rows g (+8 for odd i), k-pairs c (+4 for i >= 2) = C fragment 2kk + i/2,
    // elements 2 (i & 1), 2 (i & 1) + 1
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float* c = p[2 * kk + (i >> 1)];
        u16 h0, l0, h1, l1;
        split_bf16(c[2 * (i & 1)], &h0, &l0);
        split_bf16(c[2 * (i & 1) + 1], &h1, &l1);
        ah.w[i] = pack_bf16(h0, h1);
        al.w[i] = pack_bf16(l0, l1);
    }
#endif
}

// Max / sum over the lanes that hold the same rows (NVIDIA: the 4 lanes of a group; AMD: the
// 16 lanes of a half-wave).
ATLAS_DEV float row_max(float v) {
#pragma unroll
    for (int o = 1; o < (TC_AMD ? 16 : 4); o <<= 1) v = fmaxf(v, warp_xor(v, o));
    return v;
}
ATLAS_DEV float row_sum(float v) {
#pragma unroll
    for (int o = 1; o < (TC_AMD ? 16 : 4); o <<= 1) v += warp_xor(v, o);
    return v;
}

// One pass of a block: rows block_row0 .. + BM, this warp's 16 from row0, dims dbase.. .
template <int HD, int KV>
ATLAS_DEV void prefill_pass(const float* __restrict__ q, const void* __restrict__ kc,
                            const void* __restrict__ vc, float kscale, float vscale,
                            float* __restrict__ out, float* __restrict__ part_o,
                            float* __restrict__ part_ml, int T, int nh, int G, int hk, int cap,
                            int start, int split_len, int block_row0, int row0, int half,
                            int dbase, u32* ks, u32* vt, float* xs) {
    typedef PrefillShape<HD, KV> S;
    const int KT = S::KT, NJ = S::NJ, NO = S::NO, KS = S::HDW / 16;
    float* sx = xs;
    float* ps = xs;
    int lane = attn_lane(), w = attn_tid() / ATLAS_WARP, rows = T * G;

    // Q (scaled by the K scale and 1/sqrt(hd)) as hi/lo A fragments, kept in registers
    float qscale = kscale / sqrtf((float)HD);
    // rows past the end read the last row (no branch, one base pointer per row) and use zeros
    TcA qh[KS], ql[KS];
    const float* qrow[2];
    bool qok[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        int r = row0 + tc_a_row(lane, i);
        qok[i] = r < rows;
        r = min(r, rows - 1);
        qrow[i] = q + ((long long)(r / G) * nh + hk * G + r % G) * HD + dbase;
    }
#pragma unroll
    for (int kk = 0; kk < KS; kk++) {
#pragma unroll
        for (int i = 0; i < TC_AW; i++) {
            const float* src = qrow[i & 1] + 2 * (kk * 8 + tc_a_kp(lane, i));
            float x0 = qok[i & 1] ? src[0] * qscale : 0.0f;
            float x1 = qok[i & 1] ? src[1] * qscale : 0.0f;
            u16 h0, l0, h1, l1;
            split_bf16(x0, &h0, &l0);
            split_bf16(x1, &h1, &l1);
            qh[kk].w[i] = pack_bf16(h0, h1);
            ql[kk].w[i] = pack_bf16(l0, l1);
        }
    }
    int qpos[TC_SLOTS];  // the last key each of this lane's rows sees (-1: no such row)
    float m[TC_SLOTS], l[TC_SLOTS], o[NO][TC_CE];
#pragma unroll
    for (int e = 0; e < TC_CE; e++) {
        int r = row0 + tc_c_row(lane, e);
        qpos[tc_slot(e)] = r < rows ? start + r / G : -1;
        m[tc_slot(e)] = -atlas_inf();
        l[tc_slot(e)] = 0.0f;
    }
#pragma unroll
    for (int n = 0; n < NO; n++)
#pragma unroll
        for (int e = 0; e < TC_CE; e++) o[n][e] = 0.0f;

    int last_row = min(block_row0 + S::BM, rows) - 1;
    int k_begin = attn_bz() * split_len;
    int k_end = min(k_begin + split_len, start + last_row / G + 1);  // block-uniform
    int warp_last = start + (min(row0 + 15, rows - 1)) / G;         // this warp's last key
    for (int k0 = k_begin; k0 < k_end; k0 += KT) {
        attn_sync();  // the previous tile is consumed
        stage_kv<HD, KV>(kc, vc, hk, cap, k0, k_end, ks, vt);
        attn_sync();
        // a warp whose rows see none of these keys skips them (only where no barrier follows)
        if (S::DSPLIT == 1 && !TC_AMD && k0 > warp_last) continue;
        float s[NJ][TC_CE];
#pragma unroll
        for (int j = 0; j < NJ; j++) {
#pragma unroll
            for (int e = 0; e < TC_CE; e++) s[j][e] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < KS; kk++) {
                TcB b;
                tc_load_b(b, ks, S::KSTR, j * TC_N, dbase / 2 + kk * 8, lane);
                tc_mma(s[j], qh[kk], b);
                tc_mma(s[j], ql[kk], b);
                if (S::PARTS == 2) {
                    tc_load_b(b, ks + KT * S::KSTR, S::KSTR, j * TC_N, dbase / 2 + kk * 8, lane);
                    tc_mma(s[j], qh[kk], b);
                }
            }
        }
        if (S::DSPLIT > 1) {  // the full dot products: the DSPLIT partial sums, in one order
            // one base pointer and constant offsets (loop-invariant addresses would be hoisted
            // into registers, 64 of them at DSPLIT 4)
            float* mine = sx + w * (NJ * TC_CE * ATLAS_WARP) + lane;
            const float* group = sx + (w - half) * (NJ * TC_CE * ATLAS_WARP) + lane;
#pragma unroll
            for (int j = 0; j < NJ; j++)
#pragma unroll
                for (int e = 0; e < TC_CE; e++) mine[(j * TC_CE + e) * ATLAS_WARP] = s[j][e];
            attn_sync();
#pragma unroll
            for (int j = 0; j < NJ; j++)
#pragma unroll
                for (int e = 0; e < TC_CE; e++) {
                    float sum = 0.0f;
#pragma unroll
                    for (int d = 0; d < S::DSPLIT; d++)
                        sum += group[((d * NJ + j) * TC_CE + e) * ATLAS_WARP];
                    s[j][e] = sum;
                }
        }
        // online softmax, float32: mask, new row maxima, rescale, probabilities
        float mt[TC_SLOTS], alpha[TC_SLOTS];
#pragma unroll
        for (int r = 0; r < TC_SLOTS; r++) mt[r] = -atlas_inf();
#pragma unroll
        for (int j = 0; j < NJ; j++)
#pragma unroll
            for (int e = 0; e < TC_CE; e++) {
                int key = k0 + j * TC_N + tc_c_col(lane, e);
                bool seen = key < k_end && key <= qpos[tc_slot(e)];
                s[j][e] = seen ? s[j][e] : -atlas_inf();
                mt[tc_slot(e)] = fmaxf(mt[tc_slot(e)], s[j][e]);
            }
#pragma unroll
        for (int r = 0; r < TC_SLOTS; r++) {
            float mn = fmaxf(m[r], row_max(mt[r]));
            alpha[r] = mn == -atlas_inf() ? 1.0f : expf(m[r] - mn);
            m[r] = mn;
            l[r] *= alpha[r];
        }
#pragma unroll
        for (int j = 0; j < NJ; j++)
#pragma unroll
            for (int e = 0; e < TC_CE; e++) {
                float mr = m[tc_slot(e)];
                float p = mr == -atlas_inf() ? 0.0f : expf(s[j][e] - mr);
                s[j][e] = p;
                l[tc_slot(e)] += p;
            }
#pragma unroll
        for (int n = 0; n < NO; n++)
#pragma unroll
            for (int e = 0; e < TC_CE; e++) o[n][e] *= alpha[tc_slot(e)];
        // O += P V over the tile, 16 keys per step
#pragma unroll
        for (int kk = 0; kk < KT / 16; kk++) {
            TcA ah, al;
            p_to_a<NJ>(s, kk, ah, al, ps + w * 16 * 16, lane);
#pragma unroll
            for (int n = 0; n < NO; n++) {
                TcB b;
                tc_load_b(b, vt, S::VSTR, dbase + n * TC_N, kk * 8, lane);
                tc_mma(o[n], ah, b);
                tc_mma(o[n], al, b);
                if (S::PARTS == 2) {
                    tc_load_b(b, vt + HD * S::VSTR, S::VSTR, dbase + n * TC_N, kk * 8, lane);
                    tc_mma(o[n], ah, b);
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < TC_SLOTS; r++) l[r] = row_sum(l[r]);
    bool split = part_o != out;  // the launcher passes out for both when nsplit == 1
#pragma unroll
    for (int e = 0; e < TC_CE; e++) {
        int r = row0 + tc_c_row(lane, e);
        if (r >= rows) continue;
        int t = r / G, head = hk * G + r % G;
        long long base = ((long long)t * nh + head) * HD + dbase + tc_c_col(lane, e);
        float sl = l[tc_slot(e)];
        float f = split ? vscale : (sl > 0.0f ? vscale / sl : 0.0f);
        float* dst = split ? part_o + (long long)attn_bz() * T * nh * HD : out;
#pragma unroll
        for (int n = 0; n < NO; n++) dst[base + n * TC_N] = o[n][e] * f;
        if (split && half == 0 && tc_c_col(lane, e) == 0) {
            long long mb = ((long long)attn_bz() * T * nh + (long long)t * nh + head) * 2;
            part_ml[mb] = m[tc_slot(e)];
            part_ml[mb + 1] = sl;
        }
    }
}

template <int HD, int KV>
ATLAS_DEV void attn_prefill_body(const float* __restrict__ q, const void* __restrict__ kc,
                                 const void* __restrict__ vc, float kscale, float vscale,
                                 float* __restrict__ out, float* __restrict__ part_o,
                                 float* __restrict__ part_ml, int T, int nh, int nkv, int cap,
                                 int start, const i32* start_ptr, int split_len) {
    typedef PrefillShape<HD, KV> S;
    const int KT = S::KT, NJ = S::NJ;
    __shared__ u32 ks[S::PARTS * KT * S::KSTR];
    __shared__ u32 vt[S::PARTS * HD * S::VSTR];
    // the partner warps' partial scores (DSPLIT > 1), then on AMD each warp's P for its C -> A
    // transpose: one buffer, since a barrier separates the last read of one from the other
    const int XS = S::DSPLIT > 1 ? 4 * NJ * TC_CE * ATLAS_WARP : 1;
    const int PS = TC_AMD ? 4 * 16 * 16 : 1;
    __shared__ float xs[XS > PS ? XS : PS];
    if (start_ptr) start = *start_ptr;
    int w = attn_tid() / ATLAS_WARP;
    int G = nh / nkv, hk = attn_by(), rows = T * G;
    int half = w % S::DSPLIT;  // which head dims this warp multiplies
    int dbase = half * S::HDW;
#pragma unroll 1
    for (int pass = 0; pass < S::DSPLIT; pass++) {
        int block_row0 = attn_bx() * ATTN_PREFILL_ROWS + pass * S::BM;
        if (block_row0 >= rows) return;  // block-uniform
        int row0 = block_row0 + (w / S::DSPLIT) * 16;  // this warp's first row
        prefill_pass<HD, KV>(q, kc, vc, kscale, vscale, out, part_o, part_ml, T, nh, G, hk,
                             cap, start, split_len, block_row0, row0, half, dbase, ks, vt, xs);
    }
}
