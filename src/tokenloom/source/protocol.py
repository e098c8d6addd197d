"""The sample-source contract: what the build stage produces and the serving stage reads.

A source is one split of a build: a blend of ``num_samples`` packed samples, each drawn from one
dataset of the blend. Serving asks it two things, both vectorised over many positions at once:

* :meth:`SampleSource.locate` -- which dataset, and which sample of that dataset, sits at each
  global position of the blend;
* :meth:`SampleSource.read_samples` -- the tokens of many (dataset, sample) pairs, one row each;
* ``read_pieces`` (optional) -- the same rows plus where each document piece of a row ends
  (:class:`PieceRows`), for the document-boundary fields (``inter_document_masking``). A source
  without it serves every field but those;
* ``read_loss_masks`` (optional) -- the stores' loss masks of the same rows (``PREFIX.mask``,
  FORMAT.md "The loss-mask sidecar"), or None when no store of the batch has one; with
  ``has_loss_mask(dataset_id)``. A source without it serves every token in the loss.

``tokenloom.build(...).split(name)`` returns an object with this interface, as do
``StoreBlendSource`` and ``StatelessBlendSource`` (:mod:`tokenloom.source.memory`), which build
one split in memory from token stores; all three are :class:`~tokenloom.source.blended.BlendedSource`.

A blended source places its positions with a :class:`Locator`; the contract lives here because both
the blended source and provenance (:mod:`tokenloom.source.provenance`, which the blended source calls
for ``where`` and ``find``) read locators.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol, runtime_checkable

import numpy as np


@dataclass(frozen=True, kw_only=True)
class DatasetInfo:
    """One dataset of a blend, as serving sees it."""

    name: str
    """A label for reports: the store prefix, or a name given in the build config."""

    weight: float
    """Target share of the blend's samples (the weights of a blend sum to 1)."""

    num_samples: int
    """Samples the dataset's index holds; ``sample_ids`` handed to ``read_samples`` stay below it."""

    eod_id: int | None
    """End-of-document token id from the store's tokenizer record; None when it has none."""

    budget_tokens: int | None = None
    """Training tokens the build config gave the dataset (a token or epoch budget); None when
    the blend gave weights. The audit reports realised tokens against it."""


class PieceRows(NamedTuple):
    """Token rows and the document pieces each row holds, read in one pass.

    Row ``k`` holds ``counts[k]`` pieces (the documents megatron-core's ``GPTDataset`` reads for
    the sample, empty ones included); piece ``j`` covers columns ``[ends[k, j - 1], ends[k, j])``
    of the row (``ends[k, -1]`` read as 0). Columns after the last piece are padding.
    """

    tokens: np.ndarray
    """(B, seq_length + add_extra_token) int64, as :meth:`SampleSource.read_samples` returns."""
    ends: np.ndarray
    """(B, seq_length + add_extra_token + 1) int32: each piece's exclusive end column; entries
    from ``counts[k]`` on are undefined."""
    counts: np.ndarray
    """(B,) int32: pieces in each row (at least 1)."""


@runtime_checkable
class SampleSource(Protocol):
    """One split of a build, readable by position. Every method is vectorised."""

    @property
    def build_key(self) -> str:
        """Hex digest naming this build (config + inputs); a saved serving state carries it."""

    @property
    def num_samples(self) -> int:
        """Global positions in the blend: valid positions are ``[0, num_samples)``."""

    @property
    def seq_length(self) -> int:
        """Tokens per sample fed to the model (the labels are shifted by one)."""

    @property
    def add_extra_token(self) -> bool:
        """Whether each sample's row holds ``seq_length + 1`` tokens (megatron-core's default)."""

    @property
    def pad_id(self) -> int:
        """Token id filling short samples (megatron-core's pad id; -1 when the tokenizer has none)."""

    @property
    def datasets(self) -> tuple[DatasetInfo, ...]:
        """The blend's datasets, in dataset-id order."""

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(dataset_ids, sample_ids)``, two int64 arrays shaped like ``positions``."""

    def read_samples(self, dataset_ids: np.ndarray, sample_ids: np.ndarray) -> np.ndarray:
        """``(len(ids), seq_length + add_extra_token)`` int64 tokens, short rows padded with
        ``pad_id``; sample ``j`` of dataset ``d`` is row ``j`` of that dataset's index."""


class Locator(Protocol):
    """Where each global position of a blend comes from.

    ``positions_of(dataset_id, sample_ids)`` (optional) is the inverse: the global positions that
    hold samples ``sample_ids`` (int64, non-empty) of dataset ``dataset_id``, where a sample the
    blend never takes has none. ``find`` and quarantines need it; the three locators of
    :mod:`tokenloom.source.blended` have it.
    """

    @property
    def num_samples(self) -> int:
        """Positions in the blend."""

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(dataset_ids, sample_ids)`` int64 of in-range ``positions`` (int64)."""


def read_positions(source: SampleSource, positions) -> np.ndarray:
    """Tokens at global positions: ``source.read_samples(*source.locate(positions))``."""
    return source.read_samples(*source.locate(np.asarray(positions, dtype=np.int64)))


__all__ = ["DatasetInfo", "Locator", "PieceRows", "SampleSource", "read_positions"]
