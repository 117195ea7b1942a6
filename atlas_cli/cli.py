"""The `atlas` command line. Commands are thin: parse, call a library function, print.

The backend (numpy and friends) is imported inside commands only, so `atlas --help` is fast.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from typing import Annotated

import typer

from atlas_cli import __version__
from atlas_cli.errors import AtlasError

app = typer.Typer(
    name="atlas",
    help="Run large language models on your own machine.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

DEFAULT_MODEL = "smollm2-135m"


def handle_errors(fn):
    """Turn user-caused errors into one line on stderr and an exit code; Ctrl-C into 130."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except AtlasError as exc:
            if os.environ.get("ATLAS_DEBUG"):
                raise
            typer.echo(f"atlas: error: {exc}", err=True)
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:
            typer.echo("", err=True)
            raise typer.Exit(130) from None

    return wrapper


def _version(value: bool):
    if value:
        typer.echo(f"atlas {__version__}")
        raise typer.Exit()


@app.callback()
def main_options(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Show the version.")
    ] = False,
):
    """Run large language models on your own machine."""


# Options shared by the commands that generate text.
Temperature = Annotated[float, typer.Option(help="Sampling temperature; 0 is greedy.")]
TopK = Annotated[int, typer.Option("--top-k", help="Keep the k most likely tokens (0: off).")]
TopP = Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass.")]
MinP = Annotated[float, typer.Option("--min-p", help="Drop tokens below min-p × the best.")]
RepeatPenalty = Annotated[
    float, typer.Option("--repeat-penalty", help="Penalise recently seen tokens (1.0: off).")
]
Seed = Annotated[int | None, typer.Option(help="Random seed: the same seed gives the same text.")]
MaxTokens = Annotated[int, typer.Option("--max-tokens", "-n", help="Most tokens to generate.")]
Stop = Annotated[list[str] | None, typer.Option(help="Stop at this text (repeatable).")]
Device = Annotated[str, typer.Option(help="cpu or cpu-ref (numpy float32 reference).")]
CtxSize = Annotated[int | None, typer.Option("--ctx-size", help="Context length in tokens.")]
System = Annotated[str | None, typer.Option(help="System prompt.")]
Verbose = Annotated[bool, typer.Option("--verbose", "-v", help="Print timing statistics.")]


@app.command()
@handle_errors
def run(
    model: Annotated[str | None, typer.Argument(help="Model name or path.")] = None,
    prompt: Annotated[
        str | None, typer.Argument(help="The prompt; read from stdin if piped.")
    ] = None,
    system: System = None,
    temperature: Temperature = 0.8,
    top_k: TopK = 40,
    top_p: TopP = 0.95,
    min_p: MinP = 0.05,
    repeat_penalty: RepeatPenalty = 1.0,
    seed: Seed = None,
    max_tokens: MaxTokens = 512,
    stop: Stop = None,
    raw: Annotated[
        bool, typer.Option(help="Send the prompt as is, without the chat template.")
    ] = False,
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    verbose: Verbose = False,
    device: Device = "cpu",
    ctx_size: CtxSize = None,
):
    """Generate a reply to one prompt, streamed as it is produced."""
    from atlas_cli import run_cmd

    model_name, prompt_text = run_cmd.split_model_and_prompt(model, prompt, DEFAULT_MODEL)
    if prompt_text is None and not sys.stdin.isatty():
        prompt_text = sys.stdin.read()
    if not prompt_text:
        raise typer.BadParameter("give a prompt as an argument or on stdin")
    result = run_cmd.run(
        model_name,
        prompt_text,
        system=system,
        raw=raw,
        sampling=dict(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            repeat_penalty=repeat_penalty,
            seed=seed,
        ),
        max_tokens=max_tokens,
        stop=stop or [],
        device=device,
        ctx_size=ctx_size,
        stream=not json_output,
    )
    if json_output:
        typer.echo(json.dumps(result.as_json(), ensure_ascii=False))
    elif verbose:
        typer.echo(result.stats_block(), err=True)


from atlas_cli.bench.cli import bench_app  # noqa: E402  (typer only: keeps --help light)

app.add_typer(bench_app, name="bench")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
