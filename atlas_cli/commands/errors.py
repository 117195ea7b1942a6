"""The one map from the errors a user can cause to what the terminal shows.

An `AtlasError` becomes `atlas: error: <message>` on stderr and its exit code (1, or 2 for a
bad flag); so does a usage error that the command-line parser finds (an unknown option, a
missing argument: exit 2), in place of Typer's boxed or multi-line error. Ctrl-C exits with
130, as shells expect. ATLAS_DEBUG=1 lets an AtlasError through, traceback and all.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import os
import sys
from collections.abc import Callable, Iterator
from typing import TypeVar

import typer
from typer.core import TyperGroup

from atlas_cli.errors import AtlasError

# Newer Typer releases carry their own copy of click, older ones use click: both export
# BadParameter, whose bases are the parser's usage error and its error base class.
ParserUsageError = typer.BadParameter.__base__
ParserError = ParserUsageError.__base__
SUGGEST_CUTOFF = 0.8  # click suggests --verbose for --bogus; only a near miss is a suggestion

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


class AtlasGroup(TyperGroup):
    """The app's command groups: the parser's errors in atlas's one-line style, and each
    command's whole first sentence in the list (click cuts it at ~45 characters)."""

    def format_commands(self, ctx, formatter) -> None:
        rows = []
        for name in self.list_commands(ctx):
            command = self.get_command(ctx, name)
            if command is not None and not command.hidden:
                rows.append((name, first_sentence(command.short_help or command.help or "")))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except ParserUsageError as exc:
            ctx = getattr(exc, "ctx", None)
            if ctx is not None and exc.format_message().startswith("Missing command"):
                typer.echo(ctx.get_help())  # a group alone (`atlas bench`): what it holds
                sys.exit(0)
            typer.echo(f"atlas: error: {usage_message(exc)}", err=True)
            sys.exit(2)
        except ParserError as exc:
            typer.echo(f"atlas: error: {exc.format_message()}", err=True)
            sys.exit(exc.exit_code)
        except typer.Abort:
            typer.echo("atlas: aborted", err=True)
            sys.exit(1)
        # without standalone mode an Exit comes back as its code; commands return None
        sys.exit(code if isinstance(code, int) else 0)


def first_sentence(doc: str) -> str:
    """A docstring's first sentence, on one line."""
    text = " ".join(doc.split("\n\n")[0].split())
    end = text.find(". ")
    return text if end < 0 else text[: end + 1]


def usage_message(exc) -> str:
    """One line for a parser usage error: what is wrong, a near-miss option if there is one,
    and where the help is."""
    wrong = getattr(exc, "option_name", None)
    if wrong and getattr(exc, "possibilities", None) is not None:  # an unknown option
        message = f"no such option {wrong}"
        close = difflib.get_close_matches(wrong, exc.possibilities, n=1, cutoff=SUGGEST_CUTOFF)
        if close:
            message += f"; did you mean {close[0]}?"
    else:
        message = exc.format_message().rstrip(".")
        message = message[:1].lower() + message[1:]
    ctx = getattr(exc, "ctx", None)
    return f"{message} (see `{ctx.command_path if ctx is not None else 'atlas'} --help`)"
