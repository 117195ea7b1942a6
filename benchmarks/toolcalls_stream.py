"""Tool-call parsing, whole and streamed, on a large Qwen3.5 XML call and a Qwen3 JSON call:
reasoning, then a `write_file` whose content is 40,000 characters of this package's parser
source (full of the format's own tags). Deltas of 4 characters stand in for tokens.

Prints the parse cost, and when a client sees the call: the delta that brings the first
tool-call delta (its id and name) and the first argument piece, counted from the delta that
opens `<tool_call>`, against the delta that closes it. An agent harness's time to first token
on a tool-call turn is the first of these.

    python benchmarks/toolcalls_stream.py
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from atlas_cli.serve import toolcalls
from atlas_cli.serve.toolcalls import HermesParser, Qwen3CoderParser, ToolCallDelta

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
            },
        },
    }
]


def run(name: str, parser_cls, text: str, opened: bool, want: str) -> None:
    start = time.perf_counter()
    whole = parser_cls(TOOLS).parse(text, prompt_opened_think=opened)
    whole_s = time.perf_counter() - start
    deltas = [text[i : i + 4] for i in range(0, len(text), 4)]
    stream = parser_cls(TOOLS).stream(prompt_opened_think=opened)
    first_name = first_args = None
    start = time.perf_counter()
    for i, delta in enumerate(deltas):
        for event in stream.feed(delta):
            if isinstance(event, ToolCallDelta):
                first_name = i if first_name is None else first_name
                if event.arguments and first_args is None:
                    first_args = i
    stream.finish()
    stream_s = time.perf_counter() - start
    assert json.loads(whole.tool_calls[0].arguments)["content"] == want
    assert stream.message.tool_calls[0].arguments == whole.tool_calls[0].arguments
    opens = text.index("<tool_call>") // 4
    closes = (text.rindex("</tool_call>") + len("</tool_call>") - 1) // 4  # the code holds some
    print(
        f"{name}: {len(text)} chars; whole parse {whole_s * 1e3:.1f} ms; "
        f"{len(deltas)} deltas streamed in {stream_s * 1e3:.0f} ms "
        f"({stream_s / len(deltas) * 1e6:.1f} us/delta)"
    )
    print(
        f"  call open at delta {opens}, closed at {closes} ({closes - opens} deltas later); "
        f"first tool-call delta +{first_name - opens}, first argument piece "
        f"+{first_args - opens} deltas after the open"
    )


def main() -> None:
    package = Path(toolcalls.__file__).parent
    code = "\n".join(p.read_text() for p in sorted(package.glob("*.py")))[:40_000]
    reasoning = "I should write the file carefully. " * 300
    xml = (
        f"{reasoning}\n</think>\n\nWriting it.\n\n<tool_call>\n<function=write_file>\n"
        f"<parameter=path>\nx.py\n</parameter>\n<parameter=content>\n{code}\n</parameter>\n"
        "</function>\n</tool_call>"
    )
    run("qwen3_coder", Qwen3CoderParser, xml, True, code)
    call = json.dumps({"name": "write_file", "arguments": {"path": "x.py", "content": code}})
    hermes = f"<think>\n{reasoning}\n</think>\n\n<tool_call>\n{call}\n</tool_call>"
    run("hermes", HermesParser, hermes, False, code)


if __name__ == "__main__":
    main()
