"""A GGUF header reader whose memory and time are bounded by the file's real size.

Every count read from the file (key/value count, tensor count, string and array lengths, the
number of dimensions) is checked against the bytes that remain before anything is allocated
or looped over: a file of N bytes can never make us read, allocate or iterate more than about
N items. Layout (GGUF v2/v3, little-endian): ggml's docs/gguf.md, as the `gguf` package's
`GGUFReader` reads it; numeric arrays are read with one `frombuffer` call, which is also why
this is faster than that reader on a 50K-entry vocabulary.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np

from atlas_cli.errors import CorruptModelError, UnsupportedModelError

SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NESTING = 4  # arrays of arrays: the spec allows them, no model uses them

# GGUF value type id -> (struct format, numpy dtype) for the fixed-size scalars
SCALARS = {
    0: ("<B", np.uint8),
    1: ("<b", np.int8),
    2: ("<H", np.uint16),
    3: ("<h", np.int16),
    4: ("<I", np.uint32),
    5: ("<i", np.int32),
    6: ("<f", np.float32),
    7: ("<?", np.bool_),
    10: ("<Q", np.uint64),
    11: ("<q", np.int64),
    12: ("<d", np.float64),
}
STRING, ARRAY = 8, 9


def damaged(path: Path, detail: str) -> CorruptModelError:
    return CorruptModelError(f"{path}: cannot parse GGUF header ({detail}); the file is damaged")


class _Cursor:
    """Reads from `data` (the whole file, memory-mapped) and refuses to run past its end."""

    def __init__(self, path: Path, data: memoryview):
        self.path, self.data, self.pos = path, data, 0

    def left(self) -> int:
        return len(self.data) - self.pos

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or n > self.left():
            raise damaged(
                self.path,
                f"{what} needs {n:,} bytes at offset {self.pos:,}, the file has "
                f"{self.left():,} left",
            )
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def scalar(self, type_id: int, what: str):
        fmt, _ = SCALARS[type_id]
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def u32(self, what: str) -> int:
        return self.scalar(4, what)

    def u64(self, what: str) -> int:
        return self.scalar(10, what)

    def string(self, what: str) -> str:
        n = self.u64(f"{what} length")
        raw = self.take(n, what)
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError:
            raise damaged(self.path, f"{what} is not valid UTF-8") from None

    def count(self, n: int, item_bytes: int, what: str) -> int:
        """`n` items of at least `item_bytes` each must fit in what is left of the file."""
        if n * item_bytes > self.left():
            raise damaged(
                self.path,
                f"{what} claims {n:,} entries but only {self.left():,} bytes remain in the file",
            )
        return n


def read_header(path: Path) -> tuple[dict[str, Any], list[tuple[str, int, tuple, int]], int]:
    """(metadata, [(name, ggml type id, dims in GGUF order, relative offset)], data start)."""
    data = np.memmap(path, dtype=np.uint8, mode="r")  # pages are read only where we look
    return parse(path, memoryview(data))


def parse(path: Path, data: memoryview) -> tuple[dict[str, Any], list, int]:
    cur = _Cursor(path, data)
    if bytes(cur.take(4, "magic")) != b"GGUF":
        raise CorruptModelError(f"{path}: not a GGUF file (bad magic bytes)")
    version = cur.u32("version")
    if version not in SUPPORTED_VERSIONS:
        hint = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
        raise UnsupportedModelError(
            f"{path}: GGUF version {version}{hint} is not supported (supported: 2, 3)"
        )
    n_tensors = cur.count(cur.u64("tensor count"), 24, "tensor count")
    n_kv = cur.count(cur.u64("metadata count"), 12, "metadata count")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string("metadata key")
        if key in metadata:
            raise damaged(path, f"metadata key {key} appears twice")
        metadata[key] = _value(cur, cur.u32(f"type of {key}"), key)
    tensors = []
    for _ in range(n_tensors):
        name = cur.string("tensor name")
        n_dims = cur.u32(f"dimension count of {name}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise damaged(path, f"tensor {name} has {n_dims} dimensions, expected 1 to {MAX_DIMS}")
        dims = tuple(cur.u64(f"dimensions of {name}") for _ in range(n_dims))
        type_id = cur.u32(f"type of {name}")
        tensors.append((name, type_id, dims, cur.u64(f"offset of {name}")))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
        raise damaged(path, f"general.alignment is {alignment!r}, expected a power of two")
    data_start = -(-cur.pos // alignment) * alignment
    metadata.setdefault("general.alignment", alignment)
    return metadata, tensors, data_start


def _value(cur: _Cursor, type_id: int, key: str, depth: int = 0) -> Any:
    if type_id in SCALARS:
        value = cur.scalar(type_id, key)
        return bool(value) if type_id == 7 else value
    if type_id == STRING:
        return cur.string(key)
    if type_id == ARRAY:
        item_type = cur.u32(f"item type of {key}")
        n = cur.u64(f"length of {key}")
        if item_type in SCALARS:
            _, dtype = SCALARS[item_type]
            size = np.dtype(dtype).itemsize
            cur.count(n, size, key)
            values = np.frombuffer(cur.take(n * size, key), dtype=np.dtype(dtype).newbyteorder("<"))
            return values.tolist()
        if item_type == STRING:
            cur.count(n, 8, key)  # each string has an 8-byte length at least
            return [cur.string(key) for _ in range(n)]
        if item_type == ARRAY and depth < MAX_NESTING:  # no model key nests; bound the depth
            cur.count(n, 12, key)
            return [_value(cur, ARRAY, key, depth + 1) for _ in range(n)]
        raise damaged(cur.path, f"metadata {key} has unknown item type {item_type}")
    raise damaged(cur.path, f"metadata {key} has unknown value type {type_id}")
