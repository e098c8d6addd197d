"""The best-fit index: a split's documents packed whole into padded samples, served shuffled.

:mod:`tokenloom.index.best_fit` packs a list of lengths; this module makes an index of one split
of a store out of it, the third kind beside megatron-core's arrays and the stateless index:

* **Document order.** The split's ``D`` documents are visited in the order of a keyed Feistel
  permutation ``P`` (:mod:`tokenloom.index.feistel`, purpose :data:`DOCUMENT_PURPOSE`, epoch 0):
  position ``q`` of the order holds document ``begin + P(q)``. Windows of ``window`` consecutive
  positions are packed on their own, so a store sorted by length or by source still gives every
  window a mix of documents.
* **Chunks.** The order is cut into chunks of :func:`chunk_documents` positions (a whole number
  of windows; the last chunk is shorter). A chunk is packed alone and stored alone (one cache item
  each), so the work divides over ranks and a rank holds one chunk's arrays, not a store's. As
  windows never cross a chunk, the chunks' samples laid end to end are exactly the packing of
  the whole order.
* **Samples of an epoch.** Every epoch serves the same ``S`` packed samples (chunk 0's first, in
  packing order), each once, shuffled by a Feistel permutation of ``[0, S)`` per epoch (purpose
  :data:`SAMPLE_PURPOSE`, epoch ``e``): served sample ``i`` is packed sample ``Q_e(i mod S)`` with
  ``e = i // S``. ``num_samples`` requested samples take ``ceil(num_samples / S)`` epochs; the
  last one serves the first ``num_samples - (epochs - 1) * S`` of its order, a random subset.
  So every token of every document is served exactly once per whole epoch, in one sample, in
  order, and the packing is paid for once, not per epoch.

A sample is ``seq_length + add_extra_token`` tokens: its pieces, then padding
(:data:`~tokenloom.index.megatron_gpt.PAD_TOKEN_ID`, outside the loss). Unlike concatenate-and-chunk
no token is shared between samples: the extra token is a sample's own, so a sample ends where
its last document does.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from tokenloom.errors import ConfigError, FormatError
from tokenloom.index.best_fit import BestFitPacking, pack_best_fit
from tokenloom.index.feistel import FeistelPermutation
from tokenloom.index.stateless import SampleSpans
from tokenloom.validate import check_int

__all__ = [
    "DEFAULT_WINDOW",
    "BestFitIndex",
    "BestFitPlan",
    "chunk_bounds",
    "chunk_documents",
    "pack_chunk",
    "pack_chunk_arrays",
    "resolve_window",
]

DOCUMENT_PURPOSE = "best_fit.documents"
SAMPLE_PURPOSE = "best_fit.samples"

DEFAULT_WINDOW = 100_000
"""Documents per window unless the config says otherwise (and at least one sample's capacity):
on web-like lengths a window this large already holds enough documents of every length for best
fit to fill its samples about as well as packing each file whole, as OLMo-core does, so a larger
one adds next to nothing (BENCHMARKS.md, "Best-fit packing"), while a window's working set stays
in cache."""

CHUNK_TARGET_DOCUMENTS = 1 << 22
"""Documents a chunk holds, rounded up to whole windows: small enough to spread a large store
over many ranks, large enough that a chunk's fixed cost (an item, its record, four files in a
pack) is small beside its packing."""

ARRAY_NAMES = ("documents", "begins", "lengths", "offsets")
"""The arrays of a chunk, in pack order (FORMAT.md, "Best-fit packing")."""


def resolve_window(window: int | None, capacity: int) -> int:
    """The window of a build: ``window``, or :data:`DEFAULT_WINDOW` (at least ``capacity``).

    A window must hold at least ``capacity`` (the tokens of a sample) documents: with fewer, a window
    of short documents cannot fill even one sample, whatever the packing does; ConfigError names
    that smallest value."""
    if window is None:
        return max(DEFAULT_WINDOW, int(capacity))
    check_int("best_fit_window", window, expected="a whole number of documents")
    if window < capacity:
        raise ConfigError(
            f"best_fit_window={window} documents is too small for samples of {capacity} tokens "
            f"(seq_length plus the extra token); expected at least {capacity}: a window of fewer documents cannot fill "
            f"one sample when its documents are short. The default is {DEFAULT_WINDOW:,} (or the "
            "sample length, if larger)")
    return int(window)


def chunk_documents(window: int) -> int:
    """Positions of the document order per chunk: whole windows, about :data:`CHUNK_TARGET_DOCUMENTS`."""
    return int(window) * max(1, -(-CHUNK_TARGET_DOCUMENTS // int(window)))


def chunk_bounds(num_documents: int, window: int) -> list[tuple[int, int]]:
    """``(first, stop)`` positions of the document order of every chunk of a split of
    ``num_documents`` documents (one empty chunk for an empty split)."""
    size = chunk_documents(window)
    return [(first, min(num_documents, first + size)) for first in range(0, max(num_documents, 1), size)]


def _document_order(num_documents: int, seed: int) -> FeistelPermutation:
    return FeistelPermutation.from_seed(max(1, int(num_documents)), seed=int(seed), purpose=DOCUMENT_PURPOSE)


def pack_chunk(sequence_lengths: np.ndarray, begin: int, end: int, first: int, stop: int, *, capacity: int,
               window: int, seed: int, backend: str = "auto") -> BestFitPacking:
    """The packing of positions ``[first, stop)`` of the document order of documents
    ``[begin, end)`` (module docstring); its ``documents`` are the store's document ids."""
    if not 0 <= begin <= end <= sequence_lengths.shape[0] or not 0 <= first <= stop <= end - begin:
        raise ConfigError(f"chunk [{first}, {stop}) of documents [{begin}, {end}) lies outside the store's "
                          f"{sequence_lengths.shape[0]} documents")
    if first % window:
        raise ConfigError(f"chunk starts at position {first}, not at a window edge (window {window})")
    order = _document_order(end - begin, seed)(np.arange(first, stop, dtype=np.int64)) if stop > first \
        else np.zeros(0, dtype=np.int64)
    documents = begin + order  # (n,) store ids, in packing order
    lengths = np.asarray(sequence_lengths[documents], dtype=np.int64) if documents.size \
        else np.zeros(0, dtype=np.int64)  # (n,) fancy indexing also reads a memory map in one pass
    packing = pack_best_fit(lengths, capacity, window=window, backend=backend)
    return dataclasses.replace(packing, documents=documents[packing.documents])


def pack_chunk_arrays(packing: BestFitPacking, num_sequences: int) -> dict[str, np.ndarray]:
    """The chunk's arrays as the cache stores them, each in the narrowest dtype its values need."""
    documents = packing.documents.astype(np.int32 if num_sequences <= np.iinfo(np.int32).max else np.int64)
    top = int(packing.begins.max()) if packing.begins.size else 0
    begins = packing.begins.astype(np.int32 if top <= np.iinfo(np.int32).max else np.int64)
    lengths = packing.lengths.astype(np.int32 if packing.capacity <= np.iinfo(np.int32).max else np.int64)
    return {"documents": documents, "begins": begins, "lengths": lengths, "offsets": packing.offsets.astype(np.int64)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class BestFitPlan:
    """How a request for samples maps onto epochs of a best-fit split."""

    seq_length: int
    """Tokens per sample, not counting the extra label token."""
    add_extra_token: bool
    """Whether a sample carries one more token for the shifted labels (its own, not shared)."""
    num_samples_requested: int | None
    """Samples asked for; None: one epoch."""
    samples_per_epoch: int
    """Packed samples: every document of the split, once."""
    num_epochs: int
    """Epochs the request takes (``ceil(requested / samples_per_epoch)``, 1 for None)."""

    def __post_init__(self) -> None:
        if self.samples_per_epoch < 1:
            raise ConfigError(f"a best-fit split of {self.samples_per_epoch} samples; expected at least one")

    @classmethod
    def for_request(cls, *, seq_length: int, add_extra_token: bool, num_samples: int | None,
                    samples_per_epoch: int) -> BestFitPlan:
        epochs = 1 if num_samples is None else max(1, -(-int(num_samples) // int(samples_per_epoch)))
        return cls(seq_length=int(seq_length), add_extra_token=bool(add_extra_token),
                   num_samples_requested=None if num_samples is None else int(num_samples),
                   samples_per_epoch=int(samples_per_epoch), num_epochs=epochs)

    @property
    def num_samples(self) -> int:
        """Samples the index serves: the request, or one epoch."""
        return self.samples_per_epoch if self.num_samples_requested is None else self.num_samples_requested

    @property
    def num_samples_in_index(self) -> int:
        return self.num_samples

    @property
    def sample_num_tokens(self) -> int:
        """Tokens of a sample row: ``seq_length + add_extra_token``."""
        return self.seq_length + int(self.add_extra_token)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data) -> BestFitPlan:
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls)})


class BestFitIndex:
    """Served sample ids of one best-fit split -> their document pieces (module docstring).

    ``chunks``: per chunk, the four arrays of :data:`ARRAY_NAMES` (memory maps are fine; nothing
    is copied). ``begin``/``end``: the split's documents in the store; ``window``: the packing's.
    """

    def __init__(self, *, plan: BestFitPlan, seed: int, chunks, begin: int, end: int, window: int,
                 name: str = "best-fit split") -> None:
        self.plan = plan
        self.seed = int(seed)
        self.chunks = tuple(tuple(chunk[n] for n in ARRAY_NAMES) if isinstance(chunk, dict) else tuple(chunk)
                            for chunk in chunks)
        self.begin, self.end, self.window = int(begin), int(end), int(window)
        self.name = name
        self._permutations: dict[int, FeistelPermutation] = {}
        counts = [int(c[3].shape[0]) - 1 for c in self.chunks]
        self.chunk_starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)  # (C + 1,)
        self.piece_starts = np.concatenate([[0], np.cumsum([int(c[0].shape[0]) for c in self.chunks])]).astype(np.int64)
        if int(self.chunk_starts[-1]) != plan.samples_per_epoch:
            raise FormatError(f"{name}: its chunks hold {int(self.chunk_starts[-1])} samples but its plan says "
                              f"{plan.samples_per_epoch}; the cache entries do not match (run tokenloom cache verify)")

    @property
    def num_samples(self) -> int:
        return self.plan.num_samples

    def epoch_permutation(self, epoch: int) -> FeistelPermutation:
        """``Q_e``: the order of the packed samples in epoch ``epoch`` (made once per epoch)."""
        perm = self._permutations.get(epoch)
        if perm is None:
            perm = self._permutations[epoch] = FeistelPermutation.from_seed(
                self.plan.samples_per_epoch, seed=self.seed, purpose=SAMPLE_PURPOSE, epoch=int(epoch))
        return perm

    def packed_samples(self, sample_ids: np.ndarray) -> np.ndarray:
        """(B,) int64: the packed sample each served sample id is."""
        ids = np.ascontiguousarray(sample_ids, dtype=np.int64)
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.num_samples):
            bad = int(ids[(ids < 0) | (ids >= self.num_samples)][0])
            raise ConfigError(f"{self.name}: sample {bad}; expected 0 .. {self.num_samples - 1}")
        per_epoch = self.plan.samples_per_epoch
        epochs, within = np.divmod(ids, per_epoch)
        out = np.empty_like(ids)
        for epoch in np.unique(epochs):
            rows = epochs == epoch
            out[rows] = self.epoch_permutation(int(epoch)).apply_unchecked(within[rows])
        return out

    def spans(self, sample_ids) -> SampleSpans:
        """The document pieces of served samples ``sample_ids``, in order (their padding follows)."""
        packed = self.packed_samples(sample_ids)
        chunk = np.searchsorted(self.chunk_starts, packed, side="right") - 1  # (B,)
        first = np.empty_like(packed)
        count = np.empty_like(packed)
        for c in np.unique(chunk):
            rows = chunk == c
            offsets = self.chunks[c][3]
            local = packed[rows] - self.chunk_starts[c]
            first[rows] = np.asarray(offsets[local], dtype=np.int64) + self.piece_starts[c]
            count[rows] = np.asarray(offsets[local + 1], dtype=np.int64) + self.piece_starts[c] - first[rows]
        bounds = np.zeros(packed.shape[0] + 1, dtype=np.int64)
        np.cumsum(count, out=bounds[1:])
        positions = np.repeat(first - bounds[:-1], count) + np.arange(int(bounds[-1]), dtype=np.int64)  # (P,)
        documents = np.empty(positions.shape[0], dtype=np.int64)
        begins = np.empty_like(documents)
        lengths = np.empty_like(documents)
        piece_chunk = np.searchsorted(self.piece_starts, positions, side="right") - 1
        for c in np.unique(piece_chunk):
            rows = piece_chunk == c
            local = positions[rows] - self.piece_starts[c]
            docs, starts, sizes, _ = self.chunks[c]
            documents[rows] = docs[local]
            begins[rows] = starts[local]
            lengths[rows] = sizes[local]
        return SampleSpans(bounds=bounds, document_ids=documents, offsets=begins, lengths=lengths,
                           positions=positions)

    def samples_holding(self, document: int) -> np.ndarray:
        """Served sample ids (ascending) holding some of store document ``document``: its place in
        the document order names its chunk, a scan of that chunk its pieces, and each epoch's
        inverse shuffle the served ids. Empty when the split does not hold it or it is empty."""
        local = int(document) - self.begin
        if not 0 <= local < self.end - self.begin:
            return np.zeros(0, dtype=np.int64)
        position = int(_document_order(self.end - self.begin, self.seed).inverse(np.array([local]))[0])
        c = position // chunk_documents(self.window)
        docs = np.asarray(self.chunks[c][0])
        pieces = np.flatnonzero(docs == int(document))  # (k,) a document's pieces lie in one chunk
        if not pieces.shape[0]:
            return np.zeros(0, dtype=np.int64)
        offsets = np.asarray(self.chunks[c][3])
        packed = np.unique(np.searchsorted(offsets, pieces, side="right") - 1 + self.chunk_starts[c])
        per_epoch = self.plan.samples_per_epoch
        found = []
        for epoch in range(self.plan.num_epochs):
            served = epoch * per_epoch + self.epoch_permutation(epoch).apply_unchecked(packed, inverse=True)
            found.append(served[served < self.num_samples])
        return np.unique(np.concatenate(found))


def required_chunks(num_documents: int, window: int) -> int:
    """Chunks of a split of ``num_documents`` documents."""
    return max(1, math.ceil(num_documents / chunk_documents(window)))
