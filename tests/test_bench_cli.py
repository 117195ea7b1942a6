"""`atlas bench` from the command line, on the real default model with tiny sizes."""

import json
import sys

import pytest
from typer.testing import CliRunner

from atlas_cli.bench import cli as bench_cli
from atlas_cli.bench import coherence
from atlas_cli.cli import app, main
from tests.bench_helpers import tiny_conversation, write_jsonl

runner = CliRunner()


def invoke(args: list[str]):
    """Run `atlas ARGS` as main() does: `bench MODEL ...` routed to the default subcommand."""
    if args[:1] == ["bench"]:
        args = ["bench", *bench_cli.route_bench_args(args[1:])]
    return runner.invoke(app, args)


@pytest.fixture()
def shared_model(monkeypatch, smollm2):
    """Reuse the session's loaded model instead of loading it per command."""
    monkeypatch.setattr(bench_cli, "_load", lambda name, device, ctx, kv_type=None: smollm2)
    yield smollm2
    smollm2.engine.reset()


@pytest.mark.slow  # over a minute on two cores: four bench runs of the real model
def test_throughput_json_then_both_gate_outcomes(smollm2_path, tmp_path):
    base = tmp_path / "base.json"
    args = ["bench", str(smollm2_path), "-p", "8", "-n", "2", "-r", "2", "--no-warmup", "-t", "1"]
    result = invoke([*args, "-o", "json", "--save-baseline", str(base)])
    assert result.exit_code == 0, result.output
    records = json.loads(result.stdout)
    assert [r["test"] for r in records] == ["pp8", "tg2"]
    for r in records:
        assert len(r["samples_ns"]) == len(r["samples_ts"]) == r["repetitions"] == 2
        assert r["avg_ts"] > 0 and r["model_n_params"] > 100e6 and r["backend"] == "CPU"
        for key in ("atlas_version", "git_commit", "device", "driver", "cpu_info", "test_time"):
            assert key in r
    assert json.loads(base.read_text())["records"][0]["test"] == "pp8"

    ok = invoke([*args, "-r", "1", "--baseline", str(base), "--tolerance", "1000"])
    assert ok.exit_code == 0, ok.output
    assert "| llama 135M Q4_1 |" in ok.stdout and "gate: PASS" in ok.output

    fast = json.loads(base.read_text())
    fast["records"][0]["avg_ts"] = 1e12  # no CPU reaches this: the gate must fail
    base.write_text(json.dumps(fast))
    bad = invoke([*args, "-r", "1", "--baseline", str(base)])
    assert bad.exit_code == 1
    assert "pp8 t/s" in bad.output and "REGRESSED" in bad.output and "gate: FAIL" in bad.output


def test_agentic_replay_in_process(shared_model, tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", tiny_conversation("a", 2) + tiny_conversation("b", 0))
    out = tmp_path / "result.json"
    args = ["bench", "agentic", "m", "--trajectories", str(path), "--limit-turns", "2", "-t", "1"]
    result = invoke(
        [*args, "--max-tokens", "2", "--cold-ttft", "--output-file", str(out), "--per-turn"]
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    turns = doc["turns"]
    assert [(t["conversation_id"], t["turn"]) for t in turns] == [("a", 1), ("a", 3), ("b", 1)]
    assert all(0 < t["output_tokens"] <= 2 and t["ttft_cold_s"] > 0 for t in turns)
    # turn 3 extends turn 1's prompt; conversation b shares the system prompt and tools with a
    assert turns[1]["cached_tokens"] >= turns[0]["input_tokens"] - 1
    assert turns[2]["cached_tokens"] > 0
    assert doc["settings"]["tool_format"] == "text"  # SmolLM2's template has no tools
    assert doc["summary"]["requests"] == 3 and doc["summary"]["conversations"] == 2
    assert "| TTFT (ms) |" in result.stdout and "| a | 3 |" in result.stdout

    cold = invoke([*args, "--limit-conversations", "1", "--max-tokens", "1",
                   "--no-prefix-cache", "-o", "json"])  # fmt: skip
    assert cold.exit_code == 0, cold.output
    assert [t["cached_tokens"] for t in json.loads(cold.stdout)["turns"]] == [0, 0]


def test_agentic_errors(tmp_path):
    missing = invoke(["bench", "agentic", "--trajectories", str(tmp_path / "x")])
    assert missing.exit_code == 1 and "no such trajectory file" in missing.output
    bad = invoke(["bench", "agentic", "--trajectories", "x", "--max-tokens", "0"])
    assert bad.exit_code == 2 and "--max-tokens must be at least 1" in bad.output
    fmt = invoke(["bench", "-o", "xml"])
    assert fmt.exit_code == 2 and "-o takes one of" in fmt.output


def test_coherence_gate(shared_model, monkeypatch):
    monkeypatch.setitem(coherence.SETS, "facts", (coherence.PROBES[0],))
    good = invoke(["bench", "coherence", "--max-tokens", "16", "-t", "1"])
    assert good.exit_code == 0, good.output
    assert "PASS  What is the capital of France?" in good.stdout
    wrong = coherence.Probe("What is the capital of France?", ("Berlin",))
    monkeypatch.setitem(coherence.SETS, "facts", (wrong,))
    bad = invoke(["bench", "coherence", "--max-tokens", "16", "-t", "1"])
    assert bad.exit_code == 1 and "missing 'Berlin'" in bad.stdout


def test_bench_routes_a_model_to_the_default_subcommand():
    route = bench_cli.route_bench_args
    assert route(["m.gguf", "-p", "8"]) == ["throughput", "m.gguf", "-p", "8"]
    assert route(["-o", "json"]) == ["throughput", "-o", "json"]
    assert route([]) == ["throughput"]
    for words in (["agentic", "--trajectories", "t.jsonl"], ["coherence"], ["--help"], ["-h"]):
        assert route(words) == words
    listing = invoke(["bench", "--help"])
    assert listing.exit_code == 0 and "agentic" in listing.output


def test_main_routes_bench_before_typer_parses(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["atlas", "bench", "-o", "xml"])
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 2 and "-o takes one of" in capsys.readouterr().err


def test_coherence_judge_on_recorded_answers():
    probe = coherence.Probe("Who wrote Romeo and Juliet?", ("Shakespeare",))
    looping = (  # SmolLM2-135M's own answer at temperature 0
        "The story of Romeo and Juliet by William Shakespeare is attributed to the 17th-century "
        "French playwright and poet. The play, written in 1595, is a Romeo and Juliet story, set "
        "in the balcony of the balcony of the balcony of the balcony of the"
    )
    verdict = coherence.judge(probe, looping, "length", 60)
    assert not verdict.passed
    assert any("repeats" in p for p in verdict.problems)
    assert any("no end of turn" in p for p in verdict.problems)
    assert coherence.judge(probe, "William Shakespeare.", "stop", 4).passed
    assert coherence.judge(probe, "  ", "stop", 1).problems[:1] == ("empty answer",)
    four = coherence.Probe("What is 2 + 2?", ("4",))
    assert not coherence.judge(four, "The answer is 42.", "stop", 5).passed
    assert coherence.judge(four, "2 + 2 = 4.", "stop", 5).passed


def test_threads_limit_the_blas_even_before_numpy_is_loaded():
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from atlas_cli.bench.cli import _apply_threads\n"
        "assert 'numpy' not in sys.modules\n"
        "from threadpoolctl import threadpool_info\n"
        "with _apply_threads(1):\n"
        "    blas = [i for i in threadpool_info() if i['user_api'] == 'blas']\n"
        "    assert blas and all(i['num_threads'] == 1 for i in blas)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_an_installed_copy_knows_its_commit(tmp_path, monkeypatch):
    """An installed wheel has no checkout beside it: the commit comes from what pip recorded
    (a git URL's commit, or the local folder it was installed from)."""
    import subprocess
    from types import SimpleNamespace

    from atlas_cli.bench import sysinfo

    site = tmp_path / "site-packages" / "atlas_cli" / "bench"
    site.mkdir(parents=True)
    monkeypatch.setattr(sysinfo, "__file__", str(site / "sysinfo.py"))
    source = tmp_path / "source"
    source.mkdir()
    git = ["git", "-C", str(source), "-c", "user.name=a", "-c", "user.email=a@b"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "x"], check=True)
    head = subprocess.run([*git, "rev-parse", "--short=12", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()  # fmt: skip

    def installed_from(record: dict):
        dist = SimpleNamespace(read_text=lambda name: json.dumps(record))
        monkeypatch.setattr(sysinfo.metadata, "distribution", lambda name: dist)
        return sysinfo.git_commit.__wrapped__()

    assert installed_from({"url": f"file://{source}", "dir_info": {}}) == head
    vcs = {"url": "https://example.org/atlas.git", "vcs_info": {"commit_id": "0123456789abcdef"}}
    assert installed_from(vcs) == "0123456789ab"
    assert installed_from({"url": "https://files.example.org/atlas.whl"}) is None


def test_agentic_without_trajectories_says_where_to_get_them():
    result = CliRunner().invoke(app, ["bench", "agentic"])
    assert result.exit_code == 2
    assert "--trajectories FILE" in result.output and "mlcommons/endpoints" in result.output
