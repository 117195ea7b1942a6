"""What every model file shares (after mlx-lm's `models/base.py`): config parsing, the
`sanitize` hook for checkpoint quirks, the LM head, the SwiGLU MLP and RoPE frequencies.

A model class is built as `Model(args, weights, ops)`: `args` from `ModelArgs.from_config`,
`weights` by Hugging Face name (as the loaders give them, prepared by `ops.prepare_weight`), and
`ops` an implementation of the ops contract (ops/contract.py). The constructor never changes
the dict it is given: `sanitize` returns the model's own.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, fields
from typing import Any, Self

import numpy as np

from atlas_cli.backend.cache import Cache, host_cache
from atlas_cli.backend.layers import Attention, Declaration, GatedDeltaNet, Layer, LayerKind
from atlas_cli.backend.ops.contract import Ops

MAX_CONTEXT = 1 << 24  # 16M positions: above any released model; larger is a damaged file
MAX_SIZE = 1 << 20  # a width or head count beyond this is not a real model
# The largest released models have about 130 layers; each layer is a declaration and a set of
# expected tensors, so a count read from a damaged file is capped before anything is built.
MAX_LAYERS = 1 << 10
LAYER_COUNTS = {"num_hidden_layers", "mtp_num_hidden_layers"}
# The norms add eps to a float32 mean square: below float32's smallest normal it is 0 there
# (a zero row would divide by 0), above its largest it is Inf.
FLOAT32_RANGE = (float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max))
FLOAT32_FIELDS = {"rms_norm_eps"}
# Integer fields that may be 0 (every other integer size must be at least 1)
MAY_BE_ZERO = {"mtp_num_hidden_layers"}


class ConfigError(ValueError):
    """A config value of the wrong type or out of range: names the field and what was
    expected (the loader adds the file)."""

    def __init__(self, field: str, value: Any, expected: str):
        super().__init__(f"{field} is {value!r} (expected {expected})")


def _is_int(v: Any) -> bool:
    return type(v) is int


def _is_number(v: Any) -> bool:
    return type(v) in (int, float) and math.isfinite(v)


def _is_strings(v: Any) -> bool:
    return isinstance(v, list | tuple) and all(isinstance(x, str) for x in v)


# annotation -> (accepted value, what to say when it is not); ints get their range below
FIELD_KINDS = {
    "float": (lambda v: _is_number(v) and v > 0, "a positive finite number"),
    "bool": (lambda v: type(v) is bool, "true or false"),
    "dict": (lambda v: isinstance(v, dict), "an object"),
    "tuple[str, ...]": (_is_strings, "a list of strings"),
}


def check_field(name: str, kind: str, value: Any) -> None:
    """One config value against its field's annotation (the dataclass's string form)."""
    if kind.endswith("| None"):
        if value is None:
            return
        kind = kind.removesuffix("| None").strip()
    if kind == "int":
        low = 0 if name in MAY_BE_ZERO else 1
        high = MAX_SIZE
        if name == "max_position_embeddings":
            high = MAX_CONTEXT
        elif name in LAYER_COUNTS:
            high = MAX_LAYERS
        if not _is_int(value) or not low <= value <= high:
            raise ConfigError(name, value, f"an integer from {low} to {high:,}")
    elif kind in FIELD_KINDS:
        accept, expected = FIELD_KINDS[kind]
        if not accept(value):
            raise ConfigError(name, value, expected)
        low, high = FLOAT32_RANGE
        if name in FLOAT32_FIELDS and not low <= value <= high:
            raise ConfigError(name, value, f"a positive number from {low:.3g} to {high:.3g}")


class UnsupportedConfig(ConfigError):
    """A well-formed value atlas cannot run (an unknown RoPE scaling type, ...)."""


def require(ok: bool, field: str, value: Any, expected: str) -> None:
    if not ok:
        raise ConfigError(field, value, expected)


@dataclass(frozen=True)
class BaseModelArgs:
    """A model's hyperparameters: the fields are config.json keys; unknown keys are ignored.
    Every value is checked against its field's type and range, then `check` relates them."""

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Self:
        if not isinstance(config, dict):
            raise ConfigError("config", type(config).__name__, "a JSON object")
        kinds = {f.name: str(f.type) for f in fields(cls)}
        args = {k: v for k, v in config.items() if k in kinds}
        for name, value in args.items():
            check_field(name, kinds[name], value)
        missing = [f.name for f in fields(cls) if f.name not in args and _required(f)]
        if missing:
            raise ConfigError(missing[0], None, "a value: the config must set it")
        rope = config.get("rope_parameters")
        require(rope is None or isinstance(rope, dict), "rope_parameters", rope, "an object")
        # a model without per-layer kinds ignores layer_types, but a damaged one is still refused
        types = config.get("layer_types")
        require(types is None or _is_strings(types), "layer_types", types, "a list of strings")
        args = cls.derive(args, config)
        for name, value in args.items():  # derive may take values from nested keys
            check_field(name, kinds[name], value)
        made = cls(**args)
        made.check()
        return made

    @classmethod
    def derive(cls, args: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
        """Hook: fill or check the fields config.json states elsewhere (nested keys, values
        implied by other fields). `args` holds the keys that matched a field."""
        return args

    def check(self) -> None:
        """Hook: relations between fields (heads that divide, ...); raise ConfigError."""


def _required(f) -> bool:
    return f.default is MISSING and f.default_factory is MISSING


Shapes = dict[str, list[tuple[int, ...]]]  # weight name -> the shapes it may have


def attention_shapes(
    p: str, h: int, nh: int, nkv: int, hd: int, qk_norm: bool, gated: bool = False
) -> tuple[Shapes, Shapes]:
    """(required, optional) weights of an attention block under prefix `p` ("...self_attn.");
    `gated`: q_proj may also carry a per-head output gate (2 * nh * hd rows)."""
    q_rows = [nh * hd, 2 * nh * hd] if gated else [nh * hd]
    required = {
        p + "q_proj.weight": [(r, h) for r in q_rows],
        p + "k_proj.weight": [(nkv * hd, h)],
        p + "v_proj.weight": [(nkv * hd, h)],
        p + "o_proj.weight": [(h, nh * hd)],
    }
    if qk_norm:
        required |= {p + "q_norm.weight": [(hd,)], p + "k_norm.weight": [(hd,)]}
    optional = {
        p + "q_proj.bias": [(r,) for r in q_rows],
        p + "k_proj.bias": [(nkv * hd,)],
        p + "v_proj.bias": [(nkv * hd,)],
    }
    return required, optional


def mlp_shapes(p: str, h: int, ff: int) -> Shapes:
    """A decoder layer's two norms and its SwiGLU MLP, under prefix `p` ("...layers.{i}.")."""
    return {
        p + "input_layernorm.weight": [(h,)],
        p + "post_attention_layernorm.weight": [(h,)],
        p + "mlp.gate_proj.weight": [(ff, h)],
        p + "mlp.up_proj.weight": [(ff, h)],
        p + "mlp.down_proj.weight": [(h, ff)],
    }


class BaseModel:
    """A decoder built from its declaration (`declare`): the op path every backend runs, the
    cache it needs, and the fused decode step the backend builds from the same declaration.
    A model file adds `declare`, `rope_frequencies` and the math of mixers other than
    attention."""

    has_mtp = False  # a multi-token-prediction head for speculative decoding (qwen3_5)

    def __init__(self, args: Any, weights: dict[str, Any], ops: Ops):
        self.args = args
        self.ops = ops
        self.declaration = self.declare(args)
        self.w = self.sanitize(weights)
        self.inv_freq = self.rope_frequencies()
        # Backends may run a whole decode step in one call, built from the declaration
        # (a speculative verify, which records every state, keeps the op path); None: op by op.
        self.fused = ops.fuse_decoder(self)

    @classmethod
    def declare(cls, args: Any) -> Declaration:
        """The model's layers and the weights around them (layers.py)."""
        raise NotImplementedError

    def rope_frequencies(self) -> np.ndarray:
        """RoPE inverse frequencies (rot/2,) float32 (`rope_inv_freq`)."""
        raise NotImplementedError

    def sanitize(self, weights: dict[str, Any]) -> dict[str, Any]:
        """The weights as this model reads them, in a new dict: checkpoint quirks go here, not
        into the math. Here: a tied (or absent) lm_head is the embedding table."""
        d = self.declaration
        w = dict(weights)
        if self.args.tie_word_embeddings or d.lm_head not in w:
            w[d.lm_head] = w[d.embedding]
        return w

    # -- the op path ----------------------------------------------------------------------------

    def forward(self, ids: np.ndarray, cache: Cache, start: int) -> np.ndarray:
        """Hidden states after the final norm, (T, H), for `ids` (T,) at positions start...;
        advances `cache` by T positions (attention K/V, linear-attention state)."""
        if self.fused is not None and len(ids) == 1 and not cache.recording:
            return self.fused.decode(int(ids[0]), cache, start)
        d = self.declaration
        x = self.ops.embedding(self.w[d.embedding], ids)  # (T, H)
        x = self.layers(x, cache, start)
        return self.norm(x, d.final_norm)

    def layers(self, x: np.ndarray, cache: Cache, start: int) -> np.ndarray:
        positions = np.arange(start, start + x.shape[0])
        for i, layer in enumerate(self.declaration.layers):
            h = self.norm(x, layer.input_norm)
            if layer.kind is LayerKind.ATTENTION:
                x = x + self.attention(layer.mixer, h, i, positions, cache, start)
            else:
                x = x + self.gated_deltanet(layer.mixer, h, i, cache, start)
            x = x + self.mlp(layer.mlp, self.norm(x, layer.post_norm))
        return x

    def norm(self, x, name: str):
        """RMSNorm of x by the weight `name`, in the declared form."""
        d = self.declaration
        return self.ops.rms_norm(x, self.w[name], d.eps, unit_offset=d.unit_offset_norms)

    def attention(self, m: Attention, h, layer: int, positions, cache: Cache, start: int):
        """Grouped-query attention as `m` declares it: q/k/v (+ biases), the per-head q/k norms,
        RoPE, the cache, the output gate (transformers' LlamaAttention, Qwen3Attention,
        Qwen3_5Attention)."""
        ops, w, eps = self.ops, self.w, self.declaration.eps
        t, hd, nh, nkv = h.shape[0], m.head_dim, m.n_heads, m.n_kv_heads
        q_w, k_w, v_w = (w[n] for n in m.inputs)
        q_b, k_b, v_b = (w.get(n) for n in m.biases)
        qg = ops.linear(h, q_w, q_b)
        gated = m.output_gate and qg.shape[1] == 2 * nh * hd
        qg = qg.reshape(t, nh, -1)  # (T, nh, hd), or (T, nh, 2*hd): query and gate per head
        q, gate = qg[..., :hd], qg[..., hd:]
        k = ops.linear(h, k_w, k_b).reshape(t, nkv, hd)  # (T, nkv, hd)
        v = ops.linear(h, v_w, v_b).reshape(t, nkv, hd)
        if m.q_norm is not None:
            unit = self.declaration.unit_offset_norms
            q = ops.rms_norm(q, w[m.q_norm], eps, unit_offset=unit)
            k = ops.rms_norm(k, w[m.k_norm], eps, unit_offset=unit)
        q = ops.rope(q, positions, self.inv_freq)
        k = ops.rope(k, positions, self.inv_freq)
        keys, values = cache.update(layer, start, k, v)  # (nkv, S, hd)
        out = ops.attention(q, keys, values, start).reshape(t, nh * hd)  # (T, nh*hd)
        if gated:
            out = out * ops.sigmoid(gate.reshape(t, nh * hd))
        return ops.linear(out, w[m.output])

    def gated_deltanet(self, m, h, layer: int, cache: Cache, start: int):
        """A linear-attention mixer (models/qwen3_5.py has one)."""
        raise NotImplementedError(f"{type(self).__name__} declares no Gated DeltaNet layer")

    def mlp(self, names: tuple[str, str, str], h):
        """SwiGLU: down(silu(gate(h)) * up(h)) by the weights (gate, up, down) `names`."""
        ops, w = self.ops, self.w
        gate, up, down = names
        return ops.linear(ops.silu_mul(ops.linear(h, w[gate]), ops.linear(h, w[up])), w[down])

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """(T, H) final hidden states -> (T, V) float32 logits (a fused decode step may have
        computed them already)."""
        done = self.fused.logits_for(hidden) if self.fused is not None else None
        if done is not None:
            return done
        return self.ops.linear(hidden, self.w[self.declaration.lm_head])

    # -- the cache ------------------------------------------------------------------------------

    def new_cache(self, max_len: int) -> Cache:
        """The cache the declared layers need: the backend's device cache, else the fused
        step's (its own KV type and layout), else the host's."""
        layout = self.declaration.cache_layout()
        cache = self.ops.device_cache(layout, max_len)
        if cache is None and self.fused is not None:
            cache = self.fused.new_cache(layout, max_len)
        return cache if cache is not None else host_cache(layout, max_len)


def declaration(layers, eps: float, unit_offset_norms: bool = False) -> Declaration:
    """`layers` with Hugging Face's names for the embedding, the final norm and the lm_head."""
    return Declaration(
        tuple(layers),
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
        eps,
        unit_offset_norms,
    )


def attention_layer(prefix: str, a: Any, qk_norm: bool = False, output_gate: bool = False) -> Layer:
    """A block of Hugging Face's Llama names under `prefix` ("model.layers.{i}."): `self_attn`
    with the geometry of `a` (ModelArgs), the two norms and the SwiGLU `mlp`."""
    p = prefix + "self_attn."
    mixer = Attention(
        a.num_attention_heads,
        a.num_key_value_heads,
        a.dim_per_head,
        inputs=(p + "q_proj.weight", p + "k_proj.weight", p + "v_proj.weight"),
        output=p + "o_proj.weight",
        biases=(p + "q_proj.bias", p + "k_proj.bias", p + "v_proj.bias"),
        q_norm=p + "q_norm.weight" if qk_norm else None,
        k_norm=p + "k_norm.weight" if qk_norm else None,
        output_gate=output_gate,
    )
    return block(prefix, mixer)


def block(prefix: str, mixer: Attention | GatedDeltaNet) -> Layer:
    """`mixer` with the two norms and the SwiGLU MLP under `prefix`, by Hugging Face's names."""
    mlp = (prefix + "mlp.gate_proj.weight", prefix + "mlp.up_proj.weight")
    return Layer(
        mixer,
        prefix + "input_layernorm.weight",
        prefix + "post_attention_layernorm.weight",
        (*mlp, prefix + "mlp.down_proj.weight"),
    )


ROPE_SCALING_KEYS = {  # the numbers each supported scaling type needs (rope_inv_freq reads them)
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def check_rope(rot_dims: int, scaling: dict[str, Any] | None) -> None:
    """What rope_inv_freq needs: an even, non-zero number of rotated dims and a scaling it
    knows, with positive numbers."""
    require(rot_dims > 0 and rot_dims % 2 == 0, "rotary dims", rot_dims, "an even number > 0")
    scaling = scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_SCALING_KEYS:
        raise UnsupportedConfig(
            "rope_scaling.rope_type", kind, f"one of {', '.join(ROPE_SCALING_KEYS)}"
        )
    for key in ROPE_SCALING_KEYS[kind]:
        value = scaling.get(key)
        require(_is_number(value) and value > 0, f"rope_scaling.{key}", value, "a positive number")
    if kind == "llama3":
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        require(high != low, "rope_scaling.high_freq_factor", high, "a value other than low's")


def rope_inv_freq(
    head_dim: int,
    theta: float,
    partial_rotary_factor: float = 1.0,
    scaling: dict[str, Any] | None = None,
    freq_factors: np.ndarray | None = None,
) -> np.ndarray:
    """RoPE inverse frequencies (rot/2,) float32 for the rotated first `rot` dims of a head,
    with the scaling the config names (HF's `ROPE_INIT_FUNCTIONS`: default, linear, llama3).
    GGUF files carry llama3 scaling as per-frequency divisors (`rope_freqs`) instead."""
    rot = int(head_dim * partial_rotary_factor)
    inv = 1.0 / (theta ** (np.arange(0, rot, 2, dtype=np.float64) / rot))
    scaling = scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        inv = inv / scaling["factor"]
    elif kind == "llama3":
        inv = _llama3_scaled(inv, scaling)
    elif kind not in ("default",):
        raise ValueError(f"unsupported rope scaling {kind!r}")
    if freq_factors is not None:
        inv = inv / freq_factors.astype(np.float64)
    return inv.astype(np.float32)


def _llama3_scaled(inv: np.ndarray, scaling: dict[str, Any]) -> np.ndarray:
    """Llama 3.1's frequency-dependent scaling: long wavelengths divided by `factor`, short
    ones kept, a smooth blend between."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_ctx = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    smooth = (old_ctx / wavelen - low) / (high - low)
    scaled = np.where(wavelen > old_ctx / low, inv / factor, inv)
    mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
    return np.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
