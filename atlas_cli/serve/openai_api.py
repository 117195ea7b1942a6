"""`POST /v1/chat/completions` and `POST /v1/completions`, streamed (SSE) or whole."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from atlas_cli.backend.think_budget import EFFORT_BUDGETS
from atlas_cli.serve.errors import APIError, unsupported
from atlas_cli.serve.http import (
    AppState,
    check_token_ids,
    endpoint,
    new_id,
    on_disconnect,
    read_body,
    sampling_given,
    sse,
    sse_response,
    version_tag,
)
from atlas_cli.serve.prompt import ChatOptions, Prompt, build_chat_prompt
from atlas_cli.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
)
from atlas_cli.serve.toolcalls import ContentDelta, ReasoningDelta, ToolCallDelta
from atlas_cli.serve.turn import Outcome, Turn

DONE = "data: [DONE]\n\n"


def _stream_chunk(
    meta: dict[str, Any],
    obj: str,
    fields: dict[str, Any],
    finish: str | None,
    include_usage: bool,
    extra: dict[str, Any] | None = None,
) -> str:
    """One streamed chunk with a single choice; with include_usage every chunk carries
    "usage": null (only the last one, sent separately, has numbers)."""
    body = {
        **meta,
        "object": obj,
        "choices": [{"index": 0, **fields, "logprobs": None, "finish_reason": finish}],
    }
    if include_usage:
        body["usage"] = None
    return sse({**body, **(extra or {})})


def _last_chunks(
    meta: dict[str, Any], obj: str, fields: dict[str, Any], out: Outcome, include_usage: bool
) -> Iterator[str]:
    """The finish chunk, then the usage chunk if asked: llama-server's `timings` ride on
    whichever comes last."""
    timings = {"timings": out.timings}
    extra = None if include_usage else timings
    yield _stream_chunk(meta, obj, fields, out.finish_reason, include_usage, extra)
    if include_usage:
        yield sse({**meta, "object": obj, "choices": [], "usage": out.usage, **timings})


def _error_event(exc: APIError) -> str:
    return sse(exc.openai_body())


def stops(value: str | list[str] | None) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def new_turn(state: AppState, prompt: Prompt, req: SamplingFields, max_tokens: int | None):
    if req.n is not None and req.n > 1:
        raise unsupported("n", "n > 1")
    given = sampling_given(req, reasoning_budget(req))
    return state.new_turn(prompt, max_tokens=max_tokens, stop=stops(req.stop), **given)


def reasoning_budget(req: SamplingFields) -> int | None:
    """The request's thought budget: `reasoning_budget`, else its `reasoning_effort`'s."""
    effort = getattr(req, "reasoning_effort", None)  # chat completions only
    if req.reasoning_budget is not None or effort is None:
        return req.reasoning_budget
    return EFFORT_BUDGETS[effort]


def response_meta(state: AppState, id_prefix: str) -> dict[str, Any]:
    """The fields every response and chunk of one answer repeats."""
    return {
        "id": new_id(id_prefix),
        "created": int(time.time()),
        "model": state.name,
        "system_fingerprint": version_tag(),
    }


def include_usage(req: SamplingFields) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


# -- chat --------------------------------------------------------------------------------------


@endpoint("chat_completions")
async def chat_completions(state: AppState, request: Request) -> Response:
    req = await read_body(state, request, ChatCompletionRequest)
    if req.logprobs:
        raise unsupported("logprobs", "logprobs")
    opts = ChatOptions(
        parser=state.parser,
        tools=req.tools,
        tool_choice=req.tool_choice,
        response_format=req.response_format,
        parallel_tool_calls=req.parallel_tool_calls,
        template_kwargs=state.template_kwargs(req.chat_template_kwargs),
        context=state.model.context_length,
    )
    # rendering and tokenising a long conversation takes a while: not on the event loop
    prompt = await run_in_threadpool(build_chat_prompt, state.model.tokenizer, req.messages, opts)
    # compiling the answer's grammar can take a while too
    max_tokens = req.max_completion_tokens or req.max_tokens
    turn = await run_in_threadpool(new_turn, state, prompt, req, max_tokens)
    meta = response_meta(state, "chatcmpl-")
    if req.stream:
        events = chat_stream(turn, meta, include_usage(req))
        return sse_response(turn, events, _error_event, DONE)
    async with on_disconnect(request, turn.cancel):
        out = await turn.complete()
    headers = {"X-Atlas-JSON-Valid": str(out.json_valid).lower()} if prompt.json_mode else None
    return JSONResponse(chat_body(out, meta), headers=headers)


def chat_message(out: Outcome) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": out.content}
    if out.reasoning:
        msg["reasoning_content"] = out.reasoning
    if out.tool_calls:
        msg["content"] = out.content or None
        msg["tool_calls"] = [c.to_openai() for c in out.tool_calls]
    return msg


def chat_body(out: Outcome, meta: dict[str, Any]) -> dict[str, Any]:
    return {
        **meta,
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "message": chat_message(out),
                "logprobs": None,
                "finish_reason": out.finish_reason,
            }
        ],
        "usage": out.usage,
        "timings": out.timings,
    }


async def chat_stream(turn: Turn, meta: dict[str, Any], include_usage: bool) -> AsyncIterator[str]:
    """Chunks: the role (sent with the first token, so a client's time to first chunk is the
    time to first token), deltas, the finish reason, usage if asked (then `[DONE]`). A tool
    call comes as OpenAI's deltas while it is generated: id and name as soon as the name is
    written, then its arguments JSON in pieces (one per parameter for Qwen3.5's XML calls,
    every few characters for Hermes JSON ones); a call cut off by the token limit ends with
    finish_reason "length" and the arguments written so far."""

    def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
        return _stream_chunk(meta, "chat.completion.chunk", {"delta": delta}, finish, include_usage)

    role = chunk({"role": "assistant", "content": ""})
    started = False
    async for event in turn.deltas():
        if isinstance(event, ToolCallDelta):
            delta: dict[str, Any] = {"tool_calls": [event.to_openai()]}
        elif isinstance(event, ReasoningDelta | ContentDelta) and event.text:
            key = "reasoning_content" if isinstance(event, ReasoningDelta) else "content"
            delta = {key: event.text}
        else:  # ToolCallEnd: its arguments went out as deltas already
            continue
        if not started:
            started = True
            yield role
        yield chunk(delta)
    out = turn.outcome
    if not started:
        yield role
    for last in _last_chunks(meta, "chat.completion.chunk", {"delta": {}}, out, include_usage):
        yield last


# -- completions -------------------------------------------------------------------------------


def completion_prompt(state: AppState, req: CompletionRequest) -> Prompt:
    """The prompt of a raw completion: one text or one list of token ids."""
    tok = state.model.tokenizer
    prompt_in = req.prompt
    if isinstance(prompt_in, list) and prompt_in and isinstance(prompt_in[0], str | list):
        if len(prompt_in) != 1:
            raise unsupported("prompt", "more than one prompt per request")
        prompt_in = prompt_in[0]
    if isinstance(prompt_in, str):
        return Prompt(tok.encode(prompt_in, add_special_tokens=True), prompt_in)
    check_token_ids(prompt_in, tok.vocab_size, "prompt")
    return Prompt(list(prompt_in), tok.decode(prompt_in))


@endpoint("completions")
async def completions(state: AppState, request: Request) -> Response:
    req = await read_body(state, request, CompletionRequest)
    if req.suffix:
        raise unsupported("suffix", "suffix (fill-in-the-middle)")
    if req.logprobs:
        raise unsupported("logprobs", "logprobs")
    if req.best_of is not None and req.best_of > 1:
        raise unsupported("best_of", "best_of > 1")
    prompt = await run_in_threadpool(completion_prompt, state, req)
    # OpenAI's default for this endpoint is 16 tokens
    turn = new_turn(state, prompt, req, req.max_tokens or 16)
    meta = response_meta(state, "cmpl-")
    echo = prompt.text if req.echo else ""
    if req.stream:
        events = completion_stream(turn, meta, include_usage(req), echo)
        return sse_response(turn, events, _error_event, DONE)
    async with on_disconnect(request, turn.cancel):
        pieces = [t async for t in turn.texts()]
        out = await turn.finish_plain("".join(pieces))
    choice = {"index": 0, "text": echo + out.text, "logprobs": None}
    choice["finish_reason"] = out.finish_reason
    body = {**meta, "object": "text_completion", "choices": [choice], "usage": out.usage}
    return JSONResponse({**body, "timings": out.timings})


async def completion_stream(
    turn: Turn, meta: dict[str, Any], include_usage: bool, echo: str
) -> AsyncIterator[str]:
    def chunk(text: str, finish: str | None = None) -> str:
        return _stream_chunk(meta, "text_completion", {"text": text}, finish, include_usage)

    pieces = []
    async for text in turn.texts():
        pieces.append(text)
        yield chunk(echo + text)
        echo = ""
    out = await turn.finish_plain("".join(pieces))
    for last in _last_chunks(meta, "text_completion", {"text": ""}, out, include_usage):
        yield last
