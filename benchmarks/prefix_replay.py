"""Two MLPerf Edge Agentic conversations interleaved turn by turn through `atlas serve`'s app:
how much of each prompt the prefix cache serves, per turn, with the pool and with one slot.

    python benchmarks/prefix_replay.py                        # tiny dense and hybrid, 64K
    python benchmarks/prefix_replay.py --model tiny-hybrid --start 0 --turns 46
    python benchmarks/prefix_replay.py --model smollm2 --start 0 --turns 12   # capped to 8K

The requests are the MLPerf harness's: one chat request per user or tool row, the system
prompt plus the *recorded* history up to that row, `tools` in every request, temperature 0,
sent one at a time as A[s] B[s] A[s+1] B[s+1] ... (s = --start). Each request goes through
the OpenAI client to the server's app in this process (uvicorn on a loopback port), and the
table reads `usage.prompt_tokens_details.cached_tokens` off the answers.

The recorded prompts grow from ~1.5K to ~20-30K tokens, past SmolLM2's 8K context, so the
default models are built here (see `build_tiny`): random weights of two layers and hidden 64,
a 64K context, and SmolLM2's own tokenizer and chat template copied from the embedded model's
GGUF, as a Qwen3 (dense) and a Qwen3.5 (Gated DeltaNet + attention) file. The weights say
nothing about quality; what is measured is which tokens are prefilled, and that depends on the
tokenizer, the template and the cache only. `--model smollm2` runs the embedded model with
each message capped (`--cap`) so that the prompts fit its context; any other name or path runs
that model uncapped unless told.

A turn can reuse at most what its conversation sent before: `bound` = (previous prompt - 1) /
prompt (the last prompt token is recomputed for its logits, and the recorded answer replaces
the one generated). Early turns add whole files of tool output (in the file's first two
conversations the bound is 79-90% on requests 1-4, 8 and 9); later turns add a few hundred
tokens to 15-20K, so the default window (requests 48-52 of those two) is one where the bound
is >= 90% on every turn. `--start 0 --turns 57` replays them whole.
After the replay, conversation A's slot is saved, a new model and server restore it, and A's
next request is sent to that server and to a cold one: the restored one prefills the new
suffix only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from make_random_gguf import Shape, write_f16  # noqa: E402

from atlas_cli.bench import trajectories as traj  # noqa: E402
from atlas_cli.bench.capping import cut_text  # noqa: E402

DATA = Path("data/mlperf-edge-agentic/agentic_coding_2.5h.jsonl")
DEFAULT_TRAJECTORIES = REPO.parent / "shared" / DATA  # beside the checkout, or --trajectories
TINY_CONTEXT = 65536
SMOLLM2_VOCAB = 49152  # the tiny models' embedding rows: one per token of SmolLM2's vocabulary
TINY = {
    "tiny-dense": Shape(
        "qwen3", 64, 2, 4, 2, 16, 128, SMOLLM2_VOCAB, 1_000_000.0, TINY_CONTEXT, 0
    ),
    # layers [Gated DeltaNet, gated attention]: the linear state is what the pool checkpoints
    "tiny-hybrid": Shape(
        "qwen35", 64, 2, 4, 2, 16, 128, SMOLLM2_VOCAB, 10_000_000.0, TINY_CONTEXT, 0,
        extra=dict(
            full_attention_interval=2, conv_kernel=4, key_heads=2, value_heads=2,
            key_dim=16, value_dim=16, partial_rotary=0.25, mrope_sections=[1, 1, 0, 0],
        ),
    ),
}  # fmt: skip
# --model smollm2: each message cut to this many characters (as tests/test_serve_mlperf.py
# does), so that 12 requests of a conversation stay inside 8K tokens
SMOLLM2_CAP = {"system": 400, "user": 600, "tool": 160, "command": 120}
MAX_TOKENS = 2  # the answers are not what is measured; the recorded ones are sent back
SLOT_FILE = f"prefix-replay-{os.getpid()}"  # in slot_dir(), removed after


def slot_dir() -> Path:
    """The servers' --slot-save-path: the slots folder of atlas's cache folder."""
    from atlas_cli.store import paths

    return paths.cache_dir() / "slots"


@dataclass(frozen=True)
class Turn:
    conv: str
    index: int  # the request's position in its conversation
    prompt: int
    cached: int
    seconds: float  # the whole request (prefill dominates: two tokens are generated)


@dataclass(frozen=True)
class Restore:
    saved: int  # tokens in the saved slot (its last prompt and the reply generated to it)
    previous: int  # that last prompt's tokens: what the next request can reuse
    prompt: int  # the next request of the conversation, on the restarted server
    cached: int
    seconds: float
    cold_cached: int  # the same request to a server that restored nothing
    cold_seconds: float


# -- models ------------------------------------------------------------------------------------


def smollm2_path() -> Path:
    from atlas_cli.store import embedded, locate

    return locate.resolve(embedded.DEFAULT_MODEL)


def build_tiny(kind: str, out_dir: Path, tokenizer_gguf: Path) -> Path:
    """A random-weight GGUF of `TINY[kind]` with the embedded SmolLM2's tokenizer and chat
    template (every `tokenizer.*` key of its file); built once per `out_dir`."""
    path = out_dir / f"{kind}.gguf"
    if not path.is_file():
        out_dir.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        write_f16(partial, TINY[kind], seed=0, tokenizer=tokenizer_gguf)
        partial.replace(path)
    return path


def resolve_model(name: str, work: Path, ctx: int | None, cap: bool | None, smollm2: Path):
    """(model path, context, per-message caps or None) for --model; `smollm2`: the embedded
    model's file."""
    if name in TINY:
        return build_tiny(name, work, smollm2), ctx or TINY_CONTEXT, SMOLLM2_CAP if cap else None
    if name == "smollm2":
        return smollm2, ctx or 8192, None if cap is False else SMOLLM2_CAP
    return Path(name), ctx, SMOLLM2_CAP if cap else None


# -- requests ----------------------------------------------------------------------------------


def cap_messages(messages: list[dict], caps: dict[str, int]) -> list[dict]:
    """Each message cut on its own (reasoning dropped), so each request still extends the
    previous one."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if k != "reasoning_content"}
        if isinstance(m.get("content"), str) and m["role"] in caps:
            m["content"] = cut_text(m["content"], caps[m["role"]])
        calls = []
        for call in m.get("tool_calls") or []:
            args = json.loads(call["function"]["arguments"])
            if isinstance(args.get("command"), str):
                args["command"] = cut_text(args["command"], caps["command"])
            calls.append({**call, "function": {**call["function"], "arguments": json.dumps(args)}})
        out.append({**m, "tool_calls": calls} if calls else m)
    return out


def conversation_requests(
    path: Path, conversations: list[str] | None, start: int, count: int, caps: dict | None
) -> dict[str, list[tuple[list[dict], list[dict]]]]:
    """(messages, tools) of requests start .. start+count-1 of each conversation (default the
    file's first two, the order the harness issues them)."""
    convs = {c.id: c for c in traj.load(path)}
    chosen = conversations or list(convs)[:2]
    out = {}
    for cid in chosen:
        if cid not in convs:
            sys.exit(f"no conversation {cid!r} in {path}")
        reqs = list(traj.requests(convs[cid], start + count))[start:]
        if len(reqs) < count:
            sys.exit(f"{cid} has {convs[cid].n_requests} requests, fewer than {start + count}")
        out[cid] = [(cap_messages(r.messages, caps) if caps else r.messages, r.tools) for r in reqs]
    return out


# -- serving -----------------------------------------------------------------------------------


@contextmanager
def serving(model_path: Path, ctx: int | None, cache_bytes: int | None):
    """A freshly loaded model behind `atlas serve`'s app (what a restarted server is)."""
    from atlas_cli.serve.app import create_app
    from atlas_cli.serve.http import ServeConfig
    from atlas_cli.session import open_model
    from tests.serve_helpers import ServerThread

    model = open_model(str(model_path), ctx_size=ctx)
    config = ServeConfig(
        model=str(model_path),
        served_model_name="m",
        cache_bytes=cache_bytes,
        slot_save_path=slot_dir(),
    )
    with ServerThread(create_app(config, model)) as srv:
        yield srv


def send(url: str, messages: list[dict], tools: list[dict]) -> tuple[int, int, float]:
    """One chat request as the harness sends it; (prompt tokens, cached tokens, seconds)."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=1800)
    sent = time.perf_counter()
    usage = client.chat.completions.create(
        model="m", messages=messages, tools=tools, max_completion_tokens=MAX_TOKENS,
        temperature=0, seed=42,
    ).usage  # fmt: skip
    return (
        usage.prompt_tokens,
        usage.prompt_tokens_details.cached_tokens,
        time.perf_counter() - sent,
    )


def post(url: str, path: str, body: dict) -> dict:
    headers = {"Content-Type": "application/json"}
    req = urllib.request.Request(url + path, json.dumps(body).encode(), headers, method="POST")
    with urllib.request.urlopen(req, timeout=600) as resp:
        return json.loads(resp.read())


def slots(url: str) -> list[dict]:
    with urllib.request.urlopen(url + "/slots", timeout=60) as resp:
        return json.loads(resp.read())


def replay(
    model_path: Path,
    ctx: int | None,
    reqs: dict[str, list],
    turns: int,
    start: int,
    cache_bytes: int | None,
    save_first: bool = False,
) -> list[Turn]:
    """Requests 0 .. turns-1 of each conversation, interleaved turn by turn, on a new server;
    with `save_first` the slot of the first conversation's last prompt is saved at the end."""
    rows = []
    with serving(model_path, ctx, cache_bytes) as srv:
        for k in range(turns):
            for conv, conv_reqs in reqs.items():
                prompt, cached, seconds = send(srv.url, *conv_reqs[k])
                rows.append(Turn(conv, start + k, prompt, cached, seconds))
        if save_first:
            first = next(iter(reqs))
            last = next(r.prompt for r in reversed(rows) if r.conv == first)
            (slot,) = [s for s in slots(srv.url) if s["n_prompt_tokens"] == last]
            post(srv.url, f"/slots/{slot['id']}?action=save", {"filename": SLOT_FILE})
    return rows


def restore(model_path: Path, ctx: int | None, previous: int, messages, tools) -> Restore:
    """The saved slot (whose last prompt had `previous` tokens) restored by a new model and
    server, then the conversation's next request; and the same request to a server that
    restored nothing."""
    with serving(model_path, ctx, None) as srv:
        saved = post(srv.url, "/slots/0?action=restore", {"filename": SLOT_FILE})["n_restored"]
        prompt, cached, seconds = send(srv.url, messages, tools)
    with serving(model_path, ctx, None) as srv:
        _, cold_cached, cold_seconds = send(srv.url, messages, tools)
    return Restore(saved, previous, prompt, cached, seconds, cold_cached, cold_seconds)


# -- the report --------------------------------------------------------------------------------


def bounds(rows: list[Turn]) -> list[float | None]:
    """Per row: the share its conversation's previous prompt allows (None on its first)."""
    previous: dict[str, int] = {}
    out = []
    for r in rows:
        out.append((previous[r.conv] - 1) / r.prompt if r.conv in previous else None)
        previous[r.conv] = r.prompt
    return out


def problems(rows: list[Turn], pooled: bool, target: float = 0.9) -> list[str]:
    """What fails the done-when: with the pool every later turn reuses all its conversation
    sent before, and >= `target` of its prompt wherever the recorded growth allows it; with
    one slot the other conversation has evicted that."""
    out = []
    for r, bound in zip(rows, bounds(rows), strict=True):
        if bound is None:
            continue
        share, allowed = r.cached / r.prompt, bound * r.prompt
        if pooled and r.cached < allowed:
            out.append(f"{r.conv} request {r.index}: cached {r.cached} < {allowed:.0f} sent before")
        if pooled and bound >= target and share < target:
            out.append(f"{r.conv} request {r.index}: reused {share:.1%} < {target:.0%}")
        if not pooled and r.cached >= allowed:
            out.append(f"{r.conv} request {r.index}: one slot kept all of it ({r.cached})")
    return out


def restore_problems(r: Restore) -> list[str]:
    """The restored slot must give the next request all of the saved prompt (but its last
    token, recomputed for its logits); a cold server nothing of it."""
    if r.cached >= r.previous - 1 and r.cold_cached < r.previous - 1:
        return []
    return [f"the restored slot was not reused: {r}"]


def table(name: str, rows: list[Turn]) -> str:
    width = max(len(r.conv) for r in rows)
    lines = [f"{'':{len(name)}}  {'conversation':{width}} req  prompt  cached   share  bound     s"]
    for r, bound in zip(rows, bounds(rows), strict=True):
        b = f"{bound:6.1%}" if bound is not None else "     -"
        lines.append(
            f"{name}  {r.conv:{width}} {r.index:3d} {r.prompt:7,} {r.cached:7,} "
            f"{r.cached / r.prompt:6.1%} {b} {r.seconds:5.2f}"
        )
    later = [(r, b) for r, b in zip(rows, bounds(rows), strict=True) if b is not None]
    if later:
        shares = [r.cached / r.prompt for r, _ in later]
        prefilled = sum(r.prompt - r.cached for r, _ in later)
        lines.append(
            f"{name}: after the first turn of each: share min {min(shares):.1%}, "
            f"mean {sum(shares) / len(shares):.1%}; {prefilled:,} tokens prefilled, "
            f"{sum(r.seconds for r, _ in later):.1f} s"
        )
    return "\n".join(lines)


def restore_line(r: Restore) -> str:
    return (
        f"restore: {r.saved:,} tokens restored (a {r.previous:,}-token prompt and its reply); "
        f"next request {r.prompt:,} tokens, cached "
        f"{r.cached:,}, prefilled {r.prompt - r.cached:,} in {r.seconds:.2f} s "
        f"(a cold server: cached {r.cold_cached:,}, {r.cold_seconds:.2f} s)"
    )


def run(args, name: str, work: Path, smollm2: Path) -> dict:
    """The pooled replay, the single-slot one and the restore, for one model; printed."""
    path, ctx, caps = resolve_model(name, work, args.ctx_size, args.cap, smollm2)
    reqs = conversation_requests(
        args.trajectories, args.conversation, args.start, args.turns + 1, caps
    )
    t0 = time.perf_counter()
    pooled = replay(path, ctx, reqs, args.turns, args.start, args.cache_size, save_first=True)
    print(f"== {name}: {len(reqs)} conversations x {args.turns} requests from {args.start}")
    print(table("pool", pooled))
    single = replay(path, ctx, reqs, args.single_turns, args.start, 0)
    print(table("one slot", single))
    first = next(iter(reqs))
    previous = next(r.prompt for r in reversed(pooled) if r.conv == first)
    restored = restore(path, ctx, previous, *reqs[first][args.turns])
    print(restore_line(restored))
    found = problems(pooled, True) + problems(single, False) + restore_problems(restored)
    print("\n".join(found) or "checks: ok", f"({time.perf_counter() - t0:.0f} s)\n")
    return {"pool": pooled, "single": single, "restore": restored, "problems": found}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", action="append", help="tiny-dense, tiny-hybrid, smollm2, or a "
                    "model name or path (repeatable; default the two tiny ones)")  # fmt: skip
    ap.add_argument("--trajectories", type=Path, default=DEFAULT_TRAJECTORIES)
    ap.add_argument("--conversation", action="append", help="conversation id (repeatable)")
    ap.add_argument("--start", type=int, default=48, help="first request of each conversation")
    ap.add_argument("--turns", type=int, default=5, help="requests per conversation (pool)")
    ap.add_argument("--single-turns", type=int, default=3, help="requests per conversation "
                    "in the single-slot run (each re-prefills most of its prompt)")  # fmt: skip
    ap.add_argument("--ctx-size", type=int)
    ap.add_argument("--cache-size", type=int, help="the pool's budget in bytes (default: auto)")
    ap.add_argument("--cap", action=argparse.BooleanOptionalAction, default=None,
                    help="cap each message (default: only for smollm2)")  # fmt: skip
    ap.add_argument("--work", type=Path, help="where the tiny models are built (default: temp)")
    args = ap.parse_args()
    if not args.trajectories.is_file():
        sys.exit(f"no trajectory file at {args.trajectories}: give --trajectories")
    models = args.model or list(TINY)
    smollm2 = smollm2_path()
    try:
        with tempfile.TemporaryDirectory(prefix="atlas-prefix-replay-") as tmp:
            results = [run(args, name, args.work or Path(tmp), smollm2) for name in models]
    finally:
        (slot_dir() / SLOT_FILE).unlink(missing_ok=True)
    sys.exit(1 if any(r["problems"] for r in results) else 0)


if __name__ == "__main__":
    main()
