"""The ops contract: every op a model file or the engine calls, with one name and signature.

Three implementations: `numpy_ref` (the float32 oracle, a module), `cpu.fast` (a module: the
ops it does not override are numpy_ref's) and `native.device.NativeOps` (our kernels on CUDA, HIP or
the CPU emulator). A model file runs unchanged on any of them, and tests/test_ops_contract.py
checks that each implements every op below with exactly these parameter names, kinds and
defaults; tests/test_native_emu.py zips their results.

Shapes: T tokens in this call, S cached positions, H hidden size, nh/nkv query/key-value heads
of dimension hd; for Gated DeltaNet, C conv channels, K conv width, nk/nv key/value heads with
dims dk/dv. Activations are float32 arrays (on the backend's device); weights are whatever
`prepare_weight` made of a loader's tensor.
"""

from __future__ import annotations

from typing import Any, Protocol

from atlas_cli.backend.cache import Cache
from atlas_cli.backend.layers import CacheLayout

Array = Any  # a numpy array, or a native.array.DeviceArray (what of the array protocol models use)
Weight = Any  # what prepare_weight returns


class FusedStep(Protocol):
    """A model's decode step fused by a backend from its declaration (`Ops.fuse_decoder`)."""

    # the next token may be handed over on the device (`token_from_device`): the device sampler
    # writes it where the step reads it, so nothing is copied in
    TOKEN_ON_DEVICE: bool

    def decode(self, token: int | None, cache: Cache, pos: int) -> Array:
        """One token at position `pos` through every layer, writing its K/V and state into
        `cache`; the final normed hidden state (1, H)."""

    def logits_for(self, hidden: Array) -> Array | None:
        """The logits the step computed with `hidden`, or None: the op path's lm_head."""

    def new_cache(self, layout: CacheLayout, max_len: int) -> Cache | None:
        """The cache this step reads (its own layout or K/V type), or None: the backend's."""

    def use_kv_type(self, name: str) -> None:
        """Make the caches the step reads hold K/V as `name` (--kv-type)."""


class Ops(Protocol):
    NAME: str  # the --device name: "cpu-ref", "cpu", "cuda", "hip", "emu"

    # -- what the backend does, declared (read by `backend.load` and the engine) -----------
    KEEP_QUANTIZED: bool  # GGUF blocks reach prepare_weight as they are (no float32 copy)
    PREFILL_CHUNK: int | None  # prompt tokens per forward; None: the engine's default
    DEVICE_SAMPLING: bool  # `device_sampler` picks tokens on the device
    KV_TYPES: tuple[str, ...]  # the --kv-type values its caches take

    # -- weights and the decoder hooks ----------------------------------------------------
    def prepare_weight(self, w: Any) -> Weight:
        """A loader's 2-D weight (float array or `formats.QuantizedWeight`) in the form `linear`
        and `embedding` take on this backend."""

    def fuse_decoder(self, model: Any) -> FusedStep | None:
        """The fused decode step of `model`'s declaration, or None: the model runs op by op."""

    def device_kv_cache(
        self, n_layers: int, n_kv_heads: int, head_dim: int, max_len: int
    ) -> Cache | None:
        """A KV cache kept where this backend computes, or None: the host `cache.KVCache`."""

    def device_cache(self, layout: CacheLayout, max_len: int) -> Cache | None:
        """The cache of a model's declared layers (`layout`: K/V only, or hybrid) kept where
        this backend computes, or None: the host's (`cache.host_cache`)."""

    # -- dense ops ------------------------------------------------------------------------
    def embedding(self, table: Weight, ids: Array) -> Array:
        """table (V, H), ids (T,) -> (T, H) float32."""

    def rms_norm(self, x: Array, weight: Array, eps: float, unit_offset: bool = False) -> Array:
        """x (..., n) / rms(x) * w (or * (1 + w), the Qwen3.5 form) over the last axis."""

    def linear(self, x: Array, w: Weight, bias: Array | None = None) -> Array:
        """x (T, in) @ w (out, in)^T (+ bias (out,)) -> (T, out)."""

    def silu_mul(self, gate: Array, up: Array) -> Array:
        """silu(gate) * up, elementwise (T, I)."""

    def rope(self, x: Array, positions: Array, inv_freq: Array) -> Array:
        """Neox (rotate_half) RoPE on the first 2 * len(inv_freq) dims of x (T, n, hd), at
        positions (T,); returns a new array."""

    def attention(self, q: Array, k: Any, v: Any, start: int, nsplit: int | None = None) -> Array:
        """Causal GQA attention: q (T, nh, hd) at positions start..start+T-1 against k, v
        (nkv, S, hd) with S = start + T (as `Cache.update` returns them) -> (T, nh, hd).
        `nsplit`: split the keys into that many parts (a kernel's choice; the result does not
        depend on it; None lets the backend choose)."""

    def argmax(self, logits: Array) -> int:
        """The index of the largest logit (V,), the lowest among ties."""

    # -- Qwen3.5: gated attention and Gated DeltaNet --------------------------------------
    def sigmoid(self, x: Array) -> Array:
        """1 / (1 + exp(-x)), elementwise."""

    def silu(self, x: Array) -> Array:
        """x * sigmoid(x), elementwise."""

    def softplus(self, x: Array) -> Array:
        """log(1 + exp(x)), elementwise, without overflow."""

    def l2norm(self, x: Array, eps: float = 1e-6) -> Array:
        """x (..., d) / sqrt(sum(x^2) + eps) over the last axis."""

    def rms_norm_gated(self, x: Array, gate: Array, weight: Array, eps: float) -> Array:
        """rms_norm(x) * w * silu(gate) over the last axis: x, gate (..., d), weight (d,)."""

    def causal_conv1d(
        self, x: Array, weight: Array, state: Array, all_states: bool = False, act: bool = False
    ) -> tuple[Array, Array]:
        """Depthwise causal conv over time, no bias: x (T, C), weight (C, K) (tap K-1 is the
        current token), state (K-1, C) the inputs before x. Returns (out (T, C), new_state
        (K-1, C)); with `all_states` the state after every token (T, K-1, C) in its place;
        with `act`, out is SiLU(conv) (the states are inputs, never activated)."""

    def gated_delta_rule(
        self,
        q: Array,
        k: Array,
        v: Array,
        g: Array,
        beta: Array,
        state: Array,
        scale: float | None = None,
        all_states: bool = False,
    ) -> tuple[Array, Array]:
        """The gated delta rule token by token: q, k (T, nk, dk) L2-normalised, v (T, nv, dv),
        g (T, nv) log-decay, beta (T, nv), state (nv, dk, dv); q scaled by `scale` (default
        dk^-0.5). Returns (out (T, nv, dv), new_state (nv, dk, dv)), or with `all_states` the
        state after every token (T, nv, dk, dv) in its place. The input state is not changed."""

    def gated_delta_rule_chunked(
        self,
        q: Array,
        k: Array,
        v: Array,
        g: Array,
        beta: Array,
        state: Array,
        scale: float | None = None,
        chunk: int = 64,
    ) -> tuple[Array, Array]:
        """`gated_delta_rule`'s result (without all_states), computed `chunk` tokens at a time
        where the backend has a chunked form (prefill)."""


OP_NAMES = tuple(
    name for name, value in vars(Ops).items() if callable(value) and not name.startswith("_")
)
