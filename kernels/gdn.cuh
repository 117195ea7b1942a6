// The gated delta rule's per-token update, shared by gdn_recurrent (gdn.cu) and gdn_decode
// (decode.cu). Thread (part, j) of a value head's block holds rows part*R..part*R+R-1 of
// column j of the state S in registers, already multiplied by the token's decay; np parts.
// kv = k.S, delta = (v - kv) * beta, S += k (x) delta; returns this thread's part of
// o = q.S (the caller sums the np parts). `red` holds np * dv floats; two barriers inside,
// so every thread of the block must call it.
#pragma once
#include "atlas_common.cuh"

template <int RMAX>
ATLAS_DEV float gdn_delta_update(float (&S)[RMAX], const float* ksh, const float* qsh,
                                 const float* vsh, float* red, float b, int part, int R, int j,
                                 int dv, int np, int tid, bool active) {
    float kvp = 0.0f;
#pragma unroll
    for (int r = 0; r < RMAX; r++)
        if (active && r < R) kvp = fmaf(ksh[part * R + r], S[r], kvp);
    if (active) red[tid] = kvp;
    __syncthreads();
    float kv = 0.0f;
    for (int p = 0; p < np; p++) kv += red[p * dv + j];
    float delta = active ? (vsh[j] - kv) * b : 0.0f;
    float op = 0.0f;
#pragma unroll
    for (int r = 0; r < RMAX; r++) {
        if (active && r < R) {
            S[r] = fmaf(ksh[part * R + r], delta, S[r]);
            op = fmaf(qsh[part * R + r], S[r], op);
        }
    }
    __syncthreads();  // every thread has read red for kv
    return op;
}
