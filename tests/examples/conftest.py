"""What the examples' tests share: a byte-tokenized store of real text."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def stdlib_store(tmp_path_factory) -> str:
    """The prefix of a byte-tokenized store of 120 standard-library modules, a document each."""
    from tokenloom.tokenization import TokenizeConfig, tokenize_to_store

    directory = tmp_path_factory.mktemp("stdlib")
    library = os.path.dirname(os.__file__)
    files = sorted(os.path.join(library, f) for f in os.listdir(library) if f.endswith(".py"))[:120]
    return tokenize_to_store(files, str(directory / "stdlib"), TokenizeConfig(tokenizer="bytes", workers=1,
                                                                               skip_bad=True)).prefix
