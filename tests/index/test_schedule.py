"""Mixture schedules: boundaries, exact counts per phase, ramps, numbering across phases, bad input.

Every property is checked against a slow reference that spells the rule out: optimizer steps walked
one at a time with megatron's batch-size rule, quotas in exact fractions, every position of the run
materialised and every dataset's samples counted by hand.
"""

from __future__ import annotations

import bisect
import itertools
import math
import warnings
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schedule_fixtures import (
    TINY,
    alpha_sums,
    assert_largest_remainder,
    classic_rampup,
    make_plan,
    schedules,
    served,
    step_starts,
)
from tokenloom.errors import ConfigError
from tokenloom.index.batch_sizes import StepRuns
from tokenloom.index.blend import Blend, largest_remainder_counts
from tokenloom.index.schedule import MixtureSchedule, SchedulePhase, parse_schedule, plan_schedule

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ------------------------------------------------------------------------------ slow references


def reference_boundaries(phases, seq_length: int, starts: list[int]) -> tuple[list[int], list[int]]:
    """``(requested, boundaries)`` straight from the rule: interior ends move up to a step's end."""
    boundaries, requested, tokens = [0], [], 0
    for k, phase in enumerate(phases):
        start, seq = boundaries[-1], phase.seq_length or seq_length
        kind, amount = phase.until.kind, phase.until.amount
        ask = amount if kind == "samples" else starts[amount] if kind == "steps" else \
            start + -(-(amount - tokens) // seq)
        end = ask if k == len(phases) - 1 else min(s for s in starts if s >= ask)
        requested.append(ask)
        boundaries.append(end)
        tokens += (end - start) * seq
    return requested, boundaries


# ------------------------------------------------------------------------------------- the tests


@SETTINGS
@given(case=schedules())
def test_boundaries_fall_on_global_batches_as_the_rule_says(case):
    schedule, batch, ramp, seq_length, starts = case
    plan = make_plan(schedule, batch, ramp, seq_length)
    requested, boundaries = reference_boundaries(schedule.phases, seq_length, starts)
    assert list(plan.requested) == requested
    assert list(plan.boundaries) == boundaries
    for b in plan.boundaries[:-1]:  # every boundary but the run's end starts an optimizer step
        assert b in starts
    assert list(plan.boundary_steps) == [sum(1 for s in starts if s < b) for b in plan.boundaries]


@SETTINGS
@given(case=schedules())
def test_counts_are_exact_per_phase_and_every_dataset_is_numbered_in_order(case):
    schedule, batch, ramp, seq_length, starts = case
    plan = make_plan(schedule, batch, ramp, seq_length)
    phase_ids, datasets, samples = served(plan)
    num_datasets = schedule.num_datasets
    for k, phase in enumerate(schedule.phases):
        size = plan.phase_length(k)
        mine = phase_ids == k
        assert mine.sum() == size
        realised = np.bincount(datasets[mine], minlength=num_datasets)
        assert realised.tolist() == plan.counts[k].tolist()  # served counts are the rule's counts
        before = np.bincount(datasets[: plan.boundaries[k]], minlength=num_datasets)
        assert before.tolist() == plan.cumulative[k].tolist()
        if phase.ramp is None:
            assert_largest_remainder(plan.counts[k], phase.weights, size)
        else:
            split = plan.ramps[k]
            to_samples = math.floor(alpha_sums(plan, k, starts)[-1] + Fraction(1, 2))
            assert split.to_samples == to_samples
            assert_largest_remainder(split.from_counts, schedule.phases[k - 1].weights, size - to_samples) \
                if size > to_samples else None
            assert_largest_remainder(split.to_counts, phase.weights, to_samples) if to_samples else None
    assert plan.cumulative[-1].tolist() == np.bincount(datasets, minlength=num_datasets).tolist()
    # each dataset's sample numbers, in the order served, are exactly 0 .. N - 1: none twice, none skipped
    for d in range(num_datasets):
        assert samples[datasets == d].tolist() == list(range(int(plan.totals[d])))


@SETTINGS
@given(case=schedules(max_phases=4, max_datasets=12))
def test_order_within_a_phase_is_the_blend_of_its_counts(case):
    """A constant phase is the Blend over its counts; a ramp's to-slots fall where ``V(L)`` grows
    (exact fractions) and each kind of slot is its own Blend, in order."""
    schedule, batch, ramp, seq_length, starts = case
    plan = make_plan(schedule, batch, ramp, seq_length)
    _, datasets, _ = served(plan)
    for k in range(plan.num_phases):
        mine = datasets[plan.boundaries[k]: plan.boundaries[k + 1]]
        split = plan.ramps[k]
        if split is None:
            expected = Blend(plan.counts[k].astype(float), int(plan.counts[k].sum())).materialize()[0]
            assert mine.tolist() == expected.tolist()
            continue
        v = [math.floor(m + Fraction(1, 2)) for m in alpha_sums(plan, k, starts)]
        is_to = np.array([b > a for a, b in itertools.pairwise(v)])
        for mask, counts in ((is_to, split.to_counts), (~is_to, split.from_counts)):
            if counts.sum():
                assert mine[mask].tolist() == Blend(counts.astype(float), int(counts.sum())).materialize()[0].tolist()


@SETTINGS
@given(case=schedules(max_phases=4))
def test_every_prefix_stays_near_its_target(case):
    """A constant phase: within the Blend's certified bound (< 2) of ``L * counts / S``. A ramp:
    within both blends' bounds, their count rounding and the slot rounding of the interpolated
    target ``u (L - M) + v M``."""
    schedule, batch, ramp, seq_length, _ = case
    plan = make_plan(schedule, batch, ramp, seq_length)
    _, datasets, _ = served(plan)
    for k in range(plan.num_phases):
        size = plan.phase_length(k)
        one_hot = np.zeros((size + 1, schedule.num_datasets), dtype=np.int64)
        one_hot[np.arange(1, size + 1), datasets[plan.boundaries[k]: plan.boundaries[k + 1]]] = 1
        prefix = np.cumsum(one_hot, axis=0)  # (S + 1, D): samples of d among the phase's first L
        deviation = np.abs(prefix - plan.targets(k, np.arange(size + 1)))
        split = plan.ramps[k]
        if split is None:
            bound = plan.segments.orders[k].blend().prefix_bound
            assert np.all(bound < 2)
        else:
            order = plan.segments.orders[k]
            bound = 2.5 + sum(b.prefix_bound for b in (order.blend("from"), order.blend("to")) if b is not None)
        assert np.all(deviation <= bound + 1e-9)


@settings(max_examples=25, deadline=None)
@given(weights=st.lists(st.sampled_from([*TINY, 0.0]), min_size=2, max_size=20).filter(any),
       size=st.integers(1, 3000))
def test_one_phase_is_todays_stateless_blend(weights, size):
    plan = plan_schedule(MixtureSchedule(phases=(SchedulePhase(weights=tuple(weights), until={"samples": size}),)),
                         seq_length=8, global_batch_size=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # weights that get no sample
        today = Blend(np.array(weights), size)
    assert plan.counts[0].tolist() == today.counts.tolist() == largest_remainder_counts(weights, size).tolist()
    phases, datasets, samples = served(plan)
    expected = today.lookup(np.arange(size))
    assert (phases == 0).all()
    assert datasets.tolist() == expected[0].tolist() and samples.tolist() == expected[1].tolist()


def test_a_tiny_weight_gets_its_exact_count_in_every_phase():
    weights = (1.0, 1e-6)
    schedule = parse_schedule([{"weights": weights, "until": {"samples": 3_500_000}},
                               {"weights": (1.0, 1.0), "until": {"samples": 3_500_016}},
                               {"weights": weights, "until": {"samples": 7_000_016}, "ramp": "linear"}])
    plan = plan_schedule(schedule, seq_length=8, global_batch_size=16)
    assert plan.counts[:2, 1].tolist() == [3, 8]  # floor(3.4999965) = 3, then half of 16
    assert_largest_remainder(plan.counts[0], weights, 3_500_000)
    ramp = plan.ramps[2]  # from (1, 1) to (1, 1e-6): half the ramp's samples each way
    assert ramp.to_counts[1] == 2 and ramp.from_counts[1] == ramp.from_counts.sum() // 2
    _, datasets, samples = plan.locate(np.arange(3_499_000, 3_500_100))
    assert samples[datasets == 1].tolist() == list(range(3, 3 + 8 + 42))  # phase 2 reads on from sample 3


def test_worked_example_and_where_boundaries_fall():
    schedule = parse_schedule([{"weights": [0.5, 0.5], "until": {"samples": 10}},
                               {"weights": [0, 1], "until": {"samples": 16}}])
    plan = plan_schedule(schedule, seq_length=8, global_batch_size=4)
    assert plan.requested == (10, 16) and plan.boundaries == (0, 12, 16) and plan.boundary_steps == (0, 3, 4)
    assert plan.counts.tolist() == [[6, 6], [0, 4]]
    _, datasets, samples = plan.locate(np.arange(12, 16))
    assert datasets.tolist() == [1, 1, 1, 1] and samples.tolist() == [6, 7, 8, 9]
    # the run's end is train_samples as given, even inside a step
    plan = plan_schedule(parse_schedule([{"weights": [1, 1], "until": {"samples": 10}}]), seq_length=8,
                         global_batch_size=4)
    assert plan.boundaries == (0, 10) and plan.boundary_steps == (0, 3)


def test_tokens_count_each_phase_at_its_own_seq_length():
    # phase 1's 100 samples move up to 104 (batch 8), and those 4 x 4096 tokens count: phase 2 gets
    # ceil((8 x 32768 - 4 x 4096) / 32768) = ceil(7.5) = 8 samples, not 8 + 0
    schedule = parse_schedule([{"weights": [1, 0], "until": {"tokens": 4096 * 100}},
                               {"weights": [0, 1], "until": {"tokens": 4096 * 100 + 32768 * 8},
                                "seq_length": 32768}])
    plan = plan_schedule(schedule, seq_length=4096, global_batch_size=8)
    assert plan.seq_lengths == (4096, 32768)
    assert plan.requested == (100, 112) and plan.boundaries == (0, 104, 112)
    schedule = parse_schedule([{"weights": [1, 0], "until": {"tokens": 4096 * 100}},
                               {"weights": [0, 1], "until": {"tokens": 4096 * 104 + 32768 * 16 + 1},
                                "seq_length": 32768}])
    assert plan_schedule(schedule, seq_length=4096, global_batch_size=8).boundaries == (0, 104, 121)


def test_steps_follow_the_batch_size_ramp():
    schedule = parse_schedule([{"weights": [1, 1], "until": {"steps": 3}}, {"weights": [1, 2], "until": {"steps": 6}}])
    plan = plan_schedule(schedule, seq_length=8, global_batch_size=8, rampup_batch_size=[2, 2, 12])
    starts = step_starts(100, lambda c: classic_rampup(c, 2, 2, 12, 8))
    assert plan.boundaries == (0, starts[3], starts[6]) and plan.boundary_steps == (0, 3, 6)
    steps = plan_schedule(schedule, seq_length=8, global_batch_size=8, batch_size_steps=[(0, 2), (5, 8)])
    assert steps.boundaries == (0, 2 + 2 + 2, 6 + 8 + 8 + 8)


@settings(max_examples=60, deadline=None)
@given(thresholds=st.lists(st.integers(1, 300), max_size=6, unique=True),
       sizes=st.lists(st.integers(1, 40), min_size=7, max_size=7), probes=st.lists(st.integers(0, 2000), max_size=20))
def test_step_runs_match_megatrons_rule_step_by_step(thresholds, sizes, probes):
    """megatron-core's StepBatchsizeNumMicroBatchesCalculator: a step takes the size of the last
    threshold at or below the samples consumed before it."""
    pairs = [(0, sizes[0]), *((t, s) for t, s in zip(sorted(thresholds), sizes[1:]))]
    runs = StepRuns.of(pairs)
    starts = step_starts(2500, lambda c: [s for t, s in pairs if t <= c][-1])
    assert runs.step_start(np.arange(len(starts))).tolist() == starts
    for x in probes:
        step = max(i for i, s in enumerate(starts) if s <= x)
        assert int(runs.step_at(x)) == step and int(runs.size_of(step)) == starts[step + 1] - starts[step]


def test_check_room_names_the_dataset_and_the_phase():
    schedule = parse_schedule([{"weights": [1, 1], "until": {"samples": 100}},
                               {"weights": [0, 1], "until": {"samples": 200}}])
    plan = plan_schedule(schedule, seq_length=8, global_batch_size=10)
    plan.check_room([50, 150])
    with pytest.raises(ConfigError, match=r"dataset 1 \('code'\).* 150 .*end of phase 2 \(100 in that phase\).*"
                                          r"more than the 120 its max_epochs"):
        plan.check_room([50, 120], names=["web", "code"])


GOOD = {"weights": [1, 1, 1], "until": {"samples": 64}}
BAD = [
    ([GOOD, {"weights": [1, 1, 1], "until": {"samples": 64}}], r"phase 2: until \{samples: 64\} does not move forward"),
    ([GOOD, {"weights": [1, 1, 1], "until": {"samples": 32}}], r"phase 2: until .*does not move forward"),
    ([GOOD, GOOD | {"until": {"steps": 7}}], r"phase 2: until \{steps: 7\} \(sample 56\) is not past phase 1's end"),
    ([GOOD, GOOD | {"until": {"tokens": 100}}], r"phase 2: until \{tokens: 100\} \(sample 64\) is not past"),
    ([GOOD, GOOD | {"until": {"samples": 70}}], r"phase 2: until \{samples: 70\} leaves the phase 6 samples, "
                                                r"fewer than the global batch of 8"),
    ([{"weights": [1, 1, 1], "until": {"samples": 4}}], r"phase 1: until .*fewer than the global batch"),
    ([GOOD, GOOD | {"until": {"samples": 128}}, {"weights": [1, 1], "until": {"samples": 200}}],
     r"phase 3: weights has 2 entries; expected 3"),
    ([GOOD, {"weights": [1, -0.5, 1], "until": {"samples": 128}}], r"phase 2: weights\[1\]=-0.5"),
    ([GOOD, {"weights": [1, float("nan"), 1], "until": {"samples": 128}}], r"phase 2: weights\[1\]=nan"),
    ([{"weights": [0, 0, 0], "until": {"samples": 64}}], r"phase 1: weights: all 3 are zero"),
    ([GOOD | {"ramp": "linear"}], r"phase 1: ramp='linear'; the first phase has no earlier weights"),
    ([GOOD, GOOD | {"ramp": "cosine", "until": {"samples": 128}}], r"phase 2: ramp: 'cosine'"),
    ([GOOD, GOOD | {"until": {"epochs": 2}}], r"phase 2: until: unknown kind 'epochs'; expected one of tokens"),
    ([GOOD, GOOD | {"until": {"steps": 9, "samples": 72}}], r"phase 2: until: .*expected one of \{tokens: N\}"),
    ([GOOD, GOOD | {"until": {"samples": 1.5}}], r"phase 2: until: samples=1.5; expected a positive whole"),
    ([GOOD, GOOD | {"until": 128}], r"phase 2: until: 128; expected one of"),
    ([GOOD, GOOD | {"weights": "1 1 1", "until": {"samples": 128}}], r"phase 2: weights: '1 1 1'"),
    ([GOOD, GOOD | {"seq_length": 0, "until": {"samples": 128}}], r"phase 2: seq_length=0"),
    ([GOOD, GOOD | {"blend": [1], "until": {"samples": 128}}], r"phase 2: unknown key 'blend'"),
    ([GOOD, {"weights": [1, 1, 1]}], r"phase 2: no until"),
    ([], r"phases: none given"),
]


@pytest.mark.parametrize(("entries", "message"), BAD, ids=[m.split(":")[0] + f" {i}" for i, (_, m) in enumerate(BAD)])
def test_a_bad_schedule_names_the_phase_and_the_key(entries, message):
    with pytest.raises(ConfigError, match=message):
        plan_schedule(parse_schedule(entries), seq_length=8, global_batch_size=8)


def test_bad_batch_sizes_are_config_errors():
    schedule = parse_schedule([GOOD])
    with pytest.raises(ConfigError, match=r"rampup_batch_size=.*expected Megatron's"):
        plan_schedule(schedule, seq_length=8, global_batch_size=8, rampup_batch_size=[2, 2])
    with pytest.raises(ConfigError, match="end at 4 but global_batch_size=8"):
        plan_schedule(schedule, seq_length=8, global_batch_size=8, batch_size_steps=[(0, 2), (10, 4)])
    with pytest.raises(ConfigError, match="one batch-size schedule"):
        plan_schedule(schedule, seq_length=8, global_batch_size=8, rampup_batch_size=[2, 2, 8],
                      batch_size_steps=[(0, 8)])


# ------------------------------------------------------------- the inverse and the target mixture


def reference_target_weights(plan, starts: list[int]) -> np.ndarray:
    """``(N, D)``: the mixture each position aims at, one position at a time: the phase's weights,
    in a ramp ``(1 - alpha) u + alpha v`` with ``alpha = (2j + 1) / (2J)`` of its step."""
    phases = plan.schedule.phases
    rows = []
    for x in range(plan.num_samples):
        k = max(i for i, b in enumerate(plan.boundaries[:-1]) if b <= x)
        weights = phases[k].normalized
        if phases[k].ramp is not None:
            j = bisect.bisect_right(starts, x) - 1 - plan.boundary_steps[k]  # the step holding x
            alpha = (2 * j + 1) / (2 * (plan.boundary_steps[k + 1] - plan.boundary_steps[k]))
            weights = (1 - alpha) * phases[k - 1].normalized + alpha * phases[k].normalized
        rows.append(weights)
    return np.array(rows)


@SETTINGS
@given(case=schedules(max_phases=4, max_datasets=12))
def test_positions_of_is_the_inverse_of_locate(case):
    """Over every sample of every dataset: exactly the positions where locate names it, in order."""
    schedule, batch, ramp, seq_length, _ = case
    plan = make_plan(schedule, batch, ramp, seq_length)
    phases, datasets, _ = served(plan)
    for d in range(schedule.num_datasets):
        numbers = np.arange(int(plan.totals[d]))
        positions = plan.positions_of(d, numbers)
        assert positions.tolist() == np.flatnonzero(datasets == d).tolist()
        again = plan.locate(positions)
        assert again[1].tolist() == [d] * len(numbers) and again[2].tolist() == numbers.tolist()
        assert again[0].tolist() == phases[positions].tolist()
    shuffled = np.random.default_rng(0).permutation(int(plan.totals[0]))[:7].reshape(-1, 1)  # any order, any shape
    assert plan.positions_of(0, shuffled).shape == shuffled.shape
    assert plan.locate(plan.positions_of(0, shuffled))[2].tolist() == shuffled.tolist()


@SETTINGS
@given(case=schedules(max_phases=4, max_datasets=12))
def test_target_weights_are_the_phase_weights_or_the_ramps_step(case):
    schedule, batch, ramp, seq_length, starts = case
    plan = make_plan(schedule, batch, ramp, seq_length)
    targets = plan.target_weights(np.arange(plan.num_samples))
    assert targets.shape == (plan.num_samples, schedule.num_datasets)
    np.testing.assert_allclose(targets, reference_target_weights(plan, starts), rtol=0, atol=1e-12)
    np.testing.assert_allclose(targets.sum(axis=1), 1.0, rtol=0, atol=1e-12)
    assert plan.target_weights(np.array([[0]])).shape == (1, 1, schedule.num_datasets)


def test_positions_of_refuses_what_the_schedule_never_serves():
    plan = plan_schedule(parse_schedule([{"weights": [1, 1, 0], "until": {"samples": 20}}]), seq_length=8,
                         global_batch_size=10)
    with pytest.raises(ConfigError, match=r"samples of dataset 0 span \[3, 10\]; the schedule serves its samples "
                                          r"\[0, 10\)"):
        plan.positions_of(0, [3, 10])
    with pytest.raises(ConfigError, match=r"samples of dataset 2 span \[0, 0\]; the schedule serves its samples "
                                          r"\[0, 0\)"):
        plan.positions_of(2, [0])
    with pytest.raises(ConfigError, match=r"dataset=3; expected a dataset id in \[0, 3\)"):
        plan.positions_of(3, [0])
    assert plan.positions_of(1, np.array([], dtype=np.int64)).tolist() == []
