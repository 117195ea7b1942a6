"""A runtime that computes nothing and counts what the launchers ask of a device.

`NativeOps(CountingRuntime())` runs a whole model forward without a GPU and without memory:
`alloc` hands out fake addresses (no bytes behind them), `d2h` fills the host array with zeros,
`launch` only records the kernel's name. Per phase (`with rt.phase("decode"): ...`) it counts
kernel launches by name, host-to-device / device-to-host / device-to-device copies and their
bytes, `synchronize` calls, graph launches, and the bytes of the buffers marked as weights
(`mark_weight`) that the launches read. benchmarks/launches.py and tests/test_launch_budget.py
hold the decode step to its launch budget with it.

`CountingRuntime(inner)` counts the same things while `inner` (the emulator, a GPU runtime)
does the work: what a real model on a real device asks per token.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from atlas_cli.backend.ops.native import runtime as rt

BASE_ADDRESS = 1 << 40  # fake device addresses start here (never 0: a null pointer means "none")
ALIGN = 256  # as cudaMalloc's alignment: distinct buffers never share an address


@dataclass(frozen=True)
class FakeBuffer:
    ptr: int
    nbytes: int


@dataclass
class Counts:
    """What one phase asked of the device."""

    launches: Counter = field(default_factory=Counter)  # kernel name -> launches
    h2d: int = 0
    h2d_bytes: int = 0
    d2h: int = 0
    d2h_bytes: int = 0
    d2d: int = 0
    d2d_bytes: int = 0
    syncs: int = 0
    graph_launches: int = 0
    graph_kernels: int = 0  # kernels run by those graph launches (not launches of their own)
    weight_bytes: int = 0  # bytes of marked weight buffers the kernels read, in graphs too

    @property
    def kernel_launches(self) -> int:
        return sum(self.launches.values())

    def summary(self) -> dict[str, int]:
        return {
            "launches": self.kernel_launches,
            "h2d": self.h2d,
            "h2d_bytes": self.h2d_bytes,
            "d2h": self.d2h,
            "d2h_bytes": self.d2h_bytes,
            "d2d": self.d2d,
            "d2d_bytes": self.d2d_bytes,
            "syncs": self.syncs,
            "graph_launches": self.graph_launches,
            "graph_kernels": self.graph_kernels,
            "weight_bytes": self.weight_bytes,
        }


@dataclass(frozen=True)
class CountFunction:
    name: str
    inner: Any = None  # the wrapped runtime's function


@dataclass(frozen=True)
class CountModule:
    inner: Any = None  # the wrapped runtime's module

    def function(self, name: str) -> CountFunction:
        return CountFunction(name, self.inner.function(name) if self.inner else None)


@dataclass(frozen=True)
class WeightBuffer:
    nbytes: int
    row_bytes: int  # an embedding launch reads one row per token, not the whole table


class _Graph:
    def __init__(self, runtime: CountingRuntime, inner=None):
        self.runtime = runtime
        self.inner = inner  # the wrapped runtime's graph
        self.calls: list[tuple] = []

    def replay(self) -> None:
        # one graph launch; the kernels inside it are the graph's, not launches of their own
        counts = self.runtime.current
        counts.graph_launches += 1
        counts.graph_kernels += len(self.calls)
        for fn, grid, _, args in self.calls:
            self.runtime.count_weights(counts, fn, grid, args)
        if self.inner is not None:
            self.inner.replay()


class _Event:
    def record(self) -> None:
        pass


class CountingRuntime:
    def __init__(self, inner=None):
        self.inner = inner
        self.name = inner.name if inner else "count"  # what the launchers may ask of it
        self.target = inner.target if inner else "count"
        self.phases: dict[str, Counts] = {}
        self.current = self._counts("load")
        self._next = BASE_ADDRESS
        self._weights: dict[int, WeightBuffer] = {}
        self._tables: dict[int, set[int]] = {}  # device address -> the weights a table names
        self._capture: _Graph | None = None

    # -- phases ---------------------------------------------------------------------------
    def _counts(self, name: str) -> Counts:
        return self.phases.setdefault(name, Counts())

    @contextlib.contextmanager
    def phase(self, name: str):
        """Count what runs inside the block under `name` (added to earlier blocks of it)."""
        previous, self.current = self.current, self._counts(name)
        try:
            yield self.current
        finally:
            self.current = previous

    def mark_weight(self, buf: FakeBuffer, row_bytes: int) -> None:
        """Count `buf`'s bytes as weight bytes read whenever a launch takes its address."""
        self._weights[buf.ptr] = WeightBuffer(buf.nbytes, row_bytes)

    # -- memory ---------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> FakeBuffer:
        if self.inner is not None:
            return self.inner.alloc(nbytes)
        nbytes = max(int(nbytes), 1)
        buf = FakeBuffer(self._next, nbytes)
        self._next += -(-nbytes // ALIGN) * ALIGN
        return buf

    def h2d(self, dst: FakeBuffer, host, offset: int = 0) -> None:
        self.current.h2d += 1
        self.current.h2d_bytes += int(host.nbytes)
        if getattr(host, "dtype", None) == np.int64:  # a table of pointers a kernel follows
            named = {int(v) for v in np.asarray(host).reshape(-1)} & self._weights.keys()
            if named:
                self._tables[dst.ptr + offset] = named
        if self.inner is not None:
            self.inner.h2d(dst, host, offset)

    def d2h(self, host, src: FakeBuffer, offset: int = 0) -> None:
        self.current.d2h += 1
        self.current.d2h_bytes += int(host.nbytes)
        if self.inner is not None:
            self.inner.d2h(host, src, offset)
        else:
            host.reshape(-1).view("u1")[:] = 0

    def d2d(self, dst: FakeBuffer, dst_off: int, src: FakeBuffer, src_off: int, n: int) -> None:
        self.current.d2d += 1
        self.current.d2d_bytes += int(n)
        if self.inner is not None:
            self.inner.d2d(dst, dst_off, src, src_off, n)

    # -- compile and launch ---------------------------------------------------------------
    def compile(self, file: str, defines: dict | None = None) -> CountModule:
        return CountModule(self.inner.compile(file, defines) if self.inner else None)

    def launch(self, fn: CountFunction, grid: tuple, block: tuple, args: list[rt.Arg]) -> None:
        if self.inner is not None:
            self.inner.launch(fn.inner, grid, block, args)
        if self._capture is not None:
            self._capture.calls.append((fn, grid, block, list(args)))
            return
        counts = self.current
        counts.launches[fn.name] += 1
        self.count_weights(counts, fn, grid, args)

    def count_weights(self, counts: Counts, fn: CountFunction, grid: tuple, args: list) -> None:
        """The marked weight bytes one kernel reads (an embedding: only its rows)."""
        pointers = [a.value for a in args if a.kind == "p"]
        seen = {p for p in pointers if p in self._weights}
        for p in pointers:  # the weights a launch reads through a device pointer table
            seen |= self._tables.get(p, set())
        for address in seen:
            w = self._weights[address]
            rows = rt.dims3(grid)[0] if fn.name.startswith("embedding") else None
            counts.weight_bytes += w.nbytes if rows is None else min(w.nbytes, rows * w.row_bytes)

    def synchronize(self) -> None:
        self.current.syncs += 1
        if self.inner is not None:
            self.inner.synchronize()

    def event(self):
        return self.inner.event() if self.inner else _Event()

    def elapsed_ms(self, start, end) -> float:
        return self.inner.elapsed_ms(start, end) if self.inner else 0.0

    @contextlib.contextmanager
    def capture(self):
        with contextlib.ExitStack() as stack:
            inner = stack.enter_context(self.inner.capture()) if self.inner else None
            graph = _Graph(self, inner)
            self._capture = graph
            try:
                yield graph
            finally:
                self._capture = None

    def info(self) -> dict:
        return self.inner.info() if self.inner else {"runtime": self.name, "target": self.target}
