// Row normalisations, one block per row, float32 in and out, statistics in float32.
#include "atlas_common.cuh"

// sum(x^2) over one row of n, every thread of the block gets it. `red`: 32 floats of shared.
ATLAS_DEV float row_sum_squares(const float* __restrict__ xr, int n, float* red) {
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss = fmaf(xr[i], xr[i], ss);
    return block_sum(ss, red);
}

// rms_norm: out = x * rsqrt(mean(x^2) + eps) * (w or 1 + w).  Reference: numpy_ref.rms_norm.
// x, out (rows, n); w (n). Grid (rows), block 256 (or any multiple of 32).
extern "C" __global__ void __launch_bounds__(256)
    rms_norm(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ out,
             int n, float eps, int unit_offset) {
    __shared__ float red[32];
    const float* xr = x + (long long)blockIdx.x * n;
    float* o = out + (long long)blockIdx.x * n;
    float ss = row_sum_squares(xr, n, red);
    float scale = rsqrtf(ss / (float)n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float wi = unit_offset ? 1.0f + w[i] : w[i];
        o[i] = xr[i] * scale * wi;
    }
}

// add_rms_norm: s = x + r (written to sum_out), out = rms_norm(s). The residual add fused into
// the next norm.  Reference: numpy_ref.add_rms_norm.
extern "C" __global__ void __launch_bounds__(256)
    add_rms_norm(const float* __restrict__ x, const float* __restrict__ r,
                 const float* __restrict__ w, float* __restrict__ sum_out,
                 float* __restrict__ out, int n, float eps, int unit_offset) {
    __shared__ float red[32];
    long long base = (long long)blockIdx.x * n;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float s = x[base + i] + r[base + i];
        sum_out[base + i] = s;
        ss = fmaf(s, s, ss);
    }
    ss = block_sum(ss, red);  // its __syncthreads also orders the sum_out writes below
    float scale = rsqrtf(ss / (float)n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float wi = unit_offset ? 1.0f + w[i] : w[i];
        out[base + i] = sum_out[base + i] * scale * wi;
    }
}

// l2norm: out = x * rsqrt(sum(x^2) + eps) per row of n.  Reference: numpy_ref.l2norm
// (Gated DeltaNet q and k). Grid (rows), block 32..256.
extern "C" __global__ void __launch_bounds__(256)
    l2norm(const float* __restrict__ x, float* __restrict__ out, int n, float eps) {
    __shared__ float red[32];
    const float* xr = x + (long long)blockIdx.x * n;
    float* o = out + (long long)blockIdx.x * n;
    float ss = row_sum_squares(xr, n, red);
    float scale = rsqrtf(ss + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) o[i] = xr[i] * scale;
}

// rms_norm_gated: out = rms_norm(x) * w * silu(z) per row of n (Qwen3.5 RMSNormGated, plain
// weight).  Reference: numpy_ref.rms_norm_gated.
extern "C" __global__ void __launch_bounds__(256)
    rms_norm_gated(const float* __restrict__ x, const float* __restrict__ z,
                   const float* __restrict__ w, float* __restrict__ out, int n, float eps) {
    __shared__ float red[32];
    long long base = (long long)blockIdx.x * n;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss = fmaf(x[base + i], x[base + i], ss);
    ss = block_sum(ss, red);
    float scale = rsqrtf(ss / (float)n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        out[base + i] = x[base + i] * scale * w[i] * siluf_(z[base + i]);
}
