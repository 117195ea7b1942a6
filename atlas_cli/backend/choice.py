"""`tool_choice: auto` for a model that has no tool-call syntax of its own: call or reply,
decided by the model's own likelihoods, calibrated against a content-free question.

A lazy grammar (free text until the call's opening tag) leaves the choice to the first token,
and a model that never saw the tag in training (SmolLM2-135M: its template renders no tools)
almost never writes it first, whatever it was asked. A fixed reply marker moves the choice
onto the marker's wording instead (the marker's prior decides, not the question). So the
question is asked the way "Calibrate Before Use" (Zhao et al., 2021) asks a classifier: how
much more likely does *this* question make the opening tag than a content-free one ("N/A")
in the same prompt, against how much more likely it makes not opening it. The likelier side
after that correction wins: a question the tools answer raises P(tag) above its prior; one
they do not leaves it at or below it. Cost: the content-free prompt's suffix (its system
prompt and tools are the real prompt's prefix, already cached) and one short forward per
token of the tag, on both prompts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

CONTENT_FREE = "N/A"  # Zhao et al.'s content-free input: no question, same prompt around it


@dataclass(frozen=True)
class Choice:
    call: bool
    log_p: float  # log P(opening | the question)
    log_p_null: float  # log P(opening | the content-free question)
    cached_tokens: int = 0  # prompt tokens the first prefill found in the prefix pool

    @property
    def margin(self) -> float:
        """Calibrated call-vs-reply score: > 0 means call."""
        return _calibrated_margin(self.log_p, self.log_p_null)


def opening_logprob(engine, ids: Sequence[int], opening: Sequence[int]) -> tuple[float, int]:
    """log P(`opening` follows `ids`), by one prefill and one resumed forward per further
    token (through the engine's prefix pool, so any model and cache kind works); and how
    many of `ids` the prefill found cached."""
    ids, total, cached = list(ids), 0.0, 0
    for k, token in enumerate(opening):
        logits, reused = engine.prefill(ids + list(opening[:k]))
        cached = reused if k == 0 else cached
        total += float(_log_softmax(logits)[token])
    return total, cached


def choose_call(
    engine, ids: Sequence[int], null_ids: Sequence[int], opening: Sequence[int]
) -> Choice:
    """Whether the answer to `ids` should open with `opening` (a call) or not (a reply):
    see the module docstring. `null_ids`: the same prompt with the question content-free."""
    log_p, cached = opening_logprob(engine, ids, opening)
    home, before = engine.pool.current, list(engine.pool.slots)
    log_p_null, _ = opening_logprob(engine, null_ids, opening)
    if all(engine.pool.current is not s for s in before):  # forked for this prompt only
        engine.return_to(home)
    margin = _calibrated_margin(log_p, log_p_null)
    return Choice(margin > 0, log_p, log_p_null, cached)


def _calibrated_margin(log_p: float, log_p_null: float) -> float:
    """[log P(call) - log P0(call)] - [log P(reply) - log P0(reply)], P(reply) = 1 - P(call)."""
    return (log_p - log_p_null) - (_log1m_exp(log_p) - _log1m_exp(log_p_null))


def _log1m_exp(x: float) -> float:
    """log(1 - exp(x)) for x <= 0, accurate near both ends."""
    if x >= 0:
        return -math.inf
    return math.log(-math.expm1(x)) if x > -0.693 else math.log1p(-math.exp(x))


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max()
    return x - math.log(float(np.exp(x).sum()))
