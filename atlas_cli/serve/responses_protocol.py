"""The OpenAI Responses API's request body (`POST /v1/responses`), and its translation into the
chat-completions terms the shared prompt path takes: input items become chat messages, function
tools and `tool_choice` their chat forms, `text.format` a `response_format`.

Items follow the API's shapes: a message (`role` user / system / developer / assistant, content
as text or `input_text` / `output_text` parts), `function_call` (an earlier call of the model),
`function_call_output` (its result) and `reasoning` (earlier thinking, kept as the assistant
turn's reasoning). Consecutive assistant items (reasoning, text, calls) are one assistant turn,
as a response's own output is.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from atlas_cli.backend.think_budget import EFFORT_BUDGETS
from atlas_cli.serve.errors import APIError, bad_param, unsupported
from atlas_cli.serve.prompt import text_of
from atlas_cli.serve.protocol import (
    FunctionDef,
    Message,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    Tool,
    ToolCallFunction,
    ToolCallIn,
)

# the part types that carry text: what a client writes, and what a response's output holds
TEXT_PARTS = ("input_text", "output_text", "text")
REASONING_PARTS = ("reasoning_text", "summary_text")


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")  # vendor extras are accepted and ignored


class ItemPart(_Body):
    type: str
    text: str | None = None


class InputItem(_Body):
    """One input item; which fields count depends on `type` (a message when it is absent)."""

    type: str = "message"
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: str | list[ItemPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[ItemPart] | None = None
    summary: list[ItemPart] | None = None


class ResponsesTool(_Body):
    type: str
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")] | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(_Body):
    type: str
    name: str | None = None


class TextFormat(_Body):
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Body):
    format: TextFormat | None = None


class ReasoningConfig(_Body):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: str | None = None


class ResponsesRequest(_Body):
    model: str | None = None
    input: str | list[InputItem] = ""
    instructions: str | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    # llama.cpp's sampling extensions, as /v1/chat/completions takes them
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, lt=1)
    repeat_penalty: float | None = Field(None, gt=0)
    seed: int | None = Field(None, ge=0, lt=2**64)
    reasoning: ReasoningConfig | None = None
    reasoning_budget: int | None = Field(None, ge=0)  # tokens of thought before `</think>`
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] | None = None
    stream: bool = False
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    top_logprobs: int | None = Field(None, ge=0)
    chat_template_kwargs: dict[str, Any] | None = None


def check_supported(req: ResponsesRequest) -> None:
    """400 for what this server cannot do, rather than quietly doing something else."""
    if req.background:
        raise unsupported("background", "background responses")
    if req.conversation is not None:
        raise unsupported("conversation", "conversation objects (use previous_response_id)")
    if req.truncation == "auto":
        raise unsupported("truncation", "truncation 'auto'")
    if req.top_logprobs:
        raise unsupported("top_logprobs", "top_logprobs")


def reasoning_budget(req: ResponsesRequest) -> int | None:
    """The request's thought budget: `reasoning_budget`, else its `reasoning.effort`'s, as
    chat completions reads `reasoning_effort` (xhigh and max: no limit, as high)."""
    effort = req.reasoning.effort if req.reasoning is not None else None
    if req.reasoning_budget is not None or effort is None:
        return req.reasoning_budget
    return EFFORT_BUDGETS.get(effort)


def input_messages(given: str | list[InputItem]) -> list[Message]:
    """The request's `input` as chat messages."""
    if isinstance(given, str):
        return [Message(role="user", content=given)] if given else []
    out: list[Message] = []
    turn: _AssistantTurn | None = None  # consecutive assistant items gathered into one turn
    for i, item in enumerate(given):
        where = f"input[{i}]"
        if _is_assistant_item(item):
            turn = turn or _AssistantTurn()
            turn.add(item, where)
            continue
        if turn is not None:
            out.append(turn.message())
            turn = None
        if item.type == "message":
            if item.role is None:
                raise bad_param(f"{where}.role", f"{where}.role: a message needs a role")
            text = text_of(item.content, f"{where}.content", kinds=TEXT_PARTS)
            out.append(Message(role=item.role, content=text))
        elif item.type == "function_call_output":
            call_id = _required(item.call_id, f"{where}.call_id")
            result = text_of(item.output, f"{where}.output", kinds=TEXT_PARTS)
            out.append(Message(role="tool", content=result, tool_call_id=call_id))
        else:
            raise unsupported(f"{where}.type", f"an input item of type {item.type!r}")
    if turn is not None:
        out.append(turn.message())
    return out


def _is_assistant_item(item: InputItem) -> bool:
    if item.type == "message":
        return item.role == "assistant"
    return item.type in ("function_call", "reasoning")


class _AssistantTurn:
    def __init__(self) -> None:
        self.texts: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[ToolCallIn] = []

    def add(self, item: InputItem, where: str) -> None:
        if item.type == "message":
            self.texts.append(text_of(item.content, f"{where}.content", kinds=TEXT_PARTS))
        elif item.type == "reasoning":
            # the full reasoning text where the item has it, else its summary
            parts = item.content if isinstance(item.content, list) else item.summary
            self.reasoning.append(text_of(parts, f"{where}.content", kinds=REASONING_PARTS))
        else:
            call_id = _required(item.call_id, f"{where}.call_id")
            name = _required(item.name, f"{where}.name")
            function = ToolCallFunction(name=name, arguments=item.arguments or "{}")
            self.calls.append(ToolCallIn(id=call_id, function=function))

    def message(self) -> Message:
        return Message(
            role="assistant",
            content="\n".join(self.texts),
            tool_calls=self.calls or None,
            reasoning_content="\n".join(r for r in self.reasoning if r) or None,
        )


def _required(value: str | None, param: str) -> str:
    if not value:
        raise bad_param(param, f"{param}: this field is required")
    return value


def with_instructions(instructions: str | None, messages: list[Message]) -> list[Message]:
    """`instructions` as the conversation's system message. A system or developer message that
    opens the input joins it: several templates (Qwen3.5's) allow one system turn, first."""
    if not instructions:
        return messages
    if messages and messages[0].role in ("system", "developer"):
        first = text_of(messages[0].content, "input[0].content", kinds=TEXT_PARTS)
        merged = f"{instructions}\n\n{first}" if first else instructions
        return [Message(role="system", content=merged), *messages[1:]]
    return [Message(role="system", content=instructions), *messages]


def chat_tools(tools: list[ResponsesTool] | None) -> list[Tool] | None:
    """Function tools in chat form; built-in tools (web search, files, ...) are refused."""
    out = []
    for i, tool in enumerate(tools or []):
        if tool.type != "function":
            raise unsupported(f"tools[{i}].type", f"a tool of type {tool.type!r}")
        name = _required(tool.name, f"tools[{i}].name")
        function = FunctionDef(name=name, description=tool.description, parameters=tool.parameters)
        out.append(Tool(function=function))
    return out or None


def chat_tool_choice(choice: str | FunctionChoice | None) -> str | NamedToolChoice | None:
    if not isinstance(choice, FunctionChoice):
        return choice
    if choice.type != "function":
        raise unsupported("tool_choice", f"tool_choice of type {choice.type!r}")
    name = _required(choice.name, "tool_choice.name")
    return NamedToolChoice(function=NamedFunction(name=name))


def chat_response_format(text: TextConfig | None) -> ResponseFormat | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    if fmt.schema_ is None:
        raise APIError(
            400,
            "text.format.schema: a json_schema format needs a schema",
            code="invalid_value",
            param="text.format.schema",
        )
    schema = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}
    return ResponseFormat(type="json_schema", json_schema=schema)
