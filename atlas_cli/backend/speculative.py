"""Speculative decoding with the model's own multi-token-prediction (MTP) head (Qwen3.5/3.6).

Each round drafts K tokens with the MTP block, then runs the main model once over the sampled
token plus the K drafts. The caller keeps sampling from the main model's logits as usual: while
its token equals the next draft, the logits after it are already computed (no forward); at the
first difference the cache drops the unused draft positions (KV truncated; the linear-attention
state restored from the per-token trail recorded during the verify) and a new round starts.
Every emitted token is sampled from the main model's logits for exactly the tokens before it,
so the output is the one without speculation (greedy: identical; sampling: the same draws);
drafts only change how many tokens one forward yields.

MTP cache invariant: with n positions committed in the main cache, the MTP cache holds the pairs
(h_i, x_{i+1}) for i < n - 1, where h_i is the main model's final hidden state at position i.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DEFAULT_DRAFT = 2  # tokens drafted per round when the model has an MTP head


@dataclass
class SpeculationStats:
    rounds: int = 0  # verify forwards
    drafted: int = 0
    accepted: int = 0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens each verify forward yielded: accepted drafts plus the sampled token."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0


class MTPSpeculator:
    def __init__(self, engine, draft: int):
        self.engine = engine
        self.model = engine.model
        self.k = draft
        self.cache = self.model.new_mtp_cache(engine.context_length)
        self.stats = SpeculationStats()
        self.last_hidden: np.ndarray | None = None  # main hidden state at position length - 1
        self.window_start = 0  # the last forward's first position and its hidden states
        self.window: np.ndarray | None = None
        self.pending: list[tuple[int, np.ndarray]] = []  # (draft token, logits after it)

    # -- keeping the MTP cache in step with the main cache -------------------------------------

    def after_forward(self, ids: np.ndarray, start: int, hidden: np.ndarray) -> None:
        """The main model ran `ids` at positions start...: add the MTP pairs this completes."""
        if start == 0:
            pairs, tokens, first = hidden[:-1], ids[1:], 0
        else:
            # without the hidden state before `start` (a prefix reused after a cut), the first
            # new one stands in: it only affects draft quality, never the output
            prev = self.last_hidden if self.last_hidden is not None else hidden[0]
            pairs, tokens, first = np.concatenate([prev[None], hidden[:-1]]), ids, start - 1
        if len(tokens):
            self.cache.reserve(first + len(tokens))
            self.model.mtp_forward(pairs, tokens, self.cache, first)
            self.cache.length = first + len(tokens)
        self.last_hidden = hidden[-1]
        self.window_start, self.window = start, hidden

    def switch(self, cache) -> None:
        """Continue another sequence (the engine's prefix pool changed slots) whose MTP cache
        is `cache`; the hidden states kept from the last forward belong to the old one."""
        self.cache = cache
        self.pending = []
        self.last_hidden, self.window_start, self.window = None, 0, None

    def truncate(self, length: int) -> None:
        """The main cache now holds `length` positions."""
        self.pending = []
        self.cache.truncate(max(length - 1, 0))
        end = self.window_start + (0 if self.window is None else len(self.window))
        if self.window is not None and self.window_start < length <= end:
            self.last_hidden = self.window[length - 1 - self.window_start]
        elif length != end:
            self.last_hidden = None

    # -- the decode step -----------------------------------------------------------------------

    def step(self, token: int) -> np.ndarray:
        """As `Engine.step`: append `token`, return the next-token logits (V,)."""
        eng = self.engine
        if self.pending and self.pending[0][0] == token:
            _, logits = self.pending.pop(0)
            eng.cached_ids.append(token)
            self.stats.accepted += 1
            return logits
        n = len(eng.cached_ids)
        if eng.cache.length != n:  # drop the rejected drafts
            kept = eng.cache.truncate(n)
            assert kept == n, "the cache lost positions it recorded"
        self.truncate(n)
        drafts = self.draft(token, n)
        if eng.constraint is not None:  # a draft the grammar forbids would only be rejected
            drafts = drafts[: eng.constraint.valid_prefix(drafts)]
        trail = bool(drafts)
        if trail:
            eng.cache.start_trail()
        try:
            hidden = eng._forward(np.asarray([token, *drafts], dtype=np.int64), n)
        finally:
            if trail:
                eng.cache.stop_trail()
        logits = self.model.logits(hidden)
        eng.cached_ids.append(token)
        self.pending = list(zip(drafts, logits[1:], strict=True))
        self.stats.rounds += 1
        self.stats.drafted += len(drafts)
        return logits[0]

    def draft(self, token: int, n: int) -> list[int]:
        """Up to K greedy MTP drafts for the positions after `token` (which goes to position n)."""
        k = min(self.k, self.engine.context_length - n - 1)
        if k <= 0 or self.last_hidden is None:
            return []
        hidden, tok, pos = self.last_hidden, token, n - 1
        self.cache.reserve(n - 1 + k)
        drafts = []
        for _ in range(k):
            out = self.model.mtp_forward(hidden[None], np.asarray([tok]), self.cache, pos)
            self.cache.length = pos + 1
            tok = int(np.argmax(self.model.logits(out)[0]))
            drafts.append(tok)
            hidden, pos = out[0], pos + 1
        # these entries pair drafts with MTP states; the verify forward writes the real pairs
        self.cache.truncate(n - 1)
        return drafts
