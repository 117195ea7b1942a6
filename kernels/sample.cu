// Token selection on the device, so that only the token id comes back to the host.
//
// argmax: out[0] = the index of the largest logit (the lowest index among equals, as
//   np.argmax). logits (V) f32. Grid (1), block 1024.  Reference: numpy_ref.argmax.
// sample_topk_topp: the sampler chain of backend/sample.py (`filtered_distribution`, then
//   numpy's choice with the uniform number u): top-k (1 <= k <= 256), softmax at temperature
//   1, top-p prefix, min-p, then temperature; out[0] = the drawn id. The k best logits are found
//   with a 4-pass radix select over order-preserving keys, then bitonic-sorted in shared
//   memory. Grid (1), block 1024.
// sample_chain: the whole of backend/sample.py's `Sampler` for one token, reading everything
//   from device memory so that a generation uploads once and reads back 8 bytes per token:
//   the non-finite check of the raw logits (engine.check_finite), the repeat and presence
//   penalties over the ring buffer `hist` of the last tokens (rewritten into `logits` in
//   place), then argmax (temperature 0) or top-k / top-p / min-p / temperature and the draw with
//   uniforms[state[0]] (the host draws them from the CPU Sampler's own RNG stream). The
//   probabilities are float64, as numpy's. dp: temperature, top_p, min_p, repeat_penalty,
//   presence_penalty; ip: top_k (1..256), ring capacity, number of uniforms; state: step (the
//   next uniform), tokens in the ring, the ring's next slot. out[0] = the token (also appended
//   to the ring), out[1] = 1 when a logit is NaN or Inf (nothing else is done then), 2 when the
//   uniforms ran out. Grid (1), block 512.
//   With a grammar (backend/constraint.py) the host checks the drawn token; one the grammar
//   rejects is drawn again, as Sampler does: `redraw` = 1 with `mask`, the grammar's bitmask
//   (bit i of word i / 32: token i allowed; tokens past nmask words are not), skips the finite
//   check and the penalties (already applied in place), sets every token the mask forbids to
//   -inf, draws with the next uniform and puts the token in the rejected one's ring slot.
#include "atlas_common.cuh"

#define SAMPLE_KMAX 256

ATLAS_DEV u32 order_key(float f) {
    u32 b = __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// The index of the largest logit (lowest index among equals), valid in thread 0; every thread
// of the block calls it. sv / si: 32 shared slots each.
ATLAS_DEV int block_argmax(const float* __restrict__ logits, int V, float* sv, int* si) {
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
    }
    return bi == 0x7fffffff ? 0 : bi;
}

extern "C" __global__ void __launch_bounds__(1024)
    argmax(const float* __restrict__ logits, int V, i32* __restrict__ out) {
    __shared__ float sv[32];
    __shared__ int si[32];
    int bi = block_argmax(logits, V, sv, si);
    if (threadIdx.x == 0) out[0] = bi;
}

struct TopKScratch {
    int hist[256];
    u32 prefix, mask;
    int need, above, ties;
};

// The k (1..SAMPLE_KMAX) largest logits into cv / ci, best first (lower index first among
// equals); every thread of the block calls it.
ATLAS_DEV void top_k_sorted(const float* __restrict__ logits, int V, int k, TopKScratch& s,
                            float* cv, int* ci) {
    int tid = threadIdx.x;
    if (tid == 0) {
        s.prefix = 0u;
        s.mask = 0u;
        s.need = k;
    }
    // radix select: the key of the k-th largest logit, 8 bits per pass
    for (int pass = 0; pass < 4; pass++) {
        int shift = 24 - 8 * pass;
        for (int b = tid; b < 256; b += blockDim.x) s.hist[b] = 0;
        __syncthreads();
        u32 prefix = s.prefix, mask = s.mask;
        for (int i = tid; i < V; i += blockDim.x) {
            u32 key = order_key(logits[i]);
            if ((key & mask) == prefix) atomicAdd(&s.hist[(key >> shift) & 255u], 1);
        }
        __syncthreads();
        if (tid == 0) {
            int need = s.need, above = 0;
            for (int b = 255; b >= 0; b--) {
                if (above + s.hist[b] >= need) {
                    s.prefix = prefix | ((u32)b << shift);
                    s.mask = mask | (255u << shift);
                    s.need = need - above;  // how many equal to the final key are still needed
                    break;
                }
                above += s.hist[b];
            }
        }
        __syncthreads();
    }
    u32 thr = s.prefix;
    int ties_wanted = s.need;
    for (int i = tid; i < SAMPLE_KMAX; i += blockDim.x) {
        cv[i] = -atlas_inf();
        ci[i] = 0x7fffffff;
    }
    if (tid == 0) {
        s.above = 0;
        s.ties = 0;
    }
    __syncthreads();
    for (int i = tid; i < V; i += blockDim.x) {
        float x = logits[i];
        u32 key = order_key(x);
        if (key > thr) {
            int p = atomicAdd(&s.above, 1);
            cv[p] = x;
            ci[p] = i;
        } else if (key == thr) {
            int p = atomicAdd(&s.ties, 1);
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
}

extern "C" __global__ void __launch_bounds__(1024)
    sample_topk_topp(const float* __restrict__ logits, int V, int top_k, float top_p,
                     float min_p, float temperature, float u, i32* __restrict__ out) {
    __shared__ TopKScratch scratch;
    __shared__ float cv[SAMPLE_KMAX];
    __shared__ int ci[SAMPLE_KMAX];
    int tid = threadIdx.x;
    int k = top_k < 1 ? 1 : (top_k > SAMPLE_KMAX ? SAMPLE_KMAX : top_k);
    if (k > V) k = V;
    top_k_sorted(logits, V, k, scratch, cv, ci);
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

ATLAS_DEV bool is_finite(float x) { return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u; }

// sample.py's apply_repeat_penalty then apply_presence_penalty, on each distinct id of the ring
// once (thread 0): the repeat penalty in float64 clipped to float32's range, the presence
// penalty in float32 (numpy subtracts a Python float from a float32 array in float32).
ATLAS_DEV void apply_penalties(float* logits, const double* dp, const i32* hist, int n) {
    double repeat = dp[3];
    float presence = (float)dp[4];
    const double limit = 3.4028234663852886e38;  // FLT_MAX
    for (int j = 0; j < n; j++) {
        int id = hist[j];
        bool seen = false;
        for (int e = 0; e < j && !seen; e++) seen = hist[e] == id;
        if (seen) continue;
        if (repeat != 1.0) {
            double x = (double)logits[id];
            double r = x > 0 ? x / repeat : x * repeat;
            logits[id] = (float)(r > limit ? limit : (r < -limit ? -limit : r));
        }
        if (presence != 0.0f) logits[id] = logits[id] - presence;
    }
}

// filtered_distribution on the k sorted candidates, then numpy's choice with uniform u: the
// cdf of the probabilities, normalised by its last entry, searched for the first entry > u.
ATLAS_DEV int draw_candidate(const float* cv, int k, const double* dp, double u) {
    double temperature = dp[0], top_p = dp[1], min_p = dp[2];
    double top = (double)cv[0], total = 0.0;
    for (int i = 0; i < k; i++) total += exp((double)cv[i] - top);
    int keep = k;
    if (top_p < 1.0) {
        double cum = 0.0;
        for (int i = 0; i < k; i++) {
            cum += exp((double)cv[i] - top) / total;
            if (cum >= top_p) {
                keep = i + 1;
                break;
            }
        }
    }
    if (min_p > 0.0) {
        double floor = min_p * (1.0 / total);  // min_p * probs[0]
        int n = 0;
        while (n < keep && exp((double)cv[n] - top) / total >= floor) n++;
        keep = n;
    }
    double z = 0.0;
    for (int i = 0; i < keep; i++) z += exp(((double)cv[i] - top) / temperature);
    double cdf = 0.0, last = 0.0;
    for (int i = 0; i < keep; i++) last += exp(((double)cv[i] - top) / temperature) / z;
    for (int i = 0; i < keep; i++) {
        cdf += exp(((double)cv[i] - top) / temperature) / z;
        if (cdf / last > u) return i;
    }
    return keep - 1;
}

// 512 threads: thread 0's float64 draw needs more registers than a 1024-thread block leaves
extern "C" __global__ void __launch_bounds__(512)
    sample_chain(float* __restrict__ logits, int V, const double* __restrict__ dp,
                 const i32* __restrict__ ip, const double* __restrict__ uniforms,
                 i32* __restrict__ state, i32* __restrict__ hist, i32* __restrict__ out,
                 const u32* __restrict__ mask, int nmask, int redraw) {
    __shared__ int s_bad;
    __shared__ float sv[32];
    __shared__ int si[32];
    __shared__ TopKScratch scratch;
    __shared__ float cv[SAMPLE_KMAX];
    __shared__ int ci[SAMPLE_KMAX];
    int tid = threadIdx.x;
    int cap = ip[1], count = state[1];
    if (redraw) {
        for (int i = tid; i < V; i += blockDim.x) {
            bool allowed = (i >> 5) < nmask && ((mask[i >> 5] >> (i & 31)) & 1u);
            if (!allowed) logits[i] = -atlas_inf();
        }
        __syncthreads();
    } else {
        if (tid == 0) s_bad = 0;
        __syncthreads();
        int bad = 0;
        for (int i = tid; i < V; i += blockDim.x) bad |= !is_finite(logits[i]);
        if (bad) atomicAdd(&s_bad, 1);
        __syncthreads();
        if (s_bad) {
            if (tid == 0) {
                out[0] = 0;
                out[1] = 1;
            }
            return;
        }
        if (tid == 0 && count > 0) apply_penalties(logits, dp, hist, count);
        __syncthreads();
    }
    int token, flag = 0;
    if (dp[0] == 0.0) {
        token = block_argmax(logits, V, sv, si);
    } else {
        int k = ip[0] < 1 ? 1 : (ip[0] > SAMPLE_KMAX ? SAMPLE_KMAX : ip[0]);
        if (k > V) k = V;
        top_k_sorted(logits, V, k, scratch, cv, ci);
        token = 0;
        if (tid == 0) {
            int step = state[0];
            if (step < ip[2]) {
                token = ci[draw_candidate(cv, k, dp, uniforms[step])];
                state[0] = step + 1;
            } else {
                flag = 2;
            }
        }
    }
    if (tid == 0) {
        out[0] = token;
        out[1] = flag;
        int slot = state[2];
        if (redraw) {  // the rejected token's slot: the ring then holds what it would have
            hist[slot == 0 ? cap - 1 : slot - 1] = token;
        } else {
            hist[slot] = token;
            state[2] = slot + 1 == cap ? 0 : slot + 1;
            state[1] = count < cap ? count + 1 : cap;
        }
    }
}
