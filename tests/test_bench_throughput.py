import csv
import io
import json
import random

import pytest

from atlas_cli.bench import throughput
from atlas_cli.bench.throughput import BenchSpec
from atlas_cli.errors import UsageError


def test_names_follow_llama_bench():
    assert BenchSpec(512, 0).name == "pp512"
    assert BenchSpec(0, 128).name == "tg128"
    assert BenchSpec(512, 128).name == "pp512+tg128"
    assert BenchSpec(0, 128, 4096).name == "tg128 @ d4096"
    assert BenchSpec(512, 128).tokens == 640


def test_expand_sweeps_every_combination_in_order():
    specs = throughput.expand([256, 512], [64], [(16, 4)], [0, 1024])
    assert [s.name for s in specs] == [
        "pp256", "pp512", "tg64", "pp16+tg4",
        "pp256 @ d1024", "pp512 @ d1024", "tg64 @ d1024", "pp16+tg4 @ d1024",
    ]  # fmt: skip
    assert [s.name for s in throughput.expand([0], [8], threads=[1, 2])] == ["tg8", "tg8"]
    with pytest.raises(UsageError, match="nothing to run"):
        throughput.expand([0], [0])


def test_flag_parsing():
    assert throughput.parse_int_list("512,1024", "-p") == [512, 1024]
    assert throughput.parse_pg("512,128") == (512, 128)
    for bad in ("a", "-1", ""):
        with pytest.raises(UsageError):
            throughput.parse_int_list(bad, "-p")
    for bad in ("512", "0,5", "1,2,3"):
        with pytest.raises(UsageError):
            throughput.parse_pg(bad)


class FakeTokenizer:
    vocab_size = 100
    bos_id = 1
    add_bos = True


class FakeEngine:
    """Records what the benchmark asks the engine to compute."""

    def __init__(self):
        self.tokenizer = FakeTokenizer()
        self.calls = []
        self.cached = 0

    def reset(self):
        self.calls.append(("reset",))
        self.cached = 0

    def prefill(self, ids):
        self.calls.append(("prefill", len(ids), self.cached, ids[0]))
        self.cached = len(ids)

    def step(self, token):
        self.calls.append(("step", self.cached))
        self.cached += 1


def test_time_once_prefills_depth_then_times_the_test():
    engine = FakeEngine()
    throughput.time_once(engine, BenchSpec(8, 3, 16), random.Random(0), bos=1)
    # the depth prefill from empty, then the prompt on top of it, then 3 single steps
    assert engine.calls == [
        ("reset",), ("prefill", 16, 0, 1), ("prefill", 24, 16, 1),
        ("step", 24), ("step", 25), ("step", 26),
    ]  # fmt: skip
    engine = FakeEngine()
    throughput.time_once(engine, BenchSpec(0, 2), random.Random(0), bos=1)
    assert engine.calls == [("reset",), ("step", 0), ("step", 1)]


RECORD = {
    "model": "llama 135M Q4_1",
    "model_size": 96_572_416,
    "model_n_params": 134_515_008,
    "backend": "CPU",
    "n_threads": 1,
    "test": "pp512",
    "avg_ts": 190.254,
    "stddev_ts": 0.031,
    "samples_ts": [190.2, 190.3],
    "samples_ns": [1, 2],
}


def test_markdown_table_has_llama_bench_columns():
    lines = throughput.render([RECORD], "md").splitlines()
    assert [c.strip() for c in lines[0].strip("|").split("|")] == [
        "model", "size", "params", "backend", "threads", "test", "t/s"
    ]  # fmt: skip
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells == ["llama 135M Q4_1", "92.10 MiB", "134.52 M", "CPU", "1", "pp512",
                     "190.25 ± 0.03"]  # fmt: skip
    assert lines[1].split("|")[2].strip().endswith(":")  # numbers right-aligned


def test_machine_readable_formats_keep_every_sample():
    records = [RECORD, {**RECORD, "test": "tg128"}]
    assert json.loads(throughput.render(records, "json")) == records
    assert [json.loads(x) for x in throughput.render(records, "jsonl").splitlines()] == records
    rows = list(csv.DictReader(io.StringIO(throughput.render(records, "csv"))))
    assert [r["test"] for r in rows] == ["pp512", "tg128"]
    assert json.loads(rows[0]["samples_ts"]) == [190.2, 190.3]
    with pytest.raises(UsageError):
        throughput.render(records, "xml")


def test_model_facts_on_the_default_model(smollm2):
    from atlas_cli.bench import sysinfo

    facts = sysinfo.model_facts(smollm2)
    assert facts["model"] == "llama 135M Q4_1"
    # tensor bytes (the file minus its header and tokenizer) and the parameters of the GGUF
    assert (
        0.9 * smollm2.info.path.stat().st_size
        < facts["model_size"]
        < smollm2.info.path.stat().st_size
    )
    assert facts["model_n_params"] == sysinfo._count_params(smollm2)
    assert sysinfo.size_label(7_241_732_096) == "7.2B" and sysinfo.size_label(8e9) == "8B"
    assert sysinfo.format_size(3 * 1024**3) == "3.00 GiB"
    assert sysinfo.format_params(6_738_415_616) == "6.74 B"


def test_thread_limit_reaches_the_fast_paths_numba_pool():
    import numba

    from atlas_cli.bench.throughput import _thread_limit

    before = numba.get_num_threads()
    with _thread_limit(1):
        assert numba.get_num_threads() == 1
    assert numba.get_num_threads() == before
