"""Batch geometry: global batch, micro-batch, data-parallel size, and a batch-size schedule.

Every optimizer step consumes one global batch of ``G`` samples from the global stream. It is
cut into ``G / (micro x dp)`` micro-steps of ``micro x dp`` consecutive samples; in each
micro-step data-parallel rank ``r`` takes samples ``[r x micro, (r + 1) x micro)`` (Megatron's
``MegatronPretrainingSampler`` order). So step ``k`` of a run starting at ``consumed`` serves
positions ``[consumed, consumed + G)`` whatever ``dp`` is: a run can resume on another layout.

A schedule changes ``G`` with the samples consumed (Megatron's ``--step-batch-size-schedule``
"0:768 250B:1536", or the classic ``--rampup-batch-size start increment samples``).

With ``balance`` set, a step's samples are the same ``G`` positions, placed on the (rank,
micro-batch) slots by their cost instead of in this order (:mod:`tokenloom.index.balance`,
:mod:`tokenloom.serve.balance`): every rank computes the placement from the index alone.

A build with a mixture schedule placed its phase boundaries on its own optimizer steps;
:func:`check_planned_steps` refuses a geometry that steps otherwise, so every phase ends at a
global-batch boundary of the run that serves it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from tokenloom.errors import ConfigError
from tokenloom.index.balance import BALANCES, CostModel
from tokenloom.index.batch_sizes import StepRuns, parse_step_schedule, rampup_steps
from tokenloom.validate import is_integer

if TYPE_CHECKING:
    from tokenloom.index.schedule import SchedulePlan


def _positive(name: str, value) -> int:
    if not is_integer(value) or value < 1:
        raise ConfigError(f"{name}={value!r}; expected a positive integer")
    return int(value)


@dataclass(frozen=True, kw_only=True)
class BatchSizeSchedule:
    """Global batch size as a step function of consumed samples."""

    steps: tuple[tuple[int, int], ...]
    """``(threshold_samples, global_batch_size)`` pairs, thresholds strictly increasing from 0:
    a step starting with ``consumed >= threshold`` uses that batch size."""

    def __post_init__(self) -> None:
        if not self.steps or self.steps[0][0] != 0:
            raise ConfigError(f"BatchSizeSchedule.steps={self.steps!r}; expected a first entry at threshold 0")
        for (a, _), (b, _) in zip(self.steps, self.steps[1:]):
            if b <= a:
                raise ConfigError(f"BatchSizeSchedule thresholds {a} then {b}; expected strictly increasing")
        for _, size in self.steps:
            _positive("global batch size", size)

    @classmethod
    def parse(cls, text: str, *, seq_length: int | None = None) -> BatchSizeSchedule:
        """Megatron's "THRESHOLD:BS THRESHOLD:BS ..." (K/M/B/T suffixes); thresholds in tokens when
        ``seq_length`` is given (divided by it, rounding down), else in samples."""
        return cls(steps=parse_step_schedule(text, seq_length=seq_length))

    @classmethod
    def rampup(cls, *, start: int, increment: int, ramp_samples: int, global_batch_size: int) -> BatchSizeSchedule:
        """Megatron-LM's ``--rampup-batch-size start increment ramp_samples``: the batch grows from
        ``start`` by ``increment`` every ``ramp_samples / num_increments`` consumed samples, and is
        ``global_batch_size`` once more than ``ramp_samples`` are consumed."""
        return cls(steps=rampup_steps(start=start, increment=increment, ramp_samples=ramp_samples,
                                      global_batch_size=global_batch_size))

    def global_batch_size_at(self, consumed_samples: int) -> int:
        """The global batch size of a step that starts after ``consumed_samples``."""
        size = self.steps[0][1]
        for threshold, value in self.steps:
            if consumed_samples < threshold:
                break
            size = value
        return size


@dataclass(frozen=True, kw_only=True)
class BatchGeometry:
    """How the global stream is cut into steps and micro-batches."""

    global_batch_size: int
    """Samples per optimizer step (the final size when a schedule is set)."""
    micro_batch_size: int
    """Samples per forward/backward pass on one data-parallel rank."""
    dp: int
    """Data-parallel size."""
    schedule: BatchSizeSchedule | None = None
    """Optional batch-size ramp; None keeps ``global_batch_size`` throughout."""
    balance: str | None = None
    """None (Megatron's order), ``"attention"`` (place each step's samples so that every rank,
    and every micro-batch of a rank, gets about the same attention and dense work: needs
    ``SampleOptions(inter_document_masking=True)``, whose boundaries the cost is counted on) or
    ``"tokens"`` (the same real tokens: best-fit samples served without boundaries). The step's
    set of samples, its fingerprint and the state are unchanged; only placement inside the step."""
    balance_cost: CostModel | None = None
    """The cost model of ``balance="attention"`` (None: ``CostModel.for_width()``, width 4096)."""

    def __post_init__(self) -> None:
        _positive("global_batch_size", self.global_batch_size)
        _positive("micro_batch_size", self.micro_batch_size)
        _positive("dp", self.dp)
        if self.balance is not None and self.balance not in BALANCES:
            raise ConfigError(f"BatchGeometry.balance={self.balance!r}; expected None or one of {list(BALANCES)}")
        if self.balance_cost is not None:
            if self.balance != "attention":
                raise ConfigError(f"BatchGeometry.balance_cost={self.balance_cost!r} with balance={self.balance!r}; "
                                  "a cost model is what balance='attention' weighs samples by")
            if not isinstance(self.balance_cost, CostModel):
                raise ConfigError(f"BatchGeometry.balance_cost={self.balance_cost!r}; expected a "
                                  "tokenloom.index.CostModel")
        if self.schedule is None:
            self.num_micro_batches_for(self.global_batch_size)
        elif self.schedule.steps[-1][1] != self.global_batch_size:
            raise ConfigError(
                f"the schedule ends at global batch size {self.schedule.steps[-1][1]} but "
                f"global_batch_size={self.global_batch_size}; expected them to agree")

    @classmethod
    def from_tokens(cls, *, global_batch_tokens: int, seq_length: int, micro_batch_size: int,
                    dp: int, schedule: BatchSizeSchedule | None = None) -> BatchGeometry:
        """A global batch given in tokens (``global_batch_tokens = samples x seq_length``)."""
        global_batch_tokens = _positive("global_batch_tokens", global_batch_tokens)
        seq_length = _positive("seq_length", seq_length)
        if global_batch_tokens % seq_length:
            raise ConfigError(
                f"global_batch_tokens={global_batch_tokens} is not a multiple of seq_length={seq_length} "
                f"({global_batch_tokens / seq_length:.3f} samples); use "
                f"{max(1, global_batch_tokens // seq_length) * seq_length} or "
                f"{(global_batch_tokens // seq_length + 1) * seq_length}")
        return cls(global_batch_size=global_batch_tokens // seq_length, micro_batch_size=micro_batch_size,
                   dp=dp, schedule=schedule)

    @classmethod
    def from_data_geometry(cls, geometry, *, schedule: BatchSizeSchedule | None = None) -> BatchGeometry:
        """From a :class:`tokenloom.plan.DataGeometry` (its checks already hold), its ``balance`` too."""
        return cls(global_batch_size=geometry.global_batch_size, micro_batch_size=geometry.micro_batch_size,
                   dp=geometry.data_parallel_size, schedule=schedule, balance=getattr(geometry, "balance", None))

    def with_dp(self, dp: int) -> BatchGeometry:
        """The same batches on another data-parallel size (the micro-batch stays)."""
        return BatchGeometry(global_batch_size=self.global_batch_size, micro_batch_size=self.micro_batch_size,
                             dp=dp, schedule=self.schedule, balance=self.balance, balance_cost=self.balance_cost)

    @property
    def cost_model(self) -> CostModel:
        """The cost model ``balance="attention"`` weighs samples by."""
        return self.balance_cost if self.balance_cost is not None else CostModel.for_width()

    @property
    def batch_steps(self) -> tuple[tuple[int, int], ...]:
        """The global batch sizes as ``(threshold_samples, global_batch_size)`` pairs (the
        schedule's ``steps``; one pair without a schedule): what a build's ``batch_steps`` hold."""
        return self.schedule.steps if self.schedule is not None else ((0, self.global_batch_size),)

    @property
    def samples_per_micro_step(self) -> int:
        """Samples one micro-step takes from the stream over all data-parallel ranks."""
        return self.micro_batch_size * self.dp

    def num_micro_batches_for(self, global_batch_size: int) -> int:
        """Gradient-accumulation steps for a global batch: ``global / (micro x dp)``."""
        per = self.samples_per_micro_step
        if global_batch_size % per:
            raise ConfigError(
                f"global batch size {global_batch_size} is not divisible by micro_batch_size "
                f"{self.micro_batch_size} x dp {self.dp} = {per} (remainder {global_batch_size % per}); "
                f"use a global batch of {global_batch_size // per * per or per} or "
                f"{(global_batch_size // per + 1) * per}")
        return global_batch_size // per

    @property
    def num_micro_batches(self) -> int:
        """Gradient-accumulation steps at the final global batch size."""
        return self.num_micro_batches_for(self.global_batch_size)

    def global_batch_size_at(self, consumed_samples: int) -> int:
        """Global batch size of the step starting after ``consumed_samples``."""
        if self.schedule is None:
            return self.global_batch_size
        return self.schedule.global_batch_size_at(consumed_samples)

    def step_start(self, step: int) -> int:
        """Samples consumed before optimizer step ``step`` (0-based)."""
        if step < 0:
            raise ConfigError(f"step={step!r}; expected a non-negative integer")
        if self.schedule is None:
            return step * self.global_batch_size
        consumed, done = 0, 0
        while done < step:
            size = self.schedule.global_batch_size_at(consumed)
            later = [t for t, _ in self.schedule.steps if t > consumed]
            # every step that starts before the next threshold has this size
            run = step - done if not later else min(step - done, -(-(later[0] - consumed) // size))
            consumed += run * size
            done += run
        return consumed

    def step_of(self, consumed_samples: int) -> int:
        """The step starting at ``consumed_samples``; ConfigError when it falls inside a step."""
        step, consumed = 0, 0
        if self.schedule is None:
            step, rest = divmod(consumed_samples, self.global_batch_size)
            if rest == 0:
                return step
        else:
            while consumed < consumed_samples:
                consumed += self.schedule.global_batch_size_at(consumed)
                step += 1
            if consumed == consumed_samples:
                return step
        raise ConfigError(f"consumed_samples={consumed_samples} falls inside an optimizer step of this geometry")


def check_planned_steps(geometry: BatchGeometry, plan: SchedulePlan) -> None:
    """ConfigError unless ``geometry`` cuts the run into the optimizer steps ``plan``'s phases were
    placed on (``plan.batch_steps``), over every step that starts before the run's end: otherwise
    a phase would not end at the step the build put it on (``until: {steps: N}`` counts the
    build's steps, a ramp's weights move per build step), or would end inside a global batch.

    Compares the two batch-size schedules as runs of equal steps (:class:`StepRuns`): O(thresholds),
    not O(steps), and two definitions that step alike (a threshold inside the same step) agree."""
    built, here = StepRuns.of(plan.batch_steps), StepRuns.of(geometry.batch_steps)
    # (C,) the steps where either schedule changes size: between two of them both sizes hold still
    changes = np.union1d(built.first_step, here.first_step)
    differ = np.flatnonzero(built.size_of(changes) != here.size_of(changes))
    if differ.size == 0:
        return
    step = int(changes[differ[0]])
    start = int(built.step_start(step))  # the same in both: every step before it agrees
    if start >= plan.num_samples:
        return  # past the run's end: no phase left to keep
    steps = tuple((int(t), int(s)) for t, s in plan.batch_steps)
    size = steps[-1][1]
    build = (f"global_batch_size {size} and no batch-size ramp" if len(steps) == 1 else
             f"global_batch_size {size} after a batch-size ramp of (threshold_samples, size) steps {steps}")
    mine = f"global_batch_size={geometry.global_batch_size} and " + (
        "no schedule" if geometry.schedule is None else f"a schedule of steps {geometry.schedule.steps}")
    inner = [f"{b} (step {k})" for b, k in zip(plan.boundaries[1:-1], plan.boundary_steps[1:-1])]
    shown = ", ".join(inner[:6]) + (", ..." if len(inner) > 6 else "")
    fix = f"global_batch_size={size}" + ("" if len(steps) == 1 else f", schedule=BatchSizeSchedule(steps={steps})")
    raise ConfigError(
        f"the build placed its phases on optimizer steps of {build} (its config's global_batch_size and "
        f"rampup_batch_size or step_batch_size_schedule; phase boundaries at samples {shown}), but this "
        f"BatchGeometry has {mine}: step {step}, from sample {start}, takes {int(built.size_of(step))} samples "
        f"in the build and {int(here.size_of(step))} here, so the phases would not end at the build's steps. "
        f"Serve with the build's batch sizes, BatchGeometry({fix}, ...) (a loader that takes only a "
        "global_batch_size, such as the JAX HostLoader or GrainStream, serves a build without a batch-size "
        "ramp), or build again with this geometry's")


__all__ = ["BatchGeometry", "BatchSizeSchedule", "check_planned_steps"]
