"""The interleaved MLPerf Edge Agentic replay of benchmarks/prefix_replay.py at the recorded
prompts' real length (11-17K tokens as the server renders them, past SmolLM2's 8K), on tiny
64K-context models that carry SmolLM2's tokenizer and template: a dense Qwen3 and a hybrid
Qwen3.5 (Gated DeltaNet state checkpointed at message starts and prompt ends). Two
conversations, turn by turn through the serve app: with the pool every turn after the first of
each reuses >= 90% of its prompt (all its conversation sent before); one slot reuses only the
shared system prompt; a slot saved, restored by a new model and server, prefills only the next
request's new suffix."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from atlas_cli.backend.cache import HybridCache, KVCache
from atlas_cli.session import open_model

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import prefix_replay as replay  # noqa: E402

START = 48  # requests 48-51 of the file's first two conversations: 11-16K-token prompts
TURNS = 4  # per conversation with the pool (the fifth request goes to the restored slot)
SINGLE_TURNS = 2  # with one slot, each re-prefills its whole prompt


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("ATLAS_HOME", str(tmp_path / "home"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_path) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("tiny")
    return {kind: replay.build_tiny(kind, out, smollm2_path) for kind in replay.TINY}


def _turn(conv: str, index: int, prompt: int, cached: int) -> replay.Turn:
    return replay.Turn(conv, index, prompt, cached, 0.0)


def test_the_checks_catch_a_cache_that_loses_a_prefix():
    good = [_turn("a", 0, 1000, 0), _turn("b", 0, 900, 50), _turn("a", 1, 1050, 1000)]
    assert replay.bounds(good) == [None, None, 999 / 1050]
    assert replay.problems(good, pooled=True) == []
    # a turn that lost part of what was sent before, and one under 90% though 95% was possible
    lost = good + [_turn("b", 1, 950, 600), _turn("a", 2, 1100, 1040)]
    assert len(replay.problems(lost, pooled=True)) == 3
    # a turn that adds a whole file: under 90% is all the data allows, and it is not a failure
    big = good + [_turn("b", 1, 2000, 900)]
    assert replay.problems(big, pooled=True) == []
    # one slot keeping everything would mean the other conversation never evicted it
    assert len(replay.problems(good, pooled=False)) == 1
    assert replay.problems(good[:2] + [_turn("a", 1, 1050, 50)], pooled=False) == []
    restore = replay.Restore(1002, 1000, 1100, 999, 0.1, 0, 1.0)
    assert replay.restore_problems(restore) == []
    assert replay.restore_problems(replay.Restore(1002, 1000, 1100, 50, 0.1, 0, 1.0))


def test_capped_requests_each_extend_the_previous():
    from tests.test_serve_mlperf import trajectory_file

    reqs = replay.conversation_requests(trajectory_file(), None, 0, 12, replay.SMOLLM2_CAP)
    assert len(reqs) == 2
    for conv in reqs.values():
        for (a, _), (b, _) in zip(conv, conv[1:], strict=False):
            assert b[: len(a)] == a
            assert all(len(m.get("content") or "") <= max(replay.SMOLLM2_CAP.values()) for m in b)


@pytest.mark.slow
def test_tiny_models_speak_smollm2s_chat_format_with_a_long_context(tiny, smollm2):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    want = smollm2.tokenizer.encode(smollm2.tokenizer.render_chat(messages))
    for kind, cache in [("tiny-dense", KVCache), ("tiny-hybrid", HybridCache)]:
        model = open_model(str(tiny[kind]), ctx_size=replay.TINY_CONTEXT)
        assert model.tokenizer.encode(model.tokenizer.render_chat(messages)) == want
        assert model.engine.context_length == replay.TINY_CONTEXT
        assert isinstance(model.engine.cache, cache)
        assert model.engine.message_starts == smollm2.engine.message_starts != frozenset()


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(replay.TINY))
def test_interleaved_replay_at_real_length(kind, tiny):
    pytest.importorskip("openai")
    from tests.test_serve_mlperf import trajectory_file

    path, ctx = tiny[kind], replay.TINY_CONTEXT
    reqs = replay.conversation_requests(trajectory_file(), None, START, TURNS + 1, None)
    pooled = replay.replay(path, ctx, reqs, TURNS, START, None, save_first=True)
    print(replay.table("pool", pooled))
    assert min(r.prompt for r in pooled) > 8192  # past the embedded model's context
    assert replay.problems(pooled, pooled=True) == []
    later = [r for r, b in zip(pooled, replay.bounds(pooled), strict=True) if b is not None]
    assert len(later) == 2 * (TURNS - 1) and all(r.cached / r.prompt >= 0.9 for r in later)
    single = replay.replay(path, ctx, reqs, SINGLE_TURNS, START, 0)
    print(replay.table("one slot", single))
    assert replay.problems(single, pooled=False) == []
    # only the system prompt both conversations share survives the other's turn
    assert all(r.cached / r.prompt < 0.05 for r in single[2:])
    first = next(iter(reqs))
    previous = pooled[-2].prompt
    assert pooled[-2].conv == first
    restored = replay.restore(path, ctx, previous, *reqs[first][TURNS])
    print(replay.restore_line(restored))
    assert replay.restore_problems(restored) == []
    assert restored.prompt - restored.cached <= restored.prompt - previous + 1  # the new suffix
    assert restored.cold_cached == 0
