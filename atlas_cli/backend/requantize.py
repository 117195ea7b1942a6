"""A float weight matrix requantized at load time, for `ATLAS_LM_HEAD`: the 27B's lm_head is a
bf16 matrix of 248,320 x 5,120 (2.5 GB, ~15% of the bytes a decode step reads in an NVFP4
checkpoint); Q8_0 halves it (KL ~1e-5 on real models' logits), NVFP4 quarters it.

Q8_0 through the `gguf` package's own quantizer (llama.cpp's: f16 scale amax / 127 per 32,
int8 codes rounded to nearest); NVFP4 as NVIDIA's modelopt quantizes: a float32 global scale
amax / (448 * 6), an E4M3 scale per 16 columns (amax / 6 over the global scale, nearest, ties
to even), E2M1 codes (nearest, ties to the even code, saturating at 6)."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from atlas_cli.backend.loaders.gguf import QuantizedTensor
from atlas_cli.backend.loaders.safetensors import E4M3_VALUES, NVFP4Tensor

FORMATS = ("q8_0", "nvfp4")


def requantize(w: np.ndarray, fmt: str):
    """`w` (rows, cols) float32 as a weight of `fmt` the loaders' classes hold."""
    w = np.ascontiguousarray(w, np.float32)
    if fmt == "q8_0":
        blocks = quantize(w, GGMLQuantizationType.Q8_0)
        return QuantizedTensor(int(GGMLQuantizationType.Q8_0), w.shape, blocks)
    if fmt == "nvfp4":
        return _nvfp4(w)
    raise ValueError(f"cannot requantize to {fmt!r} (one of {', '.join(FORMATS)})")


def e4m3_codes(x: np.ndarray) -> np.ndarray:
    """Non-negative float32 -> the nearest E4M3 code (ties to the even code), saturating at 448."""
    table = E4M3_VALUES[:127].astype(np.float64)  # codes 0..126, ascending
    x = np.minimum(np.asarray(x, np.float64), table[-1])
    hi = np.clip(np.searchsorted(table, x), 1, 126)
    lo = hi - 1
    d_lo, d_hi = x - table[lo], table[hi] - x
    pick = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(lo % 2 == 0, lo, hi)))
    return pick.astype(np.uint8)


def e2m1_codes(v: np.ndarray) -> np.ndarray:
    """float32 -> E2M1 code: |v| to the nearest of 0, .5, 1, 1.5, 2, 3, 4, 6 (ties to the even
    code, saturating), bit 3 the sign."""
    a = np.abs(v)
    bounds = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False))
    bounds += ((3.5, True), (5.0, False))  # (midpoint, whether the tie goes up)
    i = sum(((a >= m) if up else (a > m)).astype(np.uint8) for m, up in bounds)
    return (i | np.where(v < 0, 8, 0)).astype(np.uint8)


def _nvfp4(w: np.ndarray) -> NVFP4Tensor:
    rows, cols = w.shape
    if cols % 16:
        raise ValueError(f"NVFP4 needs whole 16-column blocks, got {cols} columns")
    amax = float(np.abs(w).max())
    gs = np.float32(amax / (448 * 6) if amax > 0 else 1.0)
    blocks = w.reshape(rows, cols // 16, 16)
    scales = e4m3_codes(np.abs(blocks).max(-1) / (np.float32(6) * gs))
    d = (E4M3_VALUES[scales] * gs).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        codes = e2m1_codes((blocks / d[..., None]).astype(np.float32))
    codes = np.where(d[..., None] > 0, codes, 0).astype(np.uint8).reshape(rows, cols)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)  # low nibble: even column
    return NVFP4Tensor(packed, scales, float(gs))
