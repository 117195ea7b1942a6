"""Tokenizer parity with transformers on the real GGUF, and chat template rendering."""

from __future__ import annotations

import json

import pytest

from atlas_cli.backend.tokenizer import render_template
from atlas_cli.errors import TemplateError
from tests.conftest import FIXTURES


@pytest.fixture(scope="module")
def corpus():
    return json.loads((FIXTURES / "tokenizer_corpus.json").read_text())


def test_corpus_is_large_and_varied(corpus):
    assert len(corpus["cases"]) >= 1000
    assert len(corpus["kinds"]) >= 10


def test_ids_equal_transformers_on_corpus(smollm2, corpus):
    tok = smollm2.tokenizer
    mismatches = [
        (case["kind"], case["text"][:40])
        for case in corpus["cases"]
        if tok.encode(case["text"], add_special_tokens=False) != case["ids"]
    ]
    assert not mismatches, f"{len(mismatches)} mismatches, e.g. {mismatches[:5]}"


def test_decode_round_trips_text(smollm2, corpus):
    tok = smollm2.tokenizer
    missing = {chr(b) for b in corpus["missing_bytes"] if b < 0x80}
    for case in corpus["cases"]:
        text = case["text"]
        if case["kind"] == "missing_byte" or any(ch in missing for ch in text):
            continue  # bytes the vocabulary cannot represent are dropped (as in transformers)
        if any(0x40000 <= ord(ch) <= 0xBFFFF for ch in text):
            continue
        assert tok.decode(case["ids"]) == text


def test_special_token_text_is_one_id(smollm2):
    tok = smollm2.tokenizer
    assert tok.encode("<|im_start|>") == [1]
    assert tok.encode("<|im_end|>") == [2]
    assert 2 in tok.stop_ids  # <|im_end|> ends an assistant turn


def test_bos_is_not_doubled(smollm2):
    tok = smollm2.tokenizer
    ids = tok.encode("<|im_start|>user\nhi", add_special_tokens=True)
    assert ids[:2] != [tok.bos_id, tok.bos_id]


@pytest.mark.parametrize(
    "case", json.loads((FIXTURES / "smollm2_template.json").read_text())["cases"], ids=str
)
def test_chat_template_matches_transformers(smollm2, case):
    rendered = smollm2.tokenizer.render_chat(
        case["messages"], add_generation_prompt=case["add_generation_prompt"]
    )
    assert rendered == case["rendered"]


def test_template_kwargs_tools_and_thinking():
    source = (
        "{% if tools %}TOOLS:{{ tools | tojson }}\n{% endif %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}"
    )
    tools = [{"type": "function", "function": {"name": "ls", "parameters": {}}}]
    out = render_template(
        source,
        messages=[{"role": "user", "content": "<hi> & bye"}],
        tools=tools,
        enable_thinking=False,
    )
    assert out.startswith('TOOLS:[{"type": "function"')
    assert "user: <hi> & bye" in out  # no HTML escaping
    assert out.endswith("<no-think>")


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__.__init__.__globals__ }}",
        "{% set x = messages.append(1) %}",
    ],
)
def test_template_sandbox_blocks_escapes(source):
    with pytest.raises(TemplateError):
        render_template(source, messages=[])


def test_template_raise_exception_and_syntax_errors():
    with pytest.raises(TemplateError, match="only user and assistant"):
        render_template("{{ raise_exception('only user and assistant') }}", messages=[])
    with pytest.raises(TemplateError, match="syntax error"):
        render_template("{% for m in messages %}", messages=[])


def test_fewest_tokens_is_a_lower_bound(smollm2, corpus):
    """The server refuses a prompt by `fewest_tokens` before tokenising it (a 10 MB body costs
    seconds to encode): the bound must never exceed the real count."""
    tok = smollm2.tokenizer
    missing = {chr(b) for b in corpus["missing_bytes"]}  # dropped by the vocabulary
    texts = [c["text"] for c in corpus["cases"] if not missing & set(c["text"])]
    texts += ["word " * 5000, "\u00e9" * 999]
    for text in texts:
        assert tok.fewest_tokens(text) <= len(tok.encode(text)), text[:60]
    assert tok.fewest_tokens("a" * 10**7) > 8192  # a 10 MB body is refused without encoding
