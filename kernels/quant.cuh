// quant.cuh: weight formats, dequantized 32 elements ("a unit") at a time, in registers.
//
// A weight is `rows` rows of `cols` elements, each row `row_bytes` bytes (block formats store
// whole blocks per row, as GGUF does), and a second buffer of `srow_bytes` per row. NVFP4 keeps
// its E4M3 block scales there (`cols/16` bytes per row) plus one float32 global scale. Q4_0,
// Q4_1, Q8_0 and Q6_K keep each block's f16 scale(s) there too (d; d, m for Q4_1); the rest of
// the block stays in the row in GGUF's order, but for Q6_K's 16 int8 scales (reordered: see
// q6k_scale; backend/formats.py split_blocks), so the codes are 16-byte units (16, 16, 32,
// 208 bytes per block) that the GEMV loads straight from the row. Q5_0 and Q5_1 keep their
// scale(s) and qh word there (6, 8 bytes) and 16 code bytes in the row, in Q5_K's device bit
// layout (q5_codes4). Q3_K keeps its 12 scale bytes and d there (14 bytes), its 96 bytes of
// low bits and hmask in the row in a bit layout of its own (formats.q3_k_device). IQ4_NL and
// IQ4_XS keep d (and IQ4_XS's scales: 8 bytes) there, 16 reordered code bytes per 32 elements
// in the row (formats._iq4_codes). Every format is dequantized with the same float32
// operations, in the same order, as the numpy reference (loaders/quant.py for GGUF, loaders'
// NVFP4 dequantize for NVFP4), so that dequantization is bit-exact.
// Block layouts: docs/formats.md. Each format's facts are registered in backend/formats.py;
// tests/test_formats.py checks that the FMT_ list and the BLOCK_ sizes below agree with it.
#pragma once
#include "atlas_common.cuh"

#define FMT_F32 0
#define FMT_F16 1
#define FMT_BF16 2
#define FMT_Q4_0 3
#define FMT_Q4_1 4
#define FMT_Q8_0 5
#define FMT_Q4_K 6
#define FMT_Q5_K 7
#define FMT_Q6_K 8
#define FMT_NVFP4 9
#define FMT_Q5_0 10
#define FMT_Q5_1 11
#define FMT_Q3_K 12
#define FMT_IQ4_NL 13
#define FMT_IQ4_XS 14

// Elements and bytes of one block as stored (NVFP4: 16 codes in 8 bytes; the block's E4M3
// scale is one byte of the second buffer; the GGUF formats with a SCALE_BYTES: that many of
// them there: the f16 scales, Q5_0's and Q5_1's qh word, Q3_K's and IQ4_XS's 6-bit scales).
// A unit of 32 elements is one Q4_0/Q4_1/Q8_0 block, an eighth of a K-quant block, two NVFP4
// blocks.
#define BLOCK_ELEMS_F32 1
#define BLOCK_BYTES_F32 4
#define BLOCK_ELEMS_F16 1
#define BLOCK_BYTES_F16 2
#define BLOCK_ELEMS_BF16 1
#define BLOCK_BYTES_BF16 2
#define BLOCK_ELEMS_Q4_0 32
#define BLOCK_BYTES_Q4_0 18
#define BLOCK_ELEMS_Q4_1 32
#define BLOCK_BYTES_Q4_1 20
#define BLOCK_ELEMS_Q8_0 32
#define BLOCK_BYTES_Q8_0 34
#define BLOCK_ELEMS_Q4_K 256
#define BLOCK_BYTES_Q4_K 144
#define BLOCK_ELEMS_Q5_K 256
#define BLOCK_BYTES_Q5_K 176
#define BLOCK_ELEMS_Q6_K 256
#define BLOCK_BYTES_Q6_K 210
#define BLOCK_ELEMS_NVFP4 16
#define BLOCK_BYTES_NVFP4 8
#define BLOCK_ELEMS_Q5_0 32
#define BLOCK_BYTES_Q5_0 22
#define BLOCK_ELEMS_Q5_1 32
#define BLOCK_BYTES_Q5_1 24
#define BLOCK_ELEMS_Q3_K 256
#define BLOCK_BYTES_Q3_K 110
#define BLOCK_ELEMS_IQ4_NL 32
#define BLOCK_BYTES_IQ4_NL 18
#define BLOCK_ELEMS_IQ4_XS 256
#define BLOCK_BYTES_IQ4_XS 136
#define SCALE_BYTES_Q4_0 2
#define SCALE_BYTES_Q4_1 4
#define SCALE_BYTES_Q8_0 2
#define SCALE_BYTES_Q5_0 6
#define SCALE_BYTES_Q5_1 8
#define SCALE_BYTES_Q6_K 2
#define SCALE_BYTES_Q3_K 14
#define SCALE_BYTES_IQ4_NL 2
#define SCALE_BYTES_IQ4_XS 8
#define ROW_BYTES_Q6_K (BLOCK_BYTES_Q6_K - SCALE_BYTES_Q6_K)  // 208: ql, qh, scales
#define ROW_BYTES_Q3_K (BLOCK_BYTES_Q3_K - SCALE_BYTES_Q3_K)  // 96: low bits, hmask

// X(name, FMT_ID) for every format: used to stamp out one extern "C" entry point per format.
#define ATLAS_FOR_EACH_FORMAT(X) \
    X(f32, FMT_F32)              \
    X(f16, FMT_F16)              \
    X(bf16, FMT_BF16)            \
    X(q4_0, FMT_Q4_0)            \
    X(q4_1, FMT_Q4_1)            \
    X(q8_0, FMT_Q8_0)            \
    X(q4_k, FMT_Q4_K)            \
    X(q5_k, FMT_Q5_K)            \
    X(q6_k, FMT_Q6_K)            \
    X(nvfp4, FMT_NVFP4)          \
    X(q5_0, FMT_Q5_0)            \
    X(q5_1, FMT_Q5_1)            \
    X(q3_k, FMT_Q3_K)            \
    X(iq4_nl, FMT_IQ4_NL)        \
    X(iq4_xs, FMT_IQ4_XS)

ATLAS_DEV u16 ld_u16(const u8* p) { return (u16)(p[0] | (p[1] << 8)); }
ATLAS_DEV u32 ld_u32(const u8* p) { return (u32)ld_u16(p) | ((u32)ld_u16(p + 2) << 16); }

// K-quant 6-bit scale and min of sub-block j (ggml get_scale_min_k4).
ATLAS_DEV void k_scale_min(const u8* s, int j, u32* sc, u32* m) {
    if (j < 4) {
        *sc = s[j] & 63u;
        *m = s[j + 4] & 63u;
    } else {
        *sc = (s[j + 4] & 15u) | ((u32)(s[j - 4] >> 6) << 4);
        *m = (u32)(s[j + 4] >> 4) | ((u32)(s[j] >> 6) << 4);
    }
}

// Where Q6_K's int8 scale i (of 16 elements) is among the block's 16 on the device: the two a
// GEMV lane needs, i and i + 4 (i = 8h + 2k + j, k < 2), are adjacent, at 2 (4h + 2k + j).
ATLAS_DEV int q6k_scale(int i) { return 2 * (4 * (i >> 3) + (i & 3)) + ((i >> 2) & 1); }

// Four 5-bit codes of half A (odd = 0) or B (odd = 1) from a code word of the device layout of
// Q5_K, Q5_0 and Q5_1 (formats._q5_words): the word holds, rotated left by 1, the bytes (A >> 1)
// | (B & 15) << 4 of 4 elements, and bits p, p + 1 of the 4 bytes of `h` hold A's lowest bit
// and B's fifth bit (the latter one byte further on, so that the decode's bit selects line up:
// gemv.cuh gv_q5_word).
ATLAS_DEV void q5_codes4(u32 word, u32 h, int p, int odd, u32* q) {
    u32 w = rotr32(word, 1);
#pragma unroll
    for (int jj = 0; jj < 4; jj++) {
        u32 byte = w >> (8 * jj);
        if (!odd) q[jj] = ((byte & 15u) << 1) | ((h >> (8 * jj + p)) & 1u);
        else q[jj] = ((byte >> 4) & 15u) | (((h >> (8 * ((jj + 1) & 3) + p + 1)) & 1u) << 4);
    }
}

// Elements 4g .. 4g + 3 of sub-block j of a Q5_K block in the device layout
// (formats.q5_k_device): pair p = j / 2 keeps one code word per group of 4 elements, its extra
// bits in bits 2p and 2p + 1 of the group's 4 qh bytes.
ATLAS_DEV void q5k_codes4(const u8* b, int j, int g, u32* q) {
    int p = j >> 1;
    q5_codes4(ld_u32(b + 48 + 32 * p + 4 * g), ld_u32(b + 16 + 4 * g), 2 * p, j & 1, q);
}

// The 6-bit scales (minus 32) of Q3_K sub-blocks 2s and 2s + 1 (16 elements each; GGUF order)
// from the block's 12 scale bytes: their low nibbles are nibble s / 4 of bytes 2 (s % 4) and
// 2 (s % 4) + 1 (`lo`, those two bytes), their high 2 bits bits 2 (s / 2) of bytes 8 + 2 (s % 2)
// and 9 + 2 (s % 2) (`hi`).
ATLAS_DEV void q3k_scales(u32 lo, u32 hi, int s, int* a, int* b) {
    u32 sc = ((lo >> (4 * (s >> 2))) & 0x0F0Fu) | (((hi >> (2 * (s >> 1))) & 0x0303u) << 4);
    *a = (int)(sc & 0xffu) - 32;
    *b = (int)((sc >> 8) & 0xffu) - 32;
}

// Where the scale bytes of q3k_scales are among the 14 of a Q3_K block's second buffer (12
// scale bytes, d), as u16 indices: lo, hi.
ATLAS_DEV int q3k_lo(int s) { return s & 3; }
ATLAS_DEV int q3k_hi(int s) { return 4 + (s & 1); }

// IQ4_NL / IQ4_XS: a 4-bit code q stands for ggml's kvalues_iq4nl[q], int8 -127..113; here
// those plus 128 (1..241) as bytes, q = 0..3, 4..7, 8..11, 12..15: IQ4_LO0, IQ4_LO1, IQ4_HI0,
// IQ4_HI1. The first 8 are below 128, which the GEMV's byte permutes rely on (gv_iq4_word).
#define IQ4_LO0 0x3F2D1801u
#define IQ4_LO1 0x766A5D4Fu
#define IQ4_HI0 0xA6998D81u
#define IQ4_HI1 0xF1D9C5B5u

// The IQ4 value of code q (0..15), exactly.
ATLAS_DEV float iq4_value(u32 q) {
    u32 w = q & 8u ? (q & 4u ? IQ4_HI1 : IQ4_HI0) : (q & 4u ? IQ4_LO1 : IQ4_LO0);
    return (float)((int)((w >> (8 * (q & 3u))) & 0xffu) - 128);
}

// The 6-bit scale (minus 32) of IQ4_XS sub-block j from the block's scales_h (u16) and
// scales_l (4 bytes, as a u32): nibble j of scales_l, bits 2j, 2j + 1 of scales_h.
ATLAS_DEV int iq4xs_scale(u32 sh, u32 sl, int j) {
    return (int)(((sl >> (4 * j)) & 15u) | (((sh >> (2 * j)) & 3u) << 4)) - 32;
}

// Elements [32u, 32u+32) of one row into v[0..31].
template <int F>
ATLAS_DEV void deq32(const u8* __restrict__ row, const u8* __restrict__ srow, float gs, int u,
                     float* v) {
    if (F == FMT_F32) {
        const float* p = (const float*)row + 32 * u;
#pragma unroll
        for (int i = 0; i < 32; i++) v[i] = p[i];
    } else if (F == FMT_F16) {
        const u16* p = (const u16*)row + 32 * u;
#pragma unroll
        for (int i = 0; i < 32; i++) v[i] = f16_to_f32(p[i]);
    } else if (F == FMT_BF16) {
        const u16* p = (const u16*)row + 32 * u;
#pragma unroll
        for (int i = 0; i < 32; i++) v[i] = bf16_to_f32(p[i]);
    } else if (F == FMT_Q4_0) {
        float d = f16_to_f32(ld_u16(srow + SCALE_BYTES_Q4_0 * u));
        const u8* qs = row + 16 * u;
#pragma unroll
        for (int j = 0; j < 16; j++) {
            v[j] = mul_rn(d, (float)((int)(qs[j] & 15) - 8));
            v[j + 16] = mul_rn(d, (float)((int)(qs[j] >> 4) - 8));
        }
    } else if (F == FMT_Q4_1) {
        const u8* sc = srow + SCALE_BYTES_Q4_1 * u;
        float d = f16_to_f32(ld_u16(sc));
        float m = f16_to_f32(ld_u16(sc + 2));
        const u8* qs = row + 16 * u;
#pragma unroll
        for (int j = 0; j < 16; j++) {
            v[j] = add_rn(mul_rn(d, (float)(qs[j] & 15)), m);
            v[j + 16] = add_rn(mul_rn(d, (float)(qs[j] >> 4)), m);
        }
    } else if (F == FMT_Q5_0 || F == FMT_Q5_1) {
        // the device layout (formats.q5_0_device): group k's 4 code words in word k of the
        // unit's 16 bytes, their extra bits in bits 2k, 2k + 1 of the qh word
        const u8* sc = srow + (F == FMT_Q5_0 ? SCALE_BYTES_Q5_0 : SCALE_BYTES_Q5_1) * u;
        float d = f16_to_f32(ld_u16(sc));
        float m = F == FMT_Q5_1 ? f16_to_f32(ld_u16(sc + 2)) : 0.0f;
        u32 h = ld_u32(sc + (F == FMT_Q5_0 ? 2 : 4));
        const u8* qs = row + 16 * u;
#pragma unroll
        for (int k = 0; k < 4; k++) {
#pragma unroll
            for (int odd = 0; odd < 2; odd++) {
                u32 q[4];
                q5_codes4(ld_u32(qs + 4 * k), h, 2 * k, odd, q);
#pragma unroll
                for (int jj = 0; jj < 4; jj++) {
                    float* o = &v[16 * odd + 4 * k + jj];
                    if (F == FMT_Q5_0) *o = mul_rn(d, (float)((int)q[jj] - 16));
                    else *o = add_rn(mul_rn(d, (float)q[jj]), m);
                }
            }
        }
    } else if (F == FMT_Q3_K) {
        // the device layout (formats.q3_k_device): the unit is lane s of the block's 8
        int s = u & 7, e = s & 1, r = (s >> 1) & 1;
        const u8* b = row + ROW_BYTES_Q3_K * (u >> 3);
        const u8* sc = srow + SCALE_BYTES_Q3_K * (u >> 3);
        float d = f16_to_f32(ld_u16(sc + 12));
        int a, bb;
        q3k_scales(ld_u16(sc + 2 * q3k_lo(s)), ld_u16(sc + 2 * q3k_hi(s)), s, &a, &bb);
        float dsc[2] = {mul_rn(d, (float)a), mul_rn(d, (float)bb)};
#pragma unroll
        for (int k = 0; k < 4; k++) {
            u32 c = rotr32(ld_u32(b + 16 * (s >> 1) + 4 * k), r);
            u32 h = rotr32(ld_u32(b + 64 + 16 * (s >> 2) + 4 * k), r);
#pragma unroll
            for (int half = 0; half < 2; half++) {
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    int f = 2 * e + 4 * half;  // the 2-bit field's bit in byte j
                    u32 lo = (c >> (8 * j + f)) & 3u;
                    u32 hb = (h >> ((f + 2 + 16 * (j >> 1) + 8 * (j & 1)) & 31)) & 1u;
                    v[16 * half + 4 * k + j] = mul_rn(dsc[half], (float)((int)(lo | hb << 2) - 4));
                }
            }
        }
    } else if (F == FMT_IQ4_NL || F == FMT_IQ4_XS) {
        // the device order (formats._iq4_codes): word k's nibbles 0..3 are elements 4k.., its
        // nibbles 4..7 elements 16 + 4k..; y = d * value (IQ4_XS: (d * scale) * value)
        float d;
        if (F == FMT_IQ4_NL) {
            d = f16_to_f32(ld_u16(srow + SCALE_BYTES_IQ4_NL * u));
        } else {
            const u8* sc = srow + SCALE_BYTES_IQ4_XS * (u >> 3);
            int scale = iq4xs_scale(ld_u16(sc + 2), ld_u32(sc + 4), u & 7);
            d = mul_rn(f16_to_f32(ld_u16(sc)), (float)scale);
        }
        const u8* qs = row + 16 * u;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            u32 w = ld_u32(qs + 4 * k);
#pragma unroll
            for (int n = 0; n < 8; n++)
                v[16 * (n >> 2) + 4 * k + (n & 3)] = mul_rn(d, iq4_value((w >> (4 * n)) & 15u));
        }
    } else if (F == FMT_Q8_0) {
        float d = f16_to_f32(ld_u16(srow + SCALE_BYTES_Q8_0 * u));
        const i8* qs = (const i8*)(row + 32 * u);
#pragma unroll
        for (int i = 0; i < 32; i++) v[i] = mul_rn((float)qs[i], d);
    } else if (F == FMT_Q4_K || F == FMT_Q5_K) {
        const int bytes = F == FMT_Q4_K ? BLOCK_BYTES_Q4_K : BLOCK_BYTES_Q5_K;
        const u8* b = row + bytes * (u >> 3);
        int j = u & 7;  // sub-block
        float d = f16_to_f32(ld_u16(b));
        float dmin = f16_to_f32(ld_u16(b + 2));
        u32 sc, mn;
        k_scale_min(b + 4, j, &sc, &mn);
        float dsc = mul_rn(d, (float)sc);
        float dm = mul_rn(dmin, (float)mn);
        const u8* qs = b + 16 + 32 * (j >> 1);  // Q4_K's codes
        int shift = 4 * (j & 1);
#pragma unroll
        for (int g = 0; g < 8; g++) {  // groups of 4 elements: one Q5_K code word each
            u32 q[4];
            if (F == FMT_Q5_K) q5k_codes4(b, j, g, q);
#pragma unroll
            for (int jj = 0; jj < 4; jj++) {
                int l = 4 * g + jj;
                if (F == FMT_Q4_K) q[jj] = (qs[l] >> shift) & 15u;
                v[l] = sub_rn(mul_rn(dsc, (float)q[jj]), dm);
            }
        }
    } else if (F == FMT_Q6_K) {
        int k32 = u & 7;
        int h = k32 >> 2, k = k32 & 3;
        const u8* b = row + ROW_BYTES_Q6_K * (u >> 3);
        const u8* ql = b + 64 * h + 32 * (k & 1);
        const u8* qh = b + 128 + 32 * h;
        const i8* sc = (const i8*)(b + 192);
        float d = f16_to_f32(ld_u16(srow + SCALE_BYTES_Q6_K * (u >> 3)));
        int p = q6k_scale(8 * h + 2 * k);  // = 8 h + 4 (k & 1) + (k >> 1); the next one's p + 2
        float dsc0 = mul_rn(d, (float)sc[p]);
        float dsc1 = mul_rn(d, (float)sc[p + 2]);
        int lshift = k >= 2 ? 4 : 0;
#pragma unroll
        for (int l = 0; l < 32; l++) {
            int q = (int)(((ql[l] >> lshift) & 15u) | (((qh[l] >> (2 * k)) & 3u) << 4)) - 32;
            v[l] = mul_rn(l < 16 ? dsc0 : dsc1, (float)q);
        }
    } else if (F == FMT_NVFP4) {
        const u8* p = row + 2 * BLOCK_BYTES_NVFP4 * u;
        float s0 = mul_rn(e4m3_to_f32(srow[2 * u]), gs);
        float s1 = mul_rn(e4m3_to_f32(srow[2 * u + 1]), gs);
#pragma unroll
        for (int i = 0; i < 16; i++) {
            float s = i < 8 ? s0 : s1;
            v[2 * i] = mul_rn(e2m1_to_f32(p[i] & 15u), s);
            v[2 * i + 1] = mul_rn(e2m1_to_f32(p[i] >> 4), s);
        }
    }
}

// ---- vector reads for the GEMV (gemv.cu) --------------------------------------------------
//
// The GEMV reads each lane's 32-element unit with 16-byte loads where the row allows it (the
// caller checks the alignment; these types make it known to the compiler: LDG.E.128 on
// NVIDIA, global_load_b128 on gfx11). Values are decoded without branches and the NVFP4 block
// scale is left to the caller, who applies it once per 16-element block.

typedef struct __attribute__((aligned(16))) {
    u32 x, y, z, w;
} atlas_u4;

typedef struct __attribute__((aligned(16))) {
    float x, y, z, w;
} atlas_f4;

// Loads of what stays read-only for the kernel's lifetime (x, weights, scales): the
// non-coherent loads (LDG.E.128.CONSTANT, ...), which nvcc does not always infer from
// __restrict__ in the larger GEMV bodies, nor ever through the fused step's table of pointers.
#if defined(ATLAS_CUDA) && !defined(ATLAS_PORTABLE)
ATLAS_DEV atlas_f4 ld_f4_readonly(const float* p) {
    float4 v = __ldg((const float4*)p);
    atlas_f4 q = {v.x, v.y, v.z, v.w};
    return q;
}
ATLAS_DEV atlas_u4 ld_u4_readonly(const void* p) {
    uint4 v = __ldg((const uint4*)p);
    atlas_u4 q = {v.x, v.y, v.z, v.w};
    return q;
}
ATLAS_DEV u32 ld_u32_readonly(const void* p) { return __ldg((const unsigned int*)p); }
ATLAS_DEV u32 ld_u16_readonly(const void* p) { return __ldg((const unsigned short*)p); }
#else
// HIP: the global address space, so that a pointer read from memory (the fused step's table)
// takes global_load_* rather than flat_load_*
#if defined(ATLAS_HIP) && !defined(ATLAS_PORTABLE)
#define ATLAS_RO const __attribute__((address_space(1)))
typedef unsigned int atlas_v4u __attribute__((ext_vector_type(4)));
ATLAS_DEV atlas_u4 ld_u4_readonly(const void* p) {
    atlas_v4u v = *(ATLAS_RO atlas_v4u*)p;
    atlas_u4 q = {v.x, v.y, v.z, v.w};
    return q;
}
ATLAS_DEV atlas_f4 ld_f4_readonly(const float* p) {
    atlas_u4 v = ld_u4_readonly(p);
    atlas_f4 q = {__uint_as_float(v.x), __uint_as_float(v.y), __uint_as_float(v.z),
                  __uint_as_float(v.w)};
    return q;
}
#else
#define ATLAS_RO const
ATLAS_DEV atlas_f4 ld_f4_readonly(const float* p) { return *(const atlas_f4*)p; }
ATLAS_DEV atlas_u4 ld_u4_readonly(const void* p) { return *(const atlas_u4*)p; }
#endif
ATLAS_DEV u32 ld_u32_readonly(const void* p) { return *(ATLAS_RO u32*)p; }
ATLAS_DEV u32 ld_u16_readonly(const void* p) { return *(ATLAS_RO u16*)p; }
#undef ATLAS_RO
#endif

// Asks L2 for the line holding p (no register written, nothing waits for it); a no-op off CUDA.
ATLAS_DEV void prefetch_l2(const void* p) {
#if defined(ATLAS_CUDA) && !defined(ATLAS_PORTABLE)
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#else
    (void)p;
#endif
}

// The two halves of `h` (IEEE f16 bit patterns, low half first) as float32, exactly.
ATLAS_DEV void h2_to_f32(u32 h, float* lo, float* hi) {
#if defined(ATLAS_CUDA) && !defined(ATLAS_PORTABLE)
    asm("{.reg .f16 l, h;\n\tmov.b32 {l, h}, %2;\n\tcvt.f32.f16 %0, l;\n\tcvt.f32.f16 %1, h;}"
        : "=f"(*lo), "=f"(*hi)
        : "r"(h));
#elif defined(ATLAS_HIP) && !defined(ATLAS_PORTABLE)
    typedef _Float16 atlas_h2 __attribute__((ext_vector_type(2)));
    atlas_h2 v = __builtin_bit_cast(atlas_h2, h);
    *lo = (float)v.x;
    *hi = (float)v.y;
#else
    *lo = f16_to_f32((u16)(h & 0xffffu));
    *hi = f16_to_f32((u16)(h >> 16));
#endif
}

// Two E4M3 codes (low byte first) as float32, exactly.
ATLAS_DEV void e4m3x2_to_f32(u32 b2, float* lo, float* hi) {
#if defined(ATLAS_CUDA) && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 890) && !defined(ATLAS_PORTABLE)
    unsigned short in = (unsigned short)b2;
    u32 h2;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(in));
    h2_to_f32(h2, lo, hi);
#else
    // Without the convert: each code moved into an f16's bit positions (exponent bias 15 for
    // 7) is its value * 2^-8, subnormals included, converted exactly by h2_to_f32; the NaN
    // code S.1111.111 is selected apart. No branch (the per-code decode had four).
    u32 h = (b2 & 0x7fu) << 7 | (b2 & 0x80u) << 8 | (b2 & 0x7f00u) << 15 | (b2 & 0x8000u) << 16;
    h2_to_f32(h, lo, hi);
    u32 nan_lo = (b2 & 0x80u) << 24 | 0x7fc00000u, nan_hi = (b2 & 0x8000u) << 16 | 0x7fc00000u;
    *lo = (b2 & 0x7fu) == 0x7fu ? __uint_as_float(nan_lo) : mul_rn(*lo, 256.0f);
    *hi = (b2 & 0x7f00u) == 0x7f00u ? __uint_as_float(nan_hi) : mul_rn(*hi, 256.0f);
#endif
}

// Eight E2M1 codes (one 32-bit word, code i in bits 4i..4i+3) -> v[0..7] = value * 2^-14.
// Code i and code i+4 sit 16 bits apart, so one shift pair and one mask build both as f16
// halves: sign (bit 3) to bit 15, the exponent and mantissa bits (2..0) to bits 11..9. That
// f16 is the E2M1 value times 2^-14 for every code (exponent 0 lands on the f16 subnormals:
// 0 and 0.5 * 2^-14), so the decode is exact; the caller folds 2^14 into the block scale.
// e2m1x8_halves: the same f16 halves as words, h[i] = codes (i, i + 4) (low, high half).
ATLAS_DEV void e2m1x8_halves(u32 w, u32* h) {
    const u32 mag = 0x0E000E00u, sgn = 0x80008000u;
    h[0] = ((w << 9) & mag) | ((w << 12) & sgn);
    h[1] = ((w << 5) & mag) | ((w << 8) & sgn);
    h[2] = ((w << 1) & mag) | ((w << 4) & sgn);
    h[3] = ((w >> 3) & mag) | (w & sgn);
}
ATLAS_DEV void e2m1x8_scaled(u32 w, float* v) {
    u32 h[4];
    e2m1x8_halves(w, h);
#pragma unroll
    for (int i = 0; i < 4; i++) h2_to_f32(h[i], &v[i], &v[i + 4]);
}

// Plain formats (one element per block: f32, f16, bf16) also take rows whose length is not a
// multiple of 32 (tiny models' hidden sizes); their last unit is partial. Element c of a row:
template <int F>
ATLAS_DEV float deq1(const u8* __restrict__ row, int c) {
    if (F == FMT_F32) return ((const float*)row)[c];
    if (F == FMT_F16) return f16_to_f32(((const u16*)row)[c]);
    if (F == FMT_BF16) return bf16_to_f32(((const u16*)row)[c]);
    return 0.0f;  // block formats: rows are whole units (checked by the launchers)
}

// The units of a row of `cols` elements, the last one possibly partial.
ATLAS_DEV int units_of(int cols) { return (cols + 31) / 32; }

// Unit u of a row of `cols` elements into v[0..31]; past the row's end, zeros.
template <int F>
ATLAS_DEV void deq_unit(const u8* __restrict__ row, const u8* __restrict__ srow, float gs, int u,
                        int cols, float* v) {
    // block formats never have a partial unit: the test on F drops the element path for them
    bool plain = F == FMT_F32 || F == FMT_F16 || F == FMT_BF16;
    if (!plain || 32 * u + 32 <= cols) {
        deq32<F>(row, srow, gs, u, v);
        return;
    }
    for (int i = 0; i < 32; i++) v[i] = 32 * u + i < cols ? deq1<F>(row, 32 * u + i) : 0.0f;
}
