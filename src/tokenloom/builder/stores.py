"""Fingerprints of the input token stores: what a cache key knows about each store.

A fingerprint holds the sizes and modification times of ``PREFIX.idx`` and ``PREFIX.bin`` and a
SHA-256 over the .idx header (counts and dtype) and the sequence lengths, which are all a packed
index reads (GPT splits cut sequences; pointers and document boundaries do not change any array).
Any change that could change an index changes the hash; a touch that changes only the mtime changes
the fingerprint too, so the cache errs towards rebuilding.

Fingerprinting also measures what the planner needs: sequences and tokens in each split range.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import numpy as np

from tokenloom.io import IndexedDataset
from tokenloom.io.format import HEADER_SIZE

_HASH_CHUNK = 1 << 24  # bytes hashed per update


@dataclass(frozen=True, kw_only=True)
class StoreFingerprint:
    """Identity of one token store as the cache sees it."""

    idx_bytes: int
    """Size of ``PREFIX.idx``."""
    bin_bytes: int
    """Size of ``PREFIX.bin``."""
    idx_mtime_ns: int
    """Modification time of ``PREFIX.idx``, nanoseconds."""
    bin_mtime_ns: int
    """Modification time of ``PREFIX.bin``, nanoseconds."""
    idx_sha256: str
    """SHA-256 of the .idx header and the sequence lengths."""

    def to_dict(self) -> dict:
        return {
            "idx_bytes": self.idx_bytes, "bin_bytes": self.bin_bytes,
            "idx_mtime_ns": self.idx_mtime_ns, "bin_mtime_ns": self.bin_mtime_ns,
            "idx_sha256": self.idx_sha256,
        }


@dataclass(frozen=True, kw_only=True)
class StoreInfo:
    """A fingerprinted store and the counts the planner needs."""

    prefix: str
    """The prefix as the config names it."""
    fingerprint: StoreFingerprint
    """Sizes, times and hash of the store's files."""
    num_sequences: int
    """Sequences in the store (GPT splits cut sequences, as megatron-core does)."""
    num_tokens: int
    """Tokens in the store."""
    range_tokens: tuple[tuple[int, int, int], ...]
    """``(begin, end, tokens)`` for every sequence range the build asked about."""

    def tokens_in(self, begin: int, end: int) -> int:
        """Tokens in sequences ``[begin, end)`` (a range passed to :func:`fingerprint_store`)."""
        for b, e, tokens in self.range_tokens:
            if (b, e) == (begin, end):
                return tokens
        raise KeyError((begin, end))


def _hash_array(digest, array: np.ndarray) -> None:
    flat = array.reshape(-1).view(np.uint8)
    for begin in range(0, flat.shape[0], _HASH_CHUNK):
        digest.update(flat[begin:begin + _HASH_CHUNK])


def fingerprint_store(prefix: str, ranges_for) -> StoreInfo:
    """Open ``prefix``, hash it and count tokens in the ranges ``ranges_for(num_sequences)`` lists.

    ``ranges_for`` maps the store's sequence count to the ``(begin, end)`` sequence ranges the
    build uses (the split ranges depend on the count).
    """
    store = IndexedDataset(prefix)
    digest = hashlib.sha256()
    with open(store.idx_path, "rb") as f:
        digest.update(f.read(HEADER_SIZE))
    _hash_array(digest, store.sequence_lengths)
    idx_stat = os.stat(store.idx_path)
    bin_stat = os.stat(store.bin_path)
    fingerprint = StoreFingerprint(
        idx_bytes=idx_stat.st_size, bin_bytes=bin_stat.st_size,
        idx_mtime_ns=idx_stat.st_mtime_ns, bin_mtime_ns=bin_stat.st_mtime_ns,
        idx_sha256=digest.hexdigest(),
    )
    lengths = store.sequence_lengths
    ranges = []
    for begin, end in ranges_for(store.num_sequences):
        ranges.append((begin, end, int(np.sum(lengths[begin:end], dtype=np.int64))))
    num_tokens = int(np.sum(lengths, dtype=np.int64))
    store.close()
    return StoreInfo(prefix=prefix, fingerprint=fingerprint, num_sequences=store.num_sequences,
                     num_tokens=num_tokens, range_tokens=tuple(ranges))


__all__ = ["StoreFingerprint", "StoreInfo", "fingerprint_store"]
