"""The device cache of hybrid models (qwen3_5): the attention layers' keys and values in a
device `KVCache` (bf16, FP8 E4M3 or f32), each Gated DeltaNet layer's conv and recurrent state
as float32 device arrays.

It is `cache.HybridCache` with its storage moved to the device: checkpoints, the speculative
trail, snapshot / restore and truncate are the host class's own code. That code only copies
`LinearState`s (a `DeviceArray.copy` is a device-to-device copy), swaps them and zero-fills
them, so none of it reads a state back to the host.
"""

from __future__ import annotations

from collections.abc import Sequence

from atlas_cli.backend import cache
from atlas_cli.backend.cache import LinearState
from atlas_cli.backend.ops.native_attention import KVCache


class HybridCache(cache.HybridCache):
    """`cache.HybridCache` on the device of `ops` (a NativeOps), KV stored as `kv_dtype`."""

    def __init__(
        self,
        ops,
        layer_types: Sequence[str],
        n_kv_heads: int,
        head_dim: int,
        conv_shape: tuple[int, int],
        recurrent_shape: tuple[int, int, int],
        max_len: int,
        kv_dtype: str = "bf16",
    ):
        # The host constructor sets up the bookkeeping; the host arrays it makes are replaced
        # below before anything touches them (np.zeros maps pages lazily: nothing is written).
        super().__init__(
            layer_types, n_kv_heads, head_dim, conv_shape, recurrent_shape, max_len=max_len
        )
        self.linear = {
            i: LinearState(ops.zeros(conv_shape), ops.zeros(recurrent_shape)) for i in self.linear
        }
        attention = sorted(self.kv)
        self.kv = {}  # the attention layers live in `device_kv`, by their slot in it
        self.slot = {layer: n for n, layer in enumerate(attention)}
        self.device_kv = KVCache(ops, len(attention), n_kv_heads, head_dim, max_len, kv_dtype)

    @property
    def capacity(self) -> int:
        return self.device_kv.capacity

    def reserve(self, new_len: int) -> None:
        self.device_kv.length = self.length  # the positions a regrown buffer keeps
        self.device_kv.reserve(new_len)

    def update(self, layer: int, start: int, k, v):
        """As `KVCache.update`, for a full-attention layer: KVViews of the filled cache."""
        return self.device_kv.update(self.slot[layer], start, k, v)
