"""GGUF files: metadata, tensor index and weights under Hugging Face names.

Parsing goes through the `gguf` package. Its reader parses the 50K-entry tokenizer arrays field by
field, which takes seconds, so the parsed header (metadata + tensor table) is cached as JSON next
to atlas's other caches, keyed by the file's path, size and mtime. Tensor bytes are always read
through a memory map of the file itself. The first load checks every weight for NaN and Inf
(loaders/finite.py: the scales of every block, so every page of the file); an empty marker
under the same key remembers that it passed, and later loads skip the check.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from atlas_cli.backend.formats import QuantizedWeight, StoredRows, WeightFormat, ggml_type_name
from atlas_cli.backend.loaders import finite, gguf_reader, quant, validate
from atlas_cli.errors import CorruptModelError, UnsupportedModelError

GGUF_MAGIC = b"GGUF"
HEADER_CACHE_VERSION = 2  # 2: our own bounded reader (gguf_reader.py)

# GGUF tensor names -> Hugging Face names. `{i}` is the block index.
TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
    # qwen35 (Qwen3.5/3.6): Gated DeltaNet layers and the post-attention norm
    "blk.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_qkv.weight": "model.layers.{i}.linear_attn.in_proj_qkv.weight",
    "blk.{i}.attn_gate.weight": "model.layers.{i}.linear_attn.in_proj_z.weight",
    "blk.{i}.ssm_beta.weight": "model.layers.{i}.linear_attn.in_proj_b.weight",
    "blk.{i}.ssm_alpha.weight": "model.layers.{i}.linear_attn.in_proj_a.weight",
    "blk.{i}.ssm_conv1d.weight": "model.layers.{i}.linear_attn.conv1d.weight",
    "blk.{i}.ssm_a": "model.layers.{i}.linear_attn.A_log",
    "blk.{i}.ssm_dt.bias": "model.layers.{i}.linear_attn.dt_bias",
    "blk.{i}.ssm_norm.weight": "model.layers.{i}.linear_attn.norm.weight",
    "blk.{i}.ssm_out.weight": "model.layers.{i}.linear_attn.out_proj.weight",
}
# The multi-token-prediction block, stored by llama.cpp as block `num_hidden_layers` (the decoder
# tensors of that block map to `mtp.layers.0.*`).
NEXTN_NAMES = {
    "nextn.eh_proj.weight": "mtp.fc.weight",
    "nextn.enorm.weight": "mtp.pre_fc_norm_embedding.weight",
    "nextn.hnorm.weight": "mtp.pre_fc_norm_hidden.weight",
    "nextn.shared_head_norm.weight": "mtp.norm.weight",
    "nextn.embed_tokens.weight": "mtp.embed_tokens.weight",
    "nextn.shared_head_head.weight": "mtp.lm_head.weight",
}
_BLOCK_NAME = re.compile(r"^blk\.(\d+)\.(.+)$")

# Architectures whose converter permuted Q/K rows for ggml's interleaved RoPE (llama.cpp's
# convert_hf_to_gguf.py `LlamaModel.permute`); we undo it so RoPE is the HF rotate_half form.
PERMUTED_QK_ARCHS = {"llama"}
SUPPORTED_ARCHS = {"llama", "qwen2", "qwen3", "qwen35"}


@dataclass(frozen=True)
class TensorInfo:
    name: str  # the GGUF name
    type_id: int
    shape: tuple[int, ...]  # numpy order: (rows, cols)
    offset: int  # absolute byte offset in the file
    nbytes: int


@dataclass(frozen=True)
class QuantizedTensor(QuantizedWeight):
    """A weight kept in its GGUF blocks: `blocks` is (rows, bytes_per_row) uint8. With
    `row_perm`, logical row i is `blocks[row_perm[i]]` (llama.cpp's Q/K row order left in place,
    see `load_weights(lazy_unpermute=True)`)."""

    type_id: int
    shape: tuple[int, int]
    blocks: np.ndarray
    row_perm: np.ndarray | None = None
    col_perm: np.ndarray | None = None  # logical column c is stored column col_perm[c]

    @property
    def format(self) -> WeightFormat:
        return quant.GGML_TYPES[self.type_id]

    def dequantize(self) -> np.ndarray:
        blocks = self.blocks if self.row_perm is None else self.blocks[self.row_perm]
        w = quant.dequantize(blocks, self.type_id, self.shape)
        return w if self.col_perm is None else np.ascontiguousarray(w[:, self.col_perm])

    def stored(self) -> StoredRows:
        return StoredRows(self.blocks, row_perm=self.row_perm, col_perm=self.col_perm)


class GGUFFile:
    """An opened GGUF file: `metadata` (plain Python values) and `tensors` by GGUF name."""

    def __init__(
        self,
        path: Path,
        metadata: dict[str, Any],
        tensors: dict[str, TensorInfo],
        finite_marker: Path | None = None,
    ):
        self.path = path
        self.metadata = metadata
        self.tensors = tensors
        self._map = np.memmap(path, dtype=np.uint8, mode="r")
        self.finite_marker = finite_marker  # where a passed non-finite check is remembered

    @property
    def known_finite(self) -> bool:
        """Whether an earlier load of this very file (path, size, mtime) found no NaN or Inf."""
        return self.finite_marker is not None and self.finite_marker.exists()

    def remember_finite(self) -> None:
        if self.finite_marker is None:
            return
        try:
            self.finite_marker.parent.mkdir(parents=True, exist_ok=True)
            self.finite_marker.touch()
        except OSError:
            pass  # a marker we cannot write only costs the check next time

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "unknown"))

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes, zero-copy: (rows, bytes_per_row) uint8 for quantized types."""
        info = self.tensors[name]
        qtype = quant.GGML_TYPES.get(info.type_id)
        if qtype is None:
            raise UnsupportedModelError(
                f"{self.path.name}: tensor {name} has GGML type {info.type_id} "
                f"({ggml_type_name(info.type_id)}), which atlas does "
                f"not support (supported: {', '.join(t.name for t in quant.GGML_TYPES.values())})"
            )
        data = self._map[info.offset : info.offset + info.nbytes]
        rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
        return data.reshape(rows, -1)

    def float32(self, name: str) -> np.ndarray:
        info = self.tensors[name]
        return quant.dequantize(self.raw(name), info.type_id, info.shape)


def open_gguf(path: str | os.PathLike, cache_dir: Path | None = None) -> GGUFFile:
    """Open and validate a GGUF file; the header is cached in `cache_dir` when given. Every
    tensor is checked against the file (supported type, whole blocks, inside it, no overlaps),
    cached header or not."""
    path = Path(path)
    if not path.is_file():
        raise CorruptModelError(f"{path}: no such file")
    size = path.stat().st_size
    if size == 0:  # an interrupted copy or download: "bad magic bytes" would not say so
        raise CorruptModelError(f"{path}: empty file (0 bytes); copy or download it again")
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise CorruptModelError(f"{path}: not a GGUF file (bad magic bytes)")
    header = _read_cached_header(path, cache_dir) if cache_dir else None
    if header is None:
        header = _parse_header(path)
        if cache_dir:
            _write_cached_header(path, cache_dir, header)
    metadata, tensors = header
    spans = [validate.Span(t.name, t.offset, t.offset + t.nbytes) for t in tensors.values()]
    validate.check_spans(str(path), spans, size)
    marker = _cache_path(path, cache_dir).with_suffix(".finite") if cache_dir else None
    return GGUFFile(path, metadata, tensors, marker)


def _parse_header(path: Path) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
    metadata, table, data_start = gguf_reader.read_header(path)
    alignment = metadata["general.alignment"]
    tensors = {}
    for name, type_id, dims, offset in table:
        if name in tensors:
            raise CorruptModelError(f"{path}: tensor {name} appears twice")
        qtype = quant.GGML_TYPES.get(type_id)
        if qtype is None:
            raise UnsupportedModelError(
                f"{path.name}: tensor {name} has GGML type {type_id} "
                f"({ggml_type_name(type_id)}), which atlas does "
                f"not support (supported: {', '.join(t.name for t in quant.GGML_TYPES.values())})"
            )
        if offset % alignment:
            raise CorruptModelError(
                f"{path}: tensor {name} starts at data offset {offset:,}, which is not a "
                f"multiple of general.alignment {alignment}; the file is damaged"
            )
        shape = tuple(reversed(dims))  # numpy order
        if 0 in shape:
            raise CorruptModelError(f"{path}: tensor {name} has shape {list(shape)} (a zero size)")
        nbytes = validate.block_bytes(str(path), name, shape, qtype.block_elems, qtype.block_bytes)
        tensors[name] = TensorInfo(name, type_id, shape, data_start + offset, nbytes)
    return metadata, tensors


def _cache_path(path: Path, cache_dir: Path) -> Path:
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{HEADER_CACHE_VERSION}"
    return cache_dir / f"gguf-{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


def _read_cached_header(path: Path, cache_dir: Path):
    try:
        raw = json.loads(_cache_path(path, cache_dir).read_text())
        tensors = {t[0]: TensorInfo(t[0], t[1], tuple(t[2]), t[3], t[4]) for t in raw["tensors"]}
        return dict(raw["metadata"]), tensors
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None  # a damaged cache is only a cache: parse the file again


def _write_cached_header(path: Path, cache_dir: Path, header) -> None:
    metadata, tensors = header
    rows = [[t.name, t.type_id, list(t.shape), t.offset, t.nbytes] for t in tensors.values()]
    target = _cache_path(path, cache_dir)
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(".tmp")
        tmp.write_text(json.dumps({"metadata": metadata, "tensors": rows}))
        tmp.replace(target)
    except OSError:
        pass  # a cache we cannot write only costs time


def hf_name(gguf_name: str, n_layers: int | None = None) -> str | None:
    """The Hugging Face name for a GGUF tensor name, or None when unknown. Blocks from
    `n_layers` on are MTP blocks (`mtp.layers.{i - n_layers}.*`)."""
    if gguf_name in TENSOR_NAMES:
        return TENSOR_NAMES[gguf_name]
    m = _BLOCK_NAME.match(gguf_name)
    if not m:
        return None
    i, leaf = int(m.group(1)), m.group(2)
    if n_layers is not None and i >= n_layers:
        if leaf in NEXTN_NAMES:
            return NEXTN_NAMES[leaf]
        pattern = TENSOR_NAMES.get(f"blk.{{i}}.{leaf}")
        if pattern and pattern.startswith("model.layers.{i}."):
            return f"mtp.layers.{i - n_layers}." + pattern[len("model.layers.{i}.") :]
        return None
    pattern = TENSOR_NAMES.get(f"blk.{{i}}.{leaf}")
    return pattern.format(i=i) if pattern else None


class _Metadata:
    """Typed reads of `{arch}.*` keys: a wrong type is a CorruptModelError naming the key (the
    ranges are checked once, by the model's ModelArgs)."""

    def __init__(self, md: dict[str, Any], arch: str, source: str, required: bool):
        self.md, self.arch, self.source, self.required = md, arch, source, required

    def value(self, key: str, default: Any = None) -> Any:
        value = self.md.get(f"{self.arch}.{key}", default)
        if value is None and self.required:
            raise CorruptModelError(f"{self.source} lacks {self.arch}.{key}")
        return value

    def int(self, key: str, default: Any = None) -> int:
        value = self.value(key, default)
        if type(value) is not int:
            raise CorruptModelError(
                f"{self.source}: {self.arch}.{key} is {value!r} (expected an integer)"
            )
        return value

    def float(self, key: str, default: Any = None) -> float:
        value = self.value(key, default)
        if type(value) not in (int, float) or not math.isfinite(value):
            raise CorruptModelError(
                f"{self.source}: {self.arch}.{key} is {value!r} (expected a finite number)"
            )
        return float(value)

    def vocab(self) -> int:
        tokens = self.md.get("tokenizer.ggml.tokens")
        count = len(tokens) if isinstance(tokens, list) else 0
        return self.int("vocab_size", count) if self.md.get(f"{self.arch}.vocab_size") else count


def config_from_metadata(
    md: dict[str, Any], tensor_names: set[str], source: str = "GGUF metadata"
) -> dict[str, Any]:
    """A Hugging Face style config.json dict from GGUF metadata; `source` names the file."""
    arch = md.get("general.architecture")
    if not isinstance(arch, str) or arch not in SUPPORTED_ARCHS:
        raise UnsupportedModelError(
            f"{source}: architecture {arch!r} is not supported by atlas "
            f"(supported GGUF architectures: {', '.join(sorted(SUPPORTED_ARCHS))})"
        )
    if arch == "qwen35":
        return _qwen35_config(_Metadata(md, arch, source, required=True), tensor_names)
    get = _Metadata(md, arch, source, required=False)
    hidden = get.int("embedding_length")
    heads = get.int("attention.head_count")
    config = {
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": get.int("feed_forward_length"),
        "num_hidden_layers": get.int("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get.int("attention.head_count_kv", heads),
        "head_dim": get.int("attention.key_length", hidden // heads if heads > 0 else 0),
        "rms_norm_eps": get.float("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": get.float("rope.freq_base", 10000.0),
        "max_position_embeddings": get.int("context_length", 4096),
        "vocab_size": get.vocab(),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
    }
    scaling = get.value("rope.scaling.type")
    if scaling == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": get.float("rope.scaling.factor")}
    elif scaling not in (None, "none"):
        raise UnsupportedModelError(f"RoPE scaling {scaling!r} in GGUF files is not supported")
    return config


def _qwen35_config(get: _Metadata, tensor_names: set[str]) -> dict[str, Any]:
    """A `qwen3_5_text` config from qwen35 metadata (as transformers' `_qwen35_config`)."""
    head_dim = get.int("attention.key_length")
    value_heads = get.int("ssm.time_step_rank")
    mtp_layers = get.int("nextn_predict_layers", 0)
    layers = get.int("block_count") - mtp_layers
    for name, value in (("attention.key_length", head_dim), ("ssm.time_step_rank", value_heads)):
        if value <= 0:  # divided by below
            raise CorruptModelError(
                f"{get.source}: qwen35.{name} is {value} (expected a positive integer)"
            )
    return {
        "model_type": "qwen3_5_text",
        "hidden_size": get.int("embedding_length"),
        "intermediate_size": get.int("feed_forward_length"),
        # the file counts the MTP block as a layer; the decoder stack does not
        "num_hidden_layers": layers,
        "mtp_num_hidden_layers": mtp_layers,
        "num_attention_heads": get.int("attention.head_count"),
        "num_key_value_heads": get.int("attention.head_count_kv"),
        "head_dim": head_dim,
        "rms_norm_eps": get.float("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": get.float("rope.freq_base", 10_000_000.0),
        "partial_rotary_factor": get.int("rope.dimension_count") / head_dim,
        "max_position_embeddings": get.int("context_length", 262144),
        "vocab_size": get.vocab(),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "full_attention_interval": get.int("full_attention_interval", 4),
        **_qwen35_layer_types(get.md.get("qwen35.attention.recurrent_layers"), layers),
        "linear_conv_kernel_dim": get.int("ssm.conv_kernel"),
        "linear_key_head_dim": get.int("ssm.state_size"),
        "linear_num_key_heads": get.int("ssm.group_count"),
        "linear_num_value_heads": value_heads,
        "linear_value_head_dim": get.int("ssm.inner_size") // value_heads,
    }


def _qwen35_layer_types(recurrent, layers: int) -> dict[str, Any]:
    """llama.cpp's per-layer flags (`attention.recurrent_layers`, one bool per block, the MTP
    block last) as HF `layer_types`; without them `full_attention_interval` decides."""
    if recurrent is None:
        return {}
    if not isinstance(recurrent, list) or len(recurrent) < layers:
        raise CorruptModelError(
            f"GGUF metadata qwen35.attention.recurrent_layers has "
            f"{len(recurrent) if isinstance(recurrent, list) else 'no'} entries for {layers} layers"
        )
    flags = recurrent[:layers]
    return {"layer_types": ["linear_attention" if f else "full_attention" for f in flags]}


def load_weights(
    gf: GGUFFile,
    config: dict[str, Any],
    keep_quantized: bool = False,
    lazy_unpermute: bool = False,
):
    """All tensors under Hugging Face names: float32 arrays, or QuantizedTensor for quantized
    2-D weights when `keep_quantized` (norms and other 1-D tensors are always float32).
    llama.cpp's layout changes are undone here: the llama Q/K row permutation, and for qwen35
    the `w + 1` norms, `-exp(A_log)`, the squeezed conv and the tiled value heads. With
    `lazy_unpermute`, permuted Q/K QuantizedTensors keep the file's row order and carry
    `row_perm` instead of a reordered copy, and qwen35's `out_proj` keeps its column order and
    carries `col_perm`, so every block stays in the memory map. A tensor holding NaN or Inf
    (a float value, or a quantized block's scale) is a CorruptModelError, unless an earlier
    load of the same file found none."""
    arch = gf.architecture
    check = not gf.known_finite
    permute = arch in PERMUTED_QK_ARCHS
    n_layers = config["num_hidden_layers"] if arch == "qwen35" else None
    weights: dict[str, Any] = {}
    for name, info in gf.tensors.items():
        target = hf_name(name, n_layers)
        if target is None:
            raise UnsupportedModelError(f"{gf.path.name}: unknown tensor {name}")
        raw = gf.raw(name)
        if check:
            finite.check_gguf_tensor(gf.path.name, name, raw, quant.GGML_TYPES[info.type_id])
        perm = None
        if permute and target.endswith(("q_proj.weight", "k_proj.weight")):
            n_head = config["num_attention_heads" if "q_proj" in target else "num_key_value_heads"]
            perm = unpermute_index(raw.shape[0], n_head)
        if arch == "qwen35":
            weights[target] = _qwen35_tensor(
                target, raw, info, config, keep_quantized, lazy_unpermute
            )
            if target.endswith("linear_attn.A_log") and not np.isfinite(weights[target]).all():
                raise CorruptModelError(
                    f"{gf.path.name}: tensor {name} holds a value >= 0 (expected "
                    "ssm_a = -exp(A_log) < 0); the file is damaged"
                )
            continue
        quantized = quant.GGML_TYPES[info.type_id].quantized
        if keep_quantized and quantized and len(info.shape) == 2:
            if perm is not None and not lazy_unpermute:
                raw, perm = np.ascontiguousarray(raw[perm]), None
            weights[target] = QuantizedTensor(info.type_id, info.shape, raw, perm)
        else:
            if perm is not None:
                raw = np.ascontiguousarray(raw[perm])
            weights[target] = quant.dequantize(raw, info.type_id, info.shape)
    if check:
        gf.remember_finite()
    return weights


def unpermute_index(n_rows: int, n_head: int) -> np.ndarray:
    """Row i of the un-permuted (HF) tensor is row `index[i]` of the GGUF tensor: the index form
    of `unpermute_rows`."""
    head_dim = n_rows // n_head
    rows = np.arange(n_rows, dtype=np.int64)
    return rows.reshape(n_head, head_dim // 2, 2).swapaxes(1, 2).reshape(-1)


def _qwen35_tensor(
    target: str, raw: np.ndarray, info: TensorInfo, config, keep_quantized: bool, lazy: bool
):
    """Undo llama.cpp's qwen35 conversion (convert_hf_to_gguf.py `Qwen3_5TextModel`, mirrored
    by transformers' gguf_conversion_mapping.py `_qwen35`) for one tensor."""
    nk, nv = config["linear_num_key_heads"], config["linear_num_value_heads"]
    dk, dv = config["linear_key_head_dim"], config["linear_value_head_dim"]
    r = nv // nk
    leaf = target.rsplit(".", 2)[-2] + "." + target.rsplit(".", 1)[-1]
    if "linear_attn." in target and r > 1:  # one value head per key head: HF's order already
        # rows that carry value heads: whole (possibly quantized) rows move, so blocks stay intact
        if leaf in ("in_proj_qkv.weight", "conv1d.weight"):
            raw = np.concatenate([raw[: 2 * nk * dk], grouped_rows(raw[2 * nk * dk :], nk, r, dv)])
        elif leaf == "in_proj_z.weight":
            raw = grouped_rows(raw, nk, r, dv)
        elif leaf in ("in_proj_a.weight", "in_proj_b.weight"):
            raw = grouped_rows(raw, nk, r, 1)
    quantized = quant.GGML_TYPES[info.type_id].quantized
    keep = keep_quantized and quantized and len(info.shape) == 2
    if target.endswith("linear_attn.out_proj.weight"):
        return _qwen35_out_proj(raw, info, (nk, r, dv), keep, lazy)
    if keep:
        return QuantizedTensor(info.type_id, info.shape, np.ascontiguousarray(raw))
    w = quant.dequantize(raw, info.type_id, info.shape)
    if target.endswith(("linear_attn.A_log", "linear_attn.dt_bias")):
        w = grouped_rows(w.reshape(-1, 1), nk, r, 1).reshape(-1)
        if target.endswith("A_log"):
            with np.errstate(divide="ignore", invalid="ignore"):  # load_weights refuses those
                w = np.log(-w)  # stored as ssm_a = -exp(A_log)
    elif target.endswith("linear_attn.conv1d.weight"):
        w = w.reshape(w.shape[0], 1, -1)  # (C, K) -> (C, 1, K) as in HF
    elif _is_offset_norm(target):
        w = w - np.float32(1.0)  # zero-centred (1 + w) norms are stored as w + 1
    return np.ascontiguousarray(w, dtype=np.float32)


def _qwen35_out_proj(raw: np.ndarray, info: TensorInfo, heads, keep: bool, lazy: bool):
    """out_proj, whose value heads run along the columns, across quantization blocks: kept in
    its blocks where the order is already HF's (one value head per key head) or the backend
    takes a column permutation (`lazy`, the fast CPU path); else dequantized and reordered."""
    cols = info.shape[1]
    perm = grouped_rows(np.arange(cols, dtype=np.int64).reshape(-1, 1), *heads).reshape(-1)
    identity = bool(np.array_equal(perm, np.arange(cols)))
    if keep and (identity or lazy):
        blocks = np.ascontiguousarray(raw)
        return QuantizedTensor(
            info.type_id, info.shape, blocks, col_perm=None if identity else perm
        )
    w = quant.dequantize(raw, info.type_id, info.shape)
    return w if identity else np.ascontiguousarray(w[:, perm])


def _is_offset_norm(target: str) -> bool:
    """The zero-centred (1 + w) norms, which llama.cpp stores as w + 1: every norm weight,
    the MTP pre-fc norms included, except the Gated DeltaNet output norm."""
    module = target.removesuffix(".weight").rsplit(".", 1)[-1]
    return target.endswith(".weight") and "norm" in module and "linear_attn.norm" not in target


def grouped_rows(rows: np.ndarray, nk: int, r: int, head_dim: int) -> np.ndarray:
    """Rows of `nk * r` value heads of `head_dim` rows each, from llama.cpp's tiled order
    (head j of key group g at position j*nk + g) back to HF's grouped order (g*r + j)."""
    tail = rows.shape[1:]
    return rows.reshape(r, nk, head_dim, *tail).swapaxes(0, 1).reshape(rows.shape)


def unpermute_rows(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation. Rows are whole (quantized) rows, so this works on
    GGUF blocks as well as on float weights. Matches transformers'
    `LlamaTensorProcessor._reverse_permute_weights`."""
    out_rows = rows.shape[0]
    head_dim = out_rows // n_head
    # GGUF rows are (n_head, head_dim/2, 2) ordered; HF rows are (n_head, 2, head_dim/2).
    return np.ascontiguousarray(
        rows.reshape(n_head, head_dim // 2, 2, -1).swapaxes(1, 2).reshape(rows.shape)
    )
