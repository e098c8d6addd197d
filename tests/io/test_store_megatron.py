"""Stores are interchangeable with megatron-core's IndexedDataset, byte for byte."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenloom.io import IndexedDataset, IndexedDatasetWriter, validate

mcore_indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
torch = pytest.importorskip("torch")

# A document: a list of sequences (Megatron's add_item ... end_document).
document = st.lists(st.lists(st.integers(0, 60000), max_size=20), min_size=1, max_size=3)
# megatron-core cannot memory-map an empty .bin, so every corpus holds at least one token.
corpus = st.lists(document, max_size=12).filter(lambda docs: any(seq for doc in docs for seq in doc))
dtypes = st.sampled_from([np.uint16, np.int32, np.int64, np.uint8])


def _clip(docs, dtype):
    high = np.iinfo(dtype).max
    return [[[min(t, high) for t in seq] for seq in doc] for doc in docs]


def _write_megatron(prefix, docs, dtype):
    builder = mcore_indexed.IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for doc in docs:
        for seq in doc:
            builder.add_item(torch.tensor(np.asarray(seq, dtype=np.int64)))
        builder.end_document()
    builder.finalize(prefix + ".idx")


def _write_tokenloom(prefix, docs, dtype):
    with IndexedDatasetWriter(prefix, dtype=dtype) as w:
        for doc in docs:
            for seq in doc:
                w.add_sequence(np.asarray(seq, dtype=np.int64))
            w.end_document()
        w.finalize()


@settings(max_examples=40, deadline=None)
@given(docs=corpus, dtype=dtypes)
def test_both_writers_produce_identical_bytes(tmp_path_factory, docs, dtype):
    docs = _clip(docs, dtype)
    directory = tmp_path_factory.mktemp("cmp")
    ours, theirs = str(directory / "ours"), str(directory / "theirs")
    _write_megatron(theirs, docs, dtype)
    _write_tokenloom(ours, docs, dtype)
    for suffix in (".idx", ".bin"):
        assert open(ours + suffix, "rb").read() == open(theirs + suffix, "rb").read(), suffix


@settings(max_examples=40, deadline=None)
@given(docs=corpus, dtype=dtypes)
def test_megatron_store_reads_identically_here(tmp_path_factory, docs, dtype):
    docs = _clip(docs, dtype)
    prefix = str(tmp_path_factory.mktemp("m2t") / "s")
    _write_megatron(prefix, docs, dtype)
    ours = IndexedDataset(prefix)
    validate(ours)
    theirs = mcore_indexed.IndexedDataset(prefix)
    assert ours.dtype == theirs.index.dtype
    np.testing.assert_array_equal(ours.sequence_lengths, theirs.sequence_lengths)
    np.testing.assert_array_equal(ours.sequence_pointers, theirs.index.sequence_pointers)
    np.testing.assert_array_equal(ours.document_indices, theirs.document_indices)
    for i in range(len(theirs)):
        np.testing.assert_array_equal(ours.get(i), theirs[i])
        if theirs.sequence_lengths[i] > 1:
            np.testing.assert_array_equal(ours.get(i, 1, 1), theirs.get(i, offset=1, length=1))


@settings(max_examples=40, deadline=None)
@given(docs=corpus, dtype=dtypes)
def test_tokenloom_store_loads_in_megatron(tmp_path_factory, docs, dtype):
    docs = _clip(docs, dtype)
    prefix = str(tmp_path_factory.mktemp("t2m") / "s")
    _write_tokenloom(prefix, docs, dtype)
    theirs = mcore_indexed.IndexedDataset(prefix)
    flat = [seq for doc in docs for seq in doc]
    assert len(theirs) == len(flat)
    for i, seq in enumerate(flat):
        np.testing.assert_array_equal(theirs[i], np.asarray(seq, dtype=dtype))
    boundaries = np.cumsum([0] + [len(doc) for doc in docs])
    np.testing.assert_array_equal(theirs.document_indices, boundaries)


def test_megatron_merge_equals_tokenloom_merge(tmp_path):
    from tokenloom.io import merge_stores

    parts = [[[[1, 2], [3]], [[4]]], [[[5, 6, 7]]], [[[8], [9, 10]]]]
    prefixes = []
    for k, docs in enumerate(parts):
        prefixes.append(str(tmp_path / f"p{k}"))
        _write_tokenloom(prefixes[-1], docs, np.uint16)
    builder = mcore_indexed.IndexedDatasetBuilder(str(tmp_path / "theirs.bin"), dtype=np.uint16)
    for p in prefixes:
        builder.add_index(p)
    builder.finalize(str(tmp_path / "theirs.idx"))
    merge_stores(prefixes, str(tmp_path / "ours"))
    for suffix in (".idx", ".bin"):
        assert (tmp_path / f"ours{suffix}").read_bytes() == (tmp_path / f"theirs{suffix}").read_bytes()
