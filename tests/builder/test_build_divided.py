"""Exact blends divided over every rank: 1, 2, 3 and 4 real gloo ranks each compute a range of
positions and write it in place; the arrays are byte for byte the one-process build's and
megatron-core's, for blends of 1, 2 and 1000 datasets, exhaustive blends, ranks without work,
and builds without a shared filesystem; a failure or a killed rank in a blend fails every rank
and leaves no pack that looks valid."""

from __future__ import annotations

import os

import numpy as np
import pytest

from build_fixtures import blend_config, cache_files, launch, make_stores, write_store

pytest.importorskip("torch.distributed")

import tokenloom
import tokenloom.builder as tb
from tokenloom.builder.cache import Cache

BLOCK = 16  # positions per block: the 3000-sample train blend is ~190 blocks, divided over the ranks


def _configs(root, prefixes, many):
    """Step name -> config: what every launch builds."""
    weights = list(np.random.default_rng(0).random(len(many)) + 0.1)
    return {
        "four": blend_config(prefixes, root / "shared", blend_block_samples=BLOCK,
                             megatron_cache_dir=str(root / "megatron")),
        "one": blend_config(prefixes[:1], root / "shared", blend={"prefixes": prefixes[:1], "weights": [1.0]},
                            blend_block_samples=BLOCK),
        "exhaustive": blend_config(prefixes[:2], root / "shared", blend={"prefixes": prefixes[:2]},
                                   train_samples=None, valid_samples=None, test_samples=None,
                                   blend_block_samples=BLOCK),
        "thousand": blend_config(many, root / "shared", blend={"prefixes": many, "weights": weights},
                                 split="1,0,0", train_samples=5000, blend_block_samples=BLOCK),
        "local": blend_config(prefixes, str(root / "local{rank}"), shared_fs=False, blend_block_samples=BLOCK,
                              seed=3),
        # ranks with nothing to do: blocks larger than the valid and test blends (and than the
        # train blend's share of most ranks)
        "big-blocks": blend_config(prefixes, root / "shared", blend_block_samples=1024, seed=4),
        # a train blend worth more than any imbalance of the dataset items and the writer's manifest,
        # so every rank count really cuts it (the small blends above may go whole to one rank)
        "long": blend_config(prefixes, root / "shared", train_samples=60_000, blend_block_samples=256, seed=5),
    }


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("divided-stores")
    prefixes = make_stores(root / "stores", count=4)
    os.makedirs(root / "many")
    many = [write_store(str(root / "many" / f"s{i}"), 12 + i % 7, seed=100 + i, max_length=40) for i in range(1000)]
    return prefixes, many


@pytest.fixture(scope="module", params=[1, 2, 3, 4], ids=lambda w: f"{w}-ranks")
def run(request, corpus, tmp_path_factory):
    world = request.param
    prefixes, many = corpus
    root = tmp_path_factory.mktemp(f"divided-{world}")
    configs = _configs(root, prefixes, many)
    steps = [{"config": config} for config in configs.values()]
    if world > 1:
        last = world - 1
        steps.append({"config": blend_config(prefixes, root / "failed", seed=7, blend_block_samples=BLOCK),
                      "fault": {"rank": last, "item_kind": "blend", "action": "raise"}})
        steps.append({"config": blend_config(prefixes, root / "killed", seed=8, blend_block_samples=BLOCK,
                                             timeout_s=15.0),
                      "fault": {"rank": last, "item_kind": "blend", "action": "kill"}})
    (root / "out").mkdir()
    results = launch(world, steps, root / "out", timeout_s=400)
    return world, root, configs, results


def _outcomes(results, index):
    return [None if r is None or len(r["steps"]) <= index else r["steps"][index] for r in results]


def _single(config, cache_dir):
    """The same config built by this one process, with the default (undivided-size) blocks."""
    config = {k: v for k, v in config.items() if k != "blend_block_samples"}
    config.update(cache_dir=str(cache_dir), shared_fs=True, megatron_cache_dir=None)
    return tokenloom.build(config)


@pytest.mark.timeout(600)
def test_every_rank_count_writes_the_bytes_of_one_process(run, tmp_path):
    world, root, configs, results = run
    for index, (name, config) in enumerate(configs.items()):
        outcomes = _outcomes(results, index)
        assert all(o is not None and o["ok"] for o in outcomes), (name, outcomes)
        single = _single(config, tmp_path / name)
        assert {o["build_key"] for o in outcomes} == {single.build_key}, name
        expected = cache_files(tmp_path / name)
        caches = [root / f"local{r}" for r in range(world)] if name == "local" else [root / "shared"]
        for cache in caches:
            got = cache_files(cache)
            assert all(got.get(k) == v for k, v in expected.items()), (name, cache)
            assert tb.verify_cache(str(cache)).ok, name
        assert not os.listdir(caches[0] / "tmp"), name  # nothing half-written left behind


@pytest.mark.timeout(600)
def test_the_blends_are_megatron_cores(run):
    helpers_cpp = pytest.importorskip("megatron.core.datasets.helpers_cpp")
    world, root, _, _ = run
    cache = Cache(str(root / "shared"))
    blends = [key for key in cache.item_keys() if cache.read_record(key)["kind"] == "blend"]
    assert len(blends) >= 10
    divided = 0
    for key in blends:
        record = cache.read_record(key)
        params = record["params"]
        if params["size"] is None:  # exhaustive
            sizes = np.asarray(params["weights"], dtype=np.int64)
            size = int(sizes.sum())
        else:
            size = params["size"]
        dataset_index = np.zeros(size, dtype=np.int16)
        sample_index = np.zeros(size, dtype=np.int64)
        if params["size"] is None:
            helpers_cpp.build_exhaustive_blending_indices(dataset_index, sample_index, sizes, len(sizes))
        else:
            weights = np.asarray(params["weights"], dtype=np.float64)
            helpers_cpp.build_blending_indices(dataset_index, sample_index, weights, len(weights), size, False)
        np.testing.assert_array_equal(cache.open_array(key, "dataset_index"), dataset_index)
        np.testing.assert_array_equal(cache.open_array(key, "dataset_sample_index"), sample_index)
        bounds = record["built_by"]["bounds"]
        assert len(bounds) == world + 1 and bounds[0] == 0 and bounds[-1] == size
        divided += sum(1 for r in range(world) if bounds[r + 1] > bounds[r]) > 1
    assert divided > 0 if world > 1 else divided == 0  # some blends really were cut between ranks
    long_key = max(blends, key=lambda key: cache.read_record(key)["params"]["size"] or 0)  # "long"'s train
    long_bounds = cache.read_record(long_key)["built_by"]["bounds"]
    assert sum(1 for r in range(world) if long_bounds[r + 1] > long_bounds[r]) == world  # every rank a range


@pytest.mark.timeout(600)
def test_megatron_core_loads_the_divided_blends_as_cache_hits(run):
    pytest.importorskip("megatron.core")
    from megatron_fixtures import megatron_build_without_building

    _, root, configs, _ = run
    config = dict(configs["four"])
    datasets = megatron_build_without_building(config, root / "megatron")
    train = tokenloom.build(config).split("train")
    assert len(datasets[0]) == train.num_samples
    for i in (0, 11, train.num_samples - 1):
        assert (datasets[0][i]["tokens"].numpy() == train[i][:-1]).all()


@pytest.mark.timeout(600)
def test_a_failure_in_a_divided_blend_fails_every_rank_and_publishes_nothing(run):
    world, root, configs, results = run
    if world == 1:
        pytest.skip("needs a second rank")
    outcomes = _outcomes(results, len(configs))
    assert not any(o["ok"] for o in outcomes)
    messages = {o["error"] for o in outcomes}
    assert len(messages) == 1, messages
    message = messages.pop()
    assert "(while building blend " in message and message.endswith(f"[rank {world - 1}, build phase]"), message
    assert "injected fault" in message
    cache = Cache(str(root / "failed"))
    assert not [k for k in cache.item_keys() if cache.read_record(k)["kind"] == "blend"]
    assert not os.listdir(root / "failed" / "tmp")
    # a rerun on one process finishes the blends (and whatever dataset items were left)
    rerun = tokenloom.build(blend_config([*configs["four"]["blend"]["prefixes"]], root / "failed", seed=7))
    assert {i.key for i in rerun.plan.items if i.kind == "blend"} <= set(rerun.built_keys)


@pytest.mark.timeout(600)
def test_a_rank_killed_in_a_divided_blend_fails_the_others_clearly(run):
    world, root, configs, results = run
    if world == 1:
        pytest.skip("needs a second rank")
    outcomes = _outcomes(results, len(configs) + 1)
    assert outcomes[world - 1] is None  # the killed rank wrote nothing
    for outcome in outcomes[:-1]:
        assert outcome is not None and not outcome["ok"]
        assert "killed or hung" in outcome["error"]
        assert outcome["seconds"] < 15.0 + 15.0
    cache = Cache(str(root / "killed"))
    assert not [k for k in cache.item_keys() if cache.read_record(k)["kind"] == "blend"]
    builds = root / "killed" / "builds"
    assert not builds.is_dir() or not os.listdir(builds)  # no manifest: the build never finished
