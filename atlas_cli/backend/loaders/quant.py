"""Vectorised numpy dequantization of GGUF tensor data to float32.

Every supported type is bit-exact against ``gguf.quants.dequantize`` (gguf 0.19): the float32
operations are done in the same order as there (and as in ggml's ``dequantize_row_*``), because
float multiplication and addition do not reassociate exactly. The integer unpacking is free to
differ, and does, for speed: nibbles are unpacked with uint8 arithmetic straight into the
preallocated output, and big tensors are processed in cache-sized chunks of blocks.

This module needs numpy only (not the ``gguf`` package). Block layouts: docs/formats.md.
"""

from __future__ import annotations

from collections.abc import Callable
from math import prod

import numpy as np

import atlas_cli.backend.formats as formats
from atlas_cli.backend.formats import WeightFormat

__all__ = [
    "GGML_TYPES",
    "UnsupportedQuantError",
    "dequantize",
    "dequantize_blocks",
]


class UnsupportedQuantError(ValueError):
    """The ggml tensor type has no dequantizer here."""


K_SCALE_SIZE = 12  # bytes of packed 6-bit scales/mins in Q4_K and Q5_K

GGML_TYPES: dict[int, WeightFormat] = formats.GGML  # the types dequantize() reads

# Blocks per chunk in dequantize(): big enough to amortise numpy call overhead, small enough
# that the chunk's temporaries stay in cache (about 1 MiB of float32 output per chunk).
_CHUNK_ELEMS = 1 << 18


def _quant_type(type_id: int) -> WeightFormat:
    qt = GGML_TYPES.get(int(type_id))
    if qt is None:
        supported = ", ".join(f"{q.name} ({i})" for i, q in sorted(GGML_TYPES.items()))
        raise UnsupportedQuantError(
            f"cannot dequantize ggml type {formats.ggml_type_name(int(type_id))} "
            f"(id {int(type_id)}); "
            f"supported types: {supported}"
        )
    return qt


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The f16 field at byte ``start`` of every block, as a float32 column [n, 1]."""
    return blocks[:, start : start + 2].view(np.float16).astype(np.float32)


# --- per-type kernels: blocks [n, block_bytes] uint8 (C-contiguous) -> out [n, block_elems] f32

_Kernel = Callable[[np.ndarray, np.ndarray], None]
_BY_FORMAT: dict[str, _Kernel] = {}


def _dequantizer(fmt: WeightFormat) -> Callable[[_Kernel], _Kernel]:
    def register(kernel: _Kernel) -> _Kernel:
        _BY_FORMAT[fmt.kernel] = kernel
        return kernel

    return register


@_dequantizer(formats.F32)
def _deq_f32(blocks: np.ndarray, out: np.ndarray) -> None:
    out[:] = blocks.view(np.float32)


@_dequantizer(formats.F16)
def _deq_f16(blocks: np.ndarray, out: np.ndarray) -> None:
    out[:] = blocks.view(np.float16)


@_dequantizer(formats.BF16)
def _deq_bf16(blocks: np.ndarray, out: np.ndarray) -> None:
    # bf16 is the top half of an f32: shift the bits up, keeping NaN payloads as gguf does.
    bits = out.view(np.uint32)
    bits[:] = blocks.view(np.uint16)
    bits <<= 16


def _unpack_nibbles32(qs: np.ndarray, q: np.ndarray) -> None:
    """qs [n, 16] -> q [n, 32]: low nibbles are elements 0..15, high nibbles 16..31."""
    np.bitwise_and(qs, 15, out=q[:, :16])
    np.right_shift(qs, 4, out=q[:, 16:])


@_dequantizer(formats.Q4_0)
def _deq_q4_0(blocks: np.ndarray, out: np.ndarray) -> None:
    d = _f16(blocks, 0)
    q = np.empty(out.shape, dtype=np.uint8)
    _unpack_nibbles32(blocks[:, 2:], q)
    qi = q.view(np.int8)
    qi -= 8  # the exact integer q - 8 first, then d * (q - 8) as gguf does
    np.multiply(d, qi, out=out)


@_dequantizer(formats.Q4_1)
def _deq_q4_1(blocks: np.ndarray, out: np.ndarray) -> None:
    d = _f16(blocks, 0)
    m = _f16(blocks, 2)
    q = np.empty(out.shape, dtype=np.uint8)
    _unpack_nibbles32(blocks[:, 4:], q)
    np.multiply(d, q, out=out)  # (d * q) + m, rounded after each step
    out += m


def _unpack_q5(blocks: np.ndarray, qh_at: int, q: np.ndarray) -> None:
    """The 5-bit codes of Q5_0/Q5_1 blocks into q [n, 32]: the nibbles of the 16 bytes after
    the 32-bit little-endian qh word at ``qh_at``, bit 4 of element i from bit i of qh."""
    _unpack_nibbles32(blocks[:, qh_at + 4 :], q)
    high = np.unpackbits(blocks[:, qh_at : qh_at + 4], axis=1, bitorder="little")
    high <<= 4
    q |= high


@_dequantizer(formats.Q5_0)
def _deq_q5_0(blocks: np.ndarray, out: np.ndarray) -> None:
    d = _f16(blocks, 0)
    q = np.empty(out.shape, dtype=np.uint8)
    _unpack_q5(blocks, 2, q)
    qi = q.view(np.int8)
    qi -= 16  # the exact integer q - 16 first, then d * (q - 16) as gguf does
    np.multiply(d, qi, out=out)


@_dequantizer(formats.Q5_1)
def _deq_q5_1(blocks: np.ndarray, out: np.ndarray) -> None:
    d = _f16(blocks, 0)
    m = _f16(blocks, 2)
    q = np.empty(out.shape, dtype=np.uint8)
    _unpack_q5(blocks, 4, q)
    np.multiply(d, q, out=out)  # (d * q) + m, rounded after each step
    out += m


@_dequantizer(formats.Q8_0)
def _deq_q8_0(blocks: np.ndarray, out: np.ndarray) -> None:
    d = _f16(blocks, 0)
    np.multiply(blocks[:, 2:].view(np.int8), d, out=out)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unpack the 12-byte 6-bit scales/mins of Q4_K/Q5_K into two [n, 8] uint8 arrays.

    Sub-blocks 0..3 take the low 6 bits of bytes 0..3 (scale) and 4..7 (min); sub-blocks 4..7
    take a nibble of bytes 8..11 plus the top 2 bits of bytes 0..3 / 4..7 (ggml
    ``get_scale_min_k4``).
    """
    s = scales.reshape(-1, 3, 4)
    lo, hi, mix = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([lo & 63, (mix & 15) | ((lo >> 6) << 4)], axis=1)
    mn = np.concatenate([hi & 63, (mix >> 4) | ((hi >> 6) << 4)], axis=1)
    return sc, mn


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-sub-block float32 (d * sc, dmin * m), each [n, 8, 1], in gguf's rounding order."""
    d = _f16(blocks, 0)
    dmin = _f16(blocks, 2)
    sc, mn = _k_scale_min(blocks[:, 4 : 4 + K_SCALE_SIZE])
    dsc = (d * sc.astype(np.float32))[:, :, None]
    dm = (dmin * mn.astype(np.float32))[:, :, None]
    return dsc, dm


@_dequantizer(formats.Q4_K)
def _deq_q4_k(blocks: np.ndarray, out: np.ndarray) -> None:
    n = blocks.shape[0]
    dsc, dm = _k_scales(blocks)
    # qs[32c + l] holds sub-block 2c in its low nibble and sub-block 2c+1 in its high nibble.
    qs = blocks[:, 16:].reshape(n, 4, 32)
    q = np.empty((n, 4, 2, 32), dtype=np.uint8)
    np.bitwise_and(qs, 15, out=q[:, :, 0])
    np.right_shift(qs, 4, out=q[:, :, 1])
    o = out.reshape(n, 8, 32)
    np.multiply(dsc, q.reshape(n, 8, 32), out=o)  # (d * sc) * q - dmin * m
    o -= dm


@_dequantizer(formats.Q5_K)
def _deq_q5_k(blocks: np.ndarray, out: np.ndarray) -> None:
    n = blocks.shape[0]
    dsc, dm = _k_scales(blocks)
    qh = blocks[:, 16:48]
    qs = blocks[:, 48:].reshape(n, 4, 32)
    q = np.empty((n, 4, 2, 32), dtype=np.uint8)
    np.bitwise_and(qs, 15, out=q[:, :, 0])
    np.right_shift(qs, 4, out=q[:, :, 1])
    q8 = q.reshape(n, 8, 32)
    # The 5th bit of sub-block i is bit i of qh[l]; loop over the 8 sub-blocks only.
    hbit = np.empty((n, 32), dtype=np.uint8)
    for i in range(8):
        np.right_shift(qh, i, out=hbit)
        hbit &= 1
        hbit <<= 4
        q8[:, i] |= hbit
    o = out.reshape(n, 8, 32)
    np.multiply(dsc, q8, out=o)
    o -= dm


@_dequantizer(formats.Q6_K)
def _deq_q6_k(blocks: np.ndarray, out: np.ndarray) -> None:
    n = blocks.shape[0]
    ql = blocks[:, :128].reshape(n, 2, 2, 32)  # [half, ql[l] / ql[l+32], l]
    qh = blocks[:, 128:192].reshape(n, 2, 32)  # [half, l]
    scales = blocks[:, 192:208].view(np.int8).astype(np.float32)  # [n, 16]
    d = _f16(blocks, 208)
    dsc = (d * scales)[:, :, None]  # (d * sc) first, then times q, as gguf does
    # Per half: chunk k=0..3 is y[32k + l]; its low 4 bits are the low (k<2) or high (k>=2)
    # nibble of ql[l + 32*(k%2)], its top 2 bits are bits 2k..2k+1 of qh[l].
    q = np.empty((n, 2, 4, 32), dtype=np.uint8)
    np.bitwise_and(ql, 15, out=q[:, :, 0:2])
    np.right_shift(ql, 4, out=q[:, :, 2:4])
    hbits = np.empty((n, 2, 32), dtype=np.uint8)
    for k in range(4):
        np.right_shift(qh, 2 * k, out=hbits)
        hbits &= 3
        hbits <<= 4
        q[:, :, k] |= hbits
    qi = q.view(np.int8)
    qi -= 32
    np.multiply(dsc, qi.reshape(n, 16, 16), out=out.reshape(n, 16, 16))


@_dequantizer(formats.Q2_K)
def _deq_q2_k(blocks: np.ndarray, out: np.ndarray) -> None:
    n = blocks.shape[0]
    scales = blocks[:, :16]  # per 16 elements: the scale in the low nibble, the min in the high
    d, dmin = _f16(blocks, 80), _f16(blocks, 82)
    dl = (d * (scales & 15).astype(np.float32))[:, :, None]  # (d * sc) * q - (dmin * m)
    ml = (dmin * (scales >> 4).astype(np.float32))[:, :, None]
    # Per 128-element half h: element 32k + l is bits 2k..2k+1 of qs[32h + l].
    qs = blocks[:, 16:80].reshape(n, 2, 32)
    q = np.empty((n, 2, 4, 32), dtype=np.uint8)
    for k in range(4):
        np.right_shift(qs, 2 * k, out=q[:, :, k])
    q &= 3
    o = out.reshape(n, 16, 16)
    np.multiply(dl, q.reshape(n, 16, 16), out=o)
    o -= ml


def _scales_6bit(low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """float32 scales of Q3_K/IQ4_XS sub-blocks: the 4 low bits `low` and 2 high bits `high`
    (both uint8, unmasked above them) as a 6-bit code minus 32."""
    codes = (low & 15) | ((high & 3) << 4)
    return (codes.view(np.int8) - np.int8(32)).astype(np.float32)


@_dequantizer(formats.Q3_K)
def _deq_q3_k(blocks: np.ndarray, out: np.ndarray) -> None:
    n = blocks.shape[0]
    hmask, s, d = blocks[:, :32], blocks[:, 96:108], _f16(blocks, 108)
    # Scale j (per 16 elements): the low nibble of s[j] (j < 8) or high nibble of s[j - 8],
    # then bits 2k..2k+1 of s[8 + i] for j = 4k + i.
    low = np.concatenate([s[:, :8], s[:, :8] >> 4], axis=1)
    high = s[:, None, 8:12] >> (2 * np.arange(4, dtype=np.uint8))[:, None]
    dl = (d * _scales_6bit(low, high.reshape(n, 16)))[:, :, None]
    # Element 32c + l (c = 0..7): bits 2(c%4).. of qs[32(c//4) + l], minus 4 where bit c of
    # hmask[l] is clear.
    qs = blocks[:, 32:96].reshape(n, 2, 32)
    q = np.empty((n, 2, 4, 32), dtype=np.uint8)
    for k in range(4):
        np.right_shift(qs, 2 * k, out=q[:, :, k])
    q &= 3
    q8 = q.reshape(n, 8, 32)
    clear = np.empty((n, 32), dtype=np.uint8)
    for c in range(8):
        np.right_shift(hmask, c, out=clear)
        clear &= 1
        clear ^= 1
        clear <<= 2
        q8[:, c] -= clear  # wraps: the int8 view below holds q - 4 in -4..-1
    np.multiply(dl, q.view(np.int8).reshape(n, 16, 16), out=out.reshape(n, 16, 16))


# IQ4_NL / IQ4_XS: each 4-bit code indexes these (non-linear) int8 values (ggml kvalues_iq4nl).
IQ4_VALUES = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32
)


@_dequantizer(formats.IQ4_NL)
def _deq_iq4_nl(blocks: np.ndarray, out: np.ndarray) -> None:
    d = _f16(blocks, 0)
    q = np.empty(out.shape, dtype=np.uint8)
    _unpack_nibbles32(blocks[:, 2:], q)  # nibbles in Q4_0's order
    np.multiply(d, IQ4_VALUES[q], out=out)


@_dequantizer(formats.IQ4_XS)
def _deq_iq4_xs(blocks: np.ndarray, out: np.ndarray) -> None:
    n = blocks.shape[0]
    d = _f16(blocks, 0)
    # Sub-block j (32 elements): the low bits of its scale are nibble j % 2 of byte 4 + j // 2,
    # the high bits are bits 2j..2j+1 of the little-endian uint16 at byte 2.
    low = np.stack([blocks[:, 4:8], blocks[:, 4:8] >> 4], axis=2).reshape(n, 8)
    scales_h = blocks[:, 2:4].view(np.uint16)
    high = (scales_h >> (2 * np.arange(8, dtype=np.uint16))).astype(np.uint8)
    dl = (d * _scales_6bit(low, high))[:, :, None]  # (d * scale) * value
    qs = blocks[:, 8:].reshape(n, 8, 16)  # sub-block j: nibbles of 16 bytes, Q4_0's order
    q = np.empty((n, 8, 2, 16), dtype=np.uint8)
    np.bitwise_and(qs, 15, out=q[:, :, 0])
    np.right_shift(qs, 4, out=q[:, :, 1])
    np.multiply(dl, IQ4_VALUES[q.reshape(n, 8, 32)], out=out.reshape(n, 8, 32))


_KERNELS: dict[int, _Kernel] = {tid: _BY_FORMAT[f.kernel] for tid, f in GGML_TYPES.items()}


def _as_blocks(data: np.ndarray, qt: WeightFormat) -> np.ndarray:
    """Reinterpret ``data`` (any dtype and shape) as C-contiguous [n_blocks, block_bytes] uint8."""
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if raw.size % qt.block_bytes != 0:
        raise ValueError(
            f"{qt.name} data has {raw.size} bytes, which is not a whole number of "
            f"{qt.block_bytes}-byte blocks"
        )
    return raw.reshape(-1, qt.block_bytes)


def dequantize_blocks(blocks: np.ndarray, type_id: int) -> np.ndarray:
    """Dequantize [n_blocks, block_bytes] uint8 blocks of ``type_id`` to [n_blocks, block_elems].

    Any array whose bytes are a whole number of blocks is accepted; it is reinterpreted as bytes.
    The result is a new float32 array.
    """
    qt = _quant_type(type_id)
    b = _as_blocks(blocks, qt)
    out = np.empty((b.shape[0], qt.block_elems), dtype=np.float32)
    _KERNELS[int(type_id)](b, out)
    return out


def dequantize(data: np.ndarray, type_id: int, shape: tuple[int, ...]) -> np.ndarray:
    """Dequantize GGUF tensor ``data`` of ggml type ``type_id`` to float32 of numpy ``shape``.

    ``data`` is what ``gguf.GGUFReader`` gives: [rows, bytes_per_row] uint8 for block types
    (including BF16), or the typed array for F32/F16; any array with the right bytes works.
    ``shape`` is in numpy order, i.e. the reverse of the GGUF dims. For F32 input the result
    may be a view of ``data`` (no copy, read-only if ``data`` is); otherwise it is a new array.
    """
    qt = _quant_type(type_id)
    type_id = int(type_id)
    shape = tuple(int(s) for s in shape)
    if shape and shape[-1] % qt.block_elems != 0:
        raise ValueError(
            f"{qt.name} rows have {qt.block_elems}-element blocks, but the shape {shape} has "
            f"{shape[-1]} columns"
        )
    n_elems = prod(shape)
    if type_id == 0 and data.dtype == np.float32 and data.size == n_elems:
        return data.reshape(shape)  # already float32: nothing to compute
    blocks = _as_blocks(data, qt)
    if blocks.shape[0] * qt.block_elems != n_elems:
        raise ValueError(
            f"{qt.name} data holds {blocks.shape[0] * qt.block_elems} elements "
            f"({blocks.shape[0]} blocks), but the shape {shape} needs {n_elems}"
        )
    out = np.empty((blocks.shape[0], qt.block_elems), dtype=np.float32)
    kernel = _KERNELS[type_id]
    step = max(1, _CHUNK_ELEMS // qt.block_elems)
    for start in range(0, blocks.shape[0], step):
        kernel(blocks[start : start + step], out[start : start + step])
    return out.reshape(shape)
