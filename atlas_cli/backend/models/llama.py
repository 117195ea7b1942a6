"""Llama-architecture decoder (Llama 2/3, SmolLM2, Mistral-style), after transformers'
`LlamaForCausalLM`: pre-norm blocks, GQA attention with neox RoPE, SwiGLU MLP."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import numpy as np


@dataclass(frozen=True)
class ModelArgs:
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
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        known = {f.name for f in fields(cls)}
        args = {k: v for k, v in config.items() if k in known}
        # transformers 5 nests theta and scaling under rope_parameters
        rope = config.get("rope_parameters") or {}
        if "rope_theta" in rope:
            args.setdefault("rope_theta", rope["rope_theta"])
        if rope.get("rope_type", "default") != "default" and "rope_scaling" not in args:
            args["rope_scaling"] = rope
        if "partial_rotary_factor" in rope:
            args.setdefault("partial_rotary_factor", rope["partial_rotary_factor"])
        return cls(**args)

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads


def rope_inv_freq(args: ModelArgs, freq_factors: np.ndarray | None = None) -> np.ndarray:
    """RoPE inverse frequencies (rot/2,) float32, with the scaling the config names (HF's
    `ROPE_INIT_FUNCTIONS`: default, linear, llama3). GGUF files carry llama3 scaling as
    per-frequency divisors (`rope_freqs`) instead."""
    rot = int(args.dim_per_head * args.partial_rotary_factor)
    inv = 1.0 / (args.rope_theta ** (np.arange(0, rot, 2, dtype=np.float64) / rot))
    scaling = args.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        inv = inv / scaling["factor"]
    elif kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = np.where(wavelen > old_ctx / low, inv / factor, inv)
        mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        inv = np.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    elif kind not in ("default",):
        raise ValueError(f"unsupported rope scaling {kind!r}")
    if freq_factors is not None:
        inv = inv / freq_factors.astype(np.float64)
    return inv.astype(np.float32)


class LlamaModel:
    """Runs on any ops module (numpy reference or native): the math only."""

    qk_norm = False  # Qwen3 normalises q and k per head before RoPE

    def __init__(self, args: ModelArgs, weights: dict[str, Any], ops):
        self.args = args
        self.ops = ops
        self.w = weights
        self.inv_freq = rope_inv_freq(args, weights.get("rope_freqs"))
        if args.tie_word_embeddings or "lm_head.weight" not in weights:
            self.w["lm_head.weight"] = weights["model.embed_tokens.weight"]
        # Backends may run a whole decode step in one call (ops.fuse_decoder); None: op by op.
        fuse = getattr(ops, "fuse_decoder", None)
        self.fused = fuse(self) if fuse is not None else None

    def forward(self, ids: np.ndarray, cache, start: int) -> np.ndarray:
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
            x = x + self.mlp(h, p)
        return ops.rms_norm(x, self.w["model.norm.weight"], a.rms_norm_eps)

    def attention(self, h, layer: int, positions, cache, start: int):
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

    def mlp(self, h, prefix: str):
        ops, w = self.ops, self.w
        gate = ops.linear(h, w[prefix + "mlp.gate_proj.weight"])
        up = ops.linear(h, w[prefix + "mlp.up_proj.weight"])
        return ops.linear(ops.silu_mul(gate, up), w[prefix + "mlp.down_proj.weight"])

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """(T, H) final hidden states -> (T, V) float32 logits."""
        return self.ops.linear(hidden, self.w["lm_head.weight"])

    def new_cache(self, max_len: int):
        from atlas_cli.backend.cache import KVCache

        if self.fused is not None:
            return self.fused.new_cache(max_len)
        a = self.args
        # native ops keep the cache on the device; the numpy reference uses cache.KVCache
        make = getattr(self.ops, "KVCache", KVCache)
        return make(a.num_hidden_layers, a.num_key_value_heads, a.dim_per_head, max_len)
