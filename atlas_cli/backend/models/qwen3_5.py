"""Qwen3.5 / Qwen3.6 dense (HF model_type `qwen3_5`, `qwen3_5_text`), after transformers'
`Qwen3_5ForCausalLM`: a hybrid of Gated DeltaNet (linear attention) layers and gated full
attention layers, with (1 + w) RMSNorms, partial rotary embedding and a SwiGLU MLP.

The math and weight names are in docs/formats.md ("Qwen3.5"). Text-only input makes the
interleaved mrope plain 1-D RoPE, which is what this file computes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from atlas_cli.backend.cache import HybridCache, KVCache
from atlas_cli.backend.layers import Declaration, GatedDeltaNet, Layer, LayerKind
from atlas_cli.backend.models.base import (
    BaseModel,
    BaseModelArgs,
    Shapes,
    UnsupportedConfig,
    attention_layer,
    attention_shapes,
    block,
    check_rope,
    declaration,
    mlp_shapes,
    require,
    rope_inv_freq,
)

FULL, LINEAR = LayerKind.ATTENTION, LayerKind.GATED_DELTANET


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
        args["layer_types"] = tuple(LayerKind(t) for t in types)
        return args

    def check(self) -> None:
        if FULL not in self.layer_types:  # its geometry sizes the KV cache
            kinds = [t.value for t in self.layer_types]
            raise UnsupportedConfig("layer_types", kinds, "at least one full_attention layer")
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
    """Runs on any ops module (numpy reference or native): BaseModel's gated attention blocks
    and this file's Gated DeltaNet, as the declaration says."""

    @classmethod
    def declare(cls, a: ModelArgs) -> Declaration:
        layers = []
        for i, kind in enumerate(a.layer_types):
            p = f"model.layers.{i}."
            if kind == LINEAR:
                layers.append(block(p, cls.gated_deltanet_mixer(a, p + "linear_attn.")))
            else:
                layers.append(attention_layer(p, a, qk_norm=True, output_gate=True))
        return declaration(layers, a.rms_norm_eps, unit_offset_norms=True)

    @staticmethod
    def gated_deltanet_mixer(a: ModelArgs, p: str) -> GatedDeltaNet:
        return GatedDeltaNet(
            a.linear_num_key_heads,
            a.linear_key_head_dim,
            a.linear_num_value_heads,
            a.linear_value_head_dim,
            a.linear_conv_kernel_dim,
            inputs=tuple(f"{p}in_proj_{n}.weight" for n in ("qkv", "z", "b", "a")),
            output=p + "out_proj.weight",
            conv=p + "conv1d.weight",
            decay=p + "A",
            dt_bias=p + "dt_bias",
            norm=p + "norm.weight",
        )

    def rope_frequencies(self) -> np.ndarray:
        a = self.args
        return rope_inv_freq(a.head_dim, a.rope_theta, a.partial_rotary_factor)

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

    # -- the Gated DeltaNet mixer ---------------------------------------------------------------

    def gated_deltanet(self, m: GatedDeltaNet, h, layer: int, cache: HybridCache, start: int):
        """Gated DeltaNet (transformers' Qwen3_5GatedDeltaNet); updates the layer's conv and
        recurrent state in `cache`, and records the state after each token when the cache
        asks (a speculative verify, so that rejected tokens can be dropped)."""
        ops, w = self.ops, self.w
        state = cache.linear[layer]
        record = cache.recording
        t = h.shape[0]
        nk, dk, nv, dv = m.n_k_heads, m.k_head_dim, m.n_v_heads, m.v_head_dim
        qkv, z, b, alpha = (ops.linear(h, w[n]) for n in m.inputs)  # qkv (T, 2*nk*dk + nv*dv)
        z = z.reshape(t, nv, dv)  # b, alpha (T, nv)
        conv, conv_states = ops.causal_conv1d(qkv, w[m.conv], state.conv, all_states=record)
        conv = ops.silu(conv)
        q = ops.l2norm(conv[:, : nk * dk].reshape(t, nk, dk))
        k = ops.l2norm(conv[:, nk * dk : 2 * nk * dk].reshape(t, nk, dk))
        v = conv[:, 2 * nk * dk :].reshape(t, nv, dv)
        beta = ops.sigmoid(b)
        g = w[m.decay] * ops.softplus(alpha + w[m.dt_bias])  # (T, nv) log-decay
        if record:  # token by token, keeping every intermediate state
            out, states = ops.gated_delta_rule(q, k, v, g, beta, state.recurrent, all_states=True)
            cache.record(layer, start, conv_states, states)
            state.conv, state.recurrent = conv_states[-1].copy(), states[-1].copy()
        else:
            rule = ops.gated_delta_rule if t == 1 else ops.gated_delta_rule_chunked
            out, state.recurrent = rule(q, k, v, g, beta, state.recurrent)  # (T, nv, dv)
            state.conv = conv_states
        out = ops.rms_norm_gated(out, z, w[m.norm], self.declaration.eps)
        return ops.linear(out.reshape(t, nv * dv), w[m.output])

    # -- multi-token prediction (vLLM qwen3_5_mtp.py / qwen3_next_mtp.py) ----------------------

    @functools.cached_property
    def mtp_layer(self) -> Layer:
        """The MTP block's decoder layer: gated attention like the model's own, under `mtp.`."""
        return attention_layer("mtp.layers.0.", self.args, qk_norm=True, output_gate=True)

    @property
    def has_mtp(self) -> bool:
        return "mtp.fc.weight" in self.w

    def mtp_forward(self, hidden: np.ndarray, ids: np.ndarray, cache, start: int) -> np.ndarray:
        """The MTP block on pairs (main-model final hidden state at position p, the token at
        p + 1), for positions start..start+T-1: hidden (T, H), ids (T,). Returns the MTP's
        hidden states after `mtp.norm` (T, H): `logits` of row i predicts the token at
        start + i + 2, and row i is the hidden state the next draft step pairs with its token.
        Writes the MTP attention layer's K/V at those positions into `cache` (a 1-layer KV)."""
        ops, w = self.ops, self.w
        e = ops.embedding(w.get("mtp.embed_tokens.weight", w["model.embed_tokens.weight"]), ids)
        e = self.norm(e, "mtp.pre_fc_norm_embedding.weight")
        h = self.norm(hidden, "mtp.pre_fc_norm_hidden.weight")
        x = ops.linear(np.concatenate([e, h], axis=-1), w["mtp.fc.weight"])  # embedding first
        layer = self.mtp_layer
        positions = np.arange(start, start + x.shape[0])
        h = self.norm(x, layer.input_norm)
        x = x + self.attention(layer.mixer, h, 0, positions, cache, start)
        x = x + self.mlp(layer.mlp, self.norm(x, layer.post_norm))
        return self.norm(x, "mtp.norm.weight")

    def new_mtp_cache(self, max_len: int) -> KVCache:
        a = self.args
        shape = (1, a.num_key_value_heads, a.head_dim, max_len)
        cache = self.ops.device_kv_cache(*shape)
        return cache if cache is not None else KVCache(*shape)
