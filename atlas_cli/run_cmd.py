"""`atlas run`: one prompt in, a streamed reply out."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any

from atlas_cli.backend.engine import GenerationStats
from atlas_cli.errors import UsageError


def split_model_and_prompt(
    model: str | None, prompt: str | None, default: str
) -> tuple[str, str | None]:
    """`atlas run "hello"` means the default model: one argument that is not a model name
    or an existing path is the prompt."""
    from atlas_cli import store

    if model is not None and prompt is None and not looks_like_model(model, store):
        return default, model
    return model or default, prompt


def looks_like_model(text: str, store) -> bool:
    from atlas_cli import recipes

    if text.lower() in store.EMBEDDED or store.existing_path(text):
        return True
    if " " not in text and recipes.is_model_name(text):
        return True
    return " " not in text and text.endswith((".gguf", "/")) or text.startswith("hf.co/")


@dataclass
class RunResult:
    model: str
    stats: GenerationStats
    load_s: float
    total_s: float

    def as_json(self) -> dict[str, Any]:
        s = self.stats
        return {
            "model": self.model,
            "text": s.text,
            "finish_reason": s.finish_reason,
            "prompt_tokens": s.prompt_tokens,
            "completion_tokens": s.completion_tokens,
            "timings": {
                "load_s": round(self.load_s, 4),
                "prompt_s": round(s.prompt_s, 4),
                "ttft_s": round(s.ttft_s, 4),
                "eval_s": round(s.eval_s, 4),
                "total_s": round(self.total_s, 4),
                "prompt_tokens_per_s": round(s.prompt_rate, 2),
                "eval_tokens_per_s": round(s.eval_rate, 2),
            },
            **(
                {
                    "speculative": {
                        "rounds": s.draft_rounds,
                        "drafted": s.draft_tokens,
                        "accepted": s.accepted_tokens,
                        "mean_accepted_length": round(s.mean_accepted_length, 3),
                    }
                }
                if s.draft_rounds
                else {}
            ),
        }

    def stats_block(self) -> str:
        """ollama's `--verbose` block, plus time to first token."""
        s = self.stats
        rows = [
            ("total duration", _dur(self.total_s)),
            ("load duration", _dur(self.load_s)),
            ("prompt eval count", f"{s.prompt_tokens} token(s)"),
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


def run(
    model_name: str,
    prompt: str,
    *,
    system: str | None,
    raw: bool,
    sampling: dict[str, Any],
    max_tokens: int,
    stop: list[str],
    device: str,
    ctx_size: int | None,
    stream: bool,
    draft: int | None = None,
) -> RunResult:
    from atlas_cli.session import open_model

    t0 = time.perf_counter()
    model = open_model(model_name, device=device, ctx_size=ctx_size, draft=draft)
    if draft and model.engine.speculator is None:
        raise UsageError(
            f"--draft: {model.info.name} has no multi-token-prediction head to draft with; "
            "drop --draft"
        )
    load_s = time.perf_counter() - t0
    if raw:
        ids = model.tokenizer.encode(prompt, add_special_tokens=True)
    else:
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": prompt})
        ids = model.chat_prompt(messages)
    stats = GenerationStats()
    out = sys.stdout
    events = model.generate(ids, max_tokens=max_tokens, stop=stop, stats=stats, **sampling)
    try:
        for event in events:
            if stream and event.text:
                out.write(event.text)
                out.flush()
    finally:
        events.close()
        if stream and stats.completion_tokens:
            out.write("\n")
            out.flush()
    return RunResult(model_name, stats, load_s, time.perf_counter() - t0)
