"""Llama-architecture decoder (Llama 2/3, SmolLM2, Mistral-style), after transformers'
`LlamaForCausalLM`: pre-norm blocks, GQA attention with neox RoPE, SwiGLU MLP."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from atlas_cli.backend.layers import Declaration
from atlas_cli.backend.models.base import (
    BaseModel,
    BaseModelArgs,
    Shapes,
    attention_layer,
    attention_shapes,
    check_rope,
    declaration,
    mlp_shapes,
    require,
    rope_inv_freq,
)


@dataclass(frozen=True)
class ModelArgs(BaseModelArgs):
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    head_dim: int | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    rope_scaling: dict | None = None
    partial_rotary_factor: float = 1.0

    @classmethod
    def derive(cls, args: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
        # transformers 5 nests theta and scaling under rope_parameters
        rope = config.get("rope_parameters") or {}
        if "rope_theta" in rope:
            args.setdefault("rope_theta", rope["rope_theta"])
        if rope.get("rope_type", "default") != "default" and "rope_scaling" not in args:
            args["rope_scaling"] = rope
        if "partial_rotary_factor" in rope:
            args.setdefault("partial_rotary_factor", rope["partial_rotary_factor"])
        return args

    def check(self) -> None:
        nh, nkv = self.num_attention_heads, self.num_key_value_heads
        require(nh % nkv == 0, "num_key_value_heads", nkv, f"a divisor of {nh} heads")
        if self.head_dim is None:
            h = self.hidden_size
            require(h % nh == 0, "num_attention_heads", nh, f"a divisor of hidden_size {h}")
        require(
            0 < self.partial_rotary_factor <= 1,
            "partial_rotary_factor",
            self.partial_rotary_factor,
            "a number in (0, 1]",
        )
        check_rope(int(self.dim_per_head * self.partial_rotary_factor), self.rope_scaling)

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads


class LlamaModel(BaseModel):
    """Runs on any ops module (numpy reference or native): every layer is BaseModel's
    attention block, as the declaration says."""

    qk_norm = False  # Qwen3 normalises q and k per head before RoPE

    @classmethod
    def weight_shapes(cls, a: ModelArgs, names: set[str]) -> tuple[Shapes, Shapes]:
        """(required, optional) weights by name, each with its accepted shapes."""
        h, v, hd = a.hidden_size, a.vocab_size, a.dim_per_head
        nh, nkv = a.num_attention_heads, a.num_key_value_heads
        required = {"model.embed_tokens.weight": [(v, h)], "model.norm.weight": [(h,)]}
        optional = {
            "lm_head.weight": [(v, h)],
            "rope_freqs": [(int(hd * a.partial_rotary_factor) // 2,)],
        }
        for i in range(a.num_hidden_layers):
            p = f"model.layers.{i}."
            attn, bias = attention_shapes(p + "self_attn.", h, nh, nkv, hd, cls.qk_norm)
            required |= attn | mlp_shapes(p, h, a.intermediate_size)
            optional |= bias
        return required, optional

    @classmethod
    def declare(cls, a: ModelArgs) -> Declaration:
        layers = (
            attention_layer(f"model.layers.{i}.", a, qk_norm=cls.qk_norm)
            for i in range(a.num_hidden_layers)
        )
        return declaration(layers, a.rms_norm_eps)

    def rope_frequencies(self) -> np.ndarray:
        a = self.args
        return rope_inv_freq(
            a.dim_per_head,
            a.rope_theta,
            a.partial_rotary_factor,
            a.rope_scaling,
            self.w.get("rope_freqs"),
        )
