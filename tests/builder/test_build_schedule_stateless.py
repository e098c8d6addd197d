"""A stateless build of a schedule of several phases (issue 40, step 4): each store's index sized
by what the whole schedule takes of it, the train split served by the schedule's closed form
(``ScheduleLocator``), per phase and store exactly the plan's counts, every store numbered on
across phases; best fit per phase in both modes (exact mode: ``test_build_schedule_exact.py``)."""

from __future__ import annotations

import os

import numpy as np
import pytest

import tokenloom
from build_fixtures import cache_files, make_stores, two_rank_build
from tokenloom.builder.cache import Cache
from tokenloom.builder.config import build_config_from_dict
from tokenloom.errors import ConfigError
from tokenloom.source.blended import ScheduleLocator

#: Three phases on toy stores (seq_length 64, 16 samples a step): store3 has a weight of 1e-3 in
#: phase 1 (one sample), phase 2 ramps, store2 enters in phase 3.
PHASES = [
    {"blend": ["0.6", "store0", "0.399", "store1", "0.001", "store3"], "until": {"samples": 1000}},
    {"blend": ["1", "store0", "1", "store1"], "until": {"samples": 1500}, "ramp": "linear"},
    {"blend": ["1", "store1", "2", "store2"], "until": {"steps": 120}},
]


def _config(stores, cache_dir, phases=PHASES, **changes) -> dict:
    """The schedule as a config mapping, its stores absolute."""
    phases = [{**p, "blend": [os.path.join(stores, v) if v.startswith("store") else v for v in p["blend"]]}
              for p in phases]
    config = {"phases": phases, "split": "90,8,2", "seq_length": 64, "global_batch_size": 16,
              "valid_samples": 40, "test_samples": 20, "seed": 7, "mode": "stateless",
              "cache_dir": str(cache_dir), "rng_workers": 0, "timeout_s": 60.0}
    config.update(changes)
    return config


def _listing(root) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, files in os.walk(root) for f in files)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("schedule")
    make_stores(root / "stores", count=4)
    values = _config(str(root / "stores"), root / "cache")
    return root, values, build_config_from_dict(values), tokenloom.build(values)


def test_the_plan_has_a_ramp_a_tiny_weight_and_a_late_store(built):
    _, _, config, _ = built
    plan = config.schedule_plan()
    union = [os.path.basename(p) for p in config.schedule_stores.prefixes]
    assert union == ["store0", "store1", "store3", "store2"] and plan.boundaries == (0, 1008, 1504, 1920)
    assert plan.ramps[1] is not None and plan.ramps[0] is None and plan.ramps[2] is None
    assert plan.counts[0, 2] == 1 and plan.counts[1:, 2].sum() == 0  # 1e-3 of phase 1, exactly
    assert plan.counts[:2, 3].sum() == 0 and plan.counts[2, 3] > 0  # store2 first used in phase 3


def test_each_store_is_sized_by_the_schedules_totals_and_the_train_blend_is_the_schedule(built):
    _, _, config, result = built
    plan = config.schedule_plan()
    train = result.plan.splits[0]
    assert train.name == "train" and train.num_samples == plan.num_samples == 1920
    union = list(config.schedule_stores.prefixes)
    for prefix, key in zip(train.prefixes, train.dataset_keys):
        assert result.plan.item(key).params["num_samples"] == int(plan.totals[union.index(prefix)])
    blend = result.plan.item(train.blend_key)
    schedule = blend.params["schedule"]
    assert schedule["boundaries"] == list(plan.boundaries) and schedule["counts"] == plan.counts.tolist()
    assert [p["ramp"] for p in schedule["phases"]] == [None, "linear", None]
    assert schedule["batch_steps"] == [[0, 16]]
    # the state is the counts per phase: no per-sample array
    record = Cache(result.cache.root).read_record(train.blend_key)
    assert sorted(record["files"]) == ["counts.npy"]
    assert np.array_equal(result.cache.open_array(train.blend_key, "counts"), plan.counts)
    assert isinstance(result.split("train").locator, ScheduleLocator)


def test_each_phase_serves_the_plans_counts_and_every_store_numbers_on(built):
    _, _, config, result = built
    plan, train = config.schedule_plan(), result.split("train")
    union = list(config.schedule_stores.prefixes)
    served = [union.index(p) for p in result.plan.splits[0].prefixes]
    datasets, samples = train.locate(np.arange(len(train), dtype=np.int64))
    for k in range(plan.num_phases):
        begin, end = plan.boundaries[k], plan.boundaries[k + 1]
        counts = np.bincount(datasets[begin:end], minlength=len(served))
        assert counts.tolist() == plan.counts[k, served].tolist(), k
    for local, d in enumerate(served):  # 0..N-1 in order of service across the phases, none twice
        assert samples[datasets == local].tolist() == list(range(int(plan.totals[d])))


def test_where_and_find_round_trip_across_phases(built):
    _, _, config, result = built
    train = result.split("train")
    plan = config.schedule_plan()
    positions = [0, 1007, 1008, 1300, 1503, 1504, 1919]  # each phase's first and last, a ramp's middle
    datasets, samples = train.locate(np.asarray(positions, dtype=np.int64))
    for origin, position, d, s in zip(train.where(positions), positions, datasets, samples):
        assert (origin.position, origin.dataset, origin.sample) == (position, d, s)
        found = train.find(origin.prefix, origin.pieces[0].document)
        assert position in found.tolist()
        assert np.array_equal(train.locator.positions_of(int(d), np.asarray([s])), [position])
    tiny = [p.endswith("store3") for p in result.plan.splits[0].prefixes].index(True)
    positions = train.locator.positions_of(tiny, np.asarray([0, 1, 5]))
    assert positions.shape == (1,) and positions[0] < plan.boundaries[1]  # store3's one sample, in phase 1
    assert train.find(train.where(positions)[0].prefix, train.where(positions)[0].pieces[0].document).size


def test_valid_and_test_blend_the_stores_by_their_share_of_the_schedule(built):
    _, _, config, result = built
    plan = config.schedule_plan()
    union = list(config.schedule_stores.prefixes)
    for name, size in (("valid", 40), ("test", 20)):
        split = result.split(name)
        assert len(split) == size and split.blend is not None
        share = [plan.totals[union.index(p)] / plan.num_samples for p in result.plan.splits[0].prefixes]
        assert split.blend.weights.tolist() == pytest.approx(share)


def test_a_rebuild_takes_everything_from_the_cache(built):
    _, values, _, result = built
    again = tokenloom.build(values)
    assert again.build_key == result.build_key and not again.built_keys


def test_max_epochs_is_checked_on_the_schedules_totals(built, tmp_path):
    root, values, config, _ = built
    plan = config.schedule_plan()
    need = int(plan.totals[list(config.schedule_stores.prefixes).index(str(root / "stores" / "store2"))])
    capped = {**values, "cache_dir": str(tmp_path / "c"), "max_epochs": {str(root / "stores" / "store2"): 0.05}}
    with pytest.raises(ConfigError, match=rf"\('.*store2'\): the schedule needs {need} of its samples by the end "
                                          rf"of phase 3 \({need} in that phase\)"):
        tokenloom.build(capped)


def test_one_phase_builds_todays_arrays(tmp_path):
    make_stores(tmp_path / "stores", count=2)
    stores = str(tmp_path / "stores")
    one = [{"blend": ["3", "store0", "1", "store1"], "until": {"samples": 300}}]
    scheduled = tokenloom.build(_config(stores, tmp_path / "a", phases=one))
    blend = {key: value for key, value in _config(stores, tmp_path / "b", phases=one).items()
             if key not in ("phases", "global_batch_size")}
    today = tokenloom.build({**blend, "train_samples": 300,
                             "blend": ["3", os.path.join(stores, "store0"), "1", os.path.join(stores, "store1")]})
    assert scheduled.build_key == today.build_key
    assert cache_files(tmp_path / "a") == cache_files(tmp_path / "b")


@pytest.mark.parametrize("mode", ["stateless", "exact"])
def test_best_fit_serves_each_phase_whole_documents_and_every_store_numbers_on(tmp_path, mode):
    """Best fit packs each store's documents before the blend, so a phase boundary falls between
    packed samples and no packing window is cut by it: per phase the rule's counts (the plan's,
    or megatron-core's greedy per phase), every store numbered on, whole documents then padding."""
    from tokenloom.index.schedule_exact import exact_phase_blends

    make_stores(tmp_path / "stores", count=4)
    values = _config(str(tmp_path / "stores"), tmp_path / "c", mode=mode, packing="best_fit")
    config, result = build_config_from_dict(values), tokenloom.build(values)
    plan, train = config.schedule_plan(), result.split("train")
    union = list(config.schedule_stores.prefixes)
    served = [union.index(p) for p in result.plan.splits[0].prefixes]
    datasets, samples = train.locate(np.arange(len(train), dtype=np.int64))
    if mode == "stateless":
        starts, counts = plan.boundaries, plan.counts
    else:
        blends = exact_phase_blends(plan, backend="python")
        starts, counts = [p.start for p in blends.phases] + [len(train)], blends.counts
    for k in range(plan.num_phases):
        got = np.bincount(datasets[starts[k]:starts[k + 1]], minlength=len(served))
        assert got.tolist() == counts[k, served].tolist(), k
    for local in range(len(served)):
        assert samples[datasets == local].tolist() == list(range(int((datasets == local).sum())))
    positions = np.arange(plan.boundaries[1] - 24, plan.boundaries[1] + 24)  # around the first boundary
    rows = train.read_samples(*train.locate(positions))
    for origin in train.where(positions):
        store = train.readers[origin.dataset].store
        row, column = rows[origin.position - positions[0]], 0
        for piece in origin.pieces:
            assert np.array_equal(row[column:column + piece.length],
                                  store.get(piece.document, offset=piece.offset, length=piece.length))
            column += piece.length
        assert np.all(row[column:] == train.pad_id)
        capacity = train.seq_length + 1
        for piece in origin.pieces:  # a whole document, or a sample-length cut of a longer one
            ends = piece.offset + piece.length == int(store.sequence_lengths[piece.document])
            assert piece.offset % capacity == 0 and (ends or piece.length == capacity), piece


def _two_ranks(built, tmp_path) -> list[dict]:
    """The built config again on two gloo ranks, checked against the one-process build."""
    root, values, _, result = built
    return two_rank_build(values, tmp_path, build_key=result.build_key, cache_dir=root / "cache")


@pytest.mark.timeout(300)
def test_two_gloo_ranks_build_the_bytes_one_process_builds(built, tmp_path):
    outcomes, result = _two_ranks(built, tmp_path), built[3]
    assert outcomes[0]["first"] == [int(v) for v in result.split("train")[0][:8]]


def test_serving_aims_at_each_phases_weights(built):
    """The audit's target is the phase's mixture (a ramp's step's), not the whole run's shares
    (weight changes at run time: test_build_schedule_weights.py)."""
    from tokenloom.serve.stream import SampleStream

    _, _, config, result = built
    plan, train = config.schedule_plan(), result.split("train")
    union = list(config.schedule_stores.prefixes)
    served = [union.index(p) for p in result.plan.splits[0].prefixes]
    stream = SampleStream(train)
    for position in (0, int(plan.boundaries[1]), (int(plan.boundaries[1]) + int(plan.boundaries[2])) // 2,
                     int(plan.boundaries[-1]) - 1):
        expected = plan.target_weights(np.array([position]))[0][served]
        assert np.allclose(stream.target_weights(position), expected), position
    assert not np.allclose(stream.target_weights(0), [d.weight for d in train.datasets])
