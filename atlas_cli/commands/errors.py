"""The one map from the errors a user can cause to what the terminal shows.

An `AtlasError` becomes `atlas: error: <message>` on stderr and its exit code (1, or 2 for a
bad flag); Ctrl-C exits with 130, as shells expect. ATLAS_DEBUG=1 lets an AtlasError through,
traceback and all.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from typing import TypeVar

import typer

from atlas_cli.errors import AtlasError

F = TypeVar("F", bound=Callable)


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Run the block; end the process the way the CLI ends on a user error or Ctrl-C."""
    try:
        yield
    except AtlasError as exc:
        if os.environ.get("ATLAS_DEBUG"):
            raise
        typer.echo(f"atlas: error: {exc}", err=True)
        raise SystemExit(exc.exit_code) from None
    except KeyboardInterrupt:
        typer.echo("", err=True)
        raise SystemExit(130) from None


def guarded(command: F) -> F:
    """`command` run under `user_errors`, so the app answers the same however it is invoked
    (the `atlas` script, `python -m atlas_cli`, Typer's test runner)."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        with user_errors():
            return command(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
