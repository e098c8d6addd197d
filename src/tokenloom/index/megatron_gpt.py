"""The Megatron-exact packed-sample index: bit-identical to megatron-core 0.19.2's ``GPTDataset``.

Three arrays, built from the store's document lengths and one split's document ids:

* ``document_index`` -- every epoch's document ids, shuffled (int32);
* ``sample_index`` -- where each sample starts: ``(position in document_index, token offset)``,
  one row per sample plus a final row that marks where the last sample ends (int32, or int64 when
  ``document_index`` has more than 2**31 - 1 entries);
* ``shuffle_index`` -- the order samples are served in (uint32, or int64 from 2**32 - 2 samples).

The RandomState draws are megatron-core's, in its order: the document shuffle (the first
``num_epochs - 1`` epochs together, then the final epoch apart when it is short), then the sample
shuffle (likewise in two parts). With numba the shuffles run in
:mod:`tokenloom.index.randomstate_shuffle` (same draws, same result, faster) and the sample walk
is compiled (on first use, :mod:`tokenloom.index.kernels`); without it, RandomState's own shuffle
and a vectorised numpy walk give the same arrays. :data:`SAMPLE_INDEX_KERNELS` names the
alternatives.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from tokenloom.errors import BuildError, ConfigError
from tokenloom.index.epochs import EpochPlan, plan_epochs
from tokenloom.index.kernels import compiled_on_call, jit, numba_available, resolve_backend
from tokenloom.index.randomstate_shuffle import shuffle_like_randomstate
from tokenloom.validate import check_int, is_integer

INT32_MAX = int(np.iinfo(np.int32).max)
UINT32_MAX = int(np.iinfo(np.uint32).max)
PAD_TOKEN_ID = -1
"""The pad id megatron-core uses when the tokenizer has none (or one that collides)."""


class TokenReader(Protocol):
    """Anything that reads a slice of one document's tokens (tokenloom's and megatron-core's
    ``IndexedDataset`` both do)."""

    def get(self, sequence_id: int, offset: int = 0, length: int | None = None) -> np.ndarray: ...


@dataclass(frozen=True, kw_only=True, eq=False)
class GPTIndices:
    """The three arrays of a Megatron GPT dataset split, and the plan they were built from."""

    document_index: np.ndarray
    """(num_epochs * num_documents,) int32: document ids, epoch after epoch, shuffled."""

    sample_index: np.ndarray
    """(num_samples + 1, 2) int32 or int64: row k is (position in document_index, token offset)
    where sample k starts; row k + 1 is where it ends (its extra token, when there is one)."""

    shuffle_index: np.ndarray
    """(num_samples,) uint32 or int64: sample i served is sample shuffle_index[i] of sample_index."""

    plan: EpochPlan
    """Epoch arithmetic behind the arrays (token counts, epochs, the final-epoch rule)."""

    seed: int
    """The RandomState seed the shuffles used."""

    @property
    def num_samples(self) -> int:
        """Samples in the index (megatron-core's ``len(dataset)``)."""
        return int(self.sample_index.shape[0]) - 1

    def __len__(self) -> int:
        return self.num_samples


@dataclass(frozen=True, kw_only=True, eq=False)
class GPTSample:
    """One sample's tokens, as ``GPTDataset._query_document_sample_shuffle_indices`` returns it."""

    tokens: np.ndarray
    """(seq_length + add_extra_token,) int64: the tokens, padded with ``pad_token_id`` when the
    sample is the short last one of a validation split kept by ``drop_last_partial=False``."""

    document_ids: np.ndarray
    """(num_parts,) int64: the document each part of the sample comes from."""

    document_lengths: tuple[int, ...]
    """Tokens taken from each document, before padding."""


# --------------------------------------------------------------------------- sample index kernels


@jit(cache=True, nogil=True)
def _sample_index_walk(sequence_lengths: np.ndarray, document_index: np.ndarray,
                       seq_length: int, num_samples: int, add_extra_token: int,
                       out: np.ndarray) -> None:
    """The sample walk, one document at a time, in plain Python; the "numba" kernel compiles it."""
    last = document_index.shape[0] - 1
    position = 0  # into document_index
    offset = 0  # tokens into the current document
    out[0, 0] = 0
    out[0, 1] = 0
    for row in range(1, num_samples + 1):
        remaining = seq_length + add_extra_token
        while remaining != 0:
            document_length = int(sequence_lengths[document_index[position]]) - offset
            remaining -= document_length
            if remaining <= 0:
                # The sample ends inside this document; its extra token starts the next sample.
                offset += remaining + document_length - add_extra_token
                remaining = 0
            elif position == last:
                # Out of documents: a short (partial) final sample.
                offset = int(sequence_lengths[document_index[position]]) - add_extra_token
                break
            else:
                position += 1
                offset = 0
        out[row, 0] = position
        out[row, 1] = offset


def _sample_index_numpy(sequence_lengths: np.ndarray, document_index: np.ndarray,
                        seq_length: int, num_samples: int, add_extra_token: int,
                        out: np.ndarray, chunk: int = 1 << 20) -> None:
    """The same arrays without a loop per document.

    Sample k (k >= 1) starts at global token ``k * seq_length``; the walk stops in the first
    document whose end reaches ``k * seq_length + extra``. Counting, for every document, the first
    sample boundary past its end, and taking the running sum of those counts, gives that document
    for every k in one pass.
    """
    num_positions = document_index.shape[0]
    starts = np.empty(num_positions, dtype=np.int64)  # global token where each position starts
    # counts[k]: positions whose first boundary past their end is sample k (k clipped to S + 1)
    counts = np.zeros(num_samples + 2, dtype=np.int32 if num_positions <= INT32_MAX else np.int64)
    carried = 0
    for begin in range(0, num_positions, chunk):
        lengths = sequence_lengths[document_index[begin:begin + chunk]]  # (chunk,) int32
        ends = np.cumsum(lengths, dtype=np.int64)  # (chunk,) int64
        ends += carried
        carried = int(ends[-1])
        np.subtract(ends, lengths, out=starts[begin:begin + chunk])
        ends -= add_extra_token  # ends becomes the first boundary past each end, non-decreasing
        ends //= seq_length
        ends += 1
        np.clip(ends, 0, num_samples + 1, out=ends)
        low = int(ends[0])
        ends -= low
        counts[low:low + int(ends[-1]) + 1] += np.bincount(ends)
    out[0] = 0
    last_length = int(sequence_lengths[document_index[num_positions - 1]])
    running = int(counts[0])  # positions whose document ends before any boundary
    for begin in range(1, num_samples + 1, chunk):
        stop = min(begin + chunk, num_samples + 1)
        position = np.cumsum(counts[begin:stop], dtype=np.int64)  # (stop - begin,) non-decreasing
        position += running
        running = int(position[-1])
        # from `inside` on, the walk has run out of documents (a kept partial sample)
        inside = int(np.searchsorted(position, num_positions))
        offset = np.arange(begin, begin + inside, dtype=np.int64)  # (inside,) sample numbers
        offset *= seq_length
        offset -= starts[position[:inside]]
        out[begin:begin + inside, 1] = offset
        out[begin + inside:stop, 1] = last_length - add_extra_token
        out[begin:begin + inside, 0] = position[:inside]
        out[begin + inside:stop, 0] = num_positions - 1


SAMPLE_INDEX_KERNELS: dict[str, Callable[..., None]] = {
    "numpy": _sample_index_numpy,
    "python": _sample_index_walk,
}
"""Ways to fill the sample index (those that can run here); all give identical arrays. "python"
is for tiny inputs only; "numba" (when installed) compiles the walk on its first call (once per
dtype signature, cached on disk)."""
if numba_available():
    SAMPLE_INDEX_KERNELS["numba"] = compiled_on_call(_sample_index_walk)


def default_sample_index_kernel() -> str:
    """"numba" where numba is installed (it comes with tokenloom), else "numpy"."""
    return resolve_backend("auto", SAMPLE_INDEX_KERNELS, fallback="numpy", what="kernel")


def _resolve_kernel(kernel: str | None) -> str:
    """``kernel`` checked; None or "auto" -> :func:`default_sample_index_kernel`."""
    return resolve_backend("auto" if kernel is None else kernel, SAMPLE_INDEX_KERNELS, fallback="numpy",
                           what="kernel")


def sample_index_dtype(num_positions: int) -> type[np.integer]:
    """int32 while every document position fits, else int64 (megatron-core's switch)."""
    return np.int32 if num_positions <= INT32_MAX else np.int64


def shuffle_index_dtype(num_samples: int) -> type[np.integer]:
    """uint32 below 2**32 - 2 samples, else int64 (megatron-core's switch)."""
    return np.uint32 if num_samples < UINT32_MAX - 1 else np.int64


def build_sample_index(sequence_lengths: np.ndarray, document_index: np.ndarray, plan: EpochPlan,
                       *, kernel: str | None = None) -> np.ndarray:
    """The (num_samples + 1, 2) sample index walking ``document_index`` (no randomness)."""
    name = _resolve_kernel(kernel)
    num_positions = int(document_index.shape[0])
    dtype = sample_index_dtype(num_positions)
    if plan.num_samples_in_index < 0:
        # ceil(float(-1) / 1) = -1: megatron-core writes past its buffer and fails on the result.
        raise BuildError(
            f"{plan.num_samples_in_index} samples from a split of {plan.num_documents} documents "
            f"and {plan.num_tokens_per_epoch} tokens at seq_length={plan.seq_length}; megatron-core "
            "fails on this input too; use a split with tokens"
        )
    sample_index = np.empty((plan.num_samples_in_index + 1, 2), dtype=dtype)
    if plan.num_samples_in_index == 0:
        sample_index[0] = 0  # megatron-core's index of no samples (also for no documents)
        return sample_index
    SAMPLE_INDEX_KERNELS[name](sequence_lengths, document_index, plan.seq_length,
                               plan.num_samples_in_index, int(plan.add_extra_token), sample_index)
    if dtype == np.int32:
        # megatron-core checks its int32 index this way; only an empty last document fails it.
        smallest = int(sample_index[-1, 1])
        if smallest < 0:
            raise BuildError(
                f"the sample index's last offset is {smallest}: the final document "
                f"(id {int(document_index[-1])}) is empty, which megatron-core rejects when "
                "drop_last_partial=False; drop empty documents from the store"
            )
    return sample_index


# --------------------------------------------------------------------------- shuffles


def build_document_index(document_ids: np.ndarray, plan: EpochPlan,
                         random_state: np.random.RandomState, *, fast: bool | None = None) -> np.ndarray:
    """Every epoch's documents, shuffled: all epochs together, or the first ``num_epochs - 1``
    together and the final one apart (same draws, same order as megatron-core)."""
    num_documents = int(document_ids.shape[0])
    document_index = np.empty(plan.num_epochs * num_documents, dtype=np.int32)
    # (num_epochs, num_documents) view: one row per epoch
    document_index.reshape(plan.num_epochs, num_documents)[:] = document_ids.astype(np.int32, copy=False)
    if plan.separate_final_epoch:
        split_at = (plan.num_epochs - 1) * num_documents
        shuffle_like_randomstate(random_state, document_index[:split_at], fast=fast)
        shuffle_like_randomstate(random_state, document_index[split_at:], fast=fast)
    else:
        shuffle_like_randomstate(random_state, document_index, fast=fast)
    return document_index


def build_shuffle_index(plan: EpochPlan, num_samples: int, random_state: np.random.RandomState,
                        *, fast: bool | None = None) -> np.ndarray:
    """A permutation of ``range(num_samples)``; with a separate final epoch, the samples before
    ``plan.num_samples_sans_final_epoch`` and those after are shuffled apart."""
    shuffle_index = np.arange(num_samples, dtype=shuffle_index_dtype(num_samples))
    if plan.separate_final_epoch:
        split_at = plan.num_samples_sans_final_epoch
        shuffle_like_randomstate(random_state, shuffle_index[:split_at], fast=fast)
        shuffle_like_randomstate(random_state, shuffle_index[split_at:], fast=fast)
    else:
        shuffle_like_randomstate(random_state, shuffle_index, fast=fast)
    return shuffle_index


# --------------------------------------------------------------------------- the build


def _as_lengths(sequence_lengths: np.ndarray) -> np.ndarray:
    lengths = np.asarray(sequence_lengths)
    if lengths.ndim != 1 or not np.issubdtype(lengths.dtype, np.integer):
        raise ConfigError(
            f"sequence_lengths has shape {lengths.shape} and dtype {lengths.dtype}; expected a 1-D "
            "integer array (a token store's document lengths)"
        )
    if lengths.dtype != np.int32:
        if lengths.size and (int(lengths.min()) < 0 or int(lengths.max()) > INT32_MAX):
            raise ConfigError(
                f"sequence_lengths span [{int(lengths.min())}, {int(lengths.max())}]; expected "
                f"lengths in [0, {INT32_MAX}] (Megatron stores them as int32)"
            )
        lengths = lengths.astype(np.int32)
    return lengths


def _as_document_ids(document_ids: np.ndarray, num_documents_in_store: int) -> np.ndarray:
    ids = np.asarray(document_ids)
    if ids.ndim != 1 or not (np.issubdtype(ids.dtype, np.integer) or ids.size == 0):
        raise ConfigError(
            f"document_ids has shape {ids.shape} and dtype {ids.dtype}; expected a 1-D integer "
            "array of document ids (e.g. split.document_ids(range))"
        )
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= num_documents_in_store):
        raise ConfigError(
            f"document_ids span [{int(ids.min())}, {int(ids.max())}]; expected ids in "
            f"[0, {num_documents_in_store}) for a store of {num_documents_in_store} documents"
        )
    return ids


def _check_seed(seed: int) -> int:
    return check_int("seed", seed, minimum=0, maximum=UINT32_MAX,
                     expected=f"an integer in [0, {UINT32_MAX}] (a RandomState seed)")


def build_megatron_gpt_indices(sequence_lengths: np.ndarray, document_ids: np.ndarray, *,
                               num_samples: int | None, seq_length: int, seed: int,
                               add_extra_token: bool = True, drop_last_partial: bool = True,
                               kernel: str | None = None) -> GPTIndices:
    """Build megatron-core 0.19.2's ``GPTDataset`` indices for one split, bit for bit.

    ``sequence_lengths``: every document length of the token store. ``document_ids``: the split's
    documents (see :func:`tokenloom.index.split.split_document_ranges`). ``num_samples=None``
    builds one epoch. ``drop_last_partial=False`` is megatron-core's validation path with
    ``drop_last_partial_validation_sequence=False``; every other split drops it. ``seed`` is
    megatron-core's ``random_seed``, which it uses unchanged for every dataset and every split.
    ``kernel`` picks an entry of :data:`SAMPLE_INDEX_KERNELS` (None or "auto": numba when installed);
    "numba" also shuffles with the numba kernel, the others with RandomState's own shuffle.
    """
    seed = _check_seed(seed)
    lengths = _as_lengths(sequence_lengths)
    ids = _as_document_ids(document_ids, lengths.shape[0])
    plan = plan_epochs(lengths, ids, num_samples=num_samples, seq_length=seq_length,
                       add_extra_token=add_extra_token, drop_last_partial=drop_last_partial)
    kernel = _resolve_kernel(kernel)
    fast = kernel == "numba"
    random_state = np.random.RandomState(seed)
    document_index = build_document_index(ids, plan, random_state, fast=fast)
    sample_index = build_sample_index(lengths, document_index, plan, kernel=kernel)
    shuffle_index = build_shuffle_index(plan, sample_index.shape[0] - 1, random_state, fast=fast)
    return GPTIndices(document_index=document_index, sample_index=sample_index,
                      shuffle_index=shuffle_index, plan=plan, seed=seed)


# --------------------------------------------------------------------------- sample lookup


def megatron_gpt_sample(indices: GPTIndices, reader: TokenReader, index: int, *,
                        pad_token_id: int = PAD_TOKEN_ID) -> GPTSample:
    """Sample ``index`` (in served order) read through ``reader.get``, as megatron-core returns it.

    The tokens are ``seq_length + add_extra_token`` int64 values; a short final sample (only with
    ``drop_last_partial=False``) is padded with ``pad_token_id`` (megatron-core's is the
    tokenizer's pad id, or -1 when it has none or it collides with another special token).
    """
    num_samples = indices.num_samples
    if not is_integer(index) or not -num_samples <= index < num_samples:
        raise ConfigError(f"index={index!r}; expected an integer in [{-num_samples}, {num_samples})")
    extra = int(indices.plan.add_extra_token)
    row = int(indices.shuffle_index[index])
    begin_position, begin_offset = (int(v) for v in indices.sample_index[row])
    end_position, end_offset = (int(v) for v in indices.sample_index[row + 1])
    document_ids = [int(indices.document_index[p]) for p in range(begin_position, end_position + 1)]
    parts = []
    for position, document_id in zip(range(begin_position, end_position + 1), document_ids):
        offset = begin_offset if position == begin_position else 0
        # length None: to the end of the document (every part but the last)
        length = end_offset - offset + extra if position == end_position else None
        parts.append(np.asarray(reader.get(document_id, offset=offset, length=length)))
    document_lengths = tuple(int(part.shape[0]) for part in parts)
    shortfall = indices.plan.sample_num_tokens - sum(document_lengths)
    if shortfall > 0:
        parts.append(np.full(shortfall, pad_token_id, dtype=np.int64))
    return GPTSample(tokens=np.concatenate(parts, dtype=np.int64),
                     document_ids=np.array(document_ids, dtype=np.int64),
                     document_lengths=document_lengths)


__all__ = [
    "PAD_TOKEN_ID",
    "SAMPLE_INDEX_KERNELS",
    "GPTIndices",
    "GPTSample",
    "TokenReader",
    "build_document_index",
    "build_megatron_gpt_indices",
    "build_sample_index",
    "build_shuffle_index",
    "default_sample_index_kernel",
    "megatron_gpt_sample",
    "sample_index_dtype",
    "shuffle_index_dtype",
]
