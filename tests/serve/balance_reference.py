"""The placement of a balanced step as it was computed before it was made fast (issue 43), kept
as the slow reference the fast path must equal byte for byte: the assignment with numpy's own
stable sorts, interpreted, and the costs from each reader's ``spans``."""

from __future__ import annotations

import numpy as np

from tokenloom.index.balance import _CLOSE_ENOUGH, _SWAPS_PER_LEVEL, served_document_pairs, served_real_tokens


def _partition(costs: np.ndarray, bins: int) -> np.ndarray:
    """(bins, G / bins): LPT in rounds, then the first best swap out of the heaviest bin."""
    per = costs.shape[0] // bins
    out = np.empty((bins, per), dtype=np.int64)
    order = np.argsort(-costs, kind="mergesort")
    loads = np.zeros(bins, dtype=np.int64)
    for t in range(per):
        lightest = np.argsort(loads, kind="mergesort")
        for k in range(bins):
            item = order[t * bins + k]
            out[lightest[k], t] = item
            loads[lightest[k]] += costs[item]
    if per > 1 and bins > 1:
        bound = max(int(costs.max()), -(-int(costs.sum()) // bins))
        for _ in range(_SWAPS_PER_LEVEL):
            heavy = int(np.argmax(loads))
            top = int(loads[heavy])
            if top - bound <= bound // _CLOSE_ENOUGH:
                break
            best, best_i, best_b, best_j = top, -1, -1, -1
            for i in range(per):
                mine = int(costs[out[heavy, i]])
                for b in range(bins):
                    if b == heavy:
                        continue
                    for j in range(per):
                        delta = mine - int(costs[out[b, j]])
                        if delta > 0 and loads[b] + delta < top:
                            after = max(top - delta, int(loads[b]) + delta)
                            if after < best:
                                best, best_i, best_b, best_j = after, i, b, j
            if best_i < 0:
                break
            delta = int(costs[out[heavy, best_i]] - costs[out[best_b, best_j]])
            out[heavy, best_i], out[best_b, best_j] = out[best_b, best_j], out[heavy, best_i]
            loads[heavy] -= delta
            loads[best_b] += delta
    return np.sort(out, axis=1)


def _max_load(costs: np.ndarray, members: np.ndarray) -> int:
    return int(costs[members].sum(axis=1).max())


def reference_assign_slots(costs, dp: int, micro: int) -> np.ndarray:
    """(G,) offsets in slot order, as ``assign_slots`` placed them before."""
    costs = np.asarray(costs, dtype=np.int64)
    num_micro = costs.shape[0] // (dp * micro)
    plain = np.arange(costs.shape[0]).reshape(num_micro, dp, micro).transpose(1, 0, 2).reshape(dp, -1)
    ranks = _partition(costs, dp)
    if _max_load(costs, ranks) >= _max_load(costs, plain):
        ranks = plain
    out = np.empty(costs.shape[0], dtype=np.int64)
    for r in range(dp):
        held = np.sort(ranks[r])
        chosen = held.reshape(num_micro, micro)
        if num_micro > 1:
            split = held[_partition(costs[held], num_micro)]
            if _max_load(costs, split) < _max_load(costs, chosen):
                chosen = split
        for m in range(num_micro):
            out[m * dp * micro + r * micro:m * dp * micro + (r + 1) * micro] = chosen[m]
    return out


def reference_batch_costs(stream, positions, geometry) -> np.ndarray:
    """(B,) costs of the samples at ``positions``, from each reader's ``spans``."""
    source = stream.source
    positions = np.asarray(positions, dtype=np.int64)
    dataset_ids, sample_ids = stream.locate(positions)
    widths = getattr(source, "seq_lengths", None)
    costs = np.empty(positions.shape[0], dtype=np.int64)
    for d in np.unique(dataset_ids):
        rows = np.flatnonzero(dataset_ids == d)
        spans = source.readers[int(d)].spans(sample_ids[rows])
        seq = int(source.seq_length if widths is None else widths[int(d)])
        if geometry.balance == "tokens":
            costs[rows] = served_real_tokens(spans.lengths, spans.bounds, seq)
        else:
            pairs = served_document_pairs(spans.lengths, spans.bounds, seq, bool(source.add_extra_token))
            costs[rows] = geometry.cost_model.sample_costs(pairs, np.full(rows.shape[0], seq))
    return costs


def reference_step_placement(stream, geometry, step_start: int, size: int) -> np.ndarray:
    """(G,) positions of one step in slot order, as ``step_placement`` computed them before."""
    costs = reference_batch_costs(stream, np.arange(step_start, step_start + size), geometry)
    return step_start + reference_assign_slots(costs, geometry.dp, geometry.micro_batch_size)
