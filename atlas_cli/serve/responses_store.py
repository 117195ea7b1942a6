"""Past responses' conversations, for `previous_response_id`: a follow-up sends only its new
items and the server supplies what came before. Kept in memory for the server's lifetime,
within a bound on how many and how much text, the least recently used dropped first.

A conversation is kept as chat messages (the input, then the answer as one assistant turn)
without the request's `instructions`, which the API does not carry over to a follow-up.
"""

from __future__ import annotations

from collections import OrderedDict

from atlas_cli.serve.errors import APIError
from atlas_cli.serve.protocol import Message

MAX_RESPONSES = 1024
# a conversation's text is counted whole in every response that continues it (they share the
# messages, so this overstates the memory held): a long agent run keeps its recent turns
MAX_CHARS = 64 * 1024 * 1024


def conversation_chars(messages: list[Message]) -> int:
    total = 0
    for msg in messages:
        total += len(msg.content) if isinstance(msg.content, str) else 0
        total += len(msg.reasoning_content or "")
        for call in msg.tool_calls or []:
            args = call.function.arguments
            total += len(call.function.name) + (len(args) if isinstance(args, str) else 0)
    return total


class ResponseStore:
    def __init__(self, max_responses: int = MAX_RESPONSES, max_chars: int = MAX_CHARS):
        self.max_responses = max_responses
        self.max_chars = max_chars
        self._entries: OrderedDict[str, tuple[list[Message], int]] = OrderedDict()
        self._chars = 0

    def __len__(self) -> int:
        return len(self._entries)

    def conversation(self, response_id: str) -> list[Message]:
        """The conversation up to and including the answer of `response_id` (404 if unknown)."""
        entry = self._entries.get(response_id)
        if entry is None:
            raise APIError(
                404,
                f"previous_response_id: no response {response_id!r} is kept here (the server "
                f"keeps those made with store true in memory, the {self.max_responses} most "
                "recently used at most)",
                code="previous_response_not_found",
                param="previous_response_id",
            )
        self._entries.move_to_end(response_id)  # a conversation going on stays
        return list(entry[0])

    def keep(self, response_id: str, messages: list[Message]) -> None:
        size = conversation_chars(messages)
        if size > self.max_chars:
            return  # it would push out everything else and still not fit
        self._entries[response_id] = (list(messages), size)
        self._chars += size
        while len(self._entries) > self.max_responses or self._chars > self.max_chars:
            _, (_, dropped) = self._entries.popitem(last=False)
            self._chars -= dropped
