"""Tool calls stream as they are written, in both syntaxes: the streamed argument pieces add up
to the final arguments on every chunking, the name goes out tokens before the call ends, and a
call cut off by the token limit ends with what was written, never as content."""

from __future__ import annotations

import json
import random

import pytest

from atlas_cli.serve.toolcalls import (
    ContentDelta,
    HermesParser,
    Qwen3CoderParser,
    ToolCallDelta,
    ToolCallEnd,
)
from atlas_cli.serve.toolcalls.values import dumps
from tests.test_toolcalls_hermes import HERMES_CASES
from tests.test_toolcalls_qwen3_coder import XML_CASES
from tests.toolcall_helpers import (
    CODE,
    SEARCH_ARGS,
    SEARCH_PARAMS,
    TAGGY_CODE,
    TOOLS,
    json_call,
    random_split,
    stream,
    xml_call,
)


def streamed_arguments(events) -> dict[int, str]:
    """Each call's arguments as a client adds up the streamed pieces."""
    out: dict[int, str] = {}
    for e in events:
        if isinstance(e, ToolCallDelta):
            out[e.index] = out.get(e.index, "") + e.arguments
    return out


def assert_pieces_add_up(parser_cls, text: str, opened: bool, seed: str, splits: int = 30):
    whole = parser_cls(TOOLS, seed=1).parse(text, prompt_opened_think=opened)
    rng = random.Random(seed)
    for _ in range(splits):
        pieces = random_split(text, rng) if text else [""]
        message, events = stream(parser_cls(TOOLS, seed=1), pieces, opened)
        assert message == whole
        args = streamed_arguments(events)
        assert [args[i] for i in sorted(args)] == [c.arguments for c in whole.tool_calls]
    return whole


@pytest.mark.parametrize("case", HERMES_CASES + XML_CASES, ids=lambda c: c.id)
def test_streamed_pieces_add_up_to_the_arguments(case):
    assert_pieces_add_up(case.parser, case.text, case.opened, case.id)


# -- random JSON arguments: the whole result is what json.loads then dumps of them gives --------

ALPHABET = 'ab Z09_-.,:{}[]"\\/\n\t\x01é中🙂</tool_call><parameter=x>'


def random_string(rng: random.Random) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 12)))


def random_value(rng: random.Random, depth: int = 0):
    kind = rng.randint(0, 8 if depth < 3 else 5)
    if kind == 0:
        return rng.randint(-(10**12), 10**12)
    if kind == 1:
        return rng.choice([0.5, -1.25e-7, 3.0, 1e21, 123.456])
    if kind == 2:
        return rng.choice([True, False, None])
    if kind <= 5:
        return random_string(rng)
    if kind <= 6:
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {
        random_string(rng) + str(i): random_value(rng, depth + 1) for i in range(rng.randint(0, 4))
    }


def written(rng: random.Random, value) -> str:
    """JSON as a model may write it: any spacing, ASCII escapes or not."""
    indent = rng.choice([None, None, 2])
    separators = rng.choice([None, (",", ":"), (" , ", " : ")])
    return json.dumps(value, indent=indent, separators=separators, ensure_ascii=rng.random() < 0.4)


def test_random_json_arguments_stream_to_the_canonical_whole():
    rng = random.Random(2024)
    for n in range(300):
        args = {f"k{i}": random_value(rng) for i in range(rng.randint(0, 5))}
        name = rng.choice(["bash", "search", "write_file", "get_weather"])
        call = written(rng, {"name": name, "arguments": args})
        text = rng.choice(["", "Sure.\n"]) + f"<tool_call>\n{call}\n</tool_call>"
        whole = assert_pieces_add_up(HermesParser, text, False, f"json-{n}", splits=4)
        (got,) = whole.tool_calls
        assert got.name == name and got.arguments == dumps(args)  # what a whole parse gave


def test_xml_string_values_with_tags_stream_per_parameter():
    text = xml_call("write_file", [("path", "a.py"), ("content", TAGGY_CODE + CODE)])
    whole = assert_pieces_add_up(Qwen3CoderParser, text, False, "taggy")
    assert json.loads(whole.tool_calls[0].arguments)["content"] == TAGGY_CODE + CODE


# -- the name goes out as soon as it is written, measured in tokens --------------------------


@pytest.fixture(scope="module")
def tokens(smollm2_path):
    """The default model's tokenizer: a call's text as the pieces a model streams."""
    from atlas_cli.backend import tokenizer as tok
    from atlas_cli.backend.loaders import gguf

    tokenizer = tok.from_gguf_metadata(gguf.open_gguf(smollm2_path).metadata)

    def split(text: str) -> list[str]:
        ids = tokenizer.encode(text)
        texts = [tokenizer.decode(ids[: i + 1]) for i in range(len(ids))]
        assert texts[-1] == text
        return [b[len(a) :] for a, b in zip(["", *texts], texts, strict=False)]

    return split


def token_indices(parser_cls, pieces: list[str]) -> tuple[int, int, int]:
    """(token that brought the name delta, the first argument piece, the whole call)."""
    sp = parser_cls(TOOLS, seed=0).stream()
    name = first_args = end = -1
    for i, piece in enumerate(pieces):
        for e in sp.feed(piece):
            if isinstance(e, ToolCallDelta) and e.name and name < 0:
                name = i
            if isinstance(e, ToolCallDelta) and e.arguments and first_args < 0:
                first_args = i
            if isinstance(e, ToolCallEnd) and end < 0:
                end = i
    return name, first_args, end


@pytest.mark.parametrize(
    ("parser_cls", "text", "name_upto"),
    [
        (HermesParser, json_call("search", SEARCH_ARGS), '"search",'),
        (HermesParser, json_call("write_file", {"path": "a.py", "content": CODE}), '"write_file",'),
        (Qwen3CoderParser, xml_call("search", SEARCH_PARAMS), "<function=search>"),
    ],
    ids=["hermes-search", "hermes-write-file", "xml-search"],
)
def test_the_name_arrives_tokens_before_the_call_ends(tokens, parser_cls, text, name_upto):
    pieces = tokens(text)
    close = next(i for i in range(len(pieces)) if "</tool_call>" in "".join(pieces[: i + 1]))
    settled = next(i for i in range(len(pieces)) if name_upto in "".join(pieces[: i + 1]))
    name, first_args, end = token_indices(parser_cls, pieces)
    assert name == settled  # the very token that settles the name
    assert name < first_args < end <= close
    assert close - name >= 20  # the whole call was still to come


# -- cut off by the token limit -------------------------------------------------------------


@pytest.mark.parametrize(
    ("parser_cls", "text", "name"),
    [
        (HermesParser, json_call("search", SEARCH_ARGS), '"search"'),
        (
            HermesParser,
            json_call("write_file", {"path": "x", "content": TAGGY_CODE}),
            '"write_file"',
        ),
        (Qwen3CoderParser, xml_call("search", SEARCH_PARAMS), "<function=search>"),
        (Qwen3CoderParser, xml_call("write_file", [("content", CODE)]), "<function=write_file>"),
    ],
    ids=["hermes-search", "hermes-write-file", "xml-search", "xml-write-file"],
)
def test_a_call_cut_off_keeps_what_was_written(parser_cls, text, name):
    """Every cut after the name: a call whose arguments are valid JSON holding the members
    written whole so far, never content; streamed or whole alike."""
    prefix = "Let me look.\n"
    full = json.loads(parser_cls(TOOLS).parse(prefix + text).tool_calls[0].arguments)
    start = len(prefix) + text.index(name) + len(name)
    rng = random.Random(name)
    seen = set()
    for cut in range(start, len(prefix) + len(text)):
        cut_text = (prefix + text)[:cut]
        whole = parser_cls(TOOLS, seed=2).parse(cut_text)
        assert whole.content == "Let me look."
        (call,) = whole.tool_calls
        args = json.loads(call.arguments)
        assert call.name == name.strip('"').removeprefix("<function=").rstrip(">")
        assert set(args) <= set(full)
        for key, value in args.items():  # members so far; a string may be cut short
            if isinstance(full[key], str):
                assert full[key].startswith(value)
            elif parser_cls is HermesParser and not isinstance(value, dict | list):
                assert value == full[key]  # a number is written once it has ended
        seen.add(tuple(args))
        message, events = stream(parser_cls(TOOLS, seed=2), random_split(cut_text, rng), False)
        assert message == whole
        assert not any(isinstance(e, ContentDelta) and "<tool_call>" in e.text for e in events)
        assert streamed_arguments(events)[0] == call.arguments
    assert len(seen) == len(full) + 1  # the cuts saw the members come one by one
