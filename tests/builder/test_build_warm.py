"""Warm starts: the store fingerprint memo (what it trusts, what makes it hash again), opening a
build without touching its stores, and planning divided over ranks giving the one plan."""

from __future__ import annotations

import errno
import json
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tokenloom
import tokenloom.builder.phases.fingerprint as fingerprint_module
import tokenloom.builder.stores as stores_module
from build_fixtures import blend_config, make_stores, write_store
from tokenloom.builder.config import as_build_config
from tokenloom.builder.items import dataset_items, ranges_for, resolve_items
from tokenloom.builder.stores import FingerprintMemo, fingerprint_store
from tokenloom.errors import ConfigError
from tokenloom.source import readers as readers_module


@pytest.fixture()
def stores(tmp_path):
    return make_stores(tmp_path / "stores")


@pytest.fixture(autouse=True)
def general_path(monkeypatch):
    """Every start here takes the general path: these tests are about the fingerprint memo, which
    a warm-start record would skip (test_build_starts.py tests the records)."""
    monkeypatch.setattr(fingerprint_module, "start_key", lambda config: None)


class _Opens:
    """Counts the stores the fingerprinting opens."""

    def __init__(self, monkeypatch) -> None:
        self.prefixes: list[str] = []
        real = stores_module.IndexedDataset

        def counting(prefix):
            self.prefixes.append(prefix)
            return real(prefix)

        monkeypatch.setattr(stores_module, "IndexedDataset", counting)


def _age(prefix: str, seconds: float = 10.0) -> None:
    """Move both files' mtime back (ctime stays now: the memo's racy rule sees max of the two)."""
    for path in (prefix + ".idx", prefix + ".bin"):
        st = os.stat(path)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns - int(seconds * 1e9)))


def test_unchanged_stores_are_not_hashed_again(stores, tmp_path, monkeypatch):
    monkeypatch.setattr(stores_module, "RACY_NS", 0)  # the files here are seconds old: trust them
    config = blend_config(stores, tmp_path / "cache")
    first = tokenloom.build(config)
    memo = json.load(open(tmp_path / "cache" / "stores.json"))
    assert sorted(memo["stores"]) == sorted(os.path.abspath(p) for p in stores)
    opens = _Opens(monkeypatch)
    second = tokenloom.build(config)
    assert opens.prefixes == []  # every fingerprint came from the memo
    assert second.build_key == first.build_key and second.built_keys == frozenset()
    hashed = tokenloom.build(dict(config, verify_stores="hash"))
    assert sorted(opens.prefixes) == sorted(stores)  # hash: every store opened and hashed
    assert hashed.build_key == first.build_key


def test_a_store_changed_under_the_same_size_and_mtime_is_hashed_again(stores, tmp_path, monkeypatch):
    monkeypatch.setattr(stores_module, "RACY_NS", 0)
    config = blend_config(stores, tmp_path / "cache")
    first = tokenloom.build(config)
    # rewrite store 1 with other document lengths but the same file sizes, then restore its mtimes
    # (what cp -p or rsync -t do): only the ctime and inode tell
    target = stores[1]
    before = {p: os.stat(p) for p in (target + ".idx", target + ".bin")}
    old = np.fromfile(target + ".idx", dtype=np.uint8)
    write_store(target, 400 + 97, seed=99)  # same count of documents: same .idx size
    sizes = {p: os.path.getsize(p) for p in before}
    if sizes[target + ".bin"] != before[target + ".bin"].st_size:  # keep the .bin size too
        os.truncate(target + ".bin", before[target + ".bin"].st_size)
    for path, stat in before.items():
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert not np.array_equal(np.fromfile(target + ".idx", dtype=np.uint8), old)
    opens = _Opens(monkeypatch)
    second = tokenloom.build(config)
    assert opens.prefixes == [target]
    assert second.build_key != first.build_key


def test_stores_changed_just_before_they_were_recorded_are_not_trusted(stores, tmp_path, monkeypatch):
    config = blend_config(stores, tmp_path / "cache")
    for prefix in stores[:2]:
        _age(prefix, 60.0)
    # ctime is now for all of them: within RACY_NS of the record, so none may be trusted yet
    tokenloom.build(config)
    opens = _Opens(monkeypatch)
    tokenloom.build(config)
    assert sorted(opens.prefixes) == sorted(stores)
    # once the files are older than the margin when recorded, the memo is used
    monkeypatch.setattr(stores_module, "RACY_NS", 0)
    tokenloom.build(config)
    opens.prefixes.clear()
    tokenloom.build(config)
    assert opens.prefixes == []


def test_a_damaged_memo_is_ignored_with_a_warning(stores, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(stores_module, "RACY_NS", 0)
    config = blend_config(stores, tmp_path / "cache")
    first = tokenloom.build(config)
    (tmp_path / "cache" / "stores.json").write_text('{"format": "tokenloom-store-fingerprints", "ver')
    opens = _Opens(monkeypatch)
    with caplog.at_level("WARNING"):
        second = tokenloom.build(config)
    assert "unreadable store fingerprint memo" in caplog.text
    assert sorted(opens.prefixes) == sorted(stores) and second.build_key == first.build_key
    json.load(open(tmp_path / "cache" / "stores.json"))  # rewritten whole


def test_a_damaged_memo_entry_is_hashed_again(stores, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(stores_module, "RACY_NS", 0)
    config = blend_config(stores, tmp_path / "cache")
    first = tokenloom.build(config)
    path = tmp_path / "cache" / "stores.json"
    memo = json.load(open(path))
    key = os.path.abspath(stores[0])
    memo["stores"][key] = {"stats": memo["stores"][key]["stats"], "seen_ns": 2**62}  # no fingerprint
    memo["stores"][os.path.abspath(stores[1])]["ranges"] = "garbage"
    path.write_text(json.dumps(memo))
    opens = _Opens(monkeypatch)
    with caplog.at_level("WARNING"):
        second = tokenloom.build(config)
    assert "unusable memo entry" in caplog.text
    assert sorted(opens.prefixes) == sorted(stores[:2]) and second.build_key == first.build_key


def test_other_split_ranges_are_counted_afresh(stores, tmp_path, monkeypatch):
    monkeypatch.setattr(stores_module, "RACY_NS", 0)
    memo_path = str(tmp_path / "stores.json")
    first_config = as_build_config(blend_config(stores, tmp_path / "cache"))
    memo = FingerprintMemo(memo_path)
    infos = [fingerprint_store(p, ranges_for(first_config, p), memo) for p in stores]
    memo.merge_and_save(memo.fresh)
    other = as_build_config(blend_config(stores, tmp_path / "cache", split="50,25,25"))
    memo = FingerprintMemo(memo_path)
    again = fingerprint_store(stores[0], ranges_for(other, stores[0]), memo)
    fresh = fingerprint_store(stores[0], ranges_for(other, stores[0]))
    assert memo.hits == 0 and again == fresh
    assert again.fingerprint == infos[0].fingerprint
    memo.merge_and_save(memo.fresh)
    memo = FingerprintMemo(memo_path)  # both configs' ranges are now known
    for config in (first_config, other):
        assert fingerprint_store(stores[0], ranges_for(config, stores[0]), memo) == \
            fingerprint_store(stores[0], ranges_for(config, stores[0]))
    assert memo.hits == 2


def test_verify_stores_is_checked():
    with pytest.raises(ConfigError, match="verify_stores='sha'"):
        as_build_config(dict(blend_config(["a"], "c"), verify_stores="sha"))


# -- opening without touching the stores --------------------------------------------------------


def test_a_build_opens_each_store_on_its_first_read(stores, tmp_path, monkeypatch):
    opened: list[str] = []
    real = readers_module.IndexedDataset

    def counting(prefix):
        opened.append(prefix)
        return real(prefix)

    monkeypatch.setattr(readers_module, "IndexedDataset", counting)
    for mode in ("exact", "stateless"):
        opened.clear()
        result = tokenloom.build(blend_config(stores, tmp_path / mode, mode=mode))
        train = result.split("train")
        assert opened == [] and len(train) > 0 and not any(r.store_open for r in train.readers)
        dataset_ids, sample_ids = train.locate(np.arange(64))
        first = int(dataset_ids[0])
        rows = train.read_samples(dataset_ids[:1], sample_ids[:1])
        assert opened == [stores[first]]
        # the same samples as reading with every store open from the start
        again = tokenloom.build(blend_config(stores, tmp_path / mode, mode=mode)).split("train")
        for reader in again.readers:
            reader.store  # noqa: B018 - open them all
        assert np.array_equal(again.read_samples(dataset_ids[:1], sample_ids[:1]), rows)
        assert np.array_equal(again.read_samples(dataset_ids, sample_ids), train.read_samples(dataset_ids, sample_ids))


def test_running_out_of_file_descriptors_names_the_limit(stores, tmp_path, monkeypatch):
    result = tokenloom.build(blend_config(stores, tmp_path / "cache"))

    def exhausted(prefix):
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(readers_module, "IndexedDataset", exhausted)
    train = result.split("train")
    with pytest.raises(ConfigError, match=r"store0: cannot open the store: .*limit of \d+ open files .*ulimit -n"):
        train.read_samples(np.array([0]), np.array([0]))


# -- planning divided over ranks ------------------------------------------------------------------


def _items_and_splits(config, infos, made=None):
    items, splits = resolve_items(config, infos, made)
    return [(i.key, i.kind, i.num_samples, i.cost_s, i.output_bytes) for i in items], splits


@settings(max_examples=15, deadline=None)
@given(world=st.integers(1, 5), mode=st.sampled_from(["exact", "stateless"]),
       weighted=st.booleans(), per_split=st.booleans())
def test_dataset_items_made_by_parts_give_the_one_plan(tmp_path_factory, world, mode, weighted, per_split):
    directory = tmp_path_factory.getbasetemp() / "plan-stores"
    prefixes = make_stores(directory, 4) if not (directory / "store3.idx").exists() \
        else [str(directory / f"store{i}") for i in range(4)]
    raw = blend_config(prefixes, "unused", mode=mode)
    if not weighted:
        raw["blend"].pop("weights")
        raw.update(train_samples=None, valid_samples=None, test_samples=None)
    if per_split:
        blend = raw.pop("blend")
        raw.pop("split")
        raw["blend_per_split"] = [blend, {"prefixes": prefixes[1:3]}, None]
        raw["test_samples"] = None
    config = as_build_config(raw)
    infos = {p: fingerprint_store(p, ranges_for(config, p)) for p in config.prefixes}
    made: dict = {}
    for rank in range(world):
        part = {p: infos[p] for p in config.prefixes[rank::world]}
        made.update(dataset_items(config, part))
    assert _items_and_splits(config, infos, made) == _items_and_splits(config, infos)


def test_a_split_pickles_and_reads_the_same_in_the_copy(stores, tmp_path):
    # a DataLoader worker started by spawn gets the split by pickle: stores and arrays open there
    import pickle

    for mode in ("exact", "stateless"):
        train = tokenloom.build(blend_config(stores, tmp_path / mode, mode=mode)).split("train")
        dataset_ids, sample_ids = train.locate(np.arange(40))
        copy = pickle.loads(pickle.dumps(train))
        assert not any(r.store_open for r in copy.readers)
        assert np.array_equal(copy.read_samples(dataset_ids, sample_ids), train.read_samples(dataset_ids, sample_ids))
        assert copy.build_key == train.build_key
