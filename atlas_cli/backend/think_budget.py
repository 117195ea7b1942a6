"""A reasoning budget: after N tokens of thought the model is made to close its `<think>` block
and answer (`--reasoning-budget`, OpenAI's `reasoning_effort`, Anthropic's
`thinking.budget_tokens`).

The thought is counted from `<think>`, generated or opened by the prompt (Qwen3.5's template
ends its generation prompt inside one), to `</think>`. When the count reaches the budget the
next tokens are forced to `</think>` and the blank line templates put after it: the logits
of every other token are pushed far below (finite: a device sampler takes them as they are),
so whatever picks the token, on the host or on a device, picks the forced one, and a grammar
that leaves reasoning free accepts it.
"""

from __future__ import annotations

from collections.abc import Sequence

OPEN, CLOSE = "<think>", "</think>"
AFTER_CLOSE = "\n\n"  # what Qwen3's and Qwen3.5's templates put between thought and answer
FORCED_LOGIT = -1e30  # every token but the forced one: exp() of it is 0, and it stays finite
# OpenAI's reasoning_effort as budgets (tokens of thought): none thinks not at all
EFFORT_BUDGETS = {"none": 0, "minimal": 256, "low": 1024, "medium": 4096, "high": None}


class ThinkBudget:
    def __init__(self, open_id: int, close_ids: list[int], budget: int):
        self.open_id = open_id
        self.close_ids = close_ids
        self.budget = budget
        self.thinking = False  # inside a <think> block now
        self.count = 0  # tokens of thought so far
        self.forcing: list[int] = []  # the closing tokens still to come

    @classmethod
    def start(cls, tokenizer, prompt: Sequence[int], budget: int | None) -> ThinkBudget | None:
        """The budget for a reply to `prompt`; None when there is none, or the model's
        vocabulary has no `<think>` / `</think>` tokens to count or force."""
        if budget is None:
            return None
        backend = getattr(tokenizer, "backend", None)
        open_id = backend.token_to_id(OPEN) if backend is not None else None
        close_id = backend.token_to_id(CLOSE) if backend is not None else None
        if open_id is None or close_id is None:
            return None
        after = tokenizer.encode(AFTER_CLOSE, add_special_tokens=False)
        tail = [t for t in prompt[-4:] if tokenizer.decode([t]).strip()]  # newlines aside
        state = cls(open_id, [close_id, *after], budget)
        if tail and tail[-1] == open_id:  # the prompt opened the thought
            state._open()
        return state

    def around(self, pick):
        """`pick` (the engine's token picker) steered by this budget."""

        def steered(logits, history, n):
            token = pick(self.steer(logits), history, n)
            self.seen(token)
            return token

        return steered

    def steer(self, logits):
        """`logits`, or, while the close is being forced, logits that allow only its next
        token (a copy: the model's own are left as they are)."""
        if not self.forcing:
            return logits
        forced = logits.copy()
        forced.fill(FORCED_LOGIT)
        forced[self.forcing[0]] = 0.0
        return forced

    def _open(self) -> None:
        """A thought begins (a budget of 0 closes it at once)."""
        self.thinking, self.count = True, 0
        if self.budget == 0:
            self.forcing = list(self.close_ids)

    def seen(self, token: int) -> None:
        """Count a generated token; start forcing once the thought reaches the budget."""
        if self.forcing:
            if token == self.forcing[0]:
                self.forcing.pop(0)
            else:  # a sampler that ignored the logits: stop forcing rather than loop
                self.forcing = []
            if token == self.close_ids[0]:
                self.thinking = False
            return
        if not self.thinking:
            if token == self.open_id:
                self._open()
            return
        if token == self.close_ids[0]:
            self.thinking = False
            return
        self.count += 1
        if self.count >= self.budget:
            self.forcing = list(self.close_ids)
