"""`POST /v1/chat/completions` and `POST /v1/completions`, streamed (SSE) or whole."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from atlas_cli.serve.app import (
    AppState,
    check_token_ids,
    endpoint,
    on_disconnect,
    read_json,
    version_tag,
)
from atlas_cli.serve.errors import APIError, unsupported
from atlas_cli.serve.prompt import ChatOptions, Prompt, build_chat_prompt
from atlas_cli.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    parse_body,
)
from atlas_cli.serve.toolcalls import ContentDelta, ReasoningDelta, ToolCallDelta
from atlas_cli.serve.turn import Outcome, Turn, sampling_params

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _stream_chunk(
    meta: dict[str, Any],
    obj: str,
    fields: dict[str, Any],
    finish: str | None,
    include_usage: bool,
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
    return sse(body)


def stops(value: str | list[str] | None) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def new_turn(state: AppState, prompt: Prompt, req: SamplingFields, max_tokens: int | None):
    if req.n is not None and req.n > 1:
        raise unsupported("n", "n > 1")
    sampling = sampling_params(
        req.temperature,
        req.top_p,
        req.top_k,
        req.min_p,
        req.repeat_penalty,
        req.seed,
        state.model.sampling_defaults,
    )
    return Turn(
        state.runner,
        prompt,
        max_tokens=max_tokens,
        sampling=sampling,
        stop=stops(req.stop),
        parser=state.parser,
    )


# -- chat --------------------------------------------------------------------------------------


@endpoint("chat_completions")
async def chat_completions(state: AppState, request: Request) -> Response:
    req = parse_body(ChatCompletionRequest, await read_json(state, request))
    state.check_model(req.model)
    if req.logprobs:
        raise unsupported("logprobs", "logprobs")
    opts = ChatOptions(
        parser=state.parser,
        tools=req.tools,
        tool_choice=req.tool_choice,
        response_format=req.response_format,
        template_kwargs=state.template_kwargs(req.chat_template_kwargs),
    )
    prompt = build_chat_prompt(state.model.tokenizer, req.messages, opts)
    turn = new_turn(state, prompt, req, req.max_completion_tokens or req.max_tokens)
    meta = {
        "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
        "created": int(time.time()),
        "model": state.name,
        "system_fingerprint": version_tag(),
    }
    if req.stream:
        usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(
            chat_stream(turn, meta, usage), media_type="text/event-stream", headers=SSE_HEADERS
        )
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
    }


async def chat_stream(turn: Turn, meta: dict[str, Any], include_usage: bool) -> AsyncIterator[str]:
    """Chunks: the role (sent with the first token, so a client's time to first chunk is the
    time to first token), deltas, the finish reason, usage if asked, then [DONE]. A tool call
    comes as OpenAI's deltas: id and name first, then its arguments JSON in pieces (one per
    parameter for Qwen3.5's XML calls, whole for Hermes JSON ones)."""

    def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
        return _stream_chunk(meta, "chat.completion.chunk", {"delta": delta}, finish, include_usage)

    role = chunk({"role": "assistant", "content": ""})
    started = False
    try:
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
        yield chunk({}, out.finish_reason)
        if include_usage:
            yield sse(
                {**meta, "object": "chat.completion.chunk", "choices": [], "usage": out.usage}
            )
    except APIError as exc:
        yield sse(exc.openai_body())
    finally:
        turn.cancel()
    yield "data: [DONE]\n\n"


# -- completions -------------------------------------------------------------------------------


@endpoint("completions")
async def completions(state: AppState, request: Request) -> Response:
    req = parse_body(CompletionRequest, await read_json(state, request))
    state.check_model(req.model)
    if req.suffix:
        raise unsupported("suffix", "suffix (fill-in-the-middle)")
    if req.logprobs:
        raise unsupported("logprobs", "logprobs")
    if req.best_of is not None and req.best_of > 1:
        raise unsupported("best_of", "best_of > 1")
    tok = state.model.tokenizer
    prompt_in = req.prompt
    if isinstance(prompt_in, list) and prompt_in and isinstance(prompt_in[0], str | list):
        if len(prompt_in) != 1:
            raise unsupported("prompt", "more than one prompt per request")
        prompt_in = prompt_in[0]
    if isinstance(prompt_in, str):
        ids = tok.encode(prompt_in, add_special_tokens=True)
        text = prompt_in
    else:
        check_token_ids(prompt_in, tok.vocab_size, "prompt")
        ids, text = list(prompt_in), tok.decode(prompt_in)
    prompt = Prompt(ids, text)
    # OpenAI's default for this endpoint is 16 tokens
    turn = new_turn(state, prompt, req, req.max_tokens or 16)
    meta = {
        "id": f"cmpl-{uuid.uuid4().hex[:24]}",
        "created": int(time.time()),
        "model": state.name,
        "system_fingerprint": version_tag(),
    }
    echo = text if req.echo else ""
    if req.stream:
        usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(
            completion_stream(turn, meta, usage, echo),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )
    async with on_disconnect(request, turn.cancel):
        pieces = [t async for t in turn.texts()]
        out = await turn.finish_plain("".join(pieces))
    choice = {"index": 0, "text": echo + out.text, "logprobs": None}
    choice["finish_reason"] = out.finish_reason
    return JSONResponse(
        {**meta, "object": "text_completion", "choices": [choice], "usage": out.usage}
    )


async def completion_stream(
    turn: Turn, meta: dict[str, Any], include_usage: bool, echo: str
) -> AsyncIterator[str]:
    def chunk(text: str, finish: str | None = None) -> str:
        return _stream_chunk(meta, "text_completion", {"text": text}, finish, include_usage)

    pieces = []
    try:
        async for text in turn.texts():
            pieces.append(text)
            yield chunk(echo + text)
            echo = ""
        out = await turn.finish_plain("".join(pieces))
        yield chunk("", out.finish_reason)
        if include_usage:
            yield sse({**meta, "object": "text_completion", "choices": [], "usage": out.usage})
    except APIError as exc:
        yield sse(exc.openai_body())
    finally:
        turn.cancel()
    yield "data: [DONE]\n\n"
