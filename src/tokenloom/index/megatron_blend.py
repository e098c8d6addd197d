"""megatron-core's greedy blend, sample for sample, without its O(size x datasets) loop.

megatron-core (``helpers.cpp``) fills the blend one sample at a time: at step ``i`` every
dataset ``d`` has the error ``fl(fl(w_d * x_i) - c_d)`` with ``x_i = double(max(i, 1))`` and
``c_d`` its samples so far; the dataset with the largest error wins, ties to the lowest index.
:func:`megatron_blend` returns the same two arrays bit for bit, faster, by three observations:

1. **Equal weights move together.** Datasets with bit-identical weights see the same
   ``fl(w * x)``; the one with the fewest samples (then the lowest index) is always the best
   of them, so the group is served round-robin in index order. One *group* stands for them all.
2. **A pool of contenders.** For a level ``theta`` the pool is exactly the groups whose error is
   ``>= theta`` now. An error only grows until its group is picked, so a group leaves the pool
   only when picked, and joins it at the first step ``t`` where ``fl(w * t) - c >= theta`` —
   found from a float estimate and then checked with megatron's own expression, so the
   rounding is megatron's. When the pool is not empty its best member is the global best
   (everyone outside is below ``theta``); when it is empty the step scans all groups.
3. **A calendar.** Join times are integers; a ring of per-step buckets (far times are parked
   and re-filed every half turn) gives O(1) scheduling.

``theta`` adapts every 1024 steps to sit just below the best errors lately seen (they crowd
around 0.5, ever tighter as datasets grow: within +-0.04 at 1000 datasets, +-0.01 at 10000),
so the pool holds a few dozen groups and is rarely empty; any value gives the same arrays,
only speed depends on it. A step costs O(pool) instead of O(datasets). The pool's best is found
in two passes, a maximum kept in four independent lanes and then the first member at that
maximum with the lowest id: no branch on the data, which a single pass with the tie rule takes
(its mispredictions cost more than the arithmetic).

Up to 100 datasets a compiled copy of megatron's own loop (the same two passes) is faster than
the pool and is used instead (the tests route every case through both).

**Threads.** The greedy is sequential, but its state after ``s`` steps is nearly a closed form:
every error ``s * w_d - c_d`` stays within about +-1/2, so the largest-remainder counts of
``s * w`` miss the true counts on a handful of datasets at most (BENCHMARKS.md, "Blends"). With
``threads=T`` the steps are cut into ``T`` chunks that all run at once, each from such a guessed
state; then, chunk by chunk, megatron's own loop replays the chunk's start from the true state
(the end of the chunk before) until the true counts equal the counts of the recorded run: from
that step on both runs are the same run, so the recorded picks stand (the few counts that differ
are evened out by the greedy itself, which picks the dataset furthest behind, so the runs meet
soon after the chunk's start). A chunk whose run never meets the true one is replayed or rerun
from the true state, so the arrays are megatron's for any guess.

The exhaustive variant (``build_exhaustive_blending_indices``: weights ``size_d / total``, a
dataset dropped once it has given ``size_d`` samples) runs through the same kernel.

Backends (:class:`GreedyKernels`): ``"numba"`` compiles the kernels on first use (numba comes
with tokenloom; through :mod:`tokenloom.index.kernels`); ``"python"`` runs the very same functions in the
Python interpreter (slow: for checking, for small blends that would not repay the compile, and
for installs without numba). Both give identical arrays; :func:`_reference_megatron_blend` is the
plain O(size x D) loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np

from tokenloom.errors import ConfigError
from tokenloom.index.kernels import compiled_on_call, jit, numba_available, resolve_backend
from tokenloom.validate import check_int, check_positive_int

__all__ = [
    "MEGATRON_MAX_DATASETS",
    "MegatronGreedy",
    "RangeRun",
    "megatron_blend",
    "megatron_dataset_id_dtype",
    "megatron_exhaustive_blend",
    "ranges_settled",
    "settle_range",
]

#: megatron-core stores dataset ids as int16 and asserts ``len(datasets) < 32767``.
MEGATRON_MAX_DATASETS = 32766

_RING = 1 << 12  # calendar buckets (L1-sized); join times further ahead are parked
_ADAPT_EVERY = 1024  # steps between adjustments of theta
_SCAN_DATASETS = 100  # this many datasets or fewer: megatron's plain loop is faster than a pool
_SCAN_ALL = 16  # this many groups or fewer: every group stays in the pool
_WIDE_GROUPS = 4096  # more groups than this: theta sits further below the best errors


def megatron_dataset_id_dtype(num_datasets: int) -> np.dtype:
    """int16 like megatron-core below its 32767-dataset limit; int32 beyond it."""
    return np.dtype(np.int16) if num_datasets < 32767 else np.dtype(np.int32)


# ------------------------------------------------------------------------------------- kernel
# Plain Python; the numba backend compiles them all (tokenloom.index.kernels), the python one
# runs them as they are.


@jit(inline="always", cache=True)
def _error(w, i, c):
    """megatron's error at step ``i``: ``fl(fl(w * double(max(i, 1))) - double(c))``."""
    x = float(i) if i > 1 else 1.0
    return w * x - float(c)


@jit(cache=True)
def _join_time(w, c, theta, start, stop):
    """First step ``t`` in ``[start, stop)`` with ``_error(w, t, c) >= theta``; ``stop`` if none.

    A float estimate lands within a step or two; megatron's own expression then decides, and
    since the error never decreases in ``t`` the answer is exact.
    """
    if not w > 0.0:  # a flat error: now or never
        return start if _error(w, start, c) >= theta else stop
    t = start
    guess = (theta + float(c)) / w
    if guess >= float(stop):
        t = stop - 1
    elif guess > float(start):
        t = int(np.ceil(guess))
    while t > start and _error(w, t - 1, c) >= theta:
        t -= 1
    while t < stop and _error(w, t, c) < theta:
        t += 1
    return t


@jit(inline="always", cache=True)
def _pool_add(g, pool_size, in_pool, pool_g, pool_w, pool_c, pool_rep, weight, count_f, rep):
    in_pool[g] = pool_size
    pool_g[pool_size] = g
    pool_w[pool_size] = weight[g]
    pool_c[pool_size] = count_f[g]
    pool_rep[pool_size] = rep[g]
    return pool_size + 1


@jit(inline="always", cache=True)
def _pool_remove(g, pool_size, in_pool, pool_g, pool_w, pool_c, pool_rep):
    k = in_pool[g]
    last = pool_size - 1
    moved = pool_g[last]
    pool_g[k] = moved
    pool_w[k] = pool_w[last]
    pool_c[k] = pool_c[last]
    pool_rep[k] = pool_rep[last]
    in_pool[moved] = k
    in_pool[g] = -1
    return last


@jit(inline="always", cache=True)
def _link(g, t, head, nxt, prv, event):
    b = t & (_RING - 1)
    event[g] = t
    nxt[g] = head[b]
    prv[g] = -1
    if head[b] >= 0:
        prv[head[b]] = g
    head[b] = g


@jit(inline="always", cache=True)
def _max_error(w, c, x, n):
    """``max(w[k] * x - c[k] for k < n)``, ``n >= 1``: four independent running maxima, so
    the comparisons need not wait on each other and no branch depends on the data."""
    m0 = w[0] * x - c[0]
    m1 = m0
    m2 = m0
    m3 = m0
    k = 1
    while k + 4 <= n:
        e0 = w[k] * x - c[k]
        e1 = w[k + 1] * x - c[k + 1]
        e2 = w[k + 2] * x - c[k + 2]
        e3 = w[k + 3] * x - c[k + 3]
        m0 = e0 if e0 > m0 else m0
        m1 = e1 if e1 > m1 else m1
        m2 = e2 if e2 > m2 else m2
        m3 = e3 if e3 > m3 else m3
        k += 4
    while k < n:
        e0 = w[k] * x - c[k]
        m0 = e0 if e0 > m0 else m0
        k += 1
    m0 = m1 if m1 > m0 else m0
    m2 = m3 if m3 > m2 else m2
    return m2 if m2 > m0 else m0


@jit(inline="always", cache=True)
def _first_best(w, c, rep, x, n, best_error):
    """The ``k < n`` whose error equals ``best_error`` (the maximum) with the lowest
    ``rep[k]``: megatron's tie rule. The test is almost always false, a branch the CPU predicts."""
    k_best = -1
    for k in range(n):
        if w[k] * x - c[k] == best_error and (k_best < 0 or rep[k] < rep[k_best]):
            k_best = k
    return k_best


@jit(nogil=True, cache=True)
def _greedy_kernel(group_weight, group_limit, member_start, members, start, stop, theta0, counts,
                   out_dataset, out_sample):
    """Fill ``out_dataset``/``out_sample`` (length ``stop - start``) with megatron's greedy
    order for steps ``start .. stop-1``, starting from the per-dataset ``counts`` at ``start``
    (updated in place to the counts at ``stop``).

    group_weight: (G,) float64, the common weight of each group (groups sorted by first member).
    group_limit: (G,) int64, samples per member before the group is spent (exhaustive), or -1.
    member_start: (G + 1,) int64 offsets into members; members: (D,) int64 dataset ids, ascending
    within each group. counts: (D,) int64; within a group the members ahead by one must be its
    first ones (as the greedy leaves them: ties go to the lowest id).
    """
    num_groups = group_weight.shape[0]
    size = stop
    count_min = np.zeros(num_groups, np.int64)  # samples of the group's least-served members
    count_f = np.zeros(num_groups, np.float64)  # the same as float; +inf once spent
    turn = np.zeros(num_groups, np.int64)  # members already at count_min + 1 this round
    rep = np.empty(num_groups, np.int64)  # (G,) the member the group would give next
    active = np.ones(num_groups, np.bool_)
    for g in range(num_groups):
        first = member_start[g]
        last = member_start[g + 1] - 1
        count_min[g] = counts[members[last]]  # the group's last member is never ahead
        while turn[g] < last - first and counts[members[first + turn[g]]] > count_min[g]:
            turn[g] += 1
        rep[g] = members[first + turn[g]]
        if group_limit[g] >= 0 and count_min[g] == group_limit[g]:
            active[g] = False
            count_f[g] = np.inf
        else:
            count_f[g] = float(count_min[g])
    # the pool, stored contiguously for the scan: group, weight, count, next member
    in_pool = np.full(num_groups, -1, np.int64)
    pool_g = np.empty(num_groups, np.int64)
    pool_w = np.empty(num_groups, np.float64)
    pool_c = np.empty(num_groups, np.float64)
    pool_rep = np.empty(num_groups, np.int64)
    pool_size = 0
    # the calendar: a ring of doubly linked bucket lists, and events parked beyond it
    event = np.full(num_groups, -1, np.int64)  # scheduled join step, or -1
    parked = np.zeros(num_groups, np.bool_)
    head = np.full(_RING, -1, np.int64)
    nxt = np.full(num_groups, -1, np.int64)
    prv = np.full(num_groups, -1, np.int64)
    theta = theta0
    # theta's place below the lowest best error of the last window, in the window's spread of
    # best errors: a pool a quarter-spread deep holds about half the groups a whole-spread one
    # does, at the price of an occasional empty pool (a scan of every group) and a new theta
    # (a rebuild, O(groups)); beyond _WIDE_GROUPS those O(groups) costs outweigh the shorter pool
    if num_groups <= _WIDE_GROUPS:
        margin, slack, scans_allowed = 0.25, 1.0, 2
    else:
        margin, slack, scans_allowed = 1.0, 3.0, 0
    steps_in_window = 0
    scans = 0
    best_low = np.inf
    best_high = -np.inf

    for g in range(num_groups):
        if not active[g]:
            continue
        t = _join_time(group_weight[g], count_min[g], theta, start, size)
        if t == start:
            pool_size = _pool_add(g, pool_size, in_pool, pool_g, pool_w, pool_c, pool_rep,
                                  group_weight, count_f, rep)
        elif t < size:
            if t < start + _RING // 2:
                _link(g, t, head, nxt, prv, event)
            else:
                event[g] = t
                parked[g] = True

    for i in range(start, stop):
        if i % (_RING // 2) == 0 and i > 0:  # re-file parked events every half turn
            for g in range(num_groups):
                if parked[g] and event[g] < i + _RING // 2:
                    parked[g] = False
                    _link(g, event[g], head, nxt, prv, event)
        # groups whose error reaches theta at this step join the pool
        b = i & (_RING - 1)
        g = head[b]
        while g >= 0:
            following = nxt[g]
            event[g] = -1
            nxt[g] = -1
            prv[g] = -1
            pool_size = _pool_add(g, pool_size, in_pool, pool_g, pool_w, pool_c, pool_rep,
                                  group_weight, count_f, rep)
            g = following
        head[b] = -1

        # the best group: largest error, ties to the lowest dataset id (megatron's order)
        x = float(i) if i > 1 else 1.0
        if pool_size > 0:
            best_error = _max_error(pool_w, pool_c, x, pool_size)
            best = pool_g[_first_best(pool_w, pool_c, pool_rep, x, pool_size, best_error)]
        else:
            scans += 1
            best_error = _max_error(group_weight, count_f, x, num_groups)
            best = _first_best(group_weight, count_f, rep, x, num_groups, best_error)
        g = best
        out_dataset[i - start] = rep[g]
        out_sample[i - start] = count_min[g]
        turn[g] += 1
        if turn[g] == member_start[g + 1] - member_start[g]:
            turn[g] = 0
            count_min[g] += 1
            count_f[g] = float(count_min[g])
        rep[g] = members[member_start[g] + turn[g]]
        spent = group_limit[g] >= 0 and count_min[g] == group_limit[g]
        if spent:
            active[g] = False
            count_f[g] = np.inf
        # keep the pool exact for step i + 1
        if in_pool[g] >= 0:
            if spent or _error(group_weight[g], i + 1, count_min[g]) < theta:
                pool_size = _pool_remove(g, pool_size, in_pool, pool_g, pool_w, pool_c, pool_rep)
            else:
                pool_c[in_pool[g]] = count_f[g]
                pool_rep[in_pool[g]] = rep[g]
        elif event[g] >= 0:  # picked by a full scan: cancel its event
            if parked[g]:
                parked[g] = False
            else:
                if prv[g] >= 0:
                    nxt[prv[g]] = nxt[g]
                else:
                    head[event[g] & (_RING - 1)] = nxt[g]
                if nxt[g] >= 0:
                    prv[nxt[g]] = prv[g]
                nxt[g] = -1
                prv[g] = -1
            event[g] = -1
        if in_pool[g] < 0 and not spent and i + 1 < size:
            t = _join_time(group_weight[g], count_min[g], theta, i + 1, size)
            if t == i + 1:
                pool_size = _pool_add(g, pool_size, in_pool, pool_g, pool_w, pool_c, pool_rep,
                                      group_weight, count_f, rep)
            elif t < size:
                if t < i + 1 + _RING // 2:
                    _link(g, t, head, nxt, prv, event)
                else:
                    event[g] = t
                    parked[g] = True

        # adapt theta to the best errors just seen: a little below their lowest, so the pool
        # is rarely empty (a full scan) yet holds few groups (a short scan)
        best_low = min(best_low, best_error)
        best_high = max(best_high, best_error)
        steps_in_window += 1
        if steps_in_window == _ADAPT_EVERY and i + 1 < size and num_groups > _SCAN_ALL:
            spread = best_high - best_low
            new_theta = theta
            if scans > scans_allowed or theta < best_low - slack * spread - 1e-3:
                new_theta = best_low - margin * spread
            steps_in_window = 0
            scans = 0
            best_low = np.inf
            best_high = -np.inf
            if new_theta != theta:
                theta = new_theta
                # rebuild pool and calendar for step i + 1
                for h in range(num_groups):
                    if event[h] >= 0 and not parked[h]:
                        head[event[h] & (_RING - 1)] = -1
                pool_size = 0
                for h in range(num_groups):
                    in_pool[h] = -1
                    event[h] = -1
                    parked[h] = False
                    nxt[h] = -1
                    prv[h] = -1
                for h in range(num_groups):
                    if not active[h]:
                        continue
                    t = _join_time(group_weight[h], count_min[h], theta, i + 1, size)
                    if t == i + 1:
                        pool_size = _pool_add(h, pool_size, in_pool, pool_g, pool_w, pool_c, pool_rep,
                                              group_weight, count_f, rep)
                    elif t < size:
                        if t < i + 1 + _RING // 2:
                            _link(h, t, head, nxt, prv, event)
                        else:
                            event[h] = t
                            parked[h] = True
    for g in range(num_groups):  # the state at stop, back to per-dataset counts
        for k in range(member_start[g], member_start[g + 1]):
            counts[members[k]] = count_min[g] + (1 if k - member_start[g] < turn[g] else 0)
    return 0


@jit(inline="always", cache=True)
def _scan_best(weight, counts_f, i):
    """megatron's pick at step ``i``: the largest error, ties to the lowest id (every dataset)."""
    x = float(i) if i > 1 else 1.0
    best_error = _max_error(weight, counts_f, x, weight.shape[0])
    d = 0
    while weight[d] * x - counts_f[d] != best_error:
        d += 1
    return d


@jit(nogil=True, cache=True)
def _scan_kernel(weight, limit, start, stop, counts, out_dataset, out_sample):
    """megatron's loop itself, for a handful of datasets: every error, every step (steps
    ``start .. stop-1`` from ``counts``, updated in place)."""
    num_datasets = weight.shape[0]
    counts_f = np.empty(num_datasets, np.float64)  # +inf once spent: never the best again
    for d in range(num_datasets):
        counts_f[d] = np.inf if counts[d] == limit[d] else float(counts[d])
    for i in range(start, stop):
        best = _scan_best(weight, counts_f, i)
        out_dataset[i - start] = best
        out_sample[i - start] = counts[best]
        counts[best] += 1
        counts_f[best] = np.inf if counts[best] == limit[best] else float(counts[best])
    return 0


@jit(nogil=True, cache=True)
def _resync_kernel(weight, limit, start, stop, counts, guessed, out_dataset, out_sample, max_steps):
    """Repair a chunk that was run from a guessed state: from the true ``counts`` at ``start``,
    replay megatron's loop over the chunk's recorded picks, overwriting them, until the true
    counts equal the counts the recorded run had (its state was ``guessed`` at ``start``). From
    that step on the recorded picks and sample ids are megatron's. Returns ``(step, met)``: the
    step where the two runs met (``met``), or where it stopped without meeting them, at ``stop``
    or after ``max_steps``, with ``counts`` the true state at that step.
    """
    num_datasets = weight.shape[0]
    diff = counts - guessed  # true minus recorded, per dataset
    apart = 0
    for d in range(num_datasets):
        if diff[d] != 0:
            apart += 1
    counts_f = np.empty(num_datasets, np.float64)
    for d in range(num_datasets):
        counts_f[d] = np.inf if counts[d] == limit[d] else float(counts[d])
    i = start
    while apart > 0 and i < stop and i - start < max_steps:
        best = _scan_best(weight, counts_f, i)
        recorded = out_dataset[i - start]
        if recorded != best:
            apart -= (diff[best] != 0) + (diff[recorded] != 0)
            diff[best] += 1
            diff[recorded] -= 1
            apart += (diff[best] != 0) + (diff[recorded] != 0)
        out_dataset[i - start] = best
        out_sample[i - start] = counts[best]
        counts[best] += 1
        counts_f[best] = np.inf if counts[best] == limit[best] else float(counts[best])
        i += 1
    return i, apart == 0


class GreedyKernels(NamedTuple):
    """The three kernels of :func:`_run`, of one backend."""

    scan: Callable
    """:func:`_scan_kernel`: megatron's own loop, for a handful of datasets."""
    greedy: Callable
    """:func:`_greedy_kernel`: the pool and the calendar, for many datasets."""
    resync: Callable
    """:func:`_resync_kernel`: a chunk run from a guessed state, repaired."""


_PYTHON_KERNELS = GreedyKernels(scan=_scan_kernel, greedy=_greedy_kernel, resync=_resync_kernel)

#: Backends that run the greedy (those that can run here); all give identical arrays. "numba"
#: compiles the same functions on their first call.
BACKENDS: dict[str, GreedyKernels] = {"python": _PYTHON_KERNELS}
if numba_available():
    BACKENDS["numba"] = GreedyKernels(*(compiled_on_call(kernel) for kernel in _PYTHON_KERNELS))


# ------------------------------------------------------------------------------------ helpers


def _check_size(size, what: str) -> int:
    return check_int(what, size, minimum=0, expected="a non-negative integer number of samples")


def _groups(weights: np.ndarray, limits: np.ndarray):
    """Group datasets with bit-identical (weight, limit); groups ordered by first member."""
    num_datasets = weights.shape[0]
    keys = np.stack([weights.view(np.int64), limits])  # (2, D): exact bit patterns
    order = np.lexsort((np.arange(num_datasets), keys[1], keys[0]))  # (D,) by key, then id
    sorted_keys = keys[:, order]
    new_group = np.ones(num_datasets, dtype=bool)
    new_group[1:] = np.any(sorted_keys[:, 1:] != sorted_keys[:, :-1], axis=0)
    starts = np.flatnonzero(new_group)  # (G,) offsets into order
    first_member = order[starts]
    rank = np.argsort(first_member, kind="stable")  # groups by their lowest dataset id
    sizes = np.diff(np.append(starts, num_datasets))
    members = np.concatenate([order[starts[g] : starts[g] + sizes[g]] for g in rank]).astype(np.int64)
    member_start = np.zeros(len(rank) + 1, dtype=np.int64)
    member_start[1:] = np.cumsum(sizes[rank])
    group_of_first = first_member[rank]
    return (
        np.ascontiguousarray(weights[group_of_first]),
        np.ascontiguousarray(limits[group_of_first]),
        member_start,
        members,
    )


#: Steps per chunk below which a threaded blend does not split (a thread costs more).
_MIN_CHUNK = 1 << 18
#: Steps a repair replays with megatron's loop before handing the rest of a chunk back to the
#: fast kernel (far more than a guess that is off by a few counts needs to meet the true run),
#: and the dataset-steps it may spend (a replay step scans every dataset): at most 2**26, so a
#: guess that never meets (weights far from summing to one) wastes little at 32766 datasets.
_RESYNC_STEPS = 1 << 16
_RESYNC_WORK = 1 << 26


def _guess_counts(weights: np.ndarray, limits: np.ndarray, step: int, member_start: np.ndarray,
                  members: np.ndarray) -> np.ndarray:
    """Per-dataset counts after ``step`` greedy steps, guessed: largest remainder of
    ``step * w_d`` (the greedy keeps every ``step * w_d - count_d`` within about +-1/2), capped
    at the exhaustive limits, then within each group of equal weights the members ahead moved
    to its lowest ids, the shape the greedy leaves. Any guess gives the right arrays (the
    repair replays megatron's loop until they agree); a good one saves the replay."""
    exact = weights * np.float64(step)  # (D,) float64
    counts = np.floor(exact).astype(np.int64)
    leftover = int(step - counts.sum())
    if leftover > 0:
        counts[np.argsort(counts - exact, kind="stable")[:leftover]] += 1  # largest fractions first
    if (limits >= 0).any():
        counts = np.where(limits >= 0, np.minimum(counts, limits), counts)
    np.maximum(counts, 0, out=counts)
    sizes = np.diff(member_start)
    for g in np.flatnonzero(sizes > 1):
        ids = members[member_start[g]:member_start[g + 1]]
        total = int(counts[ids].sum())
        counts[ids] = total // len(ids)
        counts[ids[: total % len(ids)]] += 1
    return counts


class RangeRun(NamedTuple):
    """What a range of greedy steps was computed from, and the state it ended in."""

    start_counts: np.ndarray
    """(D,) int64: the per-dataset counts the range's recorded run started from."""
    end_counts: np.ndarray
    """(D,) int64: the counts after the range's last step, given ``start_counts``."""


class MegatronGreedy:
    """megatron-core's greedy over one weight vector, prepared once, run over any range of steps.

    The blend's state after ``s`` steps is the per-dataset counts. :meth:`fill` computes steps
    ``[start, stop)`` from a state (the true one, or :meth:`guess`'s) on ``threads`` threads;
    :meth:`repair` makes a range computed from a wrong start state megatron's, given the true
    one, by replaying megatron's loop until the runs meet. :func:`megatron_blend` is ``fill``
    from step 0; a distributed build gives each rank a range, then repairs each range from the
    end state of the range before it (``tokenloom.builder``).

    What such a build asks of a greedy (:class:`~tokenloom.index.schedule_exact.ScheduleGreedy`
    answers the same for a schedule's greedies laid end to end): :meth:`guess`, :meth:`fill`,
    :meth:`repair`, :attr:`dataset_id_dtype`, and :attr:`restarts` with :meth:`carry`, the
    positions where the run starts again from an exact state (none here: one greedy runs on).
    """

    restarts: tuple[int, ...] = ()
    """Positions where the run starts afresh from an exact state: none, one greedy runs on."""

    def __init__(self, weights: np.ndarray, limits: np.ndarray, backend: str = "auto") -> None:
        self.weights = np.ascontiguousarray(weights, dtype=np.float64)  # (D,)
        self.limits = np.ascontiguousarray(limits, dtype=np.int64)  # (D,) -1: no limit
        self.num_datasets = self.weights.shape[0]
        self.kernels = BACKENDS[resolve_backend(backend, BACKENDS, fallback="python")]
        if self.num_datasets <= _SCAN_DATASETS:  # few datasets: megatron's own loop is the fastest
            self._groups = None
            self.member_start = np.arange(self.num_datasets + 1, dtype=np.int64)
            self.members = np.arange(self.num_datasets, dtype=np.int64)
        else:
            self._groups = _groups(self.weights, self.limits)
            self.member_start, self.members = self._groups[2], self._groups[3]
        # pool threshold: below the usual best error (about 0.5); a few groups: everyone in the pool
        self._theta0 = 0.3 if len(self.member_start) - 1 > _SCAN_ALL else -np.inf
        self._replay_steps = min(_RESYNC_STEPS, max(1024, _RESYNC_WORK // self.num_datasets))

    @classmethod
    def for_weights(cls, weights, *, backend: str = "auto", allow_beyond_megatron: bool = False) -> MegatronGreedy:
        """The greedy of ``build_blending_indices(weights, size)``: weights used exactly as
        given, finite and non-negative, at most 32766 datasets unless ``allow_beyond_megatron``."""
        w = np.asarray(weights, dtype=np.float64).reshape(-1)  # (D,) float64
        _check_num_datasets(w.shape[0], allow_beyond_megatron)
        bad = np.flatnonzero(~np.isfinite(w) | (w < 0))
        if len(bad):
            d = int(bad[0])
            raise ConfigError(f"weight of dataset {d} is {w[d]!r}; expected a finite non-negative number")
        return cls(w, np.full(w.shape[0], -1, dtype=np.int64), backend)

    @classmethod
    def for_sizes(cls, dataset_sizes, *, backend: str = "auto", allow_beyond_megatron: bool = False) -> MegatronGreedy:
        """The greedy of ``build_exhaustive_blending_indices(sizes)``: weights ``size_d /
        double(total)``, each dataset leaving the race once it gave ``size_d`` samples (its
        steps are ``sum(sizes)``); sizes positive integers."""
        sizes = np.asarray(dataset_sizes)
        if sizes.dtype.kind not in "iu" and not (sizes.dtype.kind == "f" and np.all(np.mod(sizes, 1) == 0)):
            raise ConfigError(f"dataset_sizes must be integers, got dtype {sizes.dtype}")
        sizes = sizes.astype(np.int64).reshape(-1)  # (D,) int64
        _check_num_datasets(sizes.shape[0], allow_beyond_megatron)
        bad = np.flatnonzero(sizes <= 0)
        if len(bad):
            d = int(bad[0])
            raise ConfigError(
                f"size of dataset {d} is {int(sizes[d])}; expected a positive number of samples "
                "(megatron-core never finishes an exhaustive blend with an empty dataset)"
            )
        weights = sizes / np.float64(int(sizes.sum()))  # (D,) float64, megatron's size_d / double(total)
        return cls(weights, sizes.copy(), backend)

    @property
    def dataset_id_dtype(self) -> np.dtype:
        return megatron_dataset_id_dtype(self.num_datasets)

    def carry(self, step: int, counts: np.ndarray) -> np.ndarray:
        """The state step ``step`` starts from when the steps before it ended in ``counts``:
        ``counts`` itself (one greedy runs on; a schedule's starts each phase afresh)."""
        return counts

    def guess(self, step: int) -> np.ndarray:
        """(D,) int64: the counts after ``step`` steps, guessed in closed form (exact at 0)."""
        if step == 0:
            return np.zeros(self.num_datasets, dtype=np.int64)
        return _guess_counts(self.weights, self.limits, step, self.member_start, self.members)

    def run(self, start: int, stop: int, counts: np.ndarray, out_dataset: np.ndarray, out_sample: np.ndarray) -> None:
        """Steps ``start .. stop-1`` from ``counts`` (updated in place to the counts at ``stop``)
        into ``out_dataset``/``out_sample`` (each ``stop - start`` long)."""
        if stop <= start:
            return
        if self._groups is None:
            self.kernels.scan(self.weights, self.limits, start, stop, counts, out_dataset, out_sample)
        else:
            group_weight, group_limit, member_start, members = self._groups
            self.kernels.greedy(group_weight, group_limit, member_start, members, start, stop, self._theta0, counts,
                                out_dataset, out_sample)

    def fill(self, start: int, stop: int, out_dataset: np.ndarray, out_sample: np.ndarray, *,
             counts: np.ndarray | None = None, threads: int = 1) -> RangeRun:
        """Steps ``[start, stop)`` into the two outputs (each ``stop - start`` long), from
        ``counts`` (None: :meth:`guess` at ``start``), on ``threads`` threads: the range is cut
        into chunks that all run at once, each from a guessed state, then every chunk but the
        first is repaired from the end of the chunk before. Returns the start state used and the
        end state; the outputs are megatron's steps whenever the start state is the true one."""
        start_counts = self.guess(start) if counts is None else np.array(counts, dtype=np.int64)
        size = stop - start
        chunks = max(1, min(int(threads), size // _MIN_CHUNK))
        bounds = [start + size * k // chunks for k in range(chunks + 1)]
        starts = [start_counts] + [self.guess(step) for step in bounds[1:-1]]
        ends = [state.copy() for state in starts]

        def run(k: int) -> None:
            a, b = bounds[k] - start, bounds[k + 1] - start
            self.run(bounds[k], bounds[k + 1], ends[k], out_dataset[a:b], out_sample[a:b])

        if chunks == 1:
            run(0)
        else:  # every chunk from its guessed state at once (the kernels release the GIL) ...
            with ThreadPoolExecutor(max_workers=chunks) as pool:
                for future in [pool.submit(run, k) for k in range(chunks)]:
                    future.result()
        # ... then, chunk by chunk, replay megatron's loop from the true state where the guess missed
        for k in range(1, chunks):
            a, b = bounds[k] - start, bounds[k + 1] - start
            repaired = self.repair(bounds[k], bounds[k + 1], ends[k - 1], starts[k], out_dataset[a:b], out_sample[a:b])
            if repaired is not None:
                ends[k] = repaired
        return RangeRun(start_counts=start_counts, end_counts=ends[-1])

    def repair(self, start: int, stop: int, true_counts: np.ndarray, recorded_counts: np.ndarray,
               out_dataset: np.ndarray, out_sample: np.ndarray) -> np.ndarray | None:
        """Make steps ``[start, stop)``, recorded in the outputs from ``recorded_counts``,
        megatron's steps from ``true_counts``: replay megatron's loop over the recorded picks
        until the true counts equal the recorded run's (from there both runs are one run), or
        rerun the rest of the range when they never meet. Returns the new end state, or None
        when the end state is unchanged (the runs met, or the two start states are equal)."""
        if np.array_equal(true_counts, recorded_counts):
            return None
        if stop <= start:
            return np.array(true_counts, dtype=np.int64)
        counts = np.array(true_counts, dtype=np.int64)
        step, met = self.kernels.resync(self.weights, self.limits, start, stop, counts, recorded_counts, out_dataset,
                                        out_sample, self._replay_steps)
        if met:
            return None
        if step < stop:  # the guess never caught up: the true run goes on from where the replay stopped
            self.run(step, stop, counts, out_dataset[step - start:], out_sample[step - start:])
        return counts


def ranges_settled(runs: Sequence[RangeRun], true_starts: Sequence[np.ndarray] | None = None) -> bool:
    """Whether consecutive ranges, each recorded from ``runs[r].start_counts``, form megatron's
    run: each starts from ``true_starts[r]``, by default zero counts for the first and the end
    of the one before for the others (a divided build passes the state its greedy's
    :meth:`~MegatronGreedy.carry` gives at each range's start: a schedule's starts every phase
    afresh)."""
    if true_starts is None:
        if runs and runs[0].start_counts.any():
            return False
        return all(np.array_equal(runs[r].start_counts, runs[r - 1].end_counts) for r in range(1, len(runs)))
    return all(np.array_equal(run.start_counts, start) for run, start in zip(runs, true_starts, strict=True))


def settle_range(greedy: MegatronGreedy, bounds: Sequence[int], runs: Sequence[RangeRun], r: int,
                 out_dataset: np.ndarray, out_sample: np.ndarray) -> RangeRun:
    """One round of repairing range ``r`` (steps ``bounds[r] .. bounds[r + 1]``, recorded in the
    outputs) given every range's run: range ``r`` takes the end state of range ``r - 1`` as its
    true start and is repaired from it. Every range repairs at once; after ``k`` rounds the first
    ``k + 1`` ranges are megatron's, and usually one round settles all (a range's end state only
    changes when its guessed run never met the true one)."""
    true_start = np.zeros(greedy.num_datasets, dtype=np.int64) if r == 0 else runs[r - 1].end_counts
    mine = runs[r]
    end = greedy.repair(bounds[r], bounds[r + 1], true_start, mine.start_counts, out_dataset, out_sample)
    return RangeRun(start_counts=np.array(true_start, dtype=np.int64),
                    end_counts=mine.end_counts if end is None else end)


def _run(greedy: MegatronGreedy, size: int, threads: int = 1):
    dataset_ids = np.zeros(size, dtype=greedy.dataset_id_dtype)
    sample_ids = np.zeros(size, dtype=np.int64)
    if size:
        greedy.fill(0, size, dataset_ids, sample_ids, threads=threads)
    return dataset_ids, sample_ids


def _check_threads(threads) -> int:
    return check_positive_int("threads", threads)


def _check_num_datasets(num_datasets: int, allow_beyond_megatron: bool) -> None:
    if num_datasets == 0:
        raise ConfigError("weights is empty; expected one weight per dataset")
    if num_datasets > MEGATRON_MAX_DATASETS and not allow_beyond_megatron:
        raise ConfigError(
            f"{num_datasets} datasets; megatron-core supports at most {MEGATRON_MAX_DATASETS} "
            "(int16 dataset ids). Pass allow_beyond_megatron=True for int32 ids that no Megatron "
            "run can reproduce, or use tokenloom's Blend"
        )


# ---------------------------------------------------------------------------------- public API


def megatron_blend(weights, size: int, *, backend: str = "auto", allow_beyond_megatron: bool = False,
                   threads: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """megatron-core's ``build_blending_indices(weights, size)``, identical arrays.

    ``weights`` are used exactly as given (float64), as the C++ helper uses them: megatron's
    ``BlendedDataset`` normalises them first (see ``tokenloom.index.blend_spec`` for the
    whole sizing path). They must be finite and non-negative; megatron-core asserts positive.

    Returns ``(dataset_ids, sample_ids)``: ``(size,)`` int16 (int32 beyond megatron-core's
    32766 datasets) and ``(size,)`` int64; ``sample_ids[i]`` counts earlier samples of the
    same dataset.

    ``threads > 1`` splits the steps into that many chunks run at once, each from a guessed
    state, then repairs each chunk's start from the true state of the chunk before (see
    :func:`_run`); the arrays are identical for every thread count.
    """
    size = _check_size(size, "size")
    threads = _check_threads(threads)
    return _run(MegatronGreedy.for_weights(weights, backend=backend, allow_beyond_megatron=allow_beyond_megatron),
                size, threads)


def megatron_exhaustive_blend(dataset_sizes, *, backend: str = "auto", allow_beyond_megatron: bool = False,
                              threads: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """megatron-core's ``build_exhaustive_blending_indices(sizes)``, identical arrays.

    Every dataset gives exactly ``dataset_sizes[d]`` samples; weights are
    ``size_d / double(total)`` and a dataset leaves the race once spent. The blend has
    ``sum(dataset_sizes)`` samples. Sizes must be positive (megatron-core loops forever on 0).
    """
    threads = _check_threads(threads)
    greedy = MegatronGreedy.for_sizes(dataset_sizes, backend=backend, allow_beyond_megatron=allow_beyond_megatron)
    return _run(greedy, int(greedy.limits.sum()), threads)


def _reference_megatron_blend(weights, size: int, dataset_sizes=None) -> tuple[np.ndarray, np.ndarray]:
    """The O(size x D) greedy, written plainly (tests compare the fast kernel against it)."""
    if dataset_sizes is not None:
        limits = np.asarray(dataset_sizes, dtype=np.int64)
        w = limits / np.float64(limits.sum())
        size = int(limits.sum())
    else:
        w = np.asarray(weights, dtype=np.float64)
        limits = None
    counts = np.zeros(w.shape[0], dtype=np.int64)
    dataset_ids = np.zeros(size, dtype=np.int64)
    sample_ids = np.zeros(size, dtype=np.int64)
    for i in range(size):
        errors = w * np.float64(max(i, 1)) - counts.astype(np.float64)  # (D,) float64
        if limits is not None:
            errors[counts == limits] = -np.inf
        d = int(np.argmax(errors))  # first maximum: ties to the lowest id
        dataset_ids[i] = d
        sample_ids[i] = counts[d]
        counts[d] += 1
    return dataset_ids, sample_ids
