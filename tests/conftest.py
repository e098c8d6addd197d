from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def engine_scan_cache(tmp_path_factory):
    """One cache of gigatoken-against-tokenizers scans for the whole session (tests that tokenize
    with the same splitting rules share one scan), kept out of the user's ~/.cache; subprocesses
    inherit it through the environment."""
    saved = os.environ.get("TOKENLOOM_CACHE_DIR")
    os.environ["TOKENLOOM_CACHE_DIR"] = str(tmp_path_factory.mktemp("tokenloom-cache"))
    yield os.environ["TOKENLOOM_CACHE_DIR"]
    if saved is None:
        os.environ.pop("TOKENLOOM_CACHE_DIR", None)
    else:
        os.environ["TOKENLOOM_CACHE_DIR"] = saved
