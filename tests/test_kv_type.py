"""`--kv-type` / `kv_dtype=`: the KV cache type of a model on a native device, the recipe's by
default; on the fast CPU path f16 or f32 (test_cpu_kv.py); refused before loading when
unknown or not the device's."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from atlas_cli.cli import app
from atlas_cli.errors import UsageError
from atlas_cli.session import open_model

NVFP4 = Path(__file__).parent / "fixtures" / "qwen" / "qwen35-nvfp4"


def kv_of(model) -> str:
    return model.engine.model.new_cache(64).device_kv.dtype


@pytest.mark.slow
def test_each_model_keeps_the_kv_type_it_was_loaded_with(emu_home):
    fp8 = open_model(str(NVFP4), device="emu", kv_dtype="fp8", draft=0)
    f32 = open_model(str(NVFP4), device="emu", kv_dtype="f32", draft=0)
    plain = open_model(str(NVFP4), device="emu", draft=0)
    assert (kv_of(fp8), kv_of(f32), kv_of(plain)) == ("fp8", "f32", "bf16")
    assert fp8.engine.model.ops.rt is f32.engine.model.ops.rt  # one runtime, one kernel cache
    # the fp8 cache serves a whole generation
    events = list(fp8.generate("hi", max_tokens=4))
    assert any(e.text for e in events)


@pytest.mark.slow
def test_atlas_run_takes_kv_type(emu_home):
    args = ["run", "--device", "emu", str(NVFP4), "hi", "-n", "4", "--temperature", "0"]
    result = CliRunner().invoke(app, [*args, "--kv-type", "fp8"])
    assert result.exit_code == 0, result.output
    assert result.output.strip()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--kv-type", "f8"], "--kv-type must be one of bf16, fp8, f32, f16"),
        (["--kv-type", "fp8", "--device", "cpu"], "--device cpu keeps its KV cache in f16 or f32"),
        (["--kv-type", "f16", "--device", "cpu-ref"], "--device cpu-ref keeps its KV cache in f32"),
        (["--kv-type", "f16", "--device", "emu"], "f16 is for --device cpu"),
    ],
)
def test_bad_kv_types_are_one_line_errors(args, message, monkeypatch, tmp_path):
    monkeypatch.setenv("ATLAS_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = CliRunner().invoke(app, ["run", str(NVFP4), "hi", "-n", "1", *args])
    assert result.exit_code != 0
    assert message in result.output and "Traceback" not in result.output


def test_the_api_refuses_an_unknown_kv_type_before_resolving():
    with pytest.raises(UsageError, match="--kv-type must be one of"):
        open_model("no-such-model-anywhere", kv_dtype="int4")
