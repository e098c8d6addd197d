"""Provenance without replay: which documents a sample holds, and which samples hold a document.

:func:`where` answers, for global positions of a split, the dataset, store and document pieces
(store document id, first token, token count) of each sample, in served order: a locate and the
reader's :meth:`~tokenloom.source.readers.DatasetReader.spans`, so its cost per sample does not
depend on the position. :func:`find` answers the inverse: every global position whose sample holds
a piece of document ``D`` of store ``PREFIX``.

* exact mode (megatron-core's arrays): one vectorised pass over the memory-mapped arrays --
  ``document_index`` for the document's positions, the ``sample_index`` rows spanning them,
  ``shuffle_index`` for the served sample ids, and the blend's ``dataset_index`` /
  ``dataset_sample_index`` for the global positions;
* stateless mode: no scan -- the permutations are inverted
  (:meth:`~tokenloom.index.stateless.StatelessGPTIndex.samples_holding`, then
  :meth:`~tokenloom.index.blend.Blend.positions_of`), work proportional to the epochs.

A piece counts when it holds at least one token of the document (megatron-core's walk can
record an empty piece where a sample starts exactly at a document's end; it holds nothing).

The functions read a source through :class:`LocatedSource`, and the last step of :func:`find` is
the locator's own inverse (``positions_of``, :class:`~tokenloom.source.protocol.Locator`): the
blended source, whose ``where`` and ``find`` call this module, is not imported here.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from tokenloom.errors import ConfigError
from tokenloom.index.megatron_gpt import GPTIndices
from tokenloom.io.format import normalize_prefix
from tokenloom.source.protocol import Locator
from tokenloom.source.readers import DatasetReader
from tokenloom.validate import check_int, check_positive_int

#: Entries of an index array a pass reads at once (bounds the memory of :func:`find`).
_CHUNK = 1 << 24


class LocatedSource(Protocol):
    """What provenance reads of a split: one reader per dataset and the locator placing its
    positions (:class:`~tokenloom.source.blended.BlendedSource` is one)."""

    name: str
    """``train``, ``valid`` or ``test``: named in errors."""
    readers: Sequence[DatasetReader]
    """One reader per dataset (dataset id ``d`` is ``readers[d]``)."""
    locator: Locator
    """Where each global position comes from."""

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(dataset_ids, sample_ids)`` of global ``positions`` (PositionError outside the split)."""


@dataclasses.dataclass(frozen=True)
class Piece:
    """Tokens ``[offset, offset + length)`` of store document ``document``."""

    document: int
    offset: int
    length: int


@dataclasses.dataclass(frozen=True)
class SampleOrigin:
    """Where the sample at one global position comes from."""

    position: int
    """Global position in the split (served order)."""
    dataset: int
    """Dataset id in the blend."""
    prefix: str
    """The dataset's store."""
    sample: int
    """The dataset's sample id (a row of its index)."""
    pieces: tuple[Piece, ...]
    """The document pieces the sample's tokens are, in order."""

    def to_dict(self) -> dict:
        return {"position": self.position, "dataset": self.dataset, "prefix": self.prefix, "sample": self.sample,
                "pieces": [dataclasses.asdict(p) for p in self.pieces]}


def where(source: LocatedSource, positions) -> list[SampleOrigin]:
    """The origin of the sample at each of ``positions`` (any integer array; PositionError for a
    position outside the split)."""
    positions = np.asarray(positions, dtype=np.int64).reshape(-1)
    dataset_ids, sample_ids = source.locate(positions)
    out: list[SampleOrigin | None] = [None] * positions.shape[0]
    for d in np.unique(dataset_ids):
        rows = np.flatnonzero(dataset_ids == d)
        reader = source.readers[int(d)]
        spans = reader.spans(sample_ids[rows])
        for k, row in enumerate(rows):
            begin, end = int(spans.bounds[k]), int(spans.bounds[k + 1])
            pieces = tuple(Piece(int(doc), int(offset), int(length)) for doc, offset, length in
                           zip(spans.document_ids[begin:end], spans.offsets[begin:end], spans.lengths[begin:end])
                           if length > 0)
            out[row] = SampleOrigin(position=int(positions[row]), dataset=int(d), prefix=reader.prefix,
                                    sample=int(sample_ids[row]), pieces=pieces)
    return out  # type: ignore[return-value]


def datasets_of(source: LocatedSource, prefix: str) -> list[int]:
    """Dataset ids of ``source`` that read store ``prefix``; ConfigError naming the stores if none."""
    spelt = normalize_prefix(prefix)
    found = [d for d, reader in enumerate(source.readers) if reader.prefix == spelt]
    if found:  # spelt as the split spells it: no file system call per store
        return found
    wanted = store_identity(prefix)
    found = [d for d, reader in enumerate(source.readers) if store_identity(reader.prefix) == wanted]
    if not found:
        names = [reader.prefix for reader in source.readers]
        shown = f" ({wanted})" if wanted != str(prefix) else ""
        raise ConfigError(f"store {prefix!r}{shown} is not in the {source.name} split; its stores are "
                          f"{names[:10]}{' ...' if len(names) > 10 else ''}")
    return found


def store_identity(prefix) -> str:
    """The file a store prefix names, however it is spelt: relative (to the current directory),
    ``./``, absolute, through a symbolic link, or with its ``.idx``/``.bin`` suffix. An object-store
    URL is itself."""
    prefix = normalize_prefix(prefix)
    if "://" in prefix:
        return prefix
    if os.path.exists(prefix + ".idx"):  # a link to the .idx names the store it points to
        return normalize_prefix(os.path.realpath(prefix + ".idx"))
    return os.path.join(os.path.realpath(os.path.dirname(os.path.abspath(prefix))), os.path.basename(prefix))


def _samples_holding_exact(indices: GPTIndices, sequence_lengths: np.ndarray, document: int) -> np.ndarray:
    """Served sample ids of a megatron-core index whose tokens include some of ``document``."""
    document_index = indices.document_index
    positions = np.concatenate([begin + np.flatnonzero(np.asarray(document_index[begin:begin + _CHUNK]) == document)
                                for begin in range(0, document_index.shape[0], _CHUNK)] or
                               [np.zeros(0, dtype=np.int64)])  # (E,): once per epoch
    if not positions.shape[0] or int(sequence_lengths[document]) == 0:
        return np.zeros(0, dtype=np.int64)
    sample_index = np.asarray(indices.sample_index)
    starts, ends = sample_index[:-1, 0], sample_index[1:, 0]  # (S,) each, non-decreasing
    rows = []
    extra = int(indices.plan.add_extra_token)
    for p in positions:
        first = int(np.searchsorted(ends, p, side="left"))  # rows ending at or after p
        last = int(np.searchsorted(starts, p, side="right"))  # rows starting at or before p
        for row in range(first, last):  # a handful: the rows whose span covers position p
            begin = int(sample_index[row, 1]) if int(starts[row]) == p else 0
            stop = int(sample_index[row + 1, 1]) + extra if int(ends[row]) == p else int(sequence_lengths[document])
            if stop > begin:
                rows.append(row)
    if not rows:
        return np.zeros(0, dtype=np.int64)
    shuffle = np.asarray(indices.shuffle_index)
    wanted = np.unique(np.asarray(rows, dtype=np.int64))
    found = []
    for begin in range(0, shuffle.shape[0], _CHUNK):  # the served ids of those rows: one pass
        chunk = shuffle[begin:begin + _CHUNK]
        found.append(begin + np.flatnonzero(np.isin(chunk, wanted)))
    return np.concatenate(found)


def samples_holding(source: LocatedSource, prefix: str, document: int) -> dict[int, np.ndarray]:
    """Dataset id -> its sample ids (ascending) whose tokens include some of store ``prefix``'s
    document ``document``, for every dataset of ``source`` that reads that store."""
    check_int("document", document, minimum=0, expected="a document id (a non-negative integer)")
    out: dict[int, np.ndarray] = {}
    for d in datasets_of(source, prefix):
        reader = source.readers[d]
        if document >= reader.store.num_sequences:
            raise ConfigError(f"{reader.prefix}: document {document}; the store holds "
                              f"{reader.store.num_sequences} documents (ids 0 .. {reader.store.num_sequences - 1})")
        indices = reader.indices
        if isinstance(indices, GPTIndices):
            out[d] = np.unique(_samples_holding_exact(indices, reader.store.sequence_lengths, int(document)))
        else:
            out[d] = indices.samples_holding(int(document))
    return out


def find(source: LocatedSource, prefix: str, document: int) -> np.ndarray:
    """Ascending global positions of ``source`` whose sample holds tokens of store ``prefix``'s
    document ``document``."""
    found = [positions_of(source, d, sample_ids) for d, sample_ids in samples_holding(source, prefix, document).items()]
    return np.unique(np.concatenate(found)) if found else np.zeros(0, dtype=np.int64)


def positions_of(source: LocatedSource, d: int, sample_ids: np.ndarray) -> np.ndarray:
    """Global positions of ``source`` holding samples ``sample_ids`` of dataset ``d`` (a sample
    the blend never takes has none), as its locator inverts itself."""
    locator = source.locator
    if not sample_ids.shape[0]:
        return np.zeros(0, dtype=np.int64)
    inverse = getattr(locator, "positions_of", None)  # optional in the Locator contract
    if inverse is None:
        raise ConfigError(f"find does not know the locator {type(locator).__name__}")
    return inverse(d, sample_ids)


def steps_of(positions: np.ndarray, global_batch_size: int) -> np.ndarray:
    """The (0-based) optimizer steps that serve ``positions`` at a constant global batch size."""
    check_positive_int("global_batch_size", global_batch_size)
    return np.unique(np.asarray(positions, dtype=np.int64) // int(global_batch_size))


__all__ = ["LocatedSource", "Piece", "SampleOrigin", "datasets_of", "find", "positions_of", "samples_holding",
           "steps_of", "where"]
