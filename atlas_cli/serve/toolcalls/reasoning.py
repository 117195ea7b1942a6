"""The reasoning split, as vLLM's Qwen3ReasoningParser does it: a generated `<think>` is
stripped, `</think>` ends reasoning, a missing `</think>` means everything was reasoning
(truncated) when the prompt opened the think block and everything was content otherwise, and
`<tool_call>` followed by `<function=` ends reasoning implicitly (Qwen3.5 sometimes calls a
tool without closing it)."""

from __future__ import annotations

import re

from atlas_cli.serve.toolcalls.tags import THINK_CLOSE, THINK_OPEN, TOOL_CALL_OPEN, partial_tag

_FUNCTION_AFTER = re.compile(r"\s*<function=")
_FUNCTION_PENDING = re.compile(r"\s*(?:<(?:f(?:u(?:n(?:c(?:t(?:i(?:o(?:n)?)?)?)?)?)?)?)?)?\Z")


def prompt_opens_thinking(prompt: str) -> bool:
    """Whether a rendered prompt ends inside an open think block (Qwen3.5/3.6 with thinking
    on end the generation prompt with `<think>\\n`), so the output starts as reasoning."""
    return prompt.rstrip().endswith(THINK_OPEN)


def reasoning_end(text: str, pos: int, final: bool) -> tuple[int, int, bool]:
    """How far the reasoning that starts at `text[pos]` reaches, as far as `text` settles
    it: (end of the reasoning text to commit, where the scan goes on, whether reasoning
    ended). Held back until settled: a suffix that may start `</think>` or `<tool_call>`,
    and a `<tool_call>` that `<function=` may still follow."""
    search = pos
    while True:
        close = text.find(THINK_CLOSE, search)
        call = text.find(TOOL_CALL_OPEN, search)
        if call != -1 and (close == -1 or call < close):
            after = call + len(TOOL_CALL_OPEN)
            if _FUNCTION_AFTER.match(text, after):  # implicit end of reasoning
                return call, call, True
            if not final and _FUNCTION_PENDING.match(text, after):
                return call, call, False  # wait and see
            search = call + 1  # a `<tool_call>` mentioned in reasoning text
            continue
        if close != -1:
            return close, close + len(THINK_CLOSE), True
        end = len(text)
        if not final:
            end -= partial_tag(text, pos, (THINK_CLOSE, TOOL_CALL_OPEN))
        return end, end, False
