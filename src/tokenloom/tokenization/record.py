"""The tokenizer record a token store carries in its ``PREFIX.meta.json`` sidecar.

Later stages (build, serve) read ``vocab_size`` and ``eod_id`` from it instead of asking
the user again, and can refuse to blend stores made by different tokenizers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from tokenloom.errors import FormatError
from tokenloom.validate import is_integer

TOKENIZER_KINDS = ("bytes", "huggingface")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TokenizerRecord:
    """Which tokenizer produced a token store; ``metadata["tokenizer"]`` in the sidecar."""

    kind: str
    """``"bytes"`` (the built-in byte tokenizer) or ``"huggingface"`` (a ``tokenizer.json``)."""

    name: str
    """A human-readable name: ``"bytes"``, or the directory/file name of the tokenizer.json."""

    path: str | None
    """Absolute path of the tokenizer.json when it was loaded from a file, else None."""

    sha256: str | None
    """Hex SHA-256 of the tokenizer.json bytes (identifies the exact vocabulary), else None."""

    vocab_size: int
    """Number of token ids, special tokens included; every stored id is below it."""

    eod_id: int | None
    """The end-of-document id; None only for a tokenizer without one and ``append_eod=False``."""

    append_eod: bool
    """Whether ``eod_id`` was appended to every document."""

    def __post_init__(self) -> None:
        if self.kind not in TOKENIZER_KINDS:
            raise FormatError(f"tokenizer record: kind {self.kind!r}, expected one of {TOKENIZER_KINDS}")
        if not is_integer(self.vocab_size) or self.vocab_size <= 0:
            raise FormatError(f"tokenizer record: vocab_size {self.vocab_size!r}, expected a positive int")
        if self.eod_id is not None and (
            not is_integer(self.eod_id) or not 0 <= self.eod_id < self.vocab_size
        ):
            raise FormatError(
                f"tokenizer record: eod_id {self.eod_id!r}, expected an int in [0, {self.vocab_size})"
            )
        if self.append_eod and self.eod_id is None:
            raise FormatError("tokenizer record: append_eod is true but eod_id is null")
        object.__setattr__(self, "vocab_size", int(self.vocab_size))  # plain ints: the record is JSON
        if self.eod_id is not None:
            object.__setattr__(self, "eod_id", int(self.eod_id))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (the sidecar's ``tokenizer`` object)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TokenizerRecord:
        """Parse a sidecar's ``tokenizer`` object; FormatError if fields are missing or wrong."""
        if not isinstance(data, Mapping):
            raise FormatError(f"tokenizer record: expected a JSON object, got {data!r:.80}")
        names = [f.name for f in dataclasses.fields(cls)]
        missing = [n for n in names if n not in data]
        if missing:
            raise FormatError(
                f"tokenizer record: missing field(s) {missing} in {dict(data)!r:.200}; "
                "was the store written by tokenloom tokenize?"
            )
        return cls(**{n: data[n] for n in names})


def load_tokenizer_record(metadata: Mapping[str, Any] | None) -> TokenizerRecord | None:
    """The record in a store's sidecar dict (``IndexedDataset(prefix).metadata``), or None."""
    if metadata is None or "tokenizer" not in metadata:
        return None
    return TokenizerRecord.from_dict(metadata["tokenizer"])


__all__ = ["TOKENIZER_KINDS", "TokenizerRecord", "load_tokenizer_record"]
