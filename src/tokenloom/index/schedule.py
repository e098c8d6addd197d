"""Mixture schedules: one run's blend in phases, every dataset read on from where it stopped.

A :class:`MixtureSchedule` is a list of :class:`SchedulePhase` over one union of datasets: each
phase has weights (zero leaves a dataset out of it), an ``until`` (:class:`Until`), optionally
``ramp: linear`` and its own ``seq_length``. :func:`plan_schedule` turns it into a
:class:`SchedulePlan`, pure arithmetic on the config's numbers (no file is read):

Boundaries
    Phase ``k`` holds the run's sample positions ``[boundaries[k], boundaries[k + 1])``. ``until``
    counts from the run's start: ``samples`` as given; ``steps`` the samples those optimizer steps
    consume (through the batch-size schedule, :mod:`tokenloom.index.batch_sizes`); ``tokens`` the
    earlier phases' tokens at their own ``seq_length``, then ``ceil(rest / seq_length)`` samples of
    this phase. A boundary between two phases that falls inside an optimizer step moves **up** to
    that step's end (a phase never gets less than it asked for, and every phase but the last is
    whole global batches); the last phase's end is the run's ``train_samples`` and stays where it
    falls (megatron-core sizes the split by it; Megatron-LM trains its whole steps).

Counts, exact per phase
    A constant phase of ``S`` samples gives dataset ``d`` its ``largest_remainder_counts(w, S)``
    (:func:`tokenloom.index.blend.largest_remainder_counts`: ``floor(S * w_d)``, plus one for the
    largest fractional parts, ties to the lowest dataset id), so a weight of 1e-6 gets exactly the
    floor or the ceiling of ``1e-6 * S``. A linear ramp of ``J`` optimizer steps moves from the
    previous phase's weights ``u`` to its own ``v``: step ``j`` is ``alpha_j = (2j + 1) / (2J)`` of
    the way (the steps' midpoints). Its positions split into *from*-slots and *to*-slots: among
    its first ``L`` positions ``V(L) = floor(M(L) + 1/2)`` are to-slots, ``M(L)`` the sum of
    ``alpha`` over those positions (computed as the integer ``2J * M(L)``). The from-slots are a
    constant blend of ``u`` over ``U = S - V(S)`` samples, the to-slots one of ``v`` over
    ``V(S)``: dataset ``d`` gets ``LR(u, U)[d] + LR(v, V(S))[d]``. Step ``j``'s expected weights
    are ``(1 - alpha_j) u + alpha_j v``, and no step is rounded on its own (rounding each step
    would starve tiny weights).

Order and numbering
    A constant phase is ordered by :class:`tokenloom.index.blend.Blend` over its counts, the
    closed form of stateless mode, so a one-phase schedule is exactly today's blend; a ramp's
    from- and to-slots each by their own Blend (:mod:`tokenloom.index.phase_order`). Dataset
    ``d``'s sample number at a position is what it gave in earlier phases (``cumulative[k, d]``)
    plus its samples before that position in this phase: over the whole schedule every dataset
    serves its samples ``0, 1, 2, ...`` in order, none twice, none skipped. Every prefix of a
    constant phase holds dataset ``d`` within ``Blend.prefix_bound[d]`` (< 2) samples of
    ``L * counts[d] / S``. :meth:`SchedulePlan.locate` and its inverse
    :meth:`SchedulePlan.positions_of` are closed form: a search over the phases, then O(tree
    depth) per position (a ramp's inverse: a bisection over it), no array.

Targets
    :meth:`SchedulePlan.target_weights` is the mixture each position aims at (a ramp's: the
    interpolated weights of its step). The plan is a list of stretches, one per phase
    (:class:`tokenloom.index.phase_order.Segments`). A weight change at run time is not a new
    plan: serving composes it at the stream level (``tokenloom.serve.weight_changes``), in both
    modes. Exact mode's per-phase arrays, megatron-core's greedy, are
    :mod:`tokenloom.index.schedule_exact`.

Worked example: ``global_batch_size=4``, phases ``[0.5, 0.5]`` until 10 samples, then
``[0, 1]`` until 16 samples. Phase 1's boundary 10 falls inside step 2 (samples 8-11) and moves
up to 12: counts ``[6, 6]``; phase 2 holds 4 samples, counts ``[0, 4]``; dataset 1 serves its
samples 6-9 in phase 2, dataset 0 stops at 6.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from tokenloom.errors import ConfigError
from tokenloom.index.batch_sizes import StepRuns, check_steps, rampup_steps
from tokenloom.index.phase_order import PhaseOrder, RampSplit, Segments, plan_ramp
from tokenloom.validate import check_positive_int, is_integer

__all__ = [
    "RAMPS",
    "UNTIL_KINDS",
    "MixtureSchedule",
    "SchedulePhase",
    "SchedulePlan",
    "Until",
    "parse_schedule",
    "plan_schedule",
]

#: What an ``until`` counts, from the start of the run.
UNTIL_KINDS = ("tokens", "steps", "samples")
#: How a phase's weights may move from the previous phase's (besides not at all).
RAMPS = ("linear",)
_PHASE_KEYS = ("weights", "until", "ramp", "seq_length")


def _whole(value, what: str) -> int:
    """A positive whole number, also written as a float (``8.0e+12`` in YAML)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ConfigError(f"{what}={value!r}; expected a positive whole number")
    if isinstance(value, (float, np.floating)):
        if not math.isfinite(value) or not float(value).is_integer():
            raise ConfigError(f"{what}={value!r}; expected a positive whole number")
        value = int(value)
    if value < 1:
        raise ConfigError(f"{what}={value!r}; expected a positive whole number")
    return int(value)


def _checked_weights(weights) -> tuple[float, ...]:
    """Weights as floats: a non-empty list, each finite and non-negative, one positive."""
    if isinstance(weights, (str, bytes)) or not isinstance(weights, (Sequence, np.ndarray)) or not len(weights):
        raise ConfigError(f"weights: {weights!r}; expected a non-empty list of numbers, one per dataset")
    checked = []
    for d, w in enumerate(weights):
        if isinstance(w, bool) or not isinstance(w, (int, float, np.integer, np.floating)) \
                or not math.isfinite(w) or w < 0:
            raise ConfigError(f"weights[{d}]={w!r}; expected a finite, non-negative number")
        checked.append(float(w))
    if not any(checked):
        raise ConfigError(f"weights: all {len(checked)} are zero; expected at least one positive weight")
    return tuple(checked)


@dataclass(frozen=True, kw_only=True)
class Until:
    """Where a phase ends, counted from the start of the run (``until: {tokens: 8.0e+12}``)."""

    kind: str
    """``"tokens"``, ``"steps"`` (optimizer steps) or ``"samples"``."""
    amount: int
    """Tokens, steps or samples from the start of the run to the end of the phase."""

    def __post_init__(self) -> None:
        if self.kind not in UNTIL_KINDS:
            raise ConfigError(f"until: unknown kind {self.kind!r}; expected one of {', '.join(UNTIL_KINDS)}, "
                              "e.g. {steps: 600000}")
        object.__setattr__(self, "amount", _whole(self.amount, f"until: {self.kind}"))

    @classmethod
    def parse(cls, value) -> Until:
        """An Until from itself or a one-key mapping ``{tokens|steps|samples: amount}``."""
        if isinstance(value, Until):
            return value
        if not isinstance(value, Mapping) or len(value) != 1:
            raise ConfigError(f"until: {value!r}; expected one of {{tokens: N}}, {{steps: N}} or {{samples: N}}")
        ((kind, amount),) = value.items()
        return cls(kind=str(kind), amount=amount)

    def __str__(self) -> str:
        return f"{{{self.kind}: {self.amount}}}"


@dataclass(frozen=True, kw_only=True)
class SchedulePhase:
    """One phase of a schedule: its weights, where it ends, and how it starts."""

    weights: tuple[float, ...]
    """Per-sample weight of every dataset of the schedule (the union of all phases' datasets, in
    the schedule's order), any positive scale; zero leaves a dataset out of this phase."""
    until: Until
    """Where the phase ends, counted from the start of the run; a mapping such as
    ``{"steps": 600000}`` is read with :meth:`Until.parse`."""
    ramp: str | None = None
    """``"linear"``: the weights move step by step from the previous phase's to these over the
    phase; None: these weights throughout."""
    seq_length: int | None = None
    """Tokens per sample in this phase; None: the run's ``seq_length``."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "until", Until.parse(self.until))
        object.__setattr__(self, "weights", _checked_weights(self.weights))
        if self.ramp is not None and self.ramp not in RAMPS:
            raise ConfigError(f"ramp: {self.ramp!r}; expected {' or '.join(repr(r) for r in RAMPS)}, or none")
        if self.seq_length is not None:
            object.__setattr__(self, "seq_length", _whole(self.seq_length, "seq_length"))

    @property
    def normalized(self) -> np.ndarray:
        """``(D,)`` float64 weights summing to one (``w / sum(w)``, as a Blend normalises)."""
        w = np.asarray(self.weights, dtype=np.float64)
        return w / w.sum()


@dataclass(frozen=True, kw_only=True)
class MixtureSchedule:
    """A run's blend as phases over one union of datasets; the last phase's ``until`` is the run's
    length. Errors name the phase as a user counts (from 1) and its key."""

    phases: tuple[SchedulePhase, ...]
    """The phases in training order."""

    def __post_init__(self) -> None:
        phases = tuple(self.phases)
        if not phases:
            raise ConfigError("phases: none given; a schedule needs at least one phase")
        for k, phase in enumerate(phases, 1):
            if not isinstance(phase, SchedulePhase):
                raise ConfigError(f"phase {k}: {phase!r}; expected a SchedulePhase (parse_schedule reads mappings)")
        num_datasets = len(phases[0].weights)
        for k, phase in enumerate(phases, 1):
            if len(phase.weights) != num_datasets:
                raise ConfigError(f"phase {k}: weights has {len(phase.weights)} entries; expected {num_datasets}, "
                                  "one per dataset of the schedule (as phase 1)")
            if k == 1 and phase.ramp is not None:
                raise ConfigError(f"phase 1: ramp={phase.ramp!r}; the first phase has no earlier weights to ramp "
                                  "from: drop ramp, or put a constant phase before it")
            before = phases[k - 2].until if k > 1 else None
            if before is not None and before.kind == phase.until.kind and phase.until.amount <= before.amount:
                raise ConfigError(f"phase {k}: until {phase.until} does not move forward from phase {k - 1}'s "
                                  f"until {before}; expected more than {before.amount} {before.kind}")
        object.__setattr__(self, "phases", phases)

    @property
    def num_datasets(self) -> int:
        """Datasets of the schedule (the union of its phases')."""
        return len(self.phases[0].weights)


def parse_schedule(entries) -> MixtureSchedule:
    """A schedule from plain mappings, as a config file gives its ``phases`` (weights already over
    the union of datasets): ``{"weights": [...], "until": {"tokens": 8e12}, "ramp": "linear",
    "seq_length": 32768}``. Every error names the phase, counted from 1, and the key."""
    if isinstance(entries, (str, bytes, Mapping)) or not isinstance(entries, Sequence):
        raise ConfigError(f"phases: {entries!r}; expected a list of phases, each with weights and until")
    phases = []
    for k, entry in enumerate(entries, 1):
        if not isinstance(entry, Mapping):
            raise ConfigError(f"phase {k}: {entry!r}; expected a mapping with weights and until")
        unknown = sorted(str(key) for key in entry if key not in _PHASE_KEYS)
        if unknown:
            raise ConfigError(f"phase {k}: unknown key {unknown[0]!r}; a phase takes {', '.join(_PHASE_KEYS)}")
        for key in ("weights", "until"):
            if key not in entry:
                raise ConfigError(f"phase {k}: no {key}; every phase needs weights and until")
        try:
            phases.append(SchedulePhase(**entry))
        except ConfigError as exc:
            raise ConfigError(f"phase {k}: {exc}") from None
    return MixtureSchedule(phases=tuple(phases))


@dataclass(frozen=True, kw_only=True, eq=False)
class SchedulePlan:
    """A schedule's phases placed on the run's samples, with exact counts (see the module docstring).

    Arrays are int64 and read-only; ``P`` phases, ``D`` datasets. The order lives in
    :attr:`segments` (one stretch per phase); :attr:`counts` and :attr:`cumulative` sum it per
    phase."""

    schedule: MixtureSchedule
    """The schedule planned."""
    seq_lengths: tuple[int, ...]
    """Tokens per sample of each phase."""
    requested: tuple[int, ...]
    """The sample position each phase's ``until`` asked to end at, before moving to a step's end."""
    boundaries: tuple[int, ...]
    """``P + 1`` sample positions: phase ``k`` holds ``[boundaries[k], boundaries[k + 1])``."""
    boundary_steps: tuple[int, ...]
    """``P + 1``: optimizer steps begun before each boundary (the last counts a partial step)."""
    batch_steps: tuple[tuple[int, int], ...]
    """The batch-size schedule the boundaries were placed on, as ``(threshold_samples,
    global_batch_size)`` pairs: serving must step the same way."""
    ramps: tuple[RampSplit | None, ...]
    """Per phase, its ramp's split as planned (None for a constant phase)."""
    segments: Segments
    """The run as stretches, each with its closed-form order and the counts before it."""
    counts: np.ndarray = dataclasses.field(init=False)
    """``(P, D)``: samples of each dataset in each phase, summing to the phase's length."""
    cumulative: np.ndarray = dataclasses.field(init=False)
    """``(P + 1, D)``: samples of each dataset before each phase; the last row is what each
    dataset's index must hold (the sum over phases)."""

    def __post_init__(self) -> None:
        served = self.segments.served()  # (G, D)
        counts = np.zeros((self.num_phases, served.shape[1]), dtype=np.int64)
        np.add.at(counts, self.segments.phases, served)
        cumulative = np.concatenate([np.zeros((1, counts.shape[1]), np.int64), np.cumsum(counts, axis=0)])
        for array in (counts, cumulative):
            array.setflags(write=False)
        object.__setattr__(self, "counts", counts)
        object.__setattr__(self, "cumulative", cumulative)

    @property
    def num_samples(self) -> int:
        """Samples of the run: the last phase's end."""
        return self.boundaries[-1]

    @property
    def num_phases(self) -> int:
        """Phases of the schedule."""
        return len(self.boundaries) - 1

    @property
    def num_datasets(self) -> int:
        """Datasets of the schedule (the union of its phases')."""
        return self.schedule.num_datasets

    @property
    def totals(self) -> np.ndarray:
        """``(D,)``: samples each dataset serves over the whole schedule."""
        return self.cumulative[-1]

    def phase_length(self, phase: int) -> int:
        """Samples of phase ``phase`` (0-based)."""
        return self.boundaries[phase + 1] - self.boundaries[phase]

    def phase_of(self, positions) -> np.ndarray:
        """The 0-based phase of each of the run's sample ``positions`` (int64, their shape)."""
        p = self._positions(positions)
        return np.searchsorted(np.asarray(self.boundaries[1:], dtype=np.int64), p, side="right")

    def _positions(self, positions) -> np.ndarray:
        p = np.asarray(positions)
        if p.dtype.kind not in "iu":
            raise ConfigError(f"positions must be integers, got dtype {p.dtype}")
        p = p.astype(np.int64)
        if p.size and (p.min() < 0 or p.max() >= self.num_samples):
            raise ConfigError(f"positions span [{p.min()}, {p.max()}]; the schedule serves [0, {self.num_samples})")
        return p

    def locate(self, positions) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(phase, dataset, sample)`` int64 arrays for the run's sample ``positions``: the 0-based
        phase, the dataset, and that dataset's sample number over the whole schedule."""
        p = self._positions(positions)
        segments, datasets, samples = self.segments.locate(p.reshape(-1))
        return (self.segments.phases[segments].reshape(p.shape), datasets.reshape(p.shape),
                samples.reshape(p.shape))

    def positions_of(self, dataset: int, samples) -> np.ndarray:
        """The run's positions serving samples ``samples`` of dataset ``dataset`` (int64, their
        shape): the inverse of :meth:`locate`, closed form as it is (a binary search over the
        stretches, then the stretch's order inverted; see :mod:`tokenloom.index.phase_order`)."""
        if not is_integer(dataset) or not 0 <= int(dataset) < self.num_datasets:
            raise ConfigError(f"dataset={dataset!r}; expected a dataset id in [0, {self.num_datasets})")
        s = np.asarray(samples)
        if s.dtype.kind not in "iu":
            raise ConfigError(f"samples must be integers, got dtype {s.dtype}")
        flat, total = s.reshape(-1).astype(np.int64), int(self.totals[dataset])
        if flat.size and (flat.min() < 0 or flat.max() >= total):
            raise ConfigError(f"samples of dataset {dataset} span [{flat.min()}, {flat.max()}]; the schedule serves "
                              f"its samples [0, {total})")
        return self.segments.positions_of(int(dataset), flat).reshape(s.shape)

    def target_weights(self, positions) -> np.ndarray:
        """The target mixture at each position (float64, ``positions.shape + (D,)``, rows summing to
        one): the weights of the phase (or of the weight change) holding it; in a linear ramp
        ``(1 - alpha_j) u + alpha_j v`` of its step ``j``, the ``alpha`` the counts are built on."""
        p = self._positions(positions)
        return self.segments.target_weights(p.reshape(-1)).reshape((*p.shape, self.num_datasets))

    def samples_reached(self, position: int) -> np.ndarray:
        """``(D,)`` int64: samples each dataset served before ``position`` (``0 <= position <=
        num_samples``), closed form: the counts before its stretch plus a prefix count in it."""
        if not is_integer(position) or not 0 <= int(position) <= self.num_samples:
            raise ConfigError(f"position={position!r}; expected a sample position in [0, {self.num_samples}]")
        return self.segments.reached(int(position))

    def targets(self, phase: int, lengths) -> np.ndarray:
        """``(n, D)`` float64: each dataset's target count among phase ``phase``'s first ``lengths``
        samples: ``L * counts / S`` in a constant phase, ``u * (L - M(L)) + v * M(L)`` in a ramp; in
        a stretch a weight change began, the counts reached at its start plus its own target."""
        length = self.phase_length(phase)
        L = np.asarray(lengths, dtype=np.int64).reshape(-1)
        if L.size and (L.min() < 0 or L.max() > length):
            raise ConfigError(f"lengths span [{L.min()}, {L.max()}]; phase {phase + 1} holds {length} samples")
        segments = self.segments
        first, last = np.searchsorted(segments.phases, [phase, phase + 1])  # the phase's stretches
        g = np.clip(np.searchsorted(segments.starts, self.boundaries[phase] + L, side="right") - 1, first, last - 1)
        out = np.empty((L.shape[0], self.num_datasets), dtype=np.float64)
        for h in np.unique(g).tolist():
            mask = g == h
            local = self.boundaries[phase] + L[mask] - segments.starts[h]
            out[mask] = (segments.before[h] - segments.before[first])[None, :] + segments.orders[h].targets(local)
        return out

    def check_room(self, room, *, names: Sequence[str] | None = None, what: str = "max_epochs",
                   tokens: bool = False) -> None:
        """ConfigError unless every dataset's index can give what the schedule asks of it by the
        end of every phase: ``room`` (``(D,)`` samples each can give, e.g. ``max_epochs`` epochs)
        against :attr:`cumulative`, naming the first dataset and phase that would run out.
        ``tokens``: ``room`` is in tokens and the need is each phase's samples times its
        ``seq_length`` (a schedule whose phases change it reads its stores as tokens)."""
        room = np.asarray(room, dtype=np.int64).reshape(-1)
        if room.shape[0] != self.cumulative.shape[1]:
            raise ConfigError(f"room has {room.shape[0]} entries; expected one per dataset "
                              f"({self.cumulative.shape[1]})")
        taken = self.counts * np.asarray(self.seq_lengths, dtype=np.int64)[:, None] if tokens else self.counts
        needed = np.cumsum(taken, axis=0)  # (P, D): by the end of each phase
        over = needed > room[None, :]
        if not over.any():
            return
        phase, d = (int(i) for i in np.argwhere(over)[0])  # the earliest phase, then the lowest id
        name = f"dataset {d}" + (f" ({names[d]!r})" if names is not None else "")
        others = int(over.any(axis=0).sum()) - 1
        need = (f"reads {int(needed[phase, d]):,} tokens of its train documents by the end of phase {phase + 1} "
                f"({int(taken[phase, d]):,} there, at seq_length {self.seq_lengths[phase]})" if tokens else
                f"needs {int(needed[phase, d])} of its samples by the end of phase {phase + 1} "
                f"({int(taken[phase, d])} in that phase)")
        raise ConfigError(
            f"{name}: the schedule {need}, more than the {int(room[d]):{',' if tokens else ''}} its {what} "
            f"allows{f'; {others} more dataset(s) run out too' if others else ''}: lower its weight in phase "
            f"{phase + 1} or raise {what}")


def _batch_steps(global_batch_size: int, rampup_batch_size, batch_size_steps) -> tuple[tuple[int, int], ...]:
    if rampup_batch_size is not None and batch_size_steps is not None:
        raise ConfigError("rampup_batch_size and batch_size_steps both given; give one batch-size schedule")
    if rampup_batch_size is not None:
        if isinstance(rampup_batch_size, (str, bytes)) or not isinstance(rampup_batch_size, Sequence) \
                or len(rampup_batch_size) != 3:
            raise ConfigError(f"rampup_batch_size={rampup_batch_size!r}; expected Megatron's "
                              "[start, increment, ramp_samples]")
        start, increment, ramp_samples = rampup_batch_size
        return rampup_steps(start=start, increment=increment, ramp_samples=ramp_samples,
                            global_batch_size=global_batch_size)
    if batch_size_steps is not None:
        steps = check_steps(batch_size_steps)
        if steps[-1][1] != global_batch_size:
            raise ConfigError(f"the batch size steps end at {steps[-1][1]} but global_batch_size={global_batch_size}; "
                              "expected them to agree")
        return steps
    return ((0, global_batch_size),)


def plan_schedule(schedule: MixtureSchedule, *, seq_length: int, global_batch_size: int,
                  rampup_batch_size: Sequence[int] | None = None,
                  batch_size_steps: Sequence[tuple[int, int]] | None = None) -> SchedulePlan:
    """Place ``schedule`` on the run's samples: boundaries, exact counts, ramps.

    Args:
        schedule: the phases.
        seq_length: the run's tokens per sample (a phase's own ``seq_length`` overrides it).
        global_batch_size: samples per optimizer step (the final size under a ramp).
        rampup_batch_size: Megatron-LM's ``[start, increment, ramp_samples]``.
        batch_size_steps: or megatron-core's step schedule, ``(threshold_samples, size)`` pairs.

    A phase's ``until`` becomes a sample position as the module docstring says; ConfigError names
    the phase (from 1) and ``until`` when it does not move past the previous phase's end or leaves
    the phase less than the global batch that starts it.
    """
    seq_length = check_positive_int("seq_length", seq_length)
    global_batch_size = check_positive_int("global_batch_size", global_batch_size)
    batch_steps = _batch_steps(global_batch_size, rampup_batch_size, batch_size_steps)
    runs = StepRuns.of(batch_steps)
    phases = schedule.phases
    seq_lengths = tuple(p.seq_length or seq_length for p in phases)
    boundaries, requested, tokens_before = [0], [], 0
    for k, (phase, seq) in enumerate(zip(phases, seq_lengths), 1):
        start, until = boundaries[-1], phase.until
        if until.kind == "samples":
            ask = until.amount
        elif until.kind == "steps":
            ask = int(runs.step_start(until.amount))
        else:
            ask = start + (-(-(until.amount - tokens_before) // seq) if until.amount > tokens_before else 0)
        what = f"phase {k}: until {until}" + ("" if until.kind == "samples" else f" (sample {ask})")
        if ask <= start:
            where = f"phase {k - 1}'s end at sample {start}" if k > 1 else "the run's start"
            raise ConfigError(f"{what} is not past {where}; expected a later until")
        batch = int(runs.size_of(runs.step_at(start)))
        if ask - start < batch:
            raise ConfigError(f"{what} leaves the phase {ask - start} samples, fewer than the global batch of "
                              f"{batch} samples that starts it at sample {start}; expected at least one batch")
        end = ask if k == len(phases) else int(runs.step_start(runs.step_at(ask - 1) + 1))
        requested.append(ask)
        boundaries.append(end)
        tokens_before += (end - start) * seq
    orders, ramps = [], []
    for k, phase in enumerate(phases):
        start, end = boundaries[k], boundaries[k + 1]
        if phase.ramp is None:
            ramps.append(None)
            orders.append(PhaseOrder.constant(phase.weights, end - start))
        else:
            ramps.append(plan_ramp(phases[k - 1].normalized, phase.normalized, runs, start, end, number=k + 1))
            orders.append(PhaseOrder.ramped(ramps[-1]))
    steps = tuple(0 if b == 0 else int(runs.step_at(b - 1)) + 1 for b in boundaries)
    return SchedulePlan(schedule=schedule, seq_lengths=seq_lengths, requested=tuple(requested),
                        boundaries=tuple(boundaries), boundary_steps=steps, batch_steps=tuple(batch_steps),
                        ramps=tuple(ramps), segments=Segments.of_phases(boundaries, tuple(orders)))
