"""The order of a schedule's samples: each phase a closed-form order, the run a list of stretches.

A *stretch* is a run of consecutive positions with one :class:`PhaseOrder`: a phase.

Constant order
    :class:`tokenloom.index.blend.Blend` over the stretch's counts (the largest remainder of its
    weights), the closed form of stateless mode, so a one-phase schedule is today's blend.
Linear ramp
    :class:`RampSplit` divides the phase's positions into *from*-slots and *to*-slots: among the
    first ``L`` positions ``V(L) = floor(M(L) + 1/2)`` are to-slots, ``M(L)`` the sum of ``alpha``
    over them (the integer ``2J * M(L)``, see :mod:`tokenloom.index.schedule`). Each kind of slot
    is a Blend of its own counts; a dataset's sample number at ``L`` adds its samples in the other
    kind of slot before ``L`` (``Blend.samples_before``).

Every query is closed form in the position, with no per-position array: locating and counting a
prefix walk one Huffman path (O(tree depth)); the inverse of a constant order walks it up
(``Blend.positions_of``); the inverse of a ramp is a binary search on ``L`` over the two blends'
``samples_before`` (O(log S x depth)): two interleaved blends have no closed-form inverse.

:class:`Segments` is the run as stretches ``[starts[g], starts[g + 1])``, each read from the first
position of its own order, with ``before[g, d]``, dataset ``d``'s samples before stretch ``g``, so
every dataset numbers its samples ``0, 1, 2, ...`` over the whole run. That table is all the state
a plan holds: ``G`` stretches cost ``O(G x D)``, a position finds its stretch by a binary search
(O(log G)) and a dataset's sample by one over its column of ``before``. A weight change at run
time is composed by serving at the stream level (``tokenloom.serve.weight_changes``), not here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from tokenloom.errors import ConfigError
from tokenloom.index.batch_sizes import StepRuns
from tokenloom.index.blend import Blend, largest_remainder_counts

__all__ = ["PhaseOrder", "RampSplit", "Segments", "plan_ramp"]

_MAX_RAMP_PRODUCT = 1 << 62  # 2J * S: the ramp's integer sums stay in int64
_PARTS = ("whole", "from", "to")


@dataclass(frozen=True, kw_only=True, eq=False)
class RampSplit:
    """How a linear-ramp phase divides into from-slots (the previous weights) and to-slots (its own)."""

    num_steps: int
    """``J``: optimizer steps the phase spans (a partial last step of the run counts)."""
    to_samples: int
    """``V(S)``: to-slots among the phase's samples; the other ``S - V(S)`` are from-slots."""
    from_counts: np.ndarray
    """``(D,)`` int64: ``LR(u, S - V(S))``, the from-slots' samples per dataset."""
    to_counts: np.ndarray
    """``(D,)`` int64: ``LR(v, V(S))``, the to-slots' samples per dataset."""
    from_weights: np.ndarray
    """``(D,)`` float64: ``u``, the previous phase's normalised weights."""
    to_weights: np.ndarray
    """``(D,)`` float64: ``v``, this phase's normalised weights."""
    run_step: np.ndarray
    """``(R,)`` int64: the phase's step index where each run of equal steps starts."""
    run_sample: np.ndarray
    """``(R,)`` int64: the phase's samples before each run."""
    run_size: np.ndarray
    """``(R,)`` int64: the global batch size of the run's steps."""
    run_sum: np.ndarray
    """``(R,)`` int64: ``sum of size_i * (2i + 1)`` over the phase's steps before each run."""

    def alpha_sums(self, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(2J * M(L), j)`` for phase prefixes ``lengths`` (int64, ``0 <= L <= S``): twice ``J``
        times the summed ``alpha`` of the first ``L`` positions, and the step of position ``L``."""
        r = np.searchsorted(self.run_sample, lengths, side="right") - 1
        j = self.run_step[r] + (lengths - self.run_sample[r]) // self.run_size[r]  # step of position L
        before = self.run_sample[r] + (j - self.run_step[r]) * self.run_size[r]  # samples before step j
        sums = self.run_sum[r] + self.run_size[r] * (j * j - self.run_step[r] ** 2) + (lengths - before) * (2 * j + 1)
        return sums, j

    def to_slots(self, lengths: np.ndarray) -> np.ndarray:
        """``V(L)``: to-slots among the phase's first ``lengths`` positions (round half up)."""
        sums, _ = self.alpha_sums(lengths)
        return (sums + self.num_steps) // (2 * self.num_steps)

    def alphas(self, positions: np.ndarray) -> np.ndarray:
        """``alpha_j = (2j + 1) / (2J)`` (float64) of the step holding each phase position: how far
        that step's target has moved from the previous weights to this phase's."""
        _, j = self.alpha_sums(positions)
        return (2 * j + 1) / (2 * self.num_steps)


def plan_ramp(from_weights: np.ndarray, to_weights: np.ndarray, runs: StepRuns, start: int, end: int, *,
              number: int) -> RampSplit:
    """The :class:`RampSplit` of a linear ramp over the run's positions ``[start, end)`` (phase
    ``number``, counted from 1, for errors), from normalised weights ``u`` to ``v``, on the steps
    of ``runs``. ConfigError when its integer sums would leave int64."""
    first, stop = int(runs.step_at(start)), int(runs.step_at(end - 1)) + 1
    num_steps, size = stop - first, end - start
    if 2 * num_steps * size >= _MAX_RAMP_PRODUCT:
        raise ConfigError(f"phase {number}: ramp over {num_steps} steps of {size} samples; the ramp's sums need "
                          f"2 x steps x samples below 2**62: make the phase shorter or its batches larger")
    run_step, run_sample, run_size, run_sum = [], [], [], []
    samples = total = 0
    for lo, hi, batch in runs.runs_between(first, stop):
        a, b = lo - first, hi - first
        run_step.append(a)
        run_sample.append(samples)
        run_size.append(batch)
        run_sum.append(total)
        samples += (b - a) * batch
        total += batch * (b * b - a * a)  # sum of (2i + 1) over i in [a, b) is b^2 - a^2
    as_array = lambda values: np.array(values, dtype=np.int64)  # noqa: E731
    zero = np.zeros(len(to_weights), dtype=np.int64)
    slots = RampSplit(num_steps=num_steps, to_samples=0, from_counts=zero, to_counts=zero, from_weights=from_weights,
                      to_weights=to_weights, run_step=as_array(run_step), run_sample=as_array(run_sample),
                      run_size=as_array(run_size), run_sum=as_array(run_sum))  # the slots, counts to come
    to_samples = int(slots.to_slots(np.array([size], dtype=np.int64))[0])
    return dataclasses.replace(
        slots, to_samples=to_samples,
        from_counts=largest_remainder_counts(from_weights, size - to_samples) if size > to_samples else zero,
        to_counts=largest_remainder_counts(to_weights, to_samples) if to_samples else zero)


@dataclass(frozen=True, kw_only=True, eq=False)
class PhaseOrder:
    """The closed-form order of one stretch: a constant blend, or a linear ramp's two blends
    interleaved. Positions and lengths are the stretch's own (0 is its first position)."""

    counts: np.ndarray
    """``(D,)`` int64: samples of each dataset over the whole order."""
    weights: np.ndarray
    """``(D,)`` float64, summing to one: the target mixture (a ramp's: where it ends, ``v``)."""
    ramp: RampSplit | None = None
    """A linear ramp's slots; None for a constant order."""

    def __post_init__(self) -> None:
        for array in (self.counts, self.weights):
            array.setflags(write=False)
        object.__setattr__(self, "_size", int(self.counts.sum()))
        object.__setattr__(self, "_blends", {})  # part -> Blend, made on first use

    @property
    def size(self) -> int:
        """Positions the order spans (its counts' sum)."""
        return self._size

    @classmethod
    def constant(cls, weights, size: int) -> PhaseOrder:
        """``size`` positions at ``weights`` (any positive scale): counts by largest remainder of the
        weights as given, the target their normalisation (as :class:`Blend` does both)."""
        w = np.asarray(weights, dtype=np.float64)  # (D,)
        return cls(counts=largest_remainder_counts(w, size), weights=w / w.sum())

    @classmethod
    def ramped(cls, split: RampSplit) -> PhaseOrder:
        """A linear ramp's order: its from- and to-slots' counts together."""
        return cls(counts=split.from_counts + split.to_counts, weights=split.to_weights, ramp=split)

    def blend(self, part: str = "whole") -> Blend | None:
        """The Blend ordering a constant order (``part="whole"``) or a ramp's from- or to-slots
        (``"from"``, ``"to"``); None when that part has no samples."""
        if part not in _PARTS or (part == "whole") != (self.ramp is None):
            expected = "'whole' (a constant order)" if self.ramp is None else "'from' or 'to' (a ramp)"
            raise ConfigError(f"part={part!r}; expected {expected}")
        if part not in self._blends:
            ramp = self.ramp
            counts = self.counts if ramp is None else ramp.from_counts if part == "from" else ramp.to_counts
            size = int(counts.sum())
            blend = None if size == 0 else Blend(counts.astype(np.float64), size)
            if blend is not None and not np.array_equal(blend.counts, counts):  # counts as weights give back counts
                raise ConfigError(f"a blend over counts {counts.tolist()} gave {blend.counts.tolist()}")
            self._blends[part] = blend
        return self._blends[part]

    def lookup(self, local: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(dataset, sample)`` int64 at ``local`` positions: the sample counted from the order's start."""
        ramp = self.ramp
        if ramp is None:
            return self.blend().lookup(local)
        sums, j = ramp.alpha_sums(local)
        to_before = (sums + ramp.num_steps) // (2 * ramp.num_steps)
        is_to = (sums + 2 * j + 1 + ramp.num_steps) // (2 * ramp.num_steps) > to_before
        d, s = np.empty_like(local), np.empty_like(local)
        for mask, mine, other, slots, other_slots in (
                (is_to, "to", "from", to_before, local - to_before),
                (~is_to, "from", "to", local - to_before, to_before)):
            if not mask.any():
                continue
            d[mask], s[mask] = self.blend(mine).lookup(slots[mask])
            other_blend = self.blend(other)
            if other_blend is not None:  # the dataset's samples in the other slots before this position
                s[mask] += other_blend.samples_before(d[mask], other_slots[mask])
        return d, s

    def samples_before(self, dataset_ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Samples of ``dataset_ids[i]`` among the order's first ``lengths[i]`` positions (int64)."""
        if self.ramp is None:
            return self.blend().samples_before(dataset_ids, lengths)
        to_slots = self.ramp.to_slots(lengths)
        out = np.zeros(dataset_ids.shape, dtype=np.int64)
        for part, slots in (("from", lengths - to_slots), ("to", to_slots)):
            blend = self.blend(part)
            if blend is not None:
                out += blend.samples_before(dataset_ids, slots)
        return out

    def counts_before(self, length: int) -> np.ndarray:
        """``(D,)`` int64: every dataset's samples among the order's first ``length`` positions."""
        num_datasets = self.counts.shape[0]
        return self.samples_before(np.arange(num_datasets, dtype=np.int64),
                                   np.full(num_datasets, length, dtype=np.int64))

    def positions_of(self, dataset_ids: np.ndarray, samples: np.ndarray) -> np.ndarray:
        """Local positions of the ``(dataset, sample)`` pairs (samples counted from the order's start):
        the inverse of :meth:`lookup`. A ramp: the smallest ``L`` whose first ``L + 1`` positions
        hold more than ``sample`` samples of the dataset, by bisection."""
        if self.ramp is None:
            return self.blend().positions_of(dataset_ids, samples)
        lo, hi = np.zeros_like(samples), np.full_like(samples, self.size - 1)
        while True:
            open_ = np.flatnonzero(lo < hi)
            if not open_.shape[0]:
                return lo
            mid = (lo[open_] + hi[open_]) // 2
            reached = self.samples_before(dataset_ids[open_], mid + 1) > samples[open_]  # sample at or before mid
            hi[open_] = np.where(reached, mid, hi[open_])
            lo[open_] = np.where(reached, lo[open_], mid + 1)

    def target_weights(self, local: np.ndarray) -> np.ndarray:
        """``(n, D)`` float64: the target mixture at each local position: the weights, or in a ramp
        ``(1 - alpha_j) u + alpha_j v`` of the step ``j`` holding the position."""
        if self.ramp is None:
            return np.broadcast_to(self.weights, (local.shape[0], self.weights.shape[0])).copy()
        alpha = self.ramp.alphas(local)[:, None]  # (n, 1)
        return (1 - alpha) * self.ramp.from_weights[None, :] + alpha * self.ramp.to_weights[None, :]

    def targets(self, lengths: np.ndarray) -> np.ndarray:
        """``(n, D)`` float64: each dataset's target count among the first ``lengths`` positions:
        ``L * counts / size``, or in a ramp ``u * (L - M(L)) + v * M(L)``."""
        ramp = self.ramp
        if ramp is None:
            return lengths[:, None] * (self.counts / self.size)[None, :]
        m = ramp.alpha_sums(lengths)[0] / (2 * ramp.num_steps)  # (n,) float64
        return (lengths - m)[:, None] * ramp.from_weights[None, :] + m[:, None] * ramp.to_weights[None, :]


@dataclass(frozen=True, kw_only=True, eq=False)
class Segments:
    """A run's positions as consecutive stretches, each ordered by a :class:`PhaseOrder` from its
    own first position, every dataset numbered on across them (see the module docstring)."""

    starts: np.ndarray
    """``(G + 1,)`` int64: each stretch's first position, then the run's end."""
    phases: np.ndarray
    """``(G,)`` int64: the declared phase (0-based) each stretch belongs to."""
    before: np.ndarray
    """``(G + 1, D)`` int64: samples of each dataset before each stretch; the last row the run's."""
    orders: tuple[PhaseOrder, ...]
    """``G``: each stretch's order."""

    def __post_init__(self) -> None:
        for array in (self.starts, self.phases, self.before):
            array.setflags(write=False)
        object.__setattr__(self, "_by_dataset", None)  # (D, G + 1) before.T, made on first use

    @classmethod
    def of_phases(cls, boundaries, orders: tuple[PhaseOrder, ...]) -> Segments:
        """One stretch per phase, each its whole order."""
        counts = np.stack([order.counts for order in orders])  # (P, D)
        before = np.concatenate([np.zeros((1, counts.shape[1]), np.int64), np.cumsum(counts, axis=0)])
        return cls(starts=np.asarray(boundaries, dtype=np.int64), phases=np.arange(len(orders), dtype=np.int64),
                   before=before, orders=tuple(orders))

    def served(self) -> np.ndarray:
        """``(G, D)`` int64: samples of each dataset in each stretch."""
        return np.diff(self.before, axis=0)

    def segment_of(self, positions: np.ndarray) -> np.ndarray:
        """The stretch holding each in-range position (O(log G) each)."""
        return np.searchsorted(self.starts[1:], positions, side="right")

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(segment, dataset, sample)`` int64 of flat in-range ``positions``."""
        segments = self.segment_of(positions)
        datasets, samples = np.empty_like(positions), np.empty_like(positions)
        for g in np.unique(segments).tolist():
            mask = segments == g
            d, s = self.orders[g].lookup(positions[mask] - self.starts[g])
            datasets[mask], samples[mask] = d, s + self.before[g, d]
        return segments, datasets, samples

    def positions_of(self, dataset: int, samples: np.ndarray) -> np.ndarray:
        """Positions of dataset ``dataset``'s flat in-range ``samples``: the stretch by a binary
        search of its column of :attr:`before`, then the stretch's order inverted."""
        if self._by_dataset is None:
            object.__setattr__(self, "_by_dataset", np.ascontiguousarray(self.before.T))
        column = self._by_dataset[dataset]  # (G + 1,)
        segments = np.searchsorted(column, samples, side="right") - 1  # the last stretch starting at or below
        out = np.empty_like(samples)
        for g in np.unique(segments).tolist():
            mask = segments == g
            local = samples[mask] - column[g]
            out[mask] = self.starts[g] + self.orders[g].positions_of(np.full(local.shape, dataset, np.int64), local)
        return out

    def target_weights(self, positions: np.ndarray) -> np.ndarray:
        """``(n, D)`` float64: the target mixture at flat in-range ``positions``."""
        segments = self.segment_of(positions)
        out = np.empty((positions.shape[0], self.before.shape[1]), dtype=np.float64)
        for g in np.unique(segments).tolist():
            mask = segments == g
            out[mask] = self.orders[g].target_weights(positions[mask] - self.starts[g])
        return out

    def reached(self, position: int) -> np.ndarray:
        """``(D,)`` int64: samples of each dataset before ``position`` (``0 <= position <= end``)."""
        if position == int(self.starts[-1]):
            return self.before[-1].copy()
        g = int(self.segment_of(np.array([position], dtype=np.int64))[0])
        return self.before[g] + self.orders[g].counts_before(position - int(self.starts[g]))
