"""The flags of `atlas bench`, each declared once as an `Annotated` alias.

Typer only: this module is imported for `atlas --help`, so nothing heavy belongs here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from atlas_cli.bench import mlperf_rules

# -- shared by the subcommands -----------------------------------------------------------------

Model = Annotated[str, typer.Argument(help="Model name or path.")]
Device = Annotated[
    str, typer.Option(help="cpu, cpu-ref (numpy float32 reference), cuda, hip or emu (emulator).")
]
CtxSize = Annotated[int | None, typer.Option("--ctx-size", help="Context length in tokens.")]
KvType = Annotated[
    str | None,
    typer.Option(
        "--kv-type",
        help="KV cache: bf16, fp8 or f32 on cuda, hip, emu; f16 or f32 on cpu.",
        show_default=False,
    ),
]
Threads = Annotated[int | None, typer.Option("-t", "--threads", help="CPU threads.")]
Baseline = Annotated[
    Path | None,
    typer.Option(help="Compare with this stored result; exit 1 on a regression.", dir_okay=False),
]
SaveBaseline = Annotated[
    Path | None, typer.Option("--save-baseline", help="Write this run's result here.")
]
Tolerance = Annotated[
    float, typer.Option(help="Allowed regression before the gate fails (0.10 = 10%).")
]

# -- throughput (llama-bench's flags) ----------------------------------------------------------

NPrompt = Annotated[
    str, typer.Option("-p", "--n-prompt", help="Prompt lengths (comma list; 0: none).")
]
NGen = Annotated[
    str, typer.Option("-n", "--n-gen", help="Generation lengths (comma list; 0: none).")
]
PromptGen = Annotated[
    list[str] | None,
    typer.Option("-pg", "--pg", help="Prompt+generation test PROMPT,GEN (repeatable)."),
]
NDepth = Annotated[
    str, typer.Option("-d", "--n-depth", help="Context depths to run at (comma list).")
]
Repetitions = Annotated[int, typer.Option("-r", "--repetitions", help="Timed runs.")]
ThreadList = Annotated[
    str | None, typer.Option("-t", "--threads", help="CPU threads (comma list).")
]
TableOutput = Annotated[str, typer.Option("-o", "--output", help="md, json, jsonl or csv.")]
Warmup = Annotated[bool, typer.Option(help="Run each test once untimed first.")]

# -- agentic replay ----------------------------------------------------------------------------

ServedModel = Annotated[
    str, typer.Argument(help="Model name or path (with --url: the name sent to the server).")
]
# where the trajectories come from: not shipped (Apache-2.0 data of MLCommons')
TRAJECTORIES_SOURCE = (
    "https://github.com/mlcommons/endpoints, "
    "examples/11_Edge_Agentic_Example/agentic_coding_2.5h.jsonl"
)
Trajectories = Annotated[
    Path | None,
    typer.Option(
        help=f"MLPerf Edge Agentic trajectory file (JSONL), from {TRAJECTORIES_SOURCE}.",
        dir_okay=False,
    ),
]
LimitConversations = Annotated[
    int | None, typer.Option(help="Replay only the first N conversations.")
]
SEED_SET = mlperf_rules.ROUND
MlperfSeeds = Annotated[
    str,
    typer.Option(
        "--seeds",
        help="MLPerf seed set: v6.1 (request seed 42, dataloader and scheduler seeds of "
        "mlperf.conf) or legacy (42 everywhere).",
    ),
]
MinDuration = Annotated[
    float | None,
    typer.Option(
        help="Repeat the replay until it has run this many seconds (MLPerf: 600). "
        "Default: 600 for the whole dataset, 0 with --limit-*.",
        show_default=False,
    ),
]
LimitTurns = Annotated[
    int | None, typer.Option(help="Replay only the first N requests of each conversation.")
]
MaxPromptTokens = Annotated[
    int | None,
    typer.Option(
        help="Cap each prompt (drop the oldest steps, then cut long texts). Default "
        "in-process: the context minus --max-tokens."
    ),
]
MAX_NEW_TOKENS = 1024  # per request; the --max-tokens default
BFCL_MAX_TOKENS = 512  # BFCL sends no limit; the longest right answers here are ~300 tokens
BFCL_TIMEOUT_S = 600  # per answer; one that takes longer is a protocol error
MaxTokens = Annotated[int, typer.Option(help="Most new tokens per request.")]
Url = Annotated[
    str | None, typer.Option(help="Replay against this OpenAI-compatible server instead.")
]
ApiKey = Annotated[
    str | None, typer.Option(help="Bearer token for --url (default: $OPENAI_API_KEY).")
]
PrefixCache = Annotated[
    bool, typer.Option(help="Reuse the previous request's KV cache (in-process).")
]
ColdTtft = Annotated[
    bool, typer.Option(help="Also time each prompt from an empty cache (one more prefill).")
]
ToolFormat = Annotated[
    str,
    typer.Option(
        help="How tool calls reach the model: native (the chat template's tools support), "
        "text (<tool_call> JSON in the content) or auto (native when the template has it)."
    ),
]
ReportOutput = Annotated[str, typer.Option("-o", "--output", help="md or json on stdout.")]
OutputFile = Annotated[
    Path | None, typer.Option("--output-file", help="Also write the JSON result here.")
]
PerTurn = Annotated[bool, typer.Option(help="Print one row per request too.")]

# -- coherence ---------------------------------------------------------------------------------

AnswerTokens = Annotated[
    int | None, typer.Option(help="Token limit per answer (facts: 64; first-chat: 512).")
]
ProbeSet = Annotated[
    str,
    typer.Option(
        "--set",
        help="facts: temperature 0, facts checked; first-chat: first questions, sampled "
        "with the recipe's chat defaults over --seeds seeds.",
    ),
]
Seeds = Annotated[int, typer.Option(min=1, help="Seeds per prompt for sampled sets.")]

# -- bfcl --------------------------------------------------------------------------------------

BfclUrl = Annotated[
    str | None,
    typer.Option(help="Ask this OpenAI-compatible server instead of atlas serve in-process."),
]
BfclMode = Annotated[
    str,
    typer.Option(
        help="fc: the functions as OpenAI `tools` (function calling); prompt: BFCL's system "
        "prompt asks for Python calls in the text."
    ),
]
ToolChoice = Annotated[
    str, typer.Option(help="tool_choice sent in fc mode: auto (as clients send) or required.")
]
Categories = Annotated[
    str | None,
    typer.Option(help="Comma list of BFCL categories (default: all single-turn Python ones)."),
]
Limit = Annotated[int | None, typer.Option(help="Only the first N cases of each category.")]
BfclMaxTokens = Annotated[int, typer.Option(help="Most new tokens per answer.")]
AnswerTimeout = Annotated[
    float, typer.Option(help="Seconds to wait for one answer; a later one is a protocol error.")
]
BfclResume = Annotated[
    Path | None,
    typer.Option(
        "--resume",
        help="Keep the answers this result file holds, ask the rest, and write the result "
        "back to it after every case: an interrupted run goes on with the same command.",
    ),
]
MlperfSet = Annotated[
    bool,
    typer.Option(
        "--mlperf",
        help="MLPerf Edge Agentic's BFCL set (995 cases of non_live, live and hallucination "
        "at 62/10/10%) scored as its harness does: overall and category-balanced accuracy.",
    ),
]
MlperfRule = Annotated[
    bool,
    typer.Option(
        "--mlperf-rule",
        help="Gate as MLPerf does: overall accuracy at least 97% of the baseline's "
        "(instead of every category within --tolerance).",
    ),
]
