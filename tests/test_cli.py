"""The `atlas` CLI through Typer's runner, plus a subprocess check that --help stays light."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from atlas_cli import __version__
from atlas_cli.cli import app
from atlas_cli.commands import run as run_cmd

runner = CliRunner()


def atlas(*args, input=None):
    return runner.invoke(app, list(args), input=input)


def test_version():
    result = atlas("--version")
    assert result.exit_code == 0 and __version__ in result.output


def test_help_does_not_import_numpy():
    code = (
        "import sys\nfrom atlas_cli.cli import app\n"
        "try:\n    app(['--help'])\nexcept SystemExit:\n    pass\n"
        "print('numpy' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().endswith("False")


def test_help_imports_only_what_it_prints():
    """`atlas --help` needs the command tree, not what the commands run: no numpy, no rich,
    no backend or model session, no benchmark module beyond the bench group's flags, the
    gate's tolerance and the MLPerf round (the other defaults live in bench/options.py)."""
    heavy = ["numpy", "rich", "atlas_cli.backend", "atlas_cli.session", "atlas_cli.store.fetch"]
    light_bench = {
        "atlas_cli.bench",
        *(f"atlas_cli.bench.{m}" for m in ("cli", "options", "gate", "mlperf_rules")),
    }
    code = (
        "import sys\nfrom atlas_cli.cli import app\n"
        "try:\n    app(['--help'])\nexcept SystemExit:\n    pass\n"
        f"print([m for m in sys.modules if m in {heavy!r} or "
        f"m.startswith('atlas_cli.bench') and m not in {sorted(light_bench)!r}])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().endswith("[]")


def test_run_golden_prompt(smollm2_path):
    result = atlas("run", "--temperature", "0", "What is the capital of France?")
    assert result.exit_code == 0, result.output
    assert result.stdout == "The capital of France is Paris.\n"
    assert "\x1b[" not in result.output  # no colour codes when not a terminal


def test_run_explicit_model_and_json(smollm2_path):
    result = atlas(
        "run", str(smollm2_path), "What is the capital of France?", "--temperature", "0", "--json"
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["text"] == "The capital of France is Paris."
    assert data["finish_reason"] == "stop"
    assert data["prompt_tokens"] == 37 and data["completion_tokens"] == 7
    assert data["timings"]["ttft_s"] > 0


def test_run_prompt_from_stdin_and_verbose(smollm2_path):
    result = atlas(
        "run", "--temperature", "0", "-n", "3", "--verbose", input="What is the capital of France?"
    )
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("The capital of")
    for line in ("load duration:", "prompt eval rate:", "eval count:", "time to first token:"):
        assert line in result.stderr


def test_piped_text_goes_before_the_prompt(smollm2_path):
    """`cat notes.txt | atlas run "When is the meeting?"`: both reach the model, the piped
    text first (as ollama joins them); a prompt alone is unchanged."""
    args = ("run", "--raw", "-n", "1", "--json", "When is the meeting?")
    alone = json.loads(atlas(*args).stdout)["prompt_tokens"]
    notes = "Notes: the meeting moved to Thursday at 10:00, room 4.\n"
    both = json.loads(atlas(*args, input=notes).stdout)["prompt_tokens"]
    assert both > alone + 10
    assert run_cmd.with_piped_text(notes, "When?") == notes.rstrip() + "\n\nWhen?"
    assert run_cmd.with_piped_text(" \n", "When?") == "When?"
    assert run_cmd.with_piped_text(notes, None) == notes


def test_a_pipe_nobody_writes_to_does_not_hold_a_run(monkeypatch):
    """A parent that keeps stdin open without writing: with a prompt argument the run goes on
    after PIPE_WAIT_S instead of waiting for an end of input that never comes."""
    read_end, write_end = os.pipe()
    monkeypatch.setattr(run_cmd, "PIPE_WAIT_S", 0.05)
    with os.fdopen(read_end) as silent:
        monkeypatch.setattr(sys, "stdin", silent)
        assert run_cmd.read_piped(have_prompt=True) == ""
    os.close(write_end)


def test_run_model_alone_at_a_terminal_opens_a_chat(monkeypatch):
    from atlas_cli.commands import chat

    opened = {}
    monkeypatch.setattr(chat, "chat", lambda **kw: opened.update(kw))
    monkeypatch.setattr(run_cmd, "stdin_is_a_terminal", lambda: True)
    result = atlas("run", "smollm2-135m", "--temperature", "0.2")
    assert result.exit_code == 0, result.output
    assert opened["model"] == "smollm2-135m" and opened["temperature"] == 0.2


def test_prompt_figures_count_the_evaluated_tokens_and_the_cached_apart():
    """37 prompt tokens of which 30 came from the cache, evaluated in 0.5 s: 7 tokens at 14/s,
    30 cached (the count and the rate describe the same tokens, as llama.cpp prints them)."""
    from atlas_cli.backend.engine import GenerationStats

    stats = GenerationStats(prompt_tokens=37, cached_tokens=30, completion_tokens=5, prompt_s=0.5)
    result = run_cmd.RunResult("m", stats, 0.1, 1.0)
    block = result.stats_block()
    assert "prompt eval count:    7 token(s)" in block
    assert "prompt cached:        30 token(s)" in block
    assert "prompt eval rate:     14.00 tokens/s" in block
    data = result.as_json()
    assert (data["prompt_tokens"], data["cached_tokens"]) == (37, 30)
    assert data["timings"]["prompt_tokens_per_s"] == 14.0


@pytest.mark.parametrize("group", [[], ["bench"]])
def test_help_describes_each_command_in_a_whole_sentence(group):
    commands = atlas(*group, "--help").stdout.split("Commands:")[1]
    assert "..." not in commands
    assert "streamed as it is produced" in commands or "at depths." in commands


@pytest.mark.parametrize("words", [["-h"], ["run", "-h"], ["bench", "-h"], ["serve", "-h"]])
def test_dash_h_is_help_everywhere(words):
    result = atlas(*words)
    assert result.exit_code == 0 and result.stdout.startswith("Usage: atlas"), result.output


def test_run_raw_and_system(smollm2_path):
    result = atlas("run", "--raw", "--temperature", "0", "-n", "4", "The capital of France is")
    assert result.exit_code == 0 and result.stdout.strip()
    result = atlas("run", "--system", "Answer in one word.", "--temperature", "0", "-n", "4", "Hi")
    assert result.exit_code == 0 and result.stdout.strip()


def test_run_stop_string(smollm2_path):
    result = atlas("run", "--temperature", "0", "--stop", "Paris", "Capital of France?", "--json")
    assert "Paris" not in json.loads(result.stdout)["text"]


def one_line_error(result, code=1):
    assert result.exit_code == code, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("atlas: error:"), result.stderr
    assert "Traceback" not in result.output
    return lines[0]


def test_missing_file(tmp_path):
    line = one_line_error(atlas("run", str(tmp_path / "nope.gguf"), "hi"))
    assert "no such file" in line


def test_unknown_model_suggests():
    line = one_line_error(atlas("run", "smollm2-135", "hi"))
    assert "unknown model" in line and "smollm2-135m" in line


def test_corrupt_file(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(100))
    line = one_line_error(atlas("run", str(bad), "hi"))
    assert "bad.gguf" in line


def test_truncated_file(smollm2_path, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(smollm2_path.read_bytes()[:50_000_000])
    assert "truncated" in one_line_error(atlas("run", str(cut), "hi"))


def test_prompt_longer_than_context(smollm2_path):
    line = one_line_error(atlas("run", "--ctx-size", "32", "word " * 100))
    assert "context holds 32" in line


def test_bad_flag_value(smollm2_path):
    line = one_line_error(atlas("run", "--temperature", "-1", "hi"), code=2)
    assert "temperature" in line


def test_unknown_device():
    assert "unknown device" in one_line_error(atlas("run", "--device", "tpu", "hi"))


def test_ctrl_c_exits_130(smollm2_path, monkeypatch):
    from atlas_cli.backend.engine import Engine

    real = Engine.generate

    def interrupted(self, *args, **kwargs):
        for i, event in enumerate(real(self, *args, **kwargs)):
            if i == 2:
                raise KeyboardInterrupt
            yield event

    monkeypatch.setattr(Engine, "generate", interrupted)
    result = atlas("run", "--temperature", "0", "What is the capital of France?")
    assert result.exit_code == 130
    assert "Traceback" not in result.output
    assert result.stdout.startswith("The capital")


@pytest.mark.parametrize("args", [["run"], ["run", "smollm2-135m"]])
def test_no_prompt_is_a_usage_error(args, smollm2_path):
    result = atlas(*args, input="")
    assert result.exit_code == 2


@pytest.mark.parametrize(
    "args, says",
    [
        (["--temperature", "-1"], "temperature must be >= 0"),
        (["--top-p", "2"], "top-p must be in (0, 1]"),
        (["--seed", "-5"], "seed must be in"),
        (["--max-tokens", "0"], "--max-tokens"),
        (["-n", "-5"], "-n"),
    ],
)
def test_bad_values_fail_before_any_model_loads(args, says, monkeypatch):
    from atlas_cli import session

    def no_load(*a, **k):
        raise AssertionError("a model was loaded before the flags were checked")

    monkeypatch.setattr(session, "open_model", no_load)
    result = atlas("run", *args, "hi")
    assert result.exit_code == 2 and says in result.output, result.output


def test_blank_prompt_is_a_usage_error(monkeypatch):
    from atlas_cli import session

    monkeypatch.setattr(session, "open_model", lambda *a, **k: pytest.fail("loaded"))
    assert atlas("run", "   \n").exit_code == 2


def test_ctx_size_above_the_models_limit_is_refused(smollm2_path):
    line = one_line_error(atlas("run", "--ctx-size", "100000", "hi"), code=2)
    assert "8,192" in line and "100,000" in line


def test_threads_flag_on_run(smollm2_path):
    """`-t` means CPU threads on run, chat and serve as on bench (llama.cpp's flag)."""
    code = [sys.executable, "-m", "atlas_cli", "run", "-t", "1", "-n", "2", "--temperature", "0"]
    done = subprocess.run([*code, "Say hi."], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    for command in ("run", "chat", "serve"):
        assert "--threads" in atlas(command, "--help").output


def test_one_device_rule(monkeypatch):
    """run/chat/serve use what pull/list/show use: ATLAS_DEVICE, else the detected hardware."""
    from atlas_cli import hardware, session

    monkeypatch.setenv("ATLAS_DEVICE", "cpu-ref")
    assert session.default_device() == "cpu-ref"
    monkeypatch.delenv("ATLAS_DEVICE")
    assert session.default_device() == hardware.detect().device


def test_run_think_off_asks_the_model_not_to_think(monkeypatch):
    """`--think` means what it means in chat: off renders the prompt with enable_thinking
    false (templates such as Qwen3's then open an empty think block)."""
    from types import SimpleNamespace

    from atlas_cli.run_service import prompt_ids

    seen = {}
    model = SimpleNamespace(chat_prompt=lambda messages, **kw: seen.update(kw) or [1])
    prompt_ids(model, "hi", system=None, raw=False, think="off")
    assert seen == {"enable_thinking": False}
    seen.clear()
    prompt_ids(model, "hi", system=None, raw=False, think="on")
    assert seen == {}  # the template's (and the recipe's) own default
    assert atlas("run", "--think", "hidden", "hi").exit_code == 2
