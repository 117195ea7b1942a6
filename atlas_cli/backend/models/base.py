"""What every model file shares (after mlx-lm's `models/base.py`): config parsing, the
`sanitize` hook for checkpoint quirks, the LM head, the SwiGLU MLP and RoPE frequencies.

A model class is built as `Model(args, weights, ops)`: `args` from `ModelArgs.from_config`,
`weights` by Hugging Face name (as the loaders give them, prepared by `ops.prepare_weight`), and
`ops` an implementation of the ops contract (ops/contract.py). The constructor never changes
the dict it is given: `sanitize` returns the model's own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Self

import numpy as np

from atlas_cli.backend.ops.contract import Ops


@dataclass(frozen=True)
class BaseModelArgs:
    """A model's hyperparameters: the fields are config.json keys; unknown keys are ignored."""

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Self:
        known = {f.name for f in fields(cls)}
        args = {k: v for k, v in config.items() if k in known}
        return cls(**cls.derive(args, config))

    @classmethod
    def derive(cls, args: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
        """Hook: fill or check the fields config.json states elsewhere (nested keys, values
        implied by other fields). `args` holds the keys that matched a field."""
        return args


class BaseModel:
    """The parts of a decoder every architecture has; a model file adds `forward`."""

    has_mtp = False  # a multi-token-prediction head for speculative decoding (qwen3_5)

    def __init__(self, args: Any, weights: dict[str, Any], ops: Ops):
        self.args = args
        self.ops = ops
        self.w = self.sanitize(weights)

    def sanitize(self, weights: dict[str, Any]) -> dict[str, Any]:
        """The weights as this model reads them, in a new dict: checkpoint quirks go here, not
        into the math. Here: a tied (or absent) lm_head is the embedding table."""
        w = dict(weights)
        if self.args.tie_word_embeddings or "lm_head.weight" not in w:
            w["lm_head.weight"] = w["model.embed_tokens.weight"]
        return w

    def mlp(self, h, p: str):
        """SwiGLU: down(silu(gate(h)) * up(h)), weights under prefix `p` ("...mlp.")."""
        ops, w = self.ops, self.w
        gate = ops.linear(h, w[p + "gate_proj.weight"])
        up = ops.linear(h, w[p + "up_proj.weight"])
        return ops.linear(ops.silu_mul(gate, up), w[p + "down_proj.weight"])

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """(T, H) final hidden states -> (T, V) float32 logits."""
        return self.ops.linear(hidden, self.w["lm_head.weight"])


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
