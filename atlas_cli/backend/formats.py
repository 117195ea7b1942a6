"""Each weight format's facts, registered once (after gguf-py's `quants.py`).

A `WeightFormat` names a storage format and its block: `block_elems` values stored in
`block_bytes` bytes of a row. `kernel` is the name the kernels use for it (`FMT_Q4_0` and the
`*_q4_0` entry points in kernels/quant.cuh, the block decoder of the fast CPU path), and `cpu` /
`native` say which backends compute on the blocks themselves; every other backend, and every
format without kernels, dequantizes once at load. The numpy dequantizers (loaders/quant.py), the
CPU kernels (ops/cpu/kernels.py) and the native launchers (ops/native/device.py) take their tables
from here; tests/test_formats.py checks the kernels' header against it.

`QuantizedWeight` is the one interface of a weight the loaders keep in its stored format
(GGUF blocks, NVFP4, FP8): a model file never sees it, `ops.prepare_weight` does.
Block layouts and formulas: docs/formats.md.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class WeightFormat:
    name: str  # what GGUF tools and `atlas show` call it: "Q4_0"
    kernel: str  # the kernels' name: "q4_0" (FMT_Q4_0, gemv_q4_0, ...)
    ggml_type: int | None  # the type id in GGUF files; None for safetensors-only formats
    block_elems: int
    block_bytes: int  # bytes of one block in the row buffer (NVFP4: codes only)
    cpu: bool  # ops/cpu/kernels.py computes on the blocks
    native: bool  # kernels/quant.cuh decodes the blocks
    # The native kernels' layout (see split_blocks): the order of a block's bytes on the device
    # (None: as stored), then the (offset, size) of those the second buffer keeps; None for
    # both: the device rows are the stored rows.
    device_order: tuple[int, ...] | None = None
    device_split: tuple[int, int] | None = None
    # Blocks (..., block_bytes) -> the same blocks in the kernels' bit layout (Q5_K)
    device_repack: Callable[[np.ndarray], np.ndarray] | None = None
    # Byte offsets in a block of its float16 scales (d, and m or dmin where there is one): the
    # only bytes of a quantized block that can hold NaN or Inf (loaders/finite.py)
    f16_scales: tuple[int, ...] = ()

    @property
    def device_layout(self) -> bool:
        """Whether the device rows differ from the stored rows (split_blocks makes them)."""
        return self.device_split is not None or self.device_repack is not None

    @property
    def quantized(self) -> bool:
        """Blocks with scales, as opposed to plain floats (one element per block)."""
        return self.block_elems > 1

    @property
    def device_block_bytes(self) -> tuple[int, int]:
        """Bytes of one block in the native kernels' (row buffer, second buffer)."""
        if self.device_split is None:
            return self.block_bytes, 0
        return self.block_bytes - self.device_split[1], self.device_split[1]


def split_blocks(fmt: WeightFormat, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """Stored rows (rows, row_bytes) uint8 -> the native kernels' (codes, scales) rows (scales
    None where the format keeps none apart).

    Q4_0, Q4_1, Q8_0 and Q6_K blocks are 18, 20, 34 and 210 bytes: rows of them are not
    16-byte multiples and a block's codes straddle 16-byte boundaries. Each block's f16
    scale(s) go to a second buffer, so that the rest (16, 16, 32, 208 bytes) is 16-byte units
    the GEMV reads with 16-byte loads straight from the row (kernels/gemv.cuh); Q6_K's 16 int8
    scales are reordered so that the two a GEMV lane multiplies by are adjacent
    (kernels/quant.cuh q6k_scale). Q5_K blocks keep their size and get a new bit layout
    (q5_k_device); Q5_0 and Q5_1 blocks get that bit layout (q5_0_device), then their scale(s)
    and qh word go to the second buffer, leaving 16 code bytes; Q3_K blocks get a bit layout of
    their own (q3_k_device), then their scales and d go to the second buffer, leaving 96;
    IQ4_NL and IQ4_XS codes are reordered (_iq4_codes) and their scales split off, leaving 16
    and 128."""
    n = rows.shape[0]
    blocks = rows.reshape(n, -1, fmt.block_bytes)
    if fmt.device_repack is not None:
        blocks = fmt.device_repack(blocks)
    if fmt.device_split is None:
        return np.ascontiguousarray(blocks.reshape(n, -1)), None
    off, size = fmt.device_split
    if fmt.device_order is not None:
        blocks = blocks[:, :, list(fmt.device_order)]
    scales = blocks[:, :, off : off + size].reshape(n, -1)
    codes = np.concatenate([blocks[:, :, :off], blocks[:, :, off + size :]], axis=2)
    return np.ascontiguousarray(codes.reshape(n, -1)), np.ascontiguousarray(scales)


FORMATS: dict[str, WeightFormat] = {}  # by kernel name
GGML: dict[int, WeightFormat] = {}  # the formats GGUF files can hold, by ggml type id


def register(fmt: WeightFormat) -> WeightFormat:
    assert fmt.kernel not in FORMATS, f"{fmt.kernel} registered twice"
    FORMATS[fmt.kernel] = fmt
    if fmt.ggml_type is not None:
        assert fmt.ggml_type not in GGML, f"ggml type {fmt.ggml_type} registered twice"
        GGML[fmt.ggml_type] = fmt
    return fmt


QK_K = 256  # elements per K-quant super-block

F32 = register(WeightFormat("F32", "f32", 0, 1, 4, cpu=True, native=True))
F16 = register(WeightFormat("F16", "f16", 1, 1, 2, cpu=True, native=True))
BF16 = register(WeightFormat("BF16", "bf16", 30, 1, 2, cpu=True, native=True))
Q4_0 = register(
    WeightFormat(
        "Q4_0", "q4_0", 2, 32, 18, cpu=True, native=True, device_split=(0, 2), f16_scales=(0,)
    )
)
Q4_1 = register(
    WeightFormat(
        "Q4_1", "q4_1", 3, 32, 20, cpu=True, native=True, device_split=(0, 4), f16_scales=(0, 2)
    )
)
Q8_0 = register(
    WeightFormat(
        "Q8_0", "q8_0", 8, 32, 34, cpu=True, native=True, device_split=(0, 2), f16_scales=(0,)
    )
)


def _in_steps(repack: Callable[[np.ndarray], np.ndarray]) -> Callable[[np.ndarray], np.ndarray]:
    """A device_repack done a few thousand blocks at a time: its temporaries are ~6x the
    blocks."""

    def run(blocks: np.ndarray) -> np.ndarray:
        out = np.empty_like(blocks)
        step = max(1, 8192 // max(1, blocks.shape[1]))
        for r in range(0, blocks.shape[0], step):
            out[r : r + step] = repack(blocks[r : r + step])
        return out

    run.__doc__ = repack.__doc__
    return run


def _q5_words(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 5-bit codes of two halves A, B (..., groups, 4) -> per group of 4 elements the
    device's code word (..., groups) uint32, rotated left by 1, of the 4 bytes (A >> 1) |
    (B & 15) << 4, and per byte j the two extra bits (..., groups, 4): A's lowest (element j)
    and B's fifth (element j - 1 mod 4) as bits 0 and 1, which the decode ORs in one byte
    further on (kernels/gemv.cuh gv_q5_word, kernels/quant.cuh q5_codes4)."""
    word = ((a >> 1) | ((b & 15) << 4)).astype(np.uint32)
    word = word[..., 0] | word[..., 1] << 8 | word[..., 2] << 16 | word[..., 3] << 24
    word = (word << 1 | word >> 31) & 0xFFFFFFFF
    extra = (a & 1) | (b[..., [3, 0, 1, 2]] >> 4) << 1
    return word, extra


def _word_bytes(word: np.ndarray) -> np.ndarray:
    """uint32 words (..., n) -> their little-endian bytes (..., 4 n)."""
    return word.astype("<u4").view(np.uint8).reshape(*word.shape[:-1], -1)


def _q5_0_device(blocks: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1 blocks (rows, blocks, 22 or 24) -> the kernels' layout, same size: the
    scale(s) as stored, then the qh word and the 16 code bytes in Q5_K's device bit layout
    (q5_k_device), with the 4 elements j of group k in code word k and their extra bits in
    bits 2k, 2k + 1 of qh byte j. A GEMV lane then decodes its 32 elements as a Q5_K lane
    does its two sub-blocks' 32, from one 16-byte load and one qh word."""
    lead, at = blocks.shape[:-1], blocks.shape[-1] - 20  # the qh word's offset: 2 or 4
    qh = np.unpackbits(blocks[..., at : at + 4], axis=-1, bitorder="little")
    qs = blocks[..., at + 4 :]
    a = ((qs & 15) | qh[..., :16] << 4).reshape(*lead, 4, 4)  # elements 0..15: group, byte
    b = ((qs >> 4) | qh[..., 16:] << 4).reshape(*lead, 4, 4)  # 16..31
    word, extra = _q5_words(a, b)
    shifts = 2 * np.arange(4, dtype=np.uint8)[:, None]
    out = blocks.copy()
    out[..., at : at + 4] = (extra << shifts).sum(axis=-2, dtype=np.uint8)
    out[..., at + 4 :] = _word_bytes(word)
    return out


q5_0_device = _in_steps(_q5_0_device)
# Q5_0 / Q5_1: Q4_0 / Q4_1 with each element's fifth bit in a 32-bit word after the scale(s).
# On the device the codes get Q5_K's bit layout (q5_0_device) and the scale(s) and the qh word
# go to the second buffer (6 and 8 bytes per block), so that the row is 16-byte code units.
Q5_0 = register(
    WeightFormat(
        "Q5_0",
        "q5_0",
        6,
        32,
        22,
        cpu=True,
        native=True,
        device_split=(0, 6),
        device_repack=q5_0_device,
        f16_scales=(0,),
    )
)
Q5_1 = register(
    WeightFormat(
        "Q5_1",
        "q5_1",
        7,
        32,
        24,
        cpu=True,
        native=True,
        device_split=(0, 8),
        device_repack=q5_0_device,
        f16_scales=(0, 2),
    )
)
Q4_K = register(
    WeightFormat("Q4_K", "q4_k", 12, QK_K, 144, cpu=True, native=True, f16_scales=(0, 2))
)


def _q5_k_device(blocks: np.ndarray) -> np.ndarray:
    """Q5_K blocks (rows, blocks, 176) -> the GEMV's layout, same size, header unchanged.

    A GEMV lane multiplies 16 elements of sub-blocks 2p (A) and 2p + 1 (B), 4 of each per code
    word. Here each of its 32-bit code words holds, rotated left by 1, 4 bytes of (A code >> 1)
    | (B code & 15) << 4, and bits 2p, 2p + 1 of the group's 4 qh bytes hold A's lowest bit
    (byte j: element j) and B's fifth bit (byte j: element j - 1 mod 4) (_q5_words). The
    decode then builds f16 halves of two 5-bit fields each (A at bits 0-4, B at 5-9) from a
    code word and its qh word with two bit selects and two rotates (kernels/gemv.cuh,
    kernels/quant.cuh q5_codes4)."""
    lead = blocks.shape[:-1]
    qh = blocks[..., 16:48]
    qs = blocks[..., 48:176].reshape(*lead, 4, 32)  # pair p, element
    bits = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # sub-block, element
    a = (qs & 15) | (bits[..., 0::2, :] << 4)  # the 5-bit codes of sub-blocks 2p
    b = (qs >> 4) | (bits[..., 1::2, :] << 4)  # and 2p + 1
    word, extra = _q5_words(a.reshape(*lead, 4, 8, 4), b.reshape(*lead, 4, 8, 4))
    shifts = 2 * np.arange(4, dtype=np.uint8)[:, None]
    new_qh = (extra.reshape(*lead, 4, 32) << shifts).sum(axis=-2, dtype=np.uint8)
    out = blocks.copy()
    out[..., 16:48] = new_qh
    out[..., 48:176] = _word_bytes(word).reshape(*lead, 128)
    return out


q5_k_device = _in_steps(_q5_k_device)


Q5_K = register(
    WeightFormat(
        "Q5_K",
        "q5_k",
        13,
        QK_K,
        176,
        cpu=True,
        native=True,
        device_repack=q5_k_device,
        f16_scales=(0, 2),
    )
)
# Q6_K on the device: ql, qh as stored, the int8 scales in pairs (i, i + 4) for i = 0..3 and
# 8..11 (kernels/quant.cuh q6k_scale), d.
_Q6_K_SCALE_PAIRS = [192 + i + 4 * j for h in (0, 8) for i in range(h, h + 4) for j in (0, 1)]
Q6_K_DEVICE_ORDER = (*range(192), *_Q6_K_SCALE_PAIRS, 208, 209)
Q6_K = register(
    WeightFormat(
        "Q6_K",
        "q6_k",
        14,
        QK_K,
        210,
        cpu=True,
        native=True,
        device_order=Q6_K_DEVICE_ORDER,
        device_split=(208, 2),  # d
        f16_scales=(208,),
    )
)
# Q2_K: CPU kernels, no native ones (on a GPU it is dequantized at load).
Q2_K = register(
    WeightFormat("Q2_K", "q2_k", 10, QK_K, 84, cpu=True, native=False, f16_scales=(80, 82))
)


def _q3_k_device(blocks: np.ndarray) -> np.ndarray:
    """Q3_K blocks (rows, blocks, 110) -> the kernels' layout, same size, scales and d as stored.

    GEMV lane s (0..7) multiplies elements 32 s .. 32 s + 31 of the block: A the first 16, B
    the next 16, 4 of each per 32-bit word k (elements 4k + j, j the byte). Its low 2 bits go
    to the 16-byte unit s / 2 of the first 64 bytes, word k, byte j: A's at bits 2e, B's at 4 +
    2e (e = s % 2, the lane of the pair), the word then rotated left by r = s / 2 % 2. Its high
    (hmask) bits go to the 16-byte unit s / 4 of the next 32, word k, at bit r + 2e + 2 + 4 h
    + 16 (j / 2) + 8 (j % 2) mod 32 (h: 0 for A, 1 for B): the bit right above the field of
    the same element once the decode has rotated, for odd j, the bit select's result by 8
    (kernels/gemv.cuh gv_q3k_word). So each lane decodes 8 elements from a code word and an
    hmask word with two bit selects and one rotate; the 4 lanes that share an hmask unit use
    disjoint bits of it."""
    lead = blocks.shape[:-1]
    shifts = np.arange(0, 8, 2, dtype=np.uint8)[:, None]
    qs = blocks[..., 32:96].reshape(*lead, 2, 1, 32)
    low = ((qs >> shifts) & 3).reshape(*lead, 8, 2, 4, 4)  # lane s, half h, word k, byte j
    hmask = blocks[..., None, :32]
    high = ((hmask >> np.arange(8, dtype=np.uint8)[:, None]) & 1).reshape(*lead, 8, 2, 4, 4)
    e = np.arange(8, dtype=np.uint8)[:, None, None] & 1  # (s, k, j)
    code = low[..., 0, :, :] << 2 * e | low[..., 1, :, :] << 4 + 2 * e
    code = code.reshape(*lead, 4, 2, 4, 4).sum(axis=-3, dtype=np.uint8)  # the pair's bytes
    code = code.view("<u4")[..., 0].astype(np.uint32)  # (pair, word)
    r = np.arange(4, dtype=np.uint32)[:, None] & 1
    code = (code << r | code >> (32 - r) % 32) & 0xFFFFFFFF
    s, h, j = np.ix_(range(8), range(2), range(4))
    bit = ((s >> 1 & 1) + 2 * (s & 1) + 2 + 4 * h + 16 * (j >> 1) + 8 * (j & 1)) % 32
    words = high.astype(np.uint32) << bit[:, :, None, :].astype(np.uint32)  # (s, h, k, j)
    words = words.reshape(*lead, 2, 4, 2, 4, 4).sum(axis=(-4, -3, -1), dtype=np.uint32)
    out = blocks.copy()
    out[..., :64] = _word_bytes(code.reshape(*lead, 16))
    out[..., 64:96] = _word_bytes(words.reshape(*lead, 8))
    return out


q3_k_device = _in_steps(_q3_k_device)
# Q3_K on the device: the codes in the bit layout of q3_k_device (96 bytes, 16-byte units in the
# row); the 12 bytes of 6-bit scales and d in the second buffer (14 bytes per block).
Q3_K = register(
    WeightFormat(
        "Q3_K",
        "q3_k",
        11,
        QK_K,
        110,
        cpu=True,
        native=True,
        device_split=(96, 14),
        device_repack=q3_k_device,
        f16_scales=(108,),
    )
)


def _iq4_codes(qs: np.ndarray) -> np.ndarray:
    """16 code bytes of 32 IQ4 elements (..., 16), element j's code the low nibble of byte j
    and element 16 + j's the high one -> the device order: nibbles n = 0..3 of word k (bits 4n
    ..) elements 4k + n, nibbles 4..7 elements 16 + 4k + n - 4. Each half of a word is then
    the 4 selectors of one byte-permute table lookup (kernels/gemv.cuh gv_iq4_word)."""
    lead = qs.shape[:-1]
    a = (qs & 15).reshape(*lead, 4, 2, 2)  # word k, byte, nibble
    b = (qs >> 4).reshape(*lead, 4, 2, 2)
    pack = np.concatenate([a[..., 0] | a[..., 1] << 4, b[..., 0] | b[..., 1] << 4], axis=-1)
    return pack.reshape(*lead, 16)


def iq4_nl_device(blocks: np.ndarray) -> np.ndarray:
    """IQ4_NL blocks (rows, blocks, 18) -> the kernels' layout: d, then _iq4_codes."""
    out = blocks.copy()
    out[..., 2:] = _iq4_codes(blocks[..., 2:])
    return out


def iq4_xs_device(blocks: np.ndarray) -> np.ndarray:
    """IQ4_XS blocks (rows, blocks, 136) -> the kernels' layout: d, the scales, then each
    sub-block's 16 code bytes in _iq4_codes' order."""
    out = blocks.copy()
    qs = blocks[..., 8:].reshape(*blocks.shape[:-1], 8, 16)
    out[..., 8:] = _iq4_codes(qs).reshape(*blocks.shape[:-1], 128)
    return out


# IQ4_NL / IQ4_XS on the device: the codes reordered (_iq4_codes), d (IQ4_XS: d and the 6-bit
# scales) in the second buffer, so that the row is 16 code bytes per 32 elements.
IQ4_NL = register(
    WeightFormat(
        "IQ4_NL",
        "iq4_nl",
        20,
        32,
        18,
        cpu=True,
        native=True,
        device_split=(0, 2),
        device_repack=iq4_nl_device,
        f16_scales=(0,),
    )
)
IQ4_XS = register(
    WeightFormat(
        "IQ4_XS",
        "iq4_xs",
        23,
        QK_K,
        136,
        cpu=True,
        native=True,
        device_split=(0, 8),
        device_repack=iq4_xs_device,
        f16_scales=(0,),
    )
)
# ModelOpt NVFP4 (safetensors): 16 E2M1 codes in 8 bytes; the block's E4M3 scale lives in a
# second buffer (one byte per block), times one float32 global scale per tensor. Not the GGUF
# NVFP4 type (ggml id 40), whose packing differs.
NVFP4 = register(WeightFormat("NVFP4", "nvfp4", None, 16, 8, cpu=False, native=True))
# FP8 E4M3 weights with per-tensor, per-row or per-tile scales: dequantized at load everywhere.
FP8 = register(WeightFormat("FP8", "fp8", None, 1, 1, cpu=False, native=False))

# ggml types atlas cannot read, named only so that error messages can say which one a file has.
UNSUPPORTED_GGML_NAMES: dict[int, str] = {
    9: "Q8_1",
    15: "Q8_K",
    16: "IQ2_XXS",
    17: "IQ2_XS",
    18: "IQ3_XXS",
    19: "IQ1_S",
    21: "IQ3_S",
    22: "IQ2_S",
    24: "I8",
    25: "I16",
    26: "I32",
    27: "I64",
    28: "F64",
    29: "IQ1_M",
    34: "TQ1_0",
    35: "TQ2_0",
    39: "MXFP4",
    40: "NVFP4",
    41: "Q1_0",
}


def ggml_type_name(type_id: int) -> str:
    """ "Q4_1" for 3; the name of an unsupported type too; "unknown" for ids ggml never had."""
    fmt = GGML.get(type_id)
    return fmt.name if fmt is not None else UNSUPPORTED_GGML_NAMES.get(type_id, "unknown")


@dataclass(frozen=True)
class StoredRows:
    """A weight as the kernels read it (kernels/quant.cuh): `data` (rows, row_bytes) uint8 of
    whole blocks per row; NVFP4 adds `scales` (rows, cols/16) uint8 E4M3 codes and the float32
    `global_scale`. With `row_perm`, logical row i is stored row `row_perm[i]`; with
    `col_perm` (the fast CPU path only), logical column c is stored column `col_perm[c]`."""

    data: np.ndarray
    scales: np.ndarray | None = None
    global_scale: float = 1.0
    row_perm: np.ndarray | None = None
    col_perm: np.ndarray | None = None


class QuantizedWeight(ABC):
    """A 2-D weight (rows, cols) that a loader keeps in its stored format. Subclasses give
    `format` and `shape` (as fields, properties or class attributes) and `dequantize`."""

    format: WeightFormat
    shape: tuple[int, int]

    @abstractmethod
    def dequantize(self) -> np.ndarray:
        """float32 (rows, cols), bit-exact with the format's reference (docs/formats.md)."""

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        """`np.asarray(w)` is the dequantized weight: what the float32 backends compute with."""
        out = self.dequantize()
        return out if dtype is None else out.astype(dtype, copy=False)

    def stored(self) -> StoredRows:
        """The stored bytes in the kernels' layout; only formats with kernels have one."""
        raise TypeError(f"{self.format.name} weights have no kernel layout: dequantize them")
