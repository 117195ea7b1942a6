"""The parser base: a format names the tags that open a call block and scans its blocks;
parsing, whole or streamed, is the one state machine in `stream.py`. `NoToolParser` is the
base as it stands: the reasoning split only."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

from atlas_cli.serve.toolcalls.events import CallScan, ParsedMessage, ToolCallIds
from atlas_cli.serve.toolcalls.stream import StreamParser
from atlas_cli.serve.toolcalls.tags import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from atlas_cli.serve.toolcalls.values import arguments_value, dumps, tools_from_openai


class ToolParser:
    """Base: no tool calls. Subclasses name the tags that open a call block and scan blocks."""

    name: ClassVar[str] = "none"
    # opening tag of a call block -> its closing tag (a stray closer is dropped from content)
    blocks: ClassVar[dict[str, str]] = {}
    # opening tags that belong to the block body (a bare `<function=...>` is its own body)
    keep_opener: ClassVar[frozenset[str]] = frozenset()
    # openers of a call block honoured only as the first thing the content says (a fenced
    # JSON call), -> their closing tags; never looked for anywhere else
    leading_blocks: ClassVar[dict[str, str]] = {}
    tags: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        tools: Iterable[Any] | Mapping[str, dict] | None = None,
        *,
        seed: int | None = None,
    ):
        if isinstance(tools, Mapping):
            self.schemas: dict[str, dict] = {k: dict(v) for k, v in tools.items()}
        else:
            self.schemas = tools_from_openai(tools)
        self.new_id = ToolCallIds(seed)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Tags the content scan looks for: block openers, then stray closers (`</tool_call>`
        # left over from a nested or duplicated block), which are dropped from content.
        closers = [c for c in dict.fromkeys(cls.blocks.values()) if c not in cls.blocks]
        cls.tags = (*cls.blocks, *closers)

    def scan_block(
        self, text: str, start: int, opener: str, final: bool, memo: dict[Any, Any]
    ) -> tuple[list[CallScan], int | None]:
        """The calls in a block whose body starts at `text[start]` (after `opener`), as far
        as `text` settles them, and the index just after the block (None while unknown;
        always known when `final`). No calls in an ended block: it was text after all.
        `memo` is the block's scratch space between deltas."""
        return [], len(text)

    @classmethod
    def render_call(cls, name: str, arguments: Any) -> str:
        """An assistant call as the text this format's model writes (the server puts it in
        history when a chat template cannot render `tool_calls`); Hermes JSON by default.
        `arguments` is a dict or its JSON text."""
        args = arguments_value(arguments)
        body = dumps({"name": name, "arguments": args})
        return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"

    def stream(self, *, prompt_opened_think: bool = False) -> StreamParser:
        return StreamParser(self, prompt_opened_think=prompt_opened_think)

    def parse(self, text: str, *, prompt_opened_think: bool = False) -> ParsedMessage:
        stream = self.stream(prompt_opened_think=prompt_opened_think)
        stream.feed(text)
        stream.finish()
        return stream.message


class NoToolParser(ToolParser):
    """Reasoning split only; tool-call tags stay content text."""

    name = "none"


def split_reasoning(text: str, prompt_opened_think: bool = False) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole output; tool-call text stays in content."""
    message = NoToolParser().parse(text, prompt_opened_think=prompt_opened_think)
    return message.reasoning, message.content
