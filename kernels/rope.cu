// rope: neox-style (rotate_half) rotary embedding of the first `rot` dims of each head, in
// place. x (T, nheads, hd) f32; positions (T) int32; inv_freq (rot/2) f32.
// Reference: numpy_ref.rope (angles = float32(pos) * inv_freq, then cos/sin).
// Grid (T, nheads), block 64..256: thread i rotates the pair (i, i + rot/2).
#include "atlas_common.cuh"

extern "C" __global__ void __launch_bounds__(256)
    rope(float* __restrict__ x, const i32* __restrict__ positions,
         const float* __restrict__ inv_freq, int nheads, int hd, int rot) {
    int t = blockIdx.x, h = blockIdx.y;
    float* xh = x + ((long long)t * nheads + h) * hd;
    float pos = (float)positions[t];
    int half = rot / 2;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float s, c;
        sincosf(pos * inv_freq[i], &s, &c);
        float x1 = xh[i], x2 = xh[i + half];
        xh[i] = x1 * c - x2 * s;
        xh[i + half] = x2 * c + x1 * s;
    }
}
