"""Token sampling: repetition and presence penalties, top-k, top-p, min-p, temperature, seeded
RNG.

The order follows llama.cpp's default sampler chain (penalties -> top-k -> top-p -> min-p ->
temperature -> draw); temperature 0 is greedy (argmax, after penalties). A grammar's mask
comes last, on a rejected draw only (see `Sampler.__call__`).

`SamplingParams` is the one home of the sampling fields and atlas's defaults (llama.cpp's).
Every layer that takes settings from a person or a recipe (CLI flags, `/set` in chat, an HTTP
request, a recipe's defaults) builds a `SamplingOverrides`; `overrides.over(recipe).params()` is
the one merge.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Protocol

import numpy as np

from atlas_cli.errors import UsageError

SEED_LIMIT = 2**64
# a penalty may push a logit past float32's range (repeat_penalty=1e-308): clip it back, so the
# softmax below never sees inf - inf
LOGIT_LIMIT = float(np.finfo(np.float32).max)
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty")

# field -> (its name in messages, accepts the value, what it must be)
RANGES = {
    "temperature": ("temperature", lambda v: v >= 0, ">= 0"),
    "top_k": ("top-k", lambda v: v >= 0, ">= 0 (0 disables it)"),
    "top_p": ("top-p", lambda v: 0 < v <= 1, "in (0, 1]"),
    "min_p": ("min-p", lambda v: 0 <= v < 1, "in [0, 1)"),
    "repeat_penalty": ("repeat penalty", lambda v: v > 0, "> 0"),
    "presence_penalty": ("presence penalty", lambda v: -2 <= v <= 2, "in [-2, 2]"),
    "seed": ("seed", lambda v: isinstance(v, int) and 0 <= v < SEED_LIMIT, "in 0..2^64-1"),
    "reasoning_budget": (
        "reasoning budget",
        lambda v: isinstance(v, int) and v >= 0,
        "a count of tokens >= 0",
    ),
}


def check_ranges(settings) -> None:
    """UsageError naming the first field of `settings` outside its range (None: not set)."""
    for field, (name, ok, must) in RANGES.items():
        value = getattr(settings, field)
        if value is None:
            continue
        if field in FLOAT_FIELDS and (
            not isinstance(value, int | float) or not math.isfinite(value)
        ):
            raise UsageError(f"{name} must be a finite number, got {value}")
        try:
            fine = not isinstance(value, bool) and ok(value)
        except TypeError:  # text where a number belongs
            fine = False
        if not fine:
            raise UsageError(f"{name} must be {must}, got {value!r}")


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    seed: int | None = None
    # tokens of thought before `</think>` is forced (backend/think_budget.py); None: no limit
    reasoning_budget: int | None = None

    def __post_init__(self):
        check_ranges(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class SamplingOverrides:
    """Sampling fields someone set; None means "not set here": the next layer decides."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    seed: int | None = None
    reasoning_budget: int | None = None

    def __post_init__(self):
        check_ranges(self)  # a bad flag fails before anything is loaded

    @classmethod
    def from_mapping(cls, values) -> SamplingOverrides:
        """The sampling fields of a mapping (a recipe's defaults, a saved chat); others ignored."""
        return cls(**{f.name: values.get(f.name) for f in fields(cls)})

    def set_fields(self) -> dict:
        return {
            f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None
        }

    def over(self, base: SamplingOverrides) -> SamplingOverrides:
        """These settings, with `base` filling the ones not set here."""
        return replace(base, **self.set_fields())

    def params(self) -> SamplingParams:
        """SamplingParams with atlas's defaults for whatever is still unset."""
        return SamplingParams(**self.set_fields())


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def __call__(
        self, logits: np.ndarray, history: Sequence[int] = (), constraint: TokenFilter | None = None
    ) -> int:
        """The next token. With a `constraint` (a grammar), a draw it rejects is drawn again
        from the logits masked to what it allows (backend/constraint.py says why)."""
        p = self.params
        logits = np.asarray(logits, dtype=np.float32)
        if p.repeat_penalty != 1.0 and len(history):
            logits = apply_repeat_penalty(logits, history[-p.repeat_last_n :], p.repeat_penalty)
        if p.presence_penalty and len(history):
            logits = apply_presence_penalty(logits, history[-p.repeat_last_n :], p.presence_penalty)
        token = self._draw(logits)
        if constraint is not None and not constraint.allows(token):
            token = self._draw(constraint.masked(logits))
        return token

    def uniforms(self, n: int) -> np.ndarray:
        """The uniform numbers of this sampler's next `n` draws (n float64 in [0, 1)), for a
        device sampler that must draw what this one would: numpy's `choice` with `p` takes one
        `random()` per draw and picks the first index whose normalised cdf exceeds it."""
        return self.rng.random(n)

    def _draw(self, logits: np.ndarray) -> int:
        p = self.params
        if p.greedy:
            return int(np.argmax(logits))
        ids, probs = filtered_distribution(logits, p.top_k, p.top_p, p.min_p, p.temperature)
        return int(ids[self.rng.choice(len(ids), p=probs)])


class TokenFilter(Protocol):
    """What the sampler asks of a grammar (backend.constraint.Constraint)."""

    def allows(self, token: int) -> bool: ...

    def masked(self, logits: np.ndarray) -> np.ndarray:
        """`logits` with every token the grammar forbids at -inf."""
        ...


def apply_repeat_penalty(logits: np.ndarray, recent: Sequence[int], penalty: float):
    """CTRL-style penalty (as llama.cpp and transformers): divide positive logits of tokens seen
    recently by `penalty`, multiply negative ones."""
    out = logits.copy()
    seen = np.unique(np.asarray(recent, dtype=np.int64))
    vals = out[seen].astype(np.float64)
    with np.errstate(over="ignore"):  # an overflow is clipped right here
        out[seen] = np.clip(
            np.where(vals > 0, vals / penalty, vals * penalty), -LOGIT_LIMIT, LOGIT_LIMIT
        )
    return out


def apply_presence_penalty(logits: np.ndarray, recent: Sequence[int], penalty: float):
    """OpenAI's and llama.cpp's presence penalty: subtract `penalty` once from the logit of
    every token seen recently, however often it was seen."""
    out = logits.copy()
    out[np.unique(np.asarray(recent, dtype=np.int64))] -= penalty
    return out


def filtered_distribution(
    logits: np.ndarray, top_k: int, top_p: float, min_p: float, temperature: float
) -> tuple[np.ndarray, np.ndarray]:
    """Candidate ids and their probabilities after top-k, top-p and min-p, at `temperature`."""
    k = logits.shape[0] if top_k <= 0 else min(top_k, logits.shape[0])
    ids = np.argpartition(-logits, k - 1)[:k] if k < logits.shape[0] else np.arange(len(logits))
    ids = ids[np.argsort(-logits[ids], kind="stable")]  # best first
    vals = logits[ids].astype(np.float64)
    probs = np.exp(vals - vals[0])
    probs /= probs.sum()
    if top_p < 1.0:
        # keep the smallest prefix whose mass reaches top_p
        keep = int(np.searchsorted(np.cumsum(probs), top_p) + 1)
        ids, vals, probs = ids[:keep], vals[:keep], probs[:keep]
    if min_p > 0:
        keep = probs >= min_p * probs[0]
        ids, vals = ids[keep], vals[keep]
    scaled = (vals - vals[0]) / temperature
    probs = np.exp(scaled)
    return ids, probs / probs.sum()
