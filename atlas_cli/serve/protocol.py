"""Request bodies, validated with pydantic. Unknown fields are accepted and ignored (clients
send vendor extras); a field with a bad value becomes a 400 naming the field."""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from atlas_cli.serve.errors import APIError

MAX_STOPS = 16
T = TypeVar("T", bound=BaseModel)


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


# -- OpenAI chat -------------------------------------------------------------------------------


class FunctionDef(_Body):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Body):
    type: Literal["function"] = "function"
    function: FunctionDef


class ToolCallFunction(_Body):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ContentPart(_Body):
    type: str
    text: str | None = None


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"] = "function"
    function: NamedFunction


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class StreamOptions(_Body):
    include_usage: bool = False


class SamplingFields(_Body):
    """Sampling fields shared by /v1/chat/completions and /v1/completions (OpenAI's ranges;
    top_k, min_p and repeat_penalty are llama.cpp's extensions)."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, lt=1)
    repeat_penalty: float | None = Field(None, gt=0)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = Field(None, ge=0, lt=2**64)  # numpy's generator takes 0..2^64-1
    stop: str | Annotated[list[str], Field(max_length=MAX_STOPS)] | None = None
    max_tokens: int | None = Field(None, ge=1)
    n: int | None = Field(None, ge=1)
    reasoning_budget: int | None = Field(None, ge=0)  # tokens of thought before `</think>`


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # tokens of thought before `</think>` is forced, by OpenAI's effort names
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = None
    best_of: int | None = Field(None, ge=1)


# -- tokenizer endpoints (llama.cpp's and vLLM's field names both work) ------------------------


class TokenizeRequest(_Body):
    model: str | None = None
    content: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special: bool | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    with_pieces: bool = False
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


# -- Anthropic messages ------------------------------------------------------------------------


class AnthropicBlock(_Body):
    type: str
    text: str | None = None
    thinking: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[AnthropicBlock] | None = None
    is_error: bool | None = None


class AnthropicMessage(_Body):
    role: Literal["user", "assistant"]
    content: str | list[AnthropicBlock]


class AnthropicTool(_Body):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=dict)


class AnthropicToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class AnthropicThinking(_Body):
    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = Field(None, ge=0)


class MessagesRequest(_Body):
    model: str | None = None
    max_tokens: int = Field(ge=1)
    messages: Annotated[list[AnthropicMessage], Field(min_length=1)]
    system: str | list[AnthropicBlock] | None = None
    stop_sequences: Annotated[list[str], Field(max_length=MAX_STOPS)] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: AnthropicThinking | None = None

    @property
    def reasoning_budget(self) -> int | None:
        if self.thinking is None:
            return None
        return 0 if self.thinking.type == "disabled" else self.thinking.budget_tokens


class CountTokensRequest(_Body):
    model: str | None = None
    messages: Annotated[list[AnthropicMessage], Field(min_length=1)]
    system: str | list[AnthropicBlock] | None = None
    tools: list[AnthropicTool] | None = None


def parse_body(cls: type[T], body: Any) -> T:
    """Validate `body` as `cls`; the first problem becomes a 400 naming the field."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    try:
        return cls.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = _param_path(err["loc"])
        got = err.get("input")
        shown = "" if isinstance(got, dict | list) or got is None else f" (got {_short(got)})"
        msg = err["msg"] if err["type"] != "missing" else "this field is required"
        raise APIError(400, f"{param}: {msg}{shown}", code="invalid_value", param=param) from None


def _short(value: Any, limit: int = 80) -> str:
    """A bad value as the error shows it: a 10 MB string is not echoed back."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _param_path(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif _is_union_tag(part):
            continue  # pydantic names the union member it tried ("str", "list[...]")
        else:
            out += f".{part}" if out else str(part)
    return out or "body"


def _is_union_tag(part: str) -> bool:
    return (
        part in {"str", "int", "float", "bool"}
        or "[" in part
        or part.startswith(("function-", "literal[", "Named", "list", "dict"))
        or part[:1].isupper()
    )
