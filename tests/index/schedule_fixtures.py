"""Helpers shared by the schedule tests (not collected: no test_ prefix): slow references that
spell the rules out, and a strategy of random valid schedules."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
from hypothesis import strategies as st

from tokenloom.index.schedule import MixtureSchedule, SchedulePhase, Until, plan_schedule

# ------------------------------------------------------------------------------ slow references


def classic_rampup(consumed: int, start: int, increment: int, ramp_samples: int, final: int) -> int:
    """Megatron-LM's RampupBatchsizeNumMicroBatchesCalculator.update, as written there."""
    num_increments = (final - start) // increment
    if num_increments == 0 or consumed > ramp_samples:
        return final
    return start + int(consumed / (ramp_samples / num_increments)) * increment


def step_starts(limit: int, size_at) -> list[int]:
    """Samples consumed before each step, one step at a time, until past ``limit``."""
    starts = [0]
    while starts[-1] <= limit:
        starts.append(starts[-1] + size_at(starts[-1]))
    return starts


def assert_largest_remainder(counts, weights, size: int) -> None:
    """``counts`` are the floor or ceiling of the exact quotas, sum to ``size``, and nobody rounded
    down has a larger fractional part than somebody rounded up (exact fractions, float slack)."""
    counts = [int(c) for c in counts]
    assert sum(counts) == size
    total = sum(Fraction(w) for w in weights)
    quotas = [Fraction(w) / total * size for w in weights]
    slack = Fraction(1, 10**9)
    for c, q in zip(counts, quotas):
        assert math.floor(q - slack) <= c <= math.ceil(q + slack), (c, float(q))
    up = [q - math.floor(q) for c, q in zip(counts, quotas) if c > q + slack]
    down = [q - math.floor(q) for c, q in zip(counts, quotas) if c < q - slack]
    if up and down:
        assert min(up) >= max(down) - slack


def served(plan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every position of the run located."""
    return plan.locate(np.arange(plan.num_samples))


def alpha_sums(plan, k: int, starts: list[int]) -> list[Fraction]:
    """``M(L)`` for L = 0..S of ramp phase ``k``, one position at a time in exact fractions
    (``starts``: the samples before each step, :func:`step_starts`)."""
    start, end = plan.boundaries[k], plan.boundaries[k + 1]
    first = plan.boundary_steps[k]
    num_steps = plan.boundary_steps[k + 1] - first
    sums, total = [Fraction(0)], Fraction(0)
    for x in range(start, end):
        j = max(i for i, s in enumerate(starts) if s <= x) - first
        total += Fraction(2 * j + 1, 2 * num_steps)
        sums.append(total)
    return sums


# ---------------------------------------------------------------------------------- strategies

TINY = [1e-6, 3e-6, 1e-4, 0.01, 0.2, 0.5, 1.0, 7.0]


@st.composite
def schedules(draw, max_phases: int = 6, max_datasets: int = 20):
    """A random valid schedule with its batch geometry: 2-6 phases, 2-20 datasets, weights down
    to 1e-6, datasets entering and leaving (zero weight), ramps, every kind of until."""
    num_phases = draw(st.integers(2, max_phases))
    num_datasets = draw(st.integers(2, max_datasets))
    batch = draw(st.integers(1, 12))
    ramp = None
    if draw(st.booleans()):
        start = draw(st.integers(1, batch))
        increment = draw(st.sampled_from([d for d in range(1, batch + 1) if (batch - start) % d == 0]))
        ramp = (start, increment, draw(st.integers(1, 60)))
    size_at = (lambda c: batch) if ramp is None else (lambda c: classic_rampup(c, *ramp, batch))
    starts = step_starts(6 * 40 * batch + 1000, size_at)
    seq_length = draw(st.sampled_from([4, 8, 16]))
    phases, steps, tokens, boundary = [], 0, 0, 0
    for k in range(num_phases):
        weights = [draw(st.sampled_from(TINY)) if draw(st.integers(0, 3)) else 0.0 for _ in range(num_datasets)]
        if not any(weights):
            weights[draw(st.integers(0, num_datasets - 1))] = 1.0
        new_steps = steps + draw(st.integers(1, 30))
        seq = draw(st.sampled_from([None, 4, 8, 32]))
        kind = draw(st.sampled_from(["steps", "samples", "tokens"]))
        end = starts[new_steps]
        # room to ask for less than the step's end (it moves up) while keeping one whole batch
        slack = max(0, end - starts[steps] - size_at(starts[steps]))
        inside = draw(st.integers(0, min(slack, size_at(starts[new_steps - 1]) - 1)))
        if kind == "steps":
            until = {"steps": new_steps}
        elif kind == "samples":
            until = {"samples": end - inside}
        else:
            until = {"tokens": tokens + (end - inside - boundary) * (seq or seq_length) - draw(st.integers(0, 3))}
        phase = SchedulePhase(weights=tuple(weights), until=Until.parse(until), seq_length=seq,
                              ramp="linear" if k and draw(st.booleans()) else None)
        phases.append(phase)
        # the realised boundary, to count the next phase's tokens from (the last is not moved)
        real_end = end if k < num_phases - 1 or kind == "steps" else end - inside
        if kind == "tokens" and k == num_phases - 1:
            real_end = boundary + -(-(until["tokens"] - tokens) // (seq or seq_length))
        tokens += (real_end - boundary) * (seq or seq_length)
        steps, boundary = new_steps, real_end
    return MixtureSchedule(phases=tuple(phases)), batch, ramp, seq_length, starts


def make_plan(schedule, batch, ramp, seq_length):
    return plan_schedule(schedule, seq_length=seq_length, global_batch_size=batch, rampup_batch_size=ramp)
