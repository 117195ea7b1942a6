"""`atlas chat` from the command line: shared options, bad values, a piped session."""

from __future__ import annotations

import subprocess
import sys

from typer.testing import CliRunner

from atlas_cli.cli import app


def test_chat_shares_the_run_options():
    result = CliRunner().invoke(app, ["chat", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for flag in (
        "--system",
        "--temperature",
        "--top-k",
        "--top-p",
        "--min-p",
        "--repeat-penalty",
        "--seed",
        "--max-tokens",
        "--stop",
        "--device",
        "--verbose",
        "--ctx-size",
        "--think",
        "--markdown",
        "--no-history",
    ):
        assert flag in result.output, flag


def test_bad_values_fail_before_loading():
    result = CliRunner().invoke(app, ["chat", "--think", "maybe"])
    assert result.exit_code == 2 and "think must be one of on, hidden, off" in result.output
    result = CliRunner().invoke(app, ["chat", "--temperature", "-1"])
    assert result.exit_code == 2 and "temperature must be >= 0" in result.output


def test_cli_import_stays_light():
    code = (
        "import sys, atlas_cli.cli; print('numpy' in sys.modules, 'prompt_toolkit' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.split() == ["False", "False"], done.stderr


def test_piped_chat(smollm2_path, monkeypatch, tmp_path):
    monkeypatch.setenv("ATLAS_HOME", str(tmp_path))
    lines = (
        'What is the capital of France?\n"""\nRepeat your previous\nanswer exactly.\n"""\n/bye\n'
    )
    result = CliRunner().invoke(
        app,
        ["chat", str(smollm2_path), "--temperature", "0", "-n", "8", "--device", "cpu-ref"],
        input=lines,
    )
    assert result.exit_code == 0, result.output
    assert "atlas chat · SmolLM2-135M-Instruct.Q4_1.gguf" in result.output
    assert result.output.count("The capital of France is Paris.") == 2
    assert not (tmp_path / "chat_history").exists()  # a pipe has no history to keep
