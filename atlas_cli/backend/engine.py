"""Generation: prefill, cached decode, sampling, stop conditions and streaming text.

One `Engine` holds one model and runs one stream at a time. Its caches outlive a request: a
pool of cached sequences (backend/prefix_pool.py) sends each prompt to the one that shares
the longest prefix with it, so interleaved conversations each prefill only their new suffix.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from atlas_cli.backend.cache import Cache
from atlas_cli.backend.choice import Choice, choose_call
from atlas_cli.backend.constraint import Constraint
from atlas_cli.backend.models.base import BaseModel
from atlas_cli.backend.ops.native.sample import NONFINITE, ChainSettings
from atlas_cli.backend.prefix_disk import SHUTDOWN_SPILL_S, PrefixDisk, weights_digest
from atlas_cli.backend.prefix_pool import (
    RUN_BUDGET,
    PrefixPool,
    Slot,
    boundaries,
    default_budget,
    fingerprint,
    message_start_ids,
    read_slot,
    save_slot,
)
from atlas_cli.backend.sample import Sampler, SamplingParams
from atlas_cli.backend.think_budget import ThinkBudget
from atlas_cli.backend.tokenizer import TextTokenizer
from atlas_cli.errors import ContextOverflowError, CorruptModelError, SlotError

# Prompt tokens per prefill forward on the CPU backends: numpy_ref and cpu.fast materialise
# each layer's attention scores, (heads, T, S) float32, and 256 bounds them. The native ops
# name their own (WeightLaunchers.PREFILL_CHUNK in ops/native/weights.py).
PREFILL_CHUNK = 256


@dataclass(frozen=True)
class TokenEvent:
    token: int
    text: str  # the decoded text this token completes ("" while a character is still partial)


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    completion_tokens: int = 0
    finish_reason: str = "length"  # "stop" | "length" | "interrupted"
    prompt_s: float = 0.0
    ttft_s: float = 0.0
    eval_s: float = 0.0
    total_s: float = 0.0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    draft_rounds: int = 0  # speculative decoding: verify forwards, drafted and accepted tokens
    draft_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verify forward (accepted drafts + 1); 0 without speculation."""
        if not self.draft_rounds:
            return 0.0
        return (self.accepted_tokens + self.draft_rounds) / self.draft_rounds

    @property
    def prompt_rate(self) -> float:
        new = self.prompt_tokens - self.cached_tokens
        return new / self.prompt_s if self.prompt_s > 0 else 0.0

    @property
    def eval_rate(self) -> float:
        # the first token comes out of the prefill; decode rate counts the ones after it
        n = self.completion_tokens - 1
        return n / self.eval_s if n > 0 and self.eval_s > 0 else 0.0


class IncrementalDecoder:
    """Turns a token stream into text without ever emitting half a UTF-8 character.

    Decodes a short window of recent tokens and emits only text that no longer ends in U+FFFD
    (the mark of an incomplete byte sequence), as vLLM and TGI do.
    """

    def __init__(self, tokenizer: TextTokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # window start
        self.read = 0  # tokens already turned into emitted text

    def push(self, token: int) -> str:
        self.ids.append(token)
        done = self.tokenizer.decode(self.ids[self.prefix : self.read])
        full = self.tokenizer.decode(self.ids[self.prefix :])
        if len(full) > len(done) and not full.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return full[len(done) :]
        return ""

    def flush(self) -> str:
        done = self.tokenizer.decode(self.ids[self.prefix : self.read])
        full = self.tokenizer.decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return full[len(done) :]


class StopMatcher:
    """Holds back text that might be the start of a stop string; cuts at the first match."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.hit = False

    def feed(self, text: str) -> str:
        if not self.stops:
            return text
        self.pending += text
        cut = min((i for i in (self.pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.hit = True
            out, self.pending = self.pending[:cut], ""
            return out
        hold = max(
            (k for s in self.stops for k in range(1, len(s)) if self.pending.endswith(s[:k])),
            default=0,
        )
        out = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(out) :]
        return out

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def check_finite(logits: np.ndarray, generated: int) -> None:
    """Stop on NaN or Inf logits: no sampler can draw from them, and a model that makes them
    has broken weights (max and min carry any NaN or Inf, without a temporary array)."""
    logits = np.asarray(logits)
    if np.isfinite(logits.max()) and np.isfinite(logits.min()):
        return
    raise nonfinite_error(generated)


def nonfinite_error(generated: int) -> CorruptModelError:
    return CorruptModelError(
        f"the model produced NaN or Inf logits (after {generated} generated tokens): its weights "
        "are probably corrupt or mis-quantised; download the model again or try another "
        "quantisation"
    )


TokenPicker = Callable[[Any, list[int], int], int]  # (logits, history, generated) -> token


def host_picker(params: SamplingParams, constraint: Constraint | None) -> TokenPicker:
    """The CPU Sampler on logits brought to the host, after the finite check."""
    sampler = Sampler(params)

    def pick(logits, history: list[int], generated: int) -> int:
        check_finite(logits, generated)
        return sampler(logits, history, constraint)

    return pick


def device_picker(
    ops, params: SamplingParams, prompt: list[int], draws: int, decoder=None, constraint=None
) -> TokenPicker:
    """sample.cu's whole chain on the device logits of a NativeOps model (the finite check
    included), drawing the uniforms the CPU Sampler would draw: the same seed gives the same
    tokens. One launch and an 8-byte readback per token. With a fused device `decoder` the
    token is also copied into its input on the device, so the next step uploads nothing. With
    a `constraint`, a draw it rejects is drawn again on the device from its mask (as Sampler
    does on the host), so a token may take two of the uniforms."""
    uniforms = Sampler(params).uniforms(0 if params.greedy else draws * (2 if constraint else 1))
    target = decoder.token if decoder is not None else None
    device = ops.device_sampler(ChainSettings.of(params), prompt, uniforms, target)

    def pick(logits, history: list[int], generated: int) -> int:
        token, flag = device(logits)
        if flag == 0 and constraint is not None and not constraint.allows(token):
            token, flag = device.redraw(logits, constraint.mask())
        if flag == NONFINITE:
            raise nonfinite_error(generated)
        assert flag == 0, f"device sampler flag {flag}"
        if decoder is not None:
            decoder.token_from_device(token)
        return token

    return pick


class Engine:
    def __init__(
        self,
        model: BaseModel,
        tokenizer: TextTokenizer,
        context_length: int,
        draft: int | None = None,
        cache_bytes: int | None = None,
    ):
        """`draft`: tokens to draft per step with the model's MTP head (speculative decoding);
        None picks a default when the model has one, 0 turns speculation off. `cache_bytes`:
        the prefix pool's budget (None: `RUN_BUDGET`, or a quarter of the memory available
        now where that is less; 0: keep only the sequence in use)."""
        self.model = model
        self.tokenizer = tokenizer
        self.context_length = context_length
        budget = default_budget(RUN_BUDGET) if cache_bytes is None else cache_bytes
        self.pool = PrefixPool(lambda: model.new_cache(context_length), budget)
        self.disk: PrefixDisk | None = None  # conversations kept on disk (`keep_on_disk`)
        self.message_starts = message_start_ids(tokenizer)  # where prefill checkpoints
        self.speculator = None
        self.constraint: Constraint | None = None  # the grammar of the answer in progress
        if model.has_mtp:
            from atlas_cli.backend.speculative import DEFAULT_DRAFT, MTPSpeculator

            draft = DEFAULT_DRAFT if draft is None else draft
            if draft > 0:
                self.speculator = MTPSpeculator(self, draft)
                self.pool.current.mtp = self.speculator.cache

    @property
    def cache(self) -> Cache:
        """The cache of the sequence in use."""
        return self.pool.current.cache

    @property
    def cached_ids(self) -> list[int]:
        """The tokens whose state is in `cache`."""
        return self.pool.current.ids

    @cached_ids.setter
    def cached_ids(self, ids: list[int]) -> None:
        self.pool.current.ids = ids

    # -- the raw forward ---------------------------------------------------------------------

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Logits (T, V) float32 for a fresh sequence (the cache is reset)."""
        ids = np.asarray(token_ids, dtype=np.int64)
        self._check_fits(len(ids))
        self.reset()
        out = []
        step = self.prefill_chunk
        for start in range(0, len(ids), step):
            chunk = ids[start : start + step]
            out.append(self.model.logits(self._forward(chunk, start)))
        self.cached_ids = list(token_ids)
        return np.concatenate(out).astype(np.float32, copy=False)

    def reset(self) -> None:
        """Forget every cached sequence."""
        self.pool.clear()
        if self.speculator is not None:
            self.speculator.truncate(0)

    @property
    def prefill_chunk(self) -> int:
        """Prompt tokens per forward: the model's ops' own number, else the CPU backends'."""
        chunk = self.model.ops.PREFILL_CHUNK
        return chunk if chunk is not None else PREFILL_CHUNK

    def _forward(self, ids: np.ndarray, start: int) -> np.ndarray:
        self.cache.reserve(start + len(ids))
        hidden = self.model.forward(ids, self.cache, start)
        self.cache.length = start + len(ids)
        if self.speculator is not None:
            self.speculator.after_forward(ids, start, hidden)
        return hidden

    def _check_fits(self, n: int) -> None:
        if n > self.context_length:
            raise ContextOverflowError(
                f"the prompt is {n:,} tokens but the context holds {self.context_length:,}; "
                + (
                    "shorten the prompt or raise --ctx-size (up to the model's limit)"
                    if self.can_grow
                    else "shorten the prompt (that is the model's limit)"
                )
            )

    @property
    def can_grow(self) -> bool:
        """Whether a larger --ctx-size is possible: the model's own limit is further."""
        limit = getattr(getattr(self.model, "args", None), "max_position_embeddings", None)
        return limit is None or self.context_length < limit

    def prefill(self, ids: list[int]) -> tuple[np.ndarray, int]:
        """Bring a cache to `ids` and return the last position's logits and how many prompt
        tokens were reused from the prefix pool."""
        self._check_fits(len(ids))
        if self.disk is not None:
            self._resume_from_disk(ids)
        # recompute at least the last token for its logits
        previous = self.pool.current
        slot, common = self.pool.choose(ids, len(ids) - 1)
        if self.speculator is not None and slot is not previous:
            self._switch_mtp(slot)
        # a linear-attention state cannot be cut anywhere: `choose` kept what it can return to
        common = self.cache.truncate(common)
        self.cached_ids = self.cached_ids[:common]
        if self.speculator is not None:
            self.speculator.truncate(common)
        slot.prompt_len = len(ids)
        arr = np.asarray(ids, dtype=np.int64)
        start = common
        # restart points at message starts, and just before the last prompt token: the same
        # prompt again, or one that shares it and then differs inside this reply, resumes there
        for stop in [*boundaries(ids, common, len(ids) - 1, self.message_starts), len(ids) - 1]:
            for pos in range(start, stop, self.prefill_chunk):
                self._forward(arr[pos : min(pos + self.prefill_chunk, stop)], pos)
            start = stop
            self.cache.checkpoint()
        hidden = self._forward(arr[-1:], len(ids) - 1)
        self.cached_ids = list(ids)
        self.pool.trim()
        return self.model.logits(hidden)[0], common

    def _switch_mtp(self, slot: Slot) -> None:
        if slot.mtp is None:
            slot.mtp = self.model.new_mtp_cache(self.context_length)
        self.speculator.switch(slot.mtp)

    # -- saved slots (llama-server's /slots) ---------------------------------------------------

    def slots(self) -> list[dict]:
        return [
            {
                "id": s.id,
                "n_ctx": self.context_length,
                "n_tokens": len(s.ids),
                "n_prompt_tokens": s.prompt_len,
                "bytes": s.nbytes,
                "current": s is self.pool.current,
            }
            for s in sorted(self.pool.slots, key=lambda s: s.id)
        ]

    def save_slot(self, slot_id: int, path: Path) -> tuple[int, int]:
        """Write a slot to `path`; returns (tokens, bytes written)."""
        slot = self._settled(self.pool.get(slot_id))
        return len(slot.ids), save_slot(slot, path, fingerprint(self.model))

    @staticmethod
    def _settled(slot: Slot) -> Slot:
        """`slot` with its caches holding exactly its tokens (a verify's rejected draft
        positions are still recorded in the trail)."""
        n = len(slot.ids)
        if slot.cache.length > n:
            slot.cache.truncate(n)
        if slot.mtp is not None:
            slot.mtp.truncate(max(n - 1, 0))
        return slot

    def restore_slot(self, slot_id: int, path: Path) -> tuple[int, int]:
        """Load a saved slot as slot `slot_id` (replacing it); returns (tokens, bytes read).
        The next prompt that extends it prefills only its new suffix."""
        # a file larger than the pool could not stay in it: refused before it is read
        found = read_slot(path, fingerprint(self.model), self.pool.budget)
        cache, mtp, ids, prompt_len = self._caches_from(found, path.name)
        was_current = any(s.id == slot_id and s is self.pool.current for s in self.pool.slots)
        slot = self.pool.add(cache, ids, slot_id)
        slot.prompt_len, slot.mtp = prompt_len, mtp
        if was_current:
            self.pool.current = slot
            if self.speculator is not None:
                self._switch_mtp(slot)
        self.pool.trim()
        return len(ids), path.stat().st_size

    def _caches_from(self, found, name: str) -> tuple[Cache, Cache | None, list[int], int]:
        """A slot file's contents (`read_slot`) in new caches: (cache, MTP cache, tokens,
        prompt length); SlotError when they do not fit this model."""
        meta, arrays, mtp_arrays, ids = found
        cache = self.model.new_cache(self.context_length)
        mtp = self.model.new_mtp_cache(self.context_length) if self.speculator else None
        try:
            cache.load(arrays)
            if mtp is not None and mtp_arrays:
                mtp.load(mtp_arrays)
        except (ValueError, TypeError) as exc:
            raise SlotError(f"{name} does not fit this model's cache ({exc})") from None
        if cache.length != len(ids) or not 0 <= int(meta.get("prompt_len", -1)) <= len(ids):
            raise SlotError(f"{name} is inconsistent: its tokens and cache disagree")
        return cache, mtp, ids, int(meta["prompt_len"])

    # -- the prefix cache on disk (backend/prefix_disk.py) ------------------------------------

    def keep_on_disk(self, folder: Path, quota: int, source: Path) -> None:
        """Write evicted conversations (and every cached one at `spill_all`) under `folder`,
        within `quota` bytes, and resume prompts from there; `source`: the weights file or
        folder the entries are bound to."""
        model_id = f"{fingerprint(self.model)}-{weights_digest(source)}"
        self.disk = PrefixDisk(folder, quota, model_id)
        self.pool.on_evict = lambda slot: self.disk.spill(self._settled(slot))

    def spill_all(self, seconds: float = SHUTDOWN_SPILL_S) -> None:
        """Write the cached conversations to disk, most recent first (that one always), for
        about `seconds` (a server or worker stopping: whoever stops it may not wait long)."""
        if self.disk is None:
            return
        deadline = time.monotonic() + seconds
        self.disk.flush(seconds)  # the evictions' writes first
        for i, slot in enumerate(sorted(self.pool.slots, key=lambda s: s.used, reverse=True)):
            if i and time.monotonic() > deadline:
                break
            self.disk.spill(self._settled(slot), wait=True)

    def _resume_from_disk(self, ids: list[int]) -> None:
        """Bring the conversation on disk that keeps more of `ids` than any in memory into
        the pool (where `choose` then takes it)."""
        limit = len(ids) - 1
        in_memory = self.pool.best_reuse(ids, limit)
        found = self.disk.lookup(ids, limit)
        if found is None or found[1] <= in_memory:
            return
        path, common = found
        contents = self.disk.read(path)
        if contents is None:
            return
        try:
            cache, mtp, saved_ids, _ = self._caches_from(contents, path.name)
        except SlotError as exc:
            self.disk.discard(path, str(exc))
            return
        if cache.reusable(common) > in_memory:
            slot = self.pool.add(cache, saved_ids)
            # prompt_len 0: no conversation in memory uses it, so it is taken over in place
            slot.mtp, slot.prompt_len = mtp, 0

    def choose_call(self, ids: list[int], null_ids: list[int], opening: list[int]) -> Choice:
        """tool_choice auto's call-or-reply for a model with no call syntax of its own
        (backend/choice.py)."""
        return choose_call(self, ids, null_ids, opening)

    def return_to(self, slot: Slot) -> None:
        """Drop the sequence in use and make `slot` current again: a prompt scored on the
        side (tool_choice auto's content-free one, backend/choice.py) leaves nothing behind."""
        side = self.pool.current
        if side is slot:
            return
        self.pool.slots.remove(side)
        self.pool.current = slot
        if self.speculator is not None:
            self._switch_mtp(slot)

    def erase_slot(self, slot_id: int) -> int:
        """Drop a slot; returns how many tokens it held."""
        previous = self.pool.current
        n = self.pool.erase(slot_id)
        if self.speculator is not None and self.pool.current is not previous:
            self._switch_mtp(self.pool.current)
        return n

    def step(self, token: int) -> np.ndarray:
        """Append one token and return the next-token logits (V,)."""
        if self.speculator is not None:
            return self.speculator.step(token)
        pos = len(self.cached_ids)
        hidden = self._forward(np.asarray([token], dtype=np.int64), pos)
        self.cached_ids.append(token)
        return self.model.logits(hidden)[0]

    # -- generation --------------------------------------------------------------------------

    def _token_picker(
        self, params: SamplingParams, prompt: list[int], max_tokens: int, constraint
    ) -> TokenPicker:
        """On the device when the model runs on our kernels and nothing needs the logits on
        the host (no speculation, settings sample.cu takes; a grammar's mask goes to the
        device); else the CPU's."""
        if not self.model.ops.DEVICE_SAMPLING or self.speculator is not None:
            return host_picker(params, constraint)
        if not ChainSettings.of(params).fits():
            return host_picker(params, constraint)
        draws = min(max_tokens, self.context_length) + 1  # at most one per generated token
        fused = self.model.fused
        decoder = fused if fused is not None and fused.TOKEN_ON_DEVICE else None
        return device_picker(self.model.ops, params, prompt, draws, decoder, constraint)

    def _prompt_ids(self, prompt: str | Sequence[int], add_special_tokens: bool) -> list[int]:
        """The prompt as token ids (at least one: an empty prompt is the BOS token)."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        else:
            ids = [int(i) for i in prompt]
        return ids or [self.tokenizer.bos_id or 0]

    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int = 512,
        sampling: SamplingParams | None = None,
        stop: Sequence[str] = (),
        add_special_tokens: bool = True,
        stats: GenerationStats | None = None,
        constraint: Constraint | None = None,
    ) -> Iterator[TokenEvent]:
        """Yield one event per generated token. `stats` (when given) is filled in as it goes,
        and is complete once the iterator is exhausted or closed. `constraint`: a grammar
        every token must fit (backend/constraint.py); speculation drafts only what it takes."""
        stats = stats if stats is not None else GenerationStats()
        spec = self.speculator.stats if self.speculator is not None else None
        spec_before = (spec.rounds, spec.drafted, spec.accepted) if spec else (0, 0, 0)
        t0 = time.perf_counter()
        ids = self._prompt_ids(prompt, add_special_tokens)
        stats.prompt_tokens = len(ids)
        sampling = sampling or SamplingParams()
        pick = self._token_picker(sampling, ids, max_tokens, constraint)
        think = ThinkBudget.start(self.tokenizer, ids, sampling.reasoning_budget)
        if think is not None:
            pick = think.around(pick)
        decoder = IncrementalDecoder(self.tokenizer)
        stopper = StopMatcher(stop)
        pieces: list[str] = []
        t_first = None
        self.constraint = constraint
        try:
            logits, stats.cached_tokens = self.prefill(ids)
            stats.prompt_s = time.perf_counter() - t0
            history = list(ids)
            stats.finish_reason = "length"
            while stats.completion_tokens < max_tokens:
                token = pick(logits, history, stats.completion_tokens)
                if t_first is None:
                    t_first = time.perf_counter()
                    stats.ttft_s = t_first - t0
                if token in self.tokenizer.stop_ids:
                    stats.finish_reason = "stop"
                    break
                if constraint is not None:
                    constraint.accept(token)
                stats.completion_tokens += 1
                stats.token_ids.append(token)
                history.append(token)
                text = stopper.feed(decoder.push(token))
                pieces.append(text)
                yield TokenEvent(token, text)
                if stopper.hit:
                    stats.finish_reason = "stop"
                    break
                if len(self.cached_ids) >= self.context_length:
                    break  # the context is full: "length"
                if stats.completion_tokens < max_tokens:
                    logits = self.step(token)
            if not stopper.hit:
                tail = stopper.feed(decoder.flush()) + stopper.flush()
                if tail:
                    pieces.append(tail)
                    yield TokenEvent(-1, tail)
        except (KeyboardInterrupt, GeneratorExit):
            stats.finish_reason = "interrupted"
            raise
        finally:
            self.constraint = None
            self.pool.trim()  # the sequence grew by its reply
            now = time.perf_counter()
            stats.eval_s = now - t_first if t_first is not None else 0.0
            stats.total_s = now - t0
            stats.text = "".join(pieces)
            if spec is not None:
                stats.draft_rounds = spec.rounds - spec_before[0]
                stats.draft_tokens = spec.drafted - spec_before[1]
                stats.accepted_tokens = spec.accepted - spec_before[2]
