"""Generation on the real default model: streaming, stops, limits, seeds, prefix reuse."""

from __future__ import annotations

import numpy as np
import pytest

from atlas_cli.backend.engine import (
    GenerationStats,
    IncrementalDecoder,
    StopMatcher,
    check_finite,
)
from atlas_cli.backend.sample import SamplingOverrides
from atlas_cli.errors import ContextOverflowError, CorruptModelError


def chat(model, text):
    return model.chat_prompt([{"role": "user", "content": text}])


def test_incremental_decoder_never_splits_utf8(smollm2):
    tok = smollm2.tokenizer
    text = "naïve café 👩‍👩‍👧 日本語 ✓"
    ids = tok.encode(text)
    # the emoji and CJK characters span several byte-level tokens
    assert len(ids) > len(text.split())
    decoder = IncrementalDecoder(tok)
    pieces = [decoder.push(i) for i in ids] + [decoder.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_stop_matcher_holds_back_partial_stop():
    m = StopMatcher(["STOP"])
    out = m.feed("abc ST") + m.feed("O") + m.feed("P and more")
    assert out == "abc " and m.hit
    m = StopMatcher(["STOP"])
    assert m.feed("ST") == "" and m.feed("ay") == "STay"


def test_max_tokens_and_finish_reason(smollm2):
    stats = GenerationStats()
    events = list(
        smollm2.generate(
            chat(smollm2, "Count to fifty."),
            max_tokens=5,
            stats=stats,
            sampling=SamplingOverrides(temperature=0),
        )
    )
    assert stats.completion_tokens == 5 == len([e for e in events if e.token >= 0])
    assert stats.finish_reason == "length"
    assert stats.text == "".join(e.text for e in events)


def test_end_of_turn_stops(smollm2):
    stats = GenerationStats()
    list(
        smollm2.generate(
            chat(smollm2, "Say hi."),
            max_tokens=60,
            stats=stats,
            sampling=SamplingOverrides(temperature=0),
        )
    )
    assert stats.finish_reason == "stop"
    assert "<|im_end|>" not in stats.text


def test_stop_string(smollm2):
    stats = GenerationStats()
    prompt = chat(smollm2, "What is the capital of France?")
    list(
        smollm2.generate(
            prompt,
            max_tokens=20,
            stop=["Paris"],
            stats=stats,
            sampling=SamplingOverrides(temperature=0),
        )
    )
    assert stats.text == "The capital of France is "
    assert stats.finish_reason == "stop"


def test_seed_reproducible_and_varies(smollm2):
    prompt = chat(smollm2, "Write a word.")

    def sample(seed):
        events = smollm2.generate(
            prompt, max_tokens=8, sampling=SamplingOverrides(temperature=1.5, top_k=0, seed=seed)
        )
        return [e.token for e in events]

    assert sample(1) == sample(1)
    assert len({tuple(sample(s)) for s in range(2, 6)}) > 1


def test_prefix_reuse_gives_same_tokens_as_full_prefill(smollm2):
    first = chat(smollm2, "Name a colour.")
    list(smollm2.generate(first, max_tokens=4, sampling=SamplingOverrides(temperature=0)))
    messages = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "And another?"},
    ]
    second = smollm2.chat_prompt(messages)
    stats = GenerationStats()
    reused = [
        e.token
        for e in smollm2.generate(
            second, max_tokens=6, stats=stats, sampling=SamplingOverrides(temperature=0)
        )
    ]
    assert stats.cached_tokens > 10
    smollm2.engine.reset()
    fresh_stats = GenerationStats()
    fresh = [
        e.token
        for e in smollm2.generate(
            second, max_tokens=6, stats=fresh_stats, sampling=SamplingOverrides(temperature=0)
        )
    ]
    assert fresh_stats.cached_tokens == 0
    assert reused == fresh


def test_prompt_longer_than_context():
    from atlas_cli.session import open_model

    small = open_model("smollm2-135m", device="cpu-ref", ctx_size=16)
    with pytest.raises(ContextOverflowError, match="holds 16"):
        list(small.generate("word " * 40, max_tokens=4))


def test_generation_stops_when_context_fills():
    from atlas_cli.session import open_model

    small = open_model("smollm2-135m", device="cpu-ref", ctx_size=40)
    stats = GenerationStats()
    list(small.generate(chat(small, "Tell me a long story."), max_tokens=100, stats=stats))
    assert stats.finish_reason == "length"
    assert stats.prompt_tokens + stats.completion_tokens <= 41


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_logits_are_refused(bad):
    logits = np.zeros(8, dtype=np.float32)
    check_finite(logits, 0)
    logits[5] = bad
    with pytest.raises(CorruptModelError, match="corrupt or mis-quantised"):
        check_finite(logits, 3)


def test_nan_weights_stop_generation_with_a_clear_error():
    """Weights that produce NaN logits (here a NaN final norm, as a broken quantisation does)
    end generation with one CorruptModelError, not a crash inside the sampler."""
    from atlas_cli.session import open_model

    broken = open_model("smollm2-135m", device="cpu-ref", ctx_size=64)
    w = broken.engine.model.w
    w["model.norm.weight"] = np.full_like(np.asarray(w["model.norm.weight"]), np.nan)
    for sampling in ({"seed": 1}, {"temperature": 0}):
        with pytest.raises(CorruptModelError, match="NaN or Inf logits .after 0 generated"):
            list(broken.generate("Hello", max_tokens=4, sampling=SamplingOverrides(**sampling)))


def test_tiny_repeat_penalty_generates(smollm2):
    stats = GenerationStats()
    prompt = chat(smollm2, "Count to ten.")
    tiny = SamplingOverrides(repeat_penalty=1e-308, seed=7)
    list(smollm2.generate(prompt, max_tokens=6, sampling=tiny, stats=stats))
    assert stats.completion_tokens >= 1
