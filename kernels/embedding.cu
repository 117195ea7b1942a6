// embedding_<fmt>: out[t, :] = dequant(table[ids[t], :]).  Reference: numpy_ref.embedding.
// table: V rows in any weight format; ids (T,) int32; out (T, H) f32 (H % 32 == 0 but for plain formats).
// Grid (T), block 128: threads stride over the row's 32-element units.
#include "quant.cuh"

template <int F>
ATLAS_DEV void embedding_body(const u8* __restrict__ W, const u8* __restrict__ S, float gs,
                              const i32* __restrict__ ids, float* __restrict__ out, int H,
                              long long row_bytes, long long srow_bytes) {
    int t = blockIdx.x;
    long long r = ids[t];
    float* o = out + (long long)t * H;
    for (int u = threadIdx.x; u < units_of(H); u += blockDim.x) {
        float v[32];
        deq_unit<F>(W + r * row_bytes, S + r * srow_bytes, gs, u, H, v);
#pragma unroll
        for (int i = 0; i < 32; i++)
            if (32 * u + i < H) o[32 * u + i] = v[i];
    }
}

#define EMBEDDING_ENTRY(name, F)                                                                \
    extern "C" __global__ void __launch_bounds__(128)                                           \
        embedding_##name(const u8* __restrict__ W, const u8* __restrict__ S, float gs,          \
                         const i32* __restrict__ ids, float* __restrict__ out, int H,           \
                         long long row_bytes, long long srow_bytes) {                           \
        embedding_body<F>(W, S, gs, ids, out, H, row_bytes, srow_bytes);                        \
    }
ATLAS_FOR_EACH_FORMAT(EMBEDDING_ENTRY)
