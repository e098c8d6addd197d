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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tokenloom.errors import ConfigError
from tokenloom.index.blend_spec import DEFAULT_SURPLUS, megatron_sizes
from tokenloom.index.megatron_blend import megatron_blend, megatron_dataset_id_dtype
from tokenloom.index.phase_order import RampSplit
from tokenloom.index.schedule import SchedulePlan

__all__ = ["ExactPhase", "ExactPhaseBlends", "GreedyPart", "exact_buffers", "exact_phase_blends",
           "plan_exact_phases"]


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
    docstring). Pure arithmetic; ConfigError for a plan that :meth:`SchedulePlan.split_at` changed,
    whose later weights are stateless mode's alone (megatron-core has no mid-blend change)."""
    if plan.splits:
        raise ConfigError(f"the plan was split at positions {[s.position for s in plan.splits]}; exact mode blends "
                          "the declared phases only (a weight change is a stateless blend)")
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
    offsets = np.concatenate([np.zeros((1, counts.shape[1]), np.int64), np.cumsum(counts, axis=0)])
    return ExactPhaseBlends(phases=phases, dataset_index=tuple(d for d, _ in built),
                            dataset_sample_index=tuple(s for _, s in built), counts=counts, offsets=offsets)
