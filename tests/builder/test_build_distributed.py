"""Real multi-process gloo builds on 127.0.0.1: N ranks make the bytes one process makes, fail
together on an injected exception, survive a killed rank with a clear error, and work without a
shared filesystem. One launch of three ranks runs the scenarios in sequence (torch starts once)."""

from __future__ import annotations

import pytest

from build_fixtures import blend_config, cache_files, launch, make_stores

pytest.importorskip("torch.distributed")

import tokenloom
import tokenloom.builder as tb

WORLD = 3


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    prefixes = make_stores(root / "stores", count=4)
    shared = root / "shared"
    steps = [
        # 0: a plain build on a shared cache, also writing megatron-core's cache
        {"config": blend_config(prefixes, shared, megatron_cache_dir=str(root / "megatron"))},
        # 1: a different seed, rank 1 raising in its first dataset item
        {"config": blend_config(prefixes, shared, seed=5),
         "fault": {"rank": 1, "item_kind": "gpt", "action": "raise"}},
        # 2: the same config again, no fault: reuses what step 1 finished
        {"config": blend_config(prefixes, shared, seed=5)},
        # 3: no shared filesystem: every rank has its own cache directory
        {"config": blend_config(prefixes, str(root / "local{rank}"), shared_fs=False)},
        # 4: stateless mode on the shared cache
        {"config": blend_config(prefixes, shared, mode="stateless")},
        # 5: best-fit packing on the shared cache: the chunks divided over the ranks
        {"config": blend_config(prefixes, root / "best_fit", packing="best_fit", megatron_tokenizer=None)},
        # 6: best-fit packing, stateless blends, no shared filesystem
        {"config": blend_config(prefixes, str(root / "bf_local{rank}"), packing="best_fit", mode="stateless",
                                shared_fs=False, megatron_tokenizer=None)},
        # 7: best-fit packing, rank 1 raising in its first chunk
        {"config": blend_config(prefixes, root / "bf_fault", packing="best_fit", megatron_tokenizer=None),
         "fault": {"rank": 1, "item_kind": "pack", "action": "raise"}},
        # 8: epoch budgets, one of the budgeted stores on a node-local disk that rank 1 lacks
        {"config": blend_config([prefixes[0], str(root / "node{rank}" / "store0")], root / "budgets",
                                blend={"prefixes": [prefixes[0], str(root / "node{rank}" / "store0")],
                                       "epochs": [1.0, 2.0]}, train_samples=None)},
        # 9: rank 2 killed in its first dataset item (the group is unusable afterwards: last step)
        {"config": blend_config(prefixes, root / "killed", seed=9, timeout_s=20.0),
         "fault": {"rank": 2, "item_kind": "gpt", "action": "kill"}},
    ]
    for rank in (0, 2):  # rank 1's node lacks it
        make_stores(root / f"node{rank}", count=1)
    (root / "out").mkdir()
    results = launch(WORLD, steps, root / "out", timeout_s=240)
    return root, prefixes, results


def _step(results, index):
    return [None if r is None or len(r["steps"]) <= index else r["steps"][index] for r in results]


@pytest.mark.timeout(300)
def test_n_ranks_write_the_bytes_one_process_writes(scenario, tmp_path):
    root, prefixes, results = scenario
    outcomes = _step(results, 0)
    assert all(o["ok"] for o in outcomes), outcomes
    assert len({o["build_key"] for o in outcomes}) == 1
    assert len({tuple(o["first"]) for o in outcomes}) == 1
    single = tokenloom.build(blend_config(prefixes, tmp_path / "single"))
    expected = cache_files(tmp_path / "single")
    got = cache_files(root / "shared")
    assert set(expected) <= set(got)
    assert all(got[name] == data for name, data in expected.items())
    assert outcomes[0]["build_key"] == single.build_key
    assert [int(v) for v in single.split("train")[0][:8]] == outcomes[0]["first"]
    assert tb.verify_cache(str(root / "shared")).ok


def _one_failure(outcomes) -> str:
    """The one message every rank failed with."""
    assert not any(o["ok"] for o in outcomes)
    messages = {o["error"] for o in outcomes}
    assert len(messages) == 1, messages
    message = messages.pop()
    assert "injected fault on rank 1" in message
    return message


@pytest.mark.timeout(300)
def test_an_exception_on_one_rank_fails_every_rank_with_the_same_error(scenario):
    _, _, results = scenario
    message = _one_failure(_step(results, 1))
    assert "(while building gpt " in message and message.endswith("[rank 1, build phase]"), message


@pytest.mark.timeout(300)
def test_a_rerun_after_a_failure_reuses_finished_items(scenario):
    _, _, results = scenario
    rerun = _step(results, 2)
    assert all(o["ok"] for o in rerun)
    total_items = len(_step(results, 0)[0]["built"])
    rebuilt = set(rerun[0]["built"])
    assert 0 < len(rebuilt) < total_items  # the items other ranks finished in step 1 were kept
    assert rerun[0]["num_samples"] == _step(results, 0)[0]["num_samples"]


@pytest.mark.timeout(300)
def test_without_a_shared_filesystem_every_rank_gets_every_file(scenario, tmp_path):
    root, prefixes, results = scenario
    outcomes = _step(results, 3)
    assert all(o["ok"] for o in outcomes), outcomes
    tokenloom.build(blend_config(prefixes, tmp_path / "single"))
    expected = cache_files(tmp_path / "single")
    for rank in range(WORLD):
        local = root / f"local{rank}"
        assert cache_files(local) == expected, f"rank {rank}'s cache differs"
        assert tb.verify_cache(str(local)).ok


@pytest.mark.timeout(300)
def test_stateless_mode_on_n_ranks_matches_one_process(scenario, tmp_path):
    root, prefixes, results = scenario
    outcomes = _step(results, 4)
    assert all(o["ok"] for o in outcomes), outcomes
    single = tokenloom.build(blend_config(prefixes, tmp_path / "single", mode="stateless"))
    assert outcomes[0]["build_key"] == single.build_key
    assert [int(v) for v in single.split("train")[0][:8]] == outcomes[0]["first"]
    expected = cache_files(tmp_path / "single")
    got = cache_files(root / "shared")
    assert all(got[name] == data for name, data in expected.items())


@pytest.mark.timeout(300)
def test_best_fit_packing_on_n_ranks_matches_one_process(scenario, tmp_path):
    root, prefixes, results = scenario
    for step, cache, changes in ((5, "best_fit", {}), (6, "bf_local{rank}", {"mode": "stateless"})):
        outcomes = _step(results, step)
        assert all(o["ok"] for o in outcomes), outcomes
        config = blend_config(prefixes, tmp_path / f"single{step}", packing="best_fit", megatron_tokenizer=None,
                              **changes)
        single = tokenloom.build(config)
        assert {o["build_key"] for o in outcomes} == {single.build_key}
        assert [int(v) for v in single.split("train")[0][:8]] == outcomes[0]["first"]
        expected = cache_files(tmp_path / f"single{step}")
        for rank in range(WORLD if "{rank}" in cache else 1):
            assert cache_files(root / cache.format(rank=rank)) == expected, (step, rank)
        packs = [item.key for item in single.plan.items if item.kind == "pack"]
        assert set(packs) <= set(outcomes[0]["built"])  # built by this run, in its pack phase


@pytest.mark.timeout(300)
def test_a_failing_chunk_fails_every_rank_with_the_same_error(scenario):
    _, _, results = scenario
    message = _one_failure(_step(results, 7))
    assert "(while building pack " in message and message.endswith("[rank 1, pack phase]"), message


@pytest.mark.timeout(300)
def test_a_budgeted_store_missing_on_one_rank_fails_every_rank_with_its_message(scenario):
    """Resolving epoch budgets reads the stores before any item: rank 1's missing store is every
    rank's error at once, not rank 1's alone while the others wait for the group."""
    root, _, results = scenario
    outcomes = _step(results, 8)
    assert all(o is not None and not o["ok"] for o in outcomes), outcomes
    messages = {o["error"] for o in outcomes}
    assert len(messages) == 1, messages
    message = messages.pop()
    assert f"no token store at {root / 'node1' / 'store0'}" in message, message
    assert message.endswith("[rank 1, resolve phase]"), message
    assert all(o["seconds"] < 60.0 for o in outcomes)  # well inside the group's timeout (60 s)


@pytest.mark.timeout(300)
def test_a_killed_rank_makes_the_others_fail_with_a_clear_error(scenario):
    root, prefixes, results = scenario
    outcomes = _step(results, 9)
    assert outcomes[2] is None  # the killed rank wrote nothing
    for rank in (0, 1):
        outcome = outcomes[rank]
        assert outcome is not None and not outcome["ok"]
        assert "killed or hung" in outcome["error"]
        assert outcome["seconds"] < 20.0 + 15.0
    # rerunning alone reuses what the survivors finished before the failure
    rerun = tokenloom.build(blend_config(prefixes, root / "killed", seed=9))
    assert 0 < len(rerun.built_keys) < len(rerun.plan.items)


@pytest.mark.timeout(300)
def test_megatron_core_loads_the_multi_rank_cache(scenario):
    root, prefixes, _ = scenario
    megatron = pytest.importorskip("megatron.core")
    del megatron
    from megatron_fixtures import megatron_build_without_building

    datasets = megatron_build_without_building(blend_config(prefixes, root / "shared"), root / "megatron")
    train = tokenloom.build(blend_config(prefixes, root / "shared")).split("train")
    assert len(datasets[0]) == train.num_samples
    for i in (0, 7, train.num_samples - 1):
        assert (datasets[0][i]["tokens"].numpy() == train[i][:-1]).all()


@pytest.mark.timeout(300)
def test_a_hung_rank_makes_the_others_fail_within_the_timeout(tmp_path):
    # A hung rank (stopped: alive, its sockets open) closes no connection, so the others learn
    # of it only from the build group's timeout. They must give up within it, not the job's.
    prefixes = make_stores(tmp_path / "stores", count=4)
    timeout_s = 10.0
    steps = [{"config": blend_config(prefixes, tmp_path / "hung", seed=11, timeout_s=timeout_s),
              "fault": {"rank": 1, "item_kind": "gpt", "action": "hang"}}]
    (tmp_path / "out").mkdir()
    outcomes = _step(launch(3, steps, tmp_path / "out", timeout_s=180, hung_ranks=(1,)), 0)
    assert outcomes[1] is None  # stopped before it could write anything
    for rank in (0, 2):
        outcome = outcomes[rank]
        assert outcome is not None and not outcome["ok"], outcome
        assert "did not answer" in outcome["error"] and "killed or hung" in outcome["error"]
        assert f"{timeout_s:g} s" in outcome["error"]
        assert outcome["seconds"] < timeout_s + 15.0
