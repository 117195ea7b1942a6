"""Seeded mutations of model files, shared by tests/test_model_fuzz.py and scripts/fuzz_models.py.

`make_case(kind, seed, workdir)` copies one fixture (a GGUF file or a Hugging Face directory)
into `workdir`, damages it one way (a hostile config value, a safetensors entry whose dtype,
shape or byte range lies, overlapping tensors, a GGUF metadata value of the wrong type or range,
a length field larger than the file, flipped bytes, a cut file, a broken tokenizer.json, a NaN
or Inf in a weight or in a block's scale, a layer count or layer list of the wrong kind, a shape
of many dimensions...) and returns the path and what was done. `load_and_run(path, device)`
loads it as `atlas run` would and generates a few tokens; `run_case(path, device)` returns
"load" or the AtlasError's class name and lets anything else escape.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import random
import shutil
import struct
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).parent / "fixtures" / "qwen"
HF_FIXTURES = [
    "qwen3-gqa4-f16",
    "qwen3-mha-f32",
    "qwen3-tied-bf16",
    "qwen35-f32",
    "qwen35-text-bf16",
    "qwen35-nvfp4",
    "qwen35-vlm-bf16",
]
GGUF_FIXTURES = ["qwen3-gguf", "qwen35-gguf"]
HOSTILE = [
    0, -1, 1, 2, 3, 7, 2**31, 2**63, 10**30, 1e308, -1e308, math.nan, math.inf, 0.5, "7", "",
    None, True, False, [], [1, 2], {}, {"a": 1}, "x" * 300,
]  # fmt: skip


def load_and_run(path: Path, device: str = "cpu-ref") -> None:
    """Load `path` through the session (fit check included) and generate 4 greedy tokens."""
    from atlas_cli.backend.sample import SamplingOverrides
    from atlas_cli.session import open_model

    model = open_model(str(path), device=device)
    for _ in model.generate("Hello there", max_tokens=4, sampling=SamplingOverrides(0.0)):
        pass


def run_case(path: Path, device: str = "cpu-ref") -> str:
    """ "load", or the class name of the AtlasError `load_and_run` raised."""
    from atlas_cli.errors import AtlasError

    try:
        load_and_run(path, device)
    except AtlasError as exc:
        return type(exc).__name__
    return "load"


def warm_kernels() -> None:
    """Run every fixture on the fast CPU path once, so that its numba kernels are compiled (or
    loaded from their disk cache) before any case's time limit starts."""
    for name in [*GGUF_FIXTURES, *HF_FIXTURES]:
        path = FIXTURES / name / "model.gguf" if name in GGUF_FIXTURES else FIXTURES / name
        assert run_case(path, "cpu") == "load", name


# -- GGUF: a typed read (the fixtures are valid: the `gguf` package reads them) and a writer --

GGUF_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q"}
GGUF_SCALAR |= {11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9


REAL_DATA_BYTES = 4 << 20  # of a real model's tensor data, copied; the rest is left sparse


def read_gguf(path: Path) -> tuple[list[list], list[list], bytes, int]:
    """([key, type, value, item type], [name, type id, dims, offset], the first
    REAL_DATA_BYTES of tensor data, the data's full length). Copies: mutate freely."""
    return copy.deepcopy(_read_gguf(path))


@functools.cache
def _read_gguf(path: Path) -> tuple[list[list], list[list], bytes, int]:
    import gguf

    reader = gguf.GGUFReader(path)
    kvs = []
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        types = [int(t) for t in field.types]
        kvs.append([key, types[0], field.contents(), types[1] if len(types) > 1 else None])
    tensors = [
        [t.name, int(t.tensor_type), [int(d) for d in t.shape], t.data_offset - reader.data_offset]
        for t in reader.tensors
    ]
    with open(path, "rb") as f:
        f.seek(reader.data_offset)
        data = f.read(REAL_DATA_BYTES)
    return kvs, tensors, data, path.stat().st_size - reader.data_offset


def _pack(type_id: int, value: Any, item: int | None, out: bytearray, lengths: list[int]):
    if type_id == STRING:
        raw = str(value).encode("utf-8", "surrogatepass")
        lengths.append(len(out))
        out += struct.pack("<Q", len(raw)) + raw
    elif type_id == ARRAY:
        out += struct.pack("<I", item)
        lengths.append(len(out))
        out += struct.pack("<Q", len(value))
        for v in value:
            _pack(item, v, None, out, lengths)
    else:
        out += struct.pack(GGUF_SCALAR[type_id], value)


def write_gguf(path: Path, kvs, tensors, data: bytes, total: int, alignment: int = 32) -> list:
    """Write a GGUF v3 file whose tensor data is `data`, zero-extended (sparse) to `total`
    bytes; returns the byte offsets of every length field (for mutations)."""
    out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs)))
    lengths: list[int] = []
    for key, type_id, value, item in kvs:
        _pack(STRING, key, None, out, lengths)
        out += struct.pack("<I", type_id)
        _pack(type_id, value, item, out, lengths)
    for name, type_id, dims, offset in tensors:
        _pack(STRING, name, None, out, lengths)
        out += struct.pack("<I", len(dims))
        out += b"".join(struct.pack("<Q", d % 2**64) for d in dims)
        out += struct.pack("<IQ", type_id % 2**32, offset % 2**64)
    out += b"\0" * (-len(out) % alignment)
    with open(path, "wb") as f:
        f.write(bytes(out) + data)
        f.truncate(len(out) + total)
    return lengths


def _gguf_value_mutation(rng: random.Random, kvs: list[list]) -> str:
    kv = rng.choice(kvs)
    key, type_id, value, item = kv
    if type_id == ARRAY and rng.random() < 0.5:
        choice = rng.choice(["truncate", "empty", "wrong items", "duplicate"])
        if choice == "truncate":
            kv[2] = value[: rng.randrange(len(value) + 1)]
        elif choice == "empty":
            kv[2] = []
        elif choice == "duplicate" and value:
            kv[2] = [value[0], *value]
        else:
            kv[3], kv[2] = rng.choice([(4, [7] * len(value)), (8, ["x"] * len(value))])
        return f"{key}: array {choice}"
    new = rng.choice(
        [(4, 0), (4, 1), (4, 3), (4, 2**32 - 1), (5, -1), (10, 2**63), (6, math.nan),
         (6, math.inf), (6, -1.0), (12, 1e300), (8, "12"), (8, ""), (7, True), (9, [])]
    )  # fmt: skip
    kv[1], kv[2], kv[3] = new[0], new[1], (4 if new[0] == ARRAY else None)
    return f"{key} = {new[1]!r} (type {new[0]})"


# ggml type -> (elements per block, bytes per block, byte offsets of its float16 scales; None: the
# elements are floats of that many bytes), after llama.cpp's ggml-common.h
GGML_BLOCKS = {
    0: (1, 4, None), 1: (1, 2, None), 30: (1, 2, None), 2: (32, 18, (0,)), 3: (32, 20, (0, 2)),
    6: (32, 22, (0,)), 7: (32, 24, (0, 2)), 8: (32, 34, (0,)), 10: (256, 84, (80, 82)),
    11: (256, 110, (108,)), 12: (256, 144, (0, 2)), 13: (256, 176, (0, 2)), 14: (256, 210, (208,)),
}  # fmt: skip
NONFINITE = [math.nan, math.inf, -math.inf]
FLOAT_BITS = {4: "<f", 2: "<e"}  # GGUF F32, F16 (BF16 is written as the top half of an f32)


def _gguf_nonfinite_mutation(rng: random.Random, tensors: list[list], data: bytearray) -> str:
    """NaN or Inf in one value of a float tensor, or in one scale of a quantized block: of a
    block among the copied bytes (all of a fixture's, the first of a real model's)."""
    usable = []
    for name, type_id, dims, offset in tensors:
        if type_id in GGML_BLOCKS:
            elems, block_bytes, _ = GGML_BLOCKS[type_id]
            copied = max(0, len(data) - offset) // block_bytes
            blocks = min(math.prod(dims) // elems, copied)
            if blocks:
                usable.append((name, type_id, offset, blocks))
    if not usable:
        return "no tensor in the copied bytes"
    name, type_id, offset, blocks = rng.choice(usable)
    _, block_bytes, scales = GGML_BLOCKS[type_id]
    value, block = rng.choice(NONFINITE), rng.randrange(blocks)
    at = offset + block * block_bytes
    if scales is None:
        data[at : at + block_bytes] = _float_bytes(value, block_bytes, bf16=type_id == 30)
        return f"tensor {name}: element {block} = {value}"
    at += rng.choice(scales)
    data[at : at + 2] = struct.pack("<e", value)
    return f"tensor {name}: scale of block {block} = {value}"


def _float_bytes(value: float, width: int, bf16: bool = False) -> bytes:
    if bf16:
        return struct.pack("<f", value)[2:]
    return struct.pack(FLOAT_BITS[width], value)


def _gguf_config_mutation(rng: random.Random, kvs: list[list]) -> str:
    """A layer count, layer list or norm epsilon of the wrong kind or size."""
    arch = next((kv[2] for kv in kvs if kv[0] == "general.architecture"), "qwen3")
    key, type_id, value = rng.choice(
        [("block_count", 4, 10**6), ("block_count", 10, 2**40), ("block_count", 4, 2**31),
         ("attention.recurrent_layers", 7, True), ("attention.recurrent_layers", 8, "x"),
         ("attention.recurrent_layers", 9, [True] * 1000), ("nextn_predict_layers", 4, 10**6),
         ("attention.layer_norm_rms_epsilon", 6, 1e-45),
         ("attention.layer_norm_rms_epsilon", 6, 0.0),
         ("full_attention_interval", 4, 0), ("context_length", 10, 2**24)]
    )  # fmt: skip
    key = f"{arch}.{key}"
    kvs[:] = [kv for kv in kvs if kv[0] != key]
    kvs.append([key, type_id, value, 7 if type_id == ARRAY else None])
    return f"{key} = {str(value)[:40]} (type {type_id})"


def _gguf_tensor_mutation(rng: random.Random, tensors: list[list], size: int) -> str:
    t = rng.choice(tensors)
    other = rng.choice(tensors)
    choice = rng.choice(
        ["type", "dims", "offset", "overlap", "name", "drop", "extra dim", "many dims"]
    )
    if choice == "type":
        t[1] = rng.choice([1, 2, 3, 6, 7, 8, 9, 12, 13, 14, 30, 39, 99, 2**31])
    elif choice == "dims":
        i = rng.randrange(len(t[2]))
        t[2][i] = rng.choice([0, 1, t[2][i] * 2, t[2][i] + 1, 2**40, 2**63])
        if rng.random() < 0.3:
            t[2].reverse()
    elif choice == "offset":
        t[3] = rng.choice([t[3] + 1, t[3] + 32, size, size * 4, 2**62, 0])
    elif choice == "overlap":
        t[3] = other[3]
    elif choice == "name":
        t[0] = rng.choice([other[0], "blk.99.attn_q.weight", "blk.0.bogus", "", "\u00e9" * 40])
    elif choice == "drop":
        tensors.remove(t)
    elif choice == "extra dim":
        t[2] = [*t[2], rng.choice([1, 2, 3])]
    else:
        t[2] = [*t[2], *[1] * rng.choice([3, 60, 1000])]
    return f"tensor {t[0]}: {choice}"


def _raw_mutation(rng: random.Random, path: Path, header_end: int, lengths: list[int]) -> str:
    with open(path, "rb") as f:
        blob = bytearray(f.read(header_end + REAL_DATA_BYTES))
    full = path.stat().st_size
    choice = rng.choice(["length", "flip", "cut", "word"])
    if choice == "length" and lengths:
        at = rng.choice(lengths)
        blob[at : at + 8] = struct.pack("<Q", rng.choice([2**62, 2**40, len(blob), 2**32 + 1]))
    elif choice == "cut":
        full = rng.randrange(full)
    elif choice == "word":
        at = rng.randrange(header_end - 8)
        blob[at : at + 8] = struct.pack("<Q", rng.choice([2**64 - 1, 2**31, 0, 10**12]))
    else:
        for _ in range(rng.randint(1, 8)):
            blob[rng.randrange(header_end)] ^= 1 << rng.randrange(8)
    with open(path, "wb") as f:
        f.write(bytes(blob[:full]))
        f.truncate(full)
    return f"raw {choice}"


def make_gguf_case(rng: random.Random, workdir: Path, source: Path | None = None) -> tuple:
    source = source or FIXTURES / rng.choice(GGUF_FIXTURES) / "model.gguf"
    kvs, tensors, data, total = read_gguf(source)
    target = workdir / "model.gguf"
    what = rng.choice(
        ["value", "value", "drop key", "tensor", "tensor", "raw", "raw", "nonfinite", "config"]
    )
    if what == "value":
        done = _gguf_value_mutation(rng, kvs)
    elif what == "nonfinite":
        data = bytearray(data)
        done = _gguf_nonfinite_mutation(rng, tensors, data)
    elif what == "config":
        done = _gguf_config_mutation(rng, kvs)
    elif what == "drop key":
        kv = kvs.pop(rng.randrange(len(kvs)))
        done = f"dropped {kv[0]}"
    elif what == "tensor":
        done = _gguf_tensor_mutation(rng, tensors, total)
    else:
        done = ""
    lengths = write_gguf(target, kvs, tensors, data, total)
    if what == "raw":
        done = _raw_mutation(rng, target, target.stat().st_size - total, lengths)
    return target, f"{source.parent.name}: {done}"


# -- Hugging Face directories ---------------------------------------------------------------


def _json_paths(node: Any, prefix=()) -> list[tuple]:
    """Every (path) into a JSON value, containers included, capped for big vocabularies."""
    paths = [prefix]
    if isinstance(node, dict):
        for k, v in list(node.items())[:40]:
            paths += _json_paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node[:8]):
            paths += _json_paths(v, (*prefix, i))
    return paths


def _set_json(root: Any, path: tuple, value: Any, delete: bool = False) -> Any:
    if not path:
        return value
    node = root
    for p in path[:-1]:
        node = node[p]
    if delete:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return root


def _mutate_json_file(rng: random.Random, file: Path, force: dict | None = None) -> str:
    if force is not None:
        data = json.loads(file.read_text())
        data.update(force)
        file.write_text(json.dumps(data))
        return f"{file.name}: {force}"
    if rng.random() < 0.15:
        blob = file.read_bytes()
        file.write_bytes(blob[: rng.randrange(len(blob))])
        return f"{file.name}: cut"
    data = json.loads(file.read_text())
    path = rng.choice(_json_paths(data)[1:] or [()])
    delete = bool(path) and rng.random() < 0.2
    data = _set_json(data, path, rng.choice(HOSTILE), delete)
    file.write_text(json.dumps(data))
    return f"{file.name}: {'deleted' if delete else 'set'} {'.'.join(map(str, path))}"


def _header(file: Path) -> tuple[dict, bytes]:
    blob = file.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + n]), blob[8 + n :]


def _write_header(file: Path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def _mutate_safetensors(rng: random.Random, file: Path) -> str:
    header, data = _header(file)
    names = [n for n in header if n != "__metadata__"]
    name, other = rng.choice(names), rng.choice(names)
    entry = header[name]
    choice = rng.choice(
        ["dtype", "shape", "offsets", "overlap", "drop", "raw", "value", "many dims", "nonfinite"]
    )
    if choice == "dtype":
        entry["dtype"] = rng.choice(["F32", "BF16", "F16", "U8", "I64", "F8_E4M3", "Q4", 5, None])
    elif choice == "shape":
        shape = entry["shape"]
        if shape and rng.random() < 0.6:
            i = rng.randrange(len(shape))
            shape[i] = rng.choice([0, 1, shape[i] * 2, shape[i] // 2, -1, 2**40])
        else:
            entry["shape"] = rng.choice([[], [0], list(reversed(shape)), [*shape, 1], "x"])
    elif choice == "offsets":
        b, e = entry["data_offsets"]
        entry["data_offsets"] = rng.choice(
            [[e, b], [b + 1, e + 1], [b, e + 2], [0, 2**63], [b, len(data) + 8], [b], "0-1"]
        )
    elif choice == "overlap":  # same size, another tensor's bytes: each alone would read
        b, e = header[other]["data_offsets"]
        size = entry["data_offsets"][1] - entry["data_offsets"][0]
        entry["data_offsets"] = [b, b + size] if b + size <= len(data) else [0, size]
    elif choice == "drop":
        del header[name]
    elif choice == "value":
        header[name] = rng.choice(HOSTILE)
    elif choice == "many dims":
        entry["shape"] = [*entry["shape"], *[1] * rng.choice([3, 60, 1000])]
    elif choice == "nonfinite":
        return f"{file.name} {_safetensors_nonfinite(rng, file, header, data)}"
    else:
        blob = bytearray(file.read_bytes())
        for _ in range(rng.randint(1, 6)):
            blob[rng.randrange(min(len(blob), 8 + 4096))] ^= 1 << rng.randrange(8)
        file.write_bytes(bytes(blob))
        return f"{file.name}: raw flips"
    _write_header(file, header, data)
    return f"{file.name} {name}: {choice}"


SAFETENSORS_FLOATS = {"F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1}


def _safetensors_nonfinite(rng: random.Random, file: Path, header: dict, data: bytes) -> str:
    """NaN or Inf in one element of a float tensor (a weight, a norm, a scale; an FP8 code)."""
    floats = [
        n
        for n, e in header.items()
        if n != "__metadata__"
        and e["dtype"] in SAFETENSORS_FLOATS
        and e["data_offsets"][1] > e["data_offsets"][0]
    ]
    name = rng.choice(floats)
    entry = header[name]
    width = SAFETENSORS_FLOATS[entry["dtype"]]
    begin, end = entry["data_offsets"]
    index = rng.randrange((end - begin) // width)
    if entry["dtype"] == "F8_E4M3":
        raw, value = rng.choice([b"\x7f", b"\xff"]), "NaN"
    else:
        value = rng.choice(NONFINITE)
        raw = _float_bytes(value, width, bf16=entry["dtype"] == "BF16")
    blob = bytearray(data)
    blob[begin + index * width : begin + (index + 1) * width] = raw
    _write_header(file, header, bytes(blob))
    return f"{name}: element {index} = {value}"


# config.json keys whose type or size other code trusted: a layer list, a layer count, a nested
# text config, an interval that is divided by, a norm epsilon
CONFIG_TYPES = {
    "layer_types": [True, "full_attention", {"0": "full_attention"}, [1, 2], [],
                    ["full_attention"] * 1000, ["linear_attention", None]],
    "num_hidden_layers": [10**6, 2**31, 1025],
    "text_config": [True, {}, {"a": 1}, [], {"num_hidden_layers": 10**6}, {"layer_types": True}],
    "full_attention_interval": [0, -1, "4", 10**9],
    "rms_norm_eps": [0.0, 1e-45, 1e300, -1e-6],
}  # fmt: skip


def _config_type_mutation(rng: random.Random, file: Path) -> str:
    key = rng.choice(sorted(CONFIG_TYPES))
    value = rng.choice(CONFIG_TYPES[key])
    config = json.loads(file.read_text())
    config[key] = value
    file.write_text(json.dumps(config))
    return f"{file.name}: {key} = {str(value)[:40]}"


def make_hf_case(rng: random.Random, workdir: Path) -> tuple:
    fixture = rng.choice(HF_FIXTURES)
    target = workdir / fixture
    shutil.copytree(FIXTURES / fixture, target, ignore=shutil.ignore_patterns("*.npz"))
    shards = sorted(target.glob("*.safetensors"))
    what = rng.choice(
        ["config", "config", "safetensors", "safetensors", "tokenizer", "other", "config type"]
    )
    if what == "config type":
        done = _config_type_mutation(rng, target / "config.json")
    elif what == "config":
        force = {"vocab_size": 1} if rng.random() < 0.05 else None
        done = _mutate_json_file(rng, target / "config.json", force)
    elif what == "safetensors":
        done = _mutate_safetensors(rng, rng.choice(shards))
    elif what == "tokenizer":
        done = _mutate_json_file(rng, target / "tokenizer.json")
    else:
        others = [target / "tokenizer_config.json", target / "model.safetensors.index.json"]
        done = _mutate_json_file(rng, rng.choice([f for f in others if f.is_file()]))
    return target, f"{fixture}: {done}"


def make_case(kind: str, seed: int, workdir: Path, real_gguf: Path | None = None) -> tuple:
    """(path, description) of case `seed` of `kind` ("gguf", "hf", "real"), under `workdir`."""
    rng = random.Random(f"{kind}-{seed}")
    workdir.mkdir(parents=True, exist_ok=True)
    if kind == "hf":
        return make_hf_case(rng, workdir)
    if kind == "real":
        return make_gguf_case(rng, workdir, source=real_gguf)
    return make_gguf_case(rng, workdir)
