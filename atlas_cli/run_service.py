"""One prompt answered by a loaded model: the library under `atlas run` and its keep-alive worker.

`LoadSpec` says which model to load and how (and is the keep-alive worker's key); `RunRequest`
is one prompt and how to answer it (what a worker is sent); `reply` answers it with a loaded
model. The command (`commands/run.py`) and the worker (`keepalive/worker.py`) both call
`reply`, so a kept-alive answer is the in-process one, seed for seed. Light: the backend and
numpy are imported only when a model is opened or a request is answered.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from atlas_cli.errors import UsageError
from atlas_cli.store.paths import existing_path

NOT_IN_KEY = ("ATLAS_KEEP_ALIVE",)  # how long a worker stays, not what it computes


@dataclass(frozen=True)
class LoadSpec:
    """What decides which model a run loads and how: one keep-alive worker per distinct spec."""

    model: str
    device: str | None
    ctx_size: int | None
    draft: int | None
    kv_type: str | None
    offline: bool | None
    threads: int | None

    def key_fields(self) -> dict[str, Any]:
        """The spec as the worker key sees it: a path made absolute, and the ATLAS_*
        environment."""
        fields = dict(self.__dict__)
        if existing_path(self.model) is not None:
            fields["model"] = os.path.abspath(self.model)
        # every ATLAS_* setting may change what the model computes (device, threads, the CPU
        # path's activations and instruction set): a worker serves only the settings it has
        fields["env"] = {k: v for k, v in sorted(os.environ.items())
                         if k.startswith("ATLAS_") and k not in NOT_IN_KEY}  # fmt: skip
        return fields

    def resolve(self):
        """Find (or pull) the model: session.Resolved; a bad name or option fails here."""
        from atlas_cli import backend, session

        backend.check_kv_type(self.kv_type)  # before anything is downloaded or loaded
        return session.resolve(self.model, device=self.device, offline=self.offline)

    def open(self):
        """Resolve (or pull) and load the model: (model, session.Resolved)."""
        from atlas_cli import session

        resolved = self.resolve()
        loaded = session.load(
            resolved, ctx_size=self.ctx_size, draft=self.draft, kv_dtype=self.kv_type
        )
        if self.draft and loaded.engine.speculator is None:
            raise UsageError(
                f"--draft: {loaded.info.name} has no multi-token-prediction head to draft "
                "with; drop --draft"
            )
        return loaded, resolved


@dataclass(frozen=True)
class RunRequest:
    """One prompt and how to answer it (what a keep-alive worker is sent)."""

    prompt: str
    system: str | None
    raw: bool
    think: str
    max_tokens: int
    stop: list[str]
    sampling: dict[str, Any]  # the sampling flags as given, None where not set
    stream: bool  # write the text as it comes (else only the stats, for --json)

    def overrides(self):
        return given_sampling(**self.sampling)

    @classmethod
    def from_message(cls, fields: Any) -> RunRequest:
        """A request as a keep-alive client sent it, each field of its type (TypeError
        otherwise: the worker answers "malformed", and a bad value never reaches the model)."""
        if not isinstance(fields, dict):
            raise TypeError("a run request is an object")
        request = cls(**fields)
        types = {"prompt": str, "system": (str, type(None)), "raw": bool, "think": str,
                 "max_tokens": int, "stop": list, "sampling": dict, "stream": bool}  # fmt: skip
        for name, kind in types.items():
            value = getattr(request, name)
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise TypeError(f"{name} is {type(value).__name__}")
        if not all(isinstance(s, str) for s in request.stop) or request.max_tokens < 1:
            raise TypeError("stop holds text; max_tokens is at least 1")
        allowed = set(inspect.signature(given_sampling).parameters)
        if not set(request.sampling) <= allowed:
            raise TypeError(f"sampling takes {', '.join(sorted(allowed))}")
        return request


def given_sampling(
    temperature=None,
    top_k=None,
    top_p=None,
    min_p=None,
    repeat_penalty=None,
    seed=None,
    reasoning_budget=None,
):
    """The sampling options the user set, checked now (before any model loads); the rest come
    from the model's recipe, then atlas."""
    from atlas_cli.backend.sample import SamplingOverrides  # numpy: not for `atlas --help`

    return SamplingOverrides(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        repeat_penalty=repeat_penalty,
        seed=seed,
        reasoning_budget=reasoning_budget,
    )


def reply(loaded, request: RunRequest, write: Callable[[str], None]):
    """Answer `request` with a loaded model (here or in a keep-alive worker): its stats."""
    sampling = request.overrides()
    ids = prompt_ids(
        loaded, request.prompt, system=request.system, raw=request.raw, think=request.think
    )
    return generate(
        loaded,
        ids,
        request.max_tokens,
        request.stop,
        sampling,
        write=write if request.stream else None,
    )


def stats_record(stats) -> dict[str, Any]:
    """The GenerationStats fields a run reports, as plain values (sent by a worker)."""
    return {name: getattr(stats, name) for name in STATS_FIELDS}


# what `atlas run --json` and `--verbose` print (commands/run.py's RunResult reads them)
STATS_FIELDS = (
    "text", "finish_reason", "prompt_tokens", "cached_tokens", "completion_tokens", "prompt_s",
    "ttft_s", "eval_s", "prompt_rate", "eval_rate", "draft_rounds", "draft_tokens",
    "accepted_tokens", "mean_accepted_length",
)  # fmt: skip


def prompt_ids(model, prompt: str, *, system: str | None, raw: bool, think: str = "on"):
    """The prompt as token ids: as is with --raw, else through the chat template (with
    `--think off`, asking the model not to think, as chat does)."""
    if raw:
        return model.tokenizer.encode(prompt, add_special_tokens=True)
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": prompt})
    return model.chat_prompt(messages, **({"enable_thinking": False} if think == "off" else {}))


def generate(model, ids, max_tokens: int, stop: list[str], sampling, *, write=None):
    """Generate, handing the text to `write` as it comes (None: keep it in the stats only);
    the run's stats."""
    from atlas_cli.backend.engine import GenerationStats

    stats = GenerationStats()
    events = model.generate(ids, max_tokens=max_tokens, stop=stop, stats=stats, sampling=sampling)
    try:
        for event in events:
            if write and event.text:
                write(event.text)
    finally:
        events.close()
        if write and stats.completion_tokens:
            write("\n")
    return stats
