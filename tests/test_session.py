"""Names are resolved once, in atlas_cli.session, and the recipe's run defaults travel with the
loaded model to every command."""

from __future__ import annotations

import pytest

from atlas_cli import session
from atlas_cli.backend.defaults import RunDefaults
from atlas_cli.backend.sample import SamplingOverrides
from atlas_cli.errors import DeviceError


def test_recipe_defaults_on_the_cpu_variant():
    got = session.run_defaults("qwen3.6-27b", device="cpu")
    assert got.sampling == SamplingOverrides(
        temperature=0.6, top_k=20, top_p=0.95, min_p=0.0, presence_penalty=0.0
    )
    assert got.ctx_size == 32_768
    assert got.draft == 0  # the GGUF variant has no MTP head: speculative = false
    assert dict(got.chat_template_kwargs) == {"enable_thinking": True}
    assert (got.tool_call_parser, got.reasoning_parser) == ("qwen3_coder", "qwen3")


def test_recipe_speculative_table_gives_the_draft_count():
    got = RunDefaults.from_recipe({"speculative": {"method": "mtp", "draft_tokens": 3}})
    assert got.draft == 3
    assert RunDefaults.from_recipe({}).draft is None


def test_run_defaults_are_frozen():
    got = session.run_defaults("qwen3.6-27b", device="cpu")
    with pytest.raises(AttributeError):
        got.ctx_size = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        got.chat_template_kwargs["enable_thinking"] = False  # type: ignore[index]


def test_paths_have_no_recipe_defaults(smollm2_path):
    assert session.run_defaults(str(smollm2_path)) == RunDefaults()


def test_a_bad_device_fails_before_any_download(monkeypatch):
    from atlas_cli.store import locate

    def no_download(*args, **kwargs):
        raise AssertionError("resolved a name for a device that cannot be used")

    monkeypatch.setattr(locate, "resolve", no_download)
    with pytest.raises(DeviceError):
        session.resolve("qwen3.6-27b", device="tpu")


def test_open_model_carries_the_recipe_defaults(smollm2_path, monkeypatch):
    """A model opened by recipe name samples with the recipe's settings unless given."""
    from atlas_cli.store import locate

    monkeypatch.setattr(locate, "resolve", lambda *a, **k: smollm2_path)
    model = session.open_model("smollm2-135m", device="cpu-ref", ctx_size=64)
    assert model.defaults == session.run_defaults("smollm2-135m")
    assert model.sampling(SamplingOverrides()).temperature == 0.2  # the recipe's
    assert model.sampling(SamplingOverrides(temperature=1.0)).temperature == 1.0


def test_the_server_loads_with_the_recipe_defaults(monkeypatch, tmp_path):
    """`atlas serve NAME` once resolved NAME to a path and then asked the path for its recipe
    defaults (none). It now hands the resolved name, defaults included, to its loader."""
    from atlas_cli.serve import server
    from atlas_cli.serve.http import AppState
    from atlas_cli.store import locate

    configs = []

    class Stop(Exception):
        pass

    def capture(config):
        configs.append(config)
        raise Stop

    monkeypatch.setattr(locate, "resolve", lambda name, *a, **k: tmp_path)
    monkeypatch.setattr(server, "create_app", capture)
    with pytest.raises(Stop):
        server.serve("qwen3.6-27b", port=0, device="cpu")
    config = configs[-1]
    assert config.resolved.defaults == session.run_defaults("qwen3.6-27b", device="cpu")
    assert config.resolved.defaults.sampling.temperature == 0.6

    loaded = []
    monkeypatch.setattr(session, "load", lambda resolved, **kw: loaded.append(resolved))
    state = AppState(config)
    with pytest.raises(AttributeError):  # the stand-in returns no model
        state.load()
    assert loaded == [config.resolved]
