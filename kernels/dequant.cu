// dequant_<fmt>: a whole weight to float32, exactly as the numpy reference dequantizes it.
// Reference: loaders/quant.py `dequantize` (GGUF), the loader's NVFP4 `dequantize`.
// W: rows x row_bytes; S: rows x srow_bytes (NVFP4 scales, else unused); out: rows x cols f32.
// Grid (ceil(ceil(cols/32)/256), rows), block 256: one thread per 32-element unit.
#include "quant.cuh"

template <int F>
ATLAS_DEV void dequant_body(const u8* __restrict__ W, const u8* __restrict__ S, float gs,
                            float* __restrict__ out, int rows, int cols, long long row_bytes,
                            long long srow_bytes) {
    int r = blockIdx.y;
    int u = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows || u >= units_of(cols)) return;
    float v[32];
    deq_unit<F>(W + r * row_bytes, S + r * srow_bytes, gs, u, cols, v);
    float* o = out + (long long)r * cols + 32 * u;
#pragma unroll
    for (int i = 0; i < 32; i++)
        if (32 * u + i < cols) o[i] = v[i];
}

#define DEQUANT_ENTRY(name, F)                                                                  \
    extern "C" __global__ void __launch_bounds__(256)                                           \
        dequant_##name(const u8* __restrict__ W, const u8* __restrict__ S, float gs,            \
                       float* __restrict__ out, int rows, int cols, long long row_bytes,        \
                       long long srow_bytes) {                                                  \
        dequant_body<F>(W, S, gs, out, rows, cols, row_bytes, srow_bytes);                      \
    }
ATLAS_FOR_EACH_FORMAT(DEQUANT_ENTRY)

// fp8_decode: all 256 E4M3 codes (or any list of codes) to float32; a test of the decoder the
// KV cache and NVFP4 scales use.
extern "C" __global__ void __launch_bounds__(256)
    fp8_decode(const u8* __restrict__ codes, float* __restrict__ out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = e4m3_to_f32(codes[i]);
}

// fp8_encode: float32 -> E4M3 codes (round to nearest even, saturating), as KV writes do.
extern "C" __global__ void __launch_bounds__(256)
    fp8_encode(const float* __restrict__ x, u8* __restrict__ out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = f32_to_e4m3(x[i]);
}

// bf16_encode: float32 -> bf16 bits (round to nearest even): weight and KV conversion.
extern "C" __global__ void __launch_bounds__(256)
    bf16_encode(const float* __restrict__ x, u16* __restrict__ out, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = f32_to_bf16(x[i]);
}
