"""What a new user meets in the first hour: typos of model names, piped chat, help and parser
errors, the memory estimate, the kernel-compile notice, names, the server's front door."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from atlas_cli.cli import app

runner = CliRunner()


def atlas(*args, input=None, env=None):
    return runner.invoke(app, list(args), input=input, env=env)


def no_loading(monkeypatch):
    from atlas_cli import session

    def refuse(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(session, "open_model", refuse)


def one_line_error(result, code):
    assert result.exit_code == code, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("atlas: error: "), result.stderr
    assert "Traceback" not in result.output and "╭" not in result.output
    return lines[0]


# -- 1: a misspelt model name is not a prompt --------------------------------------------------


@pytest.mark.parametrize(
    "typo, meant",
    [("qwen3-8bb", "qwen3-8b"), ("smolm2", "smollm2-135m"), ("lama3.2-1b", "llama3.2-1b")],
)
def test_run_refuses_a_misspelt_model_name(typo, meant, monkeypatch):
    no_loading(monkeypatch)
    line = one_line_error(atlas("run", typo), code=1)
    assert f"model '{typo}' does not exist" in line and meant in line
    assert "qwen3:8b" not in line  # aliases are named by their recipe


def test_run_takes_ordinary_words_as_the_prompt(monkeypatch):
    from atlas_cli.commands.run import near_model_names, split_model_and_prompt

    no_loading(monkeypatch)
    for prompt in ("hello", "what is 2+2", "summarize", "Paris?", "explain", "2+2"):
        assert near_model_names(prompt) == []
        assert split_model_and_prompt(prompt, None) == ("smollm2-135m", prompt)


def test_run_takes_an_installed_name_as_a_model(monkeypatch, tmp_path):
    from atlas_cli.commands.run import near_model_names

    monkeypatch.setenv("ATLAS_HOME", str(tmp_path))
    (tmp_path / "models" / "mistral-7b-local").mkdir(parents=True)
    assert near_model_names("mistral-7b-locl") == ["mistral-7b-local"]


def test_chat_refuses_a_misspelt_model_before_any_output(monkeypatch):
    no_loading(monkeypatch)
    result = atlas("chat", "qwen3-8bb", input="hi\n")
    line = one_line_error(result, code=1)
    assert "unknown model 'qwen3-8bb'" in line and "qwen3-8b" in line
    assert result.stdout == ""


# -- 5: piped chat: the answers alone on stdout ------------------------------------------------


def test_piped_chat_keeps_the_banner_off_stdout(smollm2_path, monkeypatch, tmp_path):
    monkeypatch.setenv("ATLAS_HOME", str(tmp_path))
    result = atlas(
        "chat",
        str(smollm2_path),
        "--temperature",
        "0",
        "-n",
        "8",
        "--device",
        "cpu-ref",
        input="What is the capital of France?\n/clear\n/bye\n",
    )
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == "The capital of France is Paris."
    for line in ("Loading SmolLM2", "atlas chat ·", "/help: commands", "Cleared the conversation"):
        assert line in result.stderr, line


# -- 9: help and parser errors -----------------------------------------------------------------


def test_bare_atlas_prints_the_help_and_succeeds():
    result = atlas()
    assert result.exit_code == 0
    assert "Usage: atlas" in result.stdout and "run" in result.stdout and "chat" in result.stdout


def test_a_group_alone_prints_its_help():
    result = atlas("bench")
    assert result.exit_code == 0 and "Usage: atlas bench" in result.stdout
    assert "throughput" in result.stdout and result.stderr == ""


def test_switches_have_no_type_and_help_reads_at_80_columns():
    result = atlas("run", "--help", env={"COLUMNS": "80", "TERM": "dumb"})
    assert result.exit_code == 0
    assert "<bool>" not in result.output and "--no-raw" not in result.output
    lines = result.output.splitlines()
    assert max(map(len, lines)) <= 80
    raw = next(i for i, line in enumerate(lines) if line.lstrip().startswith("--raw"))
    # the description starts on the switch's line and needs at most one more
    described = lines[raw].split("--raw", 1)[1].strip()
    assert described.startswith("Send the prompt as is") and len(described) >= 35  # rich gave ~22


@pytest.mark.parametrize(
    "args, says",
    [
        (["run", "--bogus", "hi"], "no such option --bogus (see `atlas run --help`)"),
        (["run", "--temprature", "1", "hi"], "did you mean --temperature?"),
        (["show"], "missing argument 'name' (see `atlas show --help`)"),
        (["bogus"], "no such command 'bogus'"),
        (["run", "-n", "x", "hi"], "invalid value for '--max-tokens'"),
    ],
)
def test_parser_errors_are_one_line(args, says, monkeypatch):
    no_loading(monkeypatch)
    line = one_line_error(atlas(*args), code=2)
    assert says in line
    assert "Possible options" not in line and "--verbose" not in line


def test_parser_errors_from_the_installed_command():
    done = subprocess.run(
        [sys.executable, "-m", "atlas_cli", "run", "--bogus"], capture_output=True, text=True
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == "atlas: error: no such option --bogus (see `atlas run --help`)\n"


def test_unknown_device_names_only_installed_runtimes(monkeypatch):
    import importlib.util

    from atlas_cli import backend
    from atlas_cli.backend.ops.native import runtime_emu

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n in ("cupy", "hip") else real(n, *a)
    )
    monkeypatch.setattr(runtime_emu, "available", lambda: False)  # no C++ compiler either
    line = one_line_error(atlas("run", "--device", "tpu", "hi"), code=1)
    assert line.endswith("(available here: cpu, cpu-ref)")
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object())
    monkeypatch.setattr(runtime_emu, "available", lambda: True)
    assert backend.installed_devices() == ["cpu", "cpu-ref", "cuda", "hip", "emu"]


def test_no_advice_to_raise_the_context_at_the_model_s_limit(smollm2):
    from atlas_cli.errors import ContextOverflowError

    engine = smollm2.engine
    limit = engine.model.args.max_position_embeddings
    assert engine.context_length == limit and not engine.can_grow
    with pytest.raises(ContextOverflowError) as info:
        engine._check_fits(limit + 1)
    assert "--ctx-size" not in str(info.value) and "the model's limit" in str(info.value)


# -- 3: one memory estimate, counting the blocks the CPU computes on ---------------------------


def test_recipe_estimate_counts_gguf_blocks_on_the_cpu():
    from atlas_cli import fit, recipes

    r = recipes.get("smollm2-135m")
    fast = fit.recipe_estimate(r, "q4_1", "cpu", 64 * 10**9, "cpu")
    assert fast.weights_bytes == r.variants["q4_1"].size  # the blocks, not 4 bytes a parameter
    assert fast.total_bytes < 10**9  # the old estimate said 1.2 GB
    ref = fit.recipe_estimate(r, "q4_1", "cpu", 64 * 10**9, "cpu-ref")
    assert ref.weights_bytes == r.model.parameter_count * 4  # the float32 reference
    big = recipes.get("qwen3.6-27b")
    est = fit.recipe_estimate(big, "q4_k_m", "cpu", 32 * 10**9, "cpu")
    assert est.weights_bytes == big.variants["q4_k_m"].size and est.fits  # not "115 GB"


def test_the_recipe_estimate_is_the_load_time_count(smollm2_path):
    from atlas_cli import backend, fit, recipes

    weights = backend._open_gguf(smollm2_path, True, lazy_unpermute=True).weights()  # as on cpu
    loaded = fit.weight_bytes(weights)
    r = recipes.get("smollm2-135m")
    predicted = fit.variant_weight_bytes(r.variants["q4_1"], r.model.parameter_count, "cpu")
    assert abs(predicted - loaded) / loaded < 0.03, (predicted, loaded)  # the header's bytes


def test_show_and_list_print_the_one_estimate(monkeypatch, tmp_path):
    import json

    monkeypatch.setenv("ATLAS_HOME", str(tmp_path))
    shown = json.loads(atlas("show", "smollm2-135m", "--json", "--device", "cpu").stdout)
    listed = json.loads(atlas("list", "--available", "--json", "--device", "cpu").stdout)
    (row,) = [x for x in listed["recipes"] if x["name"] == "smollm2-135m"]
    moving = ("available_bytes", "fits")  # free memory changes between the two calls
    assert {k: v for k, v in shown["memory"].items() if k not in moving} == {
        k: v for k, v in row["memory"].items() if k not in moving
    }
    assert shown["memory"]["weights_bytes"] == 98_362_432
    text = atlas("show", "smollm2-135m", "--device", "cpu").stdout
    (line,) = [x for x in text.splitlines() if x.strip().startswith("memory:")]
    parts = [int(n) for n in re.findall(r"(\d+) MB", line)]  # total, then what it sums
    assert "(98 MB weights + 189 MB KV f16 + " in line and "1.2 GB" not in text
    assert abs(parts[0] - sum(parts[1:])) <= 1, line  # MB roundings
    bf16 = atlas("show", "qwen3-8b:bf16", "--device", "cpu").stdout
    assert "cpu gets q4_k_m" in bf16 and "weights are float32 on the CPU" in bf16
    table = atlas("list", "--available", "--device", "cpu").stdout
    assert table.splitlines()[0].split()[:6] == [
        "NAME", "PARAMS", "VARIANT", "FORMAT", "SIZE", "MEMORY"
    ]  # fmt: skip


def test_pull_prints_the_same_estimate(monkeypatch, tmp_path):
    from atlas_cli.store import manifest
    from atlas_cli.store import pull as pull_module

    monkeypatch.setenv("ATLAS_HOME", str(tmp_path))
    entry = manifest.Installed(
        "smollm2-135m", "q4_1", "gguf", "Q4_1", tmp_path / "m.gguf", (), 98_362_432, "pypi"
    )
    monkeypatch.setattr(pull_module, "pull", lambda *a, **k: entry)
    result = atlas("pull", "smollm2-135m", "--device", "cpu")
    assert result.exit_code == 0, result.output
    (line,) = [x for x in result.stdout.splitlines() if x.strip().startswith("memory:")]
    assert "(98 MB weights + 189 MB KV f16 + " in line and "fits in" in line


# -- 2: the kernel-compile notice, and where the compiled kernels go ---------------------------

KERNEL_CACHE_PROBE = (
    "from atlas_cli.backend.ops.cpu import jit, kernels as cpu_kernels\n"
    "from numba.core import config\n"
    "print(config.CACHE_DIR)\n"
    "print(cpu_kernels.row_dot._cache._impl.locator.get_cache_path())\n"
)


def test_compiled_kernels_live_in_atlas_s_cache(tmp_path):
    import os

    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env["ATLAS_HOME"] = str(tmp_path)
    done = subprocess.run(
        [sys.executable, "-c", KERNEL_CACHE_PROBE], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr
    cache_dir, kernel_dir = done.stdout.split()
    assert cache_dir == str(tmp_path / "cache" / "numba")
    assert kernel_dir.startswith(cache_dir) and "site-packages" not in kernel_dir
    env["NUMBA_CACHE_DIR"] = str(tmp_path / "mine")  # the user's own choice stands
    done = subprocess.run(
        [sys.executable, "-c", KERNEL_CACHE_PROBE], capture_output=True, text=True, env=env
    )
    assert done.stdout.split()[0] == str(tmp_path / "mine")


def test_compile_notice_also_without_a_terminal(smollm2_path, monkeypatch, capfd):
    from atlas_cli.backend.ops.cpu import decode as cpu_decode
    from atlas_cli.session import open_model

    monkeypatch.setattr(cpu_decode, "kernels_cached", lambda: False)  # as on a first run
    open_model(str(smollm2_path), device="cpu")
    err = capfd.readouterr().err  # a pipe, not a terminal
    lines = [line for line in err.splitlines() if "compiling the CPU kernels" in line]
    assert len(lines) == 1 and lines[0].startswith("atlas: compiling the CPU kernels")
    assert "\x1b[" not in lines[0]


# -- 10: models go by their recipe's name ------------------------------------------------------


def test_models_go_by_the_recipe_name(smollm2_path, tmp_path, monkeypatch):
    import shutil

    from atlas_cli.session import open_model

    by_name = open_model("smollm2-135m", device="cpu-ref")
    assert by_name.info.name == "smollm2-135m"
    assert open_model(str(smollm2_path), device="cpu-ref").info.name == "smollm2-135m"  # pulled
    copy = tmp_path / "mine.gguf"
    shutil.copy(smollm2_path, copy)
    # a file atlas did not pull keeps the name written in it
    assert open_model(str(copy), device="cpu-ref").info.name != "smollm2-135m"
    monkeypatch.setenv("ATLAS_HOME", str(tmp_path))
    result = atlas("chat", "--device", "cpu-ref", input="/show info\n/bye\n")
    assert result.exit_code == 0, result.output
    (row,) = [line for line in result.stdout.splitlines() if line.startswith("model")]
    assert row.split() == ["model", "smollm2-135m"]


# -- 12: the small things ----------------------------------------------------------------------


def test_the_server_says_what_it_is_at_the_root():
    from starlette.testclient import TestClient

    from atlas_cli.serve.app import ServeConfig, create_app

    app = create_app(ServeConfig(model="no-such-model", served_model_name="tiny"))
    with TestClient(app, base_url="http://127.0.0.1") as client:  # a page elsewhere: 403
        response = client.get("/")
    assert response.status_code == 200
    about = response.json()
    assert about["server"].startswith("atlas ") and about["model"] == "tiny"
    assert "/v1/chat/completions" in about["openai"] and "/v1/messages" in about["anthropic"]


def test_an_empty_gguf_says_so(tmp_path):
    empty = tmp_path / "empty.gguf"
    empty.touch()
    line = one_line_error(atlas("run", str(empty), "hi"), code=1)
    assert "empty.gguf: empty file" in line and "magic" not in line


def test_one_conversation_is_singular():
    from atlas_cli.bench.agentic import plural

    assert plural(1, "conversation") == "1 conversation"
    assert plural(2, "conversation") == "2 conversations"


def test_bench_shows_its_warm_ups_and_what_is_left(smollm2_path):
    args = ["bench", "throughput", str(smollm2_path), "-p", "8", "-n", "2", "-r", "2", "-t", "1"]
    result = atlas(*args)
    assert result.exit_code == 0, result.output
    steps = [line for line in result.stderr.splitlines() if line.startswith("bench [")]
    assert len(steps) == 2 * 3  # pp8 and tg2: a warm-up and two runs each
    assert steps[0].startswith("bench [1/6] pp8 warm-up (pp8, untimed)")
    assert steps[3].startswith("bench [4/6] tg2 warm-up (tg1, untimed)")
    assert all("left)" in line for line in steps[:-1]) and "left)" not in steps[-1]
