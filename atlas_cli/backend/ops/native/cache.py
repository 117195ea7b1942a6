"""The device cache of hybrid models (qwen3_5): the attention layers' keys and values in a
device `KVCache` (bf16, FP8 E4M3 or f32), each Gated DeltaNet layer's conv and recurrent state
as float32 device arrays.

It is `cache.HybridCache` with its storage moved to the device: checkpoints, the speculative
trail, snapshot / restore, truncate, clone, export and load are the host class's own code, on
the storage hooks this class overrides (`_empty`, `_kv_*`, `_linear_state`). That code only
copies `LinearState`s (a `DeviceArray.copy` is a device-to-device copy), swaps them and
zero-fills them, so only `export` (a slot saved to disk) reads a state back to the host.

Saved slots keep the K/V as the device stores it (raw bf16 / FP8 / f32 bytes, named by model
layer): a slot restores into a cache of the same KV type.
"""

from __future__ import annotations

import numpy as np

from atlas_cli.backend import cache
from atlas_cli.backend.cache import LinearState
from atlas_cli.backend.layers import CacheLayout
from atlas_cli.backend.ops.native.attention import KVCache


class HybridCache(cache.HybridCache):
    """`cache.HybridCache` on the device of `ops` (a NativeOps), KV stored as `kv_dtype`."""

    def __init__(self, ops, layout: CacheLayout, max_len: int, kv_dtype: str = "bf16"):
        # The host constructor sets up the bookkeeping; the host arrays it makes are replaced
        # below before anything touches them (np.zeros maps pages lazily: nothing is written).
        super().__init__(layout, max_len=max_len)
        conv, recurrent = layout.conv_shape, layout.recurrent_shape
        self.linear = {i: LinearState(ops.zeros(conv), ops.zeros(recurrent)) for i in self.linear}
        attention = sorted(self.kv)
        self.kv = {}  # the attention layers live in `device_kv`, by their slot in it
        self.slot = {layer: n for n, layer in enumerate(attention)}
        nkv, hd = layout.n_kv_heads, layout.head_dim
        self.device_kv = KVCache(ops, len(attention), nkv, hd, max_len, kv_dtype)
        self.ops = ops

    @property
    def capacity(self) -> int:
        return self.device_kv.capacity

    def reserve(self, new_len: int) -> None:
        self.device_kv.length = self.length  # the positions a regrown buffer keeps
        self.device_kv.reserve(new_len)

    def update(self, layer: int, start: int, k, v):
        """As `KVCache.update`, for a full-attention layer: KVViews of the filled cache."""
        return self.device_kv.update(self.slot[layer], start, k, v)

    # -- the storage hooks of cache.HybridCache's clone / export / load ----------------------

    def _synced_kv(self) -> KVCache:
        """`device_kv` with its length set to the cache's (the models advance `length` only)."""
        self.device_kv.length = self.length
        return self.device_kv

    def _empty(self) -> HybridCache:
        return HybridCache(self.ops, self.layout, self.max_len, self.device_kv.dtype)

    def _kv_nbytes(self) -> int:
        return self.device_kv.nbytes

    def _kv_copy(self, new: cache.HybridCache, n: int) -> None:
        new.device_kv = self._synced_kv().clone(n)  # device-to-device, per head

    def _kv_export(self) -> dict[str, np.ndarray]:
        raw = self._synced_kv().export()
        return {
            f"{kv}{layer}": raw[f"{kv}{slot}"] for layer, slot in self.slot.items() for kv in "kv"
        }

    def _kv_load(self, arrays: dict[str, np.ndarray], n: int) -> None:
        by_slot = {"length": np.asarray(n)}
        for layer, slot in self.slot.items():
            for kv in "kv":
                if f"{kv}{layer}" in arrays:
                    by_slot[f"{kv}{slot}"] = arrays[f"{kv}{layer}"]
        self.device_kv.load(by_slot)  # checks each array's shape and dtype

    def _linear_state(self, conv: np.ndarray, recurrent: np.ndarray) -> LinearState:
        return LinearState(self.ops.asarray(conv), self.ops.asarray(recurrent))
