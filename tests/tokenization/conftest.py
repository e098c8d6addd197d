from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tokenizer_files(tmp_path_factory) -> dict[str, str]:
    """The five tokenizer families of ``tokenization_fixtures``, trained once per session."""
    pytest.importorskip("tokenizers")
    from tokenization_fixtures import train_tokenizer_files

    return train_tokenizer_files(tmp_path_factory.mktemp("engines"))
