"""A response's `output` items, built from a turn's events (serve.toolcalls), and the typed
stream events that announce them (without `sequence_number`, which the stream adds).

One builder serves both ways of answering: a streamed response sends the events as they come,
a whole one keeps only the items, so both hold the same output for the same generated text.
Each run of reasoning is a `reasoning` item, each run of text a `message` item with one
`output_text` part, each tool call a `function_call` item; a new kind of text closes the item
before it, and a call's item closes when the parser has its whole arguments.
"""

from __future__ import annotations

from typing import Any

from atlas_cli.serve.http import new_id
from atlas_cli.serve.toolcalls import (
    ContentDelta,
    Event,
    ReasoningDelta,
    ToolCallDelta,
    ToolCallEnd,
)

# per text kind: the item it opens, its content part, and the event names of its text
_TEXT_KINDS: dict[str, dict[str, Any]] = {
    "message": {
        "id_prefix": "msg_",
        "item": {"type": "message", "role": "assistant"},
        "part": {"type": "output_text", "annotations": [], "logprobs": []},
        "delta": "response.output_text.delta",
        "done": "response.output_text.done",
        "logprobs": True,
    },
    "reasoning": {
        "id_prefix": "rs_",
        "item": {"type": "reasoning", "summary": []},
        "part": {"type": "reasoning_text"},
        "delta": "response.reasoning_text.delta",
        "done": "response.reasoning_text.done",
        "logprobs": False,
    },
}


class _TextItem:
    def __init__(self, kind: str, index: int):
        self.kind = kind
        self.spec = _TEXT_KINDS[kind]
        self.id = new_id(self.spec["id_prefix"])
        self.index = index
        self.pieces: list[str] = []

    def where(self) -> dict[str, Any]:
        return {"item_id": self.id, "output_index": self.index, "content_index": 0}

    def part(self) -> dict[str, Any]:
        return {**self.spec["part"], "text": "".join(self.pieces)}

    def item(self, status: str, with_part: bool) -> dict[str, Any]:
        content = [self.part()] if with_part else []
        return {"id": self.id, **self.spec["item"], "content": content, "status": status}


class _CallItem:
    def __init__(self, call_id: str, name: str, index: int):
        self.id = new_id("fc_")
        self.call_id = call_id
        self.name = name
        self.index = index
        self.pieces: list[str] = []

    def item(self, status: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function_call",
            "call_id": self.call_id,
            "name": self.name,
            "arguments": "".join(self.pieces),
            "status": status,
        }


class OutputItems:
    """Feed a turn's events, then `finish`; `items` is then the response's `output`."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._text: _TextItem | None = None  # the reasoning or message item being written
        self._calls: dict[int, _CallItem] = {}  # calls still open, by the parser's index

    def feed(self, event: Event) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if isinstance(event, ReasoningDelta | ContentDelta):
            if event.text:
                kind = "reasoning" if isinstance(event, ReasoningDelta) else "message"
                self._text_delta(kind, event.text, out)
        elif isinstance(event, ToolCallDelta):
            self._call_delta(event, out)
        elif isinstance(event, ToolCallEnd):
            call = self._calls.pop(event.index, None)
            if call is not None:
                self._close_call(call, "completed", out)
        return out

    def finish(self, incomplete: bool) -> list[dict[str, Any]]:
        """Close what is open (`incomplete`: the token limit cut it off). An answer with no
        text and no call still gets its (empty) message, as clients read `output` for one."""
        out: list[dict[str, Any]] = []
        status = "incomplete" if incomplete else "completed"
        if self._text is not None:
            self._close_text(status, out)
        for call in list(self._calls.values()):
            self._close_call(call, status, out)
        self._calls.clear()
        if not any(item["type"] in ("message", "function_call") for item in self.items):
            self._open_text("message", out)
            self._close_text(status, out)
        return out

    # -- text ------------------------------------------------------------------------------

    def _text_delta(self, kind: str, text: str, out: list[dict[str, Any]]) -> None:
        if self._text is not None and self._text.kind != kind:
            self._close_text("completed", out)
        if self._text is None:
            self._open_text(kind, out)
        item = self._text
        item.pieces.append(text)
        delta = {"type": item.spec["delta"], **item.where(), "delta": text}
        if item.spec["logprobs"]:
            delta["logprobs"] = []
        out.append(delta)

    def _open_text(self, kind: str, out: list[dict[str, Any]]) -> None:
        item = self._text = _TextItem(kind, len(self.items))
        self.items.append(item.item("in_progress", with_part=False))
        out.append(_item_event("added", item.index, item.item("in_progress", with_part=False)))
        added = {"type": "response.content_part.added", **item.where(), "part": item.part()}
        out.append(added)

    def _close_text(self, status: str, out: list[dict[str, Any]]) -> None:
        item, self._text = self._text, None
        text = "".join(item.pieces)
        done = {"type": item.spec["done"], **item.where(), "text": text}
        if item.spec["logprobs"]:
            done["logprobs"] = []
        out.append(done)
        out.append({"type": "response.content_part.done", **item.where(), "part": item.part()})
        self.items[item.index] = item.item(status, with_part=True)
        out.append(_item_event("done", item.index, item.item(status, with_part=True)))

    # -- calls -----------------------------------------------------------------------------

    def _call_delta(self, event: ToolCallDelta, out: list[dict[str, Any]]) -> None:
        call = self._calls.get(event.index)
        if call is None:  # its first delta: the id and name
            if self._text is not None:
                self._close_text("completed", out)
            call = _CallItem(event.id or "", event.name or "", len(self.items))
            self._calls[event.index] = call
            self.items.append(call.item("in_progress"))
            out.append(_item_event("added", call.index, call.item("in_progress")))
        if event.arguments:
            call.pieces.append(event.arguments)
            out.append(
                {
                    "type": "response.function_call_arguments.delta",
                    "item_id": call.id,
                    "output_index": call.index,
                    "delta": event.arguments,
                }
            )

    def _close_call(self, call: _CallItem, status: str, out: list[dict[str, Any]]) -> None:
        item = call.item(status)
        out.append(
            {
                "type": "response.function_call_arguments.done",
                "item_id": call.id,
                "output_index": call.index,
                "arguments": item["arguments"],
            }
        )
        self.items[call.index] = item
        out.append(_item_event("done", call.index, call.item(status)))


def _item_event(what: str, index: int, item: dict[str, Any]) -> dict[str, Any]:
    return {"type": f"response.output_item.{what}", "output_index": index, "item": item}
