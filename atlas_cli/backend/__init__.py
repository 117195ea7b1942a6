"""Load a model (recipe name, GGUF file or Hugging Face directory) onto a device.

model = load_model("smollm2-135m")
model.logits(ids)                     # (len(ids), vocab) float32, fresh sequence
for event in model.generate("Hi", max_tokens=32, temperature=0):
    print(event.text, end="")
"""

from __future__ import annotations

import importlib
import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from atlas_cli.errors import CorruptModelError, DeviceError, UnsupportedModelError

# Used where neither the caller nor the model's recipe sets a value (llama.cpp's defaults).
SAMPLING_DEFAULTS = {
    "temperature": 0.8,
    "top_k": 40,
    "top_p": 0.95,
    "min_p": 0.05,
    "repeat_penalty": 1.0,
}
DEVICES = ("cpu", "cpu-ref", "cuda", "hip")
NATIVE_DEVICES = ("cuda", "hip")  # our kernels, through backend/ops/native.py
# The host ops modules: "cpu" computes on the GGUF blocks (numba kernels, ops/cpu_fast.py),
# "cpu-ref" is the float32 numpy reference every other backend is tested against.
CPU_OPS = {
    "cpu": "atlas_cli.backend.ops.cpu_fast",
    "cpu-ref": "atlas_cli.backend.ops.numpy_ref",
}
MODEL_CLASSES = {
    "llama": ("atlas_cli.backend.models.llama", "LlamaModel"),
    "mistral": ("atlas_cli.backend.models.llama", "LlamaModel"),
    "qwen3": ("atlas_cli.backend.models.qwen3", "Qwen3Model"),
    "qwen3_5": ("atlas_cli.backend.models.qwen3_5", "Qwen3_5Model"),
    "qwen3_5_text": ("atlas_cli.backend.models.qwen3_5", "Qwen3_5Model"),
}


@dataclass(frozen=True)
class ModelInfo:
    name: str
    path: Path
    format: str  # "gguf" | "safetensors"
    architecture: str
    config: dict[str, Any]
    file_type: str  # e.g. "Q4_1", "bf16"


class Model:
    """A loaded model: tokenizer, engine and the facts `atlas show` prints."""

    def __init__(
        self,
        info: ModelInfo,
        engine,
        device: str,
        load_s: float,
        defaults: dict[str, Any] | None = None,
    ):
        from atlas_cli.backend.engine import Engine

        self.info: ModelInfo = info
        self.engine: Engine = engine
        self.tokenizer = engine.tokenizer
        self.device = device
        self.load_s = load_s
        self.defaults = defaults or {}  # the recipe's run defaults (see store.run_defaults)

    @property
    def context_length(self) -> int:
        return self.engine.context_length

    def logits(self, token_ids: Sequence[int]):
        return self.engine.logits(token_ids)

    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int = 512,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        min_p: float | None = None,
        repeat_penalty: float | None = None,
        seed: int | None = None,
        stop: Sequence[str] = (),
        add_special_tokens: bool = True,
        stats=None,
    ) -> Iterator:
        """Stream TokenEvents. Sampling values left as None come from the model's recipe
        defaults, then from atlas's (`SAMPLING_DEFAULTS`)."""
        from atlas_cli.backend.sample import SamplingParams

        given = dict(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            repeat_penalty=repeat_penalty,
        )
        params = {**SAMPLING_DEFAULTS, **self.sampling_defaults}
        params.update({k: v for k, v in given.items() if v is not None})
        return self.engine.generate(
            prompt,
            max_tokens=max_tokens,
            sampling=SamplingParams(seed=seed, **params),
            stop=stop,
            add_special_tokens=add_special_tokens,
            stats=stats,
        )

    @property
    def sampling_defaults(self) -> dict[str, Any]:
        return {k: v for k, v in self.defaults.items() if k in SAMPLING_DEFAULTS}

    def chat_prompt(self, messages: list[dict[str, Any]], **template_kwargs: Any) -> list[int]:
        """Token ids of `messages` rendered with the model's chat template (the recipe's
        template kwargs, e.g. `enable_thinking`, apply unless given)."""
        kwargs = {**self.defaults.get("chat_template_kwargs", {}), **template_kwargs}
        text = self.tokenizer.render_chat(messages, **kwargs)
        return self.tokenizer.encode(text, add_special_tokens=True)


def load_model(
    name_or_path: str,
    device: str = "cpu",
    ctx_size: int | None = None,
    progress=None,
    draft: int | None = None,
) -> Model:
    """Resolve `name_or_path` (fetching the embedded default if needed) and load it.
    `draft`: tokens drafted per step by the model's MTP head (None: the default when it has
    one; 0: no speculative decoding)."""
    from atlas_cli import fit, store

    if device not in DEVICES:
        raise DeviceError(f"unknown device {device!r} (available here: {', '.join(DEVICES)})")
    native = device in NATIVE_DEVICES
    if native:
        from atlas_cli.backend.ops import native as native_ops

        ops = native_ops.open_device(device)  # DeviceError before any download or parse
    else:
        ops = importlib.import_module(CPU_OPS[device])
    path = store.resolve(name_or_path, progress=progress, device=device)
    defaults = store.run_defaults(name_or_path, device=device)
    t0 = time.perf_counter()
    # the fast CPU path keeps GGUF blocks too, with llama.cpp's Q/K row order undone lazily
    fast = getattr(ops, "KEEP_QUANTIZED", False)
    if path.is_dir():
        info, weights, tokenizer = _open_hf_directory(path)
    else:
        info, weights, tokenizer = _open_gguf(path, native or fast, lazy_unpermute=fast)
    model_type = info.config["model_type"]
    if model_type not in MODEL_CLASSES:
        raise UnsupportedModelError(
            f"{path.name}: model type {model_type!r} is not supported "
            f"(supported: {', '.join(sorted(MODEL_CLASSES))})"
        )
    module, cls_name = MODEL_CLASSES[model_type]
    model_cls = getattr(importlib.import_module(module), cls_name)
    args_cls = importlib.import_module(module).ModelArgs
    args = args_cls.from_config(info.config)
    limit = args.max_position_embeddings
    context = min(ctx_size or defaults.get("ctx_size") or limit, limit)
    # refuse before dequantizing: that is where the memory goes
    fit.check_loaded(
        path.name, info.config, weights, context, device, lambda: store.alternatives(path)
    )
    if native:
        prepared = {k: _to_device(ops, k, v) for k, v in weights.items()}
    else:
        prepared = {k: ops.prepare_weight(v) if _is_matrix(k, v) else v for k, v in weights.items()}
    net = model_cls(args, prepared, ops)

    from atlas_cli.backend.engine import Engine

    if draft is None and isinstance(defaults.get("speculative"), dict):
        draft = defaults["speculative"].get("draft_tokens")
    elif defaults.get("speculative") is False:
        draft = draft if draft is not None else 0
    engine = Engine(net, tokenizer, context, draft=draft)
    return Model(info, engine, device, time.perf_counter() - t0, defaults)


def _is_matrix(name: str, value) -> bool:
    from atlas_cli.backend.ops import placement

    return placement.is_matrix(name, value)


def _to_device(ops, name: str, w):
    from atlas_cli.backend.ops import placement

    return placement.to_device(ops, name, w)


def _open_gguf(path: Path, keep_quantized: bool = False, lazy_unpermute: bool = False):
    from atlas_cli import store
    from atlas_cli.backend import tokenizer as tok
    from atlas_cli.backend.loaders import gguf, quant

    gf = gguf.open_gguf(path, cache_dir=store.cache_dir())
    config = gguf.config_from_metadata(gf.metadata, set(gf.tensors))
    weights = gguf.load_weights(
        gf, config, keep_quantized=keep_quantized, lazy_unpermute=lazy_unpermute
    )
    tokenizer = tok.from_gguf_metadata(gf.metadata)
    file_type = _dominant_type(gf, quant)
    info = ModelInfo(
        name=str(gf.metadata.get("general.name", path.stem)),
        path=path,
        format="gguf",
        architecture=gf.architecture,
        config=config,
        file_type=file_type,
    )
    return info, weights, tokenizer


def _dominant_type(gf, quant) -> str:
    counts: dict[str, int] = {}
    for t in gf.tensors.values():
        if len(t.shape) == 2:
            name = quant.GGML_TYPES[t.type_id].name if t.type_id in quant.GGML_TYPES else "?"
            counts[name] = counts.get(name, 0) + 1
    return max(counts, key=counts.get) if counts else "?"


def _open_hf_directory(path: Path):
    from atlas_cli.backend import tokenizer as tok
    from atlas_cli.backend.loaders import safetensors as st

    try:
        config = json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        raise UnsupportedModelError(f"{path}: no config.json; not a Hugging Face model") from None
    except ValueError as exc:
        raise CorruptModelError(f"{path}/config.json: invalid JSON ({exc})") from None
    weights = st.load_weights(path)
    tokenizer = tok.from_hf_directory(path, config)
    info = ModelInfo(
        name=path.name,
        path=path,
        format="safetensors",
        architecture=config.get("model_type", "unknown"),
        config=config,
        file_type=st.dominant_dtype(path),
    )
    return info, weights, tokenizer
