"""The suite runs in its own atlas home and HF cache (set in conftest.py), never the user's."""

from __future__ import annotations

import os

import platformdirs

from atlas_cli.store import hub, paths
from tests.conftest import SUITE_CACHE


def test_the_suite_never_uses_the_users_store():
    users = {
        platformdirs.user_data_dir("atlas", appauthor=False),
        platformdirs.user_cache_dir("atlas", appauthor=False),
    }
    for where in (paths.home(), paths.models_dir(), paths.cache_dir(), hub.cache_root()):
        assert where.is_relative_to(SUITE_CACHE), where
        assert str(where) not in users


def test_subprocesses_inherit_the_suite_home():
    assert os.environ["ATLAS_HOME"].startswith(str(SUITE_CACHE))
    assert os.environ["HF_HOME"].startswith(str(SUITE_CACHE))
