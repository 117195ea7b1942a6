"""`atlas chat`: an interactive session with a model (the REPL lives in atlas_cli/chat/)."""

from __future__ import annotations

from typing import Annotated

import typer

from atlas_cli.commands.options import (
    CtxSize,
    Device,
    KvType,
    MaxTokens,
    MinP,
    Model,
    Offline,
    ReasoningBudget,
    RepeatPenalty,
    Seed,
    Stop,
    System,
    Temperature,
    Think,
    Threads,
    TopK,
    TopP,
    Verbose,
)
from atlas_cli.cpu_threads import use_threads
from atlas_cli.run_service import given_sampling
from atlas_cli.store.embedded import DEFAULT_MODEL

Markdown = Annotated[bool, typer.Option(help="Render finished answers as Markdown.")]
History = Annotated[
    bool, typer.Option(help="Keep input history across sessions (or ATLAS_NO_HISTORY=1).")
]


def chat(
    model: Model = None,
    system: System = None,
    temperature: Temperature = None,
    top_k: TopK = None,
    top_p: TopP = None,
    min_p: MinP = None,
    repeat_penalty: RepeatPenalty = None,
    seed: Seed = None,
    reasoning_budget: ReasoningBudget = None,
    max_tokens: MaxTokens = 512,
    stop: Stop = None,
    verbose: Verbose = False,
    device: Device = None,
    threads: Threads = None,
    ctx_size: CtxSize = None,
    kv_type: KvType = None,
    offline: Offline = False,
    think: Think = "on",
    markdown: Markdown = False,
    history: History = True,
):
    """Chat with a model in an interactive session (/help inside lists the commands)."""
    use_threads(threads)
    from atlas_cli import backend, recipes, session
    from atlas_cli.chat import ChatOptions, ChatSettings, run_chat

    recipes.parse_ref(model or DEFAULT_MODEL)  # a misspelt name fails now, before any output
    backend.check_kv_type(kv_type)

    given = given_sampling(temperature, top_k, top_p, min_p, repeat_penalty).set_fields()
    settings = ChatSettings(
        **given,
        seed=seed,
        reasoning_budget=reasoning_budget,
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

    def load(name: str, *, device: str, ctx_size: int | None):  # also for /load inside the chat
        return session.open_model(
            name, device=device, ctx_size=ctx_size, offline=offline or None, kv_dtype=kv_type
        )

    run_chat(model or DEFAULT_MODEL, settings.validate(), options, load_model=load)
