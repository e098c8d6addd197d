"""Best-fit decreasing packing: whole documents into samples, padded, almost never cut.

Concatenate-and-chunk (Megatron's samples, and tokenloom's exact and stateless kinds) cuts most
documents at a sample edge. Packing keeps them whole: a sample of ``capacity`` tokens
(``seq_length + 1``, the extra token for the shifted labels) takes whole documents, and what no
document fills is padding.

The rule, per window of ``window`` consecutive documents (in the order given: the best-fit
index's seeded order of a split, :mod:`tokenloom.index.best_fit_index`), so that windows are
independent and a build can divide them over ranks:

1. A document longer than a sample is cut into ``capacity``-token pieces, each a sample of its
   own, in document order; its remainder (``length % capacity`` tokens, its last ones) is packed
   like any document. A document whose length is a multiple of ``capacity`` has no remainder;
   an empty one has no piece at all.
2. The remainders, longest first (ties: the earlier document first), each go to the open sample
   with the least room that still holds it (best fit), ties to the sample that most recently
   reached that room; a remainder no open sample holds opens a new one.
3. The window's samples follow its cut pieces, in the order they were opened; inside a sample
   the pieces are in the order they were placed.

Best fit is found in ``O(capacity / 4096 + 1)`` word reads per remainder: a bitmap of the room
values some open sample has (and a summary bitmap over its words), with a stack of samples per
room value. A window packs in ``O(window log window)`` for the sort.

The result is a piece list (document, first token, length) and each sample's range of pieces;
shuffling the samples and reading them are the caller's.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tokenloom.errors import ConfigError
from tokenloom.index.kernels import compiled, jit, numba_available
from tokenloom.validate import is_integer

__all__ = ["BestFitPacking", "pack_best_fit"]


@dataclasses.dataclass(frozen=True)
class BestFitPacking:
    """Samples of whole documents (see the module docstring for the rule)."""

    documents: np.ndarray
    """(P,) int64: each piece's document, as an index into the lengths that were packed."""
    begins: np.ndarray
    """(P,) int64: the piece's first token within its document."""
    lengths: np.ndarray
    """(P,) int64: the piece's tokens (at least 1)."""
    offsets: np.ndarray
    """(S + 1,) int64: sample ``s`` holds pieces ``offsets[s]:offsets[s + 1]``."""
    capacity: int
    """Tokens a sample holds (``seq_length + 1``)."""

    @property
    def num_samples(self) -> int:
        return int(self.offsets.shape[0] - 1)

    @property
    def num_tokens(self) -> int:
        """Document tokens in the samples (padding left out)."""
        return int(self.lengths.sum())

    @property
    def padding_fraction(self) -> float:
        """The share of the samples' tokens that is padding."""
        total = self.num_samples * self.capacity
        return 1.0 - self.num_tokens / total if total else 0.0

    @property
    def cut_documents(self) -> int:
        """Documents spread over more than one sample."""
        pieces = np.bincount(self.documents) if self.documents.size else np.zeros(0, np.int64)
        return int((pieces > 1).sum())

    def sample_lengths(self) -> np.ndarray:
        """(S,) int64: the document tokens of each sample."""
        ends = np.concatenate([[0], np.cumsum(self.lengths)])
        return ends[self.offsets[1:]] - ends[self.offsets[:-1]]


def pack_best_fit(lengths: np.ndarray, capacity: int, *, window: int, backend: str = "auto") -> BestFitPacking:
    """Pack documents of ``lengths`` into samples of ``capacity`` tokens, best fit decreasing
    within each window of ``window`` documents (module docstring).

    ``backend``: ``"auto"`` (numba where installed), ``"numba"`` or ``"python"`` (the same
    kernel run by the interpreter: slow, for platforms without numba)."""
    if not is_integer(capacity) or capacity < 2:
        raise ConfigError(f"capacity {capacity!r}, expected an int >= 2 (seq_length + 1)")
    if not is_integer(window) or window < 1:
        raise ConfigError(f"window {window!r}, expected a positive number of documents")
    if backend not in ("auto", "numba", "python"):
        raise ConfigError(f"backend {backend!r}, expected 'auto', 'numba' or 'python'")
    lengths = np.ascontiguousarray(lengths, dtype=np.int64)
    if lengths.ndim != 1:
        raise ConfigError(f"lengths of shape {lengths.shape}, expected one length per document")
    if lengths.size and int(lengths.min()) < 0:
        raise ConfigError(f"document {int(np.argmin(lengths))} has length {int(lengths.min())}, expected >= 0")
    capacity, window = int(capacity), int(window)
    num_pieces = int((lengths // capacity).sum() + np.count_nonzero(lengths % capacity))
    documents = np.empty(num_pieces, dtype=np.int64)
    begins = np.empty(num_pieces, dtype=np.int64)
    piece_lengths = np.empty(num_pieces, dtype=np.int64)
    offsets = np.empty(num_pieces + 1, dtype=np.int64)  # at most one sample per piece
    kernel = _pack_kernel
    if backend == "numba" or (backend == "auto" and numba_available()):
        kernel = compiled(_pack_kernel)
    num_samples = kernel(lengths, np.int64(capacity), np.int64(min(window, max(lengths.size, 1))),
                         documents, begins, piece_lengths, offsets)
    return BestFitPacking(documents=documents, begins=begins, lengths=piece_lengths,
                          offsets=offsets[:num_samples + 1].copy(), capacity=capacity)


@jit(cache=True, nogil=True)
def _lowest_bit(word):
    """Index of the lowest set bit of a nonzero uint64."""
    index = 0
    for shift in (32, 16, 8, 4, 2, 1):
        low = word & ((np.uint64(1) << np.uint64(shift)) - np.uint64(1))
        if low == np.uint64(0):
            word = word >> np.uint64(shift)
            index += shift
    return index


@jit(cache=True, nogil=True)
def _set_room(bits, summary, room, on):
    """Mark whether some open sample has ``room`` free tokens."""
    word = room >> 6
    bit = np.uint64(1) << np.uint64(room & 63)
    if on:
        bits[word] |= bit
        summary[word >> 6] |= np.uint64(1) << np.uint64(word & 63)
    else:
        bits[word] &= ~bit
        if bits[word] == np.uint64(0):
            summary[word >> 6] &= ~(np.uint64(1) << np.uint64(word & 63))


@jit(cache=True, nogil=True)
def _least_room_at_least(bits, summary, need):
    """The least room value >= ``need`` some open sample has, or -1."""
    word = need >> 6
    if word >= bits.shape[0]:
        return -1
    masked = bits[word] & ~((np.uint64(1) << np.uint64(need & 63)) - np.uint64(1))
    if masked != np.uint64(0):
        return (word << 6) + _lowest_bit(masked)
    group = (word + 1) >> 6  # the summary word holding word + 1, masked below it
    if group >= summary.shape[0]:
        return -1
    masked = summary[group] & ~((np.uint64(1) << np.uint64((word + 1) & 63)) - np.uint64(1))
    while masked == np.uint64(0):
        group += 1
        if group >= summary.shape[0]:
            return -1
        masked = summary[group]
    word = (group << 6) + _lowest_bit(masked)
    return (word << 6) + _lowest_bit(bits[word])


@jit(cache=True, nogil=True)
def _pack_kernel(lengths, capacity, window, documents, begins, piece_lengths, offsets):
    """Write the pieces and sample offsets of the module's rule; returns the number of samples."""
    words = (capacity >> 6) + 1  # bit r of the room bitmap: some open sample has r tokens free
    bits = np.zeros(words, dtype=np.uint64)
    summary = np.zeros((words >> 6) + 1, dtype=np.uint64)
    newest = np.full(capacity + 1, -1, dtype=np.int64)  # room -> the open sample that reached it last
    below = np.empty(window, dtype=np.int64)  # sample -> the next one down its room's stack
    room = np.empty(window, dtype=np.int64)
    first = np.empty(window, dtype=np.int64)  # sample -> its first and last piece (window positions)
    last = np.empty(window, dtype=np.int64)
    following = np.empty(window, dtype=np.int64)  # piece -> the next piece of its sample, or -1
    remainder = np.empty(window, dtype=np.int64)
    n = lengths.shape[0]
    pieces = 0
    samples = 0
    offsets[0] = 0
    for start in range(0, n, window):
        stop = min(n, start + window)
        for d in range(start, stop):  # the cut pieces of long documents: a sample each
            for k in range(lengths[d] // capacity):
                documents[pieces] = d
                begins[pieces] = k * capacity
                piece_lengths[pieces] = capacity
                pieces += 1
                samples += 1
                offsets[samples] = pieces
            remainder[d - start] = lengths[d] % capacity
        order = np.argsort(-remainder[:stop - start], kind="mergesort")  # longest first, stable
        opened = 0
        for i in order:
            need = remainder[i]
            if need == 0:
                break
            fit = _least_room_at_least(bits, summary, need)
            if fit < 0:
                s = opened
                opened += 1
                room[s] = capacity
                first[s] = i
            else:
                s = newest[fit]
                newest[fit] = below[s]
                if below[s] < 0:
                    _set_room(bits, summary, fit, False)
                following[last[s]] = i
            last[s] = i
            following[i] = -1
            room[s] -= need
            if room[s] > 0:
                below[s] = newest[room[s]]
                if below[s] < 0:
                    _set_room(bits, summary, room[s], True)
                newest[room[s]] = s
        for s in range(opened):
            i = first[s]
            while i >= 0:
                documents[pieces] = start + i
                begins[pieces] = lengths[start + i] - remainder[i]
                piece_lengths[pieces] = remainder[i]
                pieces += 1
                i = following[i]
            samples += 1
            offsets[samples] = pieces
            if room[s] > 0 and newest[room[s]] >= 0:  # empty the stacks for the next window
                newest[room[s]] = -1
                _set_room(bits, summary, room[s], False)
    return samples
