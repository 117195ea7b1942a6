"""The `atlas` command line: this file only assembles the app from atlas_cli/commands/.

Commands are thin (parse, call a library function, print) and import the backend inside their
bodies only, so `atlas --help` stays fast. User errors become one line and an exit code in one
place, commands/errors.py: every command runs under it, and so does `main()`.
"""

from __future__ import annotations

import os
import sys
from typing import Annotated

import typer

from atlas_cli import __version__
from atlas_cli.bench.cli import (  # typer only: keeps --help light
    DEFAULT_COMMAND,
    HELP_FLAGS,
    bench_app,
    route_bench_args,
)
from atlas_cli.commands import chat, completion, loaded, models, run, serve
from atlas_cli.commands.errors import AtlasGroup, guarded, user_errors
from atlas_cli.completion import COMPLETE_VAR, PROG, route_completion_words

app = typer.Typer(
    name=PROG,
    cls=AtlasGroup,
    help="Run large language models on your own machine.",
    add_completion=False,
    pretty_exceptions_enable=False,
    # plain help, as git and ollama print it: a switch shows no `<bool>`, and at 80 columns a
    # description gets ~48 characters instead of the rich table's ~22
    rich_markup_mode=None,
    # `-h` as well as `--help`, as ollama and llama.cpp take it; subcommands inherit it
    context_settings={"help_option_names": list(HELP_FLAGS)},
)


def _version(value: bool):
    if value:
        typer.echo(f"atlas {__version__}")
        raise typer.Exit()


@app.callback(invoke_without_command=True)
def main_options(
    ctx: typer.Context,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Show the version.")
    ] = False,
):
    """Run large language models on your own machine."""
    if ctx.invoked_subcommand is None:  # bare `atlas`: the help, and success (as git, ollama)
        typer.echo(ctx.get_help())


COMMANDS = {
    "run": run.run,
    "serve": serve.serve,
    "chat": chat.chat,
    "completion": completion.completion,
    "pull": models.pull,
    "list": models.list_models,
    "show": models.show,
    "rm": models.rm,
    "hw": models.hw,
    "ps": loaded.ps,
    "stop": loaded.stop,
}
for name, command in COMMANDS.items():
    app.command(name)(guarded(command))
app.add_typer(bench_app, name="bench")


def with_default_bench_command(words: list[str]) -> list[str]:
    """`atlas bench MODEL ...` runs the default bench subcommand: the words after `bench` get
    it put first (once there is a word after `bench`, so `atlas bench` alone shows the group)."""
    if words[:1] == ["bench"] and len(words) > 1:
        return ["bench", *route_bench_args(words[1:])]
    return words


def write_completion_table() -> None:
    """Store the command tree for the next Tab (atlas_cli/completion_cache.py answers from it
    without importing this module), unless a fresh one is there."""
    from atlas_cli import completion_cache, completion_table
    from atlas_cli.commands.options import _complete_downloaded, _complete_model

    if completion_cache.load() is not None:
        return
    names = [command.name for command in bench_app.registered_commands]
    routes = {"bench": {"default": DEFAULT_COMMAND, "keep": [*names, *HELP_FLAGS]}}
    command = typer.main.get_command(app)
    # the model completers read the store: the fast path calls completion's functions live
    live = {_complete_model: "models", _complete_downloaded: "downloaded"}
    table = completion_table.build(command, PROG, live, routes)
    completion_cache.save(table, typer.__file__)


def main() -> None:
    """The `atlas` program: Tab completion when the shell asks for it, else the app."""
    if os.environ.get(COMPLETE_VAR):
        from atlas_cli.completion import register

        register()
        write_completion_table()
        route_completion_words(with_default_bench_command)
    with user_errors():
        app(
            args=with_default_bench_command(sys.argv[1:]),
            prog_name=PROG,
            complete_var=COMPLETE_VAR,
        )


if __name__ == "__main__":
    main()
