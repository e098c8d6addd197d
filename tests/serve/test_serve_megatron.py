"""Exact mode: the sample at global position i is megatron-core's BlendedDataset[i], field for field."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serve_fixtures import megatron_blended, write_corpus
from tokenloom.serve import BatchGeometry, RankLoader, SampleOptions, Topology
from tokenloom.serve.loader import read_batch
from tokenloom.serve.stream import SampleStream
from tokenloom.source import StoreBlendSource

pytest.importorskip("megatron.core")
torch = pytest.importorskip("torch")


def _assert_sample_equal(ours: dict, theirs: dict, index: int) -> None:
    assert set(theirs) == set(ours), (index, sorted(theirs), sorted(ours))
    for name, value in theirs.items():
        expected = np.asarray(value)
        got = np.asarray(ours[name])
        assert got.dtype == expected.dtype, (index, name, got.dtype, expected.dtype)
        assert got.shape == expected.shape, (index, name, got.shape, expected.shape)
        np.testing.assert_array_equal(got, expected, err_msg=f"position {index}, field {name}")


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(
    num_stores=st.integers(1, 3),
    raw_weights=st.lists(st.floats(0.05, 5.0), min_size=3, max_size=3),
    num_samples=st.integers(1, 120),
    seq_length=st.integers(1, 48),
    seed=st.integers(0, 2**32 - 1),
    corpus_seed=st.integers(0, 1000),
    split=st.sampled_from(["1,0,0", "90,10,0", "7,2,1"]),
    flags=st.tuples(st.booleans(), st.booleans(), st.booleans(), st.booleans(), st.booleans()),
)
def test_positions_equal_megatron_blended_dataset(tmp_path_factory, num_stores, raw_weights, num_samples,
                                                  seq_length, seed, corpus_seed, split, flags):
    eod_mask_loss, reset_position_ids, reset_attention_mask, create_attention_mask, extra = flags
    directory = tmp_path_factory.mktemp("exact")
    prefixes = write_corpus(directory, num_stores, seed=corpus_seed, num_documents=30, max_length=30,
                            eod_rate=0.1)
    weights = raw_weights[:num_stores]
    theirs = megatron_blended(prefixes, weights, num_samples=num_samples, seq_length=seq_length, seed=seed,
                              cache_dir=directory / "cache", split=split, eod_mask_loss=eod_mask_loss,
                              reset_position_ids=reset_position_ids, reset_attention_mask=reset_attention_mask,
                              create_attention_mask=create_attention_mask, add_extra_token=extra)
    source = StoreBlendSource.from_prefixes(prefixes, weights, num_samples=num_samples, seq_length=seq_length,
                                            seed=seed, split=split, add_extra_token=extra)
    assert source.num_samples == len(theirs)
    options = SampleOptions(eod_mask_loss=eod_mask_loss, reset_position_ids=reset_position_ids,
                            reset_attention_mask=reset_attention_mask,
                            create_attention_mask=create_attention_mask)
    ours = read_batch(SampleStream(source), np.arange(len(theirs)), options)
    for i in range(len(theirs)):
        _assert_sample_equal({k: v[i] for k, v in ours.items()}, theirs[i], i)


def test_rank_loader_micro_batches_are_megatron_samples_in_megatron_sampler_order(tmp_path):
    """dp rank r's micro-batch m of step k holds BlendedDataset[c + m*micro*dp + r*micro + j]
    (MegatronPretrainingSampler's order), for every dp rank of a dp=3 job."""
    prefixes = write_corpus(tmp_path, 2, seed=3)
    theirs = megatron_blended(prefixes, [0.7, 0.3], num_samples=96, seq_length=12, seed=5,
                              cache_dir=tmp_path / "cache", create_attention_mask=False)
    source = StoreBlendSource.from_prefixes(prefixes, [0.7, 0.3], num_samples=96, seq_length=12, seed=5)
    geometry = BatchGeometry(global_batch_size=12, micro_batch_size=2, dp=3)
    for dp_rank in range(3):
        loader = RankLoader(source, geometry, topology=Topology(dp=3), rank=dp_rank, max_steps=4)
        batches = list(loader)
        assert len(batches) == 4 * 2
        for n, batch in enumerate(batches):
            step, micro = divmod(n, 2)
            for j in range(2):
                position = step * 12 + micro * 6 + dp_rank * 2 + j
                _assert_sample_equal({k: v[j] for k, v in batch.items()}, theirs[position], position)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(num_samples=st.integers(1, 60), seq_length=st.integers(2, 40), seed=st.integers(0, 2**31),
       corpus_seed=st.integers(0, 1000), drop=st.booleans())
def test_validation_split_with_padded_last_sample(tmp_path_factory, num_samples, seq_length, seed, corpus_seed, drop):
    """The valid split, where megatron-core may keep a short last sample and pads it."""
    directory = tmp_path_factory.mktemp("valid")
    prefixes = write_corpus(directory, 2, seed=corpus_seed, num_documents=30, max_length=30, eod_rate=0.1)
    theirs = megatron_blended(prefixes, [0.4, 0.6], num_samples=num_samples, seq_length=seq_length, seed=seed,
                              cache_dir=directory / "cache", split="6,4,0", split_name="valid",
                              eod_mask_loss=True, drop_last_partial_validation=drop, create_attention_mask=False)
    source = StoreBlendSource.from_prefixes(prefixes, [0.4, 0.6], num_samples=num_samples, seq_length=seq_length,
                                            seed=seed, split="6,4,0", split_name="valid",
                                            drop_last_partial=drop)
    ours = read_batch(SampleStream(source), np.arange(len(theirs)), SampleOptions(eod_mask_loss=True))
    for i in range(len(theirs)):
        _assert_sample_equal({k: v[i] for k, v in ours.items()}, theirs[i], i)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(1, 30), min_size=1, max_size=25), seq_length=st.integers(1, 20),
       extra=st.booleans(), drop=st.booleans(), num_samples=st.one_of(st.none(), st.integers(1, 80)),
       data=st.data())
def test_gather_matches_the_per_sample_lookup(tmp_path_factory, lengths, seq_length, extra, drop, num_samples, data):
    """The vectorised gather (one read_spans call) against tokenloom's per-sample megatron lookup."""
    from serve_fixtures import write_store
    from tokenloom.errors import ConfigError
    from tokenloom.index.megatron_gpt import build_megatron_gpt_indices, megatron_gpt_sample
    from tokenloom.io import IndexedDataset
    from tokenloom.source.readers import gather_gpt_samples

    rng = np.random.default_rng(len(lengths) * 31 + seq_length)
    prefix = write_store(str(tmp_path_factory.mktemp("gather") / "s"), [rng.integers(0, 500, n) for n in lengths],
                         vocab_size=1000, eod_id=None)
    store = IndexedDataset(prefix)
    try:
        indices = build_megatron_gpt_indices(store.sequence_lengths, np.arange(len(lengths)), num_samples=num_samples,
                                             seq_length=seq_length, seed=7, add_extra_token=extra,
                                             drop_last_partial=drop)
    except ConfigError:
        return
    if indices.num_samples == 0:
        return
    ids = np.array(data.draw(st.lists(st.integers(0, indices.num_samples - 1), min_size=1, max_size=12)))
    for backend in ("numba", "numpy"):
        rows = gather_gpt_samples(indices, store, ids, backend=backend)
        for k, i in enumerate(ids):
            np.testing.assert_array_equal(rows[k], megatron_gpt_sample(indices, store, int(i)).tokens)
        # scattered into given rows of a larger block, as a blend reads one dataset at a time
        order = np.random.default_rng(len(ids)).permutation(len(ids) + 3)[: len(ids)]
        block = np.full((len(ids) + 3, rows.shape[1]), 7, dtype=np.int64)
        gather_gpt_samples(indices, store, ids, backend=backend, out=block, out_rows=order)
        np.testing.assert_array_equal(block[order], rows)
        assert (np.delete(block, order, axis=0) == 7).all()


def test_gather_pads_a_short_last_sample(tmp_path):
    from serve_fixtures import write_store
    from tokenloom.index.megatron_gpt import build_megatron_gpt_indices, megatron_gpt_sample
    from tokenloom.io import IndexedDataset
    from tokenloom.source.readers import gather_gpt_samples

    store = IndexedDataset(write_store(str(tmp_path / "s"), [np.arange(5), np.arange(6)], vocab_size=10, eod_id=None))
    # 11 tokens, samples of 4 (+1): two whole samples and a short third one kept
    indices = build_megatron_gpt_indices(store.sequence_lengths, np.arange(2), num_samples=None, seq_length=4,
                                         seed=1, drop_last_partial=False)
    assert indices.num_samples == 3
    for backend in ("numba", "numpy"):
        rows = gather_gpt_samples(indices, store, np.arange(3), backend=backend)
        assert (rows == -1).any()
        for i in range(3):
            np.testing.assert_array_equal(rows[i], megatron_gpt_sample(indices, store, i).tokens)
