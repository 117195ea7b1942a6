// gemv_<fmt>: y (T, rows) = x (T, cols) @ W^T (+ bias) for a few tokens (T <= GEMV_MAX_T): the
// decode-time linear layer, bound by reading W once. The weight is dequantized in registers,
// 32 elements (a unit) at a time; nothing is written back.  Reference: numpy_ref.linear on
// the dequantized weight (products within float32 rounding; the summation order differs).
// One logical warp per output row, 8 warps per block: grid (ceil(rows / 8)), block 256.
// gemv_t8_<fmt>: the same for 2 <= T <= 8 (an MTP verify): each lane keeps four units' loads in
// flight, as at T == 1, and multiplies each decoded unit with all T tokens.
//
// The row is swept in tiles of 32 units, one unit per lane, so a warp streams contiguous
// bytes. Per tile the block first issues its weight loads, then stages x for the tile in
// shared memory (read from global memory once per block, not once per row, with 16-byte
// loads), then every warp multiplies its row against it. A unit of x sits 36 floats apart in
// shared memory: the 16-byte reads of 8 lanes at a time hit distinct banks. A plain format's
// partial last unit (cols % 32 != 0, small models only) is read one element per lane.
// Rows that are 16-byte aligned (the allocators align buffers, and cols % 32 == 0 makes every
// row a multiple of 16 bytes) are read with 16-byte loads and decoded without branches
// (gemv.cuh), the block scales applied once per 16 elements; misaligned rows go through deq32
// (quant.cuh).
#include "gemv.cuh"

// TT: 1 (the decode step, T == 1 known at compile time) or GEMV_MAX_T (T read at run time).
// The deq32 path has only the second: one body per format keeps its registers unspilled.
// U: tiles per loop iteration. The 16-byte bodies take four (two for f32: each lane four or two
// lane units in flight); T == 1 stages their x at once, which divides the barriers and the loop
// per weight by as much, T <= 8 a tile at a time (gemv_tiles).
template <int F, int TT, bool VEC, int U>
ATLAS_DEV void gemv_body(const u8* __restrict__ W, const u8* __restrict__ S, float gs,
                         const float* __restrict__ x, const float* __restrict__ bias,
                         float* __restrict__ y, int T, int rows, int cols, long long row_bytes,
                         long long srow_bytes, atlas_f4* xs, float* xsum) {
    int r = blockIdx.x * GEMV_WARPS + warp_id();
    bool live = r < rows;  // a warp past the last row stages x, meets the barriers, reads row 0
    int lane = lane_id();
    const bool sums = VEC && GvFmt<F>::sums;
    bool x_aligned = TT == 1 || ((unsigned long long)x & 15ull) == 0;
    GvLane L = VEC ? gv_lane<F>(lane) : gv_lane<FMT_F32>(lane);
    GvRow row[1] = {{W + (long long)(live ? r : 0) * row_bytes,
                     S + (long long)(live ? r : 0) * srow_bytes, gs}};
    float acc[TT][2];  // per token: the A and B halves' accumulators
#pragma unroll
    for (int t = 0; t < TT; t++) acc[t][0] = acc[t][1] = 0.0f;
    int units = cols / 32, whole = units - units % (U * ATLAS_WARP);
    int unit0 = 0;
    GvStageX<TT, sums, true> whole_tiles = {x, T, cols, x_aligned};
    GvStageX<TT, sums, false> last_tiles = {x, T, cols, x_aligned};
    for (; unit0 < whole; unit0 += U * ATLAS_WARP)
        gemv_tiles<F, TT, 1, VEC, U, GV_WHOLE>(row, T, units, unit0, live, lane, L, xs, xsum,
                                               acc, whole_tiles);
    if (unit0 < units)  // the last, partial tiles
        gemv_tiles<F, TT, 1, VEC, U, GV_CHECKED>(row, T, units, unit0, live, lane, L, xs, xsum,
                                                 acc, last_tiles);
    int c = 32 * units + lane;  // a plain format's partial last unit (cols % 32 != 0)
    if (live && c < cols) {
        float wc = deq1<F>(row[0].w, c);
#pragma unroll
        for (int t = 0; t < TT; t++)
            if (TT == 1 || t < T) acc[t][0] = fmaf(wc, x[(long long)t * cols + c], acc[t][0]);
    }
    if (!live) return;
#pragma unroll
    for (int t = 0; t < TT; t++) {
        if (TT == 1 || t < T) {
            float sum = warp_sum(acc[t][0] + acc[t][1]) * gemv_row_scale<F, VEC>(gs);
            if (lane == 0) y[(long long)t * rows + r] = bias ? sum + bias[r] : sum;
        }
    }
}

// TOKENS 1: the T == 1 body; GEMV_MAX_T: T <= 8 (an MTP verify), its own entry point so that
// its registers (its 8 tokens' accumulators beside 4 tiles of weights in flight) do not cost the
// T == 1 body its occupancy. Each falls back to deq32 (any T) when a row or x is misaligned.
template <int F, int TOKENS>
ATLAS_DEV void gemv_entry(const u8* __restrict__ W, const u8* __restrict__ S, float gs,
                          const float* __restrict__ x, const float* __restrict__ bias,
                          float* __restrict__ y, int T, int rows, int cols, long long row_bytes,
                          long long srow_bytes) {
    __shared__ atlas_f4 xs[GEMV_MAX_T * GEMV_TILE_F4];
    __shared__ float xsum[GvFmt<F>::sums ? GEMV_MAX_T * 64 : 1];
    bool vec = gemv_aligned(W, S, row_bytes, srow_bytes, F);
    bool x_aligned = ((unsigned long long)x & 15ull) == 0;  // the 16-byte bodies assume it
    if (vec && x_aligned && (TOKENS > 1 || T == 1))
        gemv_body<F, TOKENS, true, F == FMT_F32 ? 2 : 4>(W, S, gs, x, bias, y, T, rows, cols,
                                                         row_bytes, srow_bytes, xs, xsum);
    else
        gemv_body<F, GEMV_MAX_T, false, 1>(W, S, gs, x, bias, y, T, rows, cols, row_bytes,
                                           srow_bytes, xs, xsum);
}

// Blocks of 256 threads an SM should hold at once: the register budget the compiler gets
// (scripts/gpu_bench.py's `gemv_blocks` section times each choice).
#ifndef GEMV_MIN_BLOCKS
#define GEMV_MIN_BLOCKS 1
#endif

#define GEMV_ENTRY(name, F)                                                                     \
    extern "C" __global__ void __launch_bounds__(256, GEMV_MIN_BLOCKS)                          \
        gemv_##name(const u8* __restrict__ W, const u8* __restrict__ S, float gs,               \
                    const float* __restrict__ x, const float* __restrict__ bias,                \
                    float* __restrict__ y, int T, int rows, int cols, long long row_bytes,      \
                    long long srow_bytes) {                                                     \
        gemv_entry<F, 1>(W, S, gs, x, bias, y, T, rows, cols, row_bytes, srow_bytes);           \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(256, 1)                                        \
        gemv_t8_##name(const u8* __restrict__ W, const u8* __restrict__ S, float gs,            \
                       const float* __restrict__ x, const float* __restrict__ bias,             \
                       float* __restrict__ y, int T, int rows, int cols, long long row_bytes,   \
                       long long srow_bytes) {                                                  \
        gemv_entry<F, GEMV_MAX_T>(W, S, gs, x, bias, y, T, rows, cols, row_bytes, srow_bytes);  \
    }
ATLAS_FOR_EACH_FORMAT(GEMV_ENTRY)
