"""Hugging Face safetensors checkpoints: single-file or sharded, memory-mapped.

Float tensors come back as float32 numpy arrays (bf16 is widened by a 16-bit shift, exactly).
Quantized linear weights come back as `formats.QuantizedWeight`s
(`.dequantize() -> float32 (out, in)`):

- NVFP4 (NVIDIA ModelOpt): `<p>.weight` U8 (out, in/2) packed E2M1 codes, `<p>.weight_scale`
  F8_E4M3 (out, in/16) per-block scales, `<p>.weight_scale_2` F32 global scale.
- FP8 (E4M3) with a per-tensor or per-channel `weight_scale`, or a block-wise
  `weight_scale_inv` (DeepSeek/Qwen FP8 layout).

The format is decided per tensor from the stored dtypes, never from the config alone: NVFP4
checkpoints keep some layers (lm_head, mtp.fc, sometimes all of attention) in bf16.
Layout and exact formulas: docs/formats.md.

We read the header ourselves (8-byte length + JSON, per the safetensors spec) and map the file
with numpy: the `safetensors` numpy API has no bf16 or fp8 and copies instead of mapping.
"""

from __future__ import annotations

import json
import math
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import atlas_cli.backend.formats as formats
from atlas_cli.backend.formats import QuantizedWeight, StoredRows
from atlas_cli.backend.loaders import finite, validate
from atlas_cli.errors import CorruptModelError, UnsupportedModelError

# safetensors dtype -> numpy storage dtype (bf16 and fp8 are stored raw and decoded by us)
STORAGE = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": np.uint16,
    "F8_E4M3": np.uint8,
    "U8": np.uint8,
    "I8": np.int8,
    "I16": np.int16,
    "I32": np.int32,
    "I64": np.int64,
    "BOOL": np.bool_,
}
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
DTYPE_NAMES = {"F64": "f64", "F32": "f32", "F16": "f16", "BF16": "bf16", "F8_E4M3": "fp8"}

# Prefix rewrites for the checkpoint layouts of the same language model (first match wins).
PREFIXES = (
    ("model.language_model.", "model."),  # Qwen3_5ForConditionalGeneration and other VLMs
    ("model.mtp.", "mtp."),
)
IGNORED_PREFIXES = ("model.visual.", "visual.", "model.vision_tower.")

# E2M1 code -> value; bit 3 is the sign (modelopt's `e2m1_values`).
E2M1_VALUES = np.array(
    [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32
)
NVFP4_BLOCK = formats.NVFP4.block_elems


def _e4m3_table() -> np.ndarray:
    """float8_e4m3fn byte -> float32: bias 7, no infinities, 0x7F/0xFF are NaN."""
    b = np.arange(256, dtype=np.uint32)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exp = (b >> 3) & 0xF
    man = (b & 0x7).astype(np.float64)
    value = np.where(exp == 0, man / 8 * 2.0**-6, (1 + man / 8) * 2.0 ** (exp.astype(np.int64) - 7))
    value = sign * value
    value[(b & 0x7F) == 0x7F] = np.nan
    return value.astype(np.float32)


E4M3_VALUES = _e4m3_table()


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16, any shape) -> float32, exactly."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def e4m3_to_f32(codes: np.ndarray) -> np.ndarray:
    """float8_e4m3fn bytes (uint8, any shape) -> float32, exactly."""
    return E4M3_VALUES[codes]


@dataclass(frozen=True)
class NVFP4Tensor(QuantizedWeight):
    """A ModelOpt NVFP4 linear weight, kept packed until `dequantize`."""

    packed: np.ndarray  # (out, in/2) uint8: low nibble = even column, high nibble = odd column
    scale: np.ndarray  # (out, in/16) uint8 float8_e4m3fn codes
    global_scale: float  # weight_scale_2

    format = formats.NVFP4

    @property
    def shape(self) -> tuple[int, int]:
        return (self.packed.shape[0], self.packed.shape[1] * 2)

    def dequantize(self) -> np.ndarray:
        """W[o, i] = E2M1[code(o, i)] * (fp8(scale[o, i//16]) * weight_scale_2), in float32
        in modelopt's order (`NVFP4QTensor.dequantize`): block scale times global scale first."""
        out, half = self.packed.shape
        codes = np.empty((out, half, 2), np.uint8)
        codes[..., 0] = self.packed & 0x0F
        codes[..., 1] = self.packed >> 4
        values = E2M1_VALUES[codes].reshape(out, -1, NVFP4_BLOCK)  # (out, in/16, 16)
        scale = e4m3_to_f32(self.scale) * np.float32(self.global_scale)  # (out, in/16)
        return (values * scale[..., None]).reshape(out, half * 2)

    def stored(self) -> StoredRows:
        return StoredRows(self.packed, np.asarray(self.scale).view(np.uint8), self.global_scale)


@dataclass(frozen=True)
class FP8Tensor(QuantizedWeight):
    """An FP8 (E4M3) weight with a per-tensor, per-row or per-block float32 scale."""

    codes: np.ndarray  # (out, in) uint8 float8_e4m3fn codes
    scale: np.ndarray  # () / (1,) / (out, 1) multiplier, or (out/bo, in/bi) block multipliers

    format = formats.FP8

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape

    def dequantize(self) -> np.ndarray:
        w = e4m3_to_f32(self.codes)
        s = np.asarray(self.scale, np.float32)
        if s.ndim == 2 and s.shape[1] > 1:  # block scales: expand each to its tile
            bo = -(-w.shape[0] // s.shape[0])
            bi = -(-w.shape[1] // s.shape[1])
            s = np.repeat(np.repeat(s, bo, axis=0), bi, axis=1)[: w.shape[0], : w.shape[1]]
        elif s.ndim == 2:
            s = s.reshape(-1, 1)
        else:
            s = s.reshape(())
        return w * s


@dataclass(frozen=True)
class _Entry:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in the file
    end: int


def hf_name(name: str) -> str | None:
    """Our (HF causal-LM) name for a checkpoint tensor name, or None for tensors we skip."""
    if name.startswith(IGNORED_PREFIXES):
        return None
    for old, new in PREFIXES:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a model directory (or the single file given); an index may
    only name files inside the directory."""
    if path.is_file():
        return [path]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptModelError(f"{index}: invalid index ({exc})") from None
        if not isinstance(weight_map, dict) or not all(
            isinstance(f, str) and f and Path(f).name == f for f in weight_map.values()
        ):
            raise CorruptModelError(
                f"{index}: weight_map must map tensor names to file names in the model "
                'directory (expected an object of "name": "model-00001-of-00002.safetensors")'
            )
        files = [path / f for f in dict.fromkeys(weight_map.values())]
        missing = [f.name for f in files if not _is_file(f)]
        if missing:
            raise CorruptModelError(
                f"{path}: shard(s) {', '.join(missing)} listed in the index are missing; "
                "download the model again"
            )
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UnsupportedModelError(f"{path}: no .safetensors files")
    return files


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # a name too long for the file system is no file either
        return False


def read_header(file: Path) -> dict[str, _Entry]:
    """The tensor table of one safetensors file, validated against the file size: known
    dtypes, shapes whose byte count is the range's, every range inside the file, no overlaps."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CorruptModelError(f"{file}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", raw)
        if n > min(size - 8, 100_000_000):
            raise CorruptModelError(f"{file}: not a safetensors file (bad header length)")
        try:
            header = json.loads(f.read(n))
        except (ValueError, RecursionError) as exc:
            raise CorruptModelError(f"{file}: damaged safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise CorruptModelError(f"{file}: damaged safetensors header (expected a JSON object)")
    entries = {}
    for name, info in header.items():
        if name != "__metadata__":
            entries[name] = _entry(file, name, info, 8 + n)
    spans = [validate.Span(name, e.start, e.end) for name, e in entries.items()]
    validate.check_spans(str(file), spans, size)
    return entries


def _entry(file: Path, name: str, info: Any, data_start: int) -> _Entry:
    """One header entry, typed: {"dtype": str, "shape": [int...], "data_offsets": [b, e]}."""
    where = f"{file}: tensor {name}"
    if not isinstance(info, dict):
        raise CorruptModelError(f"{where}: header entry is {info!r} (expected an object)")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str):
        raise CorruptModelError(f"{where}: dtype is {dtype!r} (expected a string such as BF16)")
    if dtype not in STORAGE:
        raise UnsupportedModelError(
            f"{where} has dtype {dtype}, which atlas cannot read (supported: {', '.join(STORAGE)})"
        )
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise CorruptModelError(
            f"{where}: shape is {shape!r} (expected a list of non-negative integers)"
        )
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(o) is int and o >= 0 for o in offsets)
    ):
        raise CorruptModelError(
            f"{where}: data_offsets is {offsets!r} (expected [begin, end], two integers)"
        )
    begin, end = offsets
    itemsize = np.dtype(STORAGE[dtype]).itemsize
    if end - begin != validate.block_bytes(str(file), name, tuple(shape), 1, itemsize):
        raise CorruptModelError(
            f"{where}: data_offsets [{begin:,}, {end:,}) hold {end - begin:,} bytes, but shape "
            f"{shape} of {dtype} needs {math.prod(shape) * itemsize:,}; the header is damaged"
        )
    return _Entry(file, dtype, tuple(shape), data_start + begin, data_start + end)


def _index(path: Path) -> dict[str, _Entry]:
    entries: dict[str, _Entry] = {}
    for file in checkpoint_files(path):
        for name, entry in read_header(file).items():
            target = hf_name(name)
            if target is None:
                continue
            if target in entries:
                raise CorruptModelError(
                    f"{path}: tensor {target} is stored twice ({entries[target].file.name} and "
                    f"{file.name}); expected each tensor once"
                )
            entries[target] = entry
    return entries


def logical_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Each weight's shape as the model sees it (NVFP4's packed codes hold two per byte),
    from the headers alone: what validate.check_shapes compares with the config."""
    entries = _index(Path(path))
    shapes = {}
    for name, e in entries.items():
        scale = entries.get(name[: -len(".weight")] + ".weight_scale")
        nvfp4 = name.endswith(".weight") and e.dtype == "U8" and len(e.shape) == 2
        if nvfp4 and scale is not None and scale.dtype == "F8_E4M3":
            shapes[name] = (e.shape[0], e.shape[1] * 2)
        else:
            shapes[name] = e.shape
    return shapes


class _Reader:
    def __init__(self):
        self.maps: dict[Path, np.memmap] = {}

    def raw(self, name: str, e: _Entry) -> np.ndarray:
        """The stored array, zero-copy (bf16/fp8 as their raw integer codes)."""
        if e.dtype not in STORAGE:
            raise UnsupportedModelError(
                f"tensor {name} has dtype {e.dtype}, which atlas cannot read"
            )
        if e.file not in self.maps:
            self.maps[e.file] = np.memmap(e.file, dtype=np.uint8, mode="r")
        data = self.maps[e.file][e.start : e.end].view(STORAGE[e.dtype])
        if data.size != int(np.prod(e.shape)):
            raise CorruptModelError(f"{e.file}: tensor {name} has the wrong byte size")
        return data.reshape(e.shape)

    def float32(self, name: str, e: _Entry) -> np.ndarray:
        data = self.raw(name, e)
        if e.dtype == "BF16":
            return bf16_to_f32(data)
        if e.dtype == "F8_E4M3":
            return e4m3_to_f32(data)
        if e.dtype == "F32":
            return data  # the memory map itself
        return data.astype(np.float32)


def load_weights(path: Path) -> dict[str, Any]:
    """Every tensor of a checkpoint (file or directory) under our names: float32 arrays, or
    NVFP4Tensor / FP8Tensor for quantized linear weights (their scale tensors are consumed).
    A stored NaN or Inf (a float value, an FP8 code, a scale) is a CorruptModelError."""
    entries = _index(Path(path))
    reader = _Reader()
    weights: dict[str, Any] = {}
    consumed: set[str] = set()
    for name, e in entries.items():
        if not name.endswith(".weight"):
            continue
        base = name[: -len(".weight")]
        scale = entries.get(base + ".weight_scale")
        if e.dtype == "U8" and scale is not None and scale.dtype == "F8_E4M3":
            scale2 = entries.get(base + ".weight_scale_2")
            if scale2 is None:
                raise CorruptModelError(f"NVFP4 weight {name} has no weight_scale_2")
            packed = reader.raw(name, e)
            if packed.ndim != 2 or (packed.shape[1] * 2) % NVFP4_BLOCK:
                raise CorruptModelError(
                    f"{e.file}: NVFP4 weight {name} has shape {list(packed.shape)} (expected "
                    f"(out, in/2) with in a multiple of {NVFP4_BLOCK})"
                )
            if scale.shape != (packed.shape[0], packed.shape[1] * 2 // NVFP4_BLOCK):
                raise CorruptModelError(
                    f"NVFP4 weight {name}: scale shape {scale.shape} does not fit {packed.shape}"
                )
            g = float(_scalar(reader, base + ".weight_scale_2", scale2))
            codes = reader.raw(base, scale)
            finite.check_values(scale.file.name, base + ".weight_scale", codes, scale.dtype)
            weights[name] = NVFP4Tensor(packed, codes, g)
            consumed |= {base + ".weight_scale", base + ".weight_scale_2", base + ".input_scale"}
        elif e.dtype == "F8_E4M3":
            scale_name = next(
                (base + s for s in (".weight_scale", ".weight_scale_inv") if base + s in entries),
                None,
            )
            if scale_name is None:
                raise CorruptModelError(f"FP8 weight {name} has no weight_scale")
            s = np.array(reader.float32(scale_name, entries[scale_name]))
            codes = reader.raw(name, e)
            finite.check_values(e.file.name, name, codes, e.dtype)
            finite.check_values(e.file.name, scale_name, s, "F32")
            _check_fp8_scale(e.file, name, codes.shape, s.shape)
            weights[name] = FP8Tensor(codes, s)
            consumed |= {scale_name, base + ".input_scale"}
    for name, e in entries.items():
        if name in weights or name in consumed:
            continue
        if e.dtype not in FLOAT_DTYPES:
            raise UnsupportedModelError(
                f"tensor {name} is stored as {e.dtype}, which atlas does not know how to use"
            )
        finite.check_values(e.file.name, name, reader.raw(name, e), e.dtype)
        weights[name] = reader.float32(name, e)
    return weights


def _scalar(reader: _Reader, name: str, e: _Entry) -> float:
    """A one-element float tensor (a global scale)."""
    if e.dtype not in FLOAT_DTYPES or math.prod(e.shape) != 1:
        raise CorruptModelError(
            f"{e.file}: {name} is {e.dtype} of shape {list(e.shape)} (expected one float)"
        )
    finite.check_values(e.file.name, name, reader.raw(name, e), e.dtype)
    return reader.float32(name, e).reshape(-1)[0]


def _check_fp8_scale(file: Path, name: str, shape: tuple, scale: tuple) -> None:
    """FP8 scales: one per tensor, one per row (out, 1), or a 2-D grid of blocks no finer
    than the weight."""
    ok = len(shape) == 2 and (
        math.prod(scale) == 1
        or scale == (shape[0], 1)
        or (len(scale) == 2 and 0 < scale[0] <= shape[0] and 0 < scale[1] <= shape[1])
    )
    if not ok:
        raise CorruptModelError(
            f"{file}: FP8 weight {name} of shape {list(shape)} has a scale of shape "
            f"{list(scale)} (expected [1], [{shape[0] if shape else 'out'}, 1] or a block grid)"
        )


def dominant_dtype(path: Path) -> str:
    """The storage format of most linear-weight elements: "bf16", "f16", "f32", "nvfp4", "fp8"."""
    entries = _index(Path(path))
    counts: Counter[str] = Counter()
    for name, e in entries.items():
        if not name.endswith(".weight") or len(e.shape) != 2:
            continue
        base = name[: -len(".weight")]
        scale = entries.get(base + ".weight_scale")
        if e.dtype == "U8" and scale is not None and scale.dtype == "F8_E4M3":
            kind, n = "nvfp4", e.shape[0] * e.shape[1] * 2
        else:
            kind, n = DTYPE_NAMES.get(e.dtype, e.dtype.lower()), e.shape[0] * e.shape[1]
        counts[kind] += n
    return counts.most_common(1)[0][0] if counts else "?"
