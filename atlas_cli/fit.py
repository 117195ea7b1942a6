"""Will it fit? Weights + KV cache for the requested context against the device's memory.

Checked before weights are loaded, so a model that cannot fit is refused with the numbers and
a way out (a shorter context, a smaller variant, a smaller KV dtype) instead of swapping the
machine to death or dying in an allocator.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from atlas_cli.backend.layers import LayerKind
from atlas_cli.errors import ModelTooLargeError
from atlas_cli.units import size_text

DTYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "fp8": 1}
OVERHEAD_BYTES = 256 << 20  # interpreter, tokenizer, activations of a prefill chunk
OVERHEAD_FRACTION = 0.02  # of the weights: scratch buffers scale with the model
MIN_USEFUL_CONTEXT = 512
CPU_WEIGHT_BYTES = 4  # the numpy backend holds weights as float32 (ops.prepare_weight)


@dataclass(frozen=True)
class KVShape:
    layers: int  # layers that keep a KV cache
    kv_heads: int
    head_dim: int
    state_bytes: int = 0  # fixed per-sequence state (linear attention), any context

    def bytes_per_token(self, dtype: str) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * DTYPE_BYTES[dtype]  # K and V


@dataclass(frozen=True)
class FitEstimate:
    weights_bytes: int
    kv_bytes: int
    state_bytes: int
    overhead_bytes: int
    context: int
    kv_dtype: str
    available_bytes: int | None  # None: no such device here (a question about recipes)
    device: str
    kv_per_token: int

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.state_bytes + self.overhead_bytes

    @property
    def fits(self) -> bool | None:
        """None where there is no device to fit in."""
        if self.available_bytes is None:
            return None
        return self.total_bytes <= self.available_bytes

    def max_context(self) -> int:
        """The longest context that fits next to the weights (0: the weights alone do not)."""
        if self.available_bytes is None:
            return self.context
        room = self.available_bytes - self.weights_bytes - self.state_bytes - self.overhead_bytes
        return max(room // max(self.kv_per_token, 1), 0)

    def as_json(self) -> dict[str, Any]:
        return {
            "weights_bytes": self.weights_bytes,
            "kv_cache_bytes": self.kv_bytes,
            "state_bytes": self.state_bytes,
            "overhead_bytes": self.overhead_bytes,
            "total_bytes": self.total_bytes,
            "available_bytes": self.available_bytes,
            "context": self.context,
            "kv_dtype": self.kv_dtype,
            "device": self.device,
            "fits": self.fits,
        }


def estimate(
    weights_bytes: int,
    shape: KVShape,
    context: int,
    kv_dtype: str,
    available_bytes: int,
    device: str,
) -> FitEstimate:
    per_token = shape.bytes_per_token(kv_dtype)
    overhead = OVERHEAD_BYTES + int(OVERHEAD_FRACTION * weights_bytes)
    return FitEstimate(
        weights_bytes=weights_bytes,
        kv_bytes=per_token * context,
        state_bytes=shape.state_bytes,
        overhead_bytes=overhead,
        context=context,
        kv_dtype=kv_dtype,
        available_bytes=available_bytes,
        device=device,
        kv_per_token=per_token,
    )


def ensure_fits(what: str, est: FitEstimate, smaller: list[str] = ()) -> None:
    """Raise ModelTooLargeError with the numbers and what to try instead."""
    if est.fits is not False:
        return
    ideas = []
    longest = est.max_context()
    if longest >= MIN_USEFUL_CONTEXT:
        ctx = 2 ** int(math.log2(longest)) if longest < est.context else longest
        ideas.append(f"a shorter context (--ctx-size {ctx} fits)")
    if est.kv_dtype in ("bf16", "f16") and est.device != "cpu":
        ideas.append("an 8-bit KV cache (kv_cache_dtype fp8)")
    if smaller:
        ideas.append(f"a smaller variant or model ({', '.join(smaller)})")
    else:
        ideas.append("a smaller model (`atlas list --available`)")
    total, weights, kv = (size_text(n) for n in (est.total_bytes, est.weights_bytes, est.kv_bytes))
    state = f" + state {size_text(est.state_bytes)}" if est.state_bytes else ""
    raise ModelTooLargeError(
        f"{what} does not fit: it needs {total} (weights {weights} + KV cache {kv} for "
        f"{est.context} tokens in {est.kv_dtype}{state} + {size_text(est.overhead_bytes)} "
        f"overhead) but {est.device} has {size_text(est.available_bytes)} available; try "
        f"{', or '.join(ideas)}"
    )


def cpu_kv_dtype(device: str) -> str:
    """The KV cache type of a CPU device by default: the fast path's f16, the reference's f32."""
    return "f32" if device == "cpu-ref" else "f16"


UNQUANTIZED_GGUF = frozenset({"F32", "F16", "BF16"})  # GGUF types the CPU dequantizes


def variant_weight_bytes(variant, parameter_count: int, device: str) -> int:
    """Resident weight bytes of a recipe variant on `device`, from its facts alone (nothing
    downloaded), counted the way `weight_bytes` counts loaded weights: on `cpu` the fast path
    computes on the GGUF blocks, so a quantized GGUF stays about its file's size; `cpu-ref`
    and anything else on the CPU become float32; a GPU holds the variant's file."""
    blocks = variant.format == "gguf" and variant.quantization.upper() not in UNQUANTIZED_GGUF
    if device == "cpu":
        return variant.size if blocks and variant.size else parameter_count * CPU_WEIGHT_BYTES
    if device == "cpu-ref":
        return parameter_count * CPU_WEIGHT_BYTES
    return variant.size or parameter_count * 2


def recipe_estimate(
    recipe, variant: str, hw_class: str, available_bytes: int | None, device: str | None = None
) -> FitEstimate:
    """Weights + KV cache of a recipe variant at its default context, from the recipe's facts
    alone: the estimate `atlas show`, `list --available` and `pull` print, and the one
    `check_loaded` makes once the weights are open. On the CPU the KV cache is f16 (f32 on
    cpu-ref); on a GPU it takes the recipe's KV dtype (else bf16). `device` tells cpu from
    cpu-ref."""
    m = recipe.model
    defaults = recipe.defaults_for(variant)
    context = defaults.ctx_size or m.context_length
    shape = KVShape(m.kv_layers, m.kv_heads, m.head_dim, m.state_bytes)
    if hw_class == "cpu":
        device = device if device == "cpu-ref" else "cpu"
        kv_dtype = cpu_kv_dtype(device)
    else:
        device = hw_class
        kv_dtype = defaults.kv_cache_dtype if defaults.kv_cache_dtype in DTYPE_BYTES else "bf16"
    weights = variant_weight_bytes(recipe.variants[variant], m.parameter_count, device)
    return estimate(weights, shape, context, kv_dtype, available_bytes, hw_class)


def shape_from_config(config: dict[str, Any]) -> KVShape:
    """KV-cache shape from a Hugging Face config.json (or the config atlas builds from GGUF)."""
    cfg = config.get("text_config") or config
    layers = int(cfg["num_hidden_layers"])
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    types = cfg.get("layer_types")
    if types:
        attention = sum(1 for t in types if t == LayerKind.ATTENTION)
    elif cfg.get("full_attention_interval"):
        attention = layers // int(cfg["full_attention_interval"])
    else:
        attention = layers
    state = 0
    if attention < layers and cfg.get("linear_num_value_heads"):
        # Gated DeltaNet: one fp32 (heads, dk, dv) state per linear layer
        nv = int(cfg["linear_num_value_heads"])
        dk = int(cfg.get("linear_key_head_dim", 128))
        dv = int(cfg.get("linear_value_head_dim", 128))
        state = (layers - attention) * nv * dk * dv * 4
    return KVShape(attention, kv_heads, head_dim, state)


def count_parameters(weights: dict[str, Any]) -> int:
    return sum(math.prod(getattr(w, "shape", ())) for w in weights.values())


def weight_bytes(weights: dict[str, Any]) -> int:
    """Resident bytes once loaded: GGUF blocks kept by the fast CPU path (QuantizedTensor)
    stay their size; everything else becomes float32."""
    total = 0
    for w in weights.values():
        blocks = getattr(w, "blocks", None)
        if blocks is not None:
            total += blocks.nbytes
        else:
            total += math.prod(getattr(w, "shape", ())) * CPU_WEIGHT_BYTES
    return total


def check_loaded(
    name: str,
    config: dict[str, Any],
    weights: dict[str, Any],
    context: int,
    device: str,
    alternatives: Callable[[], list[str]] | None = None,
    kv_dtype: str | None = None,
) -> FitEstimate:
    """The check `session.load` runs on the CPU backends before materializing weights.
    `alternatives` names smaller models to suggest (asked only when it does not fit);
    `kv_dtype` is --kv-type (None: the device's default, `cpu_kv_dtype`)."""
    from atlas_cli.hardware import system_memory

    _, available = system_memory()
    kv = kv_dtype or cpu_kv_dtype(device)
    est = estimate(weight_bytes(weights), shape_from_config(config), context, kv, available, "cpu")
    if not est.fits:
        ensure_fits(name, est, alternatives() if alternatives else [])
    return est
