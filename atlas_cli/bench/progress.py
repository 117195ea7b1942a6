"""Progress for long benchmark runs, on stderr: a rich bar on a terminal, one line per step
otherwise (logs and CI)."""

from __future__ import annotations

import sys
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
        )

        columns = (
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[status]}"),
        )
        with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
            task = bar.add_task(description, total=total, status="")
            yield lambda status: bar.update(task, advance=1, status=status)
        return
    done = 0

    def report(status: str) -> None:
        nonlocal done
        done += 1
        print(f"{description} [{done}/{total}] {status}", file=sys.stderr, flush=True)

    yield report
