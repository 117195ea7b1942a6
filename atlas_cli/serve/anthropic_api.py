"""Anthropic's `POST /v1/messages` (and `/v1/messages/count_tokens`), mapped onto the same
prompt building and generation as the OpenAI endpoints."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from atlas_cli.backend.engine import GenerationStats
from atlas_cli.serve.errors import APIError
from atlas_cli.serve.http import (
    AppState,
    endpoint,
    new_id,
    on_disconnect,
    read_body,
    sse,
    sse_response,
)
from atlas_cli.serve.prompt import ChatOptions, Prompt, build_chat_prompt, text_of
from atlas_cli.serve.protocol import (
    AnthropicBlock,
    AnthropicMessage,
    AnthropicTool,
    AnthropicToolChoice,
    CountTokensRequest,
    FunctionDef,
    Message,
    MessagesRequest,
    NamedFunction,
    NamedToolChoice,
    Tool,
    ToolCallFunction,
    ToolCallIn,
)
from atlas_cli.serve.toolcalls import ContentDelta, ReasoningDelta, ToolCallDelta
from atlas_cli.serve.turn import Outcome, Turn

STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}
TEXT_BLOCKS = ("text",)  # the block types that may stand where Anthropic allows only text
# Claude Code opens the system prompt with a per-request billing line; kept, it would change
# the prompt's first tokens every request and defeat the prefix cache, so it is dropped
BILLING_HEADER = "x-anthropic-billing-header"


def to_openai_messages(
    system: str | list[AnthropicBlock] | None, messages: list[AnthropicMessage]
) -> list[Message]:
    """Anthropic turns as OpenAI messages: tool_result blocks become tool messages, tool_use
    blocks assistant tool_calls, thinking blocks reasoning_content."""
    out: list[Message] = []
    if isinstance(system, list) and system and (system[0].text or "").startswith(BILLING_HEADER):
        system = system[1:]
    if system:
        out.append(Message(role="system", content=text_of(system, "system", kinds=TEXT_BLOCKS)))
    for i, msg in enumerate(messages):
        where = f"messages[{i}].content"
        if isinstance(msg.content, str):
            out.append(Message(role=msg.role, content=msg.content))
            continue
        texts, calls, thinking = [], [], []
        for k, block in enumerate(msg.content):
            if block.type == "text":
                texts.append(block.text or "")
            elif block.type == "thinking" and msg.role == "assistant":
                thinking.append(block.thinking or "")
            elif block.type == "redacted_thinking":
                continue
            elif block.type == "tool_use" and msg.role == "assistant":
                calls.append(
                    ToolCallIn(
                        id=block.id,
                        function=ToolCallFunction(
                            name=block.name or "", arguments=json.dumps(block.input or {})
                        ),
                    )
                )
            elif block.type == "tool_result" and msg.role == "user":
                result = text_of(block.content, f"{where}[{k}].content", kinds=TEXT_BLOCKS)
                if block.is_error:
                    result = f"Error: {result}"
                out.append(Message(role="tool", content=result, tool_call_id=block.tool_use_id))
            else:
                raise APIError(
                    400,
                    f"{where}[{k}]: a {msg.role} block of type {block.type!r} is not supported",
                    code="unsupported",
                    param=where,
                )
        if msg.role == "assistant":
            out.append(
                Message(
                    role="assistant",
                    content="\n".join(texts),
                    tool_calls=calls or None,
                    reasoning_content="\n".join(thinking) or None,
                )
            )
        elif texts:
            out.append(Message(role="user", content="\n".join(texts)))
    return out


def to_openai_tools(tools: list[AnthropicTool] | None) -> list[Tool] | None:
    if not tools:
        return None
    return [
        Tool(
            function=FunctionDef(name=t.name, description=t.description, parameters=t.input_schema)
        )
        for t in tools
    ]


def to_openai_choice(choice: AnthropicToolChoice | None):
    if choice is None:
        return None
    if choice.type == "tool":
        if not choice.name:
            raise APIError(400, "tool_choice: type 'tool' needs a name", param="tool_choice")
        return NamedToolChoice(function=NamedFunction(name=choice.name))
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def _prompt(
    state: AppState,
    req: MessagesRequest | CountTokensRequest,
    tool_choice: AnthropicToolChoice | None = None,
    context: int | None = None,
) -> Prompt:
    """The prompt an Anthropic request renders to: `messages` and `count_tokens` must agree
    (only `messages` passes `context`, refusing what cannot fit before tokenising it)."""
    opts = ChatOptions(
        parser=state.parser,
        tools=to_openai_tools(req.tools),
        tool_choice=to_openai_choice(tool_choice),
        parallel_tool_calls=not (tool_choice and tool_choice.disable_parallel_tool_use),
        template_kwargs=state.template_kwargs(),
        context=context,
    )
    return build_chat_prompt(
        state.model.tokenizer, to_openai_messages(req.system, req.messages), opts
    )


@endpoint("messages", style="anthropic")
async def messages(state: AppState, request: Request) -> Response:
    req = await read_body(state, request, MessagesRequest)
    context = state.model.context_length
    prompt = await run_in_threadpool(_prompt, state, req, req.tool_choice, context)
    stop = list(req.stop_sequences or [])
    turn = await run_in_threadpool(  # compiling the answer's grammar can take a while
        lambda: state.new_turn(
            prompt,
            max_tokens=req.max_tokens,
            stop=stop,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            reasoning_budget=req.reasoning_budget,
        )
    )
    msg_id = new_id("msg_")
    if req.stream:
        events = message_stream(turn, msg_id, state.name, stop, state)
        return sse_response(turn, events, _error_event)
    async with on_disconnect(request, turn.cancel):
        out = await turn.complete()
    blocks: list[dict[str, Any]] = []
    if out.reasoning:
        blocks.append({"type": "thinking", "thinking": out.reasoning, "signature": ""})
    if out.content:
        blocks.append({"type": "text", "text": out.content})
    for call in out.tool_calls:
        blocks.append(
            {
                "type": "tool_use",
                "id": call.id,
                "name": call.name,
                "input": json.loads(call.arguments),
            }
        )
    reason, seq = stop_reason(out, stop, state)
    stats = out.stats
    return JSONResponse(
        message_body(msg_id, state.name, blocks, reason, seq, usage(stats, stats.completion_tokens))
    )


def message_body(
    msg_id: str,
    model: str,
    content: list[dict[str, Any]],
    reason: str | None,
    sequence: str | None,
    usage: dict[str, int],
) -> dict[str, Any]:
    """A whole message, and the head of a streamed one (no content or stop reason yet)."""
    return {
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage,
    }


def usage(stats: GenerationStats, output_tokens: int) -> dict[str, int]:
    return {
        "input_tokens": stats.prompt_tokens - stats.cached_tokens,  # cache reads count apart
        "output_tokens": output_tokens,
        "cache_read_input_tokens": stats.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def stop_reason(out: Outcome, stop: list[str], state: AppState) -> tuple[str, str | None]:
    if out.finish_reason in STOP_REASONS:
        return STOP_REASONS[out.finish_reason], None
    # a stop sequence was hit if the generated tokens hold one that the text was cut before
    raw = state.model.tokenizer.decode(out.stats.token_ids)
    hit = next((s for s in stop if s and s in raw and s not in out.stats.text), None)
    return ("stop_sequence", hit) if hit else ("end_turn", None)


def event(kind: str, body: dict[str, Any]) -> str:
    return sse({"type": kind, **body}, event=kind)


def _error_event(exc: APIError) -> str:
    return sse(exc.anthropic_body(), event="error")


# a content block as it opens, and the delta type that carries its text
_BLOCK_STARTS: dict[str, dict[str, Any]] = {
    "text": {"type": "text", "text": ""},
    "thinking": {"type": "thinking", "thinking": "", "signature": ""},
}
_DELTAS = {
    "text": ("text_delta", "text"),
    "thinking": ("thinking_delta", "thinking"),
    "tool_use": ("input_json_delta", "partial_json"),
}


async def message_stream(
    turn: Turn, msg_id: str, model: str, stop: list[str], state: AppState
) -> AsyncIterator[str]:
    """message_start (with the first token), content blocks (thinking, text, tool_use) as
    start/delta/stop, then message_delta with the stop reason and message_stop. A tool_use
    block starts as soon as the call's name is written; its arguments stream as
    input_json_delta pieces, as the parser produces them."""
    index = -1
    open_kind: str | None = None
    started = False

    def start() -> str:
        head = message_body(msg_id, model, [], None, None, usage(turn.gen.stats, 0))
        return event("message_start", {"message": head})

    async for e in turn.deltas():
        if isinstance(e, ToolCallDelta):
            kind, text = "tool_use", e.arguments
        elif isinstance(e, ReasoningDelta | ContentDelta) and e.text:
            kind, text = ("thinking" if isinstance(e, ReasoningDelta) else "text"), e.text
        else:  # ToolCallEnd: the call's block closes when the next one opens
            continue
        if not started:
            started = True
            yield start()
        # a new block for a new kind, and for each call (its first delta has the id)
        if kind != open_kind or (kind == "tool_use" and e.id is not None):
            if open_kind is not None:
                yield event("content_block_stop", {"index": index})
            index, open_kind = index + 1, kind
            block = _BLOCK_STARTS.get(kind) or {
                "type": "tool_use",
                "id": e.id,
                "name": e.name,
                "input": {},
            }
            yield event("content_block_start", {"index": index, "content_block": block})
        if text:
            delta_type, field = _DELTAS[kind]
            delta = {"type": delta_type, field: text}
            yield event("content_block_delta", {"index": index, "delta": delta})
    out = turn.outcome
    if not started:
        yield start()
    if open_kind is not None:
        yield event("content_block_stop", {"index": index})
    reason, seq = stop_reason(out, stop, state)
    stats = out.stats
    yield event(
        "message_delta",
        {
            "delta": {"stop_reason": reason, "stop_sequence": seq},
            "usage": usage(stats, stats.completion_tokens),
        },
    )
    yield event("message_stop", {})


@endpoint("count_tokens", style="anthropic")
async def count_tokens(state: AppState, request: Request) -> Response:
    req = await read_body(state, request, CountTokensRequest)
    prompt = await run_in_threadpool(_prompt, state, req)
    return JSONResponse({"input_tokens": len(prompt.ids)})
