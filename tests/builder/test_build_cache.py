"""Single-process builds: reuse, invalidation, atomic layout, verification, concurrent builders,
the plan's assignment."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tokenloom
import tokenloom.builder as tb
from build_fixtures import blend_config, cache_files, make_stores, write_store
from tokenloom.builder.cache import Cache
from tokenloom.builder.items import assign_lpt, plan_build, ranges_for
from tokenloom.builder.packs import write_npy
from tokenloom.builder.runner import build as build_with_hooks
from tokenloom.builder.stores import fingerprint_store
from tokenloom.errors import BuildError, ConfigError, FormatError
from tokenloom.index.megatron_gpt import build_megatron_gpt_indices
from tokenloom.index.split import document_ids, split_document_ranges


@pytest.fixture()
def stores(tmp_path):
    return make_stores(tmp_path / "stores")


def test_build_matches_the_index_kernels_and_reuses_its_cache(stores, tmp_path):
    config = blend_config(stores, tmp_path / "cache", blend=stores[:1], train_samples=500)
    first = tokenloom.build(config)
    train = first.split("train")
    store = train.readers[0].store
    doc_range = split_document_ranges("90,8,2", store.num_sequences).train
    expected = build_megatron_gpt_indices(store.sequence_lengths, document_ids(doc_range),
                                          num_samples=500, seq_length=64, seed=1234)
    got = train.readers[0].indices
    for name in ("document_index", "sample_index", "shuffle_index"):
        assert np.array_equal(getattr(got, name), getattr(expected, name))
        assert getattr(got, name).dtype == getattr(expected, name).dtype
        assert isinstance(getattr(got, name), np.memmap)  # opened by mmap, not loaded
    assert train.num_samples == expected.num_samples >= 500  # megatron-core: whole epochs
    second = tokenloom.build(config)
    assert second.built_keys == frozenset() and first.built_keys
    assert second.build_key == first.build_key
    assert np.array_equal(second.split("valid")[3], first.split("valid")[3])


def test_blend_threads_change_nothing_in_the_cache(stores, tmp_path, monkeypatch):
    # tiny chunks, so the blend of 3000 samples really runs in three chunks from guessed states
    import importlib

    monkeypatch.setattr(importlib.import_module("tokenloom.index.megatron_blend"), "_MIN_CHUNK", 64)
    one = tokenloom.build(blend_config(stores, tmp_path / "one", blend_threads=1))
    three = tokenloom.build(blend_config(stores, tmp_path / "three", blend_threads=3))
    assert one.build_key == three.build_key  # blend_threads is not a parameter of the arrays
    blends = [item.key for item in three.plan.items if item.kind == "blend"]
    assert [one.cache.read_record(key)["threads"] for key in blends] == [1] * len(blends)
    assert [three.cache.read_record(key)["threads"] for key in blends] == [3] * len(blends)
    assert cache_files(tmp_path / "one") == cache_files(tmp_path / "three")
    with pytest.raises(ConfigError, match="blend_threads"):
        tokenloom.build(blend_config(stores, tmp_path / "bad", blend_threads=-1))


def test_npy_files_are_what_numpy_save_writes(tmp_path):
    for array in (np.arange(10, dtype=np.int32), np.zeros((5, 2), np.int64), np.arange(7, dtype=np.uint32),
                  np.zeros(0, np.int16)):
        meta = write_npy(str(tmp_path / "a.npy"), array)
        buffer = io.BytesIO()
        np.save(buffer, array)
        data = (tmp_path / "a.npy").read_bytes()
        assert data == buffer.getvalue()
        assert meta["bytes"] == len(data)


def test_a_changed_store_invalidates_only_its_items(stores, tmp_path):
    config = blend_config(stores, tmp_path / "cache")
    before = tokenloom.build(config)
    old = before.split("train").readers[1].key
    write_store(stores[1], 400 + 97, seed=99)  # same name and size class, other lengths
    after = tokenloom.build(config)
    rebuilt = after.built_keys
    assert old not in {d.key for d in after.split("train").readers}
    untouched = {d.key for n in ("train", "valid", "test") for d in after.split(n).readers
                 if d.prefix != stores[1]}
    assert not untouched & rebuilt  # other stores' items were reused
    fresh = tokenloom.build(blend_config(stores, tmp_path / "fresh"))
    assert cache_files(tmp_path / "fresh").items() <= cache_files(tmp_path / "cache").items()
    assert np.array_equal(after.split("train")[5], fresh.split("train")[5])


def test_touching_a_store_changes_its_fingerprint(stores):
    config = tb.BuildConfig(**{k: v for k, v in blend_config(stores, "/unused").items()})
    before = fingerprint_store(stores[0], ranges_for(config, stores[0]))
    stat = os.stat(stores[0] + ".idx")
    os.utime(stores[0] + ".idx", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    after = fingerprint_store(stores[0], ranges_for(config, stores[0]))
    assert before.fingerprint.idx_sha256 == after.fingerprint.idx_sha256
    assert before.fingerprint != after.fingerprint


def test_add_extra_token_changes_tokenloom_keys_but_not_megatron_names(stores, tmp_path):
    base = tokenloom.build(blend_config(stores, tmp_path / "c"), dry_run=True)
    flipped = tokenloom.build(blend_config(stores, tmp_path / "c", add_extra_token=False), dry_run=True)
    gpt = lambda plan: {i.megatron.md5: i.key for i in plan.items if i.kind == "gpt"}  # noqa: E731
    base_names, flipped_names = gpt(base), gpt(flipped)
    # megatron-core names both builds' files alike: its cache would serve stale arrays
    assert base_names.keys() == flipped_names.keys()
    assert not set(base_names.values()) & set(flipped_names.values())


def test_dry_run_writes_nothing_and_reports_the_plan(stores, tmp_path):
    seen = {}
    plan = tokenloom.build(blend_config(stores, tmp_path / "cache"), dry_run=True,
                           on_plan=lambda p, done: seen.update(plan=p, done=done))
    assert not os.path.exists(tmp_path / "cache" / "items")
    assert seen["plan"] is plan and seen["done"] == frozenset()
    text = plan.describe()
    assert "12 items (9 dataset indices, 3 blends)" in text
    assert "cache size" in text and "slowest rank" in text


def test_verify_names_a_changed_array_and_a_truncated_pack(stores, tmp_path):
    from tokenloom.builder.cache import Cache

    cache_dir = tmp_path / "cache"
    result = tokenloom.build(blend_config(stores, cache_dir))
    assert tb.verify_cache(str(cache_dir)).ok
    cache = Cache(str(cache_dir))
    key = result.split("train").readers[0].key
    pack, entry = cache.locate(key, "shuffle_index")
    with open(pack, "r+b") as f:  # flip the last byte of one array
        f.seek(entry["offset"] + entry["bytes"] - 1)
        last = f.read(1)
        f.seek(entry["offset"] + entry["bytes"] - 1)
        f.write(bytes([last[0] ^ 0xFF]))
    report = tb.verify_cache(str(cache_dir))
    assert not report.ok and len(report.problems) == 1
    assert f"shuffle_index.npy of item {key}" in report.problems[0] and "SHA-256" in report.problems[0]
    with open(pack, "r+b") as f:
        f.truncate(entry["offset"] + 10)
    report = tb.verify_cache(str(cache_dir))
    assert any("truncated" in p for p in report.problems)


def test_manifest_records_versions_keys_files_and_timings(stores, tmp_path):
    result = tokenloom.build(blend_config(stores, tmp_path / "cache"))
    manifest = json.loads(open(result.manifest_path).read())
    assert manifest["build_key"] == result.build_key
    assert {"tokenloom_version", "numpy_version", "stores", "items", "timings_rank0"} <= set(manifest)
    assert len(manifest["items"]) == len(result.plan.items)
    assert all(entry["files"] and entry["built_this_run"] for entry in manifest["items"])
    assert set(manifest["stores"]) == set(stores)
    assert not os.listdir(tmp_path / "cache" / "tmp")  # nothing half-written left behind
    packs = os.listdir(tmp_path / "cache" / "packs")
    # one pack (data, key list, index) holds every dataset item of this one-rank build; each
    # exact blend, written in place by every rank, has a pack of its own
    blends = sum(1 for item in result.plan.items if item.kind == "blend")
    assert blends and len(packs) == 3 * (1 + blends)
    assert {os.path.splitext(name)[1] for name in packs} == {".bin", ".keys", ".json"}


def test_an_item_failure_is_a_build_error_naming_the_item(stores, tmp_path):
    def fail_blend(item, rank):
        if item.kind == "blend" and item.split == "valid":
            raise OSError("disk full")

    # one process: the cause, then what was being built; no rank or phase
    with pytest.raises(BuildError, match=r"^OSError: disk full \(while building blend valid [^\[]*\)$"):
        build_with_hooks(blend_config(stores, tmp_path / "cache"), _before_item=fail_blend)
    rerun = tokenloom.build(blend_config(stores, tmp_path / "cache"))
    assert len(rerun.built_keys) < len(rerun.plan.items)


def test_a_missing_store_is_named(tmp_path, stores):
    with pytest.raises(BuildError, match=r"store .*nope"):
        tokenloom.build(blend_config([stores[0], str(tmp_path / "nope")], tmp_path / "cache"))


def test_oversampling_raises_like_megatron():
    from tokenloom.builder.exact import build_blend_arrays

    params = {"weights": [0.5, 0.5], "size": 10, "dataset_lengths": [3, 10]}
    with pytest.raises(BuildError, match="asks 5 samples of dataset 0, whose index holds only 3"):
        build_blend_arrays(params)
    arrays = build_blend_arrays({**params, "dataset_lengths": [5, 5]})
    assert np.bincount(arrays["dataset_index"]).tolist() == [5, 5]


_CONCURRENT = """
import sys, json
sys.path.insert(0, {src!r})
import tokenloom
import tokenloom.builder as tb
from tokenloom.builder.runner import build as build_with_hooks
result = tokenloom.build(json.loads({config!r}))
print(json.dumps(sorted(result.built_keys)))
"""


@pytest.mark.timeout(300)
def test_two_concurrent_builders_share_one_cache_correctly(stores, tmp_path):
    src = os.path.join(os.path.dirname(__file__), "..", "..", "src")
    tokenloom.build(blend_config(stores, tmp_path / "alone", train_samples=20000))
    shared_once = False
    for attempt in range(3):
        config = blend_config(stores, tmp_path / f"cache{attempt}", train_samples=20000, rng_workers=0)
        script = _CONCURRENT.format(src=os.path.abspath(src), config=json.dumps(config))
        procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                 for _ in range(2)]
        outputs = [p.communicate(timeout=110) for p in procs]
        assert all(p.returncode == 0 for p in procs), [o[1].decode()[-2000:] for o in outputs]
        built = [set(json.loads(o[0].decode().strip().splitlines()[-1])) for o in outputs]
        total = len(tokenloom.build(config, dry_run=True).items)
        # Every item was built, whatever the timing, and the cache holds exactly the files a lone
        # build writes. Mostly one job builds an item and the other waits on its lock and reuses
        # it; but record locks belong to processes, so where one job's build thread waits on the
        # other's blend thread and back, the kernel refuses the wait (EDEADLK) and both build
        # (identical bytes). That can happen to every item of a run, so sharing is asked of one
        # run in three.
        assert len(built[0] | built[1]) == total
        assert tb.verify_cache(str(tmp_path / f"cache{attempt}")).ok
        assert cache_files(tmp_path / f"cache{attempt}") == cache_files(tmp_path / "alone")
        if len(built[0] & built[1]) < total:
            shared_once = True
            break
    assert shared_once, "in three runs the two jobs never shared an item: the item locks do not work"


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seq_length=st.integers(1, 700), train=st.integers(1, 40_000), valid=st.integers(0, 3000),
       keep_partial=st.booleans(), extra=st.booleans())
def test_the_plan_made_from_token_counts_is_the_one_the_store_gives(stores, tmp_path, seq_length, train, valid,
                                                                      keep_partial, extra):
    # the build draws and walks from each item's plan, made from the stores' token counts when
    # planning; it must be the plan megatron-core's arithmetic gives over the store's lengths
    from tokenloom.builder.exact import plan_gpt
    from tokenloom.io import IndexedDataset

    config = blend_config(stores, tmp_path / "cache", seq_length=seq_length, train_samples=train,
                          valid_samples=valid, add_extra_token=extra,
                          drop_last_partial_validation_sequence=not keep_partial)
    try:
        plan = tokenloom.build(config, dry_run=True)
    except ConfigError:
        return  # more samples than a split can give: refused when planning
    for item in plan.items:
        if item.kind == "gpt":
            assert item.epoch_plan == plan_gpt(IndexedDataset(item.prefix), item.params), item.label


_HOLD_LOCK = """
import sys, time
sys.path.insert(0, {src!r})
from tokenloom.builder.cache import Cache
cache = Cache({root!r})
cache.acquire({key!r})
print("held", flush=True)
sys.stdin.readline()  # until the test has published the item
"""


def _publish(root, key):
    """Publish item ``key`` into the cache at ``root`` as another job would (its own Cache)."""
    from tokenloom.builder.packs import PackWriter

    writer = PackWriter(Cache(str(root)))
    writer.add(key, {"a": np.arange(4, dtype=np.int64)}, {"kind": "test"})
    writer.close()


@pytest.mark.timeout(60)
def test_built_elsewhere_lists_again_after_a_contended_lock_or_when_the_listing_is_old(tmp_path, monkeypatch):
    import tokenloom.builder.cache as cache_module

    root = tmp_path / "cache"
    cache = Cache(str(root))
    cache.refresh()  # a fresh listing: nothing published
    first, second = "a" * 40, "b" * 40

    # uncontended and listed just now: answered from the packs already known, no listing
    _publish(root, first)
    monkeypatch.setattr(cache_module, "RELIST_S", 3600.0)
    token = cache.acquire(first)
    assert not cache.built_elsewhere(first, token)
    cache.release(token)
    # the same question once the listing is older than RELIST_S: listed again, found
    monkeypatch.setattr(cache_module, "RELIST_S", 0.0)
    token = cache.acquire(first)
    assert cache.built_elsewhere(first, token)
    cache.release(token)

    # another job holds the lock while it builds and publishes: after the wait, always listed
    monkeypatch.setattr(cache_module, "RELIST_S", 3600.0)
    cache.refresh()
    src = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "src"))
    other = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK.format(src=src, root=str(root), key=second)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "held"
        tokens = []
        waiter = threading.Thread(target=lambda: tokens.append(cache.acquire(second)))
        waiter.start()  # finds the lock held (the other job holds it until told), so it waits
        waiter.join(0.5)
        assert waiter.is_alive(), "took a lock another process holds"
        _publish(root, second)
        other.stdin.write("done\n")
        other.stdin.flush()  # the other job exits, which releases its lock
        waiter.join(30)
        assert cache.built_elsewhere(second, tokens[0])
        cache.release(tokens[0])
    finally:
        other.kill()
        other.wait()
    cache.close_locks()


def test_import_does_not_import_torch():
    code = "import sys, tokenloom, tokenloom.builder, tokenloom.cli.builder; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def _lpt_reference(costs, world):
    loads = [0.0] * world
    for cost in sorted(costs, reverse=True):
        loads[loads.index(min(loads))] += cost
    return loads


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(0.001, 100.0), min_size=1, max_size=40), st.integers(1, 8))
def test_lpt_assignment_is_balanced(costs, world):
    from tokenloom.builder.items import WorkItem

    items = [WorkItem(kind="gpt", key=f"{i:04d}", split="train", label=str(i), params={}, num_samples=1,
                      output_bytes=1, cost_s=c) for i, c in enumerate(costs)]
    assignment = assign_lpt(items, world)
    loads = [0.0] * world
    for item in items:
        loads[assignment[item.key]] += item.cost_s
    assert sorted(loads) == pytest.approx(sorted(_lpt_reference(costs, world)))
    # the least-loaded rule never exceeds the mean load plus one item (Graham)
    assert max(loads) <= sum(costs) / world + max(costs) + 1e-9


@settings(max_examples=40, deadline=None)
@given(costs=st.lists(st.floats(1e-3, 0.05), min_size=0, max_size=400), world=st.integers(1, 16),
       blend_samples=st.integers(1, 3 * 10**7), block=st.sampled_from([1 << 16, 1 << 20, 1 << 22]),
       big=st.floats(0.0, 3.0))
def test_blend_blocks_are_evened_out_by_the_items(costs, world, blend_samples, block, big):
    """A blend is cut on whole blocks, so ranks' blend shares differ by up to a block; the items
    are then assigned again from those shares. The plan's slowest rank is never slower than the
    first assignment's, and within one item of the level the whole work allows."""
    from types import SimpleNamespace

    from tokenloom.builder.cost_model import COST_PER_BLEND_SAMPLE_S
    from tokenloom.builder.items import BuildPlan, WorkItem, assign_work, divide_blends

    costs = costs + ([big] if big > 0 else [])  # at times one item worth many blocks
    items = [WorkItem(kind="gpt", key=f"{i:04d}", split="train", label=str(i), params={}, num_samples=1,
                      output_bytes=1, cost_s=c) for i, c in enumerate(costs)]
    blend = WorkItem(kind="blend", key="blend", split="train", label="blend", params={}, num_samples=blend_samples,
                     output_bytes=10 * blend_samples, cost_s=2e-3 + COST_PER_BLEND_SAMPLE_S * blend_samples)
    config = SimpleNamespace(mode="exact", blend_block_samples=block)
    plan = assign_work(config, [*items, blend], [], world, [*items, blend])
    loads = plan.seconds_per_rank()
    assert sorted(plan.assignment) == sorted(item.key for item in items)
    bounds = plan.divided["blend"]
    assert bounds[0] == 0 and bounds[-1] == blend_samples and list(bounds) == sorted(bounds)
    # the first assignment alone (items, then the blend cut around them)
    fixed = list(plan.fixed_s)
    first = assign_lpt(items, world, fixed)
    first_loads = list(fixed)
    for item in items:
        first_loads[first[item.key]] += item.cost_s
    first_plan = BuildPlan(items=tuple([*items, blend]), splits=(), world_size=world, assignment=first,
                           divided=divide_blends([blend], first_loads, block), fixed_s=tuple(fixed))
    assert max(loads) <= max(first_plan.seconds_per_rank()) + 1e-12
    if plan.assignment != first:  # the second assignment: LPT from the blend shares (Graham's bound)
        blend_loads = BuildPlan(items=tuple([*items, blend]), splits=(), world_size=world, assignment={},
                                divided=plan.divided, fixed_s=tuple(fixed)).seconds_per_rank()
        assert max(loads) <= max(max(blend_loads), sum(loads) / world + max(costs)) + 1e-9


def test_blend_blocks_do_not_leave_ranks_a_block_apart():
    """The benchmark's shape: 16 ranks, 3000 dataset items of a few ms, a train blend of 7.1e7
    positions in blocks of 2**20 (4.2 blocks a rank). Cut around the items alone, some ranks carry
    a block more than others (about 0.16 s); assigning the items again evens that out."""
    from types import SimpleNamespace

    from tokenloom.builder.cost_model import COST_PER_BLEND_SAMPLE_S
    from tokenloom.builder.items import WorkItem, assign_work

    rng = np.random.default_rng(0)
    items = [WorkItem(kind="gpt", key=f"{i:04d}", split="train", label=str(i), params={}, num_samples=1,
                      output_bytes=1, cost_s=float(c)) for i, c in enumerate(rng.uniform(1e-3, 9e-3, 3000))]
    size = 71_000_000
    blend = WorkItem(kind="blend", key="blend", split="train", label="blend", params={}, num_samples=size,
                     output_bytes=10 * size, cost_s=2e-3 + COST_PER_BLEND_SAMPLE_S * size)
    plan = assign_work(SimpleNamespace(mode="exact", blend_block_samples=1 << 20), [*items, blend], [], 16,
                       [*items, blend])
    loads = plan.seconds_per_rank()
    assert max(loads) - min(loads) < 0.01


def test_shuffle_workers_only_where_a_core_is_spare():
    from tokenloom.builder.phases.build_items import MIN_BACKGROUND_WORK_S, shuffle_workers

    much = MIN_BACKGROUND_WORK_S * 4
    assert shuffle_workers(1, much, cores_per_rank=2) == 1  # one rank on 2 cores: a worker
    assert shuffle_workers(3, much, cores_per_rank=16) == 3
    assert shuffle_workers(1, much, cores_per_rank=1) == 0  # every core runs a rank: inline
    assert shuffle_workers(1, MIN_BACKGROUND_WORK_S / 2, cores_per_rank=8) == 0  # too little to repay it
    assert shuffle_workers(0, much, cores_per_rank=8) == 0


def test_world_size_is_checked(stores, tmp_path):
    config = tb.BuildConfig(**blend_config(stores, tmp_path))
    with pytest.raises(ConfigError, match="world_size"):
        plan_build(config, {}, 0)


def test_stateless_mode_serves_the_stateless_index_and_exact_counts(stores, tmp_path):
    from tokenloom.index.blend import largest_remainder_counts
    from tokenloom.index.stateless import build_stateless_gpt_index

    result = tokenloom.build(blend_config(stores, tmp_path / "cache", mode="stateless"))
    train = result.split("train")
    assert train.num_samples == 3000  # exactly the samples asked for, no surplus
    dataset_ids, sample_ids = train.locate(np.arange(train.num_samples))
    assert np.bincount(dataset_ids).tolist() == largest_remainder_counts(np.array([0.3, 0.5, 0.2]), 3000).tolist()
    for d, dataset in enumerate(train.readers):
        store = dataset.store
        doc_range = split_document_ranges("90,8,2", store.num_sequences).train
        wanted = int(np.sum(dataset_ids == d))
        direct = build_stateless_gpt_index(store.sequence_lengths, document_ids(doc_range), num_samples=wanted,
                                           seq_length=64, seed=1234)
        picks = sample_ids[dataset_ids == d][:5]
        got = train.read_samples(np.full(len(picks), d), picks)
        for row, sample in zip(got, picks):
            assert np.array_equal(row, direct.read(store, int(sample)))
    exact = tokenloom.build(blend_config(stores, tmp_path / "exact"))
    stateless_bytes = sum(len(v) for v in cache_files(tmp_path / "cache").values())
    exact_bytes = sum(len(v) for v in cache_files(tmp_path / "exact").values())
    assert stateless_bytes * 4 < exact_bytes
    assert exact.build_key != result.build_key


def test_build_is_a_function_of_the_package(stores, tmp_path):
    import tokenloom

    result = tokenloom.build(blend_config(stores, tmp_path / "cache"), dry_run=True)
    assert isinstance(result, tb.BuildPlan)


@pytest.mark.timeout(120)
def test_background_shuffle_draws_equal_inline_draws(stores, tmp_path):
    from tokenloom.builder.exact import ShuffleDrawer, build_gpt_arrays

    plan = tokenloom.build(blend_config(stores, tmp_path / "cache"), dry_run=True)
    jobs = [(item.prefix, dict(item.params)) for item in plan.items if item.kind == "gpt"][:4]
    drawer = ShuffleDrawer(jobs, workers=1)  # a separate process, two items ahead
    try:
        for index, (prefix, params) in enumerate(jobs):
            background, _ = build_gpt_arrays(prefix, params, drawer.get(index))
            inline, _ = build_gpt_arrays(prefix, params)
            for name in inline:
                assert np.array_equal(background[name], inline[name])
                assert background[name].dtype == inline[name].dtype
    finally:
        drawer.close()


def test_verify_names_the_damaged_block_of_a_divided_blend(stores, tmp_path):
    result = tokenloom.build(blend_config(stores, tmp_path / "cache", blend_block_samples=64))
    blend = next(item for item in result.plan.items if item.kind == "blend" and item.split == "train")
    cache = Cache(str(tmp_path / "cache"))
    record = cache.read_record(blend.key)
    meta = record["files"]["dataset_sample_index.npy"]
    assert meta["hash"] == "sha256-blocks" and meta["block_bytes"] == 64 * 8
    assert len(meta["blocks"]) == -(-blend.num_samples // 64)
    assert result.rank_seconds[0]["predicted_s"] > 0 and result.rank_seconds[0]["cpu_s"] > 0
    pack = tmp_path / "cache" / "packs" / f"{record['pack']}.bin"
    data = bytearray(pack.read_bytes())
    data[meta["data_offset"] + 3 * 64 * 8 + 5] ^= 0xFF  # one byte of block 3
    pack.write_bytes(bytes(data))
    report = tb.verify_cache(str(tmp_path / "cache"))
    assert not report.ok
    (problem,) = report.problems
    assert "dataset_sample_index.npy" in problem and "block 3," in problem


def _pack_of(cache_dir, key) -> str:
    """The index path (packs/NAME.json) of the pack that holds item ``key``."""
    path, _ = Cache(str(cache_dir)).entry(key)
    return path[: -len(".bin")] + ".json"


def test_a_pack_index_is_read_only_when_one_of_its_records_is_asked_for(stores, tmp_path):
    # every item is found from the packs' key lists; a pack's index (its records, the bulk of the
    # cache's metadata) is parsed on the first read of one of them: a damaged index of a pack
    # not read does not stop the others, and the one read names its file
    cache_dir = tmp_path / "cache"
    result = tokenloom.build(blend_config(stores, cache_dir))
    blend_key = next(item.key for item in result.plan.items if item.kind == "blend" and item.split == "train")
    dataset_key = result.split("train").readers[0].key
    dataset_pack = _pack_of(cache_dir, dataset_key)
    assert dataset_pack != _pack_of(cache_dir, blend_key)
    with open(dataset_pack, "w") as f:
        f.write('{"format": "tokenloom-pack", "items": {')  # cut short
    cache = Cache(str(cache_dir))
    assert set(cache.item_keys()) == {item.key for item in result.plan.items}
    assert cache.has(dataset_key)  # from the key list alone
    assert cache.open_array(blend_key, "dataset_index").shape == (result.split("train").num_samples,)
    for _ in range(2):
        with pytest.raises(FormatError, match=f"{dataset_pack}: unreadable pack index"):
            cache.read_record(dataset_key)
    report = tb.verify_cache(str(cache_dir))  # verify lists it with the rest, it does not stop
    assert not report.ok and any(p.startswith(f"{dataset_pack}: unreadable pack index") for p in report.problems)


def test_packs_without_key_lists_are_read_whole(stores, tmp_path):
    # caches written before key lists existed: their indexes are parsed when the pack is found
    cache_dir = tmp_path / "cache"
    first = tokenloom.build(blend_config(stores, cache_dir))
    for name in os.listdir(cache_dir / "packs"):
        if name.endswith(".keys"):
            os.remove(cache_dir / "packs" / name)
    assert sorted(Cache(str(cache_dir)).item_keys()) == sorted(item.key for item in first.plan.items)
    again = tokenloom.build(blend_config(stores, cache_dir))
    assert again.built_keys == frozenset() and again.build_key == first.build_key
    assert np.array_equal(again.split("train")[7], first.split("train")[7])
    assert tb.verify_cache(str(cache_dir)).ok


def test_a_key_list_that_disagrees_with_its_index_is_named(stores, tmp_path):
    cache_dir = tmp_path / "cache"
    result = tokenloom.build(blend_config(stores, cache_dir))
    key = result.split("train").readers[0].key
    index = _pack_of(cache_dir, key)
    keys_path = index[: -len(".json")] + ".keys"
    ghost = "f" * 40
    with open(keys_path, "a") as f:
        f.write(f"{ghost}\n")
    cache = Cache(str(cache_dir))
    assert cache.has(ghost)
    with pytest.raises(FormatError, match=f"{index}: item {ghost} is in the pack's key list"):
        cache.read_record(ghost)
    report = tb.verify_cache(str(cache_dir))
    assert not report.ok
    assert any(p.startswith(f"{index}: its key list names") and "damaged" in p for p in report.problems)


def test_streamed_records_are_the_copies_readers_take(stores, tmp_path):
    result = tokenloom.build(blend_config(stores, tmp_path / "cache", mode="stateless"))
    keys = [item.key for item in result.plan.items]
    half = Cache(str(tmp_path / "cache"))
    half.read_record(keys[0])  # one pack parsed already, the others known by their key lists
    assert dict(half.stream_records(keys)) == {k: Cache(str(tmp_path / "cache")).read_record(k) for k in keys}
    with pytest.raises(BuildError, match="cache item 0000 is missing"):
        list(Cache(str(tmp_path / "cache")).stream_records(["0000"]))
    pack = sorted((tmp_path / "cache" / "packs").glob("*.json"))[0]
    pack.write_text("{not json")
    with pytest.raises(FormatError, match=f"{pack}: unreadable pack index"):
        list(Cache(str(tmp_path / "cache")).stream_records(keys))
