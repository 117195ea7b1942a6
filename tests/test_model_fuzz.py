"""Damaged model files end in one clean error, never a traceback or a hang.

A seeded fuzz over the fixtures (tests/model_mutations.py: GGUF metadata and tensor tables,
safetensors headers, config.json, tokenizer files, a real model's GGUF header), each case
loaded and run for a few tokens in-process under a time and a memory cap; then the cases that
must be refused (they used to load silently) one by one, with the file, field and expected
value in the message. scripts/fuzz_models.py runs the same cases by the thousand in subprocesses.
"""

from __future__ import annotations

import json
import resource
import shutil
import signal
import struct
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import pytest

from atlas_cli.backend.ops.cpu import jit
from atlas_cli.errors import CorruptModelError, UnsupportedModelError
from tests.model_mutations import (
    FIXTURES,
    load_and_run,
    make_case,
    read_gguf,
    run_case,
    warm_kernels,
    write_gguf,
)

CASE_SECONDS = 10  # far above any case's time (the slowest take ~1 s)
CASE_MEMORY = 2 << 30  # a case may map and allocate this much beyond the process's own


@pytest.fixture(autouse=True)
def own_home(tmp_path, monkeypatch):
    """Header caches of mutated files go to a home of their own; the compiled kernels stay the
    suite's (compiling them again takes minutes)."""
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(jit.kernel_cache_dir()))
    monkeypatch.setenv("ATLAS_HOME", str(tmp_path / "home"))


@contextmanager
def time_cap(seconds: int, what: str):
    def expired(signum, frame):
        raise TimeoutError(f"{what} ran over {seconds} s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _data_bytes() -> int:
    """The process's data segment now (VmData: heap and private mappings), what RLIMIT_DATA
    limits."""
    with open("/proc/self/status") as f:
        return int(next(x for x in f if x.startswith("VmData")).split()[1]) * 1024


@contextmanager
def memory_cap(extra: int):
    """Allocations past `extra` bytes beyond today's data segment fail with MemoryError (an
    escape the test reports) instead of taking the machine down."""
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    cap = _data_bytes() + extra
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


def fuzz(
    kind: str, cases: int, workdir: Path, real_gguf: Path | None = None, device: str = "cpu-ref"
) -> Counter:
    outcomes: Counter = Counter()
    escaped = []
    for seed in range(cases):
        path, what = make_case(kind, seed, workdir / f"{kind}{seed}", real_gguf=real_gguf)
        try:
            with time_cap(CASE_SECONDS, f"{kind} #{seed} ({what})"), memory_cap(CASE_MEMORY):
                outcomes[run_case(path, device)] += 1
        except Exception as exc:  # anything but an AtlasError is a failure of the validation
            escaped.append(f"{kind} #{seed} ({what}): {type(exc).__name__}: {exc}")
        shutil.rmtree(workdir / f"{kind}{seed}", ignore_errors=True)
    assert not escaped, "\n".join(escaped)
    return outcomes


@pytest.mark.parametrize("kind", ["gguf", "hf"])
def test_mutated_fixtures_end_in_a_clean_error_or_a_run(kind, tmp_path):
    outcomes = fuzz(kind, 150, tmp_path)
    # both ends are exercised: most damage is refused, harmless damage still runs
    assert outcomes["CorruptModelError"] > 50, outcomes
    assert outcomes["load"] > 5, outcomes


@pytest.mark.parametrize("kind", ["gguf", "hf"])
def test_mutated_fixtures_on_the_fast_cpu_path(kind, tmp_path):
    """The same cases through the numba kernels, which NaN weights once made raise."""
    warm_kernels()
    outcomes = fuzz(kind, 40, tmp_path, device="cpu")
    assert outcomes["CorruptModelError"] > 10 and outcomes["load"] > 2, outcomes


@pytest.mark.slow  # ~30 s: the harmless cases load the real model on the reference backend
def test_mutated_default_model_header(smollm2_path, tmp_path):
    outcomes = fuzz("real", 12, tmp_path, real_gguf=smollm2_path)
    assert sum(outcomes.values()) == 12


# -- what used to load silently ------------------------------------------------------------


def copy_fixture(name: str, tmp_path: Path) -> Path:
    target = tmp_path / name
    shutil.copytree(FIXTURES / name, target, ignore=shutil.ignore_patterns("*.npz"))
    return target


def rewrite_header(file: Path, change) -> None:
    blob = file.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    change(header)
    raw = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(raw)) + raw + blob[8 + n :])


def test_overlapping_safetensors_tensors_are_refused(tmp_path):
    model = copy_fixture("qwen3-mha-f32", tmp_path)

    def overlap(header):  # up_proj reads gate_proj's bytes: same size, each alone would load
        header["model.layers.0.mlp.up_proj.weight"]["data_offsets"] = header[
            "model.layers.0.mlp.gate_proj.weight"
        ]["data_offsets"]

    rewrite_header(model / "model.safetensors", overlap)
    with pytest.raises(CorruptModelError, match=r"model.safetensors: tensors .* overlap"):
        load_and_run(model)


def test_vocab_size_one_is_refused(tmp_path):
    model = copy_fixture("qwen3-gqa4-f16", tmp_path)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "vocab_size": 1}))
    with pytest.raises(CorruptModelError, match=r"has shape \[64, 32\], expected \[1, 32\]"):
        load_and_run(model)


def test_vocab_below_the_tokenizer_is_refused(tmp_path):
    """A config and embedding that agree, but smaller than the tokenizer's vocabulary."""
    model = copy_fixture("qwen3-mha-f32", tmp_path)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "vocab_size": 32}))

    def fewer_rows(header):
        entry = header["model.embed_tokens.weight"]
        entry["shape"] = [32, entry["shape"][1]]
        begin = entry["data_offsets"][0]
        entry["data_offsets"] = [begin, begin + 32 * entry["shape"][1] * 4]

    rewrite_header(model / "model.safetensors", fewer_rows)
    with pytest.raises(CorruptModelError, match=r"vocab_size is 32 but the tokenizer has 64"):
        load_and_run(model)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("num_key_value_heads", 3, r"config.json: num_key_value_heads is 3 \(expected a divisor"),
        ("hidden_size", -32, r"hidden_size is -32 \(expected an integer from 1"),
        ("rms_norm_eps", "1e-6", r"rms_norm_eps is '1e-6' \(expected a positive finite"),
        ("max_position_embeddings", 2**40, r"max_position_embeddings is 1099511627776"),
        ("tie_word_embeddings", "no", r"tie_word_embeddings is 'no' \(expected true or false"),
    ],
)
def test_config_values_are_typed_and_ranged(tmp_path, key, value, message):
    model = copy_fixture("qwen3-gqa4-f16", tmp_path)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, key: value}))
    with pytest.raises(CorruptModelError, match=message):
        load_and_run(model)


def test_unreadable_tokenizer_json_is_a_clean_error(tmp_path):
    model = copy_fixture("qwen3-gqa4-f16", tmp_path)
    tok = json.loads((model / "tokenizer.json").read_text())
    tok["model"]["type"] = "NoSuchModel"
    (model / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(CorruptModelError, match="tokenizer.json: cannot parse the tokenizer"):
        load_and_run(model)


def test_index_may_not_name_files_outside_the_directory(tmp_path):
    model = copy_fixture("qwen35-vlm-bf16", tmp_path)
    index = json.loads((model / "model.safetensors.index.json").read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = "../../etc/passwd"
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CorruptModelError, match="weight_map must map tensor names to file names"):
        load_and_run(model)


# -- GGUF: inconsistent metadata and tables ------------------------------------------------


def gguf_with(tmp_path: Path, change_kv=None, change_tensors=None, fixture="qwen3-gguf") -> Path:
    kvs, tensors, data, total = read_gguf(FIXTURES / fixture / "model.gguf")
    if change_kv:
        change_kv({kv[0]: kv for kv in kvs})
    if change_tensors:
        change_tensors({t[0]: t for t in tensors})
    path = tmp_path / "model.gguf"
    write_gguf(path, kvs, tensors, data, total)
    return path


def test_rewritten_fixture_still_loads(tmp_path):
    """The writer the mutations go through keeps a valid file valid."""
    assert run_case(gguf_with(tmp_path)) == "load"


def test_overlapping_gguf_tensors_are_refused(tmp_path):
    def overlap(t):
        t["output.weight"][3] = t["token_embd.weight"][3]

    with pytest.raises(CorruptModelError, match="tensors token_embd.weight and output.weight"):
        load_and_run(gguf_with(tmp_path, change_tensors=overlap))


def test_array_longer_than_the_file_is_refused_before_allocating(tmp_path):
    path = gguf_with(tmp_path)
    blob = bytearray(path.read_bytes())
    at = blob.index(b"tokenizer.ggml.tokens") + len("tokenizer.ggml.tokens") + 8  # type, item
    blob[at : at + 8] = struct.pack("<Q", 2**62)
    path.write_bytes(bytes(blob))
    refused = pytest.raises(CorruptModelError, match=r"tokenizer.ggml.tokens claims 4,611,686")
    with time_cap(5, "a 2**62-entry array"), refused:
        load_and_run(path)


@pytest.mark.parametrize(
    ("key", "type_id", "value", "error", "message"),
    [
        ("qwen3.attention.head_count", 4, 3, CorruptModelError, r"q_proj.weight has shape"),
        ("qwen3.attention.head_count_kv", 4, 3, CorruptModelError, r"is 3 \(expected a divisor"),
        ("qwen3.attention.head_count_kv", 4, 0, CorruptModelError, "num_key_value_heads is 0"),
        ("qwen3.attention.key_length", 4, 4, CorruptModelError, r"q_proj.weight has shape"),
        ("qwen3.block_count", 4, 3, CorruptModelError, r"model.layers.2.* is missing"),
        ("qwen3.embedding_length", 8, "32", CorruptModelError, r"embedding_length is '32'"),
        ("qwen3.context_length", 10, 2**63, CorruptModelError, "max_position_embeddings"),
        ("qwen3.rope.freq_base", 6, float("nan"), CorruptModelError, "rope.freq_base is nan"),
        ("general.architecture", 8, "mamba", UnsupportedModelError, "'mamba' is not supported"),
    ],
)
def test_inconsistent_gguf_metadata_is_refused(tmp_path, key, type_id, value, error, message):
    def change(kv):
        kv[key][1], kv[key][2] = type_id, value

    with pytest.raises(error, match=message) as caught:
        load_and_run(gguf_with(tmp_path, change_kv=change))
    assert "model.gguf" in str(caught.value)


def test_gguf_rows_of_partial_blocks_are_refused(tmp_path):
    def q8_embedding(t):  # Q8_0 blocks hold 32 elements; rows of 32 are fine, of 40 are not
        t["token_embd.weight"][1:3] = [8, [40, 64]]

    with pytest.raises(CorruptModelError, match="not a multiple of its format's block of 32"):
        load_and_run(gguf_with(tmp_path, change_tensors=q8_embedding))


# -- config values and shapes that allocate or iterate before they are checked ---------------


def test_a_thousand_dimensions_are_refused(tmp_path):
    """A one-element scale whose shape lists 1,000 ones: its byte count is right, and numpy
    cannot make an array of it (at most 64 dimensions)."""
    model = copy_fixture("qwen35-nvfp4", tmp_path)
    name = "model.language_model.layers.0.mlp.up_proj.weight_scale_2"
    shard = next(f for f in model.glob("*.safetensors") if name.encode() in f.read_bytes())

    def many_dims(header):
        header[name]["shape"] = [1] * 1000

    rewrite_header(shard, many_dims)
    with pytest.raises(CorruptModelError, match=r"has 1,000 dimensions \(expected at most 8\)"):
        load_and_run(model)


@pytest.mark.parametrize("fixture", ["qwen3-gqa4-f16", "qwen35-text-bf16"])
@pytest.mark.parametrize("value", [True, "full_attention", {"0": "full_attention"}, [1, 2]])
def test_layer_types_must_be_a_list_of_strings(tmp_path, fixture, value):
    model = copy_fixture(fixture, tmp_path)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "layer_types": value}))
    with pytest.raises(CorruptModelError, match=r"config.json: layer_types is .*\(expected a"):
        load_and_run(model)


def test_the_fit_check_reads_the_checked_config(tmp_path):
    """A `text_config` a Qwen3 model has no use for once sent the memory estimate looking for
    its layer count there."""
    model = copy_fixture("qwen3-gqa4-f16", tmp_path)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "text_config": {"a": 1}}))
    assert run_case(model) == "load"


def test_rms_norm_eps_must_stay_positive_in_float32(tmp_path):
    model = copy_fixture("qwen3-gqa4-f16", tmp_path)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-40}))
    with pytest.raises(CorruptModelError, match=r"rms_norm_eps is 1e-40 \(expected a positive"):
        load_and_run(model)


@pytest.mark.parametrize(("fixture", "key"), [("qwen3-gguf", "qwen3"), ("qwen35-gguf", "qwen35")])
def test_a_million_blocks_are_refused_before_anything_is_built(tmp_path, fixture, key):
    """Each layer is a declaration and a set of expected tensors: a million of them took a
    minute and 3.7 GB before the file's missing tensors were reported."""

    def change(kv):
        kv[f"{key}.block_count"][1:3] = [4, 1_000_000]

    path = gguf_with(tmp_path, change_kv=change, fixture=fixture)
    refused = pytest.raises(CorruptModelError, match=r"num_hidden_layers is \d+ \(expected an")
    with time_cap(5, "a million blocks"), memory_cap(256 << 20), refused:
        load_and_run(path)


def test_a_qwen35_model_needs_a_full_attention_layer(tmp_path):
    """Three of the fixture's four blocks claimed as MTP blocks leave one Gated DeltaNet layer:
    the KV cache took its geometry from an attention layer there was none of (StopIteration)."""

    def mtp_blocks(kv):
        kv["qwen35.nextn_predict_layers"][1:3] = [4, 3]

    path = gguf_with(tmp_path, change_kv=mtp_blocks, fixture="qwen35-gguf")
    with pytest.raises(UnsupportedModelError, match="expected at least one full_attention layer"):
        load_and_run(path)
