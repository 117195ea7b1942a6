"""Download progress on stderr: a rich bar on a terminal, plain lines otherwise."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

Update = Callable[[int], None]


@contextmanager
def byte_progress(description: str, total: int, done: int = 0) -> Iterator[Update]:
    """Yield `advance(nbytes)`; shows bytes, rate and ETA."""
    if sys.stderr.isatty():
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        columns = (
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
        )
        with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
            task = bar.add_task(description, total=total, completed=done)
            yield lambda n: bar.advance(task, n)
        return
    state = {"done": done, "next": 0, "t0": time.monotonic()}

    def advance(n: int) -> None:
        state["done"] += n
        pct = 100 * state["done"] // max(total, 1)
        if pct >= state["next"]:
            # rate and ETA count only this run's bytes, not a resumed download's first part
            rate = (state["done"] - done) / max(time.monotonic() - state["t0"], 1e-6)
            left = max(total - state["done"], 0)
            eta = f", ETA {_hms(left / rate)}" if rate > 0 and left else ""
            print(
                f"{description}: {pct}% ({state['done'] / 1e6:.1f}/{total / 1e6:.1f} MB, "
                f"{rate / 1e6:.1f} MB/s{eta})",
                file=sys.stderr,
                flush=True,
            )
            state["next"] = pct - pct % 25 + 25

    yield advance


def _hms(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"
