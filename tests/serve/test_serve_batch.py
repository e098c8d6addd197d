"""The one batch pipeline: its field schema equals what it returns, on every rank and adapter."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from serve_fixtures import write_corpus
from tokenloom.errors import ConfigError
from tokenloom.serve import BatchGeometry, RankLoader, SampleOptions, Topology, field_schema
from tokenloom.serve.batch import read_fields
from tokenloom.serve.loader import read_batch
from tokenloom.serve.stream import SampleStream
from tokenloom.serve.topology import INPUT_FIELDS, TARGET_FIELDS
from tokenloom.source import DatasetInfo, StatelessBlendSource, StoreBlendSource

SEQ = 16
OPTIONS = [
    SampleOptions(),
    SampleOptions(eod_mask_loss=True, reset_position_ids=True),
    SampleOptions(create_attention_mask=True),
    SampleOptions(eod_mask_loss=True, reset_position_ids=True, reset_attention_mask=True, create_attention_mask=True),
]
STAGE_FIELDS = [None, INPUT_FIELDS + TARGET_FIELDS, INPUT_FIELDS, TARGET_FIELDS, ()]


class ManyDatasets:
    """A source with 32767 datasets more than ``inner`` (never read), so megatron-core's dataset
    ids are int32; reads and locates go to ``inner``."""

    def __init__(self, inner) -> None:
        self.inner = inner
        unused = DatasetInfo(name="unused", weight=0.0, num_samples=0, eod_id=inner.datasets[0].eod_id)
        self.datasets = tuple(inner.datasets) + (unused,) * 32767
        self.build_key, self.num_samples, self.seq_length = inner.build_key, inner.num_samples, inner.seq_length
        self.add_extra_token, self.pad_id = inner.add_extra_token, inner.pad_id

    def locate(self, positions):
        return self.inner.locate(positions)

    def read_samples(self, dataset_ids, sample_ids):
        return self.inner.read_samples(dataset_ids, sample_ids)


@pytest.fixture(scope="module")
def prefixes(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("batch"), 3, seed=31, num_documents=60, eod_rate=0.1)


def _source(prefixes, kind: str, extra: bool, wide_ids: bool):
    cls = StoreBlendSource if kind == "exact" else StatelessBlendSource
    source = cls.from_prefixes(prefixes, [0.5, 0.3, 0.2], num_samples=120, seq_length=SEQ, seed=4,
                               add_extra_token=extra)
    return ManyDatasets(source) if wide_ids else source


@pytest.mark.parametrize("kind,extra,wide_ids", [("exact", True, False), ("exact", False, True),
                                                 ("stateless", True, True), ("stateless", False, False)])
def test_schema_is_what_the_pipeline_returns(prefixes, kind, extra, wide_ids):
    source = _source(prefixes, kind, extra, wide_ids)
    expected_id_dtype = np.int32 if wide_ids else np.int16
    for options, fields, cp, micro in itertools.product(OPTIONS, STAGE_FIELDS, (1, 2, 4), (1, 3)):
        schema = field_schema(source, micro, options=options, fields=fields, cp_size=cp)
        assert schema["dataset_id"] == ((micro,), np.dtype(expected_id_dtype))
        for cp_rank in range(cp):
            dataset_ids, sample_ids = source.locate(np.arange(micro * cp_rank, micro * (cp_rank + 1)))
            got = read_fields(source, dataset_ids, sample_ids, options=options, fields=fields, cp_size=cp,
                              cp_rank=cp_rank)
            case = (options, fields, cp, cp_rank, micro)
            assert list(got) == list(schema), case
            for name, value in got.items():
                assert (value.shape, value.dtype) == schema[name], (case, name)
        if fields is None:
            assert set(schema) - {"dataset_id"} == set(options.field_names)


def test_every_rank_of_a_job_gets_its_schema(prefixes):
    source = _source(prefixes, "exact", True, False)
    options = OPTIONS[3]
    topology = Topology(dp=2, tp=2, pp=3, cp=2)
    geometry = BatchGeometry(global_batch_size=8, micro_batch_size=2, dp=2)
    for rank in range(topology.world_size):
        loader = RankLoader(source, geometry, topology=topology, rank=rank, options=options, mode="every_rank",
                            max_steps=2)
        schema = field_schema(source, 2, options=options, fields=loader.plan.fields, cp_size=topology.cp)
        for batch in loader:
            if not loader.plan.fields:
                assert batch is None
                continue
            assert {k: (v.shape, v.dtype) for k, v in batch.items()} == schema, rank


def test_read_batch_is_the_pipeline_at_located_positions(prefixes):
    source = _source(prefixes, "stateless", True, False)
    positions = np.array([7, 3, 100, 3])
    expected = read_fields(source, *source.locate(positions), options=OPTIONS[3])
    got = read_batch(SampleStream(source), positions, OPTIONS[3])
    assert list(got) == list(expected)
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)


def test_schema_refusals(prefixes):
    source = _source(prefixes, "exact", True, False)
    with pytest.raises(ConfigError, match="micro_batch_size=0; expected a positive integer"):
        field_schema(source, 0)
    with pytest.raises(ConfigError, match="seq_length=16 is not divisible by 2 x cp = 6"):
        field_schema(source, 2, cp_size=3)


def test_torch_batch_shapes_match_the_dataset(prefixes):
    torch = pytest.importorskip("torch")
    from tokenloom.serve.torch_adapter import ServeDataset, batch_shapes

    source = _source(prefixes, "stateless", True, True)
    pairs = np.stack(source.locate(np.arange(3)), axis=1)  # (3, 2)
    for options, fields, cp in itertools.product(OPTIONS, STAGE_FIELDS[1:], (1, 2)):
        shapes = batch_shapes(source, 3, fields, cp, options)
        assert shapes["dataset_id"] == ((3,), torch.int32)
        batch = ServeDataset(source, options=options, fields=fields, cp_size=cp, cp_rank=cp - 1)[pairs]
        assert {k: (tuple(v.shape), v.dtype) for k, v in batch.items()} == shapes, (options, fields, cp)


def test_rank_loaders_share_their_refusals(prefixes, tmp_path):
    """RankLoader and DistributedBatches set up through one schedule: both refuse a topology of
    another dp, and EOD options without EOD ids on every rank (a middle stage too)."""
    pytest.importorskip("torch")
    from serve_fixtures import write_store
    from tokenloom.serve.torch_adapter import DistributedBatches

    source = _source(prefixes, "exact", True, False)
    rng = np.random.default_rng(0)
    bare_prefix = write_store(str(tmp_path / "bare"), [np.append(rng.integers(0, 90, 20), 99) for _ in range(30)],
                              vocab_size=100, eod_id=None)
    bare = StoreBlendSource.from_prefixes([bare_prefix], num_samples=20, seq_length=8, seed=1)
    geometry = BatchGeometry(global_batch_size=4, micro_batch_size=2, dp=2)
    middle = Topology(dp=2, pp=3).rank_of(pp_rank=1)
    for make in (lambda src, topo, rank, **kw: RankLoader(src, geometry, topology=topo, rank=rank, **kw),
                 lambda src, topo, rank, **kw: DistributedBatches(src, geometry, topo, rank, **kw)):
        with pytest.raises(ConfigError, match="the topology has dp=1 but the batch geometry dp=2"):
            make(source, Topology(dp=1), 0)
        with pytest.raises(ConfigError, match="have no EOD id"):
            make(bare, Topology(dp=2, pp=3), middle, options=SampleOptions(eod_mask_loss=True))
        assert make(bare, Topology(dp=2, pp=3), middle).next_batch() is None
