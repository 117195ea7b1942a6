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


def _complete_model(incomplete: str):
    from atlas_cli.completion import complete_models

    return complete_models(incomplete)


def _complete_device(incomplete: str):
    from atlas_cli.backend import DEVICES

    return _choices(DEVICES, incomplete)


def _choices(values: tuple[str, ...], incomplete: str) -> list[str]:
    return [v for v in values if v.startswith(incomplete)]


ModelArg = Annotated[
    str | None, typer.Argument(help="Model name or path.", autocompletion=_complete_model)
]

# Options shared by the commands that generate text.
# Sampling options left unset take the model recipe's defaults, then llama.cpp's.
Temperature = Annotated[
    float | None, typer.Option(help="Sampling temperature; 0 is greedy (recipe, else 0.8).")
]
TopK = Annotated[
    int | None, typer.Option("--top-k", help="Keep the k likeliest tokens; 0: off (else 40).")
]
TopP = Annotated[float | None, typer.Option("--top-p", help="Nucleus mass (else 0.95).")]
MinP = Annotated[
    float | None, typer.Option("--min-p", help="Drop tokens under min-p × the best (else 0.05).")
]
RepeatPenalty = Annotated[
    float | None,
    typer.Option("--repeat-penalty", help="Penalise recent tokens; 1.0: off (else 1.0)."),
]
Seed = Annotated[int | None, typer.Option(help="Random seed: the same seed gives the same text.")]
MaxTokens = Annotated[int, typer.Option("--max-tokens", "-n", help="Most tokens to generate.")]
Stop = Annotated[list[str] | None, typer.Option(help="Stop at this text (repeatable).")]
Device = Annotated[
    str,
    typer.Option(
        help="cpu (on the quantized weights), cpu-ref (float32 reference), cuda or hip.",
        autocompletion=_complete_device,
    ),
]
CtxSize = Annotated[int | None, typer.Option("--ctx-size", help="Context length in tokens.")]
System = Annotated[str | None, typer.Option(help="System prompt.")]
Verbose = Annotated[bool, typer.Option("--verbose", "-v", help="Print timing statistics.")]


def given_sampling(temperature, top_k, top_p, min_p, repeat_penalty) -> dict:
    """The sampling options the user set; the rest come from the model's recipe, then atlas."""
    given = dict(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        repeat_penalty=repeat_penalty,
    )
    return {k: v for k, v in given.items() if v is not None}


@app.command()
@handle_errors
def run(
    model: ModelArg = None,
    prompt: Annotated[
        str | None, typer.Argument(help="The prompt; read from stdin if piped.")
    ] = None,
    system: System = None,
    temperature: Temperature = None,
    top_k: TopK = None,
    top_p: TopP = None,
    min_p: MinP = None,
    repeat_penalty: RepeatPenalty = None,
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
    draft: Annotated[
        int | None,
        typer.Option("--draft", min=0, help="Tokens to draft per step with the model's MTP head."),
    ] = None,
    no_speculative: Annotated[
        bool, typer.Option("--no-speculative", help="Turn speculative decoding off.")
    ] = False,
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
        sampling={
            **given_sampling(temperature, top_k, top_p, min_p, repeat_penalty),
            "seed": seed,
        },
        max_tokens=max_tokens,
        stop=stop or [],
        device=device,
        ctx_size=ctx_size,
        stream=not json_output,
        draft=0 if no_speculative else draft,
    )
    if json_output:
        typer.echo(json.dumps(result.as_json(), ensure_ascii=False))
    elif verbose:
        typer.echo(result.stats_block(), err=True)


@app.command()
@handle_errors
def serve(
    model: Annotated[str, typer.Argument(help="Model name or path.")] = DEFAULT_MODEL,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8080,
    served_model_name: Annotated[
        str | None, typer.Option(help="The model id clients send (default: MODEL).")
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(envvar="ATLAS_API_KEY", help="Require this key (Bearer or x-api-key)."),
    ] = None,
    ctx_size: CtxSize = None,
    chat_template_kwargs: Annotated[
        str | None,
        typer.Option(help="Template defaults as JSON, e.g. '{\"enable_thinking\": false}'."),
    ] = None,
    tool_parser: Annotated[
        str | None,
        typer.Option(
            help="Tool-call format: hermes, qwen3_coder or none "
            "(default: the recipe's, else read from the chat template)."
        ),
    ] = None,
    device: Device = "cpu",
):
    """Serve a model over an OpenAI-compatible HTTP API (and Anthropic's /v1/messages)."""
    from atlas_cli.serve.server import parse_template_kwargs
    from atlas_cli.serve.server import serve as run_server

    run_server(
        model,
        host=host,
        port=port,
        served_model_name=served_model_name,
        api_key=api_key,
        ctx_size=ctx_size,
        device=device,
        template_kwargs=parse_template_kwargs(chat_template_kwargs),
        tool_parser=tool_parser,
    )


@app.command()
@handle_errors
def chat(
    model: ModelArg = None,
    system: System = None,
    temperature: Temperature = None,
    top_k: TopK = None,
    top_p: TopP = None,
    min_p: MinP = None,
    repeat_penalty: RepeatPenalty = None,
    seed: Seed = None,
    max_tokens: MaxTokens = 512,
    stop: Stop = None,
    verbose: Verbose = False,
    device: Device = "cpu",
    ctx_size: CtxSize = None,
    think: Annotated[
        str,
        typer.Option(
            help="Reasoning: on (dimmed), hidden, or off (ask the model not to think).",
            autocompletion=lambda incomplete: _choices(("on", "hidden", "off"), incomplete),
        ),
    ] = "on",
    markdown: Annotated[bool, typer.Option(help="Render finished answers as Markdown.")] = False,
    history: Annotated[
        bool, typer.Option(help="Keep input history across sessions (or ATLAS_NO_HISTORY=1).")
    ] = True,
):
    """Chat with a model in an interactive session (/help inside lists the commands)."""
    from atlas_cli.chat import ChatOptions, ChatSettings, run_chat

    given = given_sampling(temperature, top_k, top_p, min_p, repeat_penalty)
    settings = ChatSettings(
        **given,
        seed=seed,
        max_tokens=max_tokens,
        stop=tuple(stop or ()),
        verbose=verbose,
        think=think,
        markdown=markdown,
    )
    options = ChatOptions(
        system=system,
        device=device,
        ctx_size=ctx_size,
        history=history,
        explicit=frozenset(given),
    )
    run_chat(model or DEFAULT_MODEL, settings.validate(), options)


@app.command()
@handle_errors
def completion(
    shell: Annotated[
        str,
        typer.Argument(
            help="bash, zsh or fish.",
            autocompletion=lambda incomplete: _choices(("bash", "zsh", "fish"), incomplete),
        ),
    ],
):
    """Print the shell completion script for SHELL (the README says how to install it)."""
    from atlas_cli.completion import script

    typer.echo(script(shell), nl=False)


# pull, list, show, rm, hw: the model store and hardware (atlas_cli/models_cli.py)
from atlas_cli import models_cli  # noqa: E402

models_cli.register(app, handle_errors)


from atlas_cli.bench.cli import bench_app, route_bench_args  # noqa: E402  (typer only)

app.add_typer(bench_app, name="bench")


def main() -> None:
    from atlas_cli.completion import COMPLETE_VAR, PROG

    if os.environ.get(COMPLETE_VAR):
        from atlas_cli.completion import register

        register()
    argv = sys.argv[1:]
    if argv[:1] == ["bench"]:  # `atlas bench MODEL ...` runs the default bench subcommand
        argv[1:] = route_bench_args(argv[1:])
    app(args=argv, prog_name=PROG, complete_var=COMPLETE_VAR)


if __name__ == "__main__":
    main()
