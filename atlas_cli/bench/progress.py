"""Progress for long benchmark runs, on stderr: a rich bar on a terminal, one line per step
otherwise (logs and CI); both say how long the rest should take."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol


class Reporter(Protocol):
    def __call__(self, summary: str) -> None: ...


@contextmanager
def steps(description: str, total: int) -> Iterator[Reporter]:
    """Yield `report(summary)`, called once per finished step with a one-line status."""
    if sys.stderr.isatty():
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        columns = (
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[status]}"),
        )
        with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
            task = bar.add_task(description, total=total, status="")
            yield lambda status: bar.update(task, advance=1, status=status)
        return
    done = 0
    t0 = time.monotonic()

    def report(status: str) -> None:
        nonlocal done
        done += 1
        # the steps so far, on average, for each one left: rough, and honest about it
        left = (time.monotonic() - t0) / done * (total - done)
        eta = f" (about {_duration(left)} left)" if done < total else ""
        print(f"{description} [{done}/{total}] {status}{eta}", file=sys.stderr, flush=True)

    yield report


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 60} min {s % 60:02d} s" if s >= 60 else f"{s} s"
