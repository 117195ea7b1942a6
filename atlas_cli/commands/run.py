"""`atlas run`: one prompt in, a streamed reply out (ollama's `run`, llama.cpp's `llama-cli -p`).

The command reads the flags, asks a kept-alive worker first and prints; loading and answering
are `atlas_cli.run_service`'s, which the worker calls too.
"""

from __future__ import annotations

import json
import select
import sys
import time
from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import Annotated, Any

import typer

from atlas_cli.commands import chat
from atlas_cli.commands.options import (
    CtxSize,
    Device,
    Draft,
    Json,
    KeepAlive,
    KvType,
    MaxTokens,
    MinP,
    Model,
    NoSpeculative,
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
from atlas_cli.keepalive import client, keep_alive_seconds, registry
from atlas_cli.run_service import LoadSpec, RunRequest, reply
from atlas_cli.store.embedded import DEFAULT_MODEL
from atlas_cli.store.paths import existing_path

Prompt = Annotated[
    str | None,
    typer.Argument(help="The prompt; piped text is read too, and goes before the prompt."),
]
Raw = Annotated[
    bool, typer.Option("--raw", help="Send the prompt as is, without the chat template.")
]


def run(
    model: Model = None,
    prompt: Prompt = None,
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
    raw: Raw = False,
    json_output: Json = False,
    verbose: Verbose = False,
    device: Device = None,
    threads: Threads = None,
    ctx_size: CtxSize = None,
    draft: Draft = None,
    kv_type: KvType = None,
    no_speculative: NoSpeculative = False,
    offline: Offline = False,
    think: Think = "on",
    keep_alive: KeepAlive = None,
):
    """Generate a reply to one prompt, streamed as it is produced (no prompt at a terminal:
    a chat).

    The model stays loaded for --keep-alive (default 5m) in a background process, so the next
    run with the same model and options starts at once (`atlas ps`, `atlas stop`)."""
    model_name, prompt_text = split_model_and_prompt(model, prompt)
    at_terminal = stdin_is_a_terminal()
    if prompt_text is None and at_terminal and not (raw or json_output):
        # `atlas run MODEL` at a terminal, no prompt: a chat, as `ollama run MODEL` opens one
        return chat.chat(
            model=model_name, system=system, temperature=temperature, top_k=top_k, top_p=top_p,
            min_p=min_p, repeat_penalty=repeat_penalty, seed=seed, max_tokens=max_tokens,
            stop=stop, verbose=verbose, device=device, threads=threads, ctx_size=ctx_size,
            kv_type=kv_type, offline=offline, think=think,
        )  # fmt: skip
    if not at_terminal:
        prompt_text = with_piped_text(read_piped(prompt_text is not None), prompt_text)
    if not prompt_text or not prompt_text.strip():
        raise typer.BadParameter("give a prompt as an argument or on stdin")
    if think not in ("on", "off"):
        raise typer.BadParameter("run takes --think on or off (hidden is chat's)")
    hold_s = keep_alive_seconds(keep_alive)
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    sampling.update(repeat_penalty=repeat_penalty, seed=seed, reasoning_budget=reasoning_budget)
    request = RunRequest(
        prompt_text, system, raw, think, max_tokens, list(stop or []), sampling, not json_output
    )
    spec = LoadSpec(model_name, device, ctx_size, 0 if no_speculative else draft, kv_type,
                    offline or None, threads)  # fmt: skip
    t0 = time.perf_counter()
    key = registry.key_of(spec.key_fields()) if hold_s and registry.supported() else None
    if key and (why := registry.run_dir_problem()):
        typer.echo(f"atlas: no keep-alive: {why}", err=True)
        key = None
    record = client.run(key, asdict(request), write_out) if key else None
    if record is None and key:
        record = answer_on_a_new_worker(spec, request, key, hold_s)
    if record is not None:  # a kept-alive worker answered: nothing was loaded here
        stats, load_s = SimpleNamespace(**record), record["accepted_s"]
    else:  # no keep-alive, or the worker could not answer (it says why here, in one line)
        use_threads(threads)
        request.overrides()  # bad sampling values fail before the model loads
        loaded, _ = spec.open()
        load_s = time.perf_counter() - t0
        stats = reply(loaded, request, write_out)
    result = RunResult(model_name, stats, load_s, time.perf_counter() - t0, record is not None)
    if json_output:
        typer.echo(json.dumps(result.as_json(), ensure_ascii=False))
    elif verbose:
        typer.echo(result.stats_block(), err=True)


def answer_on_a_new_worker(spec: LoadSpec, request: RunRequest, key: str, hold_s: float):
    """Start the keep-alive worker and let it answer this run: it is loaded when the run ends,
    so the next run starts warm, and a run started meanwhile waits for this copy instead of
    loading its own. The model is found here first (a download shows its progress, a bad name
    or option fails in one line). The stats record, or None where no worker answered."""
    request.overrides()  # bad sampling values fail before anything starts
    spec.resolve()
    process = registry.start(spec.__dict__, hold_s, key)
    return client.run(key, asdict(request), write_out, starting=process or True)


def stdin_is_a_terminal() -> bool:
    return sys.stdin.isatty()


PIPE_WAIT_S = 1.0  # with a prompt argument, how long a silent stdin may keep a run waiting


def read_piped(have_prompt: bool) -> str:
    """What stdin (not a terminal) holds. With a prompt argument, a stdin that stays silent for
    PIPE_WAIT_S is left unread: a parent that keeps an idle pipe open (a service manager, a
    subprocess call without stdin) must not hang the run, as it hangs ollama."""
    if have_prompt:
        try:
            ready, _, _ = select.select([sys.stdin], [], [], PIPE_WAIT_S)
        except (OSError, ValueError):  # no file descriptor (a test's stdin): just read it
            ready = True
        if not ready:
            return ""
    return sys.stdin.read()


def with_piped_text(piped: str, prompt: str | None) -> str | None:
    """Piped text and a prompt argument combined as ollama combines them: the piped text
    first, then the prompt (`cat notes.txt | atlas run "When is the meeting?"`)."""
    if not piped.strip():
        return prompt
    if prompt is None:
        return piped
    return f"{piped.rstrip()}\n\n{prompt}"


def write_out(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def split_model_and_prompt(model: str | None, prompt: str | None) -> tuple[str, str | None]:
    """`atlas run "hello"` means the default model: one argument that is not a model name
    or an existing path is the prompt, unless it is one word that is nearly a model's name
    (`atlas run qwen3-8bb`): that is a typo, and answering it as a prompt would hide it."""
    if model is not None and prompt is None and not looks_like_model(model):
        refuse_near_model_name(model)
        return DEFAULT_MODEL, model
    return model or DEFAULT_MODEL, prompt


def looks_like_model(text: str) -> bool:
    from atlas_cli import recipes
    from atlas_cli.store.embedded import EMBEDDED

    if text.lower() in EMBEDDED or existing_path(text):
        return True
    if " " not in text and recipes.is_model_name(text):
        return True
    return " " not in text and text.endswith((".gguf", "/")) or text.startswith("hf.co/")


# How close (difflib's ratio) a one-word argument must be to a model name to be taken for a
# misspelt one. Measured on names and first prompts: "qwen3-8bb" 0.94, "lama3.2" 0.78,
# "llama3" 0.71 against "hello" 0.33, "summarize" 0.38, "qwen" and "smol" 0.73; a word with a
# digit in it reads as a name, so it needs less.
TYPO_CUTOFF = 0.75
TYPO_CUTOFF_WITH_DIGIT = 0.6


def near_model_names(word: str) -> list[str]:
    """Known model names (recipes and their aliases, embedded, installed) that `word` is
    nearly: its likely meaning when it is a typo. Empty for anything that is not one word.
    Reads the recipe files without their schema: this runs before a kept-alive model answers."""
    import difflib

    from atlas_cli import recipes
    from atlas_cli.completion import model_names

    if not word or any(c.isspace() for c in word):
        return []
    aliases = recipes.recipe_names()
    names = list(dict.fromkeys([*model_names(), *aliases]))
    cutoff = TYPO_CUTOFF_WITH_DIGIT if any(c.isdigit() for c in word) else TYPO_CUTOFF
    close = difflib.get_close_matches(word.lower(), names, n=3, cutoff=cutoff)
    # an alias stands for its recipe: name the recipe, once
    return list(dict.fromkeys(aliases.get(c, c) for c in close))[:2]


def refuse_near_model_name(word: str) -> None:
    """A ModelNotFoundError naming the close names, when `word` is nearly a model's name."""
    from atlas_cli.errors import ModelNotFoundError

    close = near_model_names(word)
    if close:
        raise ModelNotFoundError(
            f"model {word!r} does not exist; did you mean {' or '.join(close)}? "
            f"(to send it as a prompt: atlas run {DEFAULT_MODEL} {word!r})"
        )


@dataclass
class RunResult:
    model: str
    stats: Any  # backend.engine.GenerationStats
    load_s: float
    total_s: float
    kept_alive: bool = False  # answered by the keep-alive worker, not loaded in this process

    def as_json(self) -> dict[str, Any]:
        s = self.stats
        return {
            "model": self.model,
            "text": s.text,
            "finish_reason": s.finish_reason,
            "prompt_tokens": s.prompt_tokens,
            "cached_tokens": s.cached_tokens,  # of prompt_tokens: not evaluated, from the cache
            "completion_tokens": s.completion_tokens,
            "kept_alive": self.kept_alive,
            "timings": {
                "load_s": round(self.load_s, 4),
                "prompt_s": round(s.prompt_s, 4),
                "ttft_s": round(s.ttft_s, 4),
                "eval_s": round(s.eval_s, 4),
                "total_s": round(self.total_s, 4),
                "prompt_tokens_per_s": round(s.prompt_rate, 2),
                "eval_tokens_per_s": round(s.eval_rate, 2),
            },
            **({"speculative": self._speculative()} if s.draft_rounds else {}),
        }

    def _speculative(self) -> dict[str, Any]:
        s = self.stats
        return {
            "rounds": s.draft_rounds,
            "drafted": s.draft_tokens,
            "accepted": s.accepted_tokens,
            "mean_accepted_length": round(s.mean_accepted_length, 3),
        }

    def stats_block(self) -> str:
        """ollama's `--verbose` block, plus time to first token."""
        s = self.stats
        rows = [
            ("total duration", _dur(self.total_s)),
            ("load duration", _dur(self.load_s)),
            # as llama.cpp and ollama count it: the tokens evaluated, the cached ones apart
            ("prompt eval count", f"{s.prompt_tokens - s.cached_tokens} token(s)"),
            ("prompt cached", f"{s.cached_tokens} token(s)"),
            ("prompt eval duration", _dur(s.prompt_s)),
            ("prompt eval rate", f"{s.prompt_rate:.2f} tokens/s"),
            ("eval count", f"{s.completion_tokens} token(s)"),
            ("eval duration", _dur(s.eval_s)),
            ("eval rate", f"{s.eval_rate:.2f} tokens/s"),
            ("time to first token", _dur(s.ttft_s)),
        ]
        if s.draft_rounds:
            rows.append(
                (
                    "draft acceptance",
                    f"{s.mean_accepted_length:.2f} mean accepted length "
                    f"({s.accepted_tokens}/{s.draft_tokens} drafted tokens)",
                )
            )
        return "\n".join(f"{k + ':':22}{v}" for k, v in rows)


def _dur(seconds: float) -> str:
    return f"{seconds * 1000:.2f}ms" if seconds < 1 else f"{seconds:.3f}s"
