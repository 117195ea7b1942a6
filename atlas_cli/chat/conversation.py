"""The conversation: a system prompt and the turns after it, its JSON form, and fitting it
into the context window.

A turn is one user message and the replies after it. When a prompt would overflow the context,
`turns_to_drop` finds the fewest oldest turns whose removal makes room; the REPL asks before
dropping anything.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from atlas_cli.errors import UsageError

FORMAT = "atlas-chat"
FORMAT_VERSION = 1
ROLES = ("system", "user", "assistant")

Message = dict[str, str]


@dataclass
class Conversation:
    system: str | None = None
    turns: list[Message] = field(default_factory=list)  # user/assistant messages, in order

    def messages(self) -> list[Message]:
        return self._head() + self.turns

    def _head(self) -> list[Message]:
        return [{"role": "system", "content": self.system}] if self.system else []

    def add(self, role: str, content: str, reasoning: str = "") -> None:
        message = {"role": role, "content": content}
        if reasoning:
            # Qwen3-style templates read it; others ignore the extra key
            message["reasoning_content"] = reasoning
        self.turns.append(message)

    def pop_last(self, role: str) -> Message | None:
        if self.turns and self.turns[-1]["role"] == role:
            return self.turns.pop()
        return None

    def clear(self) -> None:
        self.turns.clear()

    @property
    def turn_starts(self) -> list[int]:
        return [i for i, m in enumerate(self.turns) if m["role"] == "user"]

    def without_oldest(self, n: int) -> list[Message]:
        """The messages with the `n` oldest turns removed (the system prompt stays)."""
        if n <= 0 or not self.turn_starts:
            return self.messages()
        return self._head() + self.turns[self._cut(n) :]

    def drop_oldest(self, n: int) -> None:
        del self.turns[: self._cut(n)]

    def _cut(self, n: int) -> int:
        """Where in `turns` the turns after the `n` oldest begin."""
        starts = self.turn_starts
        return starts[n] if n < len(starts) else len(self.turns)

    # -- files -------------------------------------------------------------------------------

    def to_json(self, model: str, options: dict[str, Any]) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "model": model,
            "options": options,
            "messages": self.messages(),
        }

    def save(self, path: Path, model: str, options: dict[str, Any]) -> None:
        text = json.dumps(self.to_json(model, options), indent=2, ensure_ascii=False)
        try:
            path.write_text(text + "\n", encoding="utf-8")
        except OSError as exc:
            raise UsageError(f"cannot write {path}: {exc.strerror or exc}") from None

    @classmethod
    def from_json(cls, data: Any) -> tuple[Conversation, dict[str, Any]]:
        """A conversation and the saved options from our format, or from a bare list of
        OpenAI-style messages."""
        if isinstance(data, list):
            data = {"messages": data}
        if not isinstance(data, dict) or not isinstance(data.get("messages"), list):
            raise UsageError("not a saved conversation: expected an object with 'messages'")
        conv = cls()
        for i, m in enumerate(data["messages"]):
            if (
                not isinstance(m, dict)
                or m.get("role") not in ROLES
                or not isinstance(m.get("content"), str)
            ):
                raise UsageError(f"message {i + 1}: expected a role ({'/'.join(ROLES)}) and text")
            if m["role"] == "system":
                if i:
                    raise UsageError(f"message {i + 1}: a system message must come first")
                conv.system = m["content"]
            else:
                conv.add(m["role"], m["content"], str(m.get("reasoning_content") or ""))
        options = data.get("options") if isinstance(data.get("options"), dict) else {}
        if isinstance(data.get("model"), str):
            options = {**options, "model": data["model"]}
        return conv, options

    @classmethod
    def load(cls, path: Path) -> tuple[Conversation, dict[str, Any]]:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from None
        except ValueError as exc:
            raise UsageError(f"{path}: not valid JSON ({exc})") from None
        return cls.from_json(data)


@dataclass(frozen=True)
class Fit:
    """How a prompt fits the context: `drop` oldest turns make it fit; None: nothing does."""

    tokens: int  # the prompt as it stands
    needed: int  # tokens plus the room kept for the reply
    limit: int
    drop: int | None
    tokens_after: int  # the prompt after dropping (when nothing helps: with all turns dropped)

    @property
    def fits(self) -> bool:
        return self.drop == 0


def reply_room(max_tokens: int, context: int) -> int:
    """Tokens kept free for the answer: all of max_tokens, but never more than a quarter of
    the context (a long max_tokens must not make every prompt 'overflow')."""
    return max(1, min(max_tokens, context // 4))


def plan_fit(
    conv: Conversation, count: Callable[[list[Message]], int], context: int, reply: int
) -> Fit:
    """The fewest oldest turns to drop so that the prompt plus `reply` tokens fit `context`.
    The last turn (the one being asked) is never dropped."""
    tokens = count(conv.messages())
    if tokens + reply <= context:
        return Fit(tokens, tokens + reply, context, 0, tokens)
    # dropping more turns never lengthens the prompt: binary-search the fewest that suffice
    lo, hi = 1, max(len(conv.turn_starts) - 1, 0)
    best: tuple[int, int] | None = None
    while lo <= hi:
        mid = (lo + hi) // 2
        after = count(conv.without_oldest(mid))
        if after + reply <= context:
            best, hi = (mid, after), mid - 1
        else:
            lo = mid + 1
    if best is None:
        alone = count(conv.without_oldest(len(conv.turn_starts) - 1))
        return Fit(tokens, tokens + reply, context, None, alone)
    return Fit(tokens, tokens + reply, context, best[0], best[1])
