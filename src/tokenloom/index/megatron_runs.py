"""Length runs in exact mode: megatron-core's arrays for one run of a store whose schedule changes
its ``seq_length`` (FORMAT.md "Length runs", :mod:`tokenloom.index.length_runs` for the rule).

megatron-core has no such dataset, so a run's three arrays are megatron's rules applied to a cut
of one stream rather than megatron-core's own ``GPTDataset``:

* **The stream** is megatron-core's document index over ``stream_epochs`` epochs, the epochs the
  store's runs need in total: the split's documents repeated that many times and shuffled *all
  together* by ``RandomState(seed)`` (megatron-core's ``_build_document_index`` without a separate
  final epoch; it shuffles every non-final epoch together too, so a document may come round twice
  before another comes once, as in megatron-core's own multi-epoch index). Every run of the store
  draws the same stream, so each run's item is built alone (any rank) and still cuts the stream
  the others cut.
* **The sample index** of a run from stream token ``T`` with ``n`` samples of ``s`` tokens is
  megatron-core's sample walk (:func:`~tokenloom.index.megatron_gpt.build_sample_index`, its
  kernels) over the stream's slice from the document holding ``T`` to the one holding the run's
  last token, the first document entered at ``T``'s offset. Its ``document_index`` is that slice
  (positions count from the run's first document), so row ``k`` is megatron's row of stream token
  ``T + k * s`` and the last row the next run's first.
* **The shuffle index** permutes the run's own ``n`` samples, one part (no separate final
  epoch), with ``RandomState`` seeded by the array ``[seed, T mod 2**32, T div 2**32]``
  (``init_by_array``): keyed by the run's first token as the stateless run's shuffle is, so two
  runs never shuffle alike and none shuffles like a megatron-core dataset (seeded ``seed`` alone).

A store with one run is not built here: it keeps megatron-core's own arrays and keys.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tokenloom.errors import ConfigError
from tokenloom.index.epochs import EpochPlan, plan_run_epochs
from tokenloom.index.kernels import resolve_backend
from tokenloom.index.megatron_gpt import (
    INT32_MAX,
    SAMPLE_INDEX_KERNELS,
    UINT32_MAX,
    GPTIndices,
    build_document_index,
    build_sample_index,
    shuffle_index_dtype,
)
from tokenloom.index.randomstate_shuffle import shuffle_like_randomstate
from tokenloom.validate import check_int


def stream_epochs_for(num_tokens_per_epoch: int, stream_tokens: int) -> int:
    """Epochs of a store's stream: the fewest whose tokens reach ``stream_tokens`` (the end of the
    last run's last row: its first token plus its samples x seq_length plus the extra token)."""
    num_tokens_per_epoch = check_int("num_tokens_per_epoch", num_tokens_per_epoch, minimum=1,
                                     expected="a positive integer (a stream of no tokens holds no run)")
    return max(1, -(-int(stream_tokens) // num_tokens_per_epoch))


def build_run_stream(document_ids: np.ndarray, plan: EpochPlan, stream_epochs: int,
                     random_state: np.random.RandomState, *, fast: bool | None = None) -> np.ndarray:
    """``(stream_epochs * documents,)`` int32: the store's document stream, megatron-core's
    document index over ``stream_epochs`` epochs shuffled together (``plan``: the run's)."""
    stream_plan = dataclasses.replace(plan, num_epochs=int(stream_epochs), separate_final_epoch=False)
    return build_document_index(np.asarray(document_ids), stream_plan, random_state, fast=fast)


def run_random_state(seed: int, first_token: int) -> np.random.RandomState:
    """The RandomState a run's samples are shuffled with: seeded by ``[seed, T mod 2**32, T div 2**32]``."""
    return np.random.RandomState(np.array([seed, first_token & 0xFFFFFFFF, first_token >> 32], dtype=np.uint32))


def build_run_shuffle_index(num_samples: int, *, seed: int, first_token: int,
                            fast: bool | None = None) -> np.ndarray:
    """``(num_samples,)`` uint32 (int64 from 2**32 - 2): the run's samples in served order."""
    shuffle_index = np.arange(num_samples, dtype=shuffle_index_dtype(num_samples))
    shuffle_like_randomstate(run_random_state(seed, first_token), shuffle_index, fast=fast)
    return shuffle_index


def _stream_ends(sequence_lengths: np.ndarray, stream: np.ndarray, reach: int, chunk: int) -> np.ndarray:
    """``(positions read,)`` int64: the stream token each position ends at, read ``chunk``
    positions at a time until one reaches ``reach`` (a run early in the stream reads only its part)."""
    parts, total = [], 0
    for lo in range(0, stream.shape[0], chunk):
        part = np.cumsum(sequence_lengths[stream[lo:lo + chunk]], dtype=np.int64)  # (chunk,)
        part += total
        parts.append(part)
        total = int(part[-1])
        if total >= reach:
            break
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def build_run_sample_index(sequence_lengths: np.ndarray, stream: np.ndarray, plan: EpochPlan, first_token: int,
                           *, kernel: str | None = None, chunk: int = 1 << 20) -> tuple[np.ndarray, np.ndarray]:
    """``(document_index, sample_index)`` of a run: the stream's slice the run reads (int32) and
    megatron's sample walk over it from ``first_token`` (``(n + 1, 2)``, positions in the slice).

    The slice starts at megatron's row of ``first_token`` (the document ``j`` with
    ``C_j < T + extra <= C_{j+1}``; ``(0, 0)`` at ``T = 0``) and ends with the document holding the
    last row's last token. The walk runs over the slice's lengths with the first one less the
    offset, and that offset is added back to the rows in the first document. ``chunk``: stream
    positions whose ends are summed at a time (the same arrays for any)."""
    extra = int(plan.add_extra_token)
    n, s = plan.num_samples_in_index, plan.seq_length
    reach = first_token + n * s + extra  # tokens of the stream the run's last row reads
    ends = _stream_ends(sequence_lengths, stream, reach, chunk)  # (positions read,) stream token each ends at
    if not ends.shape[0] or int(ends[-1]) < reach:
        raise ConfigError(f"a run of {n} samples of {s} tokens from stream token {first_token} reads to token "
                          f"{reach}, but the stream of {stream.shape[0]} positions holds "
                          f"{int(ends[-1]) if ends.shape[0] else 0}; expected stream_epochs enough for every run")
    first = 0 if first_token == 0 else int(np.searchsorted(ends, first_token + extra, side="left"))
    offset = first_token - (int(ends[first - 1]) if first else 0)
    last = int(np.searchsorted(ends, reach, side="left"))  # the document holding the last token
    document_index = np.ascontiguousarray(stream[first:last + 1])  # (run positions,) int32
    lengths = sequence_lengths[document_index].astype(np.int32)  # (run positions,) as the walk reads them
    lengths[0] -= offset
    walk_plan = dataclasses.replace(plan, num_samples_in_index=n)
    sample_index = build_sample_index(lengths, np.arange(lengths.shape[0], dtype=np.int32), walk_plan,
                                      kernel=kernel)  # (n + 1, 2)
    sample_index[sample_index[:, 0] == 0, 1] += offset
    return document_index, sample_index


def build_megatron_run_indices(sequence_lengths: np.ndarray, document_ids: np.ndarray, *, first_token: int,
                               num_samples: int, seq_length: int, seed: int, stream_epochs: int,
                               add_extra_token: bool = True, kernel: str | None = None) -> GPTIndices:
    """The three arrays of one length run in exact mode (see the module docstring): ``num_samples``
    samples of ``seq_length`` from stream token ``first_token`` of the store's stream of
    ``stream_epochs`` epochs (:func:`stream_epochs_for` over every run of the store). Its plan is
    :func:`~tokenloom.index.epochs.plan_run_epochs`' (exactly ``num_samples``, one shuffled part)."""
    seed = check_int("seed", seed, minimum=0, maximum=UINT32_MAX,
                     expected=f"an integer in [0, {UINT32_MAX}] (a RandomState seed)")
    lengths, ids = np.asarray(sequence_lengths), np.asarray(document_ids)
    if lengths.ndim != 1 or ids.ndim != 1 or lengths.dtype.kind not in "iu" or \
            (ids.size and ids.dtype.kind not in "iu"):
        raise ConfigError(f"sequence_lengths {lengths.shape} {lengths.dtype} and document_ids {ids.shape} {ids.dtype}; "
                          "expected 1-D integer arrays (a store's document lengths, a split's document ids)")
    if lengths.size and (int(lengths.min()) < 0 or int(lengths.max()) > INT32_MAX):
        raise ConfigError(f"sequence_lengths span [{int(lengths.min())}, {int(lengths.max())}]; expected lengths in "
                          f"[0, {INT32_MAX}] (Megatron stores them as int32)")
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= lengths.shape[0]):
        raise ConfigError(f"document_ids span [{int(ids.min())}, {int(ids.max())}]; expected ids in "
                          f"[0, {lengths.shape[0]}) for a store of {lengths.shape[0]} documents")
    lengths = lengths.astype(np.int32, copy=False)
    tokens = int(lengths[ids].sum(dtype=np.int64)) if ids.size else 0
    if tokens < 1:
        raise ConfigError(f"a split of {ids.size} documents holds no tokens; a length run needs a stream of tokens")
    plan = plan_run_epochs(tokens, ids.shape[0], first_token=first_token, num_samples=num_samples,
                           seq_length=seq_length, add_extra_token=add_extra_token)
    stream_epochs = check_int("stream_epochs", stream_epochs, minimum=plan.num_epochs,
                              expected=f"at least the {plan.num_epochs} epochs this run reaches into")
    kernel = resolve_backend("auto" if kernel is None else kernel, SAMPLE_INDEX_KERNELS, fallback="numpy",
                             what="kernel")
    fast = kernel == "numba"
    stream = build_run_stream(ids, plan, stream_epochs, np.random.RandomState(seed), fast=fast)
    document_index, sample_index = build_run_sample_index(lengths, stream, plan, first_token, kernel=kernel)
    shuffle_index = build_run_shuffle_index(plan.num_samples_in_index, seed=seed, first_token=first_token, fast=fast)
    return GPTIndices(document_index=document_index, sample_index=sample_index, shuffle_index=shuffle_index,
                      plan=plan, seed=seed)


__all__ = ["build_megatron_run_indices", "build_run_sample_index", "build_run_shuffle_index", "build_run_stream",
           "run_random_state", "stream_epochs_for"]
