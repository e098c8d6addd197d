"""Warm-start records: a start with an unchanged config and unchanged stores takes the kept plan
(nothing fingerprinted or planned), gives exactly what the general path gives, and falls back to
the general path on every rank for any change it cannot rule out."""

from __future__ import annotations

import logging
import os
import pickle
import time

import numpy as np
import pytest

import tokenloom
import tokenloom.builder.phases.fingerprint as fingerprint_module
import tokenloom.builder.phases.plan as plan_module
import tokenloom.builder.stores as stores_module
from build_fixtures import blend_config, cache_files, launch, make_stores, write_store
from tokenloom.builder.config import as_build_config
from tokenloom.builder.starts import STARTS_DIR, read_start, record_path, start_key


@pytest.fixture()
def stores(tmp_path):
    return make_stores(tmp_path / "stores")


@pytest.fixture()
def trusting(monkeypatch):
    """Stores written a moment ago are trusted (the racy margin is for clocks, tested apart)."""
    monkeypatch.setattr(stores_module, "RACY_NS", 0)


class _Planning:
    """Counts fingerprints and plans made by the general path."""

    def __init__(self, monkeypatch) -> None:
        self.fingerprinted: list[str] = []
        self.plans = 0
        real_fingerprint, real_plan = fingerprint_module.fingerprint_store, plan_module.resolve_items

        def fingerprint(prefix, *args, **kwargs):
            self.fingerprinted.append(prefix)
            return real_fingerprint(prefix, *args, **kwargs)

        def plan(*args, **kwargs):
            self.plans += 1
            return real_plan(*args, **kwargs)

        monkeypatch.setattr(fingerprint_module, "fingerprint_store", fingerprint)
        monkeypatch.setattr(plan_module, "resolve_items", plan)


def _served(result) -> dict[str, np.ndarray]:
    out = {}
    for name, split in result.splits.items():
        ids = np.arange(len(split))
        dataset_ids, sample_ids = split.locate(ids)
        out[name] = split.read_samples(dataset_ids[:50], sample_ids[:50])
        out[name + "/where"] = np.stack([dataset_ids, sample_ids])
    return out


@pytest.mark.parametrize("mode", ["exact", "stateless"])
def test_an_unchanged_start_takes_the_kept_plan_and_serves_the_same(stores, tmp_path, monkeypatch, trusting, mode):
    config = blend_config(stores, tmp_path / "cache", mode=mode)
    first = tokenloom.build(config)
    assert not first.warm_start
    key = start_key(as_build_config(config))
    assert os.path.isfile(record_path(str(tmp_path / "cache"), key))
    planning = _Planning(monkeypatch)
    second = tokenloom.build(config)
    assert second.warm_start and planning.fingerprinted == [] and planning.plans == 0
    assert second.build_key == first.build_key and second.built_keys == frozenset()
    assert second.manifest_path == first.manifest_path
    assert [(i.key, i.kind, i.num_samples, i.epoch_plan) for i in second.plan.items] == \
           [(i.key, i.kind, i.num_samples, i.epoch_plan) for i in first.plan.items]
    assert second.plan.splits == first.plan.splits
    for name, rows in _served(first).items():
        assert np.array_equal(_served(second)[name], rows), name
    assert tokenloom.build(config, dry_run=True).items == second.plan.items  # a dry run takes it too


def test_a_changed_store_falls_back_and_builds_what_a_fresh_cache_builds(stores, tmp_path, monkeypatch, trusting):
    config = blend_config(stores, tmp_path / "cache")
    first = tokenloom.build(config)
    write_store(stores[2], 380, seed=42)  # other documents: other dataset items, another blend
    planning = _Planning(monkeypatch)
    second = tokenloom.build(config)
    assert not second.warm_start and planning.plans == 1
    assert second.build_key != first.build_key and second.built_keys
    fresh = tokenloom.build(dict(config, cache_dir=str(tmp_path / "fresh")))
    assert fresh.build_key == second.build_key
    for name, rows in _served(fresh).items():
        assert np.array_equal(_served(second)[name], rows), name
    third = tokenloom.build(config)  # and the new plan is the one kept now
    assert third.warm_start and third.build_key == second.build_key


def test_a_touched_store_is_checked_again(stores, tmp_path, monkeypatch, trusting):
    config = blend_config(stores, tmp_path / "cache")
    tokenloom.build(config)
    os.utime(stores[0] + ".bin")  # same bytes, new mtime and ctime
    planning = _Planning(monkeypatch)
    second = tokenloom.build(config)
    assert not second.warm_start and stores[0] in planning.fingerprinted
    assert tokenloom.build(config).warm_start


def test_any_config_change_plans_again(stores, tmp_path, monkeypatch, trusting):
    config = blend_config(stores, tmp_path / "cache")
    tokenloom.build(config)
    for change in ({"seed": 99}, {"timeout_s": 61.0}, {"blend": {"prefixes": stores, "weights": [3.0, 5.0, 2.5]}}):
        assert not tokenloom.build(dict(config, **change)).warm_start, change
    assert tokenloom.build(config).warm_start


def test_a_record_of_other_planning_code_is_not_taken(stores, tmp_path, monkeypatch, trusting):
    import tokenloom.builder.starts as starts_module

    config = blend_config(stores, tmp_path / "cache")
    tokenloom.build(config)
    monkeypatch.setattr(starts_module, "plan_code_digest", lambda: "an edited checkout")
    assert not tokenloom.build(config).warm_start
    assert tokenloom.build(config).warm_start  # kept again under the new code's key


def test_a_missing_item_or_manifest_falls_back_and_rebuilds_it(stores, tmp_path, trusting):
    config = blend_config(stores, tmp_path / "cache")
    first = tokenloom.build(config)
    before = cache_files(tmp_path / "cache")
    packs = os.path.join(str(tmp_path / "cache"), "packs")
    for name in os.listdir(packs):  # drop every pack: the items are gone
        os.unlink(os.path.join(packs, name))
    again = tokenloom.build(config)
    assert not again.warm_start and again.built_keys == frozenset(i.key for i in first.plan.items)
    assert cache_files(tmp_path / "cache") == before
    os.unlink(again.manifest_path)
    last = tokenloom.build(config)
    assert not last.warm_start and os.path.isfile(last.manifest_path)


def test_stores_changed_just_before_they_were_recorded_are_not_trusted(stores, tmp_path):
    config = blend_config(stores, tmp_path / "cache")
    tokenloom.build(config)  # the stores are under 2 s old: recorded, but racy
    assert not tokenloom.build(config).warm_start


def test_no_record_without_the_stat_check(stores, tmp_path, trusting):
    config = blend_config(stores, tmp_path / "cache", verify_stores="hash")
    assert start_key(as_build_config(config)) is None
    tokenloom.build(config)
    assert not tokenloom.build(config).warm_start
    assert not os.path.exists(os.path.join(str(tmp_path / "cache"), STARTS_DIR))


def test_a_damaged_record_is_ignored_with_a_warning(stores, tmp_path, trusting, caplog):
    config = blend_config(stores, tmp_path / "cache")
    first = tokenloom.build(config)
    path = record_path(str(tmp_path / "cache"), start_key(as_build_config(config)))
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
    with caplog.at_level(logging.WARNING):
        again = tokenloom.build(config)
    assert not again.warm_start and again.build_key == first.build_key
    assert "unusable warm-start record" in caplog.text and path in caplog.text
    assert tokenloom.build(config).warm_start  # the general path kept it again


class _Planted:
    def __reduce__(self):
        return (os.system, ("touch planted",))


def test_a_record_cannot_run_code(stores, tmp_path, trusting, caplog, monkeypatch):
    config = blend_config(stores, tmp_path / "cache")
    tokenloom.build(config)
    key = start_key(as_build_config(config))
    path = record_path(str(tmp_path / "cache"), key)
    with open(path, "wb") as f:
        pickle.dump({"format": "tokenloom-warm-start", "version": 1, "key": key, "items": (_Planted(),)}, f)
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.WARNING):
        assert read_start(str(tmp_path / "cache"), key) is None
        assert not tokenloom.build(config).warm_start
    assert not (tmp_path / "planted").exists()
    assert "may not build posix.system" in caplog.text


def test_ranks_take_the_kept_plan_together_and_fall_back_together(tmp_path):
    stores = make_stores(tmp_path / "stores", 4)
    time.sleep(2.1)  # the stores' files older than the racy margin when the cold build records them
    shared = blend_config(stores, tmp_path / "cache")
    alone = blend_config(stores, str(tmp_path / "node{rank}"), shared_fs=False)
    steps = [{"config": shared}, {"config": shared}, {"config": alone}, {"config": alone}]
    (tmp_path / "out").mkdir()
    results = launch(2, steps, tmp_path / "out", timeout_s=240)
    for rank in (0, 1):
        cold, warm, cold_alone, warm_alone = results[rank]["steps"]
        assert all(step["ok"] for step in results[rank]["steps"])
        assert [step["warm_start"] for step in (cold, warm, cold_alone, warm_alone)] == [False, True, False, True]
        assert warm["build_key"] == cold["build_key"] == warm_alone["build_key"]
        assert warm["first"] == cold["first"] == warm_alone["first"]
    # a store only rank 1 checks (its share: stores 1 and 3) changes its ctime: both ranks plan again
    os.utime(stores[3] + ".idx")
    (tmp_path / "out2").mkdir()
    results = launch(2, [{"config": shared}], tmp_path / "out2", timeout_s=240)
    assert [r["steps"][0]["warm_start"] for r in results] == [False, False]
    assert len({r["steps"][0]["build_key"] for r in results}) == 1
    assert results[0]["steps"][0]["first"] == results[1]["steps"][0]["first"]
