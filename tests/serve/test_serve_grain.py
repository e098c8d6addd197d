"""The grain adapter: a split as grain's RandomAccessDataSource (through grain's own MapDataset,
DataLoader and worker processes), and tokenloom's stream as a grain IterDataset equal to
HostLoader, whose grain state restores on another host count."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest

import tokenloom
from serve_fixtures import write_corpus
from tokenloom.errors import ConfigError
from tokenloom.serve import SampleOptions
from tokenloom.serve.jax_adapter import HostLoader, ShardOptions

grain = pytest.importorskip("grain")

from tokenloom.serve.grain_adapter import GrainSource, GrainStream  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def absl_flags_parsed():
    """grain's worker processes read absl flags, which a program's main parses (MaxText's does);
    under pytest nothing has, so take the defaults."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()

OPTIONS = SampleOptions(eod_mask_loss=True, inter_document_masking=True, boundary_format="segments")
G = 16


@pytest.fixture(scope="module", params=["exact", "best_fit"])
def split(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"grain-{request.param}")
    prefixes = write_corpus(root, 3, seed=17, num_documents=90)
    config = {"blend": {"prefixes": prefixes, "weights": [5.0, 3.0, 2.0]}, "split": "100,0,0", "seq_length": 12,
              "train_samples": 640, "valid_samples": 0, "test_samples": 0, "seed": 5, "cache_dir": str(root / "cache")}
    if request.param == "best_fit":
        config["packing"] = "best_fit"
    return tokenloom.build(config).split("train")


def _assert_equal(a: dict, b: dict, what: str = "") -> None:
    assert set(a) == set(b), what
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=f"{what} field {k}")


def _host_steps(split, shard: ShardOptions, steps: int, state=None) -> list[dict]:
    loader = HostLoader(split, global_batch_size=G, shard=shard, options=OPTIONS, max_steps=steps)
    if state is not None:
        loader.load_state_dict(state)
    return list(loader)


def test_a_record_is_the_sample_at_that_position(split):
    source = GrainSource(split, options=OPTIONS)
    assert len(source) == split.num_samples
    whole = _host_steps(split, ShardOptions(shard_index=0, shard_count=1), 2)
    for position in (0, 5, G + 3):
        record = source[position]
        step, row = divmod(position, G)
        _assert_equal(record, {k: v[row] for k, v in whole[step].items()}, f"position {position}")
    many = source._getitems([3, 0, G + 1])
    _assert_equal(many[1], source[0])
    with pytest.raises(IndexError, match=r"expected 0 \.\. "):
        source[len(source)]
    with pytest.raises(ConfigError, match="boundary_format='thd'"):
        GrainSource(split, options=SampleOptions(inter_document_masking=True, boundary_format="thd"))
    # after reads (stores, index and blend arrays mapped), a copy for a worker carries none of them
    blob = pickle.dumps(source)
    assert len(blob) < 16 * 1024, len(blob)  # about 3 KB; carrying the arrays made it 40 KB here
    copy = pickle.loads(blob)
    assert copy._pipeline is None and not any(r.store_open for r in copy.stream.source.readers)
    _assert_equal(copy[7], source[7])


def test_grain_pipelines_with_worker_processes_read_what_one_process_reads(split):
    source = GrainSource(split, options=SampleOptions(eod_mask_loss=True), fields=("tokens", "labels", "loss_mask"))

    def dataset_batches(workers):  # grain's dataset API, as MaxText builds it: batches, then workers
        dataset = grain.MapDataset.source(source).shuffle(seed=3).batch(8, drop_remainder=True)
        iterable = dataset.to_iter_dataset()
        if workers:
            iterable = iterable.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
        return [b for _, b in zip(range(6), iterable)]

    alone, with_workers = dataset_batches(0), dataset_batches(2)
    assert len(alone) == 6
    for a, b in zip(alone, with_workers):
        _assert_equal(a, b)
    tokens = np.concatenate([b["tokens"] for b in alone])  # shuffled: not the first positions
    assert not np.array_equal(tokens, source.read(np.arange(tokens.shape[0]))["tokens"])

    def loader_rows(workers):  # grain's DataLoader: each worker batches its own records
        sampler = grain.samplers.IndexSampler(len(source), shard_options=grain.sharding.NoSharding(), shuffle=True,
                                              num_epochs=1, seed=3)
        loader = grain.DataLoader(data_source=source, sampler=sampler, worker_count=workers,
                                  operations=[grain.transforms.Batch(batch_size=8, drop_remainder=True)])
        return sorted(map(tuple, np.concatenate([b["tokens"] for b in loader]).tolist()))

    rows = loader_rows(0)
    assert rows == loader_rows(2) and len(rows) == len(source) // 8 * 8
    assert set(rows) <= set(map(tuple, source.read(np.arange(len(source)))["tokens"].tolist()))


def test_the_stream_is_host_loader_on_every_shard_and_restores_on_other_host_counts(split):
    whole = _host_steps(split, ShardOptions(shard_index=0, shard_count=1), 8)
    # 4 hosts, 3 steps each, through grain; each host's rows are its quarter of the global batch
    iterators = [iter(GrainStream(split, global_batch_size=G, shard=ShardOptions(shard_index=p, shard_count=4),
                                  options=OPTIONS)) for p in range(4)]
    for step in range(3):
        parts = [next(it) for it in iterators]
        _assert_equal({k: np.concatenate([p[k] for p in parts]) for k in parts[0]}, whole[step], f"step {step}")
    states = [it.get_state() for it in iterators]
    assert all(s == states[0] for s in states)  # layout-free: the same on every host
    state = json.loads(json.dumps(states[0]))
    for hosts in (2, 8):  # restored on another host count: the same global batches follow
        resumed = []
        for p in range(hosts):
            it = iter(GrainStream(split, global_batch_size=G, shard=grain.sharding.ShardOptions(p, hosts),
                                  options=OPTIONS, max_steps=8))
            it.set_state(state)
            resumed.append(list(it))
        for step in range(5):
            glued = {k: np.concatenate([r[step][k] for r in resumed]) for k in resumed[0][step]}
            _assert_equal(glued, whole[3 + step], f"{hosts} hosts, step {3 + step}")
        assert all(len(r) == 5 for r in resumed)


def test_skips_and_weight_changes_reach_the_stream_and_its_state(split):
    reference = HostLoader(split, global_batch_size=G, shard=ShardOptions(shard_index=0, shard_count=1),
                           options=OPTIONS)
    it = iter(GrainStream(split, global_batch_size=G, shard=ShardOptions(shard_index=0, shard_count=1),
                          options=OPTIONS))
    for _ in range(2):
        _assert_equal(next(it), next(reference))
    for target in (it.loader, reference):
        target.skip_steps(3, 4)
        target.reweight([0.2, 0.2, 0.6])
    for _ in range(3):
        _assert_equal(next(it), next(reference))
    state = json.loads(json.dumps(it.get_state()))
    again = iter(GrainStream(split, global_batch_size=G, shard=ShardOptions(shard_index=0, shard_count=1),
                             options=OPTIONS))
    again.set_state(state)  # the skip and the new weights travel in the state
    _assert_equal(next(again), next(reference))
    with pytest.raises(ConfigError, match="GrainStream iterator saved"):
        again.set_state({"last_seen_indices": {}})


def test_grain_checkpoints_the_stream_through_its_handler(split, tmp_path):
    from etils import epath
    from grain.checkpoint import CheckpointHandler

    (tmp_path / "ckpt").mkdir()
    dataset = GrainStream(split, global_batch_size=G, shard=ShardOptions(shard_index=0, shard_count=1),
                          options=OPTIONS)
    it = iter(dataset)
    next(it)
    CheckpointHandler().save(epath.Path(tmp_path / "ckpt"), it)
    expected = next(it)
    restored = iter(dataset)
    CheckpointHandler().restore(epath.Path(tmp_path / "ckpt"), restored)
    _assert_equal(next(restored), expected)


def test_a_bad_geometry_is_refused_when_the_dataset_is_made(split):
    with pytest.raises(ConfigError, match="not a multiple of shard_count=3"):
        GrainStream(split, global_batch_size=G, shard=ShardOptions(shard_index=0, shard_count=3))


def test_worker_processes_serve_the_stream_in_order_and_restore_on_other_host_counts(split):
    def pipeline(p, hosts, workers, state=None):
        stream = GrainStream(split, global_batch_size=G, shard=ShardOptions(shard_index=p, shard_count=hosts),
                             options=OPTIONS, max_steps=8)
        it = iter(stream.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers)) if workers else stream)
        if state is not None:
            it.set_state(state)
        return it

    whole = _host_steps(split, ShardOptions(shard_index=0, shard_count=1), 8)
    iterators = [pipeline(p, 2, workers=2) for p in range(2)]
    for step in range(3):
        parts = [next(it) for it in iterators]
        _assert_equal({k: np.concatenate([p[k] for p in parts]) for k in parts[0]}, whole[step], f"step {step}")
    state = json.loads(json.dumps(iterators[0].get_state()))  # grain's interleave: one tokenloom state a worker
    resumed = list(pipeline(0, 1, workers=2, state=state))  # one host, the same 2 workers
    assert len(resumed) == 5
    for step in range(5):
        _assert_equal(resumed[step], whole[3 + step], f"resumed step {3 + step}")


def test_a_worker_that_reached_max_steps_saves_the_step_it_serves_next(split):
    # worker 1 of 2 reads step 1, then passes step 2 (max_steps=2): its state must say step 3,
    # so that a run resumed with more steps does not read step 2 twice
    stream = GrainStream(split, global_batch_size=G, shard=ShardOptions(shard_index=0, shard_count=1),
                         options=OPTIONS, max_steps=2)
    stream.set_slice(slice(1, None, 2))
    it = iter(stream)
    next(it)
    assert it.get_state()["tokenloom"]["step"] == 3
    with pytest.raises(StopIteration):
        next(it)


def test_grain_source_is_the_experimental_face():
    """``tokenloom.experimental.GrainSource`` is the adapter's class, loaded with grain on first use."""
    import tokenloom.experimental as experimental

    assert experimental.GrainSource is GrainSource
    with pytest.raises(AttributeError, match="no attribute 'GrainStream'"):
        experimental.GrainStream  # noqa: B018
