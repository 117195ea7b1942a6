"""OpenAI's `POST /v1/responses`, whole or streamed as typed events, on the same prompt
building, constrained generation and tool-call parsing as `/v1/chat/completions`
(responses_protocol.py translates the request; responses_output.py builds the output items)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from atlas_cli.backend.engine import GenerationStats
from atlas_cli.serve.errors import APIError, bad_param
from atlas_cli.serve.http import (
    AppState,
    endpoint,
    new_id,
    on_disconnect,
    read_body,
    sampling_given,
    sse,
    sse_response,
)
from atlas_cli.serve.prompt import ChatOptions, Prompt, build_chat_prompt
from atlas_cli.serve.protocol import Message
from atlas_cli.serve.responses_output import OutputItems
from atlas_cli.serve.responses_protocol import (
    InputItem,
    ResponsesRequest,
    chat_response_format,
    chat_tool_choice,
    chat_tools,
    check_supported,
    input_messages,
    reasoning_budget,
    with_instructions,
)
from atlas_cli.serve.responses_store import ResponseStore
from atlas_cli.serve.turn import Turn


def response_store(request: Request) -> ResponseStore:
    """The app's store of past responses, made on first use (one per app, i.e. per server)."""
    store = getattr(request.app.state, "responses", None)
    if store is None:
        store = request.app.state.responses = ResponseStore()
    return store


@endpoint("responses")
async def responses(state: AppState, request: Request) -> Response:
    req = await read_body(state, request, ResponsesRequest)
    check_supported(req)
    store = response_store(request)
    history = store.conversation(req.previous_response_id) if req.previous_response_id else []
    conversation = [*history, *input_messages(req.input)]
    if not conversation:
        raise bad_param("input", "input: there is nothing to answer (no input items)")
    opts = ChatOptions(
        parser=state.parser,
        tools=chat_tools(req.tools),
        tool_choice=chat_tool_choice(req.tool_choice),
        response_format=chat_response_format(req.text),
        parallel_tool_calls=req.parallel_tool_calls,
        template_kwargs=state.template_kwargs(req.chat_template_kwargs),
        context=state.model.context_length,
    )
    messages = with_instructions(req.instructions, conversation)
    prompt = await run_in_threadpool(build_chat_prompt, state.model.tokenizer, messages, opts)
    # compiling the answer's grammar (a schema, tools) can take a while: not on the event loop
    turn = await run_in_threadpool(new_turn, state, prompt, req)
    answer = Answer(state, req, turn, conversation, store)
    if req.stream:
        return sse_response(turn, answer.stream(), answer.error_event)
    async with on_disconnect(request, turn.cancel):
        body = await answer.whole()
    out = turn.outcome
    headers = {"X-Atlas-JSON-Valid": str(out.json_valid).lower()} if prompt.json_mode else None
    return JSONResponse(body, headers=headers)


def new_turn(state: AppState, prompt: Prompt, req: ResponsesRequest) -> Turn:
    given = sampling_given(req, reasoning_budget(req))
    return state.new_turn(prompt, max_tokens=req.max_output_tokens, stop=[], **given)


class Answer:
    """One response: its id, the request it echoes, and the turn that writes its output."""

    def __init__(
        self,
        state: AppState,
        req: ResponsesRequest,
        turn: Turn,
        conversation: list[Message],
        store: ResponseStore,
    ):
        self.state = state
        self.req = req
        self.turn = turn
        self.conversation = conversation  # without the instructions, as it is stored
        self.store = store
        self.id = new_id("resp_")
        self.created = int(time.time())
        self.sequence = 0

    async def whole(self) -> dict[str, Any]:
        items = OutputItems()
        async for event in self.turn.deltas():
            items.feed(event)
        items.finish(self.incomplete)
        return await self.settle(items.items)

    async def stream(self) -> AsyncIterator[str]:
        """response.created and .in_progress at once, then each output item as it is written
        (added, its content part, text or argument deltas, done), then response.completed
        (response.incomplete when the token limit cut the answer off) with the usage."""
        head = self.body("in_progress", [])
        yield self.event({"type": "response.created", "response": head})
        yield self.event({"type": "response.in_progress", "response": head})
        items = OutputItems()
        async for event in self.turn.deltas():
            for out in items.feed(event):
                yield self.event(out)
        for out in items.finish(self.incomplete):
            yield self.event(out)
        body = await self.settle(items.items)
        yield self.event({"type": f"response.{body['status']}", "response": body})

    def event(self, body: dict[str, Any]) -> str:
        """One stream event, numbered in order."""
        kind = body["type"]
        numbered = {"type": kind, "sequence_number": self.sequence, **body}
        self.sequence += 1
        return sse(numbered, event=kind)

    def error_event(self, exc: APIError) -> str:
        return self.event(
            {"type": "error", "code": exc.code, "message": exc.message, "param": exc.param}
        )

    @property
    def incomplete(self) -> bool:
        return self.turn.outcome.finish_reason == "length"

    async def settle(self, output: list[dict[str, Any]]) -> dict[str, Any]:
        """The finished response, kept for a follow-up when the request says `store`."""
        stats = self.turn.outcome.stats
        reasoning = "".join(
            part["text"]
            for item in output
            if item["type"] == "reasoning"
            for part in item["content"]
        )
        reasoning_tokens = 0
        if reasoning:  # the engine counts tokens, not which of them were thinking
            ids = await run_in_threadpool(self.state.model.tokenizer.encode, reasoning)
            reasoning_tokens = min(len(ids), stats.completion_tokens)
        status = "incomplete" if self.incomplete else "completed"
        body = self.body(status, output, usage(stats, reasoning_tokens))
        if self.req.store:
            answer = input_messages([InputItem.model_validate(item) for item in output])
            self.store.keep(self.id, [*self.conversation, *answer])
        return body

    def body(
        self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        req, sampling = self.req, self.turn.job.sampling
        fmt = req.text.format if req.text is not None else None
        reasoning = req.reasoning
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": self.state.name,
            "output": output,
            # as on chat completions, a constrained answer is one call unless the request
            # allows more
            "parallel_tool_calls": req.parallel_tool_calls is True,
            "previous_response_id": req.previous_response_id,
            "reasoning": {
                "effort": reasoning.effort if reasoning else None,
                "summary": reasoning.summary if reasoning else None,
            },
            "store": req.store,
            "temperature": sampling.temperature,
            "text": {
                "format": fmt.model_dump(by_alias=True, exclude_none=True)
                if fmt
                else {"type": "text"}
            },
            "tool_choice": _dumped(req.tool_choice) or "auto",
            "tools": [_dumped(t) for t in req.tools or []],
            "top_p": sampling.top_p,
            "truncation": "disabled",
            "usage": usage,
            "metadata": req.metadata or {},
        }


def _dumped(value: Any) -> Any:
    return (
        value.model_dump(by_alias=True, exclude_none=True)
        if hasattr(value, "model_dump")
        else value
    )


def usage(stats: GenerationStats, reasoning_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": stats.prompt_tokens,
        # the prefix cache keeps every prompt: the tokens it did not have are written to it
        "input_tokens_details": {
            "cached_tokens": stats.cached_tokens,
            "cache_write_tokens": stats.prompt_tokens - stats.cached_tokens,
        },
        "output_tokens": stats.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": stats.prompt_tokens + stats.completion_tokens,
    }
