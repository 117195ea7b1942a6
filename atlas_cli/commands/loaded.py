"""`atlas ps` and `atlas stop`: the models kept loaded after `atlas run` (ollama's ps / stop)."""

from __future__ import annotations

import json
import time
from typing import Annotated

import typer

from atlas_cli.commands.models import table
from atlas_cli.commands.options import Json, model_argument
from atlas_cli.units import size_text

StopName = Annotated[
    str | None, model_argument("The model to unload, as named at `atlas run`; all if none.")
]


def ps(json_output: Json = False):
    """List the models kept loaded after `atlas run` (see --keep-alive)."""
    from atlas_cli.keepalive import registry

    workers = registry.workers()
    if json_output:
        rows = [{**w.__dict__, "memory_bytes": w.memory_bytes()} for w in workers]
        typer.echo(json.dumps(rows, indent=1))
    elif not workers:
        typer.echo(
            "no model is kept loaded (`atlas run` keeps its model for --keep-alive)", err=True
        )
    else:
        rows = [
            [
                w.model,
                w.device,
                size_text(w.memory_bytes()),
                f"{size_text(w.cache_bytes)} of {size_text(w.cache_budget)}",
                until(w.expires_at),
                str(w.pid),
            ]
            for w in workers
        ]
        typer.echo(table(["NAME", "DEVICE", "MEMORY", "PREFIX CACHE", "UNTIL", "PID"], rows))


def stop(name: StopName = None):
    """Unload a model kept loaded after `atlas run` (every one without a name)."""
    from atlas_cli.errors import ModelNotFoundError
    from atlas_cli.keepalive import registry

    workers = registry.matching(name)
    if name is not None and not workers:
        raise ModelNotFoundError(f"{name} is not loaded (`atlas ps` shows what is)")
    for worker in workers:
        registry.stop(worker)
        typer.echo(f"stopped {worker.model} ({worker.device})")


def until(when: float) -> str:
    seconds = when - time.time()
    if seconds <= 0:
        return "now"
    for unit, span in (("hour", 3600), ("minute", 60)):
        if seconds >= span:
            n = round(seconds / span)
            return f"{n} {unit}{'s' if n > 1 else ''} from now"
    return f"{seconds:.0f} seconds from now"
