"""The reasoning split (`<think>`) around and between tool calls, whole and streamed, and
which rendered prompts open a think block."""

from __future__ import annotations

import pytest

from atlas_cli.backend.tokenizer import render_template
from atlas_cli.serve.toolcalls import (
    ContentDelta,
    HermesParser,
    NoToolParser,
    Qwen3CoderParser,
    ReasoningDelta,
    prompt_opens_thinking,
    split_reasoning,
)
from tests.toolcall_helpers import (
    QWEN3_TEMPLATE,
    QWEN35_TEMPLATE,
    TOOLS,
    Case,
    assert_sample,
    assert_stream_matches_whole,
    stream,
    xml_call,
)

REASONING_CASES = [
    Case(
        "stray-think-close-thinking-off",
        Qwen3CoderParser,
        "Sure.</think>\n\nThe answer is 4.",
        content="Sure.</think>\n\nThe answer is 4.",
    ),
    Case(
        "second-think-close-is-content",
        HermesParser,
        "<think>\na\n</think>\n\nb</think>c",
        content="b</think>c",
        reasoning="a",
    ),
    Case(
        "partial-tag-at-end",
        Qwen3CoderParser,
        "Answer: 4 <tool_ca",
        content="Answer: 4 <tool_ca",
    ),
    Case(
        "no-tool-parser-keeps-tags",
        NoToolParser,
        "x\n</think>\n\n" + xml_call("bash", [("command", "ls")]),
        content=xml_call("bash", [("command", "ls")]),
        reasoning="x",
        opened=True,
    ),
    Case("empty-output", Qwen3CoderParser, "", content=""),
    Case("empty-output-thinking", Qwen3CoderParser, "", content="", opened=True),
]


@pytest.mark.parametrize("case", REASONING_CASES, ids=[c.id for c in REASONING_CASES])
def test_samples(case: Case):
    assert_sample(case)


@pytest.mark.parametrize("case", REASONING_CASES, ids=[c.id for c in REASONING_CASES])
def test_streaming_equals_whole_parse(case: Case):
    assert_stream_matches_whole(case)


def test_no_partial_tag_leaks_into_content_or_reasoning():
    text = (
        "Checking the tag </thi</think>\n\nLet me look.\n\n"
        + xml_call("bash", [("command", "ls")])
        + "\n"
        + xml_call("bash", [("command", "pwd")])
    )
    message, events = stream(Qwen3CoderParser(TOOLS), list(text), opened=True)
    assert message.reasoning == "Checking the tag </thi"
    assert message.content == "Let me look."
    for e in events:
        if isinstance(e, ContentDelta):
            assert "<" not in e.text
    streamed = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    assert streamed == "Checking the tag </thi"


def test_split_reasoning():
    assert split_reasoning("a\n</think>\n\nb", True) == ("a", "b")
    assert split_reasoning("<think>\na\n</think>\n\nb", False) == ("a", "b")
    assert split_reasoning("just text", False) == (None, "just text")
    assert split_reasoning("cut off", True) == ("cut off", "")
    assert split_reasoning("r\n<tool_call>\n<function=f>\n", True) == (
        "r",
        "<tool_call>\n<function=f>",
    )
    assert split_reasoning("r <tool_call> {json}", True) == ("r <tool_call> {json}", "")


def test_generation_prompt_opens_thinking():
    messages = [{"role": "user", "content": "hi"}]

    def prompt(template: str, **kw) -> str:
        return render_template(
            template, messages=messages, tools=TOOLS, add_generation_prompt=True, **kw
        )

    assert prompt_opens_thinking(prompt(QWEN35_TEMPLATE))
    assert prompt_opens_thinking(prompt(QWEN35_TEMPLATE, enable_thinking=True))
    assert not prompt_opens_thinking(prompt(QWEN35_TEMPLATE, enable_thinking=False))
    assert not prompt_opens_thinking(prompt(QWEN3_TEMPLATE))
    assert not prompt_opens_thinking(prompt(QWEN3_TEMPLATE, enable_thinking=False))
