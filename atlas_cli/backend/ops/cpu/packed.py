"""GGUF weights as the fast CPU kernels read them: `PackedMatrix` (a matrix's blocks inside
one flat buffer, usually the file's memory map, with its row and column order), and whether
decode products round activations to int8. Shared by the ops (fast.py) and the fused decode
steps (fused.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

import atlas_cli.backend.formats as formats
from atlas_cli.backend.formats import QuantizedWeight, WeightFormat
from atlas_cli.backend.ops.cpu import kernels as _k

# Decode products on int8-rounded activations (docs/architecture.md): "int8" (the default) or
# "float32", the activations as they are (slower, closer to the reference).
ACTIVATIONS_ENV = "ATLAS_CPU_ACTIVATIONS"
ACTIVATIONS = ("int8", "float32")


def int8_activations() -> bool:
    """Whether decode products round x to int8 (ATLAS_CPU_ACTIVATIONS; read on every call, so
    a process can compare both)."""
    value = os.environ.get(ACTIVATIONS_ENV, "int8")
    if value not in ACTIVATIONS:
        from atlas_cli.errors import UsageError

        raise UsageError(f"{ACTIVATIONS_ENV} must be int8 or float32, got {value!r}")
    return value == "int8"


@dataclass(frozen=True)
class PackedMatrix(QuantizedWeight):
    """A (rows, cols) weight as GGUF blocks inside a flat uint8 buffer (usually the memory map
    of the whole file): logical row r is stored at byte `offset + perm[r] * row_bytes`. With
    `in_perm`, the stored columns are a permutation of the logical ones (qwen35's out_proj):
    products gather the input, `x[..., in_perm]`, instead of reordering any block."""

    type_id: int
    shape: tuple[int, int]
    buf: np.ndarray  # (n,) uint8
    offset: int
    row_bytes: int
    perm: np.ndarray  # (rows,) int64
    in_perm: np.ndarray | None = None  # (cols,) int64: stored column j is logical in_perm[j]

    @property
    def format(self) -> WeightFormat:
        return formats.GGML[self.type_id]

    @property
    def blocks_per_row(self) -> int:
        return self.shape[1] // _k.BLOCKS[self.type_id][0]

    @property
    def kernel_args(self) -> tuple:
        """(type, buffer, offset, row bytes, blocks per row): how the kernels address it."""
        return self.type_id, self.buf, self.offset, self.row_bytes, self.blocks_per_row

    def dequantize(self) -> np.ndarray:
        out = np.empty(self.shape, np.float32)
        _k.dequant_rows(*self.kernel_args, self.perm, 0, out)
        return out if self.in_perm is None else _logical_columns(out, self.in_perm)


def _logical_columns(stored: np.ndarray, in_perm: np.ndarray) -> np.ndarray:
    """(..., cols) in stored column order -> logical order."""
    out = np.empty_like(stored)
    out[..., in_perm] = stored
    return out


def _root(a: np.ndarray) -> np.ndarray:
    """The array that owns `a`'s memory (the file's memory map for weights from a GGUF)."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def pack(qt: QuantizedWeight) -> PackedMatrix | None:
    """A GGUF-block weight as a PackedMatrix, or None when its format has no kernel here."""
    rows, cols = qt.shape
    type_id = qt.format.ggml_type
    if not qt.format.cpu or cols % _k.BLOCKS[type_id][0] != 0:
        return None
    stored = qt.stored()
    blocks = stored.data
    if not blocks.flags.c_contiguous:
        blocks = np.ascontiguousarray(blocks)
    root = _root(blocks)
    if not root.flags.c_contiguous:
        root = blocks
    buf = np.asarray(root).reshape(-1).view(np.uint8)  # no copy: the same memory
    offset = blocks.__array_interface__["data"][0] - buf.__array_interface__["data"][0]
    perm = stored.row_perm
    perm = np.arange(rows, dtype=np.int64) if perm is None else np.asarray(perm, np.int64)
    in_perm = None if stored.col_perm is None else np.argsort(stored.col_perm).astype(np.int64)
    return PackedMatrix(type_id, (rows, cols), buf, int(offset), blocks.shape[1], perm, in_perm)


def gather(table: PackedMatrix, ids: np.ndarray) -> np.ndarray:
    """Rows `ids` (T,) of a packed (V, H) table, dequantized: (T, H) float32."""
    out = np.empty((len(ids), table.shape[1]), np.float32)
    _k.gather_rows(*table.kernel_args, table.perm[np.asarray(ids, dtype=np.int64)], out)
    return out if table.in_perm is None else _logical_columns(out, table.in_perm)


def stored_in_order(m) -> bool:
    """Whether the kernels can read m's rows at row * row bytes (no row or column order)."""
    return (
        isinstance(m, PackedMatrix)
        and m.in_perm is None
        and np.array_equal(m.perm, np.arange(m.shape[0]))
    )


def address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]
