"""The reasoning budget (backend/think_budget.py): after N tokens of thought `</think>` and the
blank line after it are forced, on the engine (`--reasoning-budget`) and through the server's
per-request fields (`reasoning_budget`, OpenAI's `reasoning_effort`, Anthropic's
`thinking.budget_tokens` and `disabled`), on the tiny Qwen3.5 whose vocabulary has the tags."""

from __future__ import annotations

from pathlib import Path

import pytest

from atlas_cli.backend.engine import GenerationStats
from atlas_cli.backend.sample import SamplingParams
from atlas_cli.backend.think_budget import ThinkBudget
from atlas_cli.serve.app import create_app
from atlas_cli.serve.http import ServeConfig
from tests.serve_helpers import ServerThread

FIXTURE = Path(__file__).parent / "fixtures" / "qwen" / "qwen35-vlm-bf16"
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")


@pytest.fixture(scope="module")
def qwen35():
    from atlas_cli.session import open_model

    return open_model(str(FIXTURE), device="cpu-ref")


def thinking_prompt(model) -> list[int]:
    """A prompt that opens a think block, as Qwen3.5's template does when thinking is on."""
    messages = [{"role": "user", "content": "hi"}]
    return model.chat_prompt(messages) + model.tokenizer.encode(
        "<think>\n", add_special_tokens=False
    )


def reply(model, ids, budget) -> list[int]:
    stats = GenerationStats()
    params = SamplingParams(temperature=0, reasoning_budget=budget)
    list(model.engine.generate(ids, max_tokens=20, sampling=params, stats=stats))
    return stats.token_ids


@pytest.mark.parametrize("budget", [0, 1, 3, 8])
def test_the_thought_ends_after_the_budget(qwen35, budget):
    tok = qwen35.tokenizer
    close = tok.backend.token_to_id("</think>")
    after = tok.encode("\n\n", add_special_tokens=False)
    free = reply(qwen35, thinking_prompt(qwen35), None)
    ids = reply(qwen35, thinking_prompt(qwen35), budget)
    if close in free[: budget + 1]:
        pytest.skip("the model closed its thought on its own within the budget")
    assert ids[:budget] == free[:budget]  # the thought itself is the model's own
    assert ids[budget : budget + 1 + len(after)] == [close, *after]


def test_no_budget_and_no_tags_change_nothing(qwen35, smollm2):
    ids = thinking_prompt(qwen35)
    assert reply(qwen35, ids, None) == reply(qwen35, ids, 10**6)
    assert ThinkBudget.start(smollm2.tokenizer, [1, 2, 3], 5) is None  # no <think> token


@pytest.fixture(scope="module")
def server(qwen35):
    """The server's --reasoning-budget 2: a sampling default over the recipe's (serve's
    `with_defaults`), under each request's own."""
    from atlas_cli.backend.sample import SamplingOverrides
    from atlas_cli.serve.server import with_defaults
    from atlas_cli.session import Resolved

    resolved = Resolved("tiny", FIXTURE, "cpu-ref", qwen35.defaults)
    budget = SamplingOverrides(reasoning_budget=2)
    qwen35.defaults = with_defaults(resolved, budget, None).defaults
    config = ServeConfig(model=str(FIXTURE), served_model_name="tiny")
    with ServerThread(create_app(config, qwen35)) as srv:
        yield srv


def test_completions_force_the_close_after_the_budget(server, qwen35):
    """The server's --reasoning-budget (2) unless the request gives its own."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    prompt = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n"

    def text(**extra) -> str:
        done = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=12, temperature=0, extra_body=extra
        )
        return done.choices[0].text

    for budget, got in [(2, text()), (0, text(reasoning_budget=0)), (5, text(reasoning_budget=5))]:
        head, close, _ = got.partition("</think>")
        assert close, got
        assert len(qwen35.tokenizer.encode(head, add_special_tokens=False)) == budget, got


def test_each_api_names_its_budget(server, qwen35, monkeypatch):
    """OpenAI's reasoning_effort and Anthropic's thinking reach the engine as budgets."""
    seen = []
    generate = qwen35.engine.generate

    def spy(*args, sampling=None, **kw):
        seen.append(sampling.reasoning_budget)
        return generate(*args, sampling=sampling, **kw)

    monkeypatch.setattr(qwen35.engine, "generate", spy)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    hi = [{"role": "user", "content": "hi"}]
    for effort in ["none", "low", "high", None]:
        extra = {"reasoning_effort": effort} if effort else {}
        client.chat.completions.create(model="tiny", messages=hi, max_tokens=2, **extra)
    claude = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    for thinking in [{"type": "enabled", "budget_tokens": 1024}, {"type": "disabled"}]:
        claude.messages.create(model="tiny", max_tokens=2, messages=hi, thinking=thinking)
    # none, low, high (no limit: the server's 2), unset (the server's), Anthropic's two
    assert seen == [0, 1024, 2, 2, 1024, 0]
