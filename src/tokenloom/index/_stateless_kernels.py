"""The numba backend's kernels of :mod:`tokenloom.index.stateless`.

Plain Python, compiled by numba on first use (:func:`tokenloom.index.kernels.compiled`); they
call the Feistel kernels ``permute_into`` and ``_permute_numba``. Each has a numpy twin in
``stateless.py`` giving identical results; the tests compare them.
"""

from __future__ import annotations

import numpy as np

from tokenloom.index.feistel import _permute_numba, permute_into
from tokenloom.index.kernels import jit, prange


@jit(inline="always", cache=True)
def _length_of(d, lengths, ids, first_id, contiguous):
    if contiguous:
        return np.int64(lengths[first_id + d])
    return np.int64(lengths[ids[d]])


#: Documents per chunk of the build: the chunk's positions stay in L1/L2 between
#: the permutation and the adds (a larger chunk spills to memory between the two passes).
_CHUNK_DOCUMENTS = 1 << 12


@jit(cache=True, nogil=True)
def _epoch_block_sums(lengths, ids, first_id, contiguous, n, block_shift, bits, keys, out):
    """out[b] += tokens of positions [b*K, (b+1)*K) of one epoch (permutation keys ``keys``).

    Documents are read in order (streaming), a chunk of 4096 at a time: first the inverse
    permutation of the whole chunk (the network's multiply chains of many documents overlap,
    and cycle walking touches only the few still outside), then one pass that adds each length
    to its block, ``block = P_e^-1(d) >> log2(K)``: scattered adds into ``8 n / K`` bytes, which
    stay in cache while the split is small, instead of one random gather per position.
    """
    chunk = min(n, _CHUNK_DOCUMENTS)
    positions = np.empty(chunk, dtype=np.int64)
    buf = np.empty(chunk, dtype=np.uint64)
    slot = np.empty(chunk, dtype=np.int64)
    for first in range(0, n, chunk):
        count = min(chunk, n - first)
        permute_into(first, count, 1, n, bits, keys, True, buf, slot, positions)
        if contiguous:  # the common case, without a branch per document
            source = lengths[first_id + first:first_id + first + count]
            for k in range(count):
                out[positions[k] >> block_shift] += source[k]
        else:
            for k in range(count):
                out[positions[k] >> block_shift] += lengths[ids[first + k]]


@jit(cache=True, nogil=True)
def _block_sums_numba(lengths, ids, first_id, contiguous, n, block_shift, bits, epoch_keys, out):
    """out[e * num_blocks + b] += tokens of positions [b*K, (b+1)*K) of epoch e, epoch by epoch."""
    num_blocks = (n + (1 << block_shift) - 1) >> block_shift
    for e in range(epoch_keys.shape[0]):
        _epoch_block_sums(lengths, ids, first_id, contiguous, n, block_shift, bits, epoch_keys[e],
                          out[e * num_blocks:(e + 1) * num_blocks])


@jit(cache=True, nogil=True, parallel=True)
def _block_sums_by_epoch_numba(lengths, ids, first_id, contiguous, n, block_shift, bits, epoch_keys, out):
    """The same sums with one thread per epoch (epochs write disjoint sums: no races)."""
    num_blocks = (n + (1 << block_shift) - 1) >> block_shift
    for e in prange(epoch_keys.shape[0]):
        _epoch_block_sums(lengths, ids, first_id, contiguous, n, block_shift, bits, epoch_keys[e],
                          out[e * num_blocks:(e + 1) * num_blocks])


@jit(cache=True, nogil=True, parallel=True)
def _block_sums_parallel_numba(lengths, ids, first_id, contiguous, n, block_shift, bits, epoch_keys, out):
    """The same sums with threads: each task permutes a run of whole blocks of one epoch
    and gathers their lengths (random reads, but tasks write disjoint blocks: no races)."""
    num_blocks = (n + (1 << block_shift) - 1) >> block_shift
    blocks_per_task = max(1, _CHUNK_DOCUMENTS >> block_shift)
    tasks_per_epoch = (num_blocks + blocks_per_task - 1) // blocks_per_task
    width = blocks_per_task << block_shift
    for task in prange(epoch_keys.shape[0] * tasks_per_epoch):
        e = task // tasks_per_epoch
        b0 = (task - e * tasks_per_epoch) * blocks_per_task
        first = b0 << block_shift
        count = min(width, n - first)
        buf = np.empty(width, dtype=np.uint64)
        slot = np.empty(width, dtype=np.int64)
        documents = np.empty(width, dtype=np.int64)
        permute_into(first, count, 1, n, bits, epoch_keys[e], False, buf, slot, documents)
        base = e * num_blocks + b0
        if contiguous:
            source = lengths[first_id:first_id + n]
            for k in range(count):
                out[base + (k >> block_shift)] += source[documents[k]]
        else:
            for k in range(count):
                out[base + (k >> block_shift)] += lengths[ids[documents[k]]]


@jit(inline="always", cache=True)
def _last_block_before(starts, q):
    """Largest b with starts[b] < q (starts non-decreasing, starts[0] = 0 < q <= starts[-1]).

    Block starts grow almost linearly, so an interpolated guess and a galloping search
    around it touch a few cache lines instead of the ~log2(blocks) of a binary search.
    """
    last = starts.shape[0] - 1
    guess = np.int64(float(q) / float(starts[last]) * last)
    guess = min(max(guess, 0), last - 1)
    step = np.int64(1)
    if starts[guess] < q:  # gallop right: find hi with starts[hi] >= q
        lo = guess
        hi = min(guess + step, last)
        while starts[hi] < q:
            lo = hi
            step *= 2
            hi = min(hi + step, last)
    else:  # gallop left: find lo with starts[lo] < q
        hi = guess
        lo = max(guess - step, 0)
        while starts[lo] >= q:
            hi = lo
            step *= 2
            lo = max(lo - step, 0)
    while hi - lo > 1:  # invariant: starts[lo] < q <= starts[hi]
        mid = (lo + hi) // 2
        if starts[mid] < q:
            lo = mid
        else:
            hi = mid
    return lo


@jit(cache=True, nogil=True)
def _spans_pass1_numba(samples, seq_length, extra, first_token, starts, lengths, ids, first_id, contiguous,
                       n, block_size, bits, epoch_keys, out_begin, out_end):
    """Begin and end (position, offset) of each packed sample, as build_sample_idx records.

    Packed sample ``k`` starts at stream token ``t = first_token + k * seq_length``
    (``first_token`` is 0 but for a length run): its begin row is ``(0, 0)`` for ``t = 0``, else
    the position ``j`` with ``C_j < t + extra <= C_{j+1}`` and offset ``t - C_j``; its end row is
    the same rule at ``t + seq_length``. The block holding the begin row is found by an
    interpolated search; its documents are walked from whichever end of the block is nearer (8
    positions permuted at a time, so their lookups overlap); one cursor then walks on from the
    begin document to the one holding the end row, across blocks and epochs when it must.
    """
    num_blocks = (n + block_size - 1) // block_size
    batch = 8
    buf = np.empty(batch, dtype=np.uint64)
    slot = np.empty(batch, dtype=np.int64)
    perm = np.empty(batch, dtype=np.int64)
    for s in range(samples.shape[0]):
        k = samples[s]
        t = first_token + k * seq_length  # the stream token the sample starts at
        if t == 0:
            epoch = np.int64(0)
            p = np.int64(0)
            cum = np.int64(0)
            q = np.int64(0)
        else:
            q = t + extra
            beta = _last_block_before(starts, q)
            epoch = beta // num_blocks
            p = (beta - epoch * num_blocks) * block_size
            cum = starts[beta]
            if q - cum > starts[beta + 1] - q:  # nearer the block's end: walk down from it
                top = min(p + block_size, n)  # one past the block's last position
                cum = starts[beta + 1]  # tokens before position top
                while True:
                    low = max(p, top - batch)
                    permute_into(low, top - low, 1, n, bits, epoch_keys[epoch], False, buf, slot, perm)
                    c = top - low - 1
                    while c >= 0:
                        cum -= _length_of(perm[c], lengths, ids, first_id, contiguous)
                        if cum < q:
                            break
                        c -= 1
                    if c >= 0:
                        p = low + c  # C_p = cum < q <= C_{p+1}: the begin document
                        break
                    top = low
        filled = 0  # documents of perm[] computed, for positions p - idx ...
        idx = 0
        found_begin = t == 0
        q_end = t + seq_length + extra
        while True:
            if idx == filled:  # permute the next batch of positions of this epoch
                count = min(batch, n - p)
                permute_into(p, count, 1, n, bits, epoch_keys[epoch], False, buf, slot, perm)
                filled = count
                idx = 0
            length = _length_of(perm[idx], lengths, ids, first_id, contiguous)
            if not found_begin and cum + length >= q:
                found_begin = True
                out_begin[s, 0] = epoch * n + p
                out_begin[s, 1] = t - cum
            if found_begin and cum + length >= q_end:
                break
            cum += length
            idx += 1
            p += 1
            if p == n:  # next epoch
                epoch += 1
                p = 0
                filled = 0
                idx = 0
        if t == 0:
            out_begin[s, 0] = 0
            out_begin[s, 1] = 0
        out_end[s, 0] = epoch * n + p
        out_end[s, 1] = t + seq_length - cum


@jit(cache=True, nogil=True)
def _local_documents(positions, n, bits, epoch_keys, out):
    """out[t] = P_e(p) for global positions ``e * n + p``: the positions are grouped by epoch
    (a counting sort), and each epoch's are permuted in one batched call, so the network's
    multiply chains overlap."""
    num_epochs = epoch_keys.shape[0]
    total = positions.shape[0]
    starts = np.zeros(num_epochs + 1, dtype=np.int64)
    for t in range(total):
        starts[positions[t] // n + 1] += 1
    for e in range(num_epochs):
        starts[e + 1] += starts[e]
    cursor = starts[:-1].copy()
    local = np.empty(total, dtype=np.int64)  # epoch by epoch: position within the epoch
    where = np.empty(total, dtype=np.int64)  # and where its result goes
    for t in range(total):
        e = positions[t] // n
        local[cursor[e]] = positions[t] - e * n
        where[cursor[e]] = t
        cursor[e] += 1
    for e in range(num_epochs):
        if starts[e + 1] > starts[e]:
            documents = _permute_numba(local[starts[e]:starts[e + 1]], n, bits, epoch_keys[e], False)
            for j in range(documents.shape[0]):
                out[where[starts[e] + j]] = documents[j]


@jit(cache=True, nogil=True)
def _pieces_numba(begin, end, bounds, extra, lengths, ids, first_id, contiguous, n, bits, epoch_keys,
                  out_docs, out_offsets, out_lengths, out_positions):
    """Fill the CSR pieces of each sample from its begin and end rows.

    In passes over all pieces rather than sample by sample: positions, then their documents
    (batched permutations), then lengths (independent reads, whose cache misses overlap),
    then each sample's first and last piece cut to its offsets."""
    for s in range(begin.shape[0]):
        t = bounds[s]
        for position in range(begin[s, 0], end[s, 0] + 1):
            out_positions[t] = position
            t += 1
    _local_documents(out_positions, n, bits, epoch_keys, out_docs)
    for t in range(out_docs.shape[0]):
        d = out_docs[t]
        out_lengths[t] = _length_of(d, lengths, ids, first_id, contiguous)
        out_docs[t] = first_id + d if contiguous else np.int64(ids[d])
        out_offsets[t] = 0
    for s in range(begin.shape[0]):
        first_piece = bounds[s]
        last_piece = bounds[s + 1] - 1
        out_offsets[first_piece] = begin[s, 1]
        out_lengths[last_piece] = end[s, 1] + extra  # the last piece ends at the end offset (+ extra)
        out_lengths[first_piece] -= begin[s, 1]


@jit(cache=True, nogil=True)
def _is_consecutive_numba(ids):
    for t in range(1, ids.shape[0]):  # noqa: SIM110 (numba compiles no generator inside all())
        if ids[t] != ids[t - 1] + 1:
            return False
    return True


@jit(cache=True, nogil=True)
def _docs_at_numba(positions, ids, first_id, contiguous, n, bits, epoch_keys, out):
    _local_documents(positions, n, bits, epoch_keys, out)
    for t in range(positions.shape[0]):
        out[t] = first_id + out[t] if contiguous else np.int64(ids[out[t]])


@jit(cache=True, nogil=True)
def _shuffle_two_parts_numba(ids, split_at, bits_low, keys_low, size_high, bits_high, keys_high):
    """Sample shuffle with a separate final epoch: ids below ``split_at`` through the first
    permutation, the rest through the second (shifted by ``split_at``), in one call."""
    out = np.empty_like(ids)
    local = np.empty(ids.shape[0], dtype=np.int64)
    where = np.empty(ids.shape[0], dtype=np.int64)
    for high in (False, True):
        offset = split_at if high else 0
        m = 0
        for t in range(ids.shape[0]):
            if (ids[t] >= split_at) == high:
                local[m] = ids[t] - offset
                where[m] = t
                m += 1
        if m == 0:
            continue
        if high:
            shuffled = _permute_numba(local[:m], size_high, bits_high, keys_high, False)
        else:
            shuffled = _permute_numba(local[:m], split_at, bits_low, keys_low, False)
        for j in range(m):
            out[where[j]] = offset + shuffled[j]
    return out


@jit(cache=True, nogil=True)
def _spans_numba(samples, seq_length, extra, first_token, starts, lengths, ids, first_id, contiguous, n,
                 block_size, bits, epoch_keys):
    """Both passes in one call (a handful of samples per call is the serving case, where the
    calls' overhead outweighs the work): ``(bounds, document ids, offsets, lengths, positions)``."""
    m = samples.shape[0]
    begin = np.empty((m, 2), dtype=np.int64)
    end = np.empty((m, 2), dtype=np.int64)
    _spans_pass1_numba(samples, seq_length, extra, first_token, starts, lengths, ids, first_id, contiguous, n,
                       block_size, bits, epoch_keys, begin, end)
    bounds = np.zeros(m + 1, dtype=np.int64)
    for s in range(m):  # pieces per sample, summed
        bounds[s + 1] = bounds[s] + end[s, 0] - begin[s, 0] + 1
    total = bounds[m]
    docs = np.empty(total, dtype=np.int64)
    offsets = np.empty(total, dtype=np.int64)
    pieces = np.empty(total, dtype=np.int64)
    positions = np.empty(total, dtype=np.int64)
    _pieces_numba(begin, end, bounds, extra, lengths, ids, first_id, contiguous, n, bits, epoch_keys,
                  docs, offsets, pieces, positions)
    return bounds, docs, offsets, pieces, positions
