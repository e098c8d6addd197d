"""tokenloom's blend: exact counts, a closed-form order with a proven prefix bound, O(1) state.

Counts
    Largest remainder: ``count_d = floor(size * w_d)`` (float64, weights normalised to sum to
    one), then the ``size - sum(count)`` leftover samples go to the largest fractional parts,
    ties to the lowest dataset id. So ``sum(count) == size`` and ``|count_d - size * w_d| < 1``.

Order (no per-position array, no per-sample state)
    The datasets with samples are the leaves of a Huffman tree built on their counts (two
    smallest merged first, ties by creation order). An internal node ``v`` with ``C_v`` samples
    and children ``a`` (``C_a`` samples) and ``b`` hands its ``j``-th slot to ``a`` exactly when
    ``floor(((j + 1) * C_a + h_v) / C_v) > floor((j * C_a + h_v) / C_v)`` with
    ``h_v = C_v // 2``: Bresenham's line, centred. Slot ``j`` then is slot
    ``floor((j * C_a + h_v) / C_v)`` of ``a``, or slot ``j - that`` of ``b``. Position ``p`` of
    the blend is slot ``p`` of the root; following it down the tree gives
    ``(dataset_id, sample_id)``, where ``sample_id`` counts the dataset's earlier samples.

Prefix bound (proved in FORMAT.md, checked by property tests)
    Among the first ``L`` positions a child of ``v`` gets ``round(m * C_a / C_v)`` of ``v``'s
    first ``m`` slots, off by at most 1/2. Unrolling along the path of dataset ``d``,
    ``|n_d(L) - L * count_d / size| <= 1/2 * sum over path nodes u below the root of
    count_d / C_u`` (:attr:`Blend.prefix_bound`). In a Huffman tree a node's grandparent holds
    more than twice its samples, so the sum is below 1 + 1 + 1/2 + 1/2 + 1/4 + ... = 4 and every
    bound is below 2; relative to the weights themselves add the count rounding (< 1).
    Lookup walks the tree: averaged over positions the depth is at most the entropy of the
    counts plus one (``<= log2(D) + 1``, about 10 for 1000 datasets); a single position's depth
    is at most ``D - 1`` and, as Huffman depths grow like Fibonacci numbers, about
    ``1.44 * log2(size)`` (rare, tiny datasets sit deep, heavy ones near the root).

Materialize
    Bottom-up: each internal node's sequence of dataset ids is its children's sequences merged
    by the same Bresenham rule (no division), in Huffman creation order; then one pass numbers
    each dataset's samples. Work is ``size * mean depth``.

Seeded order
    With ``seed`` and ``window``, position ``p = k * window + r`` reads the unseeded position
    ``k * window + pi_k(r)``, where ``pi_k`` is a keyed permutation of the window: the
    alternating Feistel network of ``tokenloom.index.feistel`` (cycle-walked into range) with
    round keys ``derive_round_keys(seed, purpose="tokenloom.blend.window")`` and a round
    function ``fmix64(lo ^ key ^ k * 0x9E3779B97F4A7C15)``. Every window therefore holds exactly
    the samples of the unseeded window, in a random order, and any position is still O(1) state.
"""

from __future__ import annotations

import heapq
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import cached_property
from typing import NamedTuple

import numpy as np

from tokenloom.errors import ConfigError
from tokenloom.index.feistel import derive_round_keys, feistel_bits
from tokenloom.index.kernels import compiled, compiled_on_call, jit, numba_available, resolve_backend
from tokenloom.validate import check_int, check_positive_int, is_integer

__all__ = ["MAX_BLEND_SIZE", "Blend", "dataset_id_dtype", "largest_remainder_counts"]

#: ``j * C_a`` must fit in int64: sizes up to floor(sqrt(2**63 - 1)).
MAX_BLEND_SIZE = 3_037_000_499
_WINDOW_ROUNDS = 6
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_CHUNK = 1 << 20  # positions per numpy chunk
_MIN_MATERIALIZE_CHUNK = 1 << 18  # positions per thread below which materialize does not split


def dataset_id_dtype(num_datasets: int) -> np.dtype:
    """int16 below megatron-core's 32767-dataset limit, int32 from there on."""
    return np.dtype(np.int16) if num_datasets < 32767 else np.dtype(np.int32)


def _check_weights(weights, names: Sequence[str] | None) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or w.shape[0] == 0:
        raise ConfigError(f"weights has shape {w.shape}; expected a non-empty 1-D sequence, one per dataset")
    if names is not None and len(names) != w.shape[0]:
        raise ConfigError(f"{len(names)} names for {w.shape[0]} weights; expected one name per dataset")

    def label(d: int) -> str:
        return f"dataset {d}" + (f" ({names[d]!r})" if names is not None else "")

    for d in np.flatnonzero(~np.isfinite(w) | (w < 0)):
        raise ConfigError(
            f"weight of {label(int(d))} is {float(w[d])!r}; expected a finite, non-negative number"
        )
    if not np.any(w > 0):
        raise ConfigError(f"all {w.shape[0]} weights are zero; at least one dataset needs a positive weight")
    return w


def largest_remainder_counts(weights, size: int) -> np.ndarray:
    """Samples per dataset: ``floor(size * w_d)`` plus one for the largest fractional parts.

    ``weights`` are normalised by their float64 sum; ties among fractional parts go to the
    lowest dataset id. Returns ``(D,)`` int64 summing to ``size``.
    """
    w = _check_weights(weights, None)
    w = w / w.sum()  # (D,) float64
    quota = w * float(size)  # (D,) float64
    base = np.floor(quota)
    counts = base.astype(np.int64)
    leftover = int(size) - int(counts.sum())
    if leftover < 0 or leftover > len(w):  # only float pathologies get here
        raise ConfigError(f"cannot apportion size={size} over weights summing to {float(w.sum())!r}")
    order = np.lexsort((np.arange(len(w)), -(quota - base)))  # (D,) largest fraction first
    counts[order[:leftover]] += 1
    return counts


# --------------------------------------------------------------------------------------- tree


def _huffman_tree(counts: np.ndarray):
    """Internal nodes of a Huffman tree over the datasets with samples.

    Returns ``(node_count, left_count, left, right, root)``: per internal node its samples, its
    left child's samples, and the children (``>= 0``: internal node, ``< 0``: dataset ``-c-1``).
    ``root`` is an internal node, or ``-d-1`` when only dataset ``d`` has samples.
    """
    heap = [(int(c), d, -d - 1) for d, c in enumerate(counts) if c > 0]  # (count, tiebreak, node)
    heapq.heapify(heap)
    node_count, left_count, left, right = [], [], [], []
    tiebreak = len(counts)
    while len(heap) > 1:
        ca, _, a = heapq.heappop(heap)
        cb, _, b = heapq.heappop(heap)
        node_count.append(ca + cb)
        left_count.append(ca)
        left.append(a)
        right.append(b)
        heapq.heappush(heap, (ca + cb, tiebreak, len(node_count) - 1))
        tiebreak += 1
    root = heap[0][2] if heap else -1  # an empty blend reads as dataset 0, never read
    as_array = lambda values: np.array(values, dtype=np.int64)  # noqa: E731
    return as_array(node_count), as_array(left_count), as_array(left), as_array(right), root


def _prefix_bounds(counts, node_count, left, right, root) -> np.ndarray:
    """``1/2 * sum count_d / C_u`` over the nodes ``u`` below the root on each dataset's path."""
    bound = np.zeros(len(counts), dtype=np.float64)
    if root < 0:
        return bound
    # walk down: carry the list of ancestors' sample counts (below the root)
    stack = [(root, ())]
    while stack:
        node, above = stack.pop()
        for child in (left[node], right[node]):
            child_count = node_count[child] if child >= 0 else counts[-child - 1]
            path = (*above, int(child_count))
            if child >= 0:
                stack.append((int(child), path))
            else:
                d = -child - 1
                bound[d] = 0.5 * sum(int(counts[d]) / c for c in path)
    return bound


def _dataset_paths(counts: np.ndarray, parent: np.ndarray, is_left: np.ndarray,
                   num_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """Per dataset, the internal nodes from the root down to its leaf and whether the path goes
    left below each: ``(D, depth)`` int64 (-1 past the path, and for datasets without samples)
    and bool. ``parent``/``is_left``: :meth:`Blend._parents`, internal nodes then leaves."""
    paths = []
    for d in range(len(counts)):
        path, child = [], num_nodes + d
        while counts[d] > 0 and parent[child] >= 0:
            path.append((int(parent[child]), bool(is_left[child])))
            child = int(parent[child])
        paths.append(path[::-1])
    depth = max(1, max(len(p) for p in paths))
    nodes = np.full((len(counts), depth), -1, dtype=np.int64)
    lefts = np.zeros((len(counts), depth), dtype=bool)
    for d, path in enumerate(paths):
        for level, (node, left) in enumerate(path):
            nodes[d, level], lefts[d, level] = node, left
    return nodes, lefts


def _count_down(nodes, lefts, node_count, left_count, dataset_ids, slots) -> None:
    """Walk ``slots`` (root slots, in place) down each dataset's path: of a node's first ``m``
    slots its left child gets ``(m * C_a + C_v // 2) // C_v``, its right child the rest."""
    for level in range(nodes.shape[1]):
        walking = np.flatnonzero(nodes[dataset_ids, level] >= 0)
        if not walking.shape[0]:
            break
        v, m = nodes[dataset_ids[walking], level], slots[walking]
        c_v, c_a = node_count[v], left_count[v]
        q = (m * c_a + c_v // 2) // c_v  # (w,) slots of the left child among the node's first m
        slots[walking] = np.where(lefts[dataset_ids[walking], level], q, m - q)


# ------------------------------------------------------------------------------------ kernels


def _lookup_numpy(positions, node_count, left_count, left, right, root, dataset_out, sample_out):
    """Walk every position down the tree, all positions at once (one tree level per pass)."""
    active = np.arange(positions.shape[0])  # (n,) indices into positions still walking
    slot = positions.astype(np.int64)  # (n,) slot within the current node
    node = np.full(positions.shape[0], root, dtype=np.int64)  # (n,) current internal node
    while active.shape[0]:
        v = node[active]
        j = slot[active]
        c_v, c_a = node_count[v], left_count[v]
        q = (j * c_a + c_v // 2) // c_v  # (m,) slots of the left child before slot j
        to_left = (j * c_a + c_v // 2) - q * c_v + c_a >= c_v
        child = np.where(to_left, left[v], right[v])
        slot[active] = np.where(to_left, q, j - q)
        node[active] = child
        done = child < 0
        finished = active[done]
        dataset_out[finished] = -child[done] - 1
        sample_out[finished] = slot[finished]
        active = active[~done]


_LANES = 8  # positions walked side by side: their dependency chains overlap in the CPU


@jit(nogil=True, cache=True)
def _lookup_kernel(positions, node_count, left_count, ratio, half, left, right, root,
                   dataset_out, sample_out):
    """Walk each position down the tree, ``_LANES`` at a time (the numba backend compiles it)."""
    n = positions.shape[0]
    slot = np.empty(_LANES, np.int64)
    node = np.empty(_LANES, np.int64)
    for start in range(0, n, _LANES):
        lanes = min(_LANES, n - start)
        for lane in range(lanes):
            slot[lane] = positions[start + lane]
            node[lane] = root
        walking = lanes
        while walking > 0:
            walking = 0
            for lane in range(lanes):
                v = node[lane]
                if v < 0:
                    continue
                j = slot[lane]
                c_v = node_count[v]
                c_a = left_count[v]
                # q = (j * c_a + c_v // 2) // c_v from a float estimate (off by at most one)
                q = np.int64(np.floor(j * ratio[v] + half[v]))
                r = j * c_a + c_v // 2 - q * c_v
                if r < 0:
                    q -= 1
                    r += c_v
                elif r >= c_v:
                    q += 1
                    r -= c_v
                go_left = r + c_a >= c_v
                slot[lane] = q if go_left else j - q
                v = left[v] if go_left else right[v]
                node[lane] = v
                walking += v >= 0
        for lane in range(lanes):
            dataset_out[start + lane] = -node[lane] - 1
            sample_out[start + lane] = slot[lane]


@jit(nogil=True, cache=True)
def _materialize_kernel(first, stop, node_count, left_count, left, right, num_datasets,
                        dataset_out, sample_out):
    """Positions ``first .. stop-1`` of the blend into ``dataset_out``/``sample_out`` (their
    slices): every node's run of dataset ids, children merged by the Bresenham rule, bottom-up.

    Top-down first: the root's slots ``[first, stop)`` are, at node ``v`` with ``C_v`` slots and
    a left child of ``C_a``, the left child's slots ``[q(lo), q(hi))`` and the right child's
    ``[lo - q(lo), hi - q(hi))``, ``q(j) = (j * C_a + C_v // 2) // C_v``. Then bottom-up in
    node order (a Huffman node's children are leaves or nodes created before it), each node
    merges its children's runs from the Bresenham state at its first slot; a leaf's run is its
    dataset id repeated. A leaf's first slot is the number of its samples before ``first``,
    so the numbering starts there. Ranges are independent: threads can take one each. The
    numba backend compiles it.
    """
    num_nodes = node_count.shape[0]
    root = num_nodes - 1
    lo = np.zeros(num_nodes, np.int64)
    hi = np.zeros(num_nodes, np.int64)
    seen = np.zeros(num_datasets, np.int64)  # samples of each dataset before `first`
    lo[root] = first
    hi[root] = stop
    for v in range(root, -1, -1):  # parents before children
        c_v = node_count[v]
        c_a = left_count[v]
        q_lo = (lo[v] * c_a + c_v // 2) // c_v
        q_hi = (hi[v] * c_a + c_v // 2) // c_v
        a = left[v]
        b = right[v]
        if a >= 0:
            lo[a] = q_lo
            hi[a] = q_hi
        else:
            seen[-a - 1] = q_lo
        if b >= 0:
            lo[b] = lo[v] - q_lo
            hi[b] = hi[v] - q_hi
        else:
            seen[-b - 1] = lo[v] - q_lo
    runs = [np.empty(0, dataset_out.dtype) for _ in range(num_nodes)]
    for v in range(num_nodes):
        c_v = node_count[v]
        c_a = left_count[v]
        a = left[v]
        b = right[v]
        out = dataset_out if v == root else np.empty(hi[v] - lo[v], dataset_out.dtype)
        run_a = runs[a] if a >= 0 else np.full(1, -a - 1, dataset_out.dtype)
        run_b = runs[b] if b >= 0 else np.full(1, -b - 1, dataset_out.dtype)
        step_a = 1 if a >= 0 else 0  # a leaf's run is one id, read again and again
        step_b = 1 if b >= 0 else 0
        r = (c_v // 2 + lo[v] * c_a) % c_v  # the Bresenham state before slot lo[v]
        ia = 0
        ib = 0
        for j in range(hi[v] - lo[v]):
            r += c_a
            take_a = r >= c_v
            if take_a:
                r -= c_v
            out[j] = run_a[ia * step_a] if take_a else run_b[ib * step_b]
            ia += take_a
            ib += 1 - take_a
        runs[v] = out
        if a >= 0:
            runs[a] = np.empty(0, dataset_out.dtype)
        if b >= 0:
            runs[b] = np.empty(0, dataset_out.dtype)
    for p in range(stop - first):
        d = dataset_out[p]
        sample_out[p] = seen[d]
        seen[d] += 1


def _window_keys(seed: int, num_rounds: int) -> np.ndarray:
    return np.array(
        derive_round_keys(seed=seed, purpose="tokenloom.blend.window", epoch=0, size=0, rounds=num_rounds),
        dtype=np.uint64,
    )


def _fmix(z):
    z = z ^ (z >> np.uint64(33))
    z = z * np.uint64(0xFF51AFD7ED558CCD)
    z = z ^ (z >> np.uint64(33))
    z = z * np.uint64(0xC4CEB9FE1A85EC53)
    return z ^ (z >> np.uint64(33))


def _window_permute_numpy(offsets, window_index, length, keys):
    """Feistel permutation of ``[0, length)`` keyed by ``keys`` mixed with the window index."""
    bits = feistel_bits(length)
    x = offsets.astype(np.uint64)  # (n,) uint64
    salt = window_index.astype(np.uint64) * _GOLDEN  # (n,) uint64, wraps
    todo = np.arange(x.shape[0])
    while todo.shape[0]:
        y = x[todo]
        s = salt[todo]
        w = bits // 2
        for key in keys:
            h = bits - w
            lo = y & np.uint64((1 << w) - 1)
            hi = y >> np.uint64(w)
            f = _fmix(lo ^ key ^ s) & np.uint64((1 << h) - 1)
            y = (lo << np.uint64(h)) | (hi ^ f)
            w = h
        x[todo] = y
        todo = todo[y >= np.uint64(length)]
    return x.astype(np.int64)


def _window_unpermute_numpy(permuted, window_index, length, keys):
    """The inverse of :func:`_window_permute_numpy`: offsets that permute to ``permuted``."""
    bits = feistel_bits(length)
    widths = []  # (w, h) of each round, in order
    w = bits // 2
    for _ in keys:
        h = bits - w
        widths.append((w, h))
        w = h
    x = permuted.astype(np.uint64)  # (n,) uint64
    salt = window_index.astype(np.uint64) * _GOLDEN  # (n,) uint64, wraps
    todo = np.arange(x.shape[0])
    while todo.shape[0]:
        y = x[todo]
        s = salt[todo]
        for key, (w, h) in zip(reversed(keys), reversed(widths)):
            lo = y >> np.uint64(h)
            f = _fmix(lo ^ key ^ s) & np.uint64((1 << h) - 1)
            hi = (y & np.uint64((1 << h) - 1)) ^ f
            y = (hi << np.uint64(w)) | lo
        x[todo] = y
        todo = todo[y >= np.uint64(length)]  # cycle walking, backwards
    return x.astype(np.int64)


def _lookup_in_chunks(positions, node_count, left_count, ratio, half, left, right, root, dataset_out, sample_out):
    """:func:`_lookup_numpy` a chunk of positions at a time (``ratio`` and ``half`` unused)."""
    for start in range(0, positions.shape[0], _CHUNK):
        part = slice(start, start + _CHUNK)
        _lookup_numpy(positions[part], node_count, left_count, left, right, root, dataset_out[part],
                      sample_out[part])


def _materialize_with_numpy(blend: Blend, dataset_ids: np.ndarray, sample_ids: np.ndarray,
                            threads: int) -> None:
    """Every position looked up, a chunk at a time (``threads`` unused)."""
    for start in range(0, blend.size, _CHUNK):
        positions = np.arange(start, min(blend.size, start + _CHUNK), dtype=np.int64)
        d, s = blend._walk(positions)
        dataset_ids[start : start + len(positions)] = d
        sample_ids[start : start + len(positions)] = s


def _materialize_with_numba(blend: Blend, dataset_ids: np.ndarray, sample_ids: np.ndarray,
                            threads: int) -> None:
    """The tree's runs merged bottom-up, ``threads`` ranges of positions at once."""
    kernel = compiled(_materialize_kernel)
    chunks = max(1, min(threads, blend.size // _MIN_MATERIALIZE_CHUNK))
    bounds = [blend.size * k // chunks for k in range(chunks + 1)]

    def fill(k: int) -> None:
        first, stop = bounds[k], bounds[k + 1]
        kernel(first, stop, blend._node_count, blend._left_count, blend._left, blend._right, blend.num_datasets,
               dataset_ids[first:stop], sample_ids[first:stop])

    if chunks == 1:
        fill(0)
    else:  # each range on its own thread (the kernel releases the GIL)
        with ThreadPoolExecutor(max_workers=chunks) as pool:
            for future in [pool.submit(fill, k) for k in range(chunks)]:
                future.result()


class OrderKernels(NamedTuple):
    """One backend's walks of the unseeded order (the blend has at least two datasets with samples)."""

    lookup: Callable[..., None]
    """``(positions, node_count, left_count, ratio, half, left, right, root, dataset_out, sample_out)``:
    fill the two int64 outputs at ``positions`` (the arguments of :func:`_lookup_kernel`)."""
    materialize: Callable[[Blend, np.ndarray, np.ndarray, int], None]
    """``(blend, dataset_ids, sample_ids, threads)``: fill the whole blend's two arrays."""


#: Backends for lookup/materialize (those that can run here); identical results.
BACKENDS: dict[str, OrderKernels] = {"numpy": OrderKernels(_lookup_in_chunks, _materialize_with_numpy)}
if numba_available():
    BACKENDS["numba"] = OrderKernels(compiled_on_call(_lookup_kernel), _materialize_with_numba)


# ----------------------------------------------------------------------------------- the blend


class Blend:
    """A blend of ``len(weights)`` datasets into ``size`` samples, readable at any position.

    Args:
        weights: per-sample weights, one per dataset (the share of the blend's *samples*; see
            ``tokenloom.index.blend_spec`` to convert token shares). Normalised by their sum.
        size: number of samples in the blend, at most :data:`MAX_BLEND_SIZE`.
        seed: when given, positions are shuffled within each window of ``window`` positions.
        window: positions per shuffled window (e.g. one global batch); required with a seed.
        names: optional dataset names, used in error and warning messages.
        backend: ``"auto"``, ``"numba"`` or ``"numpy"``; the results are identical.

    Raises ConfigError for negative, NaN, infinite or all-zero weights (naming the dataset) and
    warns (``UserWarning``) for each positive weight that gets no sample.
    """

    def __init__(self, weights, size: int, *, seed: int | None = None, window: int | None = None,
                 names: Sequence[str] | None = None, backend: str = "auto") -> None:
        w = _check_weights(weights, names)
        check_int("size", size, minimum=0, maximum=MAX_BLEND_SIZE,
                  expected=f"an integer number of samples in [0, {MAX_BLEND_SIZE}]")
        if seed is not None:
            if not is_integer(seed) or not 0 <= int(seed) < 1 << 64:
                raise ConfigError(f"seed={seed!r}; expected an integer in [0, 2**64)")
            if not is_integer(window) or int(window) < 1:
                raise ConfigError(
                    f"window={window!r} with seed={seed}; a seeded blend shuffles within windows, so "
                    "give window as a positive number of samples (e.g. the global batch size)"
                )
        elif window is not None:
            raise ConfigError(f"window={window!r} without a seed; windows only matter for a seeded blend")
        self.weights: np.ndarray = w / w.sum()
        """``(D,)`` float64 normalised per-sample weights."""
        self.size: int = int(size)
        """Samples in the blend."""
        self.seed: int | None = None if seed is None else int(seed)
        """Seed of the within-window shuffle, or None for the closed-form order."""
        self.window: int | None = None if window is None else int(window)
        """Positions per shuffled window."""
        self.backend: str = resolve_backend(backend, BACKENDS, fallback="numpy")
        """Kernel backend in use (a key of :data:`BACKENDS`)."""
        self.counts: np.ndarray = largest_remainder_counts(self.weights, self.size)
        """``(D,)`` int64 samples per dataset (largest remainder), summing to ``size``."""
        starved = np.flatnonzero((self.counts == 0) & (self.weights > 0))
        if len(starved) and self.size > 0:
            label = lambda d: f"dataset {d}" + (f" ({names[d]!r})" if names is not None else "")  # noqa: E731
            listed = ", ".join(f"{label(int(d))} with weight {float(w[d]):.6g}" for d in starved[:10])
            more = f" and {len(starved) - 10} more" if len(starved) > 10 else ""
            warnings.warn(
                f"{len(starved)} dataset(s) with a positive weight get 0 of {self.size} samples: "
                f"{listed}{more}; raise the weight or the blend size if they should appear",
                UserWarning,
                stacklevel=2,
            )
        (self._node_count, self._left_count, self._left, self._right, self._root) = _huffman_tree(self.counts)
        safe = np.maximum(self._node_count, 1)
        self._ratio = self._left_count / safe  # (nodes,) float64, C_a / C_v
        self._half = (self._node_count // 2) / safe  # (nodes,) float64, h_v / C_v
        self._window_keys = None if seed is None else _window_keys(int(seed), _WINDOW_ROUNDS)

    @cached_property
    def prefix_bound(self) -> np.ndarray:
        """``(D,)`` float64: every prefix of length L holds dataset d within this many samples of
        ``L * counts[d] / size`` (always < 2; 0 for datasets without samples). Computed on first
        use: a walk of every dataset's path, which reading the blend never needs."""
        return _prefix_bounds(self.counts, self._node_count, self._left, self._right, self._root)

    @property
    def num_datasets(self) -> int:
        """Number of datasets, including those with no samples."""
        return int(self.weights.shape[0])

    @property
    def dataset_id_dtype(self) -> np.dtype:
        """dtype of :meth:`materialize`'s dataset ids (int16, or int32 from 32767 datasets)."""
        return dataset_id_dtype(self.num_datasets)

    def __len__(self) -> int:
        return self.size

    def __repr__(self) -> str:
        return f"Blend(num_datasets={self.num_datasets}, size={self.size}, seed={self.seed}, window={self.window})"

    # ------------------------------------------------------------------------------- reading

    def _unshuffled(self, positions: np.ndarray) -> np.ndarray:
        """Map blend positions to positions of the unseeded order (identity without a seed)."""
        if self.seed is None:
            return positions
        window = self.window
        index = positions // window  # (n,) int64
        offset = positions - index * window
        out = np.empty_like(positions)
        last = (self.size - 1) // window
        last_length = self.size - last * window
        full = index != last
        for mask, length in ((full, window), (~full, last_length)):
            if np.any(mask):
                permuted = _window_permute_numpy(offset[mask], index[mask], length, self._window_keys)
                out[mask] = index[mask] * window + permuted
        return out

    def _walk(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        dataset_ids = np.empty(positions.shape[0], dtype=np.int64)
        sample_ids = np.empty(positions.shape[0], dtype=np.int64)
        if self._root < 0:  # one dataset has every sample
            dataset_ids[:] = -self._root - 1
            sample_ids[:] = positions
        else:
            BACKENDS[self.backend].lookup(positions, self._node_count, self._left_count, self._ratio, self._half,
                                          self._left, self._right, self._root, dataset_ids, sample_ids)
        return dataset_ids, sample_ids

    def lookup(self, positions) -> tuple[np.ndarray, np.ndarray]:
        """``(dataset_ids, sample_ids)`` at blend ``positions``, int64 arrays of their shape.

        O(tree depth) per position, with no per-position table: the mean depth is at most
        ``log2(D) + 1``.
        """
        p = np.asarray(positions)
        if p.dtype.kind not in "iu":
            raise ConfigError(f"positions must be integers, got dtype {p.dtype}")
        flat = p.reshape(-1).astype(np.int64)  # (n,) int64
        if flat.shape[0] and (flat.min() < 0 or flat.max() >= self.size):
            raise ConfigError(
                f"positions must lie in [0, {self.size}); got values in [{flat.min()}, {flat.max()}]"
            )
        dataset_ids, sample_ids = self._walk(self._unshuffled(flat))
        return dataset_ids.reshape(p.shape), sample_ids.reshape(p.shape)

    def positions_of(self, dataset_ids, sample_ids) -> np.ndarray:
        """Blend positions of ``(dataset, sample)`` pairs: the inverse of :meth:`lookup`.

        Walks each pair up the tree from its dataset's leaf, O(tree depth) per pair: at a node
        with ``c_v`` samples whose left child has ``c_a``, the left child's slot ``k`` is the node's
        slot ``ceil(((k + 1) c_v - c_v // 2) / c_a) - 1`` and the right child's slot ``k`` is
        ``(c_v // 2 + k c_v) // (c_v - c_a)`` (the slots the walk down sends each way, solved for
        the slot). Then the seeded order's window permutation is undone. int64, shaped like the ids.
        """
        d = np.asarray(dataset_ids)
        s = np.asarray(sample_ids)
        if d.dtype.kind not in "iu" or s.dtype.kind not in "iu" or d.shape != s.shape:
            raise ConfigError(f"dataset_ids {d.shape} {d.dtype} and sample_ids {s.shape} {s.dtype}; expected "
                              "integer arrays of one shape")
        flat_d, flat_s = d.reshape(-1).astype(np.int64), s.reshape(-1).astype(np.int64)
        if flat_d.shape[0]:
            if flat_d.min() < 0 or flat_d.max() >= self.num_datasets:
                raise ConfigError(f"dataset ids span [{flat_d.min()}, {flat_d.max()}]; the blend has "
                                  f"{self.num_datasets} datasets")
            over = np.flatnonzero((flat_s < 0) | (flat_s >= self.counts[flat_d]))
            if over.shape[0]:
                k = int(over[0])
                raise ConfigError(f"sample {int(flat_s[k])} of dataset {int(flat_d[k])}: the blend takes "
                                  f"{int(self.counts[flat_d[k]])} samples of it, so expected a sample in "
                                  f"[0, {int(self.counts[flat_d[k]])})")
        slot = flat_s.copy()
        if self._root >= 0:
            parent, is_left = self._parents()
            node = -flat_d - 1  # (n,) the leaf of each pair's dataset
            active = np.arange(slot.shape[0])
            while active.shape[0]:
                child = node[active]
                index = np.where(child < 0, len(self._node_count) - child - 1, child)  # leaves after nodes
                up = parent[index]
                going = up >= 0
                active, up, left_side, k = active[going], up[going], is_left[index[going]], slot[active[going]]
                c_v, c_a = self._node_count[up], self._left_count[up]
                half = c_v // 2
                from_left = ((k + 1) * c_v - half + c_a - 1) // c_a - 1
                from_right = (half + k * c_v) // np.maximum(c_v - c_a, 1)
                slot[active] = np.where(left_side, from_left, from_right)
                node[active] = up
        if self.seed is not None and slot.shape[0]:
            window = self.window
            index = slot // window
            offset = slot - index * window
            last = (self.size - 1) // window
            last_length = self.size - last * window
            full = index != last
            for mask, length in ((full, window), (~full, last_length)):
                if np.any(mask):
                    slot[mask] = index[mask] * window + _window_unpermute_numpy(offset[mask], index[mask], length,
                                                                                self._window_keys)
        return slot.reshape(d.shape)

    def samples_before(self, dataset_ids, lengths) -> np.ndarray:
        """Samples of dataset ``dataset_ids[i]`` among the first ``lengths[i]`` positions of the
        blend (int64, shaped like the ids): the rank query of a blend interleaved with another
        (:mod:`tokenloom.index.schedule`'s ramps).

        Walks each dataset's path down from the root, O(tree depth): of a node's first ``m``
        slots, its left child gets ``(m * C_a + C_v // 2) // C_v`` (the slots the walk down sends
        left) and its right child the rest. Only the unseeded order: a seeded blend's windows
        reorder positions, so a prefix of it holds other samples (ConfigError).
        """
        if self.seed is not None:
            raise ConfigError(f"samples_before counts a prefix of the unseeded order; this blend shuffles windows "
                              f"(seed={self.seed}), so a prefix holds other samples")
        d, m = np.asarray(dataset_ids), np.asarray(lengths)
        if d.dtype.kind not in "iu" or m.dtype.kind not in "iu" or d.shape != m.shape:
            raise ConfigError(f"dataset_ids {d.shape} {d.dtype} and lengths {m.shape} {m.dtype}; expected "
                              "integer arrays of one shape")
        flat_d, out = d.reshape(-1).astype(np.int64), m.reshape(-1).astype(np.int64)  # (n,) each
        if flat_d.shape[0] and (flat_d.min() < 0 or flat_d.max() >= self.num_datasets):
            raise ConfigError(f"dataset ids span [{flat_d.min()}, {flat_d.max()}]; the blend has "
                              f"{self.num_datasets} datasets")
        if out.shape[0] and (out.min() < 0 or out.max() > self.size):
            raise ConfigError(f"lengths span [{out.min()}, {out.max()}]; expected prefixes of [0, {self.size}] "
                              "positions")
        if self._root < 0:  # one dataset (or none) has every sample
            return np.where(flat_d == -self._root - 1, out, 0).reshape(d.shape)
        if getattr(self, "_path_arrays", None) is None:
            self._path_arrays = _dataset_paths(self.counts, *self._parents(), len(self._node_count))
        out[self.counts[flat_d] == 0] = 0
        _count_down(*self._path_arrays, self._node_count, self._left_count, flat_d, out)
        return out.reshape(d.shape)

    def _parents(self) -> tuple[np.ndarray, np.ndarray]:
        """Per internal node then per dataset leaf (``nodes + d``): its parent (-1: the root or no
        samples) and whether it is its parent's left child."""
        if getattr(self, "_parent_arrays", None) is None:
            nodes = len(self._node_count)
            parent = np.full(nodes + self.num_datasets, -1, dtype=np.int64)
            is_left = np.zeros(nodes + self.num_datasets, dtype=bool)
            for v in range(nodes):
                for child, left in ((self._left[v], True), (self._right[v], False)):
                    index = child if child >= 0 else nodes - child - 1
                    parent[index] = v
                    is_left[index] = left
            self._parent_arrays = (parent, is_left)
        return self._parent_arrays

    def materialize(self, *, threads: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """The whole blend: ``(dataset_ids, sample_ids)``, ``(size,)`` int16 (int32 from 32767
        datasets) and ``(size,)`` int64, the arrays megatron-core's BlendedDataset holds.

        ``threads > 1`` (numba) fills that many ranges of positions at once; same arrays."""
        threads = check_positive_int("threads", threads)
        dataset_ids = np.empty(self.size, dtype=self.dataset_id_dtype)
        sample_ids = np.empty(self.size, dtype=np.int64)
        if self.seed is not None:
            for start in range(0, self.size, _CHUNK):
                positions = np.arange(start, min(self.size, start + _CHUNK), dtype=np.int64)
                d, s = self._walk(self._unshuffled(positions))
                dataset_ids[start : start + len(positions)] = d
                sample_ids[start : start + len(positions)] = s
        elif self._root < 0:
            dataset_ids[:] = -self._root - 1
            sample_ids[:] = np.arange(self.size)
        else:
            BACKENDS[self.backend].materialize(self, dataset_ids, sample_ids, threads)
        return dataset_ids, sample_ids
