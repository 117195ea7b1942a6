"""Fitting long agentic prompts into a small context (`--max-prompt-tokens`).

The rule, in order:
1. Keep the system prompt and the first user message (the task) always.
2. Drop the oldest history after them, one whole step at a time (an assistant message with its
   tool results), never splitting a tool call from its result. Dropping is sticky within a
   conversation and goes down to a low-water mark (3/4 of the cap), like an agent compacting
   its context: the following turns then share their prefix again until the next overflow,
   so prefix-cache reuse stays measurable.
3. If the newest step alone is still too long, cut every long message text of the kept steps
   (tool outputs, reasoning) to the same length, keeping its head and tail around a marker. The
   task is cut the same way only when cutting the steps cannot fit: an intact task keeps the
   prompt's long shared prefix.
4. If even that cannot fit, raise ContextOverflowError.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from atlas_cli.errors import ContextOverflowError

LOW_WATER = 0.75
MIN_TEXT_CHARS = 64
Messages = list[dict[str, Any]]
Counter = Callable[[Messages], int]


@dataclass(frozen=True)
class Fitted:
    messages: Messages
    tokens: int
    dropped_messages: int  # history messages left out
    truncated_to: int | None  # the per-message character cut, when one was needed


def _split(messages: Messages) -> tuple[Messages, list[Messages]]:
    """(system + first user message, the steps after them); a step starts at each assistant or
    later user message and carries the tool results that follow it."""
    head_len = next((i + 1 for i, m in enumerate(messages) if m["role"] == "user"), 0)
    head, steps = messages[:head_len], []
    for m in messages[head_len:]:
        if m["role"] == "tool" and steps:
            steps[-1].append(m)
        else:
            steps.append([m])
    return head, steps


def _join(head: Messages, steps: list[Messages]) -> Messages:
    return head + [m for step in steps for m in step]


def cut_text(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    marker = f"\n[... {len(text) - limit:,} characters cut ...]\n"
    keep = max(limit - len(marker), 0)
    return text[: keep - keep // 2] + marker + text[len(text) - keep // 2 :]


def _truncate(messages: Messages, limit: int, keep: int) -> Messages:
    """Cut the texts of every message from index `keep` on to `limit` characters."""
    out = list(messages[:keep])
    for m in messages[keep:]:
        m = dict(m)
        for key in ("content", "reasoning_content"):
            if isinstance(m.get(key), str):
                m[key] = cut_text(m[key], limit)
        out.append(m)
    return out


class PromptCapper:
    """One per conversation: remembers how many steps it dropped so far."""

    def __init__(self, max_tokens: int, count: Counter):
        self.max_tokens = max_tokens
        self.count = count
        self.dropped_steps = 0

    def fit(self, messages: Messages) -> Fitted:
        head, steps = _split(messages)
        keep_from = min(self.dropped_steps, max(len(steps) - 1, 0))
        candidate = _join(head, steps[keep_from:])
        tokens = self.count(candidate)
        if tokens > self.max_tokens and len(steps) - keep_from > 1:
            # the smallest drop that reaches the low-water mark (count falls as k grows)
            target = int(self.max_tokens * LOW_WATER)
            lo, hi = keep_from + 1, len(steps) - 1
            while lo < hi:
                mid = (lo + hi) // 2
                if self.count(_join(head, steps[mid:])) <= target:
                    hi = mid
                else:
                    lo = mid + 1
            keep_from = lo
            candidate = _join(head, steps[keep_from:])
            tokens = self.count(candidate)
        self.dropped_steps = keep_from
        dropped = sum(len(s) for s in steps[:keep_from])
        if tokens <= self.max_tokens:
            return Fitted(candidate, tokens, dropped, None)
        # cut the steps first; the task (after the system prompt) only if that is not enough
        for keep in (len(head), 1 if head and head[0]["role"] == "system" else 0):
            if self.count(_truncate(candidate, MIN_TEXT_CHARS, keep)) <= self.max_tokens:
                return self._truncate_to_fit(candidate, dropped, keep)
        raise ContextOverflowError(
            f"the prompt cannot be cut to {self.max_tokens:,} tokens (the system prompt, "
            "tools and one step need more); raise --max-prompt-tokens"
        )

    def _truncate_to_fit(self, messages: Messages, dropped: int, keep: int) -> Fitted:
        texts = [m.get(k) or "" for m in messages[keep:] for k in ("content", "reasoning_content")]
        longest = max(map(len, texts), default=0)
        lo, hi = MIN_TEXT_CHARS, max(longest, MIN_TEXT_CHARS)
        while lo < hi:  # the longest per-message cut that fits
            mid = (lo + hi + 1) // 2
            if self.count(_truncate(messages, mid, keep)) <= self.max_tokens:
                lo = mid
            else:
                hi = mid - 1
        fitted = _truncate(messages, lo, keep)
        return Fitted(fitted, self.count(fitted), dropped, lo)
