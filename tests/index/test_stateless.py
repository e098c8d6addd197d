"""The stateless packed-sample index: against a slow packer, Megatron's arrays, megatron-core itself."""

from __future__ import annotations

import logging
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from index_fixtures import (
    ArrayReader,
    megatron_pieces,
    numbered_documents,
    pieces_of,
    reference_document_order,
    reference_pieces,
)
from tokenloom.errors import ConfigError
from tokenloom.index.feistel import BACKENDS
from tokenloom.index.megatron_gpt import build_sample_index, megatron_gpt_sample
from tokenloom.index.stateless import build_stateless_gpt_index

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
BACKEND_NAMES = sorted(BACKENDS)


# ----------------------------------------------------------------------------- helpers


@st.composite
def configs(draw, max_documents=30):
    num_store = draw(st.integers(1, max_documents + 5))
    lengths = np.array(draw(st.lists(st.integers(0, 40), min_size=num_store, max_size=num_store)), dtype=np.int32)
    if draw(st.booleans()):
        ids = None
        total = int(lengths.sum())
    else:
        chosen = draw(st.lists(st.integers(0, num_store - 1), min_size=1, max_size=max_documents, unique=True))
        ids = np.array(sorted(chosen) if draw(st.booleans()) else chosen, dtype=np.int64)
        total = int(lengths[ids].sum())
    assume(total > 0)
    seq_length = draw(st.integers(1, 24))
    extra = draw(st.booleans())
    per_epoch = max(0, (total - extra) // seq_length)
    num_samples = draw(st.none() | st.integers(0, max(0, per_epoch * 4 + 3)))
    return dict(lengths=lengths, ids=ids, seq_length=seq_length, extra=extra, num_samples=num_samples,
                seed=draw(st.integers(0, 2**64 - 1)), block_size=draw(st.sampled_from([1, 2, 4, 16, 64])))


def build(config, backend="auto", **overrides):
    args = dict(num_samples=config["num_samples"], seq_length=config["seq_length"], seed=config["seed"],
                add_extra_token=config["extra"], block_size=config["block_size"], backend=backend)
    args.update(overrides)
    return build_stateless_gpt_index(config["lengths"], config["ids"], **args)


def build_or_skip(config, **kw):
    try:
        return build(config, **kw)
    except ConfigError as error:  # megatron-core's final-epoch assertion, reported as ConfigError
        assume("final epoch" not in str(error))
        raise


# ----------------------------------------------------------------------------- equivalences


@SETTINGS
@given(config=configs())
def test_spans_match_the_slow_packer(config):
    index = build_or_skip(config)
    assume(index.num_samples <= 400)
    order = reference_document_order(index)
    expected = reference_pieces(config["lengths"], order, config["seq_length"], int(config["extra"]),
                                index.num_samples)
    spans = index.spans(np.arange(index.num_samples), shuffled=False)
    for k in range(index.num_samples):
        assert pieces_of(spans, k, keep_empty=False) == expected[k], k


@SETTINGS
@given(config=configs())
def test_spans_match_to_arrays_and_the_megatron_walk(config):
    index = build_or_skip(config)
    assume(index.num_samples <= 400)
    arrays = index.to_arrays()
    extra = int(config["extra"])
    assert np.array_equal(arrays.document_index, reference_document_order(index))
    # the sample index is the shared Megatron walk over this document order...
    assert np.array_equal(arrays.sample_index, build_sample_index(config["lengths"], arrays.document_index,
                                                                  index.plan))
    # ...and the stateless lookups find the same rows without it
    begin, end = index.sample_bounds(np.arange(index.num_samples))
    assert np.array_equal(begin, arrays.sample_index[:-1].astype(np.int64))
    assert np.array_equal(end, arrays.sample_index[1:].astype(np.int64))
    # served order: shuffle_index; pieces: exactly what GPTDataset reads (empty ones included)
    served = np.arange(index.num_samples)
    assert np.array_equal(index.shuffle(served), arrays.shuffle_index.astype(np.int64))
    spans = index.spans(served)
    for i in range(index.num_samples):
        k = int(arrays.shuffle_index[i])
        expected = megatron_pieces(arrays.document_index, arrays.sample_index, k, extra)
        got = pieces_of(spans, i)
        assert [row[:3] for row in got] == [row[:3] for row in expected]
        assert sum(row[3] for row in got) == config["seq_length"] + extra


def _megatron_helpers():
    pytest.importorskip("megatron.core")
    warnings.filterwarnings("ignore", module="megatron")
    logging.getLogger("megatron").setLevel(logging.ERROR)
    from megatron.core.datasets import helpers

    return helpers


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs())
def test_sample_index_equals_megatron_cores_own_build_sample_idx(config):
    helpers = _megatron_helpers()
    assume(config["seq_length"] > 1)  # megatron-core asserts seq_length > 1
    index = build_or_skip(config)
    assume(index.plan.num_tokens_per_epoch > 1 and index.num_samples > 0)
    arrays = index.to_arrays()
    theirs = helpers.build_sample_idx(np.ascontiguousarray(config["lengths"], dtype=np.int32),
                                      arrays.document_index.astype(np.int32), config["seq_length"],
                                      index.plan.num_epochs, index.plan.num_tokens_per_epoch, True,
                                      config["extra"])
    begin, end = index.sample_bounds(np.arange(index.num_samples))
    assert np.array_equal(np.vstack([begin, end[-1:]]), theirs.astype(np.int64))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs())
def test_read_returns_megatrons_tokens(config):
    index = build_or_skip(config)
    assume(0 < index.num_samples <= 200)
    reader = ArrayReader(numbered_documents(config["lengths"]))
    arrays = index.to_arrays()
    for i in range(index.num_samples):
        tokens = index.read(reader, i)
        assert tokens.dtype == np.int64 and tokens.shape == (config["seq_length"] + int(config["extra"]),)
        assert np.array_equal(tokens, megatron_gpt_sample(arrays, reader, i).tokens)


@pytest.mark.skipif(len(BACKEND_NAMES) < 2, reason="numba is not installed")
@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs())
def test_backends_agree(config):
    numba_index = build_or_skip(config, backend="numba")
    numpy_index = build(config, backend="numpy")
    assert np.array_equal(numba_index.block_token_starts, numpy_index.block_token_starts)
    ids = np.arange(numba_index.num_samples)
    for a, b in zip(numba_index.sample_bounds(ids), numpy_index.sample_bounds(ids)):
        assert np.array_equal(a, b)
    sa, sb = numba_index.spans(ids), numpy_index.spans(ids)
    for field in ("bounds", "document_ids", "offsets", "lengths", "positions"):
        assert np.array_equal(getattr(sa, field), getattr(sb, field)), field


@pytest.mark.skipif(len(BACKEND_NAMES) < 2, reason="numba is not installed")
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs())
def test_threaded_build_equals_the_streaming_build(config):
    # threads=2 splits by epoch when there are two or more epochs, else by position; more
    # threads than epochs split by position (where numba has that many threads)
    one = build_or_skip(config, backend="numba")
    for threads in (2, one.plan.num_epochs + 1):
        other = build(config, backend="numba", threads=threads)
        assert np.array_equal(one.block_token_starts, other.block_token_starts), threads


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs())
def test_block_size_changes_memory_not_samples(config):
    indices = [build_or_skip(config, block_size=k) for k in (1, 4, 64)]
    ids = np.arange(indices[0].num_samples)
    first = indices[0].spans(ids)
    for other in indices[1:]:
        spans = other.spans(ids)
        assert np.array_equal(first.positions, spans.positions) and np.array_equal(first.lengths, spans.lengths)
    blocks = [len(index.block_token_starts) for index in indices]
    assert blocks[0] >= blocks[1] >= blocks[2]


# ----------------------------------------------------------------------------- properties


@SETTINGS
@given(config=configs())
def test_every_token_is_served_exactly_once(config):
    """In served order: the samples' first seq_length tokens are the stream's first
    num_samples * seq_length tokens, each once; each extra token is the next window's first."""
    index = build_or_skip(config)
    assume(0 < index.num_samples <= 300)
    seq_length, extra = config["seq_length"], int(config["extra"])
    lengths = config["lengths"]
    spans = index.spans(np.arange(index.num_samples))
    packed = index.shuffle(np.arange(index.num_samples))
    order = reference_document_order(index)
    starts = np.concatenate([[0], np.cumsum(lengths[order], dtype=np.int64)])  # token before each position
    seen = np.zeros(index.num_samples * seq_length + extra, dtype=np.int64)
    for i in range(index.num_samples):
        tokens = np.concatenate([starts[p] + o + np.arange(n) for p, _, o, n in pieces_of(spans, i)])
        assert len(tokens) == seq_length + extra
        k = int(packed[i])
        assert np.array_equal(tokens, k * seq_length + np.arange(seq_length + extra))
        seen[tokens[:seq_length]] += 1
    assert np.all(seen[:index.num_samples * seq_length] == 1)
    # the samples cover every epoch's tokens but the tail too short for another sample
    assert index.plan.num_epochs * index.plan.num_tokens_per_epoch - index.num_samples * seq_length - extra < seq_length


@SETTINGS
@given(config=configs())
def test_shuffle_is_a_permutation_respecting_the_final_epoch(config):
    index = build_or_skip(config)
    ids = np.arange(index.num_samples)
    packed = index.shuffle(ids)
    assert np.array_equal(np.sort(packed), ids)
    if index.plan.separate_final_epoch:
        split_at = index.plan.num_samples_sans_final_epoch
        assert np.all(packed[:split_at] < split_at) and np.all(packed[split_at:] >= split_at)


@SETTINGS
@given(config=configs())
def test_same_inputs_same_index_and_a_new_seed_a_new_order(config):
    index = build_or_skip(config)
    again = build(config)
    ids = np.arange(index.num_samples)
    assert np.array_equal(index.block_token_starts, again.block_token_starts)
    assert np.array_equal(index.spans(ids).positions, again.spans(ids).positions)
    other = build(config, seed=(config["seed"] + 1) % 2**64)
    assert other.num_samples == index.num_samples
    if index.num_samples >= 10:
        assert not np.array_equal(index.shuffle(ids), other.shuffle(ids))
    if index.num_documents >= 10:
        n = index.num_documents
        assert not np.array_equal(index.documents_at(np.arange(n)), other.documents_at(np.arange(n)))


def test_epochs_are_shuffled_independently_and_the_final_epoch_apart():
    lengths = np.full(1000, 100, dtype=np.int32)  # 100_000 tokens per epoch
    index = build_stateless_gpt_index(lengths, None, num_samples=int(1.3 * 100_000 / 64), seq_length=64, seed=3)
    assert index.plan.num_epochs == 2 and index.plan.separate_final_epoch
    first, second = index.documents_at(np.arange(1000)), index.documents_at(np.arange(1000, 2000))
    assert np.array_equal(np.sort(first), np.arange(1000)) and np.array_equal(np.sort(second), np.arange(1000))
    assert not np.array_equal(first, second)
    packed = index.shuffle(np.arange(index.num_samples))
    split_at = index.plan.num_samples_sans_final_epoch
    assert split_at == (100_000 - 1) // 64
    assert np.array_equal(np.sort(packed[:split_at]), np.arange(split_at))


def test_memory_is_8_bytes_per_block():
    lengths = np.full(100_000, 7, dtype=np.int32)
    for k in (1, 16, 256):
        index = build_stateless_gpt_index(lengths, None, num_samples=None, seq_length=50, seed=1, block_size=k)
        assert index.block_token_starts.nbytes == 8 * (-(-100_000 // k) + 1)
        assert index.nbytes == index.block_token_starts.nbytes + index.document_keys.nbytes


# ----------------------------------------------------------------------------- beyond 2**31


def _bounds_from_cumsum(index, order, lengths, packed):
    """Row k of the sample index from the definition, in Python integers."""
    ends = np.cumsum(lengths[order].astype(object))
    seq, extra = index.plan.seq_length, int(index.plan.add_extra_token)
    rows = []
    for k in packed.tolist():
        if k == 0:
            rows.append((0, 0))
            continue
        q = k * seq + extra
        j = int(np.searchsorted(ends.astype(np.float64), q - 0.5))  # first end >= q (exact: ends are ints)
        while ends[j] < q:
            j += 1
        while j > 0 and ends[j - 1] >= q:
            j -= 1
        rows.append((j, k * seq - (int(ends[j]) - int(lengths[order[j]]))))
    return np.array(rows, dtype=np.int64)


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_more_than_2_pow_31_tokens_and_samples(backend):
    lengths = np.array([2**31 - 1, 5, 2**30 + 3, 0, 2**31 - 7, 17], dtype=np.int32)  # 5.4e9 tokens
    index = build_stateless_gpt_index(lengths, None, num_samples=3 * 2**31, seq_length=3, seed=11, backend=backend)
    assert index.plan.num_tokens_per_epoch > 2**32 and index.num_samples > 2**32
    order = reference_document_order(index)
    rng = np.random.default_rng(0)
    packed = np.concatenate([[0, 1, index.num_samples - 1], rng.integers(0, index.num_samples, 300)])
    begin, end = index.sample_bounds(packed)
    assert np.array_equal(begin, _bounds_from_cumsum(index, order, lengths, packed))
    assert np.array_equal(end, _bounds_from_cumsum(index, order, lengths, packed + 1))
    served = np.array([0, index.num_samples - 1, 2**32 + 5], dtype=np.int64)
    shuffled = index.shuffle(served)
    assert len(set(shuffled.tolist())) == 3 and shuffled.max() < index.num_samples
    spans = index.spans(served)
    assert np.all(np.add.reduceat(spans.lengths, spans.bounds[:-1]) == 4)


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_document_ids_beyond_2_pow_31(backend):
    num_store = 2**33 + 10
    lengths = np.lib.stride_tricks.as_strided(np.array([9], dtype=np.int32), shape=(num_store,), strides=(0,))
    ids = np.array([2**33 + 9, 5, 2**31 + 3, 2**32, 2**31 - 1], dtype=np.int64)
    index = build_stateless_gpt_index(lengths, ids, num_samples=40, seq_length=4, seed=2, backend=backend)
    spans = index.spans(np.arange(index.num_samples))
    assert set(spans.document_ids.tolist()) == set(ids.tolist())
    assert np.array_equal(index.to_arrays().document_index, reference_document_order(index))
    assert index.to_arrays().document_index.dtype == np.int64
    # a contiguous split beyond 2**31 needs no id array at all
    contiguous = np.arange(2**32, 2**32 + 50, dtype=np.int64)
    index = build_stateless_gpt_index(lengths, contiguous, num_samples=None, seq_length=8, seed=2, backend=backend)
    assert index.document_ids is None and index.first_document_id == 2**32
    assert set(index.spans(np.arange(index.num_samples)).document_ids.tolist()) <= set(contiguous.tolist())


# ----------------------------------------------------------------------------- validation


LENGTHS = np.array([5, 0, 7], dtype=np.int32)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(seq_length=0), "seq_length=0"),
        (dict(num_samples=-1), "num_samples=-1"),
        (dict(block_size=0), "block_size=0"),
        (dict(block_size=3), "block_size=3"),
        (dict(seed=-5), "seed=-5"),
        (dict(threads=0), "threads=0"),
        (dict(backend="gpu"), "backend='gpu'"),
        (dict(document_ids=np.array([1])), "no tokens"),
        (dict(document_ids=np.array([0, 3])), "[0, 3]"),
        (dict(document_ids=np.array([], dtype=np.int64)), "0 documents"),
        (dict(sequence_lengths=np.zeros(4, dtype=np.int32)), "no tokens"),
        (dict(sequence_lengths=np.array([3, -1], dtype=np.int32)), "negative"),
        (dict(sequence_lengths=np.array([1.5])), "float"),
    ],
)
def test_bad_arguments_raise_config_error(kwargs, needle):
    args = dict(sequence_lengths=LENGTHS, document_ids=None, num_samples=2, seq_length=2, seed=0)
    args.update(kwargs)
    lengths, ids = args.pop("sequence_lengths"), args.pop("document_ids")
    with pytest.raises(ConfigError) as error:
        build_stateless_gpt_index(lengths, ids, **args)
    assert needle in str(error.value)


def test_bad_sample_ids_raise_config_error():
    index = build_stateless_gpt_index(LENGTHS, None, num_samples=2, seq_length=2, seed=0)
    for bad in (np.array([index.num_samples]), np.array([-1]), np.array([0.5])):
        with pytest.raises(ConfigError):
            index.spans(bad)
    with pytest.raises(ConfigError):
        index.documents_at(np.array([index.plan.num_epochs * index.num_documents]))


def test_read_through_a_real_token_store(tmp_path):
    from tokenloom.io import IndexedDataset, IndexedDatasetWriter

    rng = np.random.default_rng(5)
    lengths = rng.integers(0, 60, 40)
    documents = [rng.integers(0, 30000, n).astype(np.uint16) for n in lengths.tolist()]
    with IndexedDatasetWriter(str(tmp_path / "store"), dtype=np.uint16) as writer:
        for tokens in documents:
            writer.add_document(tokens)
        writer.finalize()
    store = IndexedDataset(str(tmp_path / "store"))
    ids = np.arange(5, 35)
    index = build_stateless_gpt_index(store.sequence_lengths, ids, num_samples=150, seq_length=16, seed=9)
    arrays = index.to_arrays()
    for i in range(index.num_samples):
        tokens = index.read(store, i)
        assert np.array_equal(tokens, megatron_gpt_sample(arrays, store, i).tokens)
        spans = index.spans(np.array([i]))
        expected = np.concatenate([documents[d][o:o + n] for d, o, n in
                                   zip(spans.document_ids, spans.offsets, spans.lengths)])
        assert np.array_equal(tokens, expected.astype(np.int64))
