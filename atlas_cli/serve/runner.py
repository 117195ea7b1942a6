"""The engine behind the server: one generation at a time, in arrival order.

The engine is single-stream and synchronous, so it runs on one worker thread (a one-thread
executor is a FIFO queue). Each request gets a `Generation` whose text pieces cross back to the
event loop through an asyncio queue. Cancelling one (a client that went away) stops it at the
next token and frees the engine for the next request; one that is still queued never starts.
Work on the engine's caches that is not a generation (saving or restoring a prefix-cache slot)
goes through the same queue (`call`), so it never runs beside one.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from atlas_cli.backend.constraint import Constraint
from atlas_cli.backend.engine import Engine, GenerationStats
from atlas_cli.backend.prefix_disk import STOP_WAIT_S
from atlas_cli.backend.prefix_pool import SERVE_BUDGET, default_budget
from atlas_cli.backend.sample import SamplingParams
from atlas_cli.serve.metrics import Metrics

_END = object()
T = TypeVar("T")


@dataclass(frozen=True)
class Decided:
    """What a job's `decide` chose, and how many prompt tokens were cached before it ran
    (its own forwards leave the prompt cached: the answer's usage reports this count)."""

    constraint: Constraint | None
    cached_tokens: int


# picks the answer's constraint on the engine thread, just before it starts (tool_choice auto)
Decide = Callable[[Engine], Decided]


@dataclass(frozen=True)
class Job:
    ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...] = ()
    constraint: Constraint | None = None  # the grammar the answer must fit
    decide: Decide | None = None  # when given, it chooses the constraint instead


class Generation:
    """A submitted job: iterate it for text pieces, then `await result()` for its stats."""

    def __init__(self, job: Job, loop: asyncio.AbstractEventLoop):
        self.job = job
        self.loop = loop
        self.arrival = time.perf_counter()
        self.queue_s = 0.0
        self.stats = GenerationStats()
        self.error: BaseException | None = None
        self._cancel = threading.Event()
        self._pieces: asyncio.Queue = asyncio.Queue()
        self._done = loop.create_future()

    def cancel(self) -> None:
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    async def __aiter__(self) -> AsyncIterator[str]:
        """Text pieces until the end (an engine error ends them early: see `error`)."""
        while True:
            item = await self._pieces.get()
            if item is _END:
                return
            yield item

    async def result(self) -> GenerationStats:
        """Wait until the worker has let go of the engine (after a cancel, too)."""
        await asyncio.shield(self._done)
        return self.stats

    # -- called from the worker thread -------------------------------------------------------

    def _put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self._pieces.put_nowait, item)
        except RuntimeError:  # the loop is gone (server shutting down)
            self._cancel.set()

    def _finish(self, error: BaseException | None) -> None:
        self.error = error
        self._put(_END)
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(_set_done, self._done)


def _add_decision(stats: GenerationStats, decided: Decided, spent_s: float) -> None:
    stats.cached_tokens = decided.cached_tokens
    stats.prompt_s += spent_s
    stats.ttft_s += spent_s if stats.completion_tokens else 0.0
    stats.total_s += spent_s


def _set_done(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class EngineRunner:
    def __init__(self, engine: Engine, metrics: Metrics, cache_bytes: int | None = None):
        """`cache_bytes`: the engine's prefix-pool budget (`--cache-size`); None: the server's
        default (`SERVE_BUDGET`, or a quarter of the memory available where that is less)."""
        self.engine = engine
        self.metrics = metrics
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="atlas-engine")
        self._engine_lock = threading.Lock()  # held by whatever runs on the engine thread
        metrics.ctx.set(engine.context_length)
        engine.pool.budget = default_budget(SERVE_BUDGET) if cache_bytes is None else cache_bytes

    async def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the engine thread, after the generations queued before it."""
        return await asyncio.wrap_future(self._pool.submit(self._exclusive, fn))

    def submit(self, job: Job) -> Generation:
        gen = Generation(job, asyncio.get_running_loop())
        self.metrics.waiting.inc()
        self._pool.submit(self._exclusive, self._work, gen)
        return gen

    def _exclusive(self, fn: Callable[..., T], *args) -> T:
        with self._engine_lock:
            return fn(*args)

    def shutdown(self) -> None:
        """Stop taking work; once the generation in flight has ended (its client is gone),
        keep the cached conversations on disk for the next server."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.engine.disk is not None and self._engine_lock.acquire(timeout=STOP_WAIT_S):
            try:
                self.engine.spill_all()
            finally:
                self._engine_lock.release()

    def _work(self, gen: Generation) -> None:
        m = self.metrics
        m.waiting.dec()
        start = time.perf_counter()
        gen.queue_s = start - gen.arrival
        if gen.cancelled:  # the client left while queued
            gen.stats.finish_reason = "interrupted"
            m.finished.labels("interrupted").inc()
            gen._finish(None)
            return
        m.running.inc()
        job, stats, error, events, decided = gen.job, gen.stats, None, None, None
        try:
            constraint = job.constraint
            if job.decide is not None:
                decided = job.decide(self.engine)
                constraint = decided.constraint
            events = self.engine.generate(
                job.ids,
                max_tokens=job.max_tokens,
                sampling=job.sampling,
                stop=job.stop,
                stats=stats,
                constraint=constraint,
            )
            for event in events:
                if gen.cancelled:
                    break
                if event.text:
                    gen._put(event.text)
        except Exception as exc:  # reported to the request that caused it, not the server
            error = exc
        finally:
            if events is not None:
                events.close()
            if decided is not None:  # the decision's forwards were part of the prompt's work
                _add_decision(stats, decided, time.perf_counter() - start - stats.total_s)
            m.running.dec()
            self._record(gen, stats)
            gen._finish(error)

    def _record(self, gen: Generation, stats: GenerationStats) -> None:
        m = self.metrics
        m.queue_time.observe(gen.queue_s)
        m.finished.labels(stats.finish_reason).inc()
        m.prompt_tokens.inc(stats.prompt_tokens)
        m.cached_tokens.inc(stats.cached_tokens)
        m.generation_tokens.inc(stats.completion_tokens)
        if stats.completion_tokens:
            m.ttft.observe(gen.queue_s + stats.ttft_s)
        if stats.completion_tokens > 1:
            m.tpot.observe(stats.eval_s / (stats.completion_tokens - 1))
        m.e2e.observe(time.perf_counter() - gen.arrival)
        used = len(self.engine.cached_ids)
        m.kv_used.set(used)
        m.kv_usage.set(used / self.engine.context_length)
