"""The stateless packed-sample index: Megatron's sample semantics without per-sample arrays.

Samples are the same as :mod:`tokenloom.index.megatron_gpt`'s (windows of ``seq_length``
tokens plus the shared extra label token, packed across documents, over the epochs that
:func:`tokenloom.index.epochs.plan_epochs` asks for); only the order comes from elsewhere:

* Documents: epoch ``e`` visits the split's documents in the order of a keyed Feistel
  permutation ``P_e`` (:mod:`tokenloom.index.feistel`, purpose ``"documents"``, epoch ``e``):
  position ``p`` of epoch ``e`` (global position ``e * num_documents + p``) holds document
  ``document_ids[P_e(p)]``. Every epoch is shuffled on its own, so the final epoch is
  always apart from the others.
* Samples: sample ``i`` is served from packed sample ``Q(i)``; ``Q`` is a Feistel permutation
  (purpose ``"samples"``) of all samples, or, when megatron-core would shuffle a short final
  epoch apart, of ``[0, A)`` followed by one of ``[A, S)`` (purpose ``"samples.final"``,
  shifted by ``A``), with ``A = plan.num_samples_sans_final_epoch``.
* Sample boundaries: the only array is ``block_token_starts``, the global token at which
  every block of ``block_size`` consecutive positions starts (8 bytes per ``block_size``
  documents per epoch). Packed sample ``k >= 1`` starts in the document at the global
  position ``j`` with ``C_j < k * seq_length + extra <= C_{j+1}`` (``C_j``: tokens before
  position ``j``), found by a search over the blocks and a walk of at most ``block_size``
  documents (from the nearer end of the block), evaluating ``P_e`` on the way. Sample 0
  starts at ``(0, 0)``.
* Length runs (``first_token``; :mod:`tokenloom.index.length_runs`): when a mixture schedule
  changes a dataset's ``seq_length``, each run of one length is cut from the same document
  stream (same ``P_e``, same global positions) from stream token ``T`` on: packed sample ``k``
  holds stream tokens ``[T + k * seq_length, T + (k + 1) * seq_length + extra)``, its begin row
  found by the rule above at token ``T + k * seq_length`` (``(0, 0)`` only at token 0). A run
  holds exactly the samples asked for, over the epochs its last sample reaches
  (:func:`tokenloom.index.epochs.plan_run_epochs`), shuffled as one part by a permutation of
  its own purpose, ``"samples.run"``, with ``T`` in the key's epoch slot.

Kernels come in two backends with identical results (:data:`BACKENDS`): numba
(:mod:`tokenloom.index._stateless_kernels`, compiled on first use) and numpy (where numba is not
installed).
The tests hold a slow packer that spells out every token as the reference.

This is exactly the ``(position, offset)`` megatron-core's ``build_sample_idx`` records, so
:meth:`StatelessGPTIndex.to_arrays` can hand Megatron-shaped arrays to anyone who wants them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from tokenloom.errors import ConfigError
from tokenloom.index._stateless_kernels import (
    _block_sums_by_epoch_numba,
    _block_sums_numba,
    _block_sums_parallel_numba,
    _docs_at_numba,
    _is_consecutive_numba,
    _shuffle_two_parts_numba,
    _spans_numba,
    _spans_pass1_numba,
)
from tokenloom.index.epochs import EpochPlan, plan_epochs, plan_run_epochs
from tokenloom.index.feistel import MAX_SIZE, FeistelPermutation, default_rounds, derive_round_keys, feistel_bits
from tokenloom.index.kernels import compiled, import_numba, numba_available, resolve_backend
from tokenloom.index.megatron_gpt import (
    GPTIndices,
    TokenReader,
    build_sample_index,
    sample_index_dtype,
    shuffle_index_dtype,
)
from tokenloom.validate import check_int, check_positive_int, is_integer

__all__ = [
    "BACKENDS",
    "DEFAULT_BLOCK_SIZE",
    "SampleSpans",
    "StatelessGPTIndex",
    "build_stateless_gpt_index",
]

#: Documents per block of the prefix sums (a power of two): half a byte per document per
#: epoch, and a walk of at most 16 documents per sample lookup.
DEFAULT_BLOCK_SIZE = 16
DOCUMENT_PURPOSE = "documents"
SAMPLE_PURPOSE = "samples"
FINAL_SAMPLE_PURPOSE = "samples.final"
#: Purpose of a length run's sample shuffle (keyed with the run's first token as its epoch).
RUN_SAMPLE_PURPOSE = "samples.run"
_CHUNK_POSITIONS = 1 << 16  # positions per chunk of the numpy build


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class SampleSpans:
    """The document pieces of a batch of samples, flattened (CSR layout).

    Sample ``k`` of the batch is ``pieces[bounds[k]:bounds[k + 1]]``; its pieces are the
    documents megatron-core's ``GPTDataset`` reads for it, empty documents included.
    """

    bounds: np.ndarray
    """(num_queried + 1,) int64: where each sample's pieces begin in the arrays below."""
    document_ids: np.ndarray
    """(num_pieces,) int64: the store's document id of each piece."""
    offsets: np.ndarray
    """(num_pieces,) int64: first token of each piece within its document."""
    lengths: np.ndarray
    """(num_pieces,) int64: tokens of each piece; a sample's pieces sum to seq_length + extra."""
    positions: np.ndarray
    """(num_pieces,) int64: each piece's global position (index into ``document_index``)."""


# ----------------------------------------------------------------------------- the index


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class StatelessGPTIndex:
    """Packed GPT samples of one split, located on demand from block prefix sums.

    Holds references to ``sequence_lengths`` and ``document_ids`` (no copies) and the
    ``block_token_starts`` array; everything else is recomputed from the seed.
    """

    plan: EpochPlan
    """Epoch arithmetic shared with the Megatron-exact index (tokens, epochs, final-epoch rule)."""
    seed: int
    """Seed of every permutation, in ``[0, 2**64)``."""
    block_size: int
    """Documents per block of the prefix sums (K)."""
    rounds: int | None
    """Feistel rounds of every permutation; None: :func:`~tokenloom.index.feistel.default_rounds`
    of each permutation's size."""
    backend: str
    """``"numba"`` or ``"numpy"`` (a key of :data:`BACKENDS`): which kernels run; the results are identical."""
    sequence_lengths: np.ndarray
    """(num_documents_in_store,) integer: every document length of the token store."""
    document_ids: np.ndarray | None
    """(num_documents,) integer: the split's documents, or None for ``first_document_id + range``."""
    first_document_id: int
    """When ``document_ids`` is None: the split is documents ``first_document_id + [0, n)``."""
    block_token_starts: np.ndarray
    """(num_epochs * num_blocks + 1,) int64: global token where each block starts; last = all tokens."""
    document_keys: np.ndarray
    """(num_epochs, rounds) uint64: round keys of each epoch's document permutation."""
    first_token: int | None = None
    """None: the index of a whole request, megatron-core's samples (sample ``k`` holds stream
    tokens ``[k * seq_length, (k + 1) * seq_length + extra)``, ``plan_epochs``' count and
    final-epoch rule). An int ``T``: a *length run* from stream token ``T`` (sample ``k`` holds
    ``[T + k * seq_length, T + (k + 1) * seq_length + extra)``; exactly the samples asked for,
    shuffled as one part by the ``"samples.run"`` permutation keyed with ``T``), whose ``plan`` is
    :func:`~tokenloom.index.epochs.plan_run_epochs`'."""

    # -------------------------------------------------------------- sizes

    @property
    def num_samples(self) -> int:
        """Packed samples in the index (megatron-core's ``len(dataset)``)."""
        return self.plan.num_samples_in_index

    def __len__(self) -> int:
        return self.num_samples

    @property
    def num_documents(self) -> int:
        """Documents per epoch."""
        return self.plan.num_documents

    @property
    def num_blocks_per_epoch(self) -> int:
        """Blocks of ``block_size`` positions in one epoch (the last one may be short)."""
        return -(-self.num_documents // self.block_size)

    @property
    def nbytes(self) -> int:
        """Bytes this index owns (the prefix sums and keys; the referenced inputs excluded)."""
        return int(self.block_token_starts.nbytes + self.document_keys.nbytes)

    @property
    def sample_token_count(self) -> int:
        """Tokens in every sample: ``seq_length + add_extra_token``."""
        return self.plan.sample_num_tokens

    # -------------------------------------------------------------- permutations

    def document_permutation(self, epoch: int) -> FeistelPermutation:
        """The permutation ``P_epoch`` of positions within epoch ``epoch``."""
        if not 0 <= epoch < self.plan.num_epochs:
            raise ConfigError(f"epoch={epoch!r}; expected 0 <= epoch < {self.plan.num_epochs}")
        keys = tuple(int(k) for k in self.document_keys[epoch])
        return FeistelPermutation(size=self.num_documents, round_keys=keys, backend=self.backend)

    @functools.cached_property
    def _sample_parts(self) -> list[tuple[int, FeistelPermutation]]:
        """(start, permutation) of each independently shuffled range of sample ids.

        Derived once per index: deriving round keys hashes the seed, far costlier than a lookup.

        A length run is one part, keyed ``(seed, "samples.run", epoch=T, size=n)``. Never
        ``"samples"``: a permutation is named by its key alone, so a run would be served in
        exactly the order of a whole-request index of the same seed and sample count (say the
        dataset's index in a build without the schedule), two shuffles of one dataset moving in
        lockstep; ``T`` in the key's epoch slot (which a sample shuffle otherwise leaves 0) keeps
        two runs of one count apart the same way. Never megatron-core's two parts either: a run
        ends where the next begins, not at an epoch's end, so it has no "short final epoch"."""
        total = self.num_samples
        if self.first_token is not None:
            return [(0, FeistelPermutation.from_seed(total, seed=self.seed, purpose=RUN_SAMPLE_PURPOSE,
                                                     epoch=self.first_token, rounds=self.rounds,
                                                     backend=self.backend))] if total else []
        split_at = self.plan.num_samples_sans_final_epoch if self.plan.separate_final_epoch else total
        parts = []
        for start, stop, purpose in ((0, split_at, SAMPLE_PURPOSE), (split_at, total, FINAL_SAMPLE_PURPOSE)):
            if stop > start:
                parts.append((start, FeistelPermutation.from_seed(
                    stop - start, seed=self.seed, purpose=purpose, rounds=self.rounds,
                    backend=self.backend)))
        return parts

    def shuffle(self, sample_ids) -> np.ndarray:
        """Packed sample served at each of ``sample_ids`` (megatron-core's ``shuffle_index[i]``)."""
        return self._shuffle_checked(self._check_sample_ids(sample_ids))

    def _shuffle_checked(self, ids: np.ndarray) -> np.ndarray:
        parts = self._sample_parts
        if len(parts) == 1:  # one shuffled range, starting at 0
            return parts[0][1].apply_unchecked(ids)
        if len(parts) == 2 and self.backend == "numba":  # both ranges in one compiled call
            (_, low), (split_at, high) = parts
            return compiled(_shuffle_two_parts_numba)(ids, split_at, low.bits, low.keys_array, high.size,
                                                      high.bits, high.keys_array)
        out = np.empty_like(ids)
        for start, perm in parts:
            inside = (ids >= start) & (ids < start + perm.size)
            out[inside] = start + perm.apply_unchecked(ids[inside] - start)
        return out

    def _check_sample_ids(self, sample_ids) -> np.ndarray:
        ids = np.asarray(sample_ids)
        if ids.dtype.kind not in "iu" or ids.ndim != 1:
            raise ConfigError(f"sample_ids has shape {ids.shape} and dtype {ids.dtype}; expected a 1-D integer array")
        ids = ids.astype(np.int64, copy=False)
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= self.num_samples):
            raise ConfigError(f"sample_ids span [{int(ids.min())}, {int(ids.max())}]; expected ids in "
                              f"[0, {self.num_samples})")
        return ids

    # -------------------------------------------------------------- lookups

    @functools.cached_property
    def _kernel_args(self) -> tuple:
        """The arguments every compiled lookup takes, made once per index."""
        ids = self.document_ids if self.document_ids is not None else np.zeros(1, dtype=np.int64)
        return (self.sequence_lengths, ids, self.first_document_id, self.document_ids is None,
                self.num_documents, self.block_size, feistel_bits(self.num_documents), self.document_keys)

    def sample_bounds(self, packed_ids) -> tuple[np.ndarray, np.ndarray]:
        """Begin and end ``(position, offset)`` rows of packed samples (no shuffle applied).

        Row ``k`` of megatron-core's ``sample_index`` and row ``k + 1``: each ``(m, 2)`` int64.
        Packed sample ``k`` starts at stream token ``t = T + k * seq_length`` (``T``:
        ``first_token``, or 0): its row is ``(0, 0)`` at ``t = 0``, else ``(j, t - C_j)`` with
        ``C_j < t + extra <= C_{j+1}`` (``C_j``: tokens before global position ``j``).
        """
        ids = self._check_sample_ids(packed_ids)
        return BACKENDS[self.backend].bounds(self, ids)

    def spans(self, sample_ids, *, shuffled: bool = True) -> SampleSpans:
        """The document pieces of samples ``sample_ids`` (served order unless ``shuffled=False``)."""
        ids = self._check_sample_ids(sample_ids)
        packed = self._shuffle_checked(ids) if shuffled else ids
        return BACKENDS[self.backend].spans(self, packed)

    def samples_holding(self, document: int) -> np.ndarray:
        """Served sample ids (ascending) whose tokens include some of store document ``document``:
        the inverse of :meth:`spans`, without a scan. Per epoch, the inverse document permutation
        gives the document's position, the block prefix sums its first token, the token range the
        packed samples over it, and the inverse sample shuffle their ids. Empty when the split does
        not hold the document or it has no tokens. A length run skips the epochs that end before
        its first token."""
        if self.document_ids is None:
            local = int(document) - self.first_document_id
            if not 0 <= local < self.num_documents:
                return np.zeros(0, dtype=np.int64)
        else:
            found = np.flatnonzero(np.asarray(self.document_ids) == int(document))
            if not found.shape[0]:
                return np.zeros(0, dtype=np.int64)
            local = int(found[0])
        length = int(self.sequence_lengths[int(document)])
        if length == 0:
            return np.zeros(0, dtype=np.int64)
        seq_length, extra = self.plan.seq_length, int(self.plan.add_extra_token)
        n, block_size = self.num_documents, self.block_size
        first_token = self.first_token or 0  # packed sample k holds [T + k S, T + (k + 1) S + extra)
        packed = []
        for epoch in range(first_token // self.plan.num_tokens_per_epoch, self.plan.num_epochs):
            offset = int(self.document_permutation(epoch).inverse(np.array([local], dtype=np.int64))[0])
            first = (offset // block_size) * block_size
            before = np.arange(epoch * n + first, epoch * n + offset, dtype=np.int64)
            t0 = int(self.block_token_starts[epoch * self.num_blocks_per_epoch + offset // block_size])
            if before.shape[0]:
                t0 += int(self._document_lengths(self.documents_at(before)).sum())
            t0 -= first_token  # the document's first token, counted from the run's
            low = max(0, (t0 - extra) // seq_length)  # (k + 1) S + extra > t0
            high = min(self.num_samples - 1, (t0 + length - 1) // seq_length)  # k S < t0 + length
            if high >= low:
                packed.append(np.arange(low, high + 1, dtype=np.int64))
        if not packed:
            return np.zeros(0, dtype=np.int64)
        ids = np.concatenate(packed)
        out = np.empty_like(ids)
        for start, perm in self._sample_parts:  # the inverse shuffle of each part
            inside = (ids >= start) & (ids < start + perm.size)
            out[inside] = start + perm.apply_unchecked(ids[inside] - start, inverse=True)
        return np.unique(out)

    def documents_at(self, positions) -> np.ndarray:
        """Store document id at each global position of the (virtual) ``document_index``."""
        positions = np.asarray(positions, dtype=np.int64)
        total = self.plan.num_epochs * self.num_documents
        if len(positions) and (int(positions.min()) < 0 or int(positions.max()) >= total):
            raise ConfigError(f"positions span [{int(positions.min())}, {int(positions.max())}]; "
                              f"expected positions in [0, {total})")
        return BACKENDS[self.backend].documents_at(self, positions)

    def _document_lengths(self, document_ids: np.ndarray) -> np.ndarray:
        return self.sequence_lengths[document_ids].astype(np.int64)

    def read(self, reader: TokenReader, sample_id: int) -> np.ndarray:
        """Tokens of sample ``sample_id`` (served order), read through ``reader.get``.

        ``(seq_length + add_extra_token,) int64``, the same tokens megatron-core's
        ``GPTDataset`` returns for this sample given :meth:`to_arrays`.
        """
        spans = self.spans(np.array([sample_id], dtype=np.int64))
        parts = [np.asarray(reader.get(int(d), offset=int(o), length=int(n)))
                 for d, o, n in zip(spans.document_ids, spans.offsets, spans.lengths)]
        return np.concatenate(parts, dtype=np.int64)

    # -------------------------------------------------------------- Megatron arrays

    def to_arrays(self) -> GPTIndices:
        """Megatron-shaped ``document_index``, ``sample_index``, ``shuffle_index`` (O(samples) memory).

        ``sample_index`` is the walk of the shared Megatron kernel over this index's document
        order; the tests check it against :meth:`sample_bounds` and megatron-core itself. For a
        length run, ``document_index`` holds every epoch from the first (positions stay global)
        through the last the run reaches, and ``sample_index`` is found by a search per row over
        the running token count (row 0 at the row of token ``first_token``); megatron-core's
        ``GPTDataset`` reads the run's samples from these arrays as from its own.
        """
        n = self.num_documents
        document_index = np.empty(self.plan.num_epochs * n, dtype=np.int64)
        everything = np.arange(n, dtype=np.int64)
        for epoch in range(self.plan.num_epochs):
            chosen = self.document_permutation(epoch)(everything)  # (n,) local ids
            document_index[epoch * n:(epoch + 1) * n] = (
                chosen + self.first_document_id if self.document_ids is None else self.document_ids[chosen])
        if document_index.size == 0 or int(document_index.max()) <= np.iinfo(np.int32).max:
            document_index = document_index.astype(np.int32)
        if self.first_token is None:
            sample_index = build_sample_index(self.sequence_lengths, document_index, self.plan)
        else:
            sample_index = _run_sample_index(self.sequence_lengths, document_index, self.plan, self.first_token)
        shuffle_index = self.shuffle(np.arange(self.num_samples, dtype=np.int64))
        shuffle_index = shuffle_index.astype(shuffle_index_dtype(self.num_samples))
        return GPTIndices(document_index=document_index, sample_index=sample_index,
                          shuffle_index=shuffle_index, plan=self.plan, seed=self.seed)


def _run_sample_index(sequence_lengths: np.ndarray, document_index: np.ndarray, plan: EpochPlan,
                      first_token: int) -> np.ndarray:
    """The ``(n + 1, 2)`` sample index of a length run from stream token ``first_token``: row
    ``k`` at token ``t = first_token + k * seq_length`` is ``(0, 0)`` at ``t = 0``, else ``(j, t -
    C_j)`` with ``C_j < t + extra <= C_{j+1}``. A search per row over the running token count
    (another route than the lookups' walk, which the tests hold it to)."""
    ends = np.cumsum(sequence_lengths[document_index], dtype=np.int64)  # (positions,) C_{j+1}
    # tokens: (n + 1,) int64, the stream token each row is at
    tokens = first_token + plan.seq_length * np.arange(plan.num_samples_in_index + 1, dtype=np.int64)
    # rows: (n + 1,) the first j with C_{j+1} >= t + extra (so C_j < t + extra)
    rows = np.searchsorted(ends, tokens + int(plan.add_extra_token), side="left")
    sample_index = np.stack([rows, tokens - (ends[rows] - sequence_lengths[document_index[rows]])], axis=1)
    sample_index[tokens == 0] = 0  # the stream's first row, as megatron-core's sample 0
    return sample_index.astype(sample_index_dtype(document_index.shape[0]))


# ----------------------------------------------------------------------------- backends


def _bounds_numba(index: StatelessGPTIndex, packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    begin = np.empty((len(packed), 2), dtype=np.int64)
    end = np.empty((len(packed), 2), dtype=np.int64)
    lengths, ids, first_id, contiguous, n, block_size, bits, keys = index._kernel_args
    compiled(_spans_pass1_numba)(packed, index.plan.seq_length, int(index.plan.add_extra_token),
                                 index.first_token or 0, index.block_token_starts, lengths, ids, first_id,
                                 contiguous, n, block_size, bits, keys, begin, end)
    return begin, end


def _docs_at_numba_entry(index: StatelessGPTIndex, positions: np.ndarray) -> np.ndarray:
    out = np.empty(len(positions), dtype=np.int64)
    _lengths, ids, first_id, contiguous, n, _, bits, keys = index._kernel_args
    compiled(_docs_at_numba)(positions, ids, first_id, contiguous, n, bits, keys, out)
    return out


def _spans_two_pass_numba(index: StatelessGPTIndex, packed: np.ndarray) -> SampleSpans:
    """Rows first, then the pieces (re-permuting their few positions): faster than recording
    pieces during the walk, whose stores keep the compiler from holding the walk in registers."""
    lengths, ids, first_id, contiguous, n, block_size, bits, keys = index._kernel_args
    bounds, docs, offsets, pieces, positions = compiled(_spans_numba)(
        packed, index.plan.seq_length, int(index.plan.add_extra_token), index.first_token or 0,
        index.block_token_starts, lengths, ids, first_id, contiguous, n, block_size, bits, keys)
    return SampleSpans(bounds=bounds, document_ids=docs, offsets=offsets, lengths=pieces, positions=positions)


def _spans_numpy(index: StatelessGPTIndex, packed: np.ndarray) -> SampleSpans:
    begin, end = _bounds_numpy(index, packed)
    m = len(begin)
    bounds = np.zeros(m + 1, dtype=np.int64)
    np.cumsum(end[:, 0] - begin[:, 0] + 1, out=bounds[1:])  # pieces per sample, summed
    counts = np.diff(bounds)
    total = int(bounds[-1])
    owner = np.repeat(np.arange(m), counts)  # (total,) sample of each piece
    rank = np.arange(total, dtype=np.int64) - bounds[owner]  # (total,) piece within its sample
    positions = begin[owner, 0] + rank
    document_ids = _docs_at_numpy(index, positions)
    lengths = index._document_lengths(document_ids)
    offsets = np.where(rank == 0, begin[owner, 1], 0)
    is_last = positions == end[owner, 0]
    extra = int(index.plan.add_extra_token)
    lengths = np.where(is_last, end[owner, 1] + extra, lengths) - offsets
    return SampleSpans(bounds=bounds, document_ids=document_ids, offsets=offsets, lengths=lengths,
                       positions=positions)


def _local_at_numpy(index: StatelessGPTIndex, positions: np.ndarray) -> np.ndarray:
    """Local document (0..n-1 within the split) at each global position."""
    n = index.num_documents
    epochs = positions // n
    local = np.empty_like(positions)
    for epoch in np.unique(epochs):
        inside = epochs == epoch
        local[inside] = index.document_permutation(int(epoch))(positions[inside] - epoch * n)
    return local


def _docs_at_numpy(index: StatelessGPTIndex, positions: np.ndarray) -> np.ndarray:
    local = _local_at_numpy(index, positions)
    if index.document_ids is None:
        return local + index.first_document_id
    return index.document_ids[local].astype(np.int64)


def _bounds_numpy(index: StatelessGPTIndex, packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Vectorised twin of the numba pass: block search, block walk, then a forward walk."""
    seq_length, extra = index.plan.seq_length, int(index.plan.add_extra_token)
    n, block_size = index.num_documents, index.block_size
    num_blocks = index.num_blocks_per_epoch
    m = len(packed)
    begin = np.zeros((m, 2), dtype=np.int64)
    cum = np.zeros(m, dtype=np.int64)  # tokens before each sample's begin position
    tokens = (index.first_token or 0) + packed * seq_length  # (m,) stream token each sample starts at
    later = tokens > 0  # the sample at token 0 begins at (0, 0)
    q = tokens[later] + extra
    beta = np.searchsorted(index.block_token_starts, q, side="left") - 1  # (m',) block
    epochs = beta // num_blocks
    first = (beta - epochs * num_blocks) * block_size  # (m',) first position of the block
    rank = np.arange(block_size, dtype=np.int64)
    local = first[:, None] + rank[None, :]  # (m', K) positions in the block
    valid = local < n
    global_pos = (epochs * n)[:, None] + np.minimum(local, n - 1)
    lengths = index._document_lengths(_docs_at_numpy(index, global_pos.reshape(-1))).reshape(global_pos.shape)
    lengths = np.where(valid, lengths, 0)
    ends = index.block_token_starts[beta][:, None] + np.cumsum(lengths, axis=1)  # (m', K)
    hit = np.argmax((ends >= q[:, None]) & valid, axis=1)  # first document reaching q
    rows = np.arange(len(q))
    begin[later, 0] = epochs * n + first + hit
    cum[later] = ends[rows, hit] - lengths[rows, hit]
    begin[:, 1] = tokens - cum
    # forward walk to the end boundary, all samples in lockstep
    position = begin[:, 0].copy()
    q_end = tokens + seq_length + extra
    active = np.arange(m)
    while len(active):
        length = index._document_lengths(_docs_at_numpy(index, position[active]))
        done = cum[active] + length >= q_end[active]
        moving = active[~done]
        cum[moving] += length[~done]
        position[moving] += 1
        active = moving
    end = np.stack([position, tokens + seq_length - cum], axis=1)
    return begin, end


class StatelessKernels(NamedTuple):
    """One backend's lookups; each takes the index and an int64 array of packed ids or positions."""

    bounds: Callable[[StatelessGPTIndex, np.ndarray], tuple[np.ndarray, np.ndarray]]
    """:meth:`StatelessGPTIndex.sample_bounds` of packed samples."""
    spans: Callable[[StatelessGPTIndex, np.ndarray], SampleSpans]
    """:meth:`StatelessGPTIndex.spans` of packed samples."""
    documents_at: Callable[[StatelessGPTIndex, np.ndarray], np.ndarray]
    """:meth:`StatelessGPTIndex.documents_at` of global positions."""


#: Backends of the lookups (those that can run here); all give identical results.
BACKENDS: dict[str, StatelessKernels] = {"numpy": StatelessKernels(_bounds_numpy, _spans_numpy, _docs_at_numpy)}
if numba_available():
    BACKENDS["numba"] = StatelessKernels(_bounds_numba, _spans_two_pass_numba, _docs_at_numba_entry)


def _block_sums_numpy(lengths, document_ids, first_id, n, block_size, epoch_perms, out) -> None:
    """out[e * num_blocks + b] = tokens of positions [b*K, (b+1)*K) of epoch e (gathered in chunks)."""
    num_blocks = -(-n // block_size)
    chunk = max(1, _CHUNK_POSITIONS // block_size) * block_size
    for epoch, perm in enumerate(epoch_perms):
        for first in range(0, n, chunk):
            local = perm(np.arange(first, min(first + chunk, n), dtype=np.int64))  # (chunk,)
            docs = local + first_id if document_ids is None else document_ids[local]
            sums = np.add.reduceat(lengths[docs].astype(np.int64), np.arange(0, len(local), block_size))
            start = epoch * num_blocks + first // block_size
            out[start:start + len(sums)] = sums


# ----------------------------------------------------------------------------- the build


def _contiguous_start(document_ids: np.ndarray) -> int | None:
    """``ids[0]`` when ``ids == ids[0] + arange(len(ids))``, else None (one pass, no temporaries)."""
    if len(document_ids) == 0:
        return None
    start = int(document_ids[0])
    if int(document_ids[-1]) != start + len(document_ids) - 1:
        return None
    if numba_available():
        return start if compiled(_is_consecutive_numba)(document_ids) else None
    chunk = 1 << 20
    for first in range(0, len(document_ids), chunk):
        part = document_ids[first:first + chunk]
        if not np.array_equal(part, np.arange(start + first, start + first + len(part))):
            return None
    return start


def _count_tokens(lengths: np.ndarray, ids: np.ndarray | None, first_id: int, n: int) -> int:
    """Tokens in the split, summed in chunks (no n-element temporary)."""
    total, chunk = 0, 1 << 20
    for first in range(0, n, chunk):
        stop = min(first + chunk, n)
        part = lengths[first_id + first:first_id + stop] if ids is None else lengths[ids[first:stop]]
        total += int(np.sum(part, dtype=np.int64))
    return total


def build_stateless_gpt_index(sequence_lengths: np.ndarray, document_ids: np.ndarray | None, *,
                              num_samples: int | None, seq_length: int, seed: int,
                              add_extra_token: bool = True, block_size: int = DEFAULT_BLOCK_SIZE,
                              rounds: int | None = None, backend: str = "auto",
                              threads: int = 1, first_token: int | None = None) -> StatelessGPTIndex:
    """Build the stateless index of one split: O(documents * epochs) work, O(that / block_size) memory.

    ``sequence_lengths``: every document length of the token store (any integer dtype; not
    copied). ``document_ids``: the split's documents, or None for all of them in order.
    ``num_samples=None`` covers one epoch. ``seed`` in ``[0, 2**64)`` keys every permutation.
    ``block_size`` (K) trades memory (8 / K bytes per document per epoch) for lookup work (a
    walk of at most K documents). ``backend``: "auto", "numba" or "numpy" (identical results).
    ``threads > 1`` (numba only) builds the prefix sums on that many threads (capped at numba's
    thread count): one per epoch while there are at least as many epochs (each streams its
    documents, the cheaper order), else all of them on each epoch's positions in turn. Every
    thread count gives the same arrays.

    ``first_token``: None (the default) builds the index of a whole request, megatron-core's
    samples from stream token 0 (epochs and count from :func:`~tokenloom.index.epochs.plan_epochs`).
    An int ``T >= 0`` builds one *length run* of a mixture schedule
    (:mod:`tokenloom.index.length_runs`): the same document stream (same seed, same ``P_e``),
    cut from stream token ``T``, exactly ``num_samples`` samples (an int, required), over the
    epochs the last one reaches (:func:`~tokenloom.index.epochs.plan_run_epochs`), shuffled as
    one part (``"samples.run"``). ``T = 0`` is a run too: a dataset's first run, whose samples
    are ``[0, n)`` only, where a whole request's index would shuffle all its epochs' samples.
    """
    lengths = np.asarray(sequence_lengths)
    if lengths.ndim != 1 or lengths.dtype.kind not in "iu":
        raise ConfigError(f"sequence_lengths has shape {lengths.shape} and dtype {lengths.dtype}; "
                          "expected a 1-D integer array (a token store's document lengths)")
    if lengths.size and int(lengths.min()) < 0:
        raise ConfigError(f"sequence_lengths holds a negative length {int(lengths.min())}; expected lengths >= 0")
    if not is_integer(block_size) or block_size < 1 or block_size & (block_size - 1):
        raise ConfigError(f"block_size={block_size!r}; expected a power of two (1, 2, 4, ...) number of "
                          "documents per block")
    if not is_integer(seed) or not 0 <= seed < (1 << 64):
        raise ConfigError(f"seed={seed!r}; expected an integer in [0, 2**64)")
    check_positive_int("threads", threads)
    if first_token is not None:
        first_token = check_int("first_token", first_token, minimum=0, maximum=(1 << 63) - 1,
                                expected="a stream token in [0, 2**63) where the length run starts, or None "
                                         "for the index of a whole request")
        if num_samples is None:
            raise ConfigError(f"num_samples=None with first_token={first_token}; expected a number of samples: "
                              "a length run holds exactly the samples asked for")
    backend = resolve_backend(backend, BACKENDS, fallback="numpy")
    if document_ids is None:
        ids, first_id = None, 0
        num_documents = lengths.shape[0]
    else:
        ids = np.asarray(document_ids)
        if ids.ndim != 1 or (ids.dtype.kind not in "iu" and ids.size):
            raise ConfigError(f"document_ids has shape {ids.shape} and dtype {ids.dtype}; expected a "
                              "1-D integer array of document ids, or None for every document")
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= lengths.shape[0]):
            raise ConfigError(f"document_ids span [{int(ids.min())}, {int(ids.max())}]; expected ids in "
                              f"[0, {lengths.shape[0]}) for a store of {lengths.shape[0]} documents")
        num_documents = ids.shape[0]
        start = _contiguous_start(ids)
        ids, first_id = (None, start) if start is not None else (ids, 0)
    if num_documents == 0 or num_documents > MAX_SIZE:
        raise ConfigError(f"the split has {num_documents} documents; expected between 1 and 2**62")
    num_tokens = _count_tokens(lengths, ids, first_id, num_documents)
    if num_tokens == 0:
        raise ConfigError(f"the split's {num_documents} documents hold no tokens; expected a split with "
                          "tokens (check the split and that the token store is not empty)")
    if first_token is None:
        # plan_epochs gathers sequence_lengths[document_ids] (an n-element copy); its rules depend
        # only on the token count, so it sees one document holding every token, then the real count.
        plan = plan_epochs(np.array([num_tokens], dtype=np.int64), np.zeros(1, dtype=np.int64),
                           num_samples=num_samples, seq_length=seq_length, add_extra_token=add_extra_token)
        plan = dataclasses.replace(plan, num_documents=num_documents)
    else:
        plan = plan_run_epochs(num_tokens, num_documents, first_token=first_token, num_samples=num_samples,
                               seq_length=seq_length, add_extra_token=add_extra_token)
    document_rounds = default_rounds(num_documents) if rounds is None else rounds
    keys = np.array([derive_round_keys(seed=int(seed), purpose=DOCUMENT_PURPOSE, epoch=e, size=num_documents,
                                       rounds=document_rounds) for e in range(plan.num_epochs)], dtype=np.uint64)
    keys = keys.reshape(plan.num_epochs, document_rounds)  # (num_epochs, rounds) uint64
    num_blocks = -(-num_documents // block_size)
    # starts: (num_epochs * num_blocks + 1,) int64; block sums land in starts[1:], then an
    # in-place running sum turns sums into block starts.
    starts = np.zeros(plan.num_epochs * num_blocks + 1, dtype=np.int64)
    if backend == "numba":
        kernel_args = (lengths, ids if ids is not None else np.zeros(1, dtype=np.int64), first_id, ids is None,
                       num_documents, block_size.bit_length() - 1, feistel_bits(num_documents), keys)
        numba = import_numba()
        threads = min(int(threads), numba.config.NUMBA_NUM_THREADS)
        if threads == 1:
            compiled(_block_sums_numba)(*kernel_args, starts[1:])
        else:
            # one thread per epoch streams and scatters (the cheaper order) while there are
            # enough epochs; otherwise threads split each epoch's positions and gather
            kernel = compiled(_block_sums_by_epoch_numba if plan.num_epochs >= threads
                              else _block_sums_parallel_numba)
            previous = numba.get_num_threads()
            numba.set_num_threads(threads)
            try:
                kernel(*kernel_args, starts[1:])
            finally:
                numba.set_num_threads(previous)
    else:
        perms = [FeistelPermutation(size=num_documents, round_keys=tuple(int(k) for k in row), backend="numpy")
                 for row in keys]
        _block_sums_numpy(lengths, ids, first_id, num_documents, block_size, perms, starts[1:])
    np.cumsum(starts, out=starts)
    return StatelessGPTIndex(plan=plan, seed=int(seed), block_size=int(block_size), rounds=rounds,
                             backend=backend, sequence_lengths=lengths, document_ids=ids,
                             first_document_id=first_id, block_token_starts=starts, document_keys=keys,
                             first_token=first_token)
