"""The pieces of `POST /v1/responses` that need no server: input items as chat messages, and
the store of past conversations for `previous_response_id`."""

from __future__ import annotations

import pytest

from atlas_cli.serve.protocol import Message
from atlas_cli.serve.responses_protocol import InputItem, input_messages
from atlas_cli.serve.responses_store import ResponseStore


def test_assistant_items_gather_into_one_turn():
    items = [
        InputItem(role="user", content="Weather?"),
        InputItem(type="reasoning", content=[{"type": "reasoning_text", "text": "Look it up."}]),
        InputItem(role="assistant", content="Checking."),
        InputItem(type="function_call", call_id="call_1", name="f", arguments='{"a": 1}'),
        InputItem(type="function_call", call_id="call_2", name="g"),
        InputItem(type="function_call_output", call_id="call_1", output="one"),
        InputItem(type="function_call_output", call_id="call_2", output="two"),
    ]
    user, assistant, *results = input_messages(items)
    assert user.role == "user" and assistant.role == "assistant"
    assert assistant.content == "Checking." and assistant.reasoning_content == "Look it up."
    assert [(c.id, c.function.name, c.function.arguments) for c in assistant.tool_calls] == [
        ("call_1", "f", '{"a": 1}'),
        ("call_2", "g", "{}"),
    ]
    assert [(m.role, m.tool_call_id, m.content) for m in results] == [
        ("tool", "call_1", "one"),
        ("tool", "call_2", "two"),
    ]


def test_store_drops_the_least_recently_used_within_its_bounds():
    turn = [Message(role="user", content="x" * 10)]
    store = ResponseStore(max_responses=2, max_chars=25)
    store.keep("a", turn)
    store.keep("b", turn)
    store.conversation("a")  # used: "b" is now the oldest
    store.keep("c", turn)
    assert len(store) == 2 and store.conversation("a") == turn
    with pytest.raises(Exception, match="no response 'b'"):
        store.conversation("b")
    store.keep("d", [Message(role="user", content="y" * 20)])  # 10 + 20 > 25: "c" and "a" go
    assert len(store) == 1 and store.conversation("d")[0].content == "y" * 20
    store.keep("huge", [Message(role="user", content="z" * 26)])  # larger than all: not kept
    assert len(store) == 1
