// Attention over a KV cache stored as bf16 (u16 bits), FP8 E4M3 with a per-tensor scale, or
// float32.
//
// kv_write_<kv>: cache[h, start + t, :] = encode(k[t, h, :] / scale), k (T, nkv, hd) f32,
//   cache (nkv, cap, hd). Grid (T, nkv), block 128.  Reference: cache.KVCache.update.
// attn_<kv>_hd<HD>: causal GQA attention of T new queries (positions start..start+T-1) against
//   cache positions 0..start+T-1 (query t sees keys 0..start+t).  Reference:
//   numpy_ref.attention(q, k, v, start) on the decoded cache. q (T, nh, hd) f32; query head
//   hq uses kv head hq / (nh / nkv). One logical warp per (token, head) row; a block holds
//   R = blockDim / 32 <= 8 rows of one kv head (a decode step's whole group up to G = 8, so
//   each KV head is read once per step) and walks the keys in tiles staged in shared memory
//   with 16-byte loads, with an online softmax (flash-attention style). Split-K over the key
//   axis: grid (ceil(T*G/R), nkv, nsplit), block 32 R. With nsplit == 1 the normalised output
//   goes straight to `out` (T, nh, hd); otherwise each split writes unnormalised partials and
//   attn_combine merges them (flash-decoding). `start_ptr`, when not null, overrides `start`
//   from device memory so that a captured graph can replay the decode step at a new position.
//   split_len 0: the splits follow the length the block sees, ceil(len / nsplit) keys each
//   (whole tiles, at least ATTN_SPLIT_MIN), so a graph captured for a large cache spreads a
//   short context over every split (splits past the length write empty partials).
// attn_combine: out (T, nh, hd) from part_o (nsplit, T, nh, hd) and part_ml (nsplit, T, nh, 2).
//   Grid (T * nh), block 32..256.
// attn_prefill_<kv>_hd<HD> (attention_mma.cuh): the same contract on tensor cores for
//   prefill, 64 rows per block. Grid (ceil(T*G/64), nkv, nsplit), block 128.
#include "atlas_common.cuh"

#define KV_BF16 0
#define KV_FP8 1
#define KV_F32 2  // float32 cache: exact parity with the numpy reference, for debugging
#define ATTN_ROWS 8  // most warps (query rows) per block: a decode block covers a group of 8
#define ATTN_SPLIT_MIN 64  // fewest keys per split when the length sets the splits

#include "attention_mma.cuh"

// cache elements idx..idx+7 (idx a multiple of 8) as floats, in one 16-byte (bf16, f32: two),
// 8-byte (fp8) load
template <int KV>
ATLAS_DEV void kv_load8(const void* __restrict__ c, long long idx, float* x) {
    if (KV == KV_BF16) {
        AttnU4 v = *(const AttnU4*)((const u16*)c + idx);
        u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; i++) x[2 * i] = bf16_lo(w[i]), x[2 * i + 1] = bf16_hi(w[i]);
    } else if (KV == KV_F32) {
        const AttnU4* f = (const AttnU4*)((const float*)c + idx);
        AttnU4 a = f[0], b = f[1];
        u32 w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
        for (int i = 0; i < 8; i++) x[i] = __uint_as_float(w[i]);
    } else {
        AttnU2 v = *(const AttnU2*)((const u8*)c + idx);
#pragma unroll
        for (int i = 0; i < 8; i++) x[i] = e4m3_to_f32((u8)((i < 4 ? v.x : v.y) >> (8 * (i & 3))));
    }
}

template <int KV>
ATLAS_DEV float kv_load(const void* __restrict__ c, long long i) {
    if (KV == KV_BF16) return bf16_to_f32(((const u16*)c)[i]);
    if (KV == KV_F32) return ((const float*)c)[i];
    return e4m3_to_f32(((const u8*)c)[i]);
}

template <int KV>
ATLAS_DEV void kv_write_body(const float* __restrict__ k, void* __restrict__ cache, int T,
                             int nkv, int hd, int cap, int start, const i32* start_ptr,
                             float scale) {
    (void)T;  // the grid covers the T tokens
    if (start_ptr) start = *start_ptr;
    int t = blockIdx.x, h = blockIdx.y;
    const float* src = k + ((long long)t * nkv + h) * hd;
    long long dst = ((long long)h * cap + start + t) * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        if (KV == KV_BF16) ((u16*)cache)[dst + d] = f32_to_bf16(src[d] / scale);
        else if (KV == KV_F32) ((float*)cache)[dst + d] = src[d] / scale;
        else ((u8*)cache)[dst + d] = f32_to_e4m3(src[d] / scale);
    }
}

extern "C" __global__ void __launch_bounds__(128)
    kv_write_bf16(const float* __restrict__ k, void* __restrict__ cache, int T, int nkv, int hd,
                  int cap, int start, const i32* start_ptr, float scale) {
    kv_write_body<KV_BF16>(k, cache, T, nkv, hd, cap, start, start_ptr, scale);
}

extern "C" __global__ void __launch_bounds__(128)
    kv_write_fp8(const float* __restrict__ k, void* __restrict__ cache, int T, int nkv, int hd,
                 int cap, int start, const i32* start_ptr, float scale) {
    kv_write_body<KV_FP8>(k, cache, T, nkv, hd, cap, start, start_ptr, scale);
}

extern "C" __global__ void __launch_bounds__(128)
    kv_write_f32(const float* __restrict__ k, void* __restrict__ cache, int T, int nkv, int hd,
                 int cap, int start, const i32* start_ptr, float scale) {
    kv_write_body<KV_F32>(k, cache, T, nkv, hd, cap, start, start_ptr, scale);
}

template <int HD, int KV>
ATLAS_DEV void attn_body(const float* __restrict__ q, const void* __restrict__ kc,
                         const void* __restrict__ vc, float kscale, float vscale,
                         float* __restrict__ out, float* __restrict__ part_o,
                         float* __restrict__ part_ml, int T, int nh, int nkv, int cap, int start,
                         const i32* start_ptr, int split_len) {
    const int KT = HD <= 128 ? 32 : 16;  // keys per tile (shared memory stays under 48 KB)
    const int LPK = ATLAS_WARP / KT;     // lanes per key in the score dot product
    // output dims per lane: lane + 32 * i; heads under 32 dims leave lanes >= HD idle
    const int DPL = HD >= ATLAS_WARP ? HD / ATLAS_WARP : 1;
    __shared__ float ks[KT][HD + 1];     // +1: lanes reading one dim of 32 keys hit 32 banks
    __shared__ float vs[KT][HD];
    __shared__ float qs[ATTN_ROWS][HD];
    if (start_ptr) start = *start_ptr;
    int lane = lane_id(), w = warp_id(), tid = threadIdx.x;
    int G = nh / nkv, hk = blockIdx.y, rpb = (int)(blockDim.x / ATLAS_WARP);  // rows per block
    int row = blockIdx.x * rpb + w;
    bool valid = row < T * G;
    int t = valid ? row / G : 0;
    int head = hk * G + (valid ? row % G : 0);
    int qpos = start + t;  // the last key this row sees
    float qscale = 1.0f / sqrtf((float)HD);
    for (int d = lane; d < HD; d += ATLAS_WARP)
        qs[w][d] = valid ? q[((long long)t * nh + head) * HD + d] * qscale : 0.0f;
    int last_row = min((int)(blockIdx.x * rpb + rpb - 1), T * G - 1);
    int len = start + last_row / G + 1;  // keys the block's last row sees (block-uniform)
    if (split_len == 0) {  // from the length: gridDim.z splits of at least ATTN_SPLIT_MIN keys
        int nz = (int)gridDim.z;
        split_len = max(ATTN_SPLIT_MIN, ((len + nz - 1) / nz + KT - 1) / KT * KT);
    }
    int k_begin = blockIdx.z * split_len;
    int k_end = min(k_begin + split_len, len);
    float m = -atlas_inf(), l = 0.0f, o[DPL];
#pragma unroll
    for (int i = 0; i < DPL; i++) o[i] = 0.0f;
    int j = lane % KT, part = lane / KT;
    for (int k0 = k_begin; k0 < k_end; k0 += KT) {
        __syncthreads();  // the previous tile (and qs on the first pass) is complete
        // 8 dims of one key per step, vector loads
        for (int e = tid; e < KT * (HD / 8); e += blockDim.x) {
            int jj = e / (HD / 8), d = (e % (HD / 8)) * 8, kk = k0 + jj;
            float kx[8], vx[8];
#pragma unroll
            for (int i = 0; i < 8; i++) kx[i] = vx[i] = 0.0f;
            if (kk < k_end) {
                long long idx = ((long long)hk * cap + kk) * HD + d;
                kv_load8<KV>(kc, idx, kx);
                kv_load8<KV>(vc, idx, vx);
            }
#pragma unroll
            for (int i = 0; i < 8; i++) {
                ks[jj][d + i] = kx[i] * kscale;
                vs[jj][d + i] = vx[i] * vscale;
            }
        }
        __syncthreads();
        float s = 0.0f;
#pragma unroll 8
        for (int d = part * (HD / LPK); d < (part + 1) * (HD / LPK); d++)
            s = fmaf(qs[w][d], ks[j][d], s);
        if (LPK == 2) s += warp_xor(s, 16);  // lanes j and j+16 held the two halves
        int kk = k0 + j;
        s = (valid && kk < k_end && kk <= qpos) ? s : -atlas_inf();
        float m_new = fmaxf(m, warp_max(s));
        if (m_new == -atlas_inf()) continue;  // nothing visible yet for this row (warp-uniform)
        float alpha = expf(m - m_new);
        float p = expf(s - m_new);
        l = l * alpha + warp_sum(lane < KT ? p : 0.0f);
#pragma unroll
        for (int i = 0; i < DPL; i++) o[i] *= alpha;
#pragma unroll 4
        for (int jj = 0; jj < KT; jj++) {
            float pj = warp_bcast(p, jj);
#pragma unroll
            for (int i = 0; i < DPL; i++)
                if (HD >= ATLAS_WARP || lane < HD)
                    o[i] = fmaf(pj, vs[jj][lane + ATLAS_WARP * i], o[i]);
        }
        m = m_new;
    }
    if (!valid) return;
    long long base = ((long long)t * nh + head) * HD;
    if (gridDim.z == 1) {
        float inv = l > 0.0f ? 1.0f / l : 0.0f;
#pragma unroll
        for (int i = 0; i < DPL; i++)
            if (HD >= ATLAS_WARP || lane < HD) out[base + lane + ATLAS_WARP * i] = o[i] * inv;
    } else {
        long long pb = (long long)blockIdx.z * T * nh * HD + base;
#pragma unroll
        for (int i = 0; i < DPL; i++)
            if (HD >= ATLAS_WARP || lane < HD) part_o[pb + lane + ATLAS_WARP * i] = o[i];
        if (lane == 0) {
            long long mb = ((long long)blockIdx.z * T * nh + (long long)t * nh + head) * 2;
            part_ml[mb] = m;
            part_ml[mb + 1] = l;
        }
    }
}

#define ATTN_ENTRY(HD, KVNAME, KV)                                                              \
    extern "C" __global__ void __launch_bounds__(256)                                           \
        attn_##KVNAME##_hd##HD(const float* __restrict__ q, const void* __restrict__ kc,        \
                               const void* __restrict__ vc, float kscale, float vscale,         \
                               float* __restrict__ out, float* __restrict__ part_o,             \
                               float* __restrict__ part_ml, int T, int nh, int nkv, int cap,    \
                               int start, const i32* start_ptr, int split_len) {                \
        attn_body<HD, KV>(q, kc, vc, kscale, vscale, out, part_o, part_ml, T, nh, nkv, cap,     \
                          start, start_ptr, split_len);                                         \
    }
#define ATTN_ENTRIES(HD) \
    ATTN_ENTRY(HD, bf16, KV_BF16) ATTN_ENTRY(HD, fp8, KV_FP8) ATTN_ENTRY(HD, f32, KV_F32)
ATTN_ENTRIES(8)  // tiny test models
ATTN_ENTRIES(16)
ATTN_ENTRIES(32)
ATTN_ENTRIES(64)
ATTN_ENTRIES(128)
ATTN_ENTRIES(256)

// (128, 1): without the minimum, ptxas caps the small fp8 variants at 80 registers and spills
#define ATTN_PREFILL_ENTRY(HD, KVNAME, KV)                                                      \
    extern "C" __global__ void __launch_bounds__(128, 1) attn_prefill_##KVNAME##_hd##HD(        \
        const float* __restrict__ q, const void* __restrict__ kc, const void* __restrict__ vc,  \
        float kscale, float vscale, float* __restrict__ out, float* __restrict__ part_o,        \
        float* __restrict__ part_ml, int T, int nh, int nkv, int cap, int start,                \
        const i32* start_ptr, int split_len) {                                                  \
        attn_prefill_body<HD, KV>(q, kc, vc, kscale, vscale, out, part_o, part_ml, T, nh, nkv,  \
                                  cap, start, start_ptr, split_len);                            \
    }
#define ATTN_PREFILL_ENTRIES(HD)                                                         \
    ATTN_PREFILL_ENTRY(HD, bf16, KV_BF16) ATTN_PREFILL_ENTRY(HD, fp8, KV_FP8)           \
        ATTN_PREFILL_ENTRY(HD, f32, KV_F32)
ATTN_PREFILL_ENTRIES(16)  // MMA k-steps are 16 dims: no hd 8 variant
ATTN_PREFILL_ENTRIES(32)
ATTN_PREFILL_ENTRIES(64)
ATTN_PREFILL_ENTRIES(128)
ATTN_PREFILL_ENTRIES(256)

extern "C" __global__ void __launch_bounds__(256)
    attn_combine(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                 float* __restrict__ out, int nsplit, int rows, int hd) {
    int r = blockIdx.x;  // (t, head) row
    float M = -atlas_inf();
    for (int z = 0; z < nsplit; z++) M = fmaxf(M, part_ml[((long long)z * rows + r) * 2]);
    float L = 0.0f;
    for (int z = 0; z < nsplit; z++) {
        float mz = part_ml[((long long)z * rows + r) * 2];
        if (mz != -atlas_inf()) L += part_ml[((long long)z * rows + r) * 2 + 1] * expf(mz - M);
    }
    float inv = L > 0.0f ? 1.0f / L : 0.0f;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float acc = 0.0f;
        for (int z = 0; z < nsplit; z++) {
            float mz = part_ml[((long long)z * rows + r) * 2];
            if (mz != -atlas_inf())
                acc = fmaf(part_o[((long long)z * rows + r) * hd + d], expf(mz - M), acc);
        }
        out[(long long)r * hd + d] = acc * inv;
    }
}
