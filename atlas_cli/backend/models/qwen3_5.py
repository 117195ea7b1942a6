"""Qwen3.5 / Qwen3.6 dense (HF model_type `qwen3_5`, `qwen3_5_text`), after transformers'
`Qwen3_5ForCausalLM`: a hybrid of Gated DeltaNet (linear attention) layers and gated full
attention layers, with (1 + w) RMSNorms, partial rotary embedding and a SwiGLU MLP.

The math and weight names are in docs/formats.md ("Qwen3.5"). Text-only input makes the
interleaved mrope plain 1-D RoPE, which is what this file computes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from atlas_cli.backend.cache import HybridCache, KVCache
from atlas_cli.backend.models.base import (
    BaseModel,
    BaseModelArgs,
    Shapes,
    UnsupportedConfig,
    attention_shapes,
    check_rope,
    mlp_shapes,
    require,
    rope_inv_freq,
)
from atlas_cli.backend.ops.contract import Ops

FULL = "full_attention"
LINEAR = "linear_attention"


@dataclass(frozen=True)
class ModelArgs(BaseModelArgs):
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    head_dim: int = 256
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    layer_types: tuple[str, ...] = ()
    full_attention_interval: int = 4
    mtp_num_hidden_layers: int = 0

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        """From config.json: a `qwen3_5_text` config, or a `qwen3_5` one whose language model
        sits under `text_config` (keys there win over the top level); null values are unset."""
        text = config.get("text_config") if isinstance(config, dict) else None
        require(text is None or isinstance(text, dict), "text_config", text, "an object")
        merged = {**config, **(text or {})}
        return super().from_config({k: v for k, v in merged.items() if v is not None})

    @classmethod
    def derive(cls, args: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
        rope = config.get("rope_parameters") or {}
        for key in ("rope_theta", "partial_rotary_factor"):
            if key in rope:
                args.setdefault(key, rope[key])
        if rope.get("rope_type", "default") != "default":
            raise UnsupportedConfig("rope_parameters.rope_type", rope["rope_type"], "default")
        n = args["num_hidden_layers"]
        if not args.get("layer_types"):
            # transformers' Qwen3_5TextConfig.__post_init__: every interval-th layer is full
            interval = args.get("full_attention_interval", 4)
            args["layer_types"] = [LINEAR if (i + 1) % interval else FULL for i in range(n)]
        types = args["layer_types"]
        ok = isinstance(types, list | tuple) and all(t in (FULL, LINEAR) for t in types)
        require(ok and len(types) == n, "layer_types", types, f"{n} of {FULL!r}/{LINEAR!r}")
        args["layer_types"] = tuple(types)
        return args

    def check(self) -> None:
        nh, nkv = self.num_attention_heads, self.num_key_value_heads
        nk, nv = self.linear_num_key_heads, self.linear_num_value_heads
        require(nh % nkv == 0, "num_key_value_heads", nkv, f"a divisor of {nh} heads")
        require(nv % nk == 0, "linear_num_key_heads", nk, f"a divisor of {nv} value heads")
        factor = self.partial_rotary_factor
        require(0 < factor <= 1, "partial_rotary_factor", factor, "a number in (0, 1]")
        check_rope(int(self.head_dim * factor), None)

    @property
    def dim_per_head(self) -> int:
        return self.head_dim

    @property
    def conv_channels(self) -> int:
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.value_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim


class Qwen3_5Model(BaseModel):
    """Runs on any ops module (numpy reference or native): the math only."""

    def __init__(self, args: ModelArgs, weights: dict[str, Any], ops: Ops):
        super().__init__(args, weights, ops)
        self.inv_freq = rope_inv_freq(args.head_dim, args.rope_theta, args.partial_rotary_factor)
        # Backends may run a whole decode step in one call (a speculative verify, which
        # records every state, keeps the op path); None: op by op.
        self.fused = ops.fuse_decoder(self)

    @classmethod
    def weight_shapes(cls, a: ModelArgs, names: set[str]) -> tuple[Shapes, Shapes]:
        """(required, optional) weights by name, each with its accepted shapes; the MTP block
        is optional as a whole, and complete when `mtp.fc.weight` is there."""
        h, v, ff = a.hidden_size, a.vocab_size, a.intermediate_size
        required = {"model.embed_tokens.weight": [(v, h)], "model.norm.weight": [(h,)]}
        optional = {"lm_head.weight": [(v, h)], "mtp.embed_tokens.weight": [(v, h)]}
        for i, kind in enumerate(a.layer_types):
            p = f"model.layers.{i}."
            required |= mlp_shapes(p, h, ff)
            if kind == LINEAR:
                required |= cls.linear_shapes(a, p + "linear_attn.")
            else:
                attn, bias = cls.attention_shapes(a, p + "self_attn.")
                required, optional = required | attn, optional | bias
        mtp, mtp_bias = cls.attention_shapes(a, "mtp.layers.0.self_attn.")
        mtp |= mlp_shapes("mtp.layers.0.", h, ff)
        mtp |= {"mtp.fc.weight": [(h, 2 * h)]}
        mtp |= {f"mtp.{n}.weight": [(h,)] for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden")}
        mtp |= {"mtp.norm.weight": [(h,)]}
        if "mtp.fc.weight" in names:
            return required | mtp, optional | mtp_bias
        return required, optional | mtp | mtp_bias

    @staticmethod
    def attention_shapes(a: ModelArgs, p: str) -> tuple[Shapes, Shapes]:
        nh, nkv = a.num_attention_heads, a.num_key_value_heads
        return attention_shapes(p, a.hidden_size, nh, nkv, a.head_dim, True, gated=True)

    @staticmethod
    def linear_shapes(a: ModelArgs, p: str) -> Shapes:
        nv, h, k = a.linear_num_value_heads, a.hidden_size, a.linear_conv_kernel_dim
        return {
            p + "in_proj_qkv.weight": [(a.conv_channels, h)],
            p + "in_proj_z.weight": [(a.value_dim, h)],
            p + "in_proj_b.weight": [(nv, h)],
            p + "in_proj_a.weight": [(nv, h)],
            # (C, 1, K) in HF checkpoints, (C, K) in GGUF files
            p + "conv1d.weight": [(a.conv_channels, 1, k), (a.conv_channels, k)],
            p + "A_log": [(nv,)],
            p + "dt_bias": [(nv,)],
            p + "norm.weight": [(a.linear_value_head_dim,)],
            p + "out_proj.weight": [(h, a.value_dim)],
        }

    def sanitize(self, weights: dict[str, Any]) -> dict[str, Any]:
        """The tied lm_head, plus per Gated DeltaNet layer: the conv weight as (C, K), and the
        constant decay rate `A` = -exp(A_log), computed once in float32."""
        w = super().sanitize(weights)
        for i, kind in enumerate(self.args.layer_types):
            if kind == LINEAR:
                p = f"model.layers.{i}.linear_attn."
                conv = w[p + "conv1d.weight"]
                w[p + "conv1d.weight"] = conv.reshape(conv.shape[0], -1)  # (C, 1, K) -> (C, K)
                w[p + "A"] = -np.exp(np.asarray(w[p + "A_log"], np.float32))
        return w

    # -- the stack ----------------------------------------------------------------------------

    def forward(self, ids: np.ndarray, cache: HybridCache, start: int) -> np.ndarray:
        """Hidden states after the final norm, (T, H), for `ids` (T,) at positions start...;
        advances `cache` (KV of attention layers, state of linear layers) by T positions."""
        if self.fused is not None and len(ids) == 1 and not cache.recording:
            return self.fused.decode(int(ids[0]), cache, start)
        ops, a = self.ops, self.args
        x = ops.embedding(self.w["model.embed_tokens.weight"], ids)  # (T, H)
        x = self.layers(x, cache, start)
        return ops.rms_norm(x, self.w["model.norm.weight"], a.rms_norm_eps, unit_offset=True)

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """As BaseModel.logits; a fused decode step has computed them already."""
        done = self.fused.logits_for(hidden) if self.fused is not None else None
        return done if done is not None else super().logits(hidden)

    def layers(self, x: np.ndarray, cache: HybridCache, start: int) -> np.ndarray:
        ops, a = self.ops, self.args
        positions = np.arange(start, start + x.shape[0])
        for i, kind in enumerate(a.layer_types):
            p = f"model.layers.{i}."
            h = ops.rms_norm(x, self.w[p + "input_layernorm.weight"], a.rms_norm_eps, True)
            if kind == LINEAR:
                x = x + self.gated_deltanet(h, p + "linear_attn.", cache, i, start)
            else:
                x = x + self.attention(h, p + "self_attn.", i, positions, cache, start)
            h = ops.rms_norm(x, self.w[p + "post_attention_layernorm.weight"], a.rms_norm_eps, True)
            x = x + self.mlp(h, p + "mlp.")
        return x

    # -- blocks -------------------------------------------------------------------------------

    def attention(self, h, p: str, layer: int, positions, cache, start: int):
        """Gated full attention (transformers' Qwen3_5Attention)."""
        ops, a, w = self.ops, self.args, self.w
        t, hd, nh, nkv = h.shape[0], a.head_dim, a.num_attention_heads, a.num_key_value_heads
        qg = ops.linear(h, w[p + "q_proj.weight"], w.get(p + "q_proj.bias"))
        gated = qg.shape[1] == 2 * nh * hd
        qg = qg.reshape(t, nh, -1)  # (T, nh, 2*hd): query and gate split per head
        q, gate = qg[..., :hd], qg[..., hd:]
        k = ops.linear(h, w[p + "k_proj.weight"], w.get(p + "k_proj.bias")).reshape(t, nkv, hd)
        v = ops.linear(h, w[p + "v_proj.weight"], w.get(p + "v_proj.bias")).reshape(t, nkv, hd)
        q = ops.rms_norm(q, w[p + "q_norm.weight"], a.rms_norm_eps, unit_offset=True)
        k = ops.rms_norm(k, w[p + "k_norm.weight"], a.rms_norm_eps, unit_offset=True)
        q = ops.rope(q, positions, self.inv_freq)
        k = ops.rope(k, positions, self.inv_freq)
        keys, values = cache.update(layer, start, k, v)  # (nkv, S, hd)
        out = ops.attention(q, keys, values, start).reshape(t, nh * hd)  # (T, nh*hd)
        if gated:
            out = out * ops.sigmoid(gate.reshape(t, nh * hd))
        return ops.linear(out, w[p + "o_proj.weight"])

    def gated_deltanet(self, h, p: str, cache: HybridCache, layer: int, start: int) -> np.ndarray:
        """Gated DeltaNet (transformers' Qwen3_5GatedDeltaNet); updates the layer's conv and
        recurrent state in `cache`, and records the state after each token when the cache
        asks (a speculative verify, so that rejected tokens can be dropped)."""
        ops, a, w = self.ops, self.args, self.w
        state = cache.linear[layer]
        record = cache.recording
        t = h.shape[0]
        nk, dk = a.linear_num_key_heads, a.linear_key_head_dim
        nv, dv = a.linear_num_value_heads, a.linear_value_head_dim
        qkv = ops.linear(h, w[p + "in_proj_qkv.weight"])  # (T, 2*nk*dk + nv*dv)
        z = ops.linear(h, w[p + "in_proj_z.weight"]).reshape(t, nv, dv)
        b = ops.linear(h, w[p + "in_proj_b.weight"])  # (T, nv)
        alpha = ops.linear(h, w[p + "in_proj_a.weight"])  # (T, nv)
        conv, conv_states = ops.causal_conv1d(
            qkv, w[p + "conv1d.weight"], state.conv, all_states=record
        )
        conv = ops.silu(conv)
        q = ops.l2norm(conv[:, : nk * dk].reshape(t, nk, dk))
        k = ops.l2norm(conv[:, nk * dk : 2 * nk * dk].reshape(t, nk, dk))
        v = conv[:, 2 * nk * dk :].reshape(t, nv, dv)
        beta = ops.sigmoid(b)
        g = w[p + "A"] * ops.softplus(alpha + w[p + "dt_bias"])  # (T, nv) log-decay
        if record:  # token by token, keeping every intermediate state
            out, states = ops.gated_delta_rule(q, k, v, g, beta, state.recurrent, all_states=True)
            cache.record(layer, start, conv_states, states)
            state.conv, state.recurrent = conv_states[-1].copy(), states[-1].copy()
        else:
            rule = ops.gated_delta_rule if t == 1 else ops.gated_delta_rule_chunked
            out, state.recurrent = rule(q, k, v, g, beta, state.recurrent)  # (T, nv, dv)
            state.conv = conv_states
        out = ops.rms_norm_gated(out, z, w[p + "norm.weight"], a.rms_norm_eps)
        return ops.linear(out.reshape(t, nv * dv), w[p + "out_proj.weight"])

    # -- multi-token prediction (vLLM qwen3_5_mtp.py / qwen3_next_mtp.py) ----------------------

    @property
    def has_mtp(self) -> bool:
        return "mtp.fc.weight" in self.w

    def mtp_forward(self, hidden: np.ndarray, ids: np.ndarray, cache, start: int) -> np.ndarray:
        """The MTP block on pairs (main-model final hidden state at position p, the token at
        p + 1), for positions start..start+T-1: hidden (T, H), ids (T,). Returns the MTP's
        hidden states after `mtp.norm` (T, H): `logits` of row i predicts the token at
        start + i + 2, and row i is the hidden state the next draft step pairs with its token.
        Writes the MTP attention layer's K/V at those positions into `cache` (a 1-layer KV)."""
        ops, a, w = self.ops, self.args, self.w
        eps = a.rms_norm_eps
        e = ops.embedding(w.get("mtp.embed_tokens.weight", w["model.embed_tokens.weight"]), ids)
        e = ops.rms_norm(e, w["mtp.pre_fc_norm_embedding.weight"], eps, unit_offset=True)
        h = ops.rms_norm(hidden, w["mtp.pre_fc_norm_hidden.weight"], eps, unit_offset=True)
        x = ops.linear(np.concatenate([e, h], axis=-1), w["mtp.fc.weight"])  # embedding first
        p = "mtp.layers.0."
        positions = np.arange(start, start + x.shape[0])
        h = ops.rms_norm(x, w[p + "input_layernorm.weight"], eps, unit_offset=True)
        x = x + self.attention(h, p + "self_attn.", 0, positions, cache, start)
        h = ops.rms_norm(x, w[p + "post_attention_layernorm.weight"], eps, unit_offset=True)
        x = x + self.mlp(h, p + "mlp.")
        return ops.rms_norm(x, w["mtp.norm.weight"], eps, unit_offset=True)

    def new_mtp_cache(self, max_len: int) -> KVCache:
        a = self.args
        shape = (1, a.num_key_value_heads, a.head_dim, max_len)
        cache = self.ops.device_kv_cache(*shape)
        return cache if cache is not None else KVCache(*shape)

    def new_cache(self, max_len: int) -> HybridCache:
        a = self.args
        shape = (
            a.layer_types,
            a.num_key_value_heads,
            a.head_dim,
            (a.linear_conv_kernel_dim - 1, a.conv_channels),  # conv state
            (a.linear_num_value_heads, a.linear_key_head_dim, a.linear_value_head_dim),
            max_len,
        )
        # native ops keep the cache on the device; the host backends use cache.HybridCache,
        # the fast CPU path's fused step in its own KV type
        cache = self.ops.device_hybrid_cache(*shape)
        if cache is None and self.fused is not None:
            cache = self.fused.new_cache(*shape)
        return cache if cache is not None else HybridCache(*shape)
