"""Load a model file or Hugging Face directory onto a device.

This package imports nothing of atlas outside `backend/` (but `atlas_cli.errors` and the leaf
`atlas_cli.store.paths`): names, recipes and the fit check are `atlas_cli.session`'s business.

model = load(Path("model.gguf"))
model.logits(ids)                     # (len(ids), vocab) float32, fresh sequence
for event in model.generate("Hi", max_tokens=32, sampling=SamplingOverrides(temperature=0)):
    print(event.text, end="")
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from atlas_cli.backend.defaults import RunDefaults
from atlas_cli.backend.sample import SamplingOverrides, SamplingParams
from atlas_cli.errors import CorruptModelError, DeviceError, UnsupportedModelError, UsageError

# "emu": our kernels on the CPU emulator of the GPU execution model (slow; correctness anywhere)
DEVICES = ("cpu", "cpu-ref", "cuda", "hip", "emu")
NOT_SET = SamplingOverrides()  # generate()'s default: the recipe's settings, then atlas's
NATIVE_DEVICES = ("cuda", "hip", "emu")  # our kernels, through backend/ops/native/device.py
# The host ops modules: "cpu" computes on the GGUF blocks (numba kernels, ops/cpu/fast.py),
# "cpu-ref" is the float32 numpy reference every other backend is tested against.
CPU_OPS = {
    "cpu": "atlas_cli.backend.ops.cpu.fast",
    "cpu-ref": "atlas_cli.backend.ops.numpy_ref",
}
MODEL_CLASSES = {
    "llama": ("atlas_cli.backend.models.llama", "LlamaModel"),
    "mistral": ("atlas_cli.backend.models.llama", "LlamaModel"),
    # Qwen2 / Qwen2.5: Llama with q/k/v biases, which every Llama-family declaration lists
    "qwen2": ("atlas_cli.backend.models.llama", "LlamaModel"),
    "qwen3": ("atlas_cli.backend.models.qwen3", "Qwen3Model"),
    "qwen3_5": ("atlas_cli.backend.models.qwen3_5", "Qwen3_5Model"),
    "qwen3_5_text": ("atlas_cli.backend.models.qwen3_5", "Qwen3_5Model"),
}
# Called with (config, weights, context) after the weights are mapped and before they are
# materialized, where a model that does not fit should be refused (atlas_cli.fit). The config
# is the model's checked arguments (ModelArgs as a dict), never the file's raw values.
FitCheck = Callable[[dict[str, Any], dict[str, Any], int], None]


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
        defaults: RunDefaults | None = None,
    ):
        from atlas_cli.backend.engine import Engine

        self.info: ModelInfo = info
        self.engine: Engine = engine
        self.tokenizer = engine.tokenizer
        self.device = device
        self.load_s = load_s
        self.defaults = defaults or RunDefaults()

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
        sampling: SamplingOverrides = NOT_SET,
        stop: Sequence[str] = (),
        add_special_tokens: bool = True,
        stats=None,
    ) -> Iterator:
        """Stream TokenEvents. Sampling fields `sampling` leaves unset come from the model's
        recipe defaults, then from atlas's (`SamplingParams`)."""
        return self.engine.generate(
            prompt,
            max_tokens=max_tokens,
            sampling=self.sampling(sampling),
            stop=stop,
            add_special_tokens=add_special_tokens,
            stats=stats,
        )

    def sampling(self, given: SamplingOverrides) -> SamplingParams:
        """What the sampler runs with: `given`, then the recipe's defaults, then atlas's."""
        return given.over(self.defaults.sampling).params()

    def chat_prompt(self, messages: list[dict[str, Any]], **template_kwargs: Any) -> list[int]:
        """Token ids of `messages` rendered with the model's chat template (the recipe's
        template kwargs, e.g. `enable_thinking`, apply unless given)."""
        kwargs = {**self.defaults.chat_template_kwargs, **template_kwargs}
        text = self.tokenizer.render_chat(messages, **kwargs)
        return self.tokenizer.encode(text, add_special_tokens=True)


RUNTIME_MODULES = {"cuda": "cupy", "hip": "hip"}  # the package each GPU device runs through


def installed_devices() -> list[str]:
    """The devices whose runtime package is installed (a GPU may still be missing)."""
    import importlib.util

    from atlas_cli.backend.ops.native import runtime_emu

    return [
        d
        for d in DEVICES
        if (d != "emu" or runtime_emu.available())
        and (d not in RUNTIME_MODULES or importlib.util.find_spec(RUNTIME_MODULES[d]))
    ]


@functools.cache
def open_device(device: str):
    """The ops module (CPU) or NativeOps (GPU) for `device`, opened once per process: a
    DeviceError, one line saying what to install, when it cannot be used."""
    if device not in DEVICES:
        raise DeviceError(
            f"unknown device {device!r} (available here: {', '.join(installed_devices())})"
        )
    if device in NATIVE_DEVICES:
        from atlas_cli.backend.ops.native import device as native_ops

        return native_ops.open_device(device)
    return importlib.import_module(CPU_OPS[device])


def load(
    path: Path,
    *,
    device: str = "cpu",
    ops=None,
    ctx_size: int | None = None,
    draft: int | None = None,
    defaults: RunDefaults | None = None,
    fit_check: FitCheck | None = None,
    kv_dtype: str | None = None,
) -> Model:
    """Load the model at `path` (a GGUF file or a Hugging Face directory) onto `device`.

    `ops`: the device already opened by `open_device` (opened here when None). `ctx_size`,
    `draft` (tokens drafted per step by an MTP head; 0: off) and `kv_dtype` (the KV cache of a
    native device: bf16, fp8 or f32) fall back to `defaults`, then to the model's own.
    `fit_check` may refuse the model before its weights are materialized."""
    defaults = defaults or RunDefaults()
    ops = ops if ops is not None else open_device(device)
    native = device in NATIVE_DEVICES
    # the fast CPU path keeps GGUF blocks too, with llama.cpp's Q/K row order undone lazily
    fast = ops.KEEP_QUANTIZED
    ops = _with_kv_dtype(ops, native, fast, kv_dtype, defaults.kv_dtype)
    t0 = time.perf_counter()
    if path.is_dir():
        opened = _open_hf_directory(path)
    else:
        opened = _open_gguf(path, native or fast, lazy_unpermute=fast)
    info, tokenizer = opened.info, opened.tokenizer
    model_type = info.config.get("model_type")
    if not isinstance(model_type, str) or model_type not in MODEL_CLASSES:
        raise UnsupportedModelError(
            f"{path.name}: model type {model_type!r} is not supported "
            f"(supported: {', '.join(sorted(MODEL_CLASSES))})"
        )
    module_name, cls_name = MODEL_CLASSES[model_type]
    module = importlib.import_module(module_name)
    model_class = getattr(module, cls_name)
    args = _model_args(module, info.config, opened.config_source)
    _check_against_config(path, opened, model_class, args)
    weights = opened.weights()  # only now: the mapped or dequantized tensors
    limit = args.max_position_embeddings
    if ctx_size and ctx_size > limit:  # the user asked for it: say so rather than clamp
        raise UsageError(
            f"--ctx-size {ctx_size:,} is above what {path.name} holds ({limit:,} tokens); "
            f"give at most {limit:,}"
        )
    context = min(ctx_size or defaults.ctx_size or limit, limit)
    if fit_check is not None:  # before dequantizing: that is where the memory goes
        fit_check(dataclasses.asdict(args), weights, context)
    if native:
        prepared = {k: _to_device(ops, k, v) for k, v in weights.items()}
    else:
        prepared = {k: ops.prepare_weight(v) if _is_matrix(k, v) else v for k, v in weights.items()}
    net = model_class(args, prepared, ops)
    if kv_dtype is not None and net.fused is not None:
        net.fused.use_kv_type(kv_dtype)

    from atlas_cli.backend.engine import Engine

    engine = Engine(net, tokenizer, context, draft=draft if draft is not None else defaults.draft)
    return Model(info, engine, device, time.perf_counter() - t0, defaults)


def check_kv_type(kv_dtype: str | None) -> None:
    """A --kv-type value, checked before anything loads."""
    from atlas_cli.backend.cache import HOST_KV_TYPES
    from atlas_cli.backend.ops.native.attention import KV_DTYPES

    known = dict.fromkeys((*KV_DTYPES, *HOST_KV_TYPES))
    if kv_dtype is not None and kv_dtype not in known:
        raise UsageError(f"--kv-type must be one of {', '.join(known)}, got {kv_dtype!r}")


def _with_kv_dtype(ops, native: bool, fast: bool, given: str | None, recipe: str | None):
    """The ops making this model's KV caches: the given type, else the recipe's, else the
    ops' own (bf16 as `open_device` makes them). The types each backend takes are its
    `KV_TYPES` (the fast CPU path's f16 or f32 go to its fused step in `load`)."""
    check_kv_type(given)
    allowed = ops.KV_TYPES
    if not native:
        if given is not None and given not in allowed:
            where = "--device cpu" if fast else "--device cpu-ref"
            raise UsageError(
                f"--kv-type {given}: {where} keeps its KV cache in {' or '.join(allowed)}; "
                "bf16 and fp8 are for --device cuda, hip or emu"
            )
        return ops
    if given is not None and given not in allowed:
        raise UsageError(
            f"--kv-type {given}: --device cuda, hip and emu keep their KV cache in "
            f"{', '.join(allowed)}; f16 is for --device cpu"
        )
    chosen = given or (recipe if recipe in allowed else None) or ops.kv_dtype
    return ops.with_kv_dtype(chosen)


def _is_matrix(name: str, value) -> bool:
    from atlas_cli.backend.ops.native import placement

    return placement.is_matrix(name, value)


def _to_device(ops, name: str, w):
    from atlas_cli.backend.ops.native import placement

    return placement.to_device(ops, name, w)


@dataclass(frozen=True)
class _Opened:
    """A model file with its headers read and checked, and its tensors not yet touched."""

    info: ModelInfo
    tokenizer: Any
    shapes: dict[str, tuple[int, ...]]  # every tensor's shape under its HF name
    weights: Callable[[], dict[str, Any]]  # maps (or dequantizes) the tensors
    config_source: str  # where the config came from, for its errors


def _model_args(module, config: dict[str, Any], source: str):
    """The model's typed, range-checked arguments; a bad value names the file and field."""
    from atlas_cli.backend.models.base import ConfigError, UnsupportedConfig

    try:
        return module.ModelArgs.from_config(config)
    except UnsupportedConfig as exc:
        raise UnsupportedModelError(f"{source}: {exc}") from None
    except ConfigError as exc:
        raise CorruptModelError(f"{source}: {exc}") from None


def _check_against_config(path: Path, opened: _Opened, model_class, args) -> None:
    """Every tensor's shape against the config, and the tokenizer against the vocabulary:
    before any weight is read."""
    from atlas_cli.backend.loaders import validate

    required, optional = model_class.weight_shapes(args, set(opened.shapes))
    validate.check_shapes(path.name, opened.shapes, required, optional)
    tok = opened.tokenizer
    validate.check_vocab(
        opened.config_source,
        args.vocab_size,
        tok.vocab_size,
        {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id},
    )


def _open_gguf(path: Path, keep_quantized: bool = False, lazy_unpermute: bool = False):
    from atlas_cli.backend import tokenizer as tok
    from atlas_cli.backend.loaders import gguf, quant
    from atlas_cli.store import paths

    gf = gguf.open_gguf(path, cache_dir=paths.cache_dir())
    source = f"{path.name} (GGUF metadata)"
    config = gguf.config_from_metadata(gf.metadata, set(gf.tensors), source=source)
    tokenizer = tok.from_gguf_metadata(gf.metadata, source=path.name)
    n_layers = config["num_hidden_layers"] if gf.architecture == "qwen35" else None
    shapes = {gguf.hf_name(n, n_layers): t.shape for n, t in gf.tensors.items()}
    shapes.pop(None, None)  # an unknown name is refused when the weights are read
    info = ModelInfo(
        name=str(gf.metadata.get("general.name", path.stem)),
        path=path,
        format="gguf",
        architecture=gf.architecture,
        config=config,
        file_type=_dominant_type(gf, quant),
    )

    def weights():
        return gguf.load_weights(
            gf, config, keep_quantized=keep_quantized, lazy_unpermute=lazy_unpermute
        )

    return _Opened(info, tokenizer, shapes, weights, source)


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

    source = f"{path.name}/config.json"
    try:
        config = json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        raise UnsupportedModelError(f"{path}: no config.json; not a Hugging Face model") from None
    except (ValueError, RecursionError) as exc:
        raise CorruptModelError(f"{path}/config.json: invalid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise CorruptModelError(f"{source}: expected a JSON object, found {type(config).__name__}")
    shapes = st.logical_shapes(path)  # every header checked against its file
    tokenizer = tok.from_hf_directory(path, config)
    info = ModelInfo(
        name=path.name,
        path=path,
        format="safetensors",
        architecture=str(config.get("model_type", "unknown")),
        config=config,
        file_type=st.dominant_dtype(path),
    )
    return _Opened(info, tokenizer, shapes, lambda: st.load_weights(path), source)
