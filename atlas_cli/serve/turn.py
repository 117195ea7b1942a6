"""One answer in flight: engine text through the tool/reasoning parser, JSON mode's early stop,
and the final tally that every endpoint formats its own way."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from atlas_cli.backend.constraint import Constraint, new_constraint
from atlas_cli.backend.engine import GenerationStats
from atlas_cli.backend.sample import SamplingParams
from atlas_cli.errors import GrammarCostError, GrammarError
from atlas_cli.serve.errors import APIError, check_fits
from atlas_cli.serve.prompt import JsonCutter, Prompt, valid_json
from atlas_cli.serve.runner import Decide, Decided, EngineRunner, Generation, Job
from atlas_cli.serve.toolcalls import Event, NoToolParser, ParsedMessage, ToolCall, ToolParser

log = logging.getLogger(__name__)


@dataclass
class Outcome:
    stats: GenerationStats
    finish_reason: str  # OpenAI's: "stop" | "length" | "tool_calls"
    text: str  # everything generated, the prefill included
    content: str = ""
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    json_valid: bool | None = None  # JSON mode only

    @property
    def usage(self) -> dict:
        s = self.stats
        return {
            "prompt_tokens": s.prompt_tokens,
            "completion_tokens": s.completion_tokens,
            "total_tokens": s.prompt_tokens + s.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": s.cached_tokens},
        }

    @property
    def timings(self) -> dict:
        """llama-server's `timings` (tools/server): prompt_n counts the prompt tokens evaluated
        and cache_n those whose KV came from the prefix cache; predicted_ms runs from the first
        token, sampled at the end of the prompt's evaluation, as llama.cpp's generation time
        does, and its rates count every predicted token as llama.cpp's do."""
        s = self.stats
        prompt_n = s.prompt_tokens - s.cached_tokens
        prompt_ms = s.prompt_s * 1e3
        predicted_ms = s.eval_s * 1e3
        timings = {
            "cache_n": s.cached_tokens,
            "prompt_n": prompt_n,
            "prompt_ms": prompt_ms,
            "prompt_per_token_ms": ratio(prompt_ms, prompt_n),
            "prompt_per_second": ratio(prompt_n * 1e3, prompt_ms),
            "predicted_n": s.completion_tokens,
            "predicted_ms": predicted_ms,
            "predicted_per_token_ms": ratio(predicted_ms, s.completion_tokens),
            "predicted_per_second": ratio(s.completion_tokens * 1e3, predicted_ms),
        }
        if s.draft_rounds:  # llama.cpp adds these when it drafted
            timings["draft_n"] = s.draft_tokens
            timings["draft_n_accepted"] = s.accepted_tokens
        return timings


def ratio(num: float, den: float) -> float:
    """num / den, 0 where there is nothing to divide by (llama.cpp's JSON would say null)."""
    return num / den if den > 0 else 0.0


def answer_constraint(engine, prompt: Prompt, grammar: str | None = None) -> Constraint | None:
    """The prompt's grammar (or `grammar`) compiled for this answer (a bad schema is the
    client's 400)."""
    grammar = prompt.grammar if grammar is None else grammar
    if grammar is None:
        return None
    try:
        return new_constraint(engine.tokenizer, grammar, prompt.prefill)
    except GrammarError as exc:
        raise grammar_error(exc) from None


def grammar_error(exc: GrammarError) -> APIError:
    """The client's 400 for a grammar that fails or costs too much, before or while it runs."""
    code = "grammar_too_complex" if isinstance(exc, GrammarCostError) else "invalid_grammar"
    return APIError(400, str(exc), code=code)


def call_or_reply(engine, prompt: Prompt, reply: Constraint | None) -> Decide | None:
    """`auto`'s decision (prompt.CallDecision), run on the engine thread before the answer:
    the calls grammar when the model's calibrated likelihoods favour a call, else `reply`."""
    decision = prompt.decision
    if decision is None or reply is None:
        return None
    calls = answer_constraint(engine, prompt, decision.calls_grammar)

    def decide(engine) -> Decided:
        choice = engine.choose_call(prompt.ids, decision.null_ids, decision.opening)
        log.debug("tool_choice auto: call=%s (margin %.2f)", choice.call, choice.margin)
        return Decided(calls if choice.call else reply, choice.cached_tokens)

    return decide


class Turn:
    """Iterate `deltas()` for streamed pieces, or await `complete()`; then read `outcome`."""

    def __init__(
        self,
        runner: EngineRunner,
        prompt: Prompt,
        *,
        max_tokens: int | None,
        sampling: SamplingParams,
        stop: list[str],
        parser: type[ToolParser] = NoToolParser,
    ):
        context = runner.engine.context_length
        check_fits(len(prompt.ids), context)
        room = context - len(prompt.ids)
        self.runner = runner
        self.prompt = prompt
        # calls are looked for only when the request offers tools; reasoning always
        self.parser = (parser if prompt.tools else NoToolParser)(prompt.tools)
        constraint = answer_constraint(runner.engine, prompt)
        decide = call_or_reply(runner.engine, prompt, constraint)
        limit = min(max_tokens or room, room)
        self.job = Job(prompt.ids, limit, sampling, tuple(stop), constraint, decide)
        self.gen: Generation | None = None
        self.outcome: Outcome | None = None
        self._cut = False

    def cancel(self) -> None:
        if self.gen is not None:
            self.gen.cancel()

    async def texts(self) -> AsyncIterator[str]:
        """The answer's text: the prefill, then the engine's pieces up to JSON mode's end."""
        self.gen = gen = self.runner.submit(self.job)
        cutter = JsonCutter(self.prompt.prefill) if self.prompt.prefill else None
        if self.prompt.prefill:
            yield self.prompt.prefill
        try:
            async for piece in gen:
                if cutter is not None:
                    end = cutter.feed(piece)
                    if end is not None:
                        self._cut = True
                        if piece[:end]:
                            yield piece[:end]
                        break
                yield piece
        finally:
            gen.cancel()  # no-op when it finished; stops it when we left early

    async def deltas(self) -> AsyncIterator[Event]:
        """Reasoning, content and tool-call events (serve.toolcalls) as they are produced."""
        stream = self.parser.stream(prompt_opened_think=self.prompt.opened_think)
        pieces: list[str] = []
        async for text in self.texts():
            pieces.append(text)
            for event in stream.feed(text):
                yield event
        for event in stream.finish():
            yield event
        await self._finish("".join(pieces), stream.message)

    async def complete(self) -> Outcome:
        text = "".join([text async for text in self.texts()])
        parsed = self.parser.parse(text, prompt_opened_think=self.prompt.opened_think)
        await self._finish(text, parsed)
        return self.outcome

    async def finish_plain(self, text: str) -> Outcome:
        """The tally for a raw completion (no parsing): after iterating `texts()`."""
        await self._finish(text, ParsedMessage(text, None, []))
        return self.outcome

    async def _finish(self, text: str, parsed: ParsedMessage) -> None:
        stats = await self.gen.result()
        if isinstance(self.gen.error, GrammarError):  # the client's schema, met mid-answer
            raise grammar_error(self.gen.error)
        if self.gen.error is not None:
            raise APIError(500, f"generation failed: {self.gen.error}", type="server_error")
        reason = "stop" if self._cut else stats.finish_reason
        if reason == "interrupted":
            reason = "stop"
        if parsed.tool_calls and reason == "stop":
            reason = "tool_calls"
        self.outcome = Outcome(
            stats,
            reason,
            text,
            parsed.content,
            parsed.reasoning,
            list(parsed.tool_calls),
            valid_json(parsed.content) if self.prompt.json_mode else None,
        )
