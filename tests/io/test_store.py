"""Round trips, atomicity and errors of the token store (no megatron-core needed)."""

import os
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenloom.errors import ConfigError, FormatError, InputError
from tokenloom.io import (
    IndexedDataset,
    IndexedDatasetWriter,
    dtype_for_vocab,
    inspect_store,
    merge_stores,
    validate,
)
from tokenloom.io.format import HEADER_SIZE


def write_store(prefix, docs, dtype=np.uint16, metadata=None):
    with IndexedDatasetWriter(prefix, dtype=dtype) as writer:
        for doc in docs:
            writer.add_document(np.asarray(doc))
        writer.finalize(metadata)
    return IndexedDataset(prefix)


documents = st.lists(st.lists(st.integers(0, 65535), max_size=40), max_size=30)


@settings(max_examples=60, deadline=None)
@given(docs=documents)
def test_round_trip_documents(tmp_path_factory, docs):
    prefix = str(tmp_path_factory.mktemp("rt") / "store")
    ds = write_store(prefix, docs)
    validate(ds)
    assert len(ds) == ds.num_documents == len(docs)
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(ds.get(i), np.asarray(doc, dtype=np.uint16))
    assert ds.num_tokens == sum(map(len, docs))
    flat = np.concatenate([np.asarray(d, np.uint16) for d in docs]) if docs else np.zeros(0, np.uint16)
    np.testing.assert_array_equal(ds.tokens, flat)
    np.testing.assert_array_equal(ds.document_indices, np.arange(len(docs) + 1))


@settings(max_examples=40, deadline=None)
@given(docs=documents.filter(lambda d: sum(map(len, d)) > 0), data=st.data())
def test_read_spans_and_window_match_slices(tmp_path_factory, docs, data):
    prefix = str(tmp_path_factory.mktemp("spans") / "store")
    ds = write_store(prefix, docs)
    nonempty = [i for i, d in enumerate(docs) if d]
    picks = data.draw(st.lists(st.sampled_from(nonempty), min_size=1, max_size=8))
    offsets, lengths, expected = [], [], []
    for i in picks:
        off = data.draw(st.integers(0, len(docs[i]) - 1))
        length = data.draw(st.integers(0, len(docs[i]) - off))
        offsets.append(off)
        lengths.append(length)
        expected.extend(docs[i][off : off + length])
    got = ds.read_spans(picks, offsets, lengths)
    np.testing.assert_array_equal(got, np.asarray(expected, dtype=np.uint16))
    flat = [t for d in docs for t in d]
    i = picks[0]
    start = sum(len(d) for d in docs[:i]) + offsets[0]
    length = data.draw(st.integers(0, len(flat) - start))
    np.testing.assert_array_equal(ds.window(i, offsets[0], length), np.asarray(flat[start : start + length], np.uint16))


def test_multi_sequence_documents_and_add_documents(tmp_path):
    prefix = str(tmp_path / "s")
    with IndexedDatasetWriter(prefix, dtype=np.int32) as w:
        w.add_sequence([1, 2])
        w.add_sequence([3])
        w.end_document()
        w.add_documents(np.array([4, 5, 6, 7, 8]), np.array([2, 0, 3]))
        w.finalize()
    ds = IndexedDataset(prefix + ".idx")
    validate(ds)
    np.testing.assert_array_equal(ds.sequence_lengths, [2, 1, 2, 0, 3])
    np.testing.assert_array_equal(ds.sequence_pointers, [0, 8, 12, 20, 20])
    np.testing.assert_array_equal(ds.document_indices, [0, 2, 3, 4, 5])
    assert ds.num_documents == 4
    report = inspect_store(prefix)
    assert report.document_lengths.max == 3 and report.empty_documents == 1


def test_dtype_for_vocab_follows_megatron():
    assert dtype_for_vocab(257) == np.uint16
    assert dtype_for_vocab(65499) == np.uint16
    assert dtype_for_vocab(65500) == np.int32
    with pytest.raises(ConfigError):
        dtype_for_vocab(0)


def test_token_that_does_not_fit_is_refused_and_nothing_written(tmp_path):
    prefix = str(tmp_path / "s")
    with pytest.raises(InputError, match="token id 70000 does not fit"), \
            IndexedDatasetWriter(prefix, dtype=np.uint16) as w:
        w.add_document(np.array([1, 70000]))
    assert os.listdir(tmp_path) == []


def test_exception_inside_writer_leaves_nothing(tmp_path):
    prefix = str(tmp_path / "s")
    with pytest.raises(RuntimeError), IndexedDatasetWriter(prefix) as w:
        w.add_document([1, 2, 3])
        raise RuntimeError("simulated crash")
    assert os.listdir(tmp_path) == []


def test_leaving_without_finalize_is_an_error_and_writes_nothing(tmp_path):
    with pytest.raises(ConfigError, match="without finalize"), IndexedDatasetWriter(str(tmp_path / "s")) as w:
        w.add_document([1])
    assert os.listdir(tmp_path) == []


def test_overwrite_replaces_old_store_atomically(tmp_path):
    prefix = str(tmp_path / "s")
    write_store(prefix, [[1, 2, 3]], metadata={"tokenizer": {"kind": "bytes"}})
    w = IndexedDatasetWriter(prefix)
    w.add_document([9, 9])
    # Until finalize the old store is intact and still reads.
    np.testing.assert_array_equal(IndexedDataset(prefix).get(0), [1, 2, 3])
    w.finalize()
    ds = IndexedDataset(prefix)
    np.testing.assert_array_equal(ds.get(0), [9, 9])
    assert ds.metadata is None  # the old sidecar does not survive a store written without one
    assert sorted(os.listdir(tmp_path)) == ["s.bin", "s.idx"]


def test_merge_concatenates_and_checks_tokenizers(tmp_path):
    a = write_store(str(tmp_path / "a"), [[1, 2], [3]], metadata={"tokenizer": {"kind": "bytes"}})
    b = write_store(str(tmp_path / "b"), [[4, 5, 6]], metadata={"tokenizer": {"kind": "bytes"}})
    m = merge_stores([a.prefix, b.prefix], str(tmp_path / "m"))
    validate(m)
    assert [m.get(i).tolist() for i in range(3)] == [[1, 2], [3], [4, 5, 6]]
    assert m.metadata["tokenizer"] == {"kind": "bytes"}
    write_store(str(tmp_path / "c"), [[7]], metadata={"tokenizer": {"kind": "huggingface"}})
    with pytest.raises(ConfigError, match="tokenized differently"):
        merge_stores([a.prefix, str(tmp_path / "c")], str(tmp_path / "bad"))
    write_store(str(tmp_path / "d"), [[7]], dtype=np.int32)
    with pytest.raises(ConfigError, match="dtype"):
        merge_stores([a.prefix, str(tmp_path / "d")], str(tmp_path / "bad2"))
    assert not os.path.exists(tmp_path / "bad.idx") and not os.path.exists(tmp_path / "bad2.idx")


def test_errors_name_file_offset_and_expectation(tmp_path):
    prefix = str(tmp_path / "s")
    write_store(prefix, [[1, 2, 3], [4, 5], [6]])
    idx = prefix + ".idx"
    raw = bytearray(open(idx, "rb").read())

    def corrupt(data):
        with open(idx, "wb") as f:
            f.write(bytes(data))

    bad = bytearray(raw)
    bad[0:9] = b"NOTANIDX!"
    corrupt(bad)
    with pytest.raises(FormatError, match=r"s\.idx: bad magic .* at byte 0"):
        IndexedDataset(prefix)

    bad = bytearray(raw)
    bad[17] = 42
    corrupt(bad)
    with pytest.raises(FormatError, match="dtype code 42 at byte 17"):
        IndexedDataset(prefix)

    corrupt(raw[:-3])
    with pytest.raises(FormatError, match="truncated"):
        IndexedDataset(prefix)

    bad = bytearray(raw)
    struct.pack_into("<q", bad, HEADER_SIZE + 12 + 8, 999)  # second of three pointers
    corrupt(bad)
    with pytest.raises(FormatError, match=r"sequence 1 has pointer 999 at byte 54, expected 6"):
        validate(IndexedDataset(prefix))

    corrupt(raw)
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(4)
    with pytest.raises(FormatError, match=r"s\.bin: file is 4 bytes .* ends at byte 12"):
        IndexedDataset(prefix)

    os.remove(prefix + ".bin")
    with pytest.raises(FormatError, match=r"s: s\.bin is missing from "):
        IndexedDataset(prefix)


def test_validate_rejects_bad_document_indices(tmp_path):
    prefix = str(tmp_path / "s")
    write_store(prefix, [[1], [2], [3]])
    idx = prefix + ".idx"
    raw = bytearray(open(idx, "rb").read())
    doc_offset = HEADER_SIZE + 12 * 3
    struct.pack_into("<q", raw, doc_offset + 8 * 3, 2)  # last index 2, expected 3
    open(idx, "wb").write(bytes(raw))
    with pytest.raises(FormatError, match=r"last document index is 2 .* expected the sequence count 3"):
        validate(IndexedDataset(prefix))
    report = inspect_store(prefix)
    assert not report.consistent and "last document index" in report.problem


def test_beyond_2_31_tokens_offsets_are_exact(tmp_path):
    """A sparse .bin of 2^31 + a few uint16 tokens: pointers and reads past 4 GiB are exact."""
    prefix = str(tmp_path / "big")
    n_big = 2**31 + 10
    lengths = np.array([2**31 - 1, 11, 0], dtype=np.int32)
    assert int(lengths.sum()) == n_big
    from tokenloom.io.writer import write_index_file

    write_index_file(prefix + ".idx", np.dtype(np.uint16), lengths, np.arange(4))
    with open(prefix + ".bin", "wb") as f:
        f.truncate(2 * n_big)  # sparse: no disk used for the zeros
        f.seek(2 * (2**31 - 1))
        f.write(np.arange(11, dtype=np.uint16).tobytes())
    ds = IndexedDataset(prefix)
    validate(ds)
    assert ds.num_tokens == n_big
    assert int(ds.sequence_pointers[1]) == 2 * (2**31 - 1)
    np.testing.assert_array_equal(ds.get(1), np.arange(11))
    np.testing.assert_array_equal(ds.get(1, offset=4, length=3), [4, 5, 6])
    np.testing.assert_array_equal(ds.window(0, 2**31 - 3, 4), [0, 0, 0, 1])
    np.testing.assert_array_equal(ds.read_spans([1, 0], [9, 2**31 - 2], [2, 1]), [9, 10, 0])


def test_parts_written_by_others_at_their_offsets_make_the_merged_store(tmp_path):
    # what a divided tokenize does: the writer sizes its hidden .bin, other processes write each
    # part's bytes at its offset, the writer records the parts' documents and finalizes
    rng = np.random.default_rng(4)
    parts = []
    for k in range(3):
        lengths = rng.integers(1, 50, size=20 + 10 * k)
        with IndexedDatasetWriter(str(tmp_path / f"part{k}"), dtype=np.uint16) as writer:
            writer.add_documents(rng.integers(0, 60000, size=int(lengths.sum())).astype(np.uint16), lengths)
            writer.finalize({"tokenizer": None})
        parts.append(IndexedDataset(str(tmp_path / f"part{k}")))
    merge_stores([p.prefix for p in parts], str(tmp_path / "merged"))
    writer = IndexedDatasetWriter(str(tmp_path / "joined"), dtype=np.uint16)
    sizes = [os.path.getsize(p.bin_path) for p in parts]
    writer.reserve(sum(sizes))
    for k, part in reversed(list(enumerate(parts))):  # any order: each at its own offset
        with open(part.bin_path, "rb") as src, open(writer.temp_bin_path, "r+b") as dst:
            dst.seek(sum(sizes[:k]))
            dst.write(src.read())
    for part in parts:
        writer.append_store(part, copy_bytes=False)
    writer.finalize()
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"joined{suffix}").read_bytes() == (tmp_path / f"merged{suffix}").read_bytes()
