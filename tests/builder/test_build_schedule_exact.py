"""An exact build of a schedule of several phases (issue 40, step 5): each store's index sized by
megatron's buffer over the greedy's targets of every phase, the train split one blend item whose
arrays are each phase's megatron-core greedy laid end to end (ids over the split's stores, sample
numbers run on across the phases); megatron-core's cache export refused (one blend per split);
best fit: ``test_build_schedule_stateless.py``."""

from __future__ import annotations

import os

import numpy as np
import pytest

import tokenloom
from build_fixtures import make_stores
from test_build_schedule_stateless import _config, _listing, _two_ranks
from tokenloom.builder.cache import Cache
from tokenloom.builder.config import build_config_from_dict
from tokenloom.builder.exact import build_schedule_arrays
from tokenloom.errors import BuildError, ConfigError
from tokenloom.index.schedule_exact import exact_buffers, exact_phase_blends, plan_exact_phases
from tokenloom.source.blended import ArrayLocator


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("schedule_exact")
    make_stores(root / "stores", count=4)
    values = _config(str(root / "stores"), root / "cache", mode="exact")
    return root, values, build_config_from_dict(values), tokenloom.build(values)


def _served(config, result) -> list[int]:
    """The union's id of each store the train split reads, in the split's order."""
    union = list(config.schedule_stores.prefixes)
    return [union.index(p) for p in result.plan.splits[0].prefixes]


def test_stores_are_sized_by_the_buffers_over_every_phase_and_the_blend_is_one_item(built):
    _, _, config, result = built
    plan = config.schedule_plan()
    assert plan.ramps[1] is not None and plan.counts[:2, 3].sum() == 0 < plan.counts[2, 3]  # ramp; late store
    phases = plan_exact_phases(plan)
    buffers = exact_buffers(phases, surplus=config.mid_level_dataset_surplus)
    train = result.plan.splits[0]
    for key, d in zip(train.dataset_keys, _served(config, result)):
        assert result.plan.item(key).params["num_samples"] == int(buffers[d])
    assert train.num_samples == phases[-1].start + phases[-1].size
    assert train.blend_key not in result.plan.divided  # one item, built whole by one rank
    record = Cache(result.cache.root).read_record(train.blend_key)
    assert sorted(record["files"]) == ["dataset_index.npy", "dataset_sample_index.npy"]
    assert isinstance(result.split("train").locator, ArrayLocator)


def test_each_phase_serves_the_greedys_counts_and_every_store_numbers_on(built):
    _, _, config, result = built
    blends = exact_phase_blends(config.schedule_plan(), backend="python")
    served = _served(config, result)
    train = result.split("train")
    datasets, samples = train.locate(np.arange(len(train), dtype=np.int64))
    for k, phase in enumerate(blends.phases):
        counts = np.bincount(datasets[phase.start:phase.start + phase.size], minlength=len(served))
        assert counts.tolist() == blends.counts[k, served].tolist(), k
    for local, d in enumerate(served):  # 0..N-1 over the split, none twice
        assert np.array_equal(np.sort(samples[datasets == local]), np.arange(int(blends.offsets[-1, d])))


def test_each_constant_phase_is_megatron_cores_own_greedy(built):
    helpers_cpp = pytest.importorskip("megatron.core.datasets.helpers_cpp")
    _, _, config, result = built
    plan = config.schedule_plan()
    blends = exact_phase_blends(plan, backend="python")
    served = _served(config, result)
    local = np.full(plan.num_datasets, -1, dtype=np.int64)
    local[served] = np.arange(len(served))
    train = result.split("train").locator
    for k in (0, 2):  # the constant phases (phase 2 ramps: megatron-core has no counterpart)
        phase = blends.phases[k]
        (part,) = phase.parts
        weights = np.asarray(part.weights, dtype=np.float64)
        dataset_index = np.zeros(phase.size, dtype=np.int16)
        sample_index = np.zeros(phase.size, dtype=np.int64)
        helpers_cpp.build_blending_indices(dataset_index, sample_index, weights, len(weights), phase.size, False)
        union = part.datasets[dataset_index.astype(np.int64)]  # megatron's ids over the active stores -> the union
        window = slice(phase.start, phase.start + phase.size)
        assert np.array_equal(train.dataset_index[window], local[union]), k
        assert np.array_equal(train.dataset_sample_index[window], sample_index + blends.offsets[k, union]), k


def test_a_greedy_that_draws_past_a_stores_index_is_a_build_error(built):
    _, _, config, result = built
    params = result.plan.item(result.plan.splits[0].blend_key).params
    served = _served(config, result)
    totals = exact_phase_blends(config.schedule_plan(), backend="python").offsets[-1, served]
    short = {**params, "dataset_lengths": [int(n) for n in totals[:-1]] + [int(totals[-1]) - 1]}
    with pytest.raises(BuildError, match=rf"draws {int(totals[-1])} samples of dataset {served[-1]} by the end of "
                                         rf"phase 3, whose index holds only {int(totals[-1]) - 1}"):
        build_schedule_arrays(short)
    assert build_schedule_arrays({**params, "dataset_lengths": [int(n) for n in totals]})  # exactly enough


def test_where_and_find_round_trip_across_phases(built):
    _, _, config, result = built
    train = result.split("train")
    phases = plan_exact_phases(config.schedule_plan())
    positions = sorted({p for phase in phases for p in (phase.start, phase.start + phase.size // 2,
                                                         phase.start + phase.size - 1)})
    datasets, samples = train.locate(np.asarray(positions, dtype=np.int64))
    for origin, position, d, s in zip(train.where(positions), positions, datasets, samples):
        assert (origin.position, origin.dataset, origin.sample) == (position, d, s)
        assert position in train.find(origin.prefix, origin.pieces[0].document).tolist()
        assert np.array_equal(train.locator.positions_of(int(d), np.asarray([s])), [position])


def test_a_rebuild_takes_everything_from_the_cache(built):
    _, values, _, result = built
    again = tokenloom.build(values)
    assert again.build_key == result.build_key and not again.built_keys


@pytest.mark.timeout(300)
def test_two_gloo_ranks_build_the_bytes_one_process_builds(built, tmp_path):
    _two_ranks(built, tmp_path)  # the same build key and cache files as one process


def test_the_megatron_core_export_is_refused_with_the_reason(tmp_path):
    make_stores(tmp_path / "stores", count=4)
    before = _listing(tmp_path)
    values = _config(str(tmp_path / "stores"), tmp_path / "c", mode="exact",
                     megatron_cache_dir=str(tmp_path / "megatron"))
    with pytest.raises(ConfigError, match=r"schedule of 3 phases; megatron-core loads one blend per split"):
        tokenloom.build(values)
    assert _listing(tmp_path) == before and not (tmp_path / "c").exists() and not (tmp_path / "megatron").exists()
    one = {**values, "phases": values["phases"][:1]}  # one phase: today's blend, which megatron-core loads
    assert build_config_from_dict(one).megatron_cache_dir == os.path.join(str(tmp_path), "megatron")


def test_serving_aims_at_each_phases_weights(built):
    """As in stateless mode: the target is the phase's mixture."""
    from tokenloom.serve.stream import SampleStream

    _, _, config, result = built
    plan, train = config.schedule_plan(), result.split("train")
    served = _served(config, result)
    stream = SampleStream(train)
    for position in (0, int(plan.boundaries[1]), (int(plan.boundaries[1]) + int(plan.boundaries[2])) // 2,
                     int(plan.boundaries[-1]) - 1):
        assert np.allclose(stream.target_weights(position), plan.target_weights(np.array([position]))[0][served])
