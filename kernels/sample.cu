// Token selection on the device, so that only the token id comes back to the host.
//
// argmax: out[0] = the index of the largest logit (the lowest index among equals, as
//   np.argmax). logits (V) f32. Grid (1), block 1024.  Reference: numpy_ref.argmax.
// sample_topk_topp: the sampler chain of backend/sample.py (`filtered_distribution`, then
//   numpy's choice with the uniform number u): top-k (1 <= k <= 256), softmax at temperature
//   1, top-p prefix, min-p, then temperature; out[0] = the drawn id. The k best logits are found
//   with a 4-pass radix select over order-preserving keys, then bitonic-sorted in shared
//   memory. Grid (1), block 1024.
#include "atlas_common.cuh"

#define SAMPLE_KMAX 256

ATLAS_DEV u32 order_key(float f) {
    u32 b = __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

extern "C" __global__ void __launch_bounds__(1024)
    argmax(const float* __restrict__ logits, int V, i32* __restrict__ out) {
    __shared__ float sv[32];
    __shared__ int si[32];
    float best = -atlas_inf();
    int bi = 0x7fffffff;
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        float x = logits[i];
        if (x > best || (x == best && i < bi)) {
            best = x;
            bi = i;
        }
    }
#pragma unroll
    for (int o = ATLAS_WARP / 2; o > 0; o >>= 1) {
        float ov = warp_xor(best, o);
        int oi = warp_xor(bi, o);
        if (ov > best || (ov == best && oi < bi)) {
            best = ov;
            bi = oi;
        }
    }
    if (lane_id() == 0) {
        sv[warp_id()] = best;
        si[warp_id()] = bi;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int nw = blockDim.x / ATLAS_WARP;
        for (int w = 1; w < nw; w++)
            if (sv[w] > best || (sv[w] == best && si[w] < bi)) {
                best = sv[w];
                bi = si[w];
            }
        out[0] = bi == 0x7fffffff ? 0 : bi;
    }
}

extern "C" __global__ void __launch_bounds__(1024)
    sample_topk_topp(const float* __restrict__ logits, int V, int top_k, float top_p,
                     float min_p, float temperature, float u, i32* __restrict__ out) {
    __shared__ int hist[256];
    __shared__ u32 s_prefix, s_mask;
    __shared__ int s_need, s_above, s_ties;
    __shared__ float cv[SAMPLE_KMAX];
    __shared__ int ci[SAMPLE_KMAX];
    int tid = threadIdx.x;
    int k = top_k < 1 ? 1 : (top_k > SAMPLE_KMAX ? SAMPLE_KMAX : top_k);
    if (k > V) k = V;
    if (tid == 0) {
        s_prefix = 0u;
        s_mask = 0u;
        s_need = k;
    }
    // radix select: the key of the k-th largest logit, 8 bits per pass
    for (int pass = 0; pass < 4; pass++) {
        int shift = 24 - 8 * pass;
        for (int b = tid; b < 256; b += blockDim.x) hist[b] = 0;
        __syncthreads();
        u32 prefix = s_prefix, mask = s_mask;
        for (int i = tid; i < V; i += blockDim.x) {
            u32 key = order_key(logits[i]);
            if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1);
        }
        __syncthreads();
        if (tid == 0) {
            int need = s_need, above = 0;
            for (int b = 255; b >= 0; b--) {
                if (above + hist[b] >= need) {
                    s_prefix = prefix | ((u32)b << shift);
                    s_mask = mask | (255u << shift);
                    s_need = need - above;  // how many equal to the final key are still needed
                    break;
                }
                above += hist[b];
            }
        }
        __syncthreads();
    }
    u32 thr = s_prefix;
    int ties_wanted = s_need;
    for (int i = tid; i < SAMPLE_KMAX; i += blockDim.x) {
        cv[i] = -atlas_inf();
        ci[i] = 0x7fffffff;
    }
    if (tid == 0) {
        s_above = 0;
        s_ties = 0;
    }
    __syncthreads();
    for (int i = tid; i < V; i += blockDim.x) {
        float x = logits[i];
        u32 key = order_key(x);
        if (key > thr) {
            int p = atomicAdd(&s_above, 1);
            cv[p] = x;
            ci[p] = i;
        } else if (key == thr) {
            int p = atomicAdd(&s_ties, 1);
            if (p < ties_wanted) {
                cv[k - ties_wanted + p] = x;
                ci[k - ties_wanted + p] = i;
            }
        }
    }
    __syncthreads();
    // bitonic sort of the 256 slots: larger value first, then lower index
    for (int size = 2; size <= SAMPLE_KMAX; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int i = tid; i < SAMPLE_KMAX; i += blockDim.x) {
                int jx = i ^ stride;
                if (jx > i) {
                    bool desc = (i & size) == 0;
                    float a = cv[i], b = cv[jx];
                    int ia = ci[i], ib = ci[jx];
                    bool a_first = a > b || (a == b && ia < ib);
                    if (a_first != desc) {
                        cv[i] = b;
                        cv[jx] = a;
                        ci[i] = ib;
                        ci[jx] = ia;
                    }
                }
            }
            __syncthreads();
        }
    }
    if (tid == 0) {
        // softmax at temperature 1 over the k candidates (best first)
        float top = cv[0], total = 0.0f;
        for (int i = 0; i < k; i++) total += expf(cv[i] - top);
        int keep = k;
        if (top_p < 1.0f) {
            float cum = 0.0f;
            for (int i = 0; i < k; i++) {
                cum += expf(cv[i] - top) / total;
                if (cum >= top_p) {
                    keep = i + 1;
                    break;
                }
            }
        }
        if (min_p > 0.0f) {
            int n = 0;
            while (n < keep && expf(cv[n] - top) >= min_p) n++;  // p_i / p_0 >= min_p
            keep = n < 1 ? 1 : n;
        }
        float z = 0.0f;
        for (int i = 0; i < keep; i++) z += expf((cv[i] - top) / temperature);
        float target = u * z, cum = 0.0f;
        int pick = keep - 1;
        for (int i = 0; i < keep; i++) {
            cum += expf((cv[i] - top) / temperature);
            if (cum > target) {
                pick = i;
                break;
            }
        }
        out[0] = ci[pick];
    }
}
