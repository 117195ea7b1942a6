"""A model named by its recipe runs with the recipe's defaults unless a flag says otherwise."""

from __future__ import annotations

import pytest

from atlas_cli.backend.defaults import RunDefaults
from atlas_cli.backend.sample import SamplingOverrides, SamplingParams
from atlas_cli.store import locate


def test_default_model_recipe_defaults():
    defaults = locate.run_defaults("smollm2-135m")
    assert defaults["temperature"] == 0.2 and defaults["top_p"] == 0.9


def test_qwen25_coder_recipe_defaults():
    for name in ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"):
        defaults = locate.run_defaults(name, device="cpu")  # generation_config.json's
        assert (defaults["temperature"], defaults["top_p"], defaults["top_k"]) == (0.7, 0.8, 20)
        assert defaults["repeat_penalty"] == 1.05
        assert defaults["tool_call_parser"] == "hermes"


def test_paths_have_no_recipe_defaults(smollm2_path):
    assert locate.run_defaults(str(smollm2_path)) == {}


def test_recipe_variant_defaults_merge():
    defaults = locate.run_defaults("qwen3.6-27b", device="cpu")
    assert defaults["ctx_size"] == 32_768
    assert defaults["chat_template_kwargs"] == {"enable_thinking": True}
    assert defaults["speculative"] is False  # the CPU's GGUF variant has no MTP head


def test_model_sampling_resolution(smollm2, monkeypatch):
    seen = {}

    def capture(prompt, *, sampling, **kwargs):
        seen["sampling"] = sampling
        return iter(())

    recipe = RunDefaults.from_recipe({"temperature": 0.2, "top_p": 0.9, "ctx_size": 9})
    monkeypatch.setattr(smollm2, "defaults", recipe)
    monkeypatch.setattr(smollm2.engine, "generate", capture)
    smollm2.generate("hi")
    assert seen["sampling"].temperature == 0.2 and seen["sampling"].top_p == 0.9
    assert seen["sampling"].top_k == SamplingParams().top_k
    smollm2.generate("hi", sampling=SamplingOverrides(temperature=0, top_p=0.5))
    assert seen["sampling"].temperature == 0 and seen["sampling"].top_p == 0.5


@pytest.mark.slow
def test_the_default_models_chat_defaults_give_good_first_answers(smollm2_path):
    """`atlas chat` with the embedded model's recipe defaults: the first questions people ask
    get an answer that ends, does not loop and has its fact (seeded: the same every run on one
    machine; the bar leaves room for other CPUs' rounding). Before the recipe's repeat penalty,
    3 of these 10 looped or missed their fact."""
    from atlas_cli.bench import coherence
    from atlas_cli.session import open_model

    model = open_model("smollm2-135m", device="cpu")
    verdicts = coherence.run_sampled(model, coherence.FIRST_CHAT, 1, coherence.CHAT_MAX_TOKENS)
    passed = sum(v.passed for v in verdicts)
    assert passed >= 8, coherence.report(verdicts)
