"""The prefix pool (backend/prefix_pool.py): interleaved conversations each keep their prefix,
exactly, on the hybrid cache too; LRU by bytes; slots saved to disk and restored by a fresh
engine; the /slots routes; Anthropic's billing header; and the interleaved MLPerf replay."""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest

from atlas_cli.backend.cache import HybridCache, KVCache, StackedKVCache
from atlas_cli.backend.engine import Engine, GenerationStats
from atlas_cli.backend.layers import CacheLayout, LayerKind
from atlas_cli.backend.prefix_pool import boundaries
from atlas_cli.backend.sample import SamplingParams
from atlas_cli.errors import SlotError, SlotNotFoundError
from atlas_cli.serve.slot_files import slot_file
from atlas_cli.session import open_model

LINEAR, FULL = LayerKind.GATED_DELTANET, LayerKind.ATTENTION

FIXTURES = Path(__file__).parent / "fixtures" / "qwen"
TURNS = 12  # requests per conversation in the interleaved replay (the pool's run)
SINGLE_TURNS = 4  # and for one slot, which re-prefills most of each prompt
SYSTEM = "You are a coding agent. Use the tools. Keep answers short and exact."


@pytest.fixture(scope="module")
def qwen35():
    return open_model(str(FIXTURES / "qwen35-vlm-bf16"), device="cpu-ref")


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("ATLAS_HOME", str(tmp_path / "home"))


def chat_ids(model, *turns: str) -> list[int]:
    """System, then user / assistant turns alternating, ready for the assistant's answer."""
    messages = [{"role": "system", "content": SYSTEM}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return model.tokenizer.encode(model.tokenizer.render_chat(messages))


def fresh_logits(model, ids) -> np.ndarray:
    return Engine(model.engine.model, model.tokenizer, 256).logits(ids)[-1]


def greedy(engine: Engine, ids, n: int = 4) -> GenerationStats:
    stats = GenerationStats()
    list(engine.generate(ids, max_tokens=n, sampling=SamplingParams(temperature=0), stats=stats))
    return stats


def prefill_exact(model, engine: Engine, ids) -> int:
    """Prefill `ids` with whatever the engine has cached: the logits must be a fresh
    prefill's; returns how many tokens were reused."""
    logits, cached = engine.prefill(ids)
    assert np.allclose(logits, fresh_logits(model, ids), atol=1e-5)
    return cached


# -- caches: clone, export and load ------------------------------------------------------------


def _filled(cache, n: int, rng):
    cache.reserve(n)
    layers = cache.kv.values() if isinstance(cache, HybridCache) else cache.layers
    for layer in layers:
        layer.k[:, :n] = rng.standard_normal(layer.k[:, :n].shape)
        layer.v[:, :n] = rng.standard_normal(layer.v[:, :n].shape)
    for state in getattr(cache, "linear", {}).values():
        state.recurrent[:] = rng.standard_normal(state.recurrent.shape)
    cache.length = n
    return cache


@pytest.mark.parametrize(
    "make",
    [
        lambda: KVCache(2, 2, 4, 600),
        lambda: StackedKVCache(2, 2, 4, 600),
        lambda: HybridCache(CacheLayout((LINEAR, FULL), 2, 4, (2, 3), (1, 2, 2)), 600),
    ],
    ids=["kv", "stacked", "hybrid"],
)
def test_clone_export_load_round_trip(make):
    rng = np.random.default_rng(0)
    cache = _filled(make(), 300, rng)  # past the first capacity step
    cache.checkpoint()
    arrays = cache.export()
    again = make()
    again.load(arrays)
    assert again.length == 300 and type(again) is type(cache)
    for name, value in again.export().items():
        assert np.array_equal(value, arrays[name]), name
    copy = cache.clone(120)
    assert copy.length == (0 if isinstance(cache, HybridCache) else 120)  # no checkpoint <= 120
    assert cache.clone(300).export()["length"] == 300
    assert cache.length == 300  # the source is left as it was
    with pytest.raises(ValueError):
        make().load({**arrays, "length": np.asarray(601)})
    with pytest.raises(ValueError):
        bad = {k: (v[:, :-1] if k.startswith("k") else v) for k, v in arrays.items()}
        make().load(bad)


def test_native_kv_cache_clone_and_export_on_the_emulator():
    from atlas_cli.backend.ops.native import runtime_emu

    if not runtime_emu.available():
        pytest.skip("g++ not installed")
    import tempfile

    from atlas_cli.backend.ops.native.device import NativeOps

    cache_dir = Path(tempfile.gettempdir()) / "atlas-emu-kernels"
    cache_dir.mkdir(exist_ok=True)
    ops = NativeOps(runtime_emu.EmuRuntime(cache_dir), weight_dtype="f32", prefill="exact")
    cache = ops.device_kv_cache(2, 2, 64, 600)
    cache.reserve(300)
    k = np.random.default_rng(1).standard_normal((300, 2, 64)).astype(np.float32)
    for layer in range(2):
        cache.update(layer, 0, ops.asarray(k), ops.asarray(-k))
    cache.length = 300
    arrays = cache.export()
    copy = cache.clone(270)
    assert copy.length == 270 and copy.nbytes < cache.nbytes * 2
    assert np.array_equal(copy.export()["v1"], arrays["v1"][:, :270])
    again = ops.device_kv_cache(2, 2, 64, 600)
    again.load(arrays)
    assert all(np.array_equal(v, arrays[n]) for n, v in again.export().items())


# -- several conversations on the hybrid cache -------------------------------------------------


def test_interleaved_conversations_keep_their_prefix_exactly(qwen35):
    engine = Engine(qwen35.engine.model, qwen35.tokenizer, 256)
    assert isinstance(engine.cache, HybridCache) and engine.speculator is not None
    a1, b1 = chat_ids(qwen35, "list the files"), chat_ids(qwen35, "fix the failing test")
    assert greedy(engine, a1).cached_tokens == 0
    # B shares A's system message: it forks from the checkpoint at the message start after it
    system_end = boundaries(a1, 0, len(a1) - 1, engine.message_starts)[0]
    assert a1[:system_end] == b1[:system_end]
    assert prefill_exact(qwen35, engine, b1) == system_end
    reply_b = greedy(engine, b1).text
    assert len(engine.pool.slots) == 2
    # each conversation's next turn reuses all of its own previous prompt, never the other's
    a2 = chat_ids(qwen35, "list the files", "ok", "now read main.py")
    b2 = chat_ids(qwen35, "fix the failing test", reply_b or "done", "run it again")
    assert prefill_exact(qwen35, engine, a2) >= len(a1) - 1
    assert prefill_exact(qwen35, engine, b2) >= len(b1) - 1
    assert len(engine.pool.slots) == 2
    # and generation after the reuse is the fresh one (greedy, drafts on)
    fresh = Engine(qwen35.engine.model, qwen35.tokenizer, 256)
    assert greedy(engine, a2, 6).token_ids == greedy(fresh, a2, 6).token_ids


def test_budget_zero_keeps_one_sequence(qwen35):
    engine = Engine(qwen35.engine.model, qwen35.tokenizer, 256, cache_bytes=0)
    a1, b1 = chat_ids(qwen35, "list the files"), chat_ids(qwen35, "fix the failing test")
    greedy(engine, a1)
    greedy(engine, b1)
    assert len(engine.pool.slots) == 1
    a2 = chat_ids(qwen35, "list the files", "ok", "now read main.py")
    # only the shared system message is left of A: B replaced the rest
    assert prefill_exact(qwen35, engine, a2) < len(a1) - 1


def test_lru_evicts_the_least_recently_used_by_bytes(qwen35):
    engine = Engine(qwen35.engine.model, qwen35.tokenizer, 256)
    convs = [chat_ids(qwen35, f"task number {i}: " + "x " * (8 * i)) for i in range(3)]
    greedy(engine, convs[0])
    one = engine.pool.current.nbytes
    engine.pool.budget = int(2.5 * one)  # room for two slots of this size, not three
    greedy(engine, convs[1])
    greedy(engine, convs[0])  # conversation 0 is now the most recently used
    greedy(engine, convs[2])
    kept = {tuple(s.ids[: len(convs[0]) - 1]) for s in engine.pool.slots}
    assert len(engine.pool.slots) == 2 and engine.pool.nbytes <= engine.pool.budget
    assert tuple(convs[0][:-1]) in kept and tuple(convs[1][:-1]) not in kept
    engine.reset()
    assert len(engine.pool.slots) == 1 and engine.cached_ids == []


# -- slots on disk -----------------------------------------------------------------------------


def test_restored_slot_prefills_only_the_new_suffix(qwen35, tmp_path):
    engine = Engine(qwen35.engine.model, qwen35.tokenizer, 256)
    a1 = chat_ids(qwen35, "list the files")
    reply = greedy(engine, a1, 5)
    slot = engine.pool.current.id
    n, size = engine.save_slot(slot, slot_file(tmp_path, "conv-a.npz"))
    assert n == len(a1) + len(reply.token_ids) - 1 and size > 0
    # a restarted server: a new engine, nothing cached
    restarted = Engine(qwen35.engine.model, qwen35.tokenizer, 256)
    assert restarted.restore_slot(3, slot_file(tmp_path, "conv-a.npz")) == (n, size)
    assert [s["id"] for s in restarted.slots()] == [0, 3]
    turn = a1 + reply.token_ids + [9, 10, 11]
    assert prefill_exact(qwen35, restarted, turn) == n
    a2 = chat_ids(qwen35, "list the files", "ok", "now read main.py")
    assert prefill_exact(qwen35, restarted, a2) >= len(a1) - 1  # its checkpoints came too


def hostile_slot_files() -> dict[str, bytes]:
    """Slot files that once answered with a 500: empty, metadata that is a JSON list or has a
    prompt_len that is no number, an array header that asks for 400 GB in a few bytes."""

    def npz(**arrays) -> bytes:
        out = io.BytesIO()
        np.savez(out, **arrays)
        return out.getvalue()

    def meta(value) -> np.ndarray:
        return np.frombuffer(json.dumps(value).encode(), np.uint8)

    huge = io.BytesIO()
    with zipfile.ZipFile(huge, "w") as z, z.open("cache.k.npy", "w") as member:
        header = {"descr": "<f4", "fortran_order": False, "shape": (10**11,)}
        np.lib.format.write_array_header_1_0(member, header)
        member.write(b"\0" * 64)
    ids = np.arange(3)
    return {
        "empty": b"",
        "list-meta": npz(meta=meta([1, 2]), ids=ids),
        "text-prompt-len": npz(meta=meta({"prompt_len": "3"}), ids=ids),
        "huge-header": huge.getvalue(),
    }


def test_slot_files_are_checked(qwen35, smollm2, tmp_path):
    for name in ["../escape", "a/b", "", ".hidden", "x" * 200]:
        with pytest.raises(SlotError):
            slot_file(tmp_path, name)
    engine = Engine(qwen35.engine.model, qwen35.tokenizer, 256)
    greedy(engine, chat_ids(qwen35, "hello"))
    with pytest.raises(SlotNotFoundError):
        engine.save_slot(7, slot_file(tmp_path, "nope"))
    with pytest.raises(SlotNotFoundError):
        engine.restore_slot(0, slot_file(tmp_path, "never-saved"))
    engine.save_slot(0, slot_file(tmp_path, "q"))
    other = Engine(smollm2.engine.model, smollm2.tokenizer, 256)
    with pytest.raises(SlotError, match="another model"):
        other.restore_slot(0, slot_file(tmp_path, "q"))
    small = Engine(qwen35.engine.model, qwen35.tokenizer, 256, cache_bytes=1000)
    with pytest.raises(SlotError, match="--cache-size"):
        small.restore_slot(0, slot_file(tmp_path, "q"))
    slot_file(tmp_path, "junk").write_bytes(b"not a zip file")
    with pytest.raises(SlotError, match="not a saved slot"):
        engine.restore_slot(0, slot_file(tmp_path, "junk"))
    for name, content in hostile_slot_files().items():
        slot_file(tmp_path, name).write_bytes(content)
        with pytest.raises(SlotError, match="not a saved slot"):
            engine.restore_slot(0, slot_file(tmp_path, name))
    assert engine.erase_slot(0) > 0 and engine.cached_ids == []


# -- over HTTP ---------------------------------------------------------------------------------


def test_slots_routes_and_billing_header(smollm2_path, tmp_path):
    from atlas_cli.serve.app import create_app
    from atlas_cli.serve.http import ServeConfig
    from tests.serve_helpers import ServerThread, raw_request

    model = open_model(str(smollm2_path), device="cpu-ref", ctx_size=512)
    config = ServeConfig(model=str(smollm2_path), served_model_name="m", slot_save_path=tmp_path)
    app = create_app(config, model)

    def post(port, path, body):
        status, _, data = raw_request(port, "POST", path, json.dumps(body).encode())
        return status, json.loads(data)

    def message(port, billing: str, text: str):
        system = [
            {"type": "text", "text": f"x-anthropic-billing-header: cc_version={billing};"},
            {"type": "text", "text": SYSTEM},
        ]
        body = {"model": "m", "max_tokens": 2, "system": system, "temperature": 0}
        body["messages"] = [{"role": "user", "content": text}]
        status, out = post(port, "/v1/messages", body)
        assert status == 200, out
        return out["usage"]

    with ServerThread(app) as srv:
        first = message(srv.port, "1.0.1", "Say hi.")
        again = message(srv.port, "2.7.9", "Say hi.")  # a new billing line: the same prefix
        assert again["cache_read_input_tokens"] >= first["input_tokens"] - 1
        status, _, slots = raw_request(srv.port, "GET", "/slots")
        (slot,) = json.loads(slots)
        assert status == 200 and slot["n_tokens"] > 0
        sid = slot["id"]
        status, saved = post(srv.port, f"/slots/{sid}?action=save", {"filename": "s1"})
        assert status == 200 and saved["n_saved"] == slot["n_tokens"], saved
        assert (tmp_path / "s1").stat().st_size == saved["n_written"]
        assert post(srv.port, f"/slots/{sid}?action=erase", {})[1]["n_erased"] == slot["n_tokens"]
        status, back = post(srv.port, "/slots/5?action=restore", {"filename": "s1"})
        assert status == 200 and back["n_restored"] == slot["n_tokens"]
        restored = message(srv.port, "3.0.0", "Say hi.")
        assert restored["cache_read_input_tokens"] >= first["input_tokens"] - 1
        status, err = post(srv.port, f"/slots/{sid}?action=save", {"filename": "../x"})
        assert status == 400 and "bad slot filename" in err["error"]["message"]
        assert post(srv.port, "/slots/99?action=save", {"filename": "y"})[0] == 404
        assert post(srv.port, "/slots/0?action=dance", {})[0] == 400
        # slot ids are ASCII digits: "²" (int() refuses it), "١" (int() takes it), 5,000 digits
        for bad in ("%C2%B2", "%D9%A1", "9" * 5000):
            status, err = post(srv.port, f"/slots/{bad}?action=erase", {})
            assert status == 400 and "slot id must be a number" in err["error"]["message"]


def _replay(model, path, order, reqs, cache_bytes) -> list[tuple[str, int, int, int]]:
    """Send `order`'s requests one at a time; (conversation, turn, prompt, cached) each."""
    import openai

    from atlas_cli.serve.app import create_app
    from atlas_cli.serve.http import ServeConfig
    from tests.serve_helpers import ServerThread

    model.engine.reset()
    config = ServeConfig(model=str(path), served_model_name="m", cache_bytes=cache_bytes)
    out = []
    with ServerThread(create_app(config, model)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", timeout=1800)
        for conv, k in order:
            messages, tools = reqs[conv][k]
            usage = client.chat.completions.create(
                model="m", messages=messages, tools=tools, max_completion_tokens=2,
                temperature=0, seed=42,
            ).usage  # fmt: skip
            out.append((conv, k, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens))
    return out


@pytest.mark.slow
def test_interleaved_mlperf_replay_reuses_each_conversations_prompt(smollm2_path):
    """Two MLPerf Edge Agentic conversations, turn by turn (A0 B0 A1 B1 ...), messages capped
    as in test_serve_mlperf.py: every turn after the first of each reuses all that its
    conversation sent before, so the share reused is (previous prompt) / (prompt), >= 90% once
    a turn adds under a tenth of the prompt (as the real 23K-token sessions do); one slot
    alone re-prefills what the other conversation evicted."""
    pytest.importorskip("openai")
    from tests.test_serve_mlperf import load_conversations, requests_of, trajectory_file

    convs = load_conversations(trajectory_file())
    chosen = sorted(convs, key=lambda c: (len(convs[c]), c))[:2]
    reqs = {c: requests_of(convs[c])[:TURNS] for c in chosen}
    order = [(c, k) for k in range(TURNS) for c in chosen]
    model = open_model(str(smollm2_path), ctx_size=8192)
    pooled = _replay(model, smollm2_path, order, reqs, None)
    single = _replay(model, smollm2_path, order[: 2 * SINGLE_TURNS], reqs, 0)
    for name, rows in (("pool", pooled), ("one slot", single)):
        previous: dict[str, int] = {}
        shares = []
        for conv, k, prompt, cached in rows:
            print(
                f"{name}: {conv} turn {k}: prompt {prompt}, cached {cached} ({cached / prompt:.1%})"
            )
            if k:
                shares.append((cached / prompt, (previous[conv] - 1) / prompt, cached))
            previous[conv] = prompt
        reused = [s for s, _, _ in shares]
        last = ", ".join(f"{r:.1%}" for r in reused[-2:])
        print(f"{name}: reused after the first turn: min {min(reused):.1%}, "
              f"mean {np.mean(reused):.1%}, last two {last}")  # fmt: skip
        if name == "pool":  # everything the conversation sent before comes from the cache
            assert all(share >= bound for share, bound, _ in shares)
            assert all(share >= 0.9 for share, bound, _ in shares if bound >= 0.9)
            assert reused[-1] >= 0.9 and reused[-2] >= 0.9
        else:
            assert all(share < bound for share, bound, _ in shares)
