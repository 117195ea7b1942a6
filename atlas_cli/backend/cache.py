"""KV cache for attention layers, and the hybrid cache of linear-attention models.

Each attention layer keeps keys and values as (nkv, capacity, hd) float32 (float16 on the fast
CPU path by default, `HOST_KV_TYPES`: half the memory and half what attention reads at depth)
so that attention reads one contiguous slab per head. Capacity grows in steps (doubling) up to
the context length: a short chat does not pay for 8K positions of memory up front.

Linear-attention layers (Gated DeltaNet) keep a fixed-size state instead: the last K-1 conv
inputs and the recurrent matrix. That state summarises the whole prefix and cannot be cut back
to an earlier position, so `HybridCache` keeps checkpoints (copies of the state at chosen
positions) and `truncate` falls back to the latest checkpoint at or before the asked length.
"""

from __future__ import annotations

import math
import mmap
import sys
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from atlas_cli.backend.layers import CacheLayout, LayerKind

GROW_STEP = 256
# What a host cache may hold K/V as (--kv-type on the fast CPU path), and that path's default:
# float16 halves the memory and what attention reads at depth, as llama.cpp's.
HOST_KV_TYPES = {"f16": np.float16, "f32": np.float32}
FAST_KV_DTYPE = np.dtype(HOST_KV_TYPES["f16"])


class Cache(Protocol):
    """What the engine, the speculator and the models ask of every cache (the shape of
    mlx-lm's `_BaseCache`): `length` positions are filled, `capacity` are allocated."""

    length: int
    recording: bool  # True between start_trail and stop_trail

    @property
    def capacity(self) -> int: ...

    def reserve(self, new_len: int) -> None:
        """Make room for `new_len` positions (growing in steps, at most the context length)."""

    def update(self, layer: int, start: int, k: Any, v: Any) -> tuple[Any, Any]:
        """Write k, v (T, nkv, hd) of attention layer `layer` at positions start..start+T-1;
        return the whole filled keys and values (nkv, start+T, hd) for attention."""

    def truncate(self, length: int) -> int:
        """Keep at most `length` positions; return how many were kept (a linear-attention
        state may only go back to a checkpoint)."""

    def checkpoint(self) -> None:
        """Remember the state at the current length as a point `truncate` can return to."""

    def start_trail(self) -> None:
        """Record the state after every token of the next forward (a speculative verify), so
        that `truncate` can stop at any of them."""

    def stop_trail(self) -> None: ...

    # -- what the prefix pool (prefix_pool.py) asks to keep several sequences --------------

    @property
    def nbytes(self) -> int:
        """The memory this cache holds: allocated capacity, checkpoints included."""

    def reusable(self, length: int) -> int:
        """How many positions `truncate(length)` would keep, without cutting anything."""

    def clone(self, length: int) -> Cache:
        """A new cache holding this one's first `reusable(length)` positions; this one is
        left as it is."""

    def export(self) -> dict[str, np.ndarray]:
        """The filled state as named host arrays (a slot saved to disk)."""

    def load(self, arrays: dict[str, np.ndarray]) -> None:
        """Fill this empty cache from `export`'s arrays; ValueError when they do not fit."""


class KVCacheBase:
    """The part of `Cache` every pure key-value cache shares: K/V at a position never depend
    on later positions, so it can be truncated anywhere, with nothing to keep or record."""

    recording = False

    def checkpoint(self) -> None:
        """Nothing to do: a KV cache can be truncated anywhere."""

    def start_trail(self) -> None:
        """Nothing to record: truncating keeps exactly the positions asked for."""

    def stop_trail(self) -> None:
        """See `start_trail`."""

    def reusable(self, length: int) -> int:
        return min(length, self.length)


def grown_capacity(cap: int, new_len: int, max_len: int) -> int:
    """The capacity a cache of `cap` positions needs to hold `new_len`: `cap` itself when it
    fits, else `cap` doubled until it does, at most `max_len`. Shared with the device cache
    (ops/native/device.py) so both grow in the same steps."""
    if new_len > max_len:
        raise ValueError(f"cache holds {max_len} positions, {new_len} requested")
    while cap < new_len:
        cap *= 2
    return min(cap, max_len)


@dataclass
class LayerKV:
    k: np.ndarray  # (nkv, capacity, hd)
    v: np.ndarray


class KVCache(KVCacheBase):
    """Host keys and values (float32 or float16), one LayerKV per layer."""

    def __init__(
        self, n_layers: int, n_kv_heads: int, head_dim: int, max_len: int, dtype=np.float32
    ):
        self.max_len = max_len
        self.length = 0  # positions filled in every layer
        self.dtype = np.dtype(dtype)
        cap = min(GROW_STEP, max_len)
        self.layers = [
            LayerKV(
                np.zeros((n_kv_heads, cap, head_dim), self.dtype),
                np.zeros((n_kv_heads, cap, head_dim), self.dtype),
            )
            for _ in range(n_layers)
        ]

    @property
    def capacity(self) -> int:
        return self.layers[0].k.shape[1]

    def reserve(self, new_len: int) -> None:
        cap = grown_capacity(self.capacity, new_len, self.max_len)
        if cap == self.capacity:
            return
        for layer in self.layers:
            _grow(layer, cap, self.length)

    def update(self, layer: int, start: int, k: np.ndarray, v: np.ndarray):
        """Write k, v (T, nkv, hd) at positions start..start+T-1 and return the views of the
        whole filled cache (nkv, start+T, hd) for attention."""
        return _write(self.layers[layer], start, k, v)

    def truncate(self, length: int) -> int:
        """Forget positions from `length` on (to roll back, or to reuse a common prefix).
        Returns the length kept (a KV cache can always keep exactly `length`)."""
        self.length = min(self.length, length)
        return self.length

    @property
    def nbytes(self) -> int:
        return sum(layer.k.nbytes + layer.v.nbytes for layer in self.layers)

    def clone(self, length: int) -> KVCache:
        n = self.reusable(length)
        nkv, _, hd = self.layers[0].k.shape
        new = type(self)(len(self.layers), nkv, hd, self.max_len, self.dtype)
        new.reserve(n)  # before reading new.layers: growing may rebuild them
        _copy_kv(dict(enumerate(self.layers)), dict(enumerate(new.layers)), n)
        new.length = n
        return new

    def export(self) -> dict[str, np.ndarray]:
        kv = _export_kv(dict(enumerate(self.layers)), self.length)
        return {"length": np.asarray(self.length), **kv}

    def load(self, arrays: dict[str, np.ndarray]) -> None:
        n = saved_length(arrays, self.max_len)
        self.reserve(n)
        _load_kv(dict(enumerate(self.layers)), arrays, n)
        self.length = n


# Where the OS maps fresh zeroed memory lazily (a page is resident once written), a stacked
# cache maps its whole context at once and never grows.
LAZY_PAGES = sys.platform.startswith("linux") or sys.platform == "darwin"


class StackedKVCache(KVCache):
    """KVCache whose layers are views of two (L, nkv, capacity, hd) arrays, so the fused decode
    step reaches every layer's cache through one argument.

    With `lazy` pages the arrays span the whole context from the start: only the positions
    written become resident, and no growth copies the cache (at 2,048 positions of Qwen3 0.6B
    a growth held the old and the new 235 MB at once and stalled that step 0.6 s). Without,
    or when the mapping is refused, it grows like KVCache."""

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype=FAST_KV_DTYPE,
        lazy: bool | None = None,  # None: LAZY_PAGES
    ):
        self.max_len = max_len
        self.length = 0
        self.dtype = np.dtype(dtype)
        self.reserved = 0  # the most positions asked for: what the cache holds resident
        self.lazy = False
        if LAZY_PAGES if lazy is None else lazy:
            shape = (n_layers, n_kv_heads, max_len, head_dim)
            try:
                self._alloc(lazy_zeros(shape, self.dtype), lazy_zeros(shape, self.dtype))
                self.lazy = True
            except (MemoryError, OSError):  # a system that commits memory up front: grow
                pass
        if not self.lazy:
            cap = min(GROW_STEP, max_len)
            self._alloc(np.zeros((n_layers, n_kv_heads, cap, head_dim), self.dtype))

    def _alloc(self, k: np.ndarray, v: np.ndarray | None = None) -> None:
        self.k = k
        self.v = np.zeros(k.shape, k.dtype) if v is None else v
        self.layers = [LayerKV(self.k[i], self.v[i]) for i in range(k.shape[0])]

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def reserve(self, new_len: int) -> None:
        cap = grown_capacity(self.capacity, new_len, self.max_len)
        self.reserved = max(self.reserved, new_len)
        if cap == self.capacity:
            return
        shape = (*self.k.shape[:2], cap, self.k.shape[3])
        k, v = np.zeros(shape, self.dtype), np.zeros(shape, self.dtype)
        k[:, :, : self.length] = self.k[:, :, : self.length]
        v[:, :, : self.length] = self.v[:, :, : self.length]
        self._alloc(k, v)

    @property
    def nbytes(self) -> int:
        """The positions ever reserved with lazy pages (what is resident), else the capacity."""
        positions = self.reserved if self.lazy else self.capacity
        return 2 * self.k[:, :, :1].nbytes * positions


def lazy_zeros(shape: tuple[int, ...], dtype) -> np.ndarray:
    """Zeros whose pages become resident only when written, 4 KiB at a time. numpy's own
    large arrays ask for transparent huge pages: one written position per (layer, head) row
    of 1 MB then made the whole context resident (178 MB for each cached conversation of
    the default model)."""
    count = math.prod(shape)
    mapped = mmap.mmap(-1, max(count * np.dtype(dtype).itemsize, 1), flags=mmap.MAP_PRIVATE)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        mapped.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(mapped, dtype, count=count).reshape(shape)


def saved_length(arrays: dict[str, np.ndarray], max_len: int) -> int:
    """The `length` entry of exported arrays, checked against the cache's context."""
    length = np.asarray(arrays.get("length", -1))
    if length.shape != () or length.dtype.kind not in "iu":
        raise ValueError(f"saved length is {length.dtype} {length.shape}, not one integer")
    n = int(length)
    if not 0 <= n <= max_len:
        raise ValueError(f"saved length {n} does not fit a cache of {max_len} positions")
    return n


def _copy_kv(src: dict[int, LayerKV], dst: dict[int, LayerKV], n: int) -> None:
    for i, layer in src.items():
        dst[i].k[:, :n] = layer.k[:, :n]
        dst[i].v[:, :n] = layer.v[:, :n]


def _export_kv(layers: dict[int, LayerKV], n: int) -> dict[str, np.ndarray]:
    out = {}
    for i, layer in layers.items():  # float32 whatever the cache holds: a slot file is portable
        out[f"k{i}"] = np.asarray(layer.k[:, :n], np.float32)
        out[f"v{i}"] = np.asarray(layer.v[:, :n], np.float32)
    return out


def _load_kv(layers: dict[int, LayerKV], arrays: dict[str, np.ndarray], n: int) -> None:
    """Write saved (nkv, n, hd) float32 keys and values into `layers` (reserved for n
    positions; a float16 cache rounds them, exactly for what a float16 cache saved)."""
    for i, layer in layers.items():
        for name, slab in ((f"k{i}", layer.k), (f"v{i}", layer.v)):
            check_saved(arrays, name, (slab.shape[0], n, slab.shape[2]))
            slab[:, :n] = arrays[name]


def check_saved(arrays: dict[str, np.ndarray], name: str, shape: tuple) -> None:
    got = arrays.get(name)
    if got is None or got.shape != tuple(shape) or got.dtype != np.float32:
        desc = "missing" if got is None else f"{got.dtype} {got.shape}"
        raise ValueError(f"saved array {name!r} is {desc}; this model needs float32 {shape}")


def _write(entry: LayerKV, start: int, k: np.ndarray, v: np.ndarray):
    """k, v (T, nkv, hd) into the (nkv, capacity, hd) slabs at start..; the filled views."""
    end = start + k.shape[0]
    entry.k[:, start:end] = k.transpose(1, 0, 2)
    entry.v[:, start:end] = v.transpose(1, 0, 2)
    return entry.k[:, :end], entry.v[:, :end]


def _grow(layer: LayerKV, cap: int, length: int) -> None:
    layer.k, layer.v = (_regrown(old, cap, length) for old in (layer.k, layer.v))


def _regrown(old: np.ndarray, cap: int, length: int) -> np.ndarray:
    """(nkv, old capacity, hd) -> (nkv, cap, hd) keeping the first `length` positions."""
    new = np.zeros((old.shape[0], cap, old.shape[2]), old.dtype)
    new[:, :length] = old[:, :length]
    return new


@dataclass
class LinearState:
    """One Gated DeltaNet layer's state: conv inputs (K-1, C) and recurrent matrix (nv, dk, dv)."""

    conv: np.ndarray
    recurrent: np.ndarray

    def copy(self) -> LinearState:
        return LinearState(self.conv.copy(), self.recurrent.copy())


@dataclass(frozen=True)
class CacheSnapshot:
    """The cache at `length` positions: enough to `restore` it after later tokens were added."""

    length: int
    states: dict[int, LinearState] = field(default_factory=dict)


class HybridCache:
    """KV for full-attention layers plus conv and recurrent state for linear-attention layers,
    as `layout` (the model's declaration) says. Attention layers use the `KVCache` interface
    (`update`); linear layers read and write `linear[i]` in place, and while `recording` hand
    the state after each token to `record`.
    """

    def __init__(
        self, layout: CacheLayout, max_len: int, max_checkpoints: int = 8, kv_dtype=np.float32
    ):
        self.layout = layout  # what `clone` needs to build an empty cache of the same shape
        self.kv_dtype = np.dtype(kv_dtype)  # float32, or float16 (the fast CPU path)
        self.max_len = max_len
        self.length = 0
        self.max_checkpoints = max_checkpoints
        self.checkpoints: list[CacheSnapshot] = []  # ascending length
        cap = min(GROW_STEP, max_len)
        self.kv: dict[int, LayerKV] = {}
        self.linear: dict[int, LinearState] = {}
        kv_shape = (layout.n_kv_heads, cap, layout.head_dim)
        for i, kind in enumerate(layout.kinds):
            if kind == LayerKind.GATED_DELTANET:
                self.linear[i] = LinearState(
                    np.zeros(layout.conv_shape, np.float32),
                    np.zeros(layout.recurrent_shape, np.float32),
                )
            else:
                self.kv[i] = LayerKV(
                    np.zeros(kv_shape, self.kv_dtype), np.zeros(kv_shape, self.kv_dtype)
                )
        self._cap = cap
        # the linear state after each token of the last recorded forward, by length, so that
        # rejected draft tokens can be dropped exactly (see `start_trail`)
        self.recording = False
        self.trail: dict[int, dict[int, LinearState]] = {}

    @property
    def capacity(self) -> int:
        return self._cap

    def reserve(self, new_len: int) -> None:
        cap = grown_capacity(self._cap, new_len, self.max_len)
        if cap == self._cap:
            return
        self._cap = cap
        for layer in self.kv.values():
            _grow(layer, self._cap, self.length)

    def update(self, layer: int, start: int, k: np.ndarray, v: np.ndarray):
        """As `KVCache.update`, for a full-attention layer."""
        return _write(self.kv[layer], start, k, v)

    def start_trail(self) -> None:
        """Record the state after every token of the next forward (a speculative verify):
        `truncate` can then stop at any of those positions without recomputing."""
        self.recording = True
        self.trail = {}

    def stop_trail(self) -> None:
        self.recording = False

    def record(self, layer: int, start: int, conv: np.ndarray, recurrent: np.ndarray) -> None:
        """Called by the model while recording: conv (T, K-1, C) and recurrent (T, nv, dk, dv)
        hold the state of linear layer `layer` after each of the T tokens from `start` on."""
        for i in range(conv.shape[0]):
            self.trail.setdefault(start + i + 1, {})[layer] = LinearState(conv[i], recurrent[i])

    def snapshot(self) -> CacheSnapshot:
        """A copy of the linear states at the current length (KV needs no copy: positions
        before `length` are never overwritten while they are kept)."""
        return CacheSnapshot(self.length, {i: s.copy() for i, s in self.linear.items()})

    def restore(self, snap: CacheSnapshot) -> None:
        """Return to `snap`, taken at a length that is still a prefix of this cache."""
        for i, state in snap.states.items():
            self.linear[i] = state.copy()
        self.length = snap.length
        self.checkpoints = [c for c in self.checkpoints if c.length <= snap.length]
        self.trail = {n: s for n, s in self.trail.items() if n <= snap.length}

    def checkpoint(self) -> None:
        """Remember the state at the current length, so that a later prompt sharing this
        prefix can restart from here (the oldest checkpoint goes when there are too many)."""
        self.checkpoints = [c for c in self.checkpoints if c.length != self.length]
        self.checkpoints.append(self.snapshot())
        self.checkpoints.sort(key=lambda c: c.length)
        del self.checkpoints[: -self.max_checkpoints]

    def _best(self, length: int) -> CacheSnapshot | None:
        """The latest checkpoint or complete trail entry at or before `length`."""
        recorded = [
            CacheSnapshot(n, states)
            for n, states in self.trail.items()
            if len(states) == len(self.linear)
        ]
        return max(
            (c for c in [*self.checkpoints, *recorded] if c.length <= length),
            default=None,
            key=lambda c: c.length,
        )

    def reusable(self, length: int) -> int:
        if length >= self.length:
            return self.length
        best = self._best(length)
        return 0 if best is None else best.length

    def truncate(self, length: int) -> int:
        """Keep at most `length` positions; returns how many were kept: `length` itself when
        nothing past it was added or it lies in the recorded trail, else the latest checkpoint
        at or before it (or 0)."""
        if length >= self.length:
            return self.length
        best = self._best(length)
        if best is None:
            for state in self.linear.values():
                state.conv[:] = 0
                state.recurrent[:] = 0
            self.length = 0
            self.checkpoints = []
            self.trail = {}
        else:
            self.restore(best)
        return self.length

    # -- for the prefix pool -----------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        states = [*self.linear.values(), *(s for c in self.checkpoints for s in c.states.values())]
        return self._kv_nbytes() + sum(s.conv.nbytes + s.recurrent.nbytes for s in states)

    def clone(self, length: int) -> HybridCache:
        """A new cache at `reusable(length)` positions; the checkpoints up to there are shared
        (a snapshot is never written to: `restore` copies it)."""
        n = self.reusable(length)
        new = self._empty()
        self._kv_copy(new, n)
        at = self.snapshot() if n == self.length else self._best(n)
        if at is not None:
            new.linear = {i: state.copy() for i, state in at.states.items()}
        new.checkpoints = [c for c in self.checkpoints if c.length <= n]
        new.length = n
        return new

    def export(self) -> dict[str, np.ndarray]:
        out = {"length": np.asarray(self.length), **self._kv_export()}
        out |= _export_states(self.linear, "")
        out["checkpoints"] = np.asarray([c.length for c in self.checkpoints], np.int64)
        for j, c in enumerate(self.checkpoints):
            out |= _export_states(c.states, f"c{j}.")
        return out

    def load(self, arrays: dict[str, np.ndarray]) -> None:
        n = saved_length(arrays, self.max_len)
        self._kv_load(arrays, n)
        self.linear = _load_states(self.linear, arrays, "", self._linear_state)
        lengths = [int(x) for x in np.asarray(arrays.get("checkpoints", []), np.int64)]
        if any(not 0 < m <= n for m in lengths) or len(lengths) > self.max_checkpoints:
            raise ValueError(f"saved checkpoints {lengths} do not fit {n} positions")
        self.checkpoints = [
            CacheSnapshot(m, _load_states(self.linear, arrays, f"c{j}.", self._linear_state))
            for j, m in enumerate(lengths)
        ]
        self.length = n

    # -- where the storage lives: host arrays here; ops/native/cache.py puts it on a device --

    def _empty(self) -> HybridCache:
        """An empty cache of this one's shape and kind."""
        return HybridCache(self.layout, self.max_len, self.max_checkpoints, self.kv_dtype)

    def _kv_nbytes(self) -> int:
        return sum(layer.k.nbytes + layer.v.nbytes for layer in self.kv.values())

    def _kv_copy(self, new: HybridCache, n: int) -> None:
        """The first `n` positions of every attention layer into `new` (empty)."""
        new.reserve(n)
        _copy_kv(self.kv, new.kv, n)

    def _kv_export(self) -> dict[str, np.ndarray]:
        return _export_kv(self.kv, self.length)

    def _kv_load(self, arrays: dict[str, np.ndarray], n: int) -> None:
        self.reserve(n)
        _load_kv(self.kv, arrays, n)

    def _linear_state(self, conv: np.ndarray, recurrent: np.ndarray) -> LinearState:
        """A state of this cache's kind from saved host arrays."""
        return LinearState(np.array(conv), np.array(recurrent))


def _export_states(states: dict[int, LinearState], prefix: str) -> dict[str, np.ndarray]:
    out = {}
    for i, s in states.items():  # np.asarray brings a device state to the host
        out[f"{prefix}conv{i}"] = np.asarray(s.conv, np.float32)
        out[f"{prefix}rec{i}"] = np.asarray(s.recurrent, np.float32)
    return out


def _load_states(
    like: dict[int, LinearState], arrays: dict[str, np.ndarray], prefix: str, make
) -> dict[int, LinearState]:
    """Saved linear states shaped like `like` (the cache's own), each made by `make`."""
    out = {}
    for i, s in like.items():
        conv, rec = f"{prefix}conv{i}", f"{prefix}rec{i}"
        check_saved(arrays, conv, s.conv.shape)
        check_saved(arrays, rec, s.recurrent.shape)
        out[i] = make(arrays[conv], arrays[rec])
    return out


def host_cache(layout: CacheLayout, max_len: int) -> KVCache | HybridCache:
    """The host cache of the declared layers, float32: K/V only, or hybrid."""
    if layout.hybrid:
        return HybridCache(layout, max_len)
    return KVCache(len(layout.kinds), layout.n_kv_heads, layout.head_dim, max_len)
