"""scripts/gpu_bench.py at toy sizes on the CPU emulator: each section writes its rows, with the
fields docs/performance.md reads, and a failing section leaves the rows before it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from atlas_cli.backend.ops.native import runtime_emu

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_sections_write_their_rows_on_the_emulator(tmp_path):
    if not runtime_emu.available():
        pytest.skip("g++ not installed")
    out = tmp_path / "bench.jsonl"
    cmd = [sys.executable, str(ROOT / "scripts" / "gpu_bench.py"), "--device", "emu", "--tiny"]
    cmd += ["--only", "gemv,gemm,gdn", "--formats", "q4_0", "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=900)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    gemv = [r for r in rows if r["op"].startswith("gemv q4_0")]
    assert [r["op"].split()[2] for r in gemv] == ["T=1", "T=2", "T=4", "T=8"]
    # no copy-bandwidth row on the emulator, so no fraction
    assert all(r["ms"] > 0 and "GB/s" in r and r["of copy"] is None for r in gemv)
    gemm = [r["op"].split()[:3] for r in rows if r["op"].startswith("gemm")]
    assert gemm == [["gemm", "fast", "q4_0"], ["gemm", "exact", "q4_0"]]
    assert [r["op"] for r in rows if r["op"].startswith("gdn")] == [
        "gdn chunked prefill T=64",
        "gdn chunked prefill T=128",
    ]
    bad = subprocess.run(
        [*cmd[:-4], "--only", "gdn,nonesuch", "--out", str(out)], capture_output=True
    )
    assert bad.returncode != 0
    assert len(out.read_text().splitlines()) == len(rows) + 2  # gdn's rows kept


def test_device_check_fits_its_time_on_one_gpu():
    """scripts/device-check's time limits (compile report, atlas hw, each benchmark section,
    the GPU tests) add up to at most 420 s: one call fits a lent H100 in under 8 minutes."""
    import re
    from pathlib import Path

    script = (Path(__file__).resolve().parents[1] / "scripts" / "device-check").read_text()
    fixed = [int(s) for s in re.findall(r"\btimeout (\d+) ", script)]
    tests = int(re.search(r"TEST_LIMIT:-(\d+)", script).group(1))
    sections = re.search(r'SECTIONS="\$\{SECTIONS:-([^}]*)\}"', script).group(1)
    limits = [int(entry.split(":")[1]) for entry in sections.split(",")]
    assert len(fixed) == 2 and len(limits) >= 6
    assert sum(fixed) + tests + sum(limits) <= 420
