"""KV cache for attention layers.

Each layer keeps keys and values as (nkv, capacity, hd) float32 so that attention reads one
contiguous slab per head. Capacity grows in steps (doubling) up to the context length: a short
chat does not pay for 8K positions of memory up front.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

GROW_STEP = 256


@dataclass
class LayerKV:
    k: np.ndarray  # (nkv, capacity, hd)
    v: np.ndarray


class KVCache:
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, max_len: int):
        self.max_len = max_len
        self.length = 0  # positions filled in every layer
        cap = min(GROW_STEP, max_len)
        self.layers = [
            LayerKV(
                np.zeros((n_kv_heads, cap, head_dim), np.float32),
                np.zeros((n_kv_heads, cap, head_dim), np.float32),
            )
            for _ in range(n_layers)
        ]

    @property
    def capacity(self) -> int:
        return self.layers[0].k.shape[1]

    def reserve(self, new_len: int) -> None:
        if new_len > self.max_len:
            raise ValueError(f"cache holds {self.max_len} positions, {new_len} requested")
        if new_len <= self.capacity:
            return
        cap = self.capacity
        while cap < new_len:
            cap *= 2
        cap = min(cap, self.max_len)
        for layer in self.layers:
            for name in ("k", "v"):
                old = getattr(layer, name)
                new = np.zeros((old.shape[0], cap, old.shape[2]), np.float32)
                new[:, : self.length] = old[:, : self.length]
                setattr(layer, name, new)

    def update(self, layer: int, start: int, k: np.ndarray, v: np.ndarray):
        """Write k, v (T, nkv, hd) at positions start..start+T-1 and return the views of the
        whole filled cache (nkv, start+T, hd) for attention."""
        end = start + k.shape[0]
        entry = self.layers[layer]
        entry.k[:, start:end] = k.transpose(1, 0, 2)
        entry.v[:, start:end] = v.transpose(1, 0, 2)
        return entry.k[:, :end], entry.v[:, :end]

    def truncate(self, length: int) -> None:
        """Forget positions from `length` on (to roll back, or to reuse a common prefix)."""
        self.length = min(self.length, length)
