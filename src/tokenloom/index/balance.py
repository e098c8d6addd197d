"""Balanced ranks: a global batch's samples placed on (data-parallel rank, micro-batch) slots.

With document masking a sample's attention work grows with the squares of its documents'
lengths, so the same number of samples is not the same work: a rank that drew one-document
samples waits for nobody, and every other rank waits for it at the gradient all-reduce. Every
rank knows the whole global batch from the index before reading a token, so each one computes
the same placement from the batch's document lengths alone, with no collective, and reads only
its own samples. The set of samples of the batch does not change, only where each one goes.

**The cost of a sample** (:class:`CostModel`) is ``a * sum_documents L(L+1)/2 + b * tokens``,
counted in FLOPs of one transformer layer's forward pass. The documents are the ones the
attention kernel sees, the segments of megatron-core's ``cu_seqlens``
(:func:`served_document_pairs` follows ``tokenloom.serve.samples.document_fields``' rule: the
pieces the index cut the sample from, the extra token off the last one, a short sample's
padding joined to its last document). A causal kernel computes, for a document of ``L`` tokens,
``L(L+1)/2`` query-key pairs, each a dot product for the score and a weighted sum of values
over the head width: ``2 d + 2 d = 4 d`` FLOPs at model width ``d``, so ``a = 4 d``. Each token
also passes the dense layers: the query, key, value and output projections, ``2 d (2 d + 2
d_kv)`` FLOPs (``d_kv = d`` without grouped-query attention), and the MLP, ``2 d f`` per matrix
(two matrices, three when gated), so ``b = 8 d^2 + 4 d f`` for the classic ``f = 4 d`` MLP, i.e.
``24 d^2``. The backward pass costs about twice the forward for both terms (FlashAttention's
backward recomputes the scores, a little more), so the ratio ``a / b = 1 / (6 d)`` holds for the
step. At ``d = 4096`` (the default, :data:`DEFAULT_HIDDEN_SIZE`: Llama-2-7B's width) attention
equals the dense work of a document at ``L = 12 d``, about 49k tokens: it is a sixth of the
work of one 8k-token document, and half of a 24k one, which is why balance matters more as
sequences grow. ``tokens`` is the sample's input width ``S``: every column passes the dense
layers, padding included.

Balancing by ``"tokens"`` (for samples served without document boundaries, whose attention
is the same full ``S x S`` triangle for all) counts instead each sample's real tokens: the input
columns holding a token, padding excluded (a best-fit sample's padding is what differs).

**The assignment** (:func:`assign_slots`) is LPT (longest processing time first) in rounds,
then pairwise swaps (until the heaviest load is within 0.1% of the lower bound), twice: over
the data-parallel ranks, then over each rank's micro-batches (pipeline bubbles follow the
slowest micro-batch). Every rank holds exactly ``G / dp`` samples
and every micro-batch exactly ``micro`` of them, so the partition is one with equal
cardinalities. LPT in rounds keeps that by construction: the samples, costliest first, are
dealt ``dp`` at a time, the costliest of a round to the rank with the least load so far, so a
round changes the gap between two ranks by at most the spread of that round's costs. Then the
heaviest rank swaps one sample for a cheaper one of another rank while that lowers the pair's
larger load, the best swap first. Karmarkar-Karp's differencing is the better heuristic for two
sets, but its k-way form with equal cardinalities merges whole k-tuples per step and gains
little when each rank holds several samples, where the swaps close most of what LPT leaves;
this costs ``O(G log G)`` plus one ``(G/dp) x G`` comparison per swap, in one compiled kernel
(numba through :mod:`tokenloom.index.kernels`; the same function interpreted without it), which
places one step or, given ``(steps, G)`` costs, several in one call. Its sorts are its own
(:func:`_stable_argsort`): numba's stable argsort and its sort of a row view cost far more than
the placement around them, and a stable order is one order, so the placement is the same.

It is a pure function of the costs in stream order and the layout: ties go by cost, then by
stream order, then by the lowest rank, so every rank computes the same placement, and the loads
it gives do not depend on the order the samples are listed in. The rank sets it finds are kept
only when their costliest rank costs strictly less than the unbalanced order's (Megatron's:
rank ``r`` of micro-step ``m`` reads offsets ``m micro dp + r micro + [0, micro)``), and the
micro-batches likewise against the rank's samples in stream order: balancing is never worse
than not balancing, and where it gains nothing (all costs equal) the order stays Megatron's.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tokenloom.errors import ConfigError
from tokenloom.index.kernels import compiled, jit, numba_available
from tokenloom.validate import is_integer

__all__ = ["BALANCES", "DEFAULT_HIDDEN_SIZE", "CostModel", "assign_slots", "megatron_sample_costs",
           "served_document_pairs", "served_real_tokens", "slot_costs"]

BALANCES = ("attention", "tokens")
"""What a balance evens out: ``"attention"``, the cost model over the documents; ``"tokens"``,
the real tokens (for samples served without document boundaries)."""

DEFAULT_HIDDEN_SIZE = 4096
"""The model width of the default cost model (Llama-2-7B's, MHA, ``f = 4d``)."""

_SWAPS_PER_LEVEL = 256
"""Most swaps one level of the assignment makes: each lowers the heaviest load, and LPT leaves
few worth making; the cap bounds the cost of a batch of many equal costs."""

_CLOSE_ENOUGH = 1000
"""Swaps stop once the heaviest load is within 1/1000 of the lower bound (the mean load, or the
costliest sample): what is left to gain is below any step time's noise, and on a batch of
near-equal loads each swap would gain only that, one at a time."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class CostModel:
    """``attention * sum_documents L(L+1)/2 + tokens * S``: one sample's work, in integer units
    (FLOPs of one layer's forward pass by default; only the ratio matters). Integers, so that
    every rank adds loads exactly and computes the same placement on any machine."""

    attention: int
    """``a``: cost of one query-key pair inside a document (``4 d`` FLOPs at width ``d``)."""
    tokens: int
    """``b``: cost of one token through the dense layers (``8 d^2 + 4 d f`` FLOPs)."""

    def __post_init__(self) -> None:
        for name in ("attention", "tokens"):
            value = getattr(self, name)
            if not is_integer(value) or value < 0:
                raise ConfigError(f"CostModel.{name}={value!r}; expected a non-negative integer (FLOPs, or any "
                                  "unit: only the ratio attention / tokens matters)")
            object.__setattr__(self, name, int(value))
        if self.attention == 0 and self.tokens == 0:
            raise ConfigError("CostModel(attention=0, tokens=0); expected at least one positive weight")

    @classmethod
    def for_width(cls, hidden_size: int = DEFAULT_HIDDEN_SIZE, *, ffn_hidden_size: int | None = None,
                  kv_channels_total: int | None = None, gated: bool = False) -> CostModel:
        """The FLOPs of one layer's forward pass (module docstring): ``a = 4 d``, ``b = 2 d (2 d +
        2 d_kv) + 2 d f m`` with ``m`` = 2 matrices (3 when ``gated``), ``f`` =
        ``ffn_hidden_size`` (default ``4 d``), ``d_kv`` = ``kv_channels_total`` (key/value
        heads x head width; default ``d``)."""
        for name, value in (("hidden_size", hidden_size), ("ffn_hidden_size", ffn_hidden_size),
                            ("kv_channels_total", kv_channels_total)):
            if value is not None and (not is_integer(value) or value < 1):
                raise ConfigError(f"CostModel.for_width {name}={value!r}; expected a positive integer")
        d = int(hidden_size)
        f = 4 * d if ffn_hidden_size is None else int(ffn_hidden_size)
        kv = d if kv_channels_total is None else int(kv_channels_total)
        return cls(attention=4 * d, tokens=2 * d * (2 * d + 2 * kv) + 2 * d * f * (3 if gated else 2))

    def sample_costs(self, pairs: np.ndarray, widths: np.ndarray) -> np.ndarray:
        """(B,) int64 costs of samples with ``pairs`` query-key pairs and ``widths`` input tokens
        (ConfigError where a sum would overflow int64: a model and sequence far beyond today's)."""
        pairs = np.asarray(pairs, dtype=np.int64)
        widths = np.asarray(widths, dtype=np.int64)
        if pairs.size and (int(pairs.max()) * self.attention + int(widths.max()) * self.tokens) * pairs.size >= 2**62:
            raise ConfigError(f"{self} on {pairs.size} samples of up to {int(widths.max())} tokens overflows int64 "
                              "loads; give a CostModel in coarser units (divide both weights)")
        return pairs * self.attention + widths * self.tokens


def served_document_pairs(lengths: np.ndarray, bounds: np.ndarray, seq_lengths, add_extra_token: bool
                          ) -> np.ndarray:
    """(B,) int64: ``sum L(L+1)/2`` over the documents of each sample as served with document
    boundaries, from its pieces (``lengths[bounds[k]:bounds[k + 1]]``, the index's
    ``SampleSpans``, at least one per sample) and its input width ``seq_lengths`` (scalar or
    ``(B,)``): megatron-core's ``cu_seqlens`` segments, the extra token off the last piece (a
    last piece of only the extra token dropped), the last document running to ``S``."""
    lengths = np.asarray(lengths, dtype=np.int64)  # (P,)
    bounds = np.asarray(bounds, dtype=np.int64)  # (B + 1,)
    batch = bounds.shape[0] - 1
    seq = np.broadcast_to(np.asarray(seq_lengths, dtype=np.int64), (batch,))
    counts = np.diff(bounds)  # (B,) pieces
    if batch and int(counts.min()) < 1:
        raise ConfigError("served_document_pairs: a sample with no piece; expected at least one per sample")
    last = bounds[1:] - 1  # (B,) index of each sample's last piece
    n = counts.copy()
    if add_extra_token:  # a last piece that held only the extra token is no document
        n -= (counts >= 2) & (lengths[last] == 1)
    # pieces before the (kept) last one are documents as they are; the last runs to S
    index_in_sample = np.arange(lengths.shape[0]) - np.repeat(bounds[:-1], counts)  # (P,)
    inner = index_in_sample < np.repeat(n - 1, counts)  # (P,)
    inner_lengths = np.where(inner, lengths, 0)
    inner_pairs = np.concatenate([[0], np.cumsum(inner_lengths * (inner_lengths + 1) // 2)])
    inner_tokens = np.concatenate([[0], np.cumsum(inner_lengths)])
    tail = np.maximum(seq - (inner_tokens[bounds[1:]] - inner_tokens[bounds[:-1]]), 0)  # (B,)
    return inner_pairs[bounds[1:]] - inner_pairs[bounds[:-1]] + tail * (tail + 1) // 2


def served_real_tokens(lengths: np.ndarray, bounds: np.ndarray, seq_lengths) -> np.ndarray:
    """(B,) int64: input columns of each sample holding a token (its pieces' tokens, at most
    ``S``; the rest is padding)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    bounds = np.asarray(bounds, dtype=np.int64)
    total = np.concatenate([[0], np.cumsum(lengths)])
    return np.minimum(total[bounds[1:]] - total[bounds[:-1]], np.asarray(seq_lengths, dtype=np.int64))


@jit(cache=True, nogil=True)
def _megatron_costs_kernel(shuffle_index, sample_index, document_index, sequence_lengths, sample_ids, extra, seq,
                           add_extra_token, tokens, out):
    """Per sample of ``sample_ids``: its pieces walked straight from megatron-core's arrays (the
    rule of ``MegatronReader.spans``) and summed as :func:`served_document_pairs` (``tokens``
    False) or :func:`served_real_tokens` (True) sums them, into ``out``."""
    for k in range(sample_ids.shape[0]):
        row = np.int64(shuffle_index[sample_ids[k]])
        first, offset = np.int64(sample_index[row, 0]), np.int64(sample_index[row, 1])
        last, stop = np.int64(sample_index[row + 1, 0]), np.int64(sample_index[row + 1, 1]) + extra
        count = last - first + 1
        if tokens:
            total = np.int64(0)
            for p in range(first, last + 1):
                begin = offset if p == first else 0
                end = stop if p == last else np.int64(sequence_lengths[document_index[p]])
                total += end - begin
            out[k] = min(total, seq)
            continue
        kept = count  # the pieces that are documents: a last one of only the extra token is not
        if add_extra_token and count >= 2:
            begin = offset if last == first else 0
            if stop - begin == 1:
                kept -= 1
        pairs, inner = np.int64(0), np.int64(0)
        for p in range(first, first + kept - 1):  # all but the last kept piece, as they are
            begin = offset if p == first else 0
            end = stop if p == last else np.int64(sequence_lengths[document_index[p]])
            length = end - begin
            pairs += length * (length + 1) // 2
            inner += length
        tail = max(seq - inner, 0)  # the last document runs to S
        out[k] = pairs + tail * (tail + 1) // 2


def megatron_sample_costs(indices, sequence_lengths, sample_ids, seq_length: int, add_extra_token: bool, *,
                          tokens: bool = False, backend: str = "auto") -> np.ndarray:
    """(B,) int64: :func:`served_document_pairs` (or, with ``tokens``, :func:`served_real_tokens`)
    of the samples ``sample_ids`` of megatron-core's arrays ``indices`` (a ``GPTIndices``) over a
    store's ``sequence_lengths``, without building their ``SampleSpans``: one compiled pass reads
    each sample's rows of the index and its documents' lengths. The same numbers as the spans'
    (the pieces are walked by ``MegatronReader.spans``' rule); what balancing costs a step with,
    where every rank costs all ``G`` samples and the spans' dozen array passes were most of it.
    ``backend`` as :func:`assign_slots`'."""
    sample_ids = np.ascontiguousarray(sample_ids, dtype=np.int64)
    out = np.empty(sample_ids.shape[0], dtype=np.int64)
    kernel = _megatron_costs_kernel
    if backend == "numba" or (backend == "auto" and numba_available()):
        kernel = compiled(kernel)
    kernel(indices.shuffle_index, indices.sample_index, indices.document_index, sequence_lengths, sample_ids,
           np.int64(indices.plan.add_extra_token), np.int64(seq_length), bool(add_extra_token), bool(tokens), out)
    return out


def _check_layout(num: int, dp: int, micro_batch_size: int) -> int:
    for name, value in (("dp", dp), ("micro_batch_size", micro_batch_size)):
        if not is_integer(value) or value < 1:
            raise ConfigError(f"{name}={value!r}; expected a positive integer")
    per = dp * micro_batch_size
    if num < 1 or num % per:
        raise ConfigError(f"a global batch of {num} samples does not fill micro-batches of {micro_batch_size} on "
                          f"{dp} data-parallel ranks ({per} samples per micro-step); expected a positive multiple of "
                          f"{per}")
    return num // per


@jit(cache=True, nogil=True)
def _stable_argsort(keys):
    """``np.argsort(keys, kind="mergesort")`` (ascending, ties by index: the one stable order):
    insertion sorts of runs of 16, then bottom-up merges, moving each key with its index so
    that no comparison looks up through the order. numba's own stable argsort allocates as it
    recurses and took most of a step's placement."""
    n = keys.shape[0]
    order = np.arange(n)
    values = keys.copy()
    for lo in range(0, n, 16):
        for k in range(lo + 1, min(lo + 16, n)):
            value, item = values[k], order[k]
            at = k
            while at > lo and values[at - 1] > value:  # only past greater keys: stable
                values[at] = values[at - 1]
                order[at] = order[at - 1]
                at -= 1
            values[at] = value
            order[at] = item
    if n <= 16:
        return order
    other, spare = np.empty(n, dtype=order.dtype), np.empty(n, dtype=values.dtype)
    width = 16
    while width < n:
        for lo in range(0, n, 2 * width):
            mid, hi = min(lo + width, n), min(lo + 2 * width, n)
            a, b, at = lo, mid, lo
            while a < mid and b < hi:
                if values[b] < values[a]:  # the left one first on a tie: stable
                    spare[at], other[at] = values[b], order[b]
                    b += 1
                else:
                    spare[at], other[at] = values[a], order[a]
                    a += 1
                at += 1
            while a < mid:
                spare[at], other[at] = values[a], order[a]
                a += 1
                at += 1
            while b < hi:
                spare[at], other[at] = values[b], order[b]
                b += 1
                at += 1
        order, other = other, order
        values, spare = spare, values
        width *= 2
    return order


@jit(cache=True, nogil=True)
def _sort_in_place(values):
    """Sort a short 1-D integer array (a row of offsets) in place: insertion, no allocation
    (numba's ``ndarray.sort`` of a row view costs a microsecond of setup each)."""
    for k in range(1, values.shape[0]):
        value = values[k]
        at = k
        while at > 0 and values[at - 1] > value:
            values[at] = values[at - 1]
            at -= 1
        values[at] = value


@jit(cache=True, nogil=True)
def _partition_kernel(costs, bins, out):
    """Fill ``out`` (bins, len(costs) / bins) with indices into ``costs``: LPT in rounds, then
    swaps out of the heaviest bin (module docstring); each row ascending."""
    per = costs.shape[0] // bins
    order = _stable_argsort(-costs)  # costliest first; stable: ties by index
    loads = np.zeros(bins, dtype=np.int64)
    for t in range(per):
        lightest = _stable_argsort(loads)  # least load first, ties by bin
        for k in range(bins):
            item = order[t * bins + k]
            out[lightest[k], t] = item
            loads[lightest[k]] += costs[item]
    if per > 1 and bins > 1:
        total, largest = np.int64(0), np.int64(0)
        for k in range(costs.shape[0]):
            total += costs[k]
            largest = max(largest, costs[k])
        bound = max(largest, -(-total // bins))  # no bin can weigh less than this at the top
        for _ in range(_SWAPS_PER_LEVEL):
            heavy = np.argmax(loads)  # the first of the heaviest
            top = loads[heavy]
            if top - bound <= bound // _CLOSE_ENOUGH:  # within 1/_CLOSE_ENOUGH of the bound: done
                break
            best, best_i, best_b, best_j = top, -1, -1, -1
            for i in range(per):  # the first best swap in (i, b, j) order
                mine = costs[out[heavy, i]]
                for b in range(bins):
                    # a swap with bin b leaves max(top - delta, loads[b] + delta), at least the
                    # pair's mean: where that cannot beat the best so far no j of b is taken
                    if b == heavy or (top + loads[b] + 1) // 2 >= best:
                        continue
                    for j in range(per):
                        delta = mine - costs[out[b, j]]  # load moved off the heavy bin
                        if delta > 0 and loads[b] + delta < top:
                            after = max(top - delta, loads[b] + delta)
                            if after < best:
                                best, best_i, best_b, best_j = after, i, b, j
            if best_i < 0:
                break
            delta = costs[out[heavy, best_i]] - costs[out[best_b, best_j]]
            item = out[heavy, best_i]
            out[heavy, best_i] = out[best_b, best_j]
            out[best_b, best_j] = item
            loads[heavy] -= delta
            loads[best_b] += delta
    for b in range(bins):
        _sort_in_place(out[b])


@jit(cache=True, nogil=True)
def _max_load(costs, members):
    """The largest row sum of ``costs[members]``."""
    top = np.int64(0)
    for b in range(members.shape[0]):
        load = np.int64(0)
        for k in range(members.shape[1]):
            load += costs[members[b, k]]
        top = max(top, load)
    return top


@jit(cache=True, nogil=True)
def _assign_kernel(costs, dp, micro, out):
    """:func:`assign_slots` into ``out`` (G,): rank sets, then each rank's micro-batches."""
    num_micro = costs.shape[0] // (dp * micro)
    per_rank = num_micro * micro
    plain = np.empty((dp, per_rank), dtype=np.int64)  # Megatron's: rank r, micro-step m, sample j
    for m in range(num_micro):
        for r in range(dp):
            for j in range(micro):
                plain[r, m * micro + j] = m * dp * micro + r * micro + j
    ranks = np.empty((dp, per_rank), dtype=np.int64)
    _partition_kernel(costs, dp, ranks)
    if _max_load(costs, ranks) >= _max_load(costs, plain):
        ranks = plain
    local = np.empty((num_micro, micro), dtype=np.int64)
    split = np.empty((num_micro, micro), dtype=np.int64)
    for r in range(dp):
        held = ranks[r].copy()  # (M * micro,) this rank's offsets in stream order
        _sort_in_place(held)
        plain_micro = held.reshape(num_micro, micro)
        chosen = plain_micro
        if num_micro > 1:
            _partition_kernel(costs[held], num_micro, local)
            for m in range(num_micro):
                for j in range(micro):
                    split[m, j] = held[local[m, j]]
            if _max_load(costs, split) < _max_load(costs, plain_micro):
                chosen = split
        for m in range(num_micro):
            for j in range(micro):
                out[m * dp * micro + r * micro + j] = chosen[m, j]


@jit(cache=True, nogil=True)
def _assign_steps_kernel(costs, dp, micro, out):
    """:func:`_assign_kernel` on each row of ``costs`` (steps, G) into ``out`` (steps, G): one
    call for many steps, so that placing a step costs no Python dispatch of its own."""
    for k in range(costs.shape[0]):
        _assign_kernel(costs[k], dp, micro, out[k])


def assign_slots(costs, *, dp: int, micro_batch_size: int, backend: str = "auto") -> np.ndarray:
    """(G,) int64: the global batch's offsets (indices into ``costs``, its samples in stream
    order) in slot order: slot ``m * micro * dp + r * micro + j`` is sample ``j`` of data-parallel
    rank ``r``'s micro-batch ``m``, the order Megatron's sampler reads positions in. Inside a
    micro-batch the offsets ascend. See the module docstring for the rule and its guarantees.
    ``costs`` of shape ``(steps, G)`` places several global batches of one size in one kernel
    call (``(steps, G)`` out, row ``k`` exactly ``assign_slots(costs[k])``): what a sampler
    placing the steps ahead uses. ConfigError when the batch does not fill the layout's
    micro-batches. ``backend``: "numba" (the default where installed) or "python" (the same
    kernel, interpreted); identical results."""
    costs = np.asarray(costs)
    if costs.ndim not in (1, 2) or not np.issubdtype(costs.dtype, np.integer):
        raise ConfigError(f"assign_slots costs of shape {costs.shape} and dtype {costs.dtype}; expected one "
                          "integer cost per sample of the global batch (CostModel.sample_costs), or a (steps, G) "
                          "array of several batches")
    if backend not in ("auto", "numba", "python"):
        raise ConfigError(f"backend={backend!r}; expected 'auto', 'numba' or 'python'")
    costs = np.ascontiguousarray(costs, dtype=np.int64)
    size = costs.shape[-1]
    _check_layout(size, dp, micro_batch_size)
    if costs.size and int(costs.max()) > 2**62 // size:
        raise ConfigError(f"assign_slots: costs up to {int(costs.max())} over {size} samples overflow "
                          "int64 loads; give costs in coarser units")
    out = np.empty(costs.shape, dtype=np.int64)
    kernel = _assign_kernel if costs.ndim == 1 else _assign_steps_kernel
    if backend == "numba" or (backend == "auto" and numba_available()):
        kernel = compiled(kernel)
    kernel(costs, np.int64(dp), np.int64(micro_batch_size), out)
    return out


def slot_costs(costs, order: np.ndarray, *, dp: int, micro_batch_size: int) -> np.ndarray:
    """(M, dp) int64: each micro-batch's cost when the samples of ``costs`` (stream order) are
    placed by ``order`` (:func:`assign_slots`'s, or ``arange`` for the unbalanced order)."""
    costs = np.asarray(costs, dtype=np.int64)
    num_micro = _check_layout(costs.shape[0], dp, micro_batch_size)
    return costs[np.asarray(order, dtype=np.int64)].reshape(num_micro, dp, micro_batch_size).sum(axis=2)
