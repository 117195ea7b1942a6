"""GPU tests: the kernels and whole models on a real CUDA or HIP device, against numpy.

Everything here carries the `gpu` marker and is skipped, with the reason, where no device and
runtime are usable (this includes CI, which has no GPU). ATLAS_GPU=cuda|hip picks the runtime;
by default the first usable one is taken.
"""

from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.gpu)


def _usable() -> tuple[str | None, str]:
    from atlas_cli.backend.ops.native import device as native

    wanted = os.environ.get("ATLAS_GPU")
    reasons = []
    for device in [wanted] if wanted else ["cuda", "hip"]:
        info = native.probe(device)
        if info.get("available"):
            return device, ""
        reasons.append(f"{device}: {info.get('reason', 'unavailable')}")
    return None, "; ".join(reasons)


@pytest.fixture(scope="session")
def gpu_device() -> str:
    device, reason = _usable()
    if device is None:
        pytest.skip(f"no GPU runtime usable here ({reason})")
    return device


@pytest.fixture(scope="session")
def gpu_ops(gpu_device):
    from atlas_cli.backend.ops.native import device as native

    ops = native.open_device(gpu_device)
    ops.poison = True  # every output buffer starts as NaN: unwritten elements fail the checks
    # the float32 checks (ALL_CHECKS' `linear`, the models against numpy at 1e-4) take the exact
    # prefill GEMM; `gemm_fast` asks for the fast one by name
    ops.prefill = "exact"
    return ops
