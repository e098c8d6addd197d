"""Megatron's train/valid/test split string ("969,30,1") and the document ranges it selects.

megatron-core 0.19.2 reads every run of digits and dots as a number, pads to three numbers with
zeros, normalises them to sum to one, turns the cumulative sums into book-ends and rounds each
book-end times the document count (Python ``round``: halves go to even). A split whose book-ends
coincide is absent (``None``); one that rounds to no documents is an empty range.

Where megatron-core silently misreads a string (a minus sign it skips, letters it ignores) or
fails late (four numbers, all zeros, ``"1..2"``), :func:`parse_split` raises ConfigError instead.
"""

from __future__ import annotations

import functools
import itertools
import re
from typing import NamedTuple

import numpy as np

from tokenloom.errors import ConfigError
from tokenloom.validate import check_non_negative_int

_NUMBER = re.compile(r"[.0-9]+")
_SEPARATORS = re.compile(r"[\s,/:]*")
SPLIT_NAMES = ("train", "valid", "test")


class SplitFractions(NamedTuple):
    """Normalised split weights, summing to one."""

    train: float
    valid: float
    test: float


class DocumentRange(NamedTuple):
    """Documents ``[begin, end)`` of a token store."""

    begin: int
    end: int

    @property
    def num_documents(self) -> int:
        """Documents in the range."""
        return self.end - self.begin


class SplitDocumentRanges(NamedTuple):
    """The document range of each split; ``None`` where the split has zero weight."""

    train: DocumentRange | None
    valid: DocumentRange | None
    test: DocumentRange | None


class SplitBookends(NamedTuple):
    """Fractions ``(begin, end)`` of the document count for each split; ``None`` when empty."""

    train: tuple[float, float] | None
    valid: tuple[float, float] | None
    test: tuple[float, float] | None


def parse_split(split: str) -> SplitFractions:
    """Parse a split string such as ``"969,30,1"`` or ``"99,1"`` into normalised fractions.

    Same numbers as megatron-core's ``parse_and_normalize_split`` for every string it reads
    correctly: missing trailing weights are zero, weights are divided by their float64 sum.
    """
    if not isinstance(split, str):
        raise ConfigError(f"split={split!r}; expected a string of up to three weights like '969,30,1'")
    return _parse_split(split)


@functools.lru_cache(maxsize=256)  # a plan asks once per store and split: parse each string once
def _parse_split(split: str) -> SplitFractions:
    pieces = _NUMBER.findall(split)
    leftover = _NUMBER.sub("", split)
    if not _SEPARATORS.fullmatch(leftover):
        raise ConfigError(
            f"split={split!r} holds {leftover.strip()!r} besides its weights; expected up to three "
            "non-negative numbers separated by commas, e.g. '969,30,1'"
        )
    if not 1 <= len(pieces) <= len(SPLIT_NAMES):
        raise ConfigError(
            f"split={split!r} has {len(pieces)} weights; expected 1 to 3 (train, valid, test), "
            "e.g. '969,30,1'"
        )
    weights = []
    for piece in pieces:
        try:
            weights.append(float(piece))
        except ValueError:
            raise ConfigError(f"split={split!r}: {piece!r} is not a number; e.g. '969,30,1'") from None
    weights += [0.0] * (len(SPLIT_NAMES) - len(weights))
    vector = np.array(weights, dtype=np.float64)
    total = np.sum(vector)
    if not np.isfinite(total) or total <= 0.0:
        raise ConfigError(f"split={split!r} weights sum to {float(total)}; expected a positive sum")
    return SplitFractions(*(vector / total).tolist())


def split_bookends(split: str) -> SplitBookends:
    """The ``(begin, end)`` fractions of each split (megatron-core's split matrix)."""
    return _split_bookends(parse_split(split))


@functools.lru_cache(maxsize=256)
def _split_bookends(fractions: SplitFractions) -> SplitBookends:
    cumulative: list[float] = [0]  # int 0 first, then float sums, in megatron-core's order
    for fraction in fractions:
        cumulative.append(cumulative[-1] + fraction)
    bookends = []
    for begin, end in itertools.pairwise(cumulative):
        bookends.append(None if end <= begin else (begin, end))
    return SplitBookends(*bookends)


def split_document_ranges(split: str, num_documents: int) -> SplitDocumentRanges:
    """The documents each split of a ``num_documents``-document store uses, as megatron-core cuts
    them: ``int(round(fraction * float(num_documents)))`` at each book-end."""
    check_non_negative_int("num_documents", num_documents)
    count = float(num_documents)
    ranges = []
    for bookend in split_bookends(split):
        if bookend is None:
            ranges.append(None)
        else:
            ranges.append(DocumentRange(round(bookend[0] * count), round(bookend[1] * count)))
    return SplitDocumentRanges(*ranges)


def document_ids(document_range: DocumentRange) -> np.ndarray:
    """The document ids of a range, as the int32 array megatron-core hands its GPTDataset."""
    # document_ids: (end - begin,) int32
    return np.arange(document_range.begin, document_range.end, dtype=np.int32)


__all__ = [
    "SPLIT_NAMES",
    "DocumentRange",
    "SplitBookends",
    "SplitDocumentRanges",
    "SplitFractions",
    "document_ids",
    "parse_split",
    "split_bookends",
    "split_document_ranges",
]
