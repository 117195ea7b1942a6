"""Constrained decoding (backend/constraint.py, serve/grammar.py): with `tool_choice` required
every answer is a schema-valid call, `auto` still lets the model answer in prose, JSON mode
always parses and validates, streamed and whole answers agree, and speculation keeps the
output of the constrained run without it.

Random schemas are seeded. Most are checked at the mask level (a valid call, rendered in the
model's syntax, fits the grammar token by token; an invalid one does not); a few dozen run
through the real default model, greedy, and the answer is parsed and validated with
`jsonschema` (an independent validator)."""

from __future__ import annotations

import itertools
import json
import re
import string
from pathlib import Path

import numpy as np
import pytest

from atlas_cli.backend.constraint import Constraint, grammar_tokenizer, new_constraint
from atlas_cli.backend.engine import Engine, GenerationStats
from atlas_cli.backend.sample import SamplingParams
from atlas_cli.errors import GrammarError
from atlas_cli.serve.grammar import GrammarRequest, build_grammar, other_name_regex
from atlas_cli.serve.toolcalls import HermesParser, Qwen3CoderParser
from tests.serve_helpers import streamed_call

jsonschema = pytest.importorskip("jsonschema")

FIXTURES = Path(__file__).parent / "fixtures" / "qwen"
GREEDY = SamplingParams(temperature=0)
WORDS = ["alpha", "beta", "gamma", "delta", "omega", "red", "blue", "north", "south"]


# -- random schemas and instances ------------------------------------------------------------


def random_value_schema(rng, depth: int = 0) -> dict:
    kinds = ["string", "enum", "integer", "number", "boolean", "array"]
    kind = rng.choice(kinds + (["object"] if depth == 0 else []))
    if kind == "string":
        return {"type": "string", "maxLength": int(rng.integers(1, 12))}
    if kind == "enum":
        return {"type": "string", "enum": list(rng.choice(WORDS, 3, replace=False))}
    if kind == "integer":
        lo = int(rng.integers(-50, 50))
        return {"type": "integer", "minimum": lo, "maximum": lo + int(rng.integers(0, 200))}
    if kind == "number":
        return {"type": "number", "minimum": -10, "maximum": 100}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "array":
        item = {"type": "integer", "minimum": 0, "maximum": 99}
        return {"type": "array", "items": item, "maxItems": int(rng.integers(1, 4))}
    return random_object_schema(rng, depth + 1, int(rng.integers(1, 3)))


def random_object_schema(rng, depth: int, n: int) -> dict:
    names = [f"{w}_{i}" for i, w in enumerate(rng.choice(WORDS, n, replace=False))]
    props = {name: random_value_schema(rng, depth) for name in names}
    required = [name for name in names if rng.random() < 0.7] or names[:1]
    return {
        "type": "object",
        "properties": props,
        "required": required,
        "additionalProperties": False,
    }


def random_tools(rng) -> dict[str, dict]:
    count = int(rng.integers(1, 4))
    return {
        f"{rng.choice(WORDS)}_tool_{i}": random_object_schema(rng, 0, int(rng.integers(1, 4)))
        for i in range(count)
    }


def random_instance(rng, schema: dict):
    """A value valid under the schemas `random_value_schema` writes."""
    kind = schema.get("type")
    if "enum" in schema:
        return str(rng.choice(schema["enum"]))
    if kind == "string":
        letters = list(string.ascii_lowercase + " ")
        return "".join(rng.choice(letters, int(rng.integers(1, schema["maxLength"] + 1))))
    if kind == "integer":
        return int(rng.integers(schema["minimum"], schema["maximum"] + 1))
    if kind == "number":
        return round(float(rng.uniform(-10, 100)), 2)
    if kind == "boolean":
        return bool(rng.random() < 0.5)
    if kind == "array":
        return [int(v) for v in rng.integers(0, 100, int(rng.integers(0, schema["maxItems"] + 1)))]
    return {
        k: random_instance(rng, s)
        for k, s in schema["properties"].items()
        if k in schema["required"] or rng.random() < 0.5
    }


def hermes_call(name: str, args: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


def xml_call(name: str, args: dict) -> str:
    params = "".join(
        f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
        for k, v in args.items()
    )
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def broken(rng, schema: dict, args: dict, xml: bool) -> dict | None:
    """`args` made invalid: a required argument dropped, or one given a value of a wrong type
    (in XML any text is a string: there only enums and non-string types can break)."""
    present = sorted(k for k in args if k in schema["required"])
    if present and rng.random() < 0.5:
        key = str(rng.choice(present))
        return {k: v for k, v in args.items() if k != key}
    props = schema["properties"]
    keys = [
        k for k in sorted(args) if not xml or props[k].get("type") != "string" or "enum" in props[k]
    ]
    if not keys:
        return None
    key = str(rng.choice(keys))
    kind = "enum" if "enum" in props[key] else props[key].get("type")
    wrong = {"string": 7, "enum": "zzz", "integer": "x", "number": "x", "boolean": "maybe"}
    return {**args, key: wrong.get(kind, "x")}


def fits(gtok, grammar: str, text: str) -> bool:
    """Whether the whole of `text` is an answer the grammar accepts, token by token."""
    c = Constraint(gtok, grammar)
    for token in gtok_encode(gtok, text):
        if not c.allows(token):
            return False
        c.accept(token)
    return c.accepting


def gtok_encode(gtok, text: str) -> list[int]:
    return gtok.ll.tokenize_str(text)


def valid_calls(text: str, tools: dict[str, dict], parser_cls) -> list:
    parsed = parser_cls(tools).parse(text)
    for call in parsed.tool_calls:
        assert call.name in tools, text
        jsonschema.validate(json.loads(call.arguments), tools[call.name])
    return parsed.tool_calls


# -- the mask level: hundreds of random schemas ------------------------------------------------


@pytest.fixture(scope="module")
def gtok(smollm2):
    built = grammar_tokenizer(smollm2.tokenizer)
    assert built is not None
    return built


@pytest.mark.parametrize("syntax", ["hermes", "qwen3_coder"])
def test_random_schemas_at_the_mask_level(gtok, syntax):
    render = hermes_call if syntax == "hermes" else xml_call
    parser = HermesParser if syntax == "hermes" else Qwen3CoderParser
    rng = np.random.default_rng(17 if syntax == "hermes" else 18)
    for _ in range(120):
        tools = random_tools(rng)
        grammar = build_grammar(
            GrammarRequest(tools, "required", parallel=False, syntax=syntax), gtok.is_special
        )
        name = str(rng.choice(sorted(tools)))
        schema = tools[name]
        args = random_instance(rng, schema)
        good = render(name, args)
        assert fits(gtok, grammar, good), good
        assert len(valid_calls(good, tools, parser)) == 1
        bad = broken(rng, schema, args, xml=syntax != "hermes") if args else None
        assert bad is None or not fits(gtok, grammar, render(name, bad))
        assert not fits(gtok, grammar, render(name + "x", args))
        assert not fits(gtok, grammar, good + "\n" + good)  # parallel_tool_calls: false
        assert not fits(gtok, grammar, "Sure. " + good)  # required: no prose
        parallel = build_grammar(GrammarRequest(tools, "required", syntax=syntax), gtok.is_special)
        assert fits(gtok, parallel, good + "\n" + good)
        auto = build_grammar(GrammarRequest(tools, "auto", syntax=syntax), gtok.is_special)
        assert fits(gtok, auto, "I can answer that myself.")
        assert fits(gtok, auto, "Let me look.\n" + good)
        assert not fits(gtok, auto, "Let me look.\n" + render(name + "x", args))


def test_auto_holds_calls_in_the_models_own_drift_to_the_schemas(gtok):
    """Qwen2.5-Coder writes its calls as a ```json block or a bare object: with tools and
    `auto` such a start is a call, held to the tools' schemas like one after `<tool_call>`;
    prose may not start with JSON or a ```json fence then (a reply that does is a call),
    unless the object names a function that was not offered: that is prose, free from there."""
    params = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tools = {"get_weather": params, "get_time": params}
    auto = build_grammar(GrammarRequest(tools, "auto"), gtok.is_special)
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    for text in [f"```json\n{call}\n```", call, f"[{call}, {call}]", f"```json\n[{call}]\n```"]:
        assert fits(gtok, auto, text), text
        assert len(valid_calls(text, tools, HermesParser)) >= 1
    for name in ("get_wether", "get_weather_now", "get", "", "area_of_triangle"):
        other = f'```json\n{{"name": "{name}", "arguments": {{"base": 10}}}}\n```\nDone.'
        assert fits(gtok, auto, other) and fits(gtok, auto, other[8:]), other
        assert valid_calls(other, tools, HermesParser) == []
    assert not fits(gtok, auto, '{"name": "get_weather", "arguments": {"town": "Paris"}}')
    assert not fits(gtok, auto, '```json\n{"name": "get_time", "arguments": {}}\n```')
    assert not fits(gtok, auto, '```json\n{"city": "Paris"}\n```')  # JSON that is no call
    assert fits(gtok, auto, 'Here is the weather:\n```json\n{"city": "Paris"}\n```')
    assert fits(gtok, auto, "```python\nprint(1)\n```")
    one = build_grammar(GrammarRequest(tools, "auto", parallel=False), gtok.is_special)
    assert fits(gtok, one, call) and not fits(gtok, one, f"[{call}]")


def test_other_name_regex_is_every_name_but_the_given_ones():
    """The drift's escape hatch: a JSON string naming anything but an offered function (names
    that are prefixes of each other, dots, non-ASCII, the empty name), checked against a brute
    force over short strings of the names' own characters."""
    rng = np.random.default_rng(5)
    alphabet = "ab_.é"
    for _ in range(40):
        names = {"".join(rng.choice(list(alphabet), rng.integers(1, 4))) for _ in range(4)}
        pattern = re.sub(r"\\x\{([0-9a-f]+)\}", lambda m: f"\\u{int(m[1], 16):04x}",
                         other_name_regex(names))  # fmt: skip
        regex = re.compile(pattern)
        for n in range(5):
            for chars in map("".join, itertools.product(alphabet, repeat=n)):
                written = json.dumps(chars, ensure_ascii=False)
                assert bool(regex.fullmatch(written)) == (chars not in names), chars


def test_arguments_the_function_does_not_name_are_closed_off(gtok):
    """BFCL's tool lists (like most) name their arguments and say nothing of others: a call
    must not invent one (JSON Schema alone would allow it)."""
    names = {"location": {"type": "string"}, "unit": {"type": "string"}}
    params = {"type": "dict", "required": ["location"], "properties": names}
    grammar = build_grammar(GrammarRequest({"weather": params}, "required"), gtok.is_special)
    assert fits(gtok, grammar, hermes_call("weather", {"location": "Riga, Latvia"}))
    assert fits(gtok, grammar, hermes_call("weather", {"location": "Riga", "unit": "celsius"}))
    assert not fits(gtok, grammar, hermes_call("weather", {"location": "Riga", "description": "x"}))


def test_arguments_a_schema_allows_stay_allowed(gtok):
    """Closing off unnamed arguments is a default: a schema that asks for them keeps them."""
    open_args = {"type": "object", "properties": {"a": {"type": "integer"}},
                 "additionalProperties": True}  # fmt: skip
    free = {"type": "object"}  # no properties named: any object
    for params in (open_args, free):
        grammar = build_grammar(GrammarRequest({"f": params}, "required"), gtok.is_special)
        assert fits(gtok, grammar, hermes_call("f", {"a": 1, "extra": "x"}))


def test_reasoning_is_never_constrained(gtok):
    tools = {"f": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}
    call = hermes_call("f", {"a": 1})
    thinking = "I should call f. <tool_call> is the tag; {not json\n"
    optional = build_grammar(GrammarRequest(tools, "required", think="optional"), gtok.is_special)
    assert fits(gtok, optional, f"<think>\n{thinking}</think>\n\n{call}")
    assert fits(gtok, optional, call)
    opened = build_grammar(GrammarRequest(tools, "required", think="open"), gtok.is_special)
    assert fits(gtok, opened, f"{thinking}</think>\n\n{call}")
    assert not fits(gtok, opened, f"{thinking}</think>\n\nprose")


def test_json_schema_grammar(gtok):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    grammar = build_grammar(GrammarRequest(json_schema=schema), gtok.is_special)
    assert fits(gtok, grammar, '{"n": 3}')
    assert not fits(gtok, grammar, '{"n": "3"}') and not fits(gtok, grammar, '{"n": 3} ok')
    # JSON mode's prefill is the answer's start: the grammar goes on after it
    c = Constraint(gtok, grammar, prefix="{")
    assert c.allows(gtok_encode(gtok, '"n')[0]) and not c.allows(gtok_encode(gtok, "{")[0])
    with pytest.raises(GrammarError):
        Constraint(gtok, "start: %json {not json}")


# -- the real default model --------------------------------------------------------------------


@pytest.fixture(scope="module")
def fast(smollm2_path):
    from atlas_cli.session import open_model

    return open_model(str(smollm2_path), device="cpu", ctx_size=1024)


def chat_answer(model, tools, choice, *, fmt=None, question, parser=HermesParser, tokens=64):
    from atlas_cli.serve.prompt import ChatOptions, build_chat_prompt
    from atlas_cli.serve.protocol import ChatCompletionRequest

    body = {"messages": [{"role": "user", "content": question}], "response_format": fmt}
    if tools:
        body["tools"] = [
            {"type": "function", "function": {"name": n, "parameters": s}} for n, s in tools.items()
        ]
        body["tool_choice"] = choice
    req = ChatCompletionRequest.model_validate(body)
    opts = ChatOptions(
        parser=parser,
        tools=req.tools,
        tool_choice=req.tool_choice,
        response_format=req.response_format,
        parallel_tool_calls=False,
    )
    prompt = build_chat_prompt(model.tokenizer, req.messages, opts)
    constraint = new_constraint(model.tokenizer, prompt.grammar, prompt.prefill)
    stats = GenerationStats()
    events = model.engine.generate(
        prompt.ids, max_tokens=tokens, sampling=GREEDY, stats=stats, constraint=constraint
    )
    return prompt.prefill + "".join(e.text for e in events), stats


# one short prompt for every schema: its prefix stays cached, so each case costs its decode
# only; the grammar alone makes the answer a call (the chat path is tested below and in the
# server tests)
SHORT_PROMPT = "<|im_start|>user\nPlease use one of the tools.<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.slow
@pytest.mark.parametrize("syntax", ["hermes", "qwen3_coder"])
def test_required_calls_of_the_default_model_are_valid(fast, syntax):
    parser = HermesParser if syntax == "hermes" else Qwen3CoderParser
    rng = np.random.default_rng(99 if syntax == "hermes" else 98)
    gtok = grammar_tokenizer(fast.tokenizer)
    ids = fast.tokenizer.encode(SHORT_PROMPT)
    for _ in range(16 if syntax == "hermes" else 6):
        tools = random_tools(rng)
        req = GrammarRequest(tools, "required", parallel=False, syntax=syntax)
        c = Constraint(gtok, build_grammar(req, gtok.is_special))
        stats = GenerationStats()
        events = fast.engine.generate(
            ids, max_tokens=128, sampling=GREEDY, stats=stats, constraint=c
        )
        text = "".join(e.text for e in events)
        assert stats.finish_reason == "stop", text
        assert len(valid_calls(text, tools, parser)) == 1, text


@pytest.mark.slow
def test_named_tool_through_the_chat_prompt(fast):
    tools = random_tools(np.random.default_rng(7))
    name = sorted(tools)[-1]
    choice = {"type": "function", "function": {"name": name}}
    text, stats = chat_answer(fast, tools, choice, question="Please use a tool.")
    calls = valid_calls(text, tools, HermesParser)
    assert stats.finish_reason == "stop" and [c.name for c in calls] == [name], text


@pytest.mark.slow
def test_auto_still_answers_in_prose(fast):
    tools = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}}}}
    text, stats = chat_answer(fast, tools, "auto", question="What is 2+2?")
    assert "<tool_call>" not in text and text.strip()
    assert stats.finish_reason == "stop"


@pytest.mark.slow
def test_json_mode_always_parses_and_validates(fast):
    rng = np.random.default_rng(5)
    questions = ["Describe Paris as JSON.", "Give me a JSON object.", "List three numbers."]
    for i in range(4):
        schema = random_object_schema(rng, 0, int(rng.integers(1, 4)))
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        text, stats = chat_answer(fast, None, None, fmt=fmt, question=questions[i % 3])
        assert stats.finish_reason == "stop", text
        jsonschema.validate(json.loads(text), schema)
    question = "Give the capital of France as JSON."
    text, stats = chat_answer(fast, None, None, fmt={"type": "json_object"}, question=question)
    assert stats.finish_reason == "stop" and isinstance(json.loads(text), dict)


# -- speculation -------------------------------------------------------------------------------


def test_speculation_keeps_the_constrained_output():
    from atlas_cli.session import open_model

    model = open_model(str(FIXTURES / "qwen35-vlm-bf16"), device="cpu-ref")
    gtok = grammar_tokenizer(model.tokenizer)  # a vocabulary llguidance reads as bytes
    assert gtok is not None
    grammar = 'start: /[a-e]{3,12}/ "." /[0-9]{2,6}/'
    rng = np.random.default_rng(3)
    drafted = 0
    for _ in range(4):
        ids = [int(i) for i in rng.integers(8, 64, 12)]
        runs = []
        for draft in (0, 2):
            engine = Engine(model.engine.model, model.tokenizer, 256, draft=draft)
            stats = GenerationStats()
            c = Constraint(gtok, grammar)
            list(engine.generate(ids, max_tokens=24, sampling=GREEDY, stats=stats, constraint=c))
            runs.append(stats)
        assert runs[0].token_ids == runs[1].token_ids
        assert fits(gtok, grammar, runs[0].text), runs[0].text
        drafted += runs[1].draft_tokens
    assert drafted > 0


# -- through the server: both APIs, streamed and whole -------------------------------------------

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "days": {"type": "integer"}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(fast, smollm2_path):
    from atlas_cli.serve.app import create_app
    from atlas_cli.serve.http import ServeConfig
    from tests.serve_helpers import ServerThread

    with ServerThread(
        create_app(ServeConfig(model=str(smollm2_path), served_model_name="m"), fast)
    ) as srv:
        yield srv


@pytest.mark.slow
def test_openai_required_call_streamed_and_whole_agree(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    body = dict(
        model="m",
        messages=ASK,
        tools=[WEATHER_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=64,
    )
    whole = client.chat.completions.create(**body).choices[0]
    assert whole.finish_reason == "tool_calls" and len(whole.message.tool_calls) == 1
    call = whole.message.tool_calls[0].function
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    streamed = streamed_call(client.chat.completions.create(**body, stream=True))
    assert streamed == (call.name, call.arguments, "tool_calls")


@pytest.mark.slow
def test_openai_json_schema_streamed_and_whole_agree(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}}
    body = dict(model="m", messages=ASK, response_format=fmt, temperature=0, max_tokens=48)
    whole = client.chat.completions.create(**body).choices[0]
    jsonschema.validate(json.loads(whole.message.content), WEATHER)
    chunks = list(client.chat.completions.create(**body, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.message.content and chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.slow
def test_anthropic_any_tool_is_a_valid_tool_use(server):
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    tool = {"name": "get_weather", "description": "The weather.", "input_schema": WEATHER}
    msg = client.messages.create(
        model="m",
        messages=ASK,
        tools=[tool],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        max_tokens=64,
        extra_body={"temperature": 0},  # newer anthropic clients have no temperature argument
    )
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and len(uses) == 1 and uses[0].name == "get_weather"
    jsonschema.validate(uses[0].input, WEATHER)


@pytest.mark.slow
def test_a_schema_that_does_not_compile_is_a_400(server):
    from tests.serve_helpers import dumps, raw_request

    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}
    body = dumps({"messages": ASK, "response_format": fmt, "max_tokens": 4})
    status, _, raw = raw_request(server.port, "POST", "/v1/chat/completions", body)
    assert status == 400 and "frobnicate" in json.loads(raw)["error"]["message"]
