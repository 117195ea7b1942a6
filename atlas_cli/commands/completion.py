"""`atlas completion SHELL`: print the shell's completion hook (see atlas_cli/completion.py)."""

from __future__ import annotations

from typing import Annotated

import typer

from atlas_cli.completion import complete_shells, script

Shell = Annotated[str, typer.Argument(help="bash, zsh or fish.", autocompletion=complete_shells)]


def completion(shell: Shell):
    """Print the shell completion script for SHELL (the README says how to install it)."""
    typer.echo(script(shell), nl=False)
