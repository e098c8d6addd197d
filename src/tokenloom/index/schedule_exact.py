"""A schedule in exact mode: megatron-core's greedy blend per phase, each dataset numbered on.

Phase ``k``'s arrays are megatron-core's ``build_blending_indices`` (:func:`megatron_blend`) over
the phase's *active* datasets, those with a positive weight, with the ids mapped back to the
schedule's union. The compression is needed twice over: megatron-core asserts positive weights,
and its greedy would *pick* a zero-weight dataset on a tie (weights ``(0, .5, .5)`` at step 2: all
errors are 0 and the lowest id wins).

Sizes, as megatron-core sizes a blend: the active weights are normalised (``megatron_sizes``) and
the greedy runs on their second normalisation (``blend_weights``), as ``BlendedDataset`` does;
every phase but the last runs over exactly its ``S_k`` positions (its end is a global-batch
boundary the later phases start from), the last over megatron's ``sum_d ceil(S_last * w_d)``.
So a one-phase schedule gives today's arrays byte for byte. A linear ramp's from- and to-slots
(the stateless mode's :class:`~tokenloom.index.phase_order.RampSplit`, same ``V(L)``) are each a
greedy over their own active datasets, merged by ``V(L)``, numbered per dataset over the phase;
a ramp has no megatron-core counterpart, so as the last phase it keeps exactly ``S`` positions.

Numbering: each phase's greedy starts fresh (its own step 0) and numbers the samples of each
dataset from 0; ``offsets[k, d]``, dataset ``d``'s samples in the phases before ``k``, continue the
count. The offsets are kept beside the arrays, not added into them, so each phase's arrays stay
megatron-core's own (the differential tests compare them) and the phases build independently,
divided over ranks as one blend is today; the offsets are the phases' bincounts summed.

Each dataset's index holds megatron's buffer over the per-phase targets,
``ceil(sum_k ceil(S_k w_kd) * (1 + surplus))`` (:func:`exact_buffers`; one phase: today's).

**Divided over ranks** (:class:`ScheduleGreedy`, run by ``tokenloom.builder.divided`` as a single
blend's greedy is): a position maps to its phase and, within it, to a step of the phase's greedy
(a ramp's slot to a step of its from- or to-greedy, by ``V(L)``). The state at a position is the
phase's greedies' counts, exactly zero at every phase's start, so a rank's range is guessed only
at its first position and a range crossing a phase boundary starts the next phase from the exact
state. Ranges are computed *raw* (each greedy's own dataset ids and sample numbers) so that they
can be repaired as one greedy's range is; once every phase's final counts are known (the offsets),
:meth:`ScheduleGreedy.finish` turns each block into the stored form, the split's ids and the
samples numbered on, the same bytes as :func:`exact_phase_blends` laid end to end.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from tokenloom.errors import ConfigError
from tokenloom.index.blend_spec import DEFAULT_SURPLUS, megatron_sizes
from tokenloom.index.kernels import compiled_on_call, jit, numba_available, resolve_backend
from tokenloom.index.megatron_blend import MegatronGreedy, RangeRun, megatron_blend, megatron_dataset_id_dtype
from tokenloom.index.phase_order import RampSplit
from tokenloom.index.schedule import SchedulePlan

__all__ = ["ExactPhase", "ExactPhaseBlends", "GreedyPart", "ScheduleGreedy", "exact_buffers",
           "exact_phase_blends", "phase_offsets", "plan_exact_phases", "run_draws", "split_tables"]


@dataclass(frozen=True, kw_only=True, eq=False)
class GreedyPart:
    """One run of megatron-core's greedy: a constant phase, or one kind of a ramp's slots."""

    datasets: np.ndarray
    """``(A,)`` int64: the union ids of the active datasets (positive weight), ascending."""
    weights: tuple[float, ...]
    """``A``: the weights the greedy runs on (megatron's two normalisations of the active ones)."""
    size: int
    """Greedy steps, the part's positions."""
    targets: np.ndarray
    """``(A,)`` int64: ``ceil(S * w_d)``, the samples megatron-core sizes each dataset for."""

    @classmethod
    def of(cls, weights, size: int, *, megatron_sized: bool) -> GreedyPart:
        """The part over the positive ``weights`` (the union's, any scale) for a phase of ``size``
        samples: ``size`` steps, or megatron's blended size when ``megatron_sized``."""
        w = np.asarray(weights, dtype=np.float64)  # (D,)
        active = np.flatnonzero(w > 0)
        sizes = megatron_sizes(w[active], size)
        return cls(datasets=active.astype(np.int64), weights=sizes.blend_weights,
                   size=sizes.blended_size if megatron_sized else int(size),
                   targets=np.array(sizes.targets, dtype=np.int64))

    def build(self, num_datasets: int, *, backend: str = "auto", threads: int = 1,
              allow_beyond_megatron: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """``(dataset_index, dataset_sample_index)``: megatron-core's arrays over the active
        datasets, dataset ids mapped to the union's (its int16, or int32 from 32767 datasets)."""
        local, samples = megatron_blend(np.array(self.weights, dtype=np.float64), self.size, backend=backend,
                                        threads=threads, allow_beyond_megatron=allow_beyond_megatron)
        return self.datasets[local].astype(megatron_dataset_id_dtype(num_datasets)), samples


@dataclass(frozen=True, kw_only=True, eq=False)
class ExactPhase:
    """How one phase is blended in exact mode (sizing only: :meth:`build` runs the greedy)."""

    phase: int
    """The phase, 0-based."""
    start: int
    """The run's position of the phase's first sample."""
    num_datasets: int
    """Datasets of the schedule's union."""
    parts: tuple[GreedyPart, ...]
    """One greedy for a constant phase; a ramp's from-slots then its to-slots."""
    ramp: RampSplit | None
    """The ramp whose ``V(L)`` merges the two parts; None for a constant phase."""

    @property
    def size(self) -> int:
        """Positions of the phase's arrays."""
        return sum(part.size for part in self.parts)

    @property
    def targets(self) -> np.ndarray:
        """``(D,)`` int64: megatron's per-dataset targets of the phase (its parts' summed)."""
        out = np.zeros(self.num_datasets, dtype=np.int64)
        for part in self.parts:
            out[part.datasets] += part.targets
        return out

    def build(self, *, backend: str = "auto", threads: int = 1,
              allow_beyond_megatron: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """``(dataset_index, dataset_sample_index)`` of the phase, ``(size,)`` each: a constant
        phase's are megatron-core's own (ids mapped to the union); a ramp's two greedies are
        placed on their slots and each dataset's samples numbered over the phase."""
        built = [part.build(self.num_datasets, backend=backend, threads=threads,
                            allow_beyond_megatron=allow_beyond_megatron) for part in self.parts]
        if self.ramp is None:
            return built[0]
        lengths = np.arange(self.size + 1, dtype=np.int64)
        is_to = np.diff(self.ramp.to_slots(lengths)) > 0  # (S,) the to-slots
        dataset_index = np.empty(self.size, dtype=built[0][0].dtype)
        dataset_index[~is_to], dataset_index[is_to] = built[0][0], built[1][0]
        # each dataset's samples numbered in order: its rank among the positions that hold it
        order = np.argsort(dataset_index, kind="stable")  # (S,)
        counts = np.bincount(dataset_index, minlength=self.num_datasets)
        first = np.cumsum(counts) - counts  # (D,) where each dataset's run starts in `order`
        sample_index = np.empty(self.size, dtype=np.int64)
        sample_index[order] = np.arange(self.size, dtype=np.int64) - np.repeat(first, counts)
        return dataset_index, sample_index


def plan_exact_phases(plan: SchedulePlan) -> tuple[ExactPhase, ...]:
    """Each phase of ``plan`` as megatron-core's greedy over its active datasets (see the module
    docstring). Pure arithmetic."""
    phases = plan.schedule.phases
    out = []
    for k, phase in enumerate(phases):
        size, ramp = plan.phase_length(k), plan.ramps[k]
        if ramp is None:
            parts = (GreedyPart.of(phase.weights, size, megatron_sized=k == len(phases) - 1),)
        else:
            parts = (GreedyPart.of(phases[k - 1].weights, size - ramp.to_samples, megatron_sized=False),
                     GreedyPart.of(phase.weights, ramp.to_samples, megatron_sized=False))
        out.append(ExactPhase(phase=k, start=plan.boundaries[k], num_datasets=plan.num_datasets, parts=parts,
                              ramp=ramp))
    return tuple(out)


def exact_buffers(phases: tuple[ExactPhase, ...], *, surplus: float = DEFAULT_SURPLUS) -> np.ndarray:
    """``(D,)`` int64: samples to build each dataset with, megatron's buffer over its summed
    targets, ``ceil(sum_k ceil(S_k w_kd) * (1 + surplus))``; one phase gives today's buffers."""
    if not math.isfinite(surplus) or surplus < 0:
        raise ConfigError(f"surplus={surplus!r}; expected a finite, non-negative fraction such as 0.005")
    totals = sum(phase.targets for phase in phases)
    return np.array([math.ceil(int(t) * (1 + surplus)) for t in totals], dtype=np.int64)


@dataclass(frozen=True, kw_only=True, eq=False)
class ExactPhaseBlends:
    """Every phase's arrays in exact mode, with the offsets that number each dataset on."""

    phases: tuple[ExactPhase, ...]
    """The phases' sizing."""
    dataset_index: tuple[np.ndarray, ...]
    """Per phase, ``(size_k,)`` int16 (int32 from 32767 datasets): the union's dataset ids."""
    dataset_sample_index: tuple[np.ndarray, ...]
    """Per phase, ``(size_k,)`` int64: each dataset's samples numbered from 0 within the phase."""
    counts: np.ndarray
    """``(P, D)`` int64: samples of each dataset in each phase (the arrays' bincounts)."""
    offsets: np.ndarray
    """``(P + 1, D)`` int64: samples of each dataset before each phase; the last row its total."""

    @property
    def num_samples(self) -> int:
        """Positions of the run (the last phase's megatron size included)."""
        return self.phases[-1].start + self.phases[-1].size

    def locate(self, positions) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(phase, dataset, sample)`` int64 at the run's ``positions``: the phase's arrays, the
        sample number continued by :attr:`offsets`."""
        p = np.asarray(positions)
        if p.dtype.kind not in "iu":
            raise ConfigError(f"positions must be integers, got dtype {p.dtype}")
        flat = p.reshape(-1).astype(np.int64)
        if flat.size and (flat.min() < 0 or flat.max() >= self.num_samples):
            raise ConfigError(f"positions span [{flat.min()}, {flat.max()}]; the schedule serves "
                              f"[0, {self.num_samples})")
        starts = np.array([phase.start for phase in self.phases[1:]], dtype=np.int64)
        phases = np.searchsorted(starts, flat, side="right")
        datasets, samples = np.empty_like(flat), np.empty_like(flat)
        for k in np.unique(phases).tolist():
            mask = phases == k
            local = flat[mask] - self.phases[k].start
            d = self.dataset_index[k][local].astype(np.int64)
            datasets[mask], samples[mask] = d, self.dataset_sample_index[k][local] + self.offsets[k, d]
        return phases.reshape(p.shape), datasets.reshape(p.shape), samples.reshape(p.shape)


def exact_phase_blends(plan: SchedulePlan, *, backend: str = "auto", threads: int = 1,
                       allow_beyond_megatron: bool = False) -> ExactPhaseBlends:
    """Every phase of ``plan`` blended by megatron-core's greedy (:func:`plan_exact_phases`), in
    one process, with the offsets table. A distributed build makes the same arrays phase by phase
    (each :meth:`ExactPhase.build`) and sums the recorded bincounts into the offsets."""
    phases = plan_exact_phases(plan)
    built = [phase.build(backend=backend, threads=threads, allow_beyond_megatron=allow_beyond_megatron)
             for phase in phases]
    counts = np.stack([np.bincount(d, minlength=plan.num_datasets) for d, _ in built]).astype(np.int64)  # (P, D)
    offsets = phase_offsets(counts)
    return ExactPhaseBlends(phases=phases, dataset_index=tuple(d for d, _ in built),
                            dataset_sample_index=tuple(s for _, s in built), counts=counts, offsets=offsets)


def split_tables(num_phases: int, num_datasets: int, served, columns=None) -> tuple[np.ndarray, np.ndarray]:
    """Where each (phase, union dataset)'s samples go in the split: ``(split_ids, run_start)``,
    ``(P, D)`` int64 each. Without ``columns`` the split's datasets are ``served`` (union ids, in
    the split's order) and every dataset numbers on from phase 0. With ``columns``, ``(store,
    phases)`` per dataset of the split (a store's length runs, FORMAT.md "Length runs"), phase ``k``'s
    samples of store ``d`` go to the run holding ``k``, numbered from that run's first phase
    (``run_start``), so each run counts ``0..n - 1``; -1 where the split has none."""
    split_ids = np.full((num_phases, num_datasets), -1, dtype=np.int64)
    run_start = np.zeros((num_phases, num_datasets), dtype=np.int64)
    if columns is None:
        split_ids[:, np.asarray(served, dtype=np.int64)] = np.arange(len(served), dtype=np.int64)
        return split_ids, run_start
    for c, (d, phases) in enumerate(columns):
        phases = np.asarray(phases, dtype=np.int64)
        split_ids[phases, d], run_start[phases, d] = c, phases[0]
    return split_ids, run_start


def run_draws(offsets: np.ndarray, split_ids: np.ndarray, run_start: np.ndarray) -> np.ndarray:
    """``(datasets of the split,)`` int64: the samples the greedies draw of each, from the union's
    ``offsets`` ``(P + 1, D)`` and :func:`split_tables`."""
    num = int(split_ids.max()) + 1 if split_ids.size else 0
    out = np.zeros(max(num, 0), dtype=np.int64)
    phases, datasets = np.nonzero(split_ids >= 0)
    np.add.at(out, split_ids[phases, datasets], offsets[phases + 1, datasets] - offsets[phases, datasets])
    return out


def phase_offsets(counts: np.ndarray) -> np.ndarray:
    """``(P + 1, D)`` int64: each dataset's samples before each phase, from the ``(P, D)`` samples
    of each phase; the last row its totals."""
    counts = np.asarray(counts, dtype=np.int64)
    return np.concatenate([np.zeros((1, counts.shape[1]), np.int64), np.cumsum(counts, axis=0)])


@jit(nogil=True, cache=True)
def _ramp_flags_kernel(run_step, run_sample, run_size, run_sum, num_steps, lo, hi, out):
    """``out[i] = V(lo + i + 1) > V(lo + i)``: which of a ramp's positions ``[lo, hi)`` are
    to-slots; returns ``V(lo)``. :meth:`RampSplit.alpha_sums` at ``lo``, then its sum moved on by
    ``2j + 1`` per position (``j`` the position's step), so no array of sums is ever made (the
    vectorised :meth:`RampSplit.to_slots` would make several per block)."""
    r = np.searchsorted(run_sample, lo, side="right") - 1
    j = run_step[r] + (lo - run_sample[r]) // run_size[r]  # the step of position lo
    before = run_sample[r] + (j - run_step[r]) * run_size[r]  # positions before step j
    sums = run_sum[r] + run_size[r] * (j * j - run_step[r] * run_step[r]) + (lo - before) * (2 * j + 1)
    two_j = 2 * num_steps
    first = (sums + num_steps) // two_j
    v = first
    last_run = run_sample.shape[0] - 1
    for i in range(hi - lo):
        sums += 2 * j + 1
        position = lo + i + 1
        if position - before == run_size[r]:  # the next position opens step j + 1
            before = position
            j += 1
            if r < last_run and position >= run_sample[r + 1]:
                r += 1
        following = (sums + num_steps) // two_j
        out[i] = following > v
        v = following
    return first


@jit(nogil=True, cache=True)
def _finish_kernel(dataset, sample, is_to, from_ids, to_ids, renumber, before, shift, split_ids):
    """Raw positions of one phase made final in place: each greedy's id (``is_to`` picks a ramp's
    to-greedy; empty for a constant phase) to the union's, then to the split's; the sample
    ``before[u] + shift[u]`` with ``before`` counted on (a ramp: numbered over both greedies),
    else the greedy's own plus ``shift[u]``."""
    ramp = is_to.shape[0] > 0
    for i in range(dataset.shape[0]):
        local = dataset[i]
        u = to_ids[local] if ramp and is_to[i] else from_ids[local]
        if renumber:
            sample[i] = before[u] + shift[u]
            before[u] += 1
        else:
            sample[i] += shift[u]
        dataset[i] = split_ids[u]


class _ScheduleKernels(NamedTuple):
    ramp_flags: Callable
    finish: Callable


#: The schedule's kernels by backend (identical results): numba compiles them on first call.
_KERNELS = {"python": _ScheduleKernels(_ramp_flags_kernel, _finish_kernel)}
if numba_available():
    _KERNELS["numba"] = _ScheduleKernels(compiled_on_call(_ramp_flags_kernel), compiled_on_call(_finish_kernel))


class ScheduleGreedy:
    """Every phase's greedy laid end to end as one run over the blend's positions, with the
    contract a divided build asks of :class:`~tokenloom.index.megatron_blend.MegatronGreedy`
    (:meth:`guess`, :meth:`fill`, :meth:`repair`, :meth:`carry`, :attr:`restarts`), so each rank
    computes a range of positions and repairs it as it would a single blend's.

    The state at a position of phase ``k`` is the counts of phase ``k``'s greedies there, over
    their active datasets (a ramp's from-greedy's then its to-greedy's, concatenated): exactly zero
    at the phase's start (:attr:`restarts`, where :meth:`carry` drops the phase before's counts), so
    only a range's first position is ever guessed. :meth:`fill` and :meth:`repair` take ranges
    within one phase (the build cuts its windows at :attr:`restarts`) and write *raw* arrays: each
    greedy's own dataset ids and sample numbers, which a repair replays. :meth:`finish` writes the
    stored form once the phases' totals are known: ids over the split's stores, samples numbered
    over the phase (a ramp's two greedies merged) plus the phase's offsets.
    """

    def __init__(self, phases: tuple[ExactPhase, ...], served, *, columns=None, backend: str = "auto",
                 allow_beyond_megatron: bool = False) -> None:
        self.phases = phases
        self.num_datasets = phases[0].num_datasets
        """Datasets of the schedule's union."""
        self.starts = np.array([phase.start for phase in phases], dtype=np.int64)  # (P,)
        self.phase_ends = tuple(int(phase.start + phase.size) for phase in phases)
        """Each phase's end position (the next one's start; the last, the blend's size)."""
        self.size = self.phase_ends[-1]
        self.restarts = tuple(int(start) for start in self.starts[1:])
        self._greedies = [tuple(MegatronGreedy.for_weights(np.array(part.weights, dtype=np.float64), backend=backend,
                                                           allow_beyond_megatron=allow_beyond_megatron)
                                for part in phase.parts) for phase in phases]
        # (P, D) the split's id of each union dataset in each phase, and the phase its numbering starts
        # from (a length run's first; ``columns``: :func:`split_tables`)
        self.split_ids, self.run_start = split_tables(len(phases), self.num_datasets, served, columns)
        """``(P, D)`` int64 each: :func:`split_tables` of the split's datasets."""
        self._num_ids = max(self.num_datasets, int(self.split_ids.max()) + 1)
        self._split_ids = self.split_ids.astype(self.dataset_id_dtype)
        self._every = np.arange(self.num_datasets)
        self._kernels = _KERNELS[resolve_backend(backend, _KERNELS, fallback="python")]
        self._no_flags = np.zeros(0, dtype=np.bool_)
        self._no_before = np.zeros(0, dtype=np.int64)

    @property
    def dataset_id_dtype(self) -> np.dtype:
        """The stored ids' dtype: the union's, as :meth:`GreedyPart.build` gives it (or the split's
        length runs', where they are more)."""
        return megatron_dataset_id_dtype(self._num_ids)

    def phase_of(self, position: int) -> int:
        """The phase holding ``position`` (the last phase for the blend's end)."""
        return min(int(np.searchsorted(self.starts, position, side="right")) - 1, len(self.phases) - 1)

    def _part_steps(self, k: int, lo: int, hi: int):
        """Phase ``k``'s local positions ``[lo, hi)`` as each greedy's steps: ``((from, to) step
        ranges, is_to)``, ``is_to`` ``(hi - lo,)`` bool the ramp's to-slots; a constant phase's
        one greedy's steps are the positions (``is_to`` None)."""
        ramp = self.phases[k].ramp
        if ramp is None:
            return ((lo, hi),), None
        is_to = np.empty(hi - lo, dtype=np.bool_)
        v0 = int(self._kernels.ramp_flags(ramp.run_step, ramp.run_sample, ramp.run_size, ramp.run_sum,
                                          ramp.num_steps, lo, hi, is_to))
        v1 = v0 + int(np.count_nonzero(is_to))
        return ((lo - v0, hi - v1), (v0, v1)), is_to

    def _split_state(self, k: int, counts: np.ndarray) -> list[np.ndarray]:
        """Phase ``k``'s state as its greedies' counts."""
        widths = [part.datasets.shape[0] for part in self.phases[k].parts]
        return np.split(np.asarray(counts, dtype=np.int64), np.cumsum(widths)[:-1])

    def _local(self, start: int, stop: int) -> tuple[int, int, int]:
        k = self.phase_of(start)
        lo, hi = start - int(self.starts[k]), stop - int(self.starts[k])
        if hi > self.phases[k].size:
            raise ConfigError(f"positions {start}..{stop} cross the start of phase {k + 2} at {self.phase_ends[k]}; "
                              "a range of the schedule's greedy lies within one phase (cut it at restarts)")
        return k, lo, hi

    def guess(self, position: int) -> np.ndarray:
        """The state at ``position``, guessed in closed form; exact (zero) at a phase's start."""
        k = self.phase_of(position)
        lo = position - int(self.starts[k])
        steps, _ = self._part_steps(k, lo, lo)
        return np.concatenate([g.guess(a) for g, (a, _) in zip(self._greedies[k], steps)])

    def carry(self, position: int, counts: np.ndarray) -> np.ndarray:
        """The state ``position`` starts from when the positions before ended in ``counts``: zero
        at a phase's start (each phase's greedy starts afresh), else ``counts``."""
        if position == 0 or position in self.restarts:
            return self.guess(position)
        return counts

    def fill(self, start: int, stop: int, out_dataset: np.ndarray, out_sample: np.ndarray, *,
             counts: np.ndarray | None = None, threads: int = 1) -> RangeRun:
        """Positions ``[start, stop)`` of one phase, raw, from ``counts`` (None: :meth:`guess`), as
        :meth:`MegatronGreedy.fill` does; a ramp's greedies each over their slots' steps."""
        k, lo, hi = self._local(start, stop)
        counts = self.guess(start) if counts is None else np.asarray(counts, dtype=np.int64)
        steps, is_to = self._part_steps(k, lo, hi)
        if is_to is None:
            return self._greedies[k][0].fill(lo, hi, out_dataset, out_sample, counts=counts, threads=threads)
        runs = []
        for greedy, (a, b), state, slots in zip(self._greedies[k], steps, self._split_state(k, counts),
                                                (~is_to, is_to)):
            part_dataset, part_sample = np.empty(b - a, dtype=out_dataset.dtype), np.empty(b - a, dtype=np.int64)
            runs.append(greedy.fill(a, b, part_dataset, part_sample, counts=state, threads=threads))
            out_dataset[slots], out_sample[slots] = part_dataset, part_sample
        return RangeRun(start_counts=np.concatenate([run.start_counts for run in runs]),
                        end_counts=np.concatenate([run.end_counts for run in runs]))

    def repair(self, start: int, stop: int, true_counts: np.ndarray, recorded_counts: np.ndarray,
               out_dataset: np.ndarray, out_sample: np.ndarray) -> np.ndarray | None:
        """:meth:`MegatronGreedy.repair` over positions ``[start, stop)`` of one phase (a ramp's
        greedies each over their slots); the new end state, or None when it is unchanged."""
        k, lo, hi = self._local(start, stop)
        steps, is_to = self._part_steps(k, lo, hi)
        if is_to is None:
            return self._greedies[k][0].repair(lo, hi, true_counts, recorded_counts, out_dataset, out_sample)
        ends, changed = [], False
        for greedy, (a, b), true, recorded, slots in zip(self._greedies[k], steps, self._split_state(k, true_counts),
                                                         self._split_state(k, recorded_counts), (~is_to, is_to)):
            part_dataset, part_sample = out_dataset[slots], out_sample[slots]  # copies: repaired, then put back
            end = greedy.repair(a, b, true, recorded, part_dataset, part_sample)
            if not np.array_equal(true, recorded):
                out_dataset[slots], out_sample[slots] = part_dataset, part_sample
            changed |= end is not None
            # the greedy's end from its true start: the slots now hold its true run
            ends.append(end if end is not None else
                        true + np.bincount(part_dataset.astype(np.int64), minlength=true.shape[0]))
        return np.concatenate(ends) if changed else None

    def phase_counts(self, end_states) -> np.ndarray:
        """``(P, D)`` int64: each phase's samples of each union dataset, from ``end_states[k]``,
        phase ``k``'s state at its end (its greedies' final counts)."""
        out = np.zeros((len(self.phases), self.num_datasets), dtype=np.int64)
        for k, phase in enumerate(self.phases):
            for part, counts in zip(phase.parts, self._split_state(k, end_states[k])):
                out[k, part.datasets] += counts
        return out

    def finish(self, start: int, stop: int, out_dataset: np.ndarray, out_sample: np.ndarray, counts: np.ndarray,
               offsets: np.ndarray) -> bool:
        """Turn raw positions ``[start, stop)`` (any phases) into the stored form in place: ids over
        the split's stores, each sample numbered over its phase plus ``offsets[k, d]`` (``(P + 1, D)``,
        :func:`phase_offsets`). ``counts``: the true state at ``start``. Returns whether anything
        changed (a first constant phase over the split's stores in order is stored as computed)."""
        changed = False
        for k in range(self.phase_of(start), len(self.phases)):
            lo, hi = max(start, int(self.starts[k])), min(stop, self.phase_ends[k])
            if lo >= hi:
                break
            dataset, sample = out_dataset[lo - start:hi - start], out_sample[lo - start:hi - start]
            parts = self.phases[k].parts
            shift = offsets[k] - offsets[self.run_start[k], self._every]  # (D,) samples before, in its run
            split_ids = self._split_ids[k]
            if len(parts) == 1:  # the greedy's own numbering is the phase's
                datasets = parts[0].datasets
                if shift[datasets].any() or not np.array_equal(split_ids[datasets], np.arange(datasets.shape[0])):
                    self._kernels.finish(dataset, sample, self._no_flags, datasets, datasets, False,
                                         self._no_before, shift, split_ids)
                    changed = True
                continue
            # a ramp: number each dataset's samples over both greedies' slots, from the state at lo
            state = counts if lo == start else self.guess(lo)
            _, is_to = self._part_steps(k, lo - int(self.starts[k]), hi - int(self.starts[k]))
            before = np.zeros(self.num_datasets, dtype=np.int64)  # (D,) the phase's samples before lo
            for part, part_counts in zip(parts, self._split_state(k, state)):
                before[part.datasets] += part_counts
            self._kernels.finish(dataset, sample, is_to, parts[0].datasets, parts[1].datasets, True, before,
                                 shift, split_ids)
            changed = True
        return changed
