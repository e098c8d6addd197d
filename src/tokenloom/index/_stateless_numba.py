"""Compiled (numba) kernels of :mod:`tokenloom.index.stateless`; imported only with numba.

Each has a numpy twin in ``stateless.py`` giving identical results; the tests compare them.
"""

from __future__ import annotations

import numba
import numpy as np

from tokenloom.index.feistel import _network_batch, permute_into


@numba.njit(inline="always")
def _length_of(d, lengths, ids, first_id, contiguous):
    if contiguous:
        return np.int64(lengths[first_id + d])
    return np.int64(lengths[ids[d]])


@numba.njit(cache=True, nogil=True)
def _block_sums_numba(lengths, ids, first_id, contiguous, n, block_shift, bits, epoch_keys, out):
    """out[e * num_blocks + b] += tokens of positions [b*K, (b+1)*K) of epoch e.

    Documents are read in order (streaming) and sent to their block through the inverse
    permutation, ``block = P_e^-1(d) >> log2(K)``: the scattered adds land in an array of
    ``8 n / K`` bytes (in cache while it is small), instead of one random gather per position.
    Branch-free walk: values still outside ``[0, n)`` add their length to a spare last slot,
    which the caller drops.
    """
    num_blocks = (n + (1 << block_shift) - 1) >> block_shift
    width = 4096
    buf = np.empty(width, dtype=np.uint64)
    doc = np.empty(width, dtype=np.int64)
    length = np.empty(width, dtype=np.int64)
    limit = np.uint64(n)
    shift = np.uint64(block_shift)
    spare = np.int64(epoch_keys.shape[0] * num_blocks)  # out has one slot more
    for e in range(epoch_keys.shape[0]):
        keys = epoch_keys[e]
        base = e * num_blocks
        for first in range(0, n, width):
            count = min(width, n - first)
            for k in range(count):
                buf[k] = np.uint64(first + k)
                doc[k] = first + k
                length[k] = _length_of(first + k, lengths, ids, first_id, contiguous)
            active = count
            while active > 0:
                _network_batch(buf, active, bits, keys, True)
                kept = 0
                for j in range(active):
                    value = buf[j]
                    outside = value >= limit
                    target = spare if outside else base + np.int64(value >> shift)
                    out[target] += length[j]
                    buf[kept] = value
                    doc[kept] = doc[j]
                    length[kept] = length[j]
                    kept += np.int64(outside)
                active = kept


@numba.njit(cache=True, nogil=True, parallel=True)
def _block_sums_parallel_numba(lengths, ids, first_id, contiguous, n, block_shift, bits, epoch_keys, out):
    """The same sums with threads: each task permutes a run of whole blocks of one epoch
    and gathers their lengths (random reads, but tasks write disjoint blocks: no races)."""
    num_blocks = (n + (1 << block_shift) - 1) >> block_shift
    blocks_per_task = max(1, 4096 >> block_shift)
    tasks_per_epoch = (num_blocks + blocks_per_task - 1) // blocks_per_task
    width = blocks_per_task << block_shift
    for task in numba.prange(epoch_keys.shape[0] * tasks_per_epoch):
        e = task // tasks_per_epoch
        b0 = (task - e * tasks_per_epoch) * blocks_per_task
        first = b0 << block_shift
        count = min(width, n - first)
        buf = np.empty(width, dtype=np.uint64)
        slot = np.empty(width, dtype=np.int64)
        perm = np.empty(width, dtype=np.int64)
        permute_into(first, count, 1, n, bits, epoch_keys[e], False, buf, slot, perm)
        base = e * num_blocks + b0
        for k in range(count):
            out[base + (k >> block_shift)] += _length_of(perm[k], lengths, ids, first_id, contiguous)


@numba.njit(inline="always")
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


@numba.njit(cache=True, nogil=True)
def _spans_pass1_numba(samples, seq_length, extra, starts, lengths, ids, first_id, contiguous,
                       n, block_size, bits, epoch_keys, out_begin, out_end):
    """Begin and end (position, offset) of each packed sample, as build_sample_idx records.

    The block holding the begin row is found by an interpolated search; its documents are
    walked from whichever end of the block is nearer (8 positions permuted at a time, so
    their lookups overlap); one cursor then walks on from the begin document to the one
    holding the end row, across blocks and epochs when it must.
    """
    num_blocks = (n + block_size - 1) // block_size
    batch = 8
    buf = np.empty(batch, dtype=np.uint64)
    slot = np.empty(batch, dtype=np.int64)
    perm = np.empty(batch, dtype=np.int64)
    for s in range(samples.shape[0]):
        k = samples[s]
        if k == 0:
            epoch = np.int64(0)
            p = np.int64(0)
            cum = np.int64(0)
            q = np.int64(0)
        else:
            q = k * seq_length + extra
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
        found_begin = k == 0
        q_end = (k + 1) * seq_length + extra
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
                out_begin[s, 1] = k * seq_length - cum
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
        if k == 0:
            out_begin[s, 0] = 0
            out_begin[s, 1] = 0
        out_end[s, 0] = epoch * n + p
        out_end[s, 1] = (k + 1) * seq_length - cum


@numba.njit(cache=True, nogil=True)
def _pieces_numba(begin, end, bounds, extra, lengths, ids, first_id, contiguous, n, bits, epoch_keys,
                  out_docs, out_offsets, out_lengths, out_positions):
    """Fill the CSR pieces of each sample from its begin and end rows."""
    batch = 8
    buf = np.empty(batch, dtype=np.uint64)
    slot = np.empty(batch, dtype=np.int64)
    perm = np.empty(batch, dtype=np.int64)
    for s in range(begin.shape[0]):
        t = bounds[s]
        position = begin[s, 0]
        last = end[s, 0]
        while position <= last:  # permute the run of positions batch by batch, epoch by epoch
            epoch = position // n
            p = position - epoch * n
            count = min(batch, n - p, last - position + 1)
            permute_into(p, count, 1, n, bits, epoch_keys[epoch], False, buf, slot, perm)
            for c in range(count):
                d = perm[c]
                out_docs[t] = first_id + d if contiguous else np.int64(ids[d])
                out_lengths[t] = _length_of(d, lengths, ids, first_id, contiguous)
                out_offsets[t] = 0
                out_positions[t] = position
                t += 1
                position += 1
        first_piece = bounds[s]
        out_offsets[first_piece] = begin[s, 1]
        out_lengths[t - 1] = end[s, 1] + extra  # the last piece ends at the end offset (+ extra)
        out_lengths[first_piece] -= begin[s, 1]


@numba.njit(cache=True, nogil=True)
def _is_consecutive_numba(ids):
    for t in range(1, ids.shape[0]):
        if ids[t] != ids[t - 1] + 1:
            return False
    return True


@numba.njit(cache=True, nogil=True)
def _docs_at_numba(positions, ids, first_id, contiguous, n, bits, epoch_keys, out):
    one_buf = np.empty(1, dtype=np.uint64)
    one_slot = np.empty(1, dtype=np.int64)
    one = np.empty(1, dtype=np.int64)
    for t in range(positions.shape[0]):
        epoch = positions[t] // n
        permute_into(positions[t] - epoch * n, 1, 1, n, bits, epoch_keys[epoch], False,
                     one_buf, one_slot, one)
        out[t] = first_id + one[0] if contiguous else np.int64(ids[one[0]])
