"""What a decoder is made of, declared once per architecture (after nano-vllm's
`packed_modules_mapping` and mlx-lm's per-layer cache kinds): each model file states its layers
as these records, and every consumer reads them — the op path (models/base.py), the fused CPU
step (ops/cpu/fast.py), the fused device step (ops/native/decoder.py) and the cache
(`CacheLayout`). No consumer builds a weight name, asks a config object what it has, or tells
a layer's kind from which arrays exist: a model that changes only a norm, a bias or a gate
changes its declaration, not the fused code.

Weight names are the Hugging Face safetensors names the loaders produce.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np


class LayerKind(enum.StrEnum):
    """A layer's token mixer; the values are Hugging Face's `layer_types` names."""

    ATTENTION = "full_attention"
    GATED_DELTANET = "linear_attention"


@dataclass(frozen=True)
class Attention:
    """Grouped-query attention with neox RoPE on the first `rotary_dims` of each head."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    inputs: tuple[str, str, str]  # q_proj, k_proj, v_proj: stacked, one input projection
    output: str  # o_proj
    biases: tuple[str, str, str]  # the q/k/v biases a file may carry (absent: none)
    q_norm: str | None = None  # per-head RMSNorm of q and k before RoPE (Qwen3, Qwen3.5)
    k_norm: str | None = None
    # q_proj may carry, per head, head_dim gate rows after the query rows: the output is
    # multiplied by sigmoid(gate) before o_proj (Qwen3.5's gated attention)
    output_gate: bool = False

    @property
    def kind(self) -> LayerKind:
        return LayerKind.ATTENTION


@dataclass(frozen=True)
class GatedDeltaNet:
    """Gated DeltaNet linear attention (transformers' Qwen3_5GatedDeltaNet): a causal conv over
    q, k, v, then the gated delta rule on a (n_v_heads, k_head_dim, v_head_dim) state."""

    n_k_heads: int
    k_head_dim: int
    n_v_heads: int
    v_head_dim: int
    conv_kernel: int
    inputs: tuple[str, str, str, str]  # in_proj_qkv, in_proj_z, in_proj_b, in_proj_a: stacked
    output: str  # out_proj
    conv: str  # the depthwise conv weight, (C, K) after the model's sanitize
    decay: str  # A = -exp(A_log), formed by the model's sanitize
    dt_bias: str
    norm: str  # the gated RMSNorm's weight (plain, never unit-offset)

    @property
    def kind(self) -> LayerKind:
        return LayerKind.GATED_DELTANET

    @property
    def conv_channels(self) -> int:
        return 2 * self.n_k_heads * self.k_head_dim + self.n_v_heads * self.v_head_dim


@dataclass(frozen=True)
class Layer:
    """One pre-norm decoder block: x += mixer(norm(x)); x += down(silu(gate(h)) * up(h)),
    h = post_norm(x)."""

    mixer: Attention | GatedDeltaNet
    input_norm: str
    post_norm: str
    mlp: tuple[str, str, str]  # gate_proj, up_proj, down_proj

    @property
    def kind(self) -> LayerKind:
        return self.mixer.kind


@dataclass(frozen=True)
class CacheLayout:
    """What a cache needs to know of the layers: their kinds, the attention layers' KV heads,
    and the Gated DeltaNet layers' conv and recurrent state shapes (None without such layers)."""

    kinds: tuple[LayerKind, ...]
    n_kv_heads: int
    head_dim: int
    conv_shape: tuple[int, int] | None = None  # (K - 1, C)
    recurrent_shape: tuple[int, int, int] | None = None  # (nv, dk, dv)

    @property
    def hybrid(self) -> bool:
        """Whether any layer keeps a recurrent state (else the cache is K/V only)."""
        return LayerKind.GATED_DELTANET in self.kinds


@dataclass(frozen=True)
class Declaration:
    """A decoder's layers and the weights around them."""

    layers: tuple[Layer, ...]
    embedding: str
    final_norm: str
    lm_head: str
    eps: float  # every RMSNorm's epsilon
    # RMSNorm weights stored as w, applied as (1 + w) (Qwen3.5, Gemma); q/k norms included,
    # the Gated DeltaNet's gated norm not
    unit_offset_norms: bool = False

    @property
    def kinds(self) -> tuple[LayerKind, ...]:
        return tuple(layer.kind for layer in self.layers)

    def attention(self) -> Attention:
        """The attention geometry (every attention layer of a model shares it)."""
        return next(lay.mixer for lay in self.layers if lay.kind is LayerKind.ATTENTION)

    def cache_layout(self) -> CacheLayout:
        att = self.attention()
        gdn = next((lay.mixer for lay in self.layers if lay.kind is not LayerKind.ATTENTION), None)
        if gdn is None:
            return CacheLayout(self.kinds, att.n_kv_heads, att.head_dim)
        return CacheLayout(
            self.kinds,
            att.n_kv_heads,
            att.head_dim,
            (gdn.conv_kernel - 1, gdn.conv_channels),
            (gdn.n_v_heads, gdn.k_head_dim, gdn.v_head_dim),
        )

    def norm_multiplier(self, w) -> np.ndarray:
        """The float32 vector an RMSNorm multiplies by for the stored weight `w`: w, or 1 + w
        for unit-offset norms (the sum numpy_ref.rms_norm forms, in float32)."""
        w = np.asarray(w, np.float32)
        return w + np.float32(1.0) if self.unit_offset_norms else w
