"""An exact build of a schedule of several phases (issue 40, step 5): each store's index sized by
megatron's buffer over the greedy's targets of every phase, the train split one blend item whose
arrays are each phase's megatron-core greedy laid end to end (ids over the split's stores, sample
numbers run on across the phases), divided over the ranks as a single exact blend is: 3 gloo
ranks write the one-process arrays byte for byte with ranges that cross a phase boundary and
start inside the ramp, and a failure in it fails every rank alike; megatron-core's cache export
refused (one blend per split); best fit: ``test_build_schedule_stateless.py``."""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest

import tokenloom
from build_fixtures import cache_files, launch, make_stores
from test_build_schedule_stateless import _config, _listing
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


def test_stores_are_sized_by_the_buffers_over_every_phase_and_the_blend_is_one_divided_item(built):
    _, _, config, result = built
    plan = config.schedule_plan()
    assert plan.ramps[1] is not None and plan.counts[:2, 3].sum() == 0 < plan.counts[2, 3]  # ramp; late store
    phases = plan_exact_phases(plan)
    buffers = exact_buffers(phases, surplus=config.mid_level_dataset_surplus)
    train = result.plan.splits[0]
    for key, d in zip(train.dataset_keys, _served(config, result)):
        assert result.plan.item(key).params["num_samples"] == int(buffers[d])
    assert train.num_samples == phases[-1].start + phases[-1].size
    assert result.plan.divided[train.blend_key] == (0, train.num_samples)  # one item, divided (one rank here)
    record = Cache(result.cache.root).read_record(train.blend_key)
    assert sorted(record["files"]) == ["dataset_index.npy", "dataset_sample_index.npy"]
    assert isinstance(result.split("train").locator, ArrayLocator)
    # the divided build's bytes are the one-process arrays
    expected = build_schedule_arrays(result.plan.item(train.blend_key).params)
    for name, array in expected.items():
        stored = Cache(result.cache.root).open_array(train.blend_key, name)
        assert stored.dtype == array.dtype and np.array_equal(stored, array), name


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


def _divided_in_one_process(greedy, bounds, block, path):
    """The schedule's blend as ``tokenloom.builder.divided`` computes it, the ranks' ranges one
    after another in this process: each range from its guessed start, window by window into one
    file, settled round by round, the offsets from the windows ending a phase, then each block made
    final. Returns the file's two arrays and the settling rounds."""
    from tokenloom.builder import divided
    from tokenloom.index.megatron_blend import RangeRun, ranges_settled
    from tokenloom.index.schedule_exact import phase_offsets

    slots, total = divided.pack_layout(greedy.size, greedy.dataset_id_dtype)
    with open(path, "wb") as f:
        f.truncate(total)
    fd = os.open(path, os.O_RDWR)
    buffers = (np.empty(block, dtype=greedy.dataset_id_dtype), np.empty(block, dtype=np.int64))
    try:
        ranges = []
        for a, b in itertools.pairwise(bounds):
            blocks = [(w, min(w + block, b)) for w in range(a, b, block)]
            windows = divided._windows(blocks, greedy.restarts)
            counts, states, ends = greedy.guess(a), [], []
            start = counts.copy()
            for w0, w1 in windows:
                counts = greedy.carry(w0, counts)
                states.append(counts)
                out = (buffers[0][:w1 - w0], buffers[1][:w1 - w0])
                counts = greedy.fill(w0, w1, *out, counts=counts).end_counts
                ends.append(counts)
                divided._write_block(fd, slots, w0, out)
            ranges.append([RangeRun(start, counts), blocks, windows, states, ends])
        rounds = 0
        while not ranges_settled([r[0] for r in ranges], divided._true_starts(greedy, bounds, [r[0] for r in ranges])):
            true_starts = divided._true_starts(greedy, bounds, [r[0] for r in ranges])
            for k, (run, _, windows, states, ends) in enumerate(ranges):
                end = divided._repair_blocks(greedy, fd, slots, windows, states, ends, true_starts[k], buffers)
                ranges[k][0] = RangeRun(np.array(true_starts[k]), run.end_counts if end is None else end)
            rounds += 1
            assert rounds <= len(ranges)
        phase_at_end = {end: k for k, end in enumerate(greedy.phase_ends)}
        finished = {phase_at_end[w1]: e for r in ranges for (_, w1), e in zip(r[2], r[4]) if w1 in phase_at_end}
        offsets = phase_offsets(greedy.phase_counts(finished))
        for _, blocks, windows, states, _ in ranges:
            state_at = dict(zip((w0 for w0, _ in windows), states))
            for w0, w1 in blocks:
                data = divided._read_block(fd, slots, w0, w1, buffers)
                if greedy.finish(w0, w1, *data, state_at[w0], offsets):
                    divided._write_block(fd, slots, w0, data)
        out = [np.fromfile(path, dtype=slot.dtype, count=greedy.size, offset=slot.data_offset) for slot in slots]
        return out[0], out[1], rounds
    finally:
        os.close(fd)


def test_any_ranges_of_the_schedule_settle_into_the_one_process_arrays(built, tmp_path):
    """Ranges from guessed starts anywhere (inside the ramp, across phase ends, empty, at the end),
    repaired and made final as the divided build does, give the one-process arrays."""
    from tokenloom.builder.exact import schedule_greedy

    _, _, _, result = built
    params = result.plan.item(result.plan.splits[0].blend_key).params
    expected = build_schedule_arrays(params)
    greedy = schedule_greedy(params)
    size, rng = greedy.size, np.random.default_rng(0)
    cases = [([0, 1088, size], 64), ([0, 1008, 1504, size], 100), ([0, 0, 1300, size, size], 7)]
    cases += [([0, *sorted(rng.integers(0, size + 1, n - 1).tolist()), size], int(rng.integers(1, 300)))
              for n in rng.integers(2, 7, 12)]
    repaired = 0
    for bounds, block in cases:
        dataset_index, sample_index, rounds = _divided_in_one_process(greedy, bounds, block, tmp_path / "pack.bin")
        assert np.array_equal(dataset_index, expected["dataset_index"]), (bounds, block)
        assert np.array_equal(sample_index, expected["dataset_sample_index"]), (bounds, block)
        repaired += rounds > 0
    assert repaired >= 5  # most guesses were wrong: the repairs were exercised, in the ramp too


@pytest.mark.timeout(300)
def test_three_gloo_ranks_divide_the_schedule_into_the_bytes_one_process_builds(built, tmp_path):
    """Blocks of 64 positions: the ranks' ranges of the 1921 positions cross the end of phase 1
    (1008) and start inside the ramp (1008..1504), so the settling repairs across a restart and
    through a ramp's two greedies; a fault on the last rank in the schedule's blend fails all."""
    pytest.importorskip("torch.distributed")
    root, values, config, result = built
    one_process = build_schedule_arrays(result.plan.item(result.plan.splits[0].blend_key).params)
    divided = {**values, "cache_dir": str(tmp_path / "three"), "blend_block_samples": 64}
    faulty = {**values, "cache_dir": str(tmp_path / "faulty"), "blend_block_samples": 64, "split": "1,0,0"}
    (tmp_path / "out").mkdir()
    results = launch(3, [{"config": divided}, {"config": faulty, "fault": {"rank": 2, "item_kind": "blend",
                                                                           "action": "raise"}}],
                     tmp_path / "out", timeout_s=240)
    outcomes = [r["steps"][0] for r in results]
    assert all(o["ok"] for o in outcomes), outcomes
    assert {o["build_key"] for o in outcomes} == {result.build_key}
    assert cache_files(tmp_path / "three") == cache_files(root / "cache")
    key = result.plan.splits[0].blend_key
    cache = Cache(str(tmp_path / "three"))
    for name, array in one_process.items():
        assert np.array_equal(cache.open_array(key, name), array), name
    bounds = cache.read_record(key)["built_by"]["bounds"]
    starts = [phase.start for phase in plan_exact_phases(config.schedule_plan())]  # [0, 1008, 1504]
    ranges = [(a, b) for a, b in itertools.pairwise(bounds) if b > a]
    assert len(ranges) >= 2, bounds  # really divided (a rank busy with dataset items may get none)
    assert any(a < starts[1] < b for a, b in ranges), bounds  # a range crosses a phase boundary
    assert any(starts[1] < a < starts[2] for a, _ in ranges), bounds  # one starts inside the ramp
    assert cache.read_record(key)["built_by"]["settle_rounds"] >= 1  # its guessed start was repaired
    failed = [r["steps"][1] for r in results]
    assert not any(o["ok"] for o in failed)
    (message,) = {o["error"] for o in failed}
    assert "injected fault on rank 2" in message and "(while building schedule train" in message, message
    faulty_cache = Cache(str(tmp_path / "faulty"))
    assert not [k for k in faulty_cache.item_keys() if faulty_cache.read_record(k)["kind"] == "blend"]
    assert not os.listdir(tmp_path / "faulty" / "tmp")


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
