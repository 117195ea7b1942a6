// gemv.cuh: what the GEMV kernels share (gemv.cu, the op path; decode.cu, the fused decode
// step): the 16-byte weight loads and their branch-free decode for every format, x staged in
// shared memory with its per-16-element sums, the dot.
//
// A warp sweeps its row in tiles of 32 units (1024 weights); each lane takes 32 weights of the
// tile, "a lane unit": two halves of 16 weights, A and B, each with its own x (16 staged
// floats), multiplier and offset, so that the lane's part of the dot is
//     dA * sum(vA * xA) + dB * sum(vB * xB) - mA * sum(xA) - mB * sum(xB)
// with v the decoded codes (integers times a power of two, exact) and the scales and the
// offset/min applied once per half. Which 32 weights a lane takes:
//   plain, NVFP4, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, IQ4_XS: unit (unit0 + lane); A its
//     elements 0..15, B 16..31.
//   Q4_K, Q5_K: lane l reads bytes 16 * (l & 7) of the 128 code bytes of block (l >> 3) of the
//     tile: low nibbles are 16 elements of sub-block 2i, high nibbles the same 16 of sub-block
//     2i + 1 (i = (l & 7) >> 1), so every code byte the lane loads is used.
//   Q6_K: lane l: 16 of the ql bytes of block (l >> 3), low nibbles sub-block k, high k + 2.
//   Q3_K: unit (unit0 + lane), lane l & 7 of its block in the device layout
//     (formats.q3_k_device): 16 bytes of low bits it shares with one lane and 16 of high bits
//     it shares with three.
// Every row is a sequence of 16-byte units (Q4_K and Q5_K blocks are 144 and 176 bytes; Q4_0,
// Q4_1, Q5_0, Q5_1, Q8_0, Q3_K and Q6_K keep their scales in the second buffer, quant.cuh), so
// each lane loads its codes (and a K-quant's header, Q5_K's high bits, Q6_K's and Q3_K's) with
// 16-byte loads straight from the row and its block scales (and Q5_0's, Q5_1's high bits) with
// 2- or 4-byte loads; only a weight buffer that is not 16-byte aligned takes deq32 (quant.cuh),
// with byte loads.
//
// Decode: 4-bit codes are masked straight into f16 halves (0x000F000F: two codes 16 bits
// apart; 0x00F000F0: the two high nibbles, 16 times larger), which are f16 subnormals equal to
// q * 2^-24 (or 16 q * 2^-24) exactly, converted to float32 by one HADD2.F32 each; the 2^24 and
// 2^20 go into the half's multiplier. Q6_K ORs its high bits into the same halves; Q5_K's
// device layout (formats.q5_k_device), which Q5_0 and Q5_1 share, lets two bit selects and two
// rotates build four halves of two 5-bit codes each, Q3_K's (formats.q3_k_device) two bit
// selects and one rotate four halves of two 3-bit codes each; Q8_0 flips the sign bit (q + 128,
// unsigned) and folds the 128 into the offset; IQ4_NL and IQ4_XS look value + 128 up with byte
// permutes (gv_iq4_word) and fold the 128 in the same way.
#pragma once
#include "quant.cuh"

#define GEMV_MAX_T 8
#define GEMV_WARPS 8
#define GEMV_UNIT_F4 9  // float4 slots per staged unit: half A, 1 of padding, half B (gv_lane)
#define GEMV_TILE_F4 (32 * GEMV_UNIT_F4)     // one token's staged tile

template <int F>
struct GvFmt {
    enum {
        kquant = F == FMT_Q4_K || F == FMT_Q5_K || F == FMT_Q6_K || F == FMT_Q3_K ||
                 F == FMT_IQ4_XS,
        scaled = F != FMT_F32 && F != FMT_F16 && F != FMT_BF16,  // the halves have multipliers
        sums = scaled && F != FMT_NVFP4,  // offsets / mins: the halves' sums of x are read
    };
};

// Whether this weight can take the 16-byte path (every format has one): rows of 16-byte units
// from a 16-byte aligned start, the block scales aligned for their 2- or 4-byte loads.
ATLAS_DEV bool gemv_aligned(const u8* W, const u8* S, long long row_bytes, long long srow_bytes,
                            int f) {
    unsigned long long m = (unsigned long long)W | (unsigned long long)row_bytes;
    unsigned long long s = (unsigned long long)S | (unsigned long long)srow_bytes;
    bool u16_scales = f == FMT_NVFP4 || f == FMT_Q4_0 || f == FMT_Q8_0 || f == FMT_Q6_K ||
                      f == FMT_Q5_0 || f == FMT_Q3_K || f == FMT_IQ4_NL;
    bool u32_scales = f == FMT_Q4_1 || f == FMT_Q5_1 || f == FMT_IQ4_XS;
    unsigned long long smask = u32_scales ? 3ull : u16_scales ? 1ull : 0ull;
    return (m & 15ull) == 0 && (s & smask) == 0;
}

// A lane's unit as the multiply wants it (see the top of this file). The decoders hand over
// their f16 halves two elements at a time through put(h, lo, hi): elements lo and hi of the
// unit (0..31) are the low and high half of h.
struct GvUnit {
    float v[32];
    float dA, dB, mA, mB;
    __device__ __forceinline__ void put(u32 h, int lo, int hi) { h2_to_f32(h, &v[lo], &v[hi]); }
};

// Where a lane's halves sit in the staged tile: float4 index of xA, xB; index of their sums.
struct GvLane {
    int xa, xb, sa, sb;
};

template <int F>
ATLAS_DEV GvLane gv_lane(int lane) {
    GvLane g;
    int ua = lane, ub = lane, ha = 0, hb = 1;
    if (F == FMT_Q4_K || F == FMT_Q5_K) {
        int s = lane & 7;
        ua = (lane & ~7) + 2 * (s >> 1);
        ub = ua + 1;
        ha = hb = s & 1;
    } else if (F == FMT_Q6_K) {
        int s = lane & 7;
        ua = (lane & ~7) + 4 * (s >> 2) + ((s >> 1) & 1);
        ub = ua + 2;
        ha = hb = s & 1;
    }
    // half h of unit u at float4 9 u + 5 h: the 16-byte reads of 8 lanes at a time hit distinct
    // banks (float4 index mod 8) for the plain layout (u = lane, h fixed: u mod 8) and for
    // Q4_K's and Q5_K's (u in {0, 2, 4, 6} or {1, 3, 5, 7}, both h: u + 5 h); Q6_K's (u in
    // {0, 1, 4, 5}, both h) has two lanes per bank group under any gap between the halves
    g.xa = ua * GEMV_UNIT_F4 + 5 * ha;
    g.xb = ub * GEMV_UNIT_F4 + 5 * hb;
    g.sa = 2 * ua + ha;
    g.sb = 2 * ub + hb;
    return g;
}

// Whether lane `lane` has weights in the tile at unit0 (units: the row's).
template <int F>
ATLAS_DEV bool gv_have(int unit0, int lane, int units) {
    if (GvFmt<F>::kquant) return unit0 + 8 * (lane >> 3) < units;
    return unit0 + lane < units;
}

// ---- loads ----------------------------------------------------------------------------------

// What a lane loads from global memory for one tile, before the barrier.
struct GvRaw {
    atlas_u4 q[8];
    u32 sc, sh;  // block scales; Q5_0 and Q5_1: the qh word; Q3_K: d; IQ4_XS: scales_l
};

// How a loop iteration treats the row's end:
#define GV_CHECKED 0  // a lane with no unit of the row in the tile does nothing (the last tiles)
#define GV_WHOLE 1    // every unit of the tiles is in the row: no checks
#define GV_CLAMPED 2  // a lane past the row's end reads its last unit (K-quants: block), which
                      // the staged zeros of x there cancel: no checks but a min per load

// Issue the lane's 16-byte loads of the tile at unit0 (the warp's row is live; units: the
// row's).
template <int F, int MODE>
ATLAS_DEV void gv_fetch(const u8* __restrict__ row, const u8* __restrict__ srow, int unit0,
                        int units, int lane, GvRaw& g) {
    if (MODE == GV_CHECKED && !gv_have<F>(unit0, lane, units)) return;
    int u = MODE == GV_CLAMPED ? min(unit0 + lane, units - 1) : unit0 + lane;
    int blk = unit0 / 8 + (lane >> 3);  // K-quants: the lane's block
    if (MODE == GV_CLAMPED) blk = min(blk, units / 8 - 1);
    if (F == FMT_NVFP4) {
        g.q[0] = ld_u4_readonly((const atlas_u4*)row + u);  // 32 codes
        g.sc = ld_u16_readonly((const u16*)srow + u);       // the unit's two E4M3 block scales
    } else if (F == FMT_Q4_0 || F == FMT_Q4_1) {
        g.q[0] = ld_u4_readonly((const atlas_u4*)row + u);  // qs[16]
        g.sc = F == FMT_Q4_1 ? ld_u32_readonly((const u32*)srow + u)  // d, m
                             : ld_u16_readonly((const u16*)srow + u);  // d
    } else if (F == FMT_Q5_0) {  // d, qh: 6 bytes a block, so three 2-byte loads
        g.q[0] = ld_u4_readonly((const atlas_u4*)row + u);
        const u16* sc = (const u16*)srow + 3 * u;
        g.sc = ld_u16_readonly(sc);
        g.sh = ld_u16_readonly(sc + 1) | (ld_u16_readonly(sc + 2) << 16);
    } else if (F == FMT_Q5_1) {
        g.q[0] = ld_u4_readonly((const atlas_u4*)row + u);
        g.sc = ld_u32_readonly((const u32*)srow + 2 * u);      // d, m
        g.sh = ld_u32_readonly((const u32*)srow + 2 * u + 1);  // qh
    } else if (F == FMT_Q3_K) {  // lane s of the block (formats.q3_k_device)
        int s = lane & 7;
        const atlas_u4* b = (const atlas_u4*)(row + (long long)ROW_BYTES_Q3_K * blk);
        g.q[0] = ld_u4_readonly(b + (s >> 1));      // low bits: the lane pair's unit
        g.q[1] = ld_u4_readonly(b + 4 + (s >> 2));  // hmask: the 4 lanes' unit
        const u16* sc = (const u16*)(srow + (long long)SCALE_BYTES_Q3_K * blk);
        g.sc = ld_u16_readonly(sc + q3k_lo(s)) | (ld_u16_readonly(sc + q3k_hi(s)) << 16);
        g.sh = ld_u16_readonly(sc + 6);  // d
    } else if (F == FMT_IQ4_NL) {
        g.q[0] = ld_u4_readonly((const atlas_u4*)row + u);
        g.sc = ld_u16_readonly((const u16*)srow + u);
    } else if (F == FMT_IQ4_XS) {  // sub-block u % 8 of block u / 8
        g.q[0] = ld_u4_readonly((const atlas_u4*)row + u);
        g.sc = ld_u32_readonly((const u32*)srow + 2 * (u >> 3));      // d, scales_h
        g.sh = ld_u32_readonly((const u32*)srow + 2 * (u >> 3) + 1);  // scales_l
    } else if (F == FMT_Q8_0) {
        g.q[0] = ld_u4_readonly((const atlas_u4*)row + 2 * u);
        g.q[1] = ld_u4_readonly((const atlas_u4*)row + 2 * u + 1);
        g.sc = ld_u16_readonly((const u16*)srow + u);
    } else if (F == FMT_Q6_K) {
        int s = lane & 7;
        const atlas_u4* b = (const atlas_u4*)(row + (long long)ROW_BYTES_Q6_K * blk);
        g.q[0] = ld_u4_readonly(b + s);  // ql bytes 16 s = 64 hh + 32 kk + 16 h16
        g.q[1] = ld_u4_readonly(b + 8 + 2 * (s >> 2) + (s & 1));  // qh: 128 + 32 hh + 16 h16
        // the lane's two int8 scales (row bytes 192 + 2 s: q6k_scale), d
        g.sc = ld_u16_readonly((const u16*)(b + 12) + s) |
               (ld_u16_readonly((const u16*)srow + blk) << 16);
    } else if (F == FMT_BF16 || F == FMT_F16) {
#pragma unroll
        for (int c = 0; c < 4; c++) g.q[c] = ld_u4_readonly((const atlas_u4*)row + 4 * u + c);
    } else if (F == FMT_F32) {
#pragma unroll
        for (int c = 0; c < 8; c++) g.q[c] = ld_u4_readonly((const atlas_u4*)row + 8 * u + c);
    } else if (F == FMT_Q4_K || F == FMT_Q5_K) {
        const int bb = F == FMT_Q4_K ? BLOCK_BYTES_Q4_K : BLOCK_BYTES_Q5_K;
        const atlas_u4* b = (const atlas_u4*)(row + (long long)bb * blk);
        int s = lane & 7;
        g.q[0] = ld_u4_readonly(b);  // d, dmin, the 12 bytes of 6-bit scales and mins
        if (F == FMT_Q4_K) {
            g.q[1] = ld_u4_readonly(b + 1 + s);  // code bytes 16 s .. 16 s + 15
        } else {
            g.q[1] = ld_u4_readonly(b + 3 + s);
            g.q[2] = ld_u4_readonly(b + 1 + (s & 1));  // the high bits of the same 16 positions
        }
    }
}

// Bytes per 8 units (256 weights) of a row and of its block scales' row, as uploaded.
template <int F>
ATLAS_DEV constexpr int gv_row8() {
    return F == FMT_F32 ? 1024 : F == FMT_F16 || F == FMT_BF16 ? 512 : F == FMT_Q8_0 ? 256
         : F == FMT_Q4_K ? BLOCK_BYTES_Q4_K : F == FMT_Q5_K ? BLOCK_BYTES_Q5_K
         : F == FMT_Q6_K ? ROW_BYTES_Q6_K : F == FMT_Q3_K ? ROW_BYTES_Q3_K : 128;
}
template <int F>
ATLAS_DEV constexpr int gv_srow8() {
    return F == FMT_NVFP4 ? 16 : F == FMT_Q4_0 ? 8 * SCALE_BYTES_Q4_0
         : F == FMT_Q4_1 ? 8 * SCALE_BYTES_Q4_1 : F == FMT_Q8_0 ? 8 * SCALE_BYTES_Q8_0
         : F == FMT_Q5_0 ? 8 * SCALE_BYTES_Q5_0 : F == FMT_Q5_1 ? 8 * SCALE_BYTES_Q5_1
         : F == FMT_IQ4_NL ? 8 * SCALE_BYTES_IQ4_NL : F == FMT_Q6_K ? SCALE_BYTES_Q6_K
         : F == FMT_Q3_K ? SCALE_BYTES_Q3_K : F == FMT_IQ4_XS ? SCALE_BYTES_IQ4_XS : 0;
}

// Asks L2 for units [unit0, unit0 + N) of a row and their block scales (N a multiple of 8:
// whole K-quant blocks; the caller keeps them inside the row) in one instruction: lanes spread
// over the bytes (all 32 over the codes, or 16 over the codes and 16 over the scales), each
// asking for the 128-byte line that holds its byte. Nothing is written or waited for; the loads
// that follow find the bytes in L2.
template <int F, int N>
ATLAS_DEV void gv_prefetch(const u8* __restrict__ row, const u8* __restrict__ srow, int unit0,
                           int lane) {
    constexpr int cbytes = N * gv_row8<F>() / 8, sbytes = N * gv_srow8<F>() / 8;
    const u8* c = row + unit0 * (gv_row8<F>() / 8);  // byte offsets: a row is far below 2 GB
    if constexpr (sbytes == 0) {
#pragma unroll
        for (int k = 0; k < cbytes / ATLAS_WARP; k += 128) prefetch_l2(c + lane * (cbytes / 32) + k);
    } else {
        static_assert(N * gv_row8<F>() / 8 / 16 <= 128, "16 lanes cover the codes");
        const u8* sc = srow + unit0 * gv_srow8<F>() / 8;
        prefetch_l2(lane < 16 ? c + lane * (cbytes / 16) : sc + (lane - 16) * (sbytes / 16));
    }
}

// ---- decode ---------------------------------------------------------------------------------

// One word of 8 4-bit codes (bytes 0..3: elements 4k..4k+3; low nibble -> A, high -> B) with
// high bits hA, hB already in place (0 for plain 4-bit), as q * 2^-24 (A) and 16 q * 2^-24 (B).
// The four decoders of a word below give elements a..a + 3 of A and b..b + 3 of B to o.put in
// pairs (a, a + 2), (a + 1, a + 3).
template <class O>
ATLAS_DEV void gv_nib8(u32 w, u32 hA02, u32 hA13, u32 hB02, u32 hB13, O& o, int a, int b) {
    u32 w8 = w >> 8;
    o.put((w & 0x000F000Fu) | hA02, a, a + 2);
    o.put((w8 & 0x000F000Fu) | hA13, a + 1, a + 3);
    o.put((w & 0x00F000F0u) | hB02, b, b + 2);
    o.put((w8 & 0x00F000F0u) | hB13, b + 1, b + 3);
}

// The two 6-bit scales and mins of sub-blocks 2i, 2i + 1 of a K-quant block (ggml
// get_scale_min_k4) from the header words h1 = bytes 4..7, h2 = 8..11, h3 = 12..15, as pairs
// of bytes (low byte: sub-block 2i) -> floats.
ATLAS_DEV void gv_kscales(u32 h1, u32 h2, u32 h3, int i, float* sc, float* mn) {
    // sub-blocks 0..3: the low 6 bits of bytes j (scale) and j + 4 (min); 4..7: 4 bits of byte
    // j + 4 (low nibble: scale, high: min) and the top 2 bits of bytes j - 4 and j
    bool lo = i < 2;
    int p = 16 * (i & 1), q = lo ? p : p + 2;
    u32 s2 = (((lo ? h1 : h3) >> p) & 0x0F0Fu) | ((h1 >> q) & 0x3030u);
    u32 m2 = (((lo ? h2 : h3) >> (lo ? p : p + 4)) & 0x0F0Fu) | ((h2 >> q) & 0x3030u);
    sc[0] = (float)(s2 & 0xffu);
    sc[1] = (float)(s2 >> 8);
    mn[0] = (float)(m2 & 0xffu);
    mn[1] = (float)(m2 >> 8);
}

#define GV_2P24 16777216.0f
#define GV_2P20 1048576.0f
// Q5_K on the device: the bits of a code word that are codes in the first 5-bit fields of its
// halves (bits 1-8 and 17-24; the rest, rotated by 8, fill the second halves' fields)
#define Q5K_CODE_BITS 0x01FE01FEu

// Four elements of A (vA[0..3]) and of B (vB[0..3]) from a code word `c` of the device layout of
// Q5_K, Q5_0 and Q5_1 (formats._q5_words) and `b`, whose bits 0 and 1 of each byte are the
// extra bits: f16 halves of two 5-bit fields each, A's code at bits 0-4 (q * 2^-24), B's at
// 5-9 (32 q * 2^-24).
template <class O>
ATLAS_DEV void gv_q5_word(u32 c, u32 b, O& o, int a, int bb) {
    u32 z02 = bitsel<Q5K_CODE_BITS>(c, b);
    u32 z13 = rotr32(bitsel<Q5K_CODE_BITS>(b, c), 8);
    o.put(z02 & 0x001F001Fu, a, a + 2);
    o.put(z13 & 0x001F001Fu, a + 1, a + 3);
    o.put(z02 & 0x03E003E0u, bb, bb + 2);
    o.put(z13 & 0x03E003E0u, bb + 1, bb + 3);
}

// Four elements of A (vA[0..3]) and of B (vB[0..3]) of a Q3_K lane (formats.q3_k_device) from
// its low-bits word `c` and its hmask word `h`: two bit selects put each element's high bit
// above its 2-bit field, so A's halves hold q * 2^(t - 24) and B's q * 2^(t - 20) (q: the 3-bit
// code, 0..7; t = 2e + r, the lane's field offset). `cm` = 0x00330033 << t: the fields of
// elements 0 and 2 in `c`; rotated by 8, those of 1 and 3.
template <class O>
ATLAS_DEV void gv_q3k_word(u32 c, u32 h, int t, u32 cm, O& o, int a, int b) {
    u32 cm13 = rotr32(cm, 24);
    u32 z02 = (c & cm) | (h & ~cm);
    u32 z13 = rotr32((c & cm13) | (h & ~cm13), 8);
    u32 ma = 0x00070007u << t, mb = ma << 4;
    o.put(z02 & ma, a, a + 2);
    o.put(z13 & ma, a + 1, a + 3);
    o.put(z02 & mb, b, b + 2);
    o.put(z13 & mb, b + 1, b + 3);
}

// Byte permute (PTX prmt, default mode): byte n of the result is byte (s >> 4n) & 7 of the 8
// bytes (a, b), or, where bit 3 of that nibble is set, its sign bit copied to all 8 bits.
ATLAS_DEV u32 gv_prmt(u32 a, u32 b, u32 s) {
#if defined(ATLAS_CUDA) && !defined(ATLAS_PORTABLE)
    u32 d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(s));
    return d;
#else
    unsigned long long x = (unsigned long long)b << 32 | a;
    u32 d = 0;
#pragma unroll
    for (int n = 0; n < 4; n++) {
        u32 sel = (s >> (4 * n)) & 15u, byte = (u32)(x >> (8 * (sel & 7u))) & 0xffu;
        if (sel & 8u) byte = byte & 0x80u ? 0xffu : 0u;
        d |= byte << (8 * n);
    }
    return d;
#endif
}

// Four elements of A (vA[0..3]) and of B (vB[0..3]) from an IQ4 code word in the device order
// (formats._iq4_codes: A's 4 codes in the low 16 bits, B's in the high), as f16 halves of
// value + 128 (quant.cuh IQ4_LO0..): table lookups by byte permutes. A half's 4 codes look up
// the first 8 values (`lo`: a code >= 8 gets the sign of one of them, 0) and, with bit 3 of
// every code flipped, the last 8 (`hi`); a third permute picks each value from lo or hi by its
// code's bit 3 and puts a zero byte (the sign of lo's first byte) above it.
template <class O>
ATLAS_DEV void gv_iq4_word(u32 w, O& o, int a, int b) {
    u32 wh = w ^ 0x88888888u;
    u32 i02 = ((w >> 1) & 0x04040404u) | 0x82808280u;  // bytes 0, 2 of lo (hi where bit 3)
    u32 i13 = ((w >> 5) & 0x04040404u) | 0x83818381u;  // bytes 1, 3
    u32 loA = gv_prmt(IQ4_LO0, IQ4_LO1, w), hiA = gv_prmt(IQ4_HI0, IQ4_HI1, wh);
    u32 loB = gv_prmt(IQ4_LO0, IQ4_LO1, w >> 16), hiB = gv_prmt(IQ4_HI0, IQ4_HI1, wh >> 16);
    o.put(gv_prmt(loA, hiA, i02), a, a + 2);
    o.put(gv_prmt(loA, hiA, i13), a + 1, a + 3);
    o.put(gv_prmt(loB, hiB, i02 >> 16), b, b + 2);
    o.put(gv_prmt(loB, hiB, i13 >> 16), b + 1, b + 3);
}

// The signed byte p (0..3) of w as a float.
ATLAS_DEV float gv_i8(u32 w, int p) { return (float)((int)(w << (24 - 8 * p)) >> 24); }

// The plain formats' values (gv_decode).
template <int F>
ATLAS_DEV void gv_decode_plain(const GvRaw& g, GvUnit& o) {
    if (F == FMT_BF16 || F == FMT_F16) {
#pragma unroll
        for (int c = 0; c < 4; c++) {
            u32 wd[4] = {g.q[c].x, g.q[c].y, g.q[c].z, g.q[c].w};
#pragma unroll
            for (int k = 0; k < 4; k++) {
                float* e = o.v + 8 * c + 2 * k;
                if (F == FMT_BF16) {
                    e[0] = __uint_as_float(wd[k] << 16);
                    e[1] = __uint_as_float(wd[k] & 0xffff0000u);
                } else {
                    h2_to_f32(wd[k], &e[0], &e[1]);
                }
            }
        }
    } else if (F == FMT_F32) {
#pragma unroll
        for (int c = 0; c < 8; c++) {
            o.v[4 * c] = __uint_as_float(g.q[c].x);
            o.v[4 * c + 1] = __uint_as_float(g.q[c].y);
            o.v[4 * c + 2] = __uint_as_float(g.q[c].z);
            o.v[4 * c + 3] = __uint_as_float(g.q[c].w);
        }
    }
}

// The lane's unit, decoded into o (GvUnit: floats; gemv_mma.cu's GvmHalves: the f16 halves).
// The plain formats' values are not f16 halves: GvUnit only.
template <int F, class O>
ATLAS_DEV void gv_decode(const GvRaw& g, int lane, O& o) {
    o.dA = o.dB = 1.0f;
    o.mA = o.mB = 0.0f;
    float dummy;
    if constexpr (F == FMT_BF16 || F == FMT_F16 || F == FMT_F32) {
        gv_decode_plain<F>(g, o);
    } else if (F == FMT_NVFP4) {
        u32 c[4] = {g.q[0].x, g.q[0].y, g.q[0].z, g.q[0].w};
#pragma unroll
        for (int k = 0; k < 4; k++) {
            u32 h[4];
            e2m1x8_halves(c[k], h);
#pragma unroll
            for (int i = 0; i < 4; i++) o.put(h[i], 8 * k + i, 8 * k + i + 4);
        }
        e4m3x2_to_f32(g.sc, &o.dA, &o.dB);  // the global scale and 2^14: gemv_row_scale
    } else if (F == FMT_Q4_K || F == FMT_Q5_K) {
        int s = lane & 7, i = s >> 1;
        float d, dmin, sc[2], mn[2];
        h2_to_f32(g.q[0].x, &d, &dmin);
        gv_kscales(g.q[0].y, g.q[0].z, g.q[0].w, i, sc, mn);
        u32 c[4] = {g.q[1].x, g.q[1].y, g.q[1].z, g.q[1].w};
        u32 h[4] = {g.q[2].x, g.q[2].y, g.q[2].z, g.q[2].w};
#pragma unroll
        for (int k = 0; k < 4; k++) {
            if (F == FMT_Q4_K) {
                gv_nib8(c[k], 0, 0, 0, 0, o, 4 * k, 16 + 4 * k);
            } else {  // the device layout (formats.q5_k_device): two 5-bit fields per half
                // the lane's extra bits: bits 0 and 1 of each byte
                gv_q5_word(c[k], rotr32(h[k], 2 * i), o, 4 * k, 16 + 4 * k);
            }
        }
        // A: q * 2^-24 (Q4_K, Q5_K); B: 16 q * 2^-24 (Q4_K), 32 q * 2^-24 (Q5_K); exact scalings
        float d24 = mul_rn(d, GV_2P24);
        o.dA = mul_rn(d24, sc[0]);
        o.dB = mul_rn(mul_rn(d24, F == FMT_Q4_K ? 0.0625f : 0.03125f), sc[1]);
        o.mA = mul_rn(dmin, mn[0]);
        o.mB = mul_rn(dmin, mn[1]);
    } else if (F == FMT_Q4_0 || F == FMT_Q4_1 || F == FMT_Q8_0) {
        float d, m;
        h2_to_f32(g.sc, &d, &m);  // Q4_0, Q8_0: the high half is 0
        if (F == FMT_Q8_0) {
            u32 c[8] = {g.q[0].x, g.q[0].y, g.q[0].z, g.q[0].w,
                        g.q[1].x, g.q[1].y, g.q[1].z, g.q[1].w};
#pragma unroll
            for (int k = 0; k < 8; k++) {
                o.put((c[k] & 0x00FF00FFu) ^ 0x00800080u, 4 * k, 4 * k + 2);
                o.put(((c[k] >> 8) & 0x00FF00FFu) ^ 0x00800080u, 4 * k + 1, 4 * k + 3);
            }
            o.dA = o.dB = mul_rn(d, GV_2P24);
            o.mA = o.mB = mul_rn(d, 128.0f);
        } else {
            u32 c[4] = {g.q[0].x, g.q[0].y, g.q[0].z, g.q[0].w};
#pragma unroll
            for (int k = 0; k < 4; k++) gv_nib8(c[k], 0, 0, 0, 0, o, 4 * k, 16 + 4 * k);
            o.dA = mul_rn(d, GV_2P24);
            o.dB = mul_rn(d, GV_2P20);
            o.mA = o.mB = F == FMT_Q4_0 ? mul_rn(d, 8.0f) : -m;
        }
    } else if (F == FMT_Q5_0 || F == FMT_Q5_1) {
        // Q5_K's decode (formats.q5_0_device): word k's extra bits are bits 2k, 2k + 1 of qh
        float d, m;
        h2_to_f32(g.sc, &d, &m);  // Q5_0: the high half is 0
        u32 c[4] = {g.q[0].x, g.q[0].y, g.q[0].z, g.q[0].w};
#pragma unroll
        for (int k = 0; k < 4; k++)
            gv_q5_word(c[k], rotr32(g.sh, 2 * k), o, 4 * k, 16 + 4 * k);
        o.dA = mul_rn(d, GV_2P24);
        o.dB = mul_rn(d, GV_2P24 / 32.0f);
        o.mA = o.mB = F == FMT_Q5_0 ? mul_rn(d, 16.0f) : -m;
    } else if (F == FMT_Q3_K) {
        int s = lane & 7, t = 2 * (s & 1) + ((s >> 1) & 1);
        u32 cm = 0x00330033u << t;
        u32 c[4] = {g.q[0].x, g.q[0].y, g.q[0].z, g.q[0].w};
        u32 h[4] = {g.q[1].x, g.q[1].y, g.q[1].z, g.q[1].w};
#pragma unroll
        for (int k = 0; k < 4; k++) gv_q3k_word(c[k], h[k], t, cm, o, 4 * k, 16 + 4 * k);
        int a, b;
        q3k_scales(g.sc & 0xffffu, g.sc >> 16, s, &a, &b);
        float d;
        h2_to_f32(g.sh, &d, &dummy);
        // value = d sc (q - 4), every product exact: the halves hold q * 2^(t - 24) (A) and
        // 16 q * 2^(t - 24) (B)
        float da = mul_rn(d, __uint_as_float((u32)(127 + 24 - t) << 23));  // d * 2^(24 - t)
        o.dA = mul_rn(da, (float)a);
        o.dB = mul_rn(mul_rn(da, 0.0625f), (float)b);
        float d4 = mul_rn(d, 4.0f);
        o.mA = mul_rn(d4, (float)a);
        o.mB = mul_rn(d4, (float)b);
    } else if (F == FMT_IQ4_NL || F == FMT_IQ4_XS) {
        u32 c[4] = {g.q[0].x, g.q[0].y, g.q[0].z, g.q[0].w};
#pragma unroll
        for (int k = 0; k < 4; k++) gv_iq4_word(c[k], o, 4 * k, 16 + 4 * k);
        float d;
        h2_to_f32(g.sc, &d, &dummy);
        if (F == FMT_IQ4_XS) d = mul_rn(d, (float)iq4xs_scale(g.sc >> 16, g.sh, lane & 7));
        o.dA = o.dB = mul_rn(d, GV_2P24);  // the halves: (value + 128) * 2^-24
        o.mA = o.mB = mul_rn(d, 128.0f);
    } else if (F == FMT_Q6_K) {
        // lane (hh, kk, h16) = bits (2, 1, 0) of lane & 7: half hh of the block, sub-blocks
        // kk (low nibbles, A) and kk + 2 (high, B) of it, their elements 16 h16 .. + 15
        int kk = (lane >> 1) & 1;
        float d;
        h2_to_f32(g.sc, &dummy, &d);
        u32 c[4] = {g.q[0].x, g.q[0].y, g.q[0].z, g.q[0].w};
        u32 h[4] = {g.q[1].x, g.q[1].y, g.q[1].z, g.q[1].w};
#pragma unroll
        for (int k = 0; k < 4; k++) {
            // bits 2kk, 2kk + 1 of each byte (A's; B's 4 higher) to bits 4, 5 of bytes 0 and 2
            // (hl) and of bytes 1 and 3 (hr)
            u32 hl = h[k] << (4 - 2 * kk), hr = h[k] >> (4 + 2 * kk);
            gv_nib8(c[k], hl & 0x00300030u, hr & 0x00300030u, hl & 0x03000300u,
                    hr & 0x03000300u, o, 4 * k, 16 + 4 * k);
        }
        float sa = mul_rn(d, gv_i8(g.sc, 0)), sb = mul_rn(d, gv_i8(g.sc, 1));
        o.dA = mul_rn(sa, GV_2P24);
        o.dB = mul_rn(sb, GV_2P20);
        o.mA = mul_rn(sa, 32.0f);
        o.mB = mul_rn(sb, 32.0f);
    }
}

// ---- x --------------------------------------------------------------------------------------

// One staged float4 of x: thread (uu, c) holds elements 4c..4c+3 of tile unit uu. With SUMS,
// the 4 threads of each half add their values (every lane of the warp must call).
template <bool SUMS>
ATLAS_DEV void gemv_put_x(atlas_f4 q, bool ok, atlas_f4* xs, float* xsum, int uu, int c) {
    if (ok) xs[uu * GEMV_UNIT_F4 + c + (c >> 2)] = q;  // half B (c >= 4) past the padding
    if (SUMS) {
        float s = ok ? (q.x + q.y) + (q.z + q.w) : 0.0f;
        s += warp_xor(s, 1);
        s += warp_xor(s, 2);
        if (ok && (c & 3) == 0) xsum[2 * uu + (c >> 2)] = s;
    }
}

// x[t][32 * unit0 .. + 32 * 32) -> xs for t < T: each of the 256 threads copies one float4 of
// each token's tile (the warp reads 512 contiguous bytes); units past the row's end are left
// (FULL: there are none).
template <int TT, bool SUMS, bool FULL = false>
ATLAS_DEV void gemv_stage_x(const float* __restrict__ x, atlas_f4* xs, float* xsum, int T,
                            int cols, int unit0, bool x_aligned) {
    int uu = (int)(threadIdx.x >> 3), c = (int)(threadIdx.x & 7);
    bool ok = FULL || unit0 + uu < cols / 32;
    if (!SUMS && !ok) return;
    const float* src = x + 32 * (unit0 + uu) + 4 * c;
#pragma unroll
    for (int t = 0; t < TT; t++) {
        if (TT == 1 || t < T) {
            const float* p = src + (long long)t * cols;
            atlas_f4 q = {0.0f, 0.0f, 0.0f, 0.0f};
            if (ok && x_aligned) {
                q = ld_f4_readonly(p);
            } else if (ok) {
                q.x = p[0];
                q.y = p[1];
                q.z = p[2];
                q.w = p[3];
            }
            gemv_put_x<SUMS>(q, ok, xs + t * GEMV_TILE_F4, xsum + t * 64, uu, c);
        }
    }
}

// ---- the dot --------------------------------------------------------------------------------

// acc + sum_i v[i] * x[i] over 16 elements of staged x (four float4): one chain; a lane has
// two halves per unit and U units in flight, enough chains to hide the FFMA latency.
ATLAS_DEV float gemv_dot16(const float* v, const atlas_f4* xu, float acc) {
#pragma unroll
    for (int c = 0; c < 4; c++) {
        atlas_f4 p = xu[c];
        acc = fmaf(v[4 * c], p.x, acc);
        acc = fmaf(v[4 * c + 1], p.y, acc);
        acc = fmaf(v[4 * c + 2], p.z, acc);
        acc = fmaf(v[4 * c + 3], p.w, acc);
    }
    return acc;
}

// The lane's unit against one token's staged tile (xs, xsum of that token), into the two
// accumulators of the halves. NVFP4's global scale is applied once per row by the caller.
template <int F, bool VEC>
ATLAS_DEV void gemv_dot(const GvUnit& g, const GvLane& L, const atlas_f4* xs, const float* xsum,
                        float* acc) {
    if (!VEC || !GvFmt<F>::scaled) {  // deq32 values are final; plain formats
        acc[0] = gemv_dot16(g.v, xs + L.xa, acc[0]);
        acc[1] = gemv_dot16(g.v + 16, xs + L.xb, acc[1]);
        return;
    }
    acc[0] = fmaf(gemv_dot16(g.v, xs + L.xa, 0.0f), g.dA, acc[0]);
    acc[1] = fmaf(gemv_dot16(g.v + 16, xs + L.xb, 0.0f), g.dB, acc[1]);
    if (GvFmt<F>::sums) {
        acc[0] = fmaf(-g.mA, xsum[L.sa], acc[0]);
        acc[1] = fmaf(-g.mB, xsum[L.sb], acc[1]);
    }
}

// What multiplies a row's sum at the end: NVFP4's global scale times 2^14 on the 16-byte path.
template <int F, bool VEC>
ATLAS_DEV float gemv_row_scale(float gs) {
    return VEC && F == FMT_NVFP4 ? mul_rn(gs, 16384.0f) : 1.0f;
}

// The fallback: deq32's exact values of unit (unit0 + lane), the plain layout of lanes.
template <int F>
ATLAS_DEV void gemv_deq(const u8* __restrict__ row, const u8* __restrict__ srow, float gs, int u,
                        GvUnit& o) {
    deq32<F>(row, srow, gs, u, o.v);
    o.dA = o.dB = 1.0f;
    o.mA = o.mB = 0.0f;
}

// ---- a loop iteration -----------------------------------------------------------------------

// A row a warp multiplies: its codes, its block scales (quant.cuh), NVFP4's global scale.
struct GvRow {
    const u8* w;
    const u8* s;
    float gs;
};

// gemv.cu's staging: x of TT tokens as it is (tokens t at xs + t * GEMV_TILE_F4).
template <int TT, bool SUMS, bool FULL>
struct GvStageX {
    static const bool pre = false;  // staged by gemv_tiles, a tile at a time
    const float* x;
    int T, cols;
    bool x_aligned;
    __device__ __forceinline__ float operator()(atlas_f4* xs, float* xsum, int unit0) const {
        gemv_stage_x<TT, SUMS, FULL>(x, xs, xsum, T, cols, unit0, x_aligned);
        return 0.0f;
    }
};

// x staged for many tiles before the loop (decode.cu): gemv_tiles neither stages nor waits.
struct GvPrestaged {
    static const bool pre = true;
    __device__ __forceinline__ float operator()(atlas_f4*, float*, int) const { return 0.0f; }
};

// One loop iteration: U tiles from unit0, each warp's NR rows (they share the staged x) against
// TT staged tokens, into acc[r * TT + t]. Every thread of the block calls it: `stage(xs, xsum,
// unit0)` stages one tile of x (GvStageX) and returns what it sums on the way, which this
// returns; GvPrestaged: the tiles are staged already. The weight loads of all U tiles are
// issued first. TT == 1 stages the U tiles at once (tile j where token j would sit); TT > 1
// stages each tile's TT tokens in turn between its own barriers, so T <= 8 keeps T == 1's
// bytes in flight with one tile of x staged. MODE: the row's end (GV_CHECKED, ...); without
// checks the warp's rows are live or clamped to real ones (their sums are dropped), so the
// loop carries no divergent branch. !VEC (the deq32 fallback) dequantizes after the barrier, a
// unit at a time, and takes GV_CHECKED.
template <int F, int TT, int NR, bool VEC, int U, int MODE, class Stage>
ATLAS_DEV float gemv_tiles(const GvRow (&rows)[NR], int T, int units, int unit0, bool live,
                           int lane, const GvLane& L, atlas_f4* xs, float* xsum,
                           float (*acc)[2], const Stage& stage) {
    GvRaw raw[NR][U];
#pragma unroll
    for (int r = 0; r < NR; r++) {
#pragma unroll
        for (int j = 0; j < U; j++)  // in flight
            if (VEC && (MODE != GV_CHECKED || live))
                gv_fetch<F, MODE>(rows[r].w, rows[r].s, unit0 + 32 * j, units, lane, raw[r][j]);
    }
    const bool per_tile = TT > 1;  // x staged a tile at a time (TT tokens of it)
    float staged = 0.0f;
    if (!Stage::pre && !per_tile) {
        __syncthreads();  // the previous tile's x and weight bytes have been read
#pragma unroll
        for (int j = 0; j < U; j++)
            staged += stage(xs + j * GEMV_TILE_F4, xsum + 64 * j, unit0 + 32 * j);
        __syncthreads();
    }
    GvUnit g;
#pragma unroll
    for (int j = 0; j < U; j++) {
        int u0 = unit0 + 32 * j;
        if (!Stage::pre && per_tile) {
            __syncthreads();  // the previous tile's x has been read
            staged += stage(xs, xsum, u0);
            __syncthreads();
        }
        if (MODE == GV_CHECKED &&
            (!live || !(VEC ? gv_have<F>(u0, lane, units) : u0 + lane < units)))
            continue;
#pragma unroll
        for (int r = 0; r < NR; r++) {
            if (VEC) gv_decode<F>(raw[r][j], lane, g);
            else gemv_deq<F>(rows[r].w, rows[r].s, rows[r].gs, u0 + lane, g);
#pragma unroll
            for (int t = 0; t < TT; t++) {
                int k = per_tile ? t : t + j;  // the staged tile: token t, or (TT == 1) tile j
                if (TT == 1 || t < T)
                    gemv_dot<F, VEC>(g, L, xs + k * GEMV_TILE_F4, xsum + k * 64, acc[r * TT + t]);
            }
        }
    }
    return staged;
}
