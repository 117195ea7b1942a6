"""Llama-architecture decoder (Llama 2/3, SmolLM2, Mistral-style), after transformers'
`LlamaForCausalLM`: pre-norm blocks, GQA attention with neox RoPE, SwiGLU MLP."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from atlas_cli.backend.cache import Cache, KVCache
from atlas_cli.backend.models.base import (
    BaseModel,
    BaseModelArgs,
    Shapes,
    attention_shapes,
    check_rope,
    mlp_shapes,
    require,
    rope_inv_freq,
)
from atlas_cli.backend.ops.contract import Ops


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
    """Runs on any ops module (numpy reference or native): the math only."""

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

    def __init__(self, args: ModelArgs, weights: dict[str, Any], ops: Ops):
        super().__init__(args, weights, ops)
        self.inv_freq = rope_inv_freq(
            args.dim_per_head,
            args.rope_theta,
            args.partial_rotary_factor,
            args.rope_scaling,
            self.w.get("rope_freqs"),
        )
        # Backends may run a whole decode step in one call; None: op by op.
        self.fused = ops.fuse_decoder(self)

    def forward(self, ids: np.ndarray, cache: Cache, start: int) -> np.ndarray:
        """Hidden states after the final norm, (T, H), for `ids` (T,) at positions start...;
        writes their keys and values into `cache`."""
        if self.fused is not None and len(ids) == 1:
            return self.fused.decode(int(ids[0]), cache, start)
        ops, a = self.ops, self.args
        positions = np.arange(start, start + len(ids))
        x = ops.embedding(self.w["model.embed_tokens.weight"], ids)  # (T, H)
        for i in range(a.num_hidden_layers):
            p = f"model.layers.{i}."
            h = ops.rms_norm(x, self.w[p + "input_layernorm.weight"], a.rms_norm_eps)
            x = x + self.attention(h, i, positions, cache, start)
            h = ops.rms_norm(x, self.w[p + "post_attention_layernorm.weight"], a.rms_norm_eps)
            x = x + self.mlp(h, p + "mlp.")
        return ops.rms_norm(x, self.w["model.norm.weight"], a.rms_norm_eps)

    def attention(self, h, layer: int, positions, cache: Cache, start: int):
        ops, a, w = self.ops, self.args, self.w
        p = f"model.layers.{layer}.self_attn."
        t, hd = h.shape[0], a.dim_per_head
        q = ops.linear(h, w[p + "q_proj.weight"], w.get(p + "q_proj.bias"))
        k = ops.linear(h, w[p + "k_proj.weight"], w.get(p + "k_proj.bias"))
        v = ops.linear(h, w[p + "v_proj.weight"], w.get(p + "v_proj.bias"))
        q = q.reshape(t, a.num_attention_heads, hd)  # (T, nh, hd)
        k = k.reshape(t, a.num_key_value_heads, hd)  # (T, nkv, hd)
        v = v.reshape(t, a.num_key_value_heads, hd)
        if self.qk_norm:
            q = ops.rms_norm(q, w[p + "q_norm.weight"], a.rms_norm_eps)
            k = ops.rms_norm(k, w[p + "k_norm.weight"], a.rms_norm_eps)
        q = ops.rope(q, positions, self.inv_freq)
        k = ops.rope(k, positions, self.inv_freq)
        keys, values = cache.update(layer, start, k, v)  # (nkv, S, hd)
        out = ops.attention(q, keys, values, start)  # (T, nh, hd)
        return ops.linear(out.reshape(t, -1), w[p + "o_proj.weight"])

    def new_cache(self, max_len: int) -> Cache:
        if self.fused is not None:
            return self.fused.new_cache(max_len)
        a = self.args
        shape = (a.num_hidden_layers, a.num_key_value_heads, a.dim_per_head, max_len)
        # native ops keep the cache on the device; the host backends use cache.KVCache
        cache = self.ops.device_kv_cache(*shape)
        return cache if cache is not None else KVCache(*shape)
