"""Arguments and options shared by several commands: one meaning and one help text per flag.

Sampling options left unset take the model recipe's defaults, then atlas's (llama.cpp's), so
they default to None here, and `run_service.given_sampling` keeps only the ones the user set.
"""

from __future__ import annotations

from typing import Annotated

import typer


def choices(values: tuple[str, ...], incomplete: str) -> list[str]:
    """Shell completion for a flag with a fixed set of values."""
    return [v for v in values if v.startswith(incomplete)]


def _complete_model(incomplete: str):
    from atlas_cli.completion import complete_models

    return complete_models(incomplete)


def _complete_downloaded(incomplete: str):
    from atlas_cli.completion import complete_downloaded

    return complete_downloaded(incomplete)


def _complete_device(incomplete: str):
    from atlas_cli.backend import DEVICES

    return choices(DEVICES, incomplete)


def _complete_variant_device(incomplete: str):
    from atlas_cli.hardware import DEVICE_CHOICES

    return choices(DEVICE_CHOICES, incomplete)


def model_argument(help: str = "Model name or path."):
    """A model argument that completes names (recipes, installed, embedded) in the shell."""
    return typer.Argument(help=help, autocompletion=_complete_model)


Model = Annotated[str | None, model_argument()]


def downloaded_argument(help: str):
    """A model argument that completes only what is in the store (what `rm` can delete)."""
    return typer.Argument(help=help, autocompletion=_complete_downloaded)


# -- where and how a model runs ----------------------------------------------------------------

Device = Annotated[
    str | None,
    typer.Option(
        help="cpu (on the quantized weights), cpu-ref (float32 reference), cuda, hip, or emu "
        "(our GPU kernels on a CPU emulator: slow, for checking) (default: ATLAS_DEVICE, else "
        "this machine's GPU if atlas can use it, else cpu).",
        autocompletion=_complete_device,
    ),
]
Threads = Annotated[
    int | None, typer.Option("-t", "--threads", min=1, help="CPU threads (default: all cores).")
]


# The store commands pick a recipe's variant for a device without running anything on it.
VariantDevice = Annotated[
    str | None,
    typer.Option(
        "--device",
        help="Pick variants for cpu, cuda or hip (default: detected, ATLAS_DEVICE).",
        autocompletion=_complete_variant_device,
    ),
]
CtxSize = Annotated[int | None, typer.Option("--ctx-size", help="Context length in tokens.")]
Draft = Annotated[
    int | None,
    typer.Option("--draft", min=0, help="Tokens to draft per step with the model's MTP head."),
]
KvType = Annotated[
    str | None,
    typer.Option(
        "--kv-type",
        help="KV cache: on cuda, hip and emu bf16, fp8 (E4M3) or f32 (default: the recipe's, "
        "bf16); on cpu f16 (default) or f32.",
        show_default=False,
    ),
]
NoSpeculative = Annotated[
    bool, typer.Option("--no-speculative", help="Turn speculative decoding off.")
]
Offline = Annotated[
    bool, typer.Option("--offline", help="Use only the local caches (also HF_HUB_OFFLINE=1).")
]
Json = Annotated[bool, typer.Option("--json", help="Print JSON.")]
KeepAlive = Annotated[
    str | None,
    typer.Option(
        "--keep-alive",
        metavar="DURATION",
        help="Keep the model loaded this long after the run (30s, 5m, 1h; 0: no). "
        "Default ATLAS_KEEP_ALIVE, else 5m.",
    ),
]

# -- generation --------------------------------------------------------------------------------

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
ReasoningBudget = Annotated[
    int | None,
    typer.Option(
        "--reasoning-budget",
        min=0,
        help="Tokens of thought before the model is made to answer (0: none; default: no limit).",
    ),
]
MaxTokens = Annotated[
    int, typer.Option("--max-tokens", "-n", min=1, help="Most tokens to generate.")
]
Stop = Annotated[list[str] | None, typer.Option(help="Stop at this text (repeatable).")]
System = Annotated[str | None, typer.Option(help="System prompt.")]
Verbose = Annotated[bool, typer.Option("--verbose", "-v", help="Print timing statistics.")]


Think = Annotated[
    str,
    typer.Option(
        help="Reasoning: on (shown), hidden (chat only) or off (ask the model not to think).",
        autocompletion=lambda incomplete: choices(("on", "hidden", "off"), incomplete),
    ),
]
