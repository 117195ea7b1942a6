"""What the parsers produce: whole results (a message and its calls), the events a stream
yields, what a format's block scanner reports to the stream, and call ids."""

from __future__ import annotations

import random
import string
from dataclasses import dataclass
from typing import Any

from atlas_cli.serve.toolcalls.values import FAIL, json_value


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON string, as in OpenAI's `function.arguments`

    def to_openai(self, *, decode_arguments: bool = False) -> dict[str, Any]:
        """OpenAI `tool_calls` entry. `decode_arguments` gives arguments as a dict, which is
        what chat templates iterate (`tool_call.arguments|items`)."""
        arguments: Any = self.arguments
        if decode_arguments:
            decoded = json_value(self.arguments)
            arguments = self.arguments if decoded is FAIL else decoded
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": arguments},
        }


@dataclass(frozen=True)
class ParsedMessage:
    content: str
    reasoning: str | None
    tool_calls: list[ToolCall]

    def to_openai(self, *, decode_arguments: bool = False) -> dict[str, Any]:
        """An assistant message dict (`reasoning_content` as vLLM names it)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content or None}
        if self.reasoning is not None:
            message["reasoning_content"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = [
                c.to_openai(decode_arguments=decode_arguments) for c in self.tool_calls
            ]
        return message


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """OpenAI streaming shape: the first delta of a call has `id` and `name` (and empty
    `arguments`), later ones only a chunk of the arguments JSON string."""

    index: int
    id: str | None
    name: str | None
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        function: dict[str, Any] = {"arguments": self.arguments}
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
        if self.name is not None:
            function["name"] = self.name
        out["function"] = function
        return out


@dataclass(frozen=True)
class ToolCallEnd:
    """A call whose arguments are complete (sent after its last ToolCallDelta)."""

    index: int
    call: ToolCall


Event = ReasoningDelta | ContentDelta | ToolCallDelta | ToolCallEnd


_ID_ALPHABET = string.ascii_letters + string.digits


class ToolCallIds:
    """`call_` + 24 random alphanumerics (vLLM's shape); a seed makes them reproducible."""

    def __init__(self, seed: int | None = None):
        self._rng = random.Random(seed) if seed is not None else random.SystemRandom()

    def __call__(self) -> str:
        return "call_" + "".join(self._rng.choice(_ID_ALPHABET) for _ in range(24))


@dataclass
class CallScan:
    """What a format's block scanner has read of one call so far."""

    name: str
    fragments: list[str]  # the arguments JSON string, in pieces that only ever get appended
    complete: bool


def valid_name(name: str) -> bool:
    return bool(name) and not any(c in name for c in "<>\n\r")
