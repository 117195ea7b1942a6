"""Memory stays what the user set: `atlas serve` and the keep-alive worker after 200 distinct
prompts of the default model (each a new cached conversation) hold at most weights + prefix
cache budget + 300 MB, and grow by about what their prefix cache says it holds. Each cached
conversation once kept its whole 8K-position KV mapping resident (178 MB each: 7 GB after 41
prompts) while the pool counted only its positions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SLACK = 64 << 20  # growth beyond the cache's own bytes: allocator pages, request buffers


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads Linux's VmRSS")
@pytest.mark.parametrize(
    "args",
    [["serve"], ["serve", "--cache-size", "256MiB"], ["worker"]],
    ids=["serve", "serve-256MiB", "worker"],
)
def test_resident_memory_after_200_distinct_prompts(args, smollm2_path):
    cmd = [sys.executable, str(ROOT / "scripts" / "memory_soak.py"), *args]
    cmd += ["--prompts", "200", "--model", str(smollm2_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode in (0, 1), done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    print(result)
    assert result["ok"], result
    assert result["cache_bytes"] <= result["budget"]
    assert result["after"] - result["before"] <= result["cache_bytes"] + SLACK, result
