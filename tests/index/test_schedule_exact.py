"""Exact mode of a schedule against megatron-core itself: each phase is its own greedy, byte for byte.

Every phase part is compared with megatron-core's C++ ``build_blending_indices`` called on that
part's active weights and size, after mapping the ids back to the union; a one-phase schedule with
today's whole exact path (``plan_split_blends``); numbering across phases against a count by hand.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from index_fixtures import megatron_blending_indices as megatron
from schedule_fixtures import TINY, alpha_sums, make_plan, schedules
from tokenloom.errors import ConfigError
from tokenloom.index.blend_spec import BlendSpec, megatron_sizes, plan_split_blends
from tokenloom.index.schedule import parse_schedule, plan_schedule
from tokenloom.index.schedule_exact import exact_buffers, exact_phase_blends, plan_exact_phases

pytest.importorskip("megatron.core.datasets.helpers_cpp")

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(case=schedules(max_phases=4, max_datasets=12))
def test_every_phase_is_megatron_cores_greedy_over_its_active_datasets(case):
    schedule, batch, ramp, seq_length, starts = case
    plan = make_plan(schedule, batch, ramp, seq_length)
    blends = exact_phase_blends(plan, backend="python")
    last = plan.num_phases - 1
    for k, phase in enumerate(blends.phases):
        dataset_index, sample_index = blends.dataset_index[k], blends.dataset_sample_index[k]
        assert dataset_index.dtype == np.int16 and sample_index.dtype == np.int64
        split = plan.ramps[k]
        if split is None:
            slots = [(schedule.phases[k].weights, np.ones(phase.size, dtype=bool))]
        else:  # the to-slots where V(L) grows, in exact fractions
            v = [math.floor(m + Fraction(1, 2)) for m in alpha_sums(plan, k, starts)]
            is_to = np.diff(v) > 0
            slots = [(schedule.phases[k - 1].weights, ~is_to), (schedule.phases[k].weights, is_to)]
        for part, (weights, mask) in zip(phase.parts, slots):
            active = np.flatnonzero(np.asarray(weights) > 0)
            asked = plan.phase_length(k) if split is None else int(mask.sum())
            sizes = megatron_sizes(np.asarray(weights)[active], asked)
            assert part.datasets.tolist() == active.tolist() and part.weights == sizes.blend_weights
            megatron_sized = split is None and k == last  # the run's end: megatron's blended size
            assert part.size == (sizes.blended_size if megatron_sized else asked) == int(mask.sum())
            theirs = megatron(part.weights, part.size)
            assert dataset_index[mask].tobytes() == active[theirs[0]].astype(np.int16).tobytes()
            if split is None:  # the phase's arrays are megatron-core's own
                assert sample_index.tobytes() == theirs[1].tobytes()
        # every dataset numbered 0, 1, ... in order within the phase; a zero weight never picked
        for d in range(plan.num_datasets):
            assert sample_index[dataset_index == d].tolist() == list(range(int((dataset_index == d).sum())))
        assert set(np.unique(dataset_index).tolist()) <= set(np.flatnonzero(phase.targets > 0).tolist())


@SETTINGS
@given(case=schedules(max_phases=5, max_datasets=12))
def test_each_dataset_is_numbered_on_across_phases(case):
    schedule, batch, ramp, seq_length, _ = case
    plan = make_plan(schedule, batch, ramp, seq_length)
    blends = exact_phase_blends(plan, backend="python")
    phases, datasets, samples = blends.locate(np.arange(blends.num_samples))
    starts = [phase.start for phase in blends.phases]
    assert starts == list(plan.boundaries[:-1]) and blends.num_samples >= plan.num_samples
    for k in range(plan.num_phases):
        assert np.bincount(datasets[phases == k], minlength=plan.num_datasets).tolist() == blends.counts[k].tolist()
    assert blends.offsets[-1].tolist() == np.bincount(datasets, minlength=plan.num_datasets).tolist()
    for d in range(plan.num_datasets):  # 0 .. N - 1 over the whole run: none twice, none skipped
        assert samples[datasets == d].tolist() == list(range(int(blends.offsets[-1, d])))
    # the greedy never draws more than megatron's target ceil(S w) in a phase of exactly S steps, so
    # buffers over the summed targets hold those draws (the last phase runs past S, as today)
    targets = np.stack([phase.targets for phase in blends.phases])  # (P, D)
    assert np.all(blends.counts[:-1] <= targets[:-1])


@settings(max_examples=25, deadline=None)
@given(weights=st.lists(st.sampled_from(TINY), min_size=2, max_size=20), size=st.integers(1, 3000))
def test_one_phase_is_todays_exact_blend_byte_for_byte(weights, size):
    plan = plan_schedule(parse_schedule([{"weights": weights, "until": {"samples": size}}]), seq_length=8,
                         global_batch_size=1)
    blends = exact_phase_blends(plan, backend="python")
    today = plan_split_blends(num_samples=[size, None, None], mode="exact",
                              blend_per_split=[BlendSpec(prefixes=tuple(f"d{i}" for i in range(len(weights))),
                                                         weights=tuple(weights)), None, None])[0]
    # today's exact path sizes the blend (weights, size, buffers); its arrays are megatron-core's
    # greedy over them (today's build() is megatron_blend, tested equal to it in test_megatron_blend)
    assert blends.phases[0].parts[0].weights == today.weights and blends.phases[0].size == today.size
    assert exact_buffers(blends.phases).tolist() == list(today.dataset_num_samples)
    theirs = megatron(today.weights, today.size)
    assert blends.dataset_index[0].dtype == theirs[0].dtype and blends.dataset_index[0].tobytes() == theirs[0].tobytes()
    assert blends.dataset_sample_index[0].tobytes() == theirs[1].tobytes()


def test_a_zero_weight_is_left_out_of_the_greedy_it_would_win():
    """megatron-core's greedy picks a zero-weight dataset on an all-zero tie (step 2 of
    ``(0, .5, .5)``): the phase runs over its active datasets only."""
    assert megatron([0.0, 0.5, 0.5], 4)[0].tolist() == [1, 2, 0, 1]
    plan = plan_schedule(parse_schedule([{"weights": [1, 1, 1], "until": {"samples": 6}},
                                         {"weights": [0, 1, 1], "until": {"samples": 10}}]),
                         seq_length=8, global_batch_size=2)
    blends = exact_phase_blends(plan, backend="python")
    assert blends.dataset_index[1].tolist() == [1, 2, 1, 2]
    assert blends.offsets.tolist() == [[0, 0, 0], [2, 2, 2], [2, 4, 4]]
    _, datasets, samples = blends.locate(np.arange(6, 10))
    assert datasets.tolist() == [1, 2, 1, 2] and samples.tolist() == [2, 2, 3, 3]


def test_buffers_sum_the_targets_of_every_phase():
    plan = plan_schedule(parse_schedule([{"weights": [3, 1], "until": {"samples": 1000}},
                                         {"weights": [0, 1], "until": {"samples": 3000}},
                                         {"weights": [1, 1], "until": {"samples": 4001}}]),
                         seq_length=8, global_batch_size=8)
    phases = plan_exact_phases(plan)
    assert [phase.targets.tolist() for phase in phases] == [[750, 250], [0, 2000], [501, 501]]
    assert phases[-1].size == 1002  # the last phase as megatron sizes a blend: sum of ceil(1001 * w)
    assert exact_buffers(phases, surplus=0.005).tolist() == [math.ceil(1251 * (1 + 0.005)),
                                                             math.ceil(2751 * (1 + 0.005))]
    with pytest.raises(ConfigError, match=r"surplus=-0.1; expected a finite, non-negative"):
        exact_buffers(phases, surplus=-0.1)
