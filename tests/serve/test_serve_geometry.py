"""Batch geometry and batch-size schedules, checked against megatron-core's calculators."""

from __future__ import annotations

import types

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tokenloom.errors import ConfigError
from tokenloom.planning import DataGeometry
from tokenloom.serve.geometry import BatchGeometry, BatchSizeSchedule


def test_accumulation_steps_and_error_numbers():
    geometry = BatchGeometry(global_batch_size=512, micro_batch_size=4, dp=16)
    assert geometry.num_micro_batches == 8 and geometry.samples_per_micro_step == 64
    with pytest.raises(ConfigError, match=r"500 is not divisible by micro_batch_size 4 x dp 16 = 64 \(remainder 52\)"):
        BatchGeometry(global_batch_size=500, micro_batch_size=4, dp=16)


def test_global_batch_in_tokens():
    geometry = BatchGeometry.from_tokens(global_batch_tokens=4 * 2**20, seq_length=4096, micro_batch_size=2, dp=64)
    assert geometry.global_batch_size == 1024 and geometry.num_micro_batches == 8
    with pytest.raises(ConfigError, match="not a multiple of seq_length=4096"):
        BatchGeometry.from_tokens(global_batch_tokens=10**6, seq_length=4096, micro_batch_size=1, dp=1)


def test_from_plan_data_geometry():
    data = DataGeometry(seq_length=2048, global_batch_size=96, micro_batch_size=2, data_parallel_size=8,
                        gradient_accumulation_steps=6, train_iters=10)
    geometry = BatchGeometry.from_data_geometry(data)
    assert geometry.num_micro_batches == data.gradient_accumulation_steps == 6


def _megatron_step_calculator(schedule: str, micro: int, dp: int):
    module = pytest.importorskip("megatron.core.num_microbatches_calculator")
    return module.StepBatchsizeNumMicroBatchesCalculator(
        micro_batch_size=micro, data_parallel_size=dp, decrease_batch_size_if_needed=False, rank=1,
        schedule=schedule, seq_length=None)


@settings(max_examples=60, deadline=None)
@given(micro=st.integers(1, 4), dp=st.integers(1, 4),
       multiples=st.lists(st.integers(1, 6), min_size=1, max_size=4),
       gaps=st.lists(st.integers(1, 500), min_size=3, max_size=3), steps=st.integers(1, 80))
def test_step_schedule_matches_megatron(micro, dp, multiples, gaps, steps):
    unit = micro * dp
    thresholds = [0]
    for gap in gaps[: len(multiples) - 1]:
        thresholds.append(thresholds[-1] + gap)
    text = " ".join(f"{t}:{m * unit}" for t, m in zip(thresholds, multiples))
    calculator = _megatron_step_calculator(text, micro, dp)
    schedule = BatchSizeSchedule.parse(text)
    geometry = BatchGeometry(global_batch_size=multiples[-1] * unit, micro_batch_size=micro, dp=dp, schedule=schedule)
    consumed = 0
    for step in range(steps):
        calculator.update(consumed, consistency_check=True)
        assert geometry.step_start(step) == consumed
        assert geometry.step_of(consumed) == step
        assert geometry.global_batch_size_at(consumed) == calculator.get_current_global_batch_size()
        assert geometry.num_micro_batches_for(geometry.global_batch_size_at(consumed)) == calculator.get()
        consumed += calculator.get_current_global_batch_size()


def test_schedule_parses_suffixes_and_tokens():
    assert BatchSizeSchedule.parse("0:768 250B:1536", seq_length=4096).steps == ((0, 768), (250 * 10**9 // 4096, 1536))
    with pytest.raises(ConfigError, match="THRESHOLD:BATCH_SIZE"):
        BatchSizeSchedule.parse("0-768")


def _classic_rampup(consumed, start, increment, ramp_samples, global_batch_size):
    """Megatron-LM's RampupBatchsizeNumMicroBatchesCalculator.update, as documented."""
    num_increments = (global_batch_size - start) // increment
    per_increment = ramp_samples / num_increments
    if consumed > ramp_samples:
        return global_batch_size
    return start + int(consumed / per_increment) * increment


@settings(max_examples=100, deadline=None)
@given(start=st.integers(1, 64), increment=st.integers(1, 32), num_increments=st.integers(1, 12),
       ramp_samples=st.integers(1, 5000), consumed=st.lists(st.integers(0, 6000), min_size=1, max_size=20))
# fewer ramp samples than increments: two increments at once (hypothesis found it in CI)
@example(start=1, increment=1, num_increments=2, ramp_samples=1, consumed=[0, 1, 2])
@example(start=8, increment=4, num_increments=12, ramp_samples=5, consumed=list(range(8)))
def test_rampup_matches_classic_formula(start, increment, num_increments, ramp_samples, consumed):
    final = start + num_increments * increment
    schedule = BatchSizeSchedule.rampup(start=start, increment=increment, ramp_samples=ramp_samples,
                                        global_batch_size=final)
    for c in consumed:
        assert schedule.global_batch_size_at(c) == _classic_rampup(c, start, increment, ramp_samples, final)


def test_schedule_must_end_at_global_batch_size():
    with pytest.raises(ConfigError, match="ends at global batch size 64"):
        BatchGeometry(global_batch_size=128, micro_batch_size=1, dp=1,
                      schedule=BatchSizeSchedule(steps=((0, 32), (100, 64))))


def _megatron_pretraining_sampler():
    """megatron-training's MegatronPretrainingSampler, its own code: the class is taken from the
    installed file (megatron.training itself needs Python 3.12 to import)."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec("megatron.core")
    if spec is None:
        pytest.skip("megatron-core is not installed")
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(spec.origin)), "training", "datasets", "data_samplers.py")
    if not os.path.isfile(path):
        pytest.skip("megatron's data_samplers.py is not installed")
    tree = ast.parse(open(path).read())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "MegatronPretrainingSampler")
    namespace: dict = {}
    exec(compile(ast.Module(body=[node], type_ignores=[]), path, "exec"), namespace)
    return namespace["MegatronPretrainingSampler"]


@settings(max_examples=60, deadline=None)
@given(micro=st.integers(1, 4), dp=st.integers(1, 6), accumulation=st.integers(1, 4), steps_done=st.integers(0, 5),
       steps=st.integers(1, 6))
def test_micro_batch_positions_match_megatron_pretraining_sampler(micro, dp, accumulation, steps_done, steps):
    from tokenloom.serve.sampler import MicroBatchSampler

    Sampler = _megatron_pretraining_sampler()
    geometry = BatchGeometry(global_batch_size=micro * dp * accumulation, micro_batch_size=micro, dp=dp)
    total = geometry.global_batch_size * (steps_done + steps)

    positions_only = types.SimpleNamespace(num_samples=total, datasets=())  # a source of `total` samples
    for rank in range(dp):
        theirs = list(Sampler(total_samples=total, consumed_samples=steps_done * geometry.global_batch_size,
                              micro_batch_size=micro, data_parallel_rank=rank, data_parallel_size=dp))
        ours = MicroBatchSampler(positions_only, geometry, dp_rank=rank)
        ours.seek(steps_done, steps_done * geometry.global_batch_size, 0)
        assert [p.tolist() for p in ours] == theirs
