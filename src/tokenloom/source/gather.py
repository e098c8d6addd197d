"""Copy many packed samples out of a memory-mapped store into one ``(B, width)`` int64 block.

Two backends, chosen from :data:`GATHER_BACKENDS` by :func:`gather_kernels` (identical results):

* ``"numba"`` (the default; numba comes with tokenloom): one compiled loop per call, walking each sample's documents
  and copying their tokens straight from the memory map into the output row (plain Python loops
  below, compiled on first use by :mod:`tokenloom.index.kernels`);
* ``"numpy"``: the same from vectorised index arithmetic and ``IndexedDataset.read_spans``.

A store on object storage has no memory map to compile against: both backends read it with the
numpy path, whose ``read_spans`` fetches the blocks of a whole micro-batch at once.

Asked for them (``ends``/``counts``), both also record each row's document pieces as they copy:
``ends[r, j]`` is the column where piece ``j`` of row ``r`` ends (exclusive) and ``counts[r]`` the
number of pieces, empty pieces included, as megatron-core's ``GPTDataset`` lists them. The
boundary fields of a sample (``cu_seqlens``, per-document position ids) come from these, not from
end-of-document tokens, at the cost of a few stores per piece inside the copy loop.

A micro-batch is a few dozen spans of a few thousand tokens; what costs is the per-call
overhead of a dozen small numpy operations, which the compiled loop removes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from tokenloom.errors import FormatError, InputError
from tokenloom.index.kernels import compiled, jit, numba_available, resolve_backend


@jit(cache=True, nogil=True)
def _gpt_rows_kernel(tokens, sequence_pointers, itemsize, sequence_lengths, document_index, sample_index,
                     shuffle_index, sample_ids, extra, pad_id, out, out_rows, want_pieces, ends, counts):
    """Fill ``out[out_rows[k]]`` with Megatron GPT sample ``sample_ids[k]`` (and, with
    ``want_pieces``, ``ends``/``counts`` of that row); returns -1, the first ``k`` whose spans
    would overrun the row (a corrupt index), or ``-2 - k`` when row ``k`` has more pieces than
    ``ends`` has columns."""
    width = out.shape[1]
    capacity = ends.shape[1]
    for k in range(sample_ids.shape[0]):
        r = out_rows[k]
        row = np.int64(shuffle_index[sample_ids[k]])
        first = np.int64(sample_index[row, 0])
        first_offset = np.int64(sample_index[row, 1])
        last = np.int64(sample_index[row + 1, 0])
        last_offset = np.int64(sample_index[row + 1, 1])
        column = 0
        for position in range(first, last + 1):
            document = np.int64(document_index[position])
            start = first_offset if position == first else 0
            stop = last_offset + extra if position == last else np.int64(sequence_lengths[document])
            if stop - start > width - column or start < 0 or stop > sequence_lengths[document]:
                return k
            base = np.int64(sequence_pointers[document]) // itemsize
            for t in range(start, stop):
                out[r, column] = tokens[base + t]
                column += 1
            if want_pieces:
                piece = position - first
                if piece >= capacity:
                    return -2 - k
                ends[r, piece] = column
        if want_pieces:
            counts[r] = last - first + 1
        for c in range(column, width):
            out[r, c] = pad_id
    return -1


@jit(cache=True, nogil=True)
def _span_rows_kernel(tokens, sequence_pointers, itemsize, bounds, document_ids, offsets, lengths, pad_id, out,
                      out_rows, want_pieces, ends, counts):
    """Fill ``out[out_rows[k]]`` with the spans ``bounds[k]:bounds[k + 1]`` (and the row's
    ``ends``/``counts``); returns -1, a bad k, or ``-2 - k`` as :func:`_gpt_rows_kernel`."""
    width = out.shape[1]
    capacity = ends.shape[1]
    for k in range(bounds.shape[0] - 1):
        r = out_rows[k]
        column = 0
        for piece in range(bounds[k], bounds[k + 1]):
            n = lengths[piece]
            if n > width - column:
                return k
            base = np.int64(sequence_pointers[document_ids[piece]]) // itemsize + offsets[piece]
            for t in range(n):
                out[r, column + t] = tokens[base + t]
            column += n
            if want_pieces:
                if piece - bounds[k] >= capacity:
                    return -2 - k
                ends[r, piece - bounds[k]] = column
        if want_pieces:
            counts[r] = bounds[k + 1] - bounds[k]
        for c in range(column, width):
            out[r, c] = pad_id
    return -1


@jit(cache=True, nogil=True)
def _mask_rows_kernel(bits, sequence_pointers, itemsize, bounds, document_ids, offsets, lengths, out, out_rows):
    """Fill ``out[out_rows[k]]`` with the loss-mask bits of the spans ``bounds[k]:bounds[k + 1]``
    (token t is bit ``t & 7`` of ``bits[t >> 3]``), then 1 on the padding; returns -1, or a k whose
    spans hold more tokens than the row."""
    width = out.shape[1]
    for k in range(bounds.shape[0] - 1):
        r = out_rows[k]
        column = 0
        for piece in range(bounds[k], bounds[k + 1]):
            n = lengths[piece]
            if n > width - column:
                return k
            p = np.int64(sequence_pointers[document_ids[piece]]) // itemsize + offsets[piece]
            stop = column + n
            while column < stop and p & 7:  # to a byte boundary, then a byte (8 tokens) at a time
                out[r, column] = (bits[p >> 3] >> (p & 7)) & 1
                column += 1
                p += 1
            while stop - column >= 8:
                byte = bits[p >> 3]
                for j in range(8):
                    out[r, column + j] = (byte >> j) & 1
                column += 8
                p += 8
            while column < stop:
                out[r, column] = (bits[p >> 3] >> (p & 7)) & 1
                column += 1
                p += 1
        for c in range(column, width):
            out[r, c] = 1
    return -1


def _plain(array) -> np.ndarray:
    """The ndarray behind a memmap (numba takes plain arrays; no copy)."""
    return array if type(array) is np.ndarray else np.asarray(array)


_PREPARED: dict[tuple[int, int], tuple] = {}


def _prepared_gpt(indices, store) -> tuple:
    """Plain-array arguments of the GPT kernel, built once per (index, store) pair (the tuple
    holds both objects, so their ids stay theirs while the entry lives)."""
    key = (id(indices), id(store))
    entry = _PREPARED.get(key)
    if entry is None or entry[0] is not indices or entry[1] is not store:
        arrays = (_plain(store.tokens), _plain(store.sequence_pointers), np.int64(store.itemsize),
                  _plain(store.sequence_lengths), _plain(indices.document_index), _plain(indices.sample_index),
                  _plain(indices.shuffle_index))
        entry = (indices, store, arrays, np.int64(int(indices.plan.add_extra_token)))
        if len(_PREPARED) > 256:
            _PREPARED.clear()
        _PREPARED[key] = entry
    return entry


_NO_ENDS = np.zeros((1, 1), dtype=np.int32)
_NO_COUNTS = np.zeros(1, dtype=np.int32)


def _too_many_pieces(prefix: str, sample: int, capacity: int) -> InputError:
    return InputError(
        f"{prefix}: sample {sample} holds more than {capacity} document pieces, more than a row of its "
        f"length can list (megatron-core's cu_seqlens has seq_length + 1 entries): its window is mostly "
        "empty documents. megatron-core's GPTDataset fails on this sample too; drop the empty documents "
        "from the store (tokenloom tokenize writes none) or serve without inter_document_masking")


def gpt_rows_numba(indices, store, sample_ids: np.ndarray, pad_id: int, out: np.ndarray,
                   out_rows: np.ndarray, ends: np.ndarray | None = None, counts: np.ndarray | None = None) -> None:
    if getattr(store, "is_remote", False):  # remote: read_spans fetches a batch's blocks at once
        gpt_rows_numpy(indices, store, sample_ids, pad_id, out, out_rows, ends, counts)
        return
    _, _, arrays, extra = _prepared_gpt(indices, store)
    want = ends is not None
    bad = compiled(_gpt_rows_kernel)(*arrays, sample_ids, extra, np.int64(pad_id), out, out_rows, want,
                                     ends if want else _NO_ENDS, counts if want else _NO_COUNTS)
    if bad <= -2:
        raise _too_many_pieces(store.prefix, int(sample_ids[-2 - bad]), ends.shape[1])
    if bad >= 0:
        raise FormatError(f"{store.prefix}: sample {int(sample_ids[bad])} of the index runs outside its documents "
                          "or past seq_length; the index does not belong to this store")


def gpt_rows_numpy(indices, store, sample_ids: np.ndarray, pad_id: int, out: np.ndarray,
                   out_rows: np.ndarray, ends: np.ndarray | None = None, counts: np.ndarray | None = None) -> None:
    block = np.empty((sample_ids.shape[0], out.shape[1]), dtype=np.int64)
    pieces = _gpt_block_numpy(indices, store, sample_ids, pad_id, block)
    out[out_rows] = block
    if ends is not None:
        _piece_ends_numpy(store.prefix, sample_ids, *pieces, ends, counts, out_rows)


def _piece_ends_numpy(prefix: str, sample_ids: np.ndarray, bounds: np.ndarray, lengths: np.ndarray,
                      ends: np.ndarray, counts: np.ndarray, out_rows: np.ndarray) -> None:
    """``ends[out_rows[k]]``/``counts[out_rows[k]]`` of the pieces ``bounds[k]:bounds[k + 1]``."""
    per_row = np.diff(bounds)  # (B,) pieces of each row
    if per_row.size and per_row.max() > ends.shape[1]:
        raise _too_many_pieces(prefix, int(sample_ids[int(np.argmax(per_row > ends.shape[1]))]), ends.shape[1])
    row_of_piece = np.repeat(np.arange(per_row.shape[0]), per_row)  # (P,)
    cumulative = np.cumsum(lengths)  # (P,) tokens up to each piece's end, over all rows
    before_row = np.concatenate([[0], cumulative])[bounds[:-1]]  # (B,) tokens of the rows before
    column = np.arange(lengths.shape[0]) - bounds[:-1][row_of_piece]  # (P,) piece number in its row
    ends[out_rows[row_of_piece], column] = cumulative - before_row[row_of_piece]
    counts[out_rows] = per_row


def _gpt_block_numpy(indices, store, sample_ids: np.ndarray, pad_id: int,
                     out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Fill ``out`` (one row per sample) and return the pieces read: ``(bounds, lengths)``,
    sample ``k``'s pieces being ``lengths[bounds[k]:bounds[k + 1]]``."""
    num_rows, width = out.shape
    extra = int(indices.plan.add_extra_token)
    rows = indices.shuffle_index[sample_ids].astype(np.int64)  # (B,)
    begin = indices.sample_index[rows].astype(np.int64)  # (B, 2): position, offset
    end = indices.sample_index[rows + 1].astype(np.int64)  # (B, 2)
    num_parts = end[:, 0] - begin[:, 0] + 1  # (B,) documents each sample touches
    first_part = np.cumsum(num_parts) - num_parts  # (B,)
    sample_of_part = np.repeat(np.arange(num_rows), num_parts)  # (P,)
    position = begin[sample_of_part, 0] + (np.arange(sample_of_part.shape[0]) - first_part[sample_of_part])
    document = indices.document_index[position].astype(np.int64)  # (P,)
    offset = np.where(position == begin[sample_of_part, 0], begin[sample_of_part, 1], 0)  # (P,)
    stop = np.where(position == end[sample_of_part, 0], end[sample_of_part, 1] + extra,
                    store.sequence_lengths[document].astype(np.int64))  # (P,) exclusive
    lengths = stop - offset
    tokens = store.read_spans(document, offset, lengths)  # (sum(lengths),)
    per_row = np.bincount(sample_of_part, weights=lengths, minlength=num_rows).astype(np.int64)
    if (per_row > width).any():
        raise FormatError(f"{store.prefix}: a sample of the index runs past seq_length; the index does not "
                          "belong to this store")
    if (per_row == width).all():
        out[:] = tokens.reshape(num_rows, width)
    else:  # a short final sample (validation split kept by drop_last_partial=False)
        out[:] = pad_id
        row_of_token = np.repeat(np.arange(num_rows), per_row)
        column = np.arange(tokens.shape[0]) - np.repeat(np.cumsum(per_row) - per_row, per_row)
        out[row_of_token, column] = tokens
    return np.concatenate([[0], np.cumsum(num_parts)]), lengths


def span_rows_numba(store, spans, pad_id: int, out: np.ndarray, out_rows: np.ndarray,
                    ends: np.ndarray | None = None, counts: np.ndarray | None = None,
                    sample_ids: np.ndarray | None = None) -> None:
    if getattr(store, "is_remote", False):
        span_rows_numpy(store, spans, pad_id, out, out_rows, ends, counts, sample_ids)
        return
    want = ends is not None
    bad = compiled(_span_rows_kernel)(
        _plain(store.tokens), _plain(store.sequence_pointers), np.int64(store.itemsize), spans.bounds,
        spans.document_ids, spans.offsets, spans.lengths, np.int64(pad_id), out, out_rows, want,
        ends if want else _NO_ENDS, counts if want else _NO_COUNTS)
    if bad <= -2:
        k = -2 - bad
        raise _too_many_pieces(store.prefix, k if sample_ids is None else int(sample_ids[k]), ends.shape[1])
    if bad >= 0:
        raise FormatError(f"{store.prefix}: sample row {bad} has more tokens than seq_length + extra")


def span_rows_numpy(store, spans, pad_id: int, out: np.ndarray, out_rows: np.ndarray,
                    ends: np.ndarray | None = None, counts: np.ndarray | None = None,
                    sample_ids: np.ndarray | None = None) -> None:
    block = np.empty((out_rows.shape[0], out.shape[1]), dtype=np.int64)
    _span_block_numpy(store, spans, pad_id, block)
    out[out_rows] = block
    if ends is not None:
        named = np.arange(out_rows.shape[0]) if sample_ids is None else sample_ids
        _piece_ends_numpy(store.prefix, named, spans.bounds, spans.lengths, ends, counts, out_rows)


def _span_block_numpy(store, spans, pad_id: int, out: np.ndarray) -> None:
    tokens = store.read_spans(spans.document_ids, spans.offsets, spans.lengths)
    per_row = np.diff(spans.bounds)
    counts = np.add.reduceat(spans.lengths, spans.bounds[:-1]) if spans.lengths.size else np.zeros_like(per_row)
    counts = np.where(per_row > 0, counts, 0)
    if (counts == out.shape[1]).all():
        out[:] = tokens.reshape(out.shape)
        return
    out[:] = pad_id
    row_of_token = np.repeat(np.arange(out.shape[0]), counts)
    column = np.arange(tokens.shape[0]) - np.repeat(np.cumsum(counts) - counts, counts)
    out[row_of_token, column] = tokens


def mask_rows_numba(store, spans, out: np.ndarray, out_rows: np.ndarray) -> None:
    if getattr(store, "is_remote", False):
        mask_rows_numpy(store, spans, out, out_rows)
        return
    bad = compiled(_mask_rows_kernel)(
        _plain(store.loss_mask_bits), _plain(store.sequence_pointers), np.int64(store.itemsize), spans.bounds,
        spans.document_ids, spans.offsets, spans.lengths, out, out_rows)
    if bad >= 0:
        raise FormatError(f"{store.prefix}: sample row {bad} has more tokens than seq_length + extra")


def mask_rows_numpy(store, spans, out: np.ndarray, out_rows: np.ndarray) -> None:
    values = store.read_loss_mask_spans(spans.document_ids, spans.offsets, spans.lengths)  # (V,) uint8
    ends = np.zeros(spans.lengths.shape[0] + 1, dtype=np.int64)
    np.cumsum(spans.lengths, out=ends[1:])
    row_ends = ends[spans.bounds]  # (B + 1,) where each sample's values begin in ``values``
    totals = np.diff(row_ends)  # (B,) tokens of each sample's pieces
    if (totals > out.shape[1]).any():
        bad = int(np.flatnonzero(totals > out.shape[1])[0])
        raise FormatError(f"{store.prefix}: sample row {bad} has more tokens than seq_length + extra")
    out[out_rows] = 1
    row_of_value = np.repeat(np.arange(totals.shape[0]), totals)  # (V,)
    columns = np.arange(values.shape[0]) - row_ends[row_of_value]  # (V,)
    out[out_rows[row_of_value], columns] = values


class GatherKernels(NamedTuple):
    """One backend's gathers; both fill ``out[out_rows[k]]`` with sample ``k`` (int64 rows)."""

    gpt_rows: Callable[..., None]
    """``(indices, store, sample_ids, pad_id, out, out_rows, ends=None, counts=None)``: Megatron
    GPT index samples (and their document pieces when ``ends``/``counts`` are given)."""
    span_rows: Callable[..., None]
    """``(store, spans, pad_id, out, out_rows, ends=None, counts=None, sample_ids=None)``: the
    pieces of stateless samples (:class:`~tokenloom.index.stateless.SampleSpans`; ``sample_ids``
    only name a sample in an error)."""
    mask_rows: Callable[..., None]
    """``(store, spans, out, out_rows)``: the store's loss-mask bits of the pieces ``spans`` (any
    kind of index's :class:`~tokenloom.index.stateless.SampleSpans`) into uint8 rows, 1 on the
    padding after them."""


GATHER_BACKENDS: dict[str, GatherKernels] = {"numpy": GatherKernels(gpt_rows_numpy, span_rows_numpy,
                                                                   mask_rows_numpy)}
"""Backend name -> :class:`GatherKernels` (the backends that can run here); identical results."""
if numba_available():
    GATHER_BACKENDS["numba"] = GatherKernels(gpt_rows_numba, span_rows_numba, mask_rows_numba)


def default_backend() -> str:
    """"numba" when installed (it comes with tokenloom), else "numpy"."""
    return resolve_backend("auto", GATHER_BACKENDS, fallback="numpy")


def gather_kernels(backend: str | None = None) -> GatherKernels:
    """The gathers of ``backend``: a key of :data:`GATHER_BACKENDS`, or None/"auto" for
    :func:`default_backend`; an unknown or missing backend is a ConfigError."""
    return GATHER_BACKENDS[resolve_backend("auto" if backend is None else backend, GATHER_BACKENDS,
                                           fallback="numpy")]


__all__ = ["GATHER_BACKENDS", "GatherKernels", "default_backend", "gather_kernels"]
