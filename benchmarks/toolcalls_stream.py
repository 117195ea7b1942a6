"""Cost of tool-call parsing, whole and streamed, on a large Qwen3.5 XML call and a Qwen3
JSON call: reasoning, then a `write_file` whose content is this package's parser source
(about 40 KB, full of the format's own tags). Deltas of 4 characters stand in for tokens.

    python benchmarks/toolcalls_stream.py
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from atlas_cli.serve import toolcalls
from atlas_cli.serve.toolcalls import HermesParser, Qwen3CoderParser

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
    start = time.perf_counter()
    for delta in deltas:
        stream.feed(delta)
    stream.finish()
    stream_s = time.perf_counter() - start
    assert json.loads(whole.tool_calls[0].arguments)["content"] == want
    assert stream.message.tool_calls[0].arguments == whole.tool_calls[0].arguments
    print(
        f"{name}: {len(text)} chars; whole parse {whole_s * 1e3:.1f} ms; "
        f"{len(deltas)} deltas streamed in {stream_s * 1e3:.0f} ms "
        f"({stream_s / len(deltas) * 1e6:.1f} us/delta)"
    )


def main() -> None:
    package = Path(toolcalls.__file__).parent
    code = "\n".join(p.read_text() for p in sorted(package.glob("*.py")))
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
