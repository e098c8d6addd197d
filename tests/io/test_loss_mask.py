"""The loss-mask sidecar: written with the tokens, read as they are, checked against the store."""

import json
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenloom.errors import FormatError, InputError
from tokenloom.io import IndexedDataset, IndexedDatasetWriter, merge_stores, validate
from tokenloom.io.loss_mask import MASK_HEADER_SIZE, mask_file_bytes, mask_path

# A document: its sequences, each (tokens, mask or None); a store: its documents.
sequence = st.integers(0, 40).flatmap(lambda n: st.tuples(
    st.lists(st.integers(0, 60000), min_size=n, max_size=n),
    st.none() | st.lists(st.integers(0, 1), min_size=n, max_size=n)))
document = st.lists(sequence, min_size=1, max_size=3)
corpus = st.lists(document, max_size=10)


def _write(prefix, docs, *, batched=False):
    with IndexedDatasetWriter(prefix) as w:
        if batched and all(len(doc) == 1 for doc in docs) and docs:
            tokens = np.concatenate([np.asarray(doc[0][0], dtype=np.int64) for doc in docs])
            masks = [doc[0][1] for doc in docs]
            mask = None if all(m is None for m in masks) else np.concatenate(
                [np.ones(len(doc[0][0]), np.uint8) if m is None else np.asarray(m, np.uint8)
                 for doc, m in zip(docs, masks)])
            w.add_documents(tokens, [len(doc[0][0]) for doc in docs], loss_mask=mask)
        else:
            for doc in docs:
                for tokens, mask in doc:
                    w.add_sequence(tokens, loss_mask=None if mask is None else np.asarray(mask, dtype=bool))
                w.end_document()
        w.finalize({"tokenizer": {"eod_id": 0}})
    return IndexedDataset(prefix)


def _reference(docs):
    """Each sequence's mask as the documents give it (ones where none)."""
    return [np.ones(len(tokens), np.uint8) if mask is None else np.asarray(mask, np.uint8)
            for doc in docs for tokens, mask in doc]


@settings(max_examples=60, deadline=None)
@given(docs=corpus, batched=st.booleans(), data=st.data())
def test_masks_read_back_per_sequence_and_span(tmp_path_factory, docs, batched, data):
    ds = _write(str(tmp_path_factory.mktemp("m") / "s"), docs, batched=batched)
    expected = _reference(docs)
    any_mask = any(mask is not None for doc in docs for _, mask in doc)
    assert ds.has_loss_mask == any_mask
    assert os.path.exists(mask_path(ds.prefix)) == any_mask
    validate(ds)
    for i, mask in enumerate(expected):
        got = ds.get_loss_mask(i)
        assert got.dtype == np.uint8 and got.tolist() == mask.tolist()
        if len(mask) > 2:
            assert ds.get_loss_mask(i, 1, len(mask) - 2).tolist() == mask[1:-1].tolist()
    if expected:
        ids = data.draw(st.lists(st.integers(0, len(expected) - 1), max_size=6))
        cuts = [data.draw(st.tuples(st.integers(0, len(expected[i])), st.integers(0, len(expected[i]))))
                for i in ids]
        offsets = [min(c) for c in cuts]
        lengths = [max(c) - min(c) for c in cuts]
        spans = ds.read_loss_mask_spans(ids, offsets, lengths)
        want = [expected[i][o:o + n] for i, o, n in zip(ids, offsets, lengths)]
        assert spans.tolist() == (np.concatenate(want).tolist() if want else [])
        assert len(ds.read_spans(ids, offsets, lengths)) == len(spans)
    if any_mask:
        assert os.path.getsize(mask_path(ds.prefix)) == mask_file_bytes(ds.num_tokens)
        assert ds.metadata["loss_mask"]["tokens_outside_loss"] == sum(int((m == 0).sum()) for m in expected)
        assert ds.metadata["tokenizer"] == {"eod_id": 0}


def test_bad_masks_name_the_store_and_the_values(tmp_path):
    prefix = str(tmp_path / "bad")
    with IndexedDatasetWriter(prefix) as w:
        with pytest.raises(InputError, match=r"bad: loss_mask holds \[2, 3\].*expected only 0"):
            w.add_document([1, 2, 3, 4], loss_mask=[1, 2, 3, 0])
        with pytest.raises(InputError, match=r"bad: loss_mask of shape \(3,\) for sequence 0 of 4 tokens"):
            w.add_document([1, 2, 3, 4], loss_mask=[1, 1, 0])
        with pytest.raises(InputError, match="dtype float64"):
            w.add_documents([1, 2, 3], [3], loss_mask=np.ones(3))
        w.abort()
    assert os.listdir(tmp_path) == []


def test_abort_and_errors_leave_nothing(tmp_path):
    prefix = str(tmp_path / "gone")
    with pytest.raises(RuntimeError), IndexedDatasetWriter(prefix) as w:
        w.add_document([1, 2, 3], loss_mask=[0, 1, 1])
        assert any(name.endswith(".tmp") and ".mask." in name for name in os.listdir(tmp_path))
        raise RuntimeError("stop")
    assert os.listdir(tmp_path) == []


def test_rewriting_without_masks_drops_the_old_sidecar(tmp_path):
    prefix = str(tmp_path / "s")
    _write(prefix, [[([1, 2, 3], [0, 1, 1])]])
    ds = _write(prefix, [[([1, 2, 3], None)]])
    assert not ds.has_loss_mask and not os.path.exists(mask_path(prefix))
    assert ds.get_loss_mask(0).tolist() == [1, 1, 1]
    # a record copied from another store's metadata does not make this one masked
    with IndexedDatasetWriter(prefix) as w:
        w.add_document([5, 6])
        w.finalize({"loss_mask": {"file": "x.mask", "num_tokens": 2, "bytes": 25, "sha256": "0"}})
    assert not IndexedDataset(prefix).has_loss_mask


def test_a_sidecar_that_does_not_match_its_store_is_a_format_error(tmp_path):
    prefix = str(tmp_path / "s")
    tokens = np.arange(100) % 50
    _write(prefix, [[(tokens.tolist(), (tokens % 3 == 0).astype(int).tolist())]])
    path = mask_path(prefix)
    data = open(path, "rb").read()
    assert len(data) == MASK_HEADER_SIZE + 13
    with open(path, "wb") as f:  # one bit flipped: the size holds, the checksum does not
        f.write(data[:-1] + bytes([data[-1] ^ 1]))
    ds = IndexedDataset(prefix)
    assert ds.has_loss_mask
    with pytest.raises(FormatError, match=r"s\.mask: its bits have SHA-256 .* records"):
        validate(ds)
    with open(path, "wb") as f:
        f.write(data[:-1])
    with pytest.raises(FormatError, match=r"s\.mask: file is 36 bytes but a mask of the store's 100 tokens is 37"):
        assert IndexedDataset(prefix).has_loss_mask
    with open(path, "wb") as f:
        f.write(b"XXXXXXXX" + data[8:])
    with pytest.raises(FormatError, match="bad magic"):
        IndexedDataset(prefix).get_loss_mask(0)
    os.remove(path)
    with pytest.raises(FormatError, match=r"s\.mask: missing, but .*s\.meta\.json records"):
        assert IndexedDataset(prefix).has_loss_mask
    with open(path, "wb") as f:
        f.write(data)
    meta = json.load(open(prefix + ".meta.json"))
    meta["loss_mask"]["num_tokens"] = 99
    json.dump(meta, open(prefix + ".meta.json", "w"))
    with pytest.raises(FormatError, match=r"covers 99 tokens but the \.bin holds 100"):
        assert IndexedDataset(prefix).has_loss_mask


def test_append_store_and_merge_carry_masks_and_ones(tmp_path):
    plain = _write(str(tmp_path / "plain"), [[([1, 2, 3], None)], [([4, 5, 6, 7, 8], None)]])
    masked = _write(str(tmp_path / "masked"), [[([9, 8, 7], [0, 0, 1])], [([6, 5], None)],
                                               [(list(range(17)), [k % 2 for k in range(17)])]])
    merged = merge_stores([plain.prefix, masked.prefix, plain.prefix], str(tmp_path / "merged"))
    validate(merged)
    assert merged.has_loss_mask
    want = [[1] * 3, [1] * 5, [0, 0, 1], [1, 1], [k % 2 for k in range(17)], [1] * 3, [1] * 5]
    assert [merged.get_loss_mask(i).tolist() for i in range(len(merged))] == want
    assert merged.metadata["loss_mask"]["num_tokens"] == merged.num_tokens
    unmasked = merge_stores([plain.prefix, plain.prefix], str(tmp_path / "plain2"))
    assert not unmasked.has_loss_mask and "loss_mask" not in (unmasked.metadata or {})


def test_megatron_core_loads_the_tokens_of_a_masked_store(tmp_path):
    mcore_indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    docs = [[([5, 6, 7, 8], [0, 1, 1, 1])], [([1, 2], None), ([3], [1])], [(list(range(40)), None)]]
    ds = _write(str(tmp_path / "s"), docs)
    assert ds.has_loss_mask
    theirs = mcore_indexed.IndexedDataset(ds.prefix, mmap=True)
    assert len(theirs) == len(ds) == 4
    for i in range(len(ds)):
        assert theirs[i].tolist() == ds.get(i).tolist()
    assert theirs.document_indices.tolist() == ds.document_indices.tolist()


def test_format_md_worked_example(tmp_path):
    """FORMAT.md, "The loss-mask sidecar": the bytes of its worked example."""
    with IndexedDatasetWriter(str(tmp_path / "chat")) as w:
        w.add_document([10, 11, 12, 13, 256], loss_mask=[0, 0, 1, 1, 1])
        w.add_document([33, 256])
        w.finalize()
    data = open(tmp_path / "chat.mask", "rb").read()
    assert data == b"TLMASK\x00\x01" + (1).to_bytes(8, "little") + (7).to_bytes(8, "little") + bytes([0x7C])
    record = json.load(open(tmp_path / "chat.meta.json"))["loss_mask"]
    assert record["sha256"].startswith("cbe5cfdf") and record["tokens_outside_loss"] == 2
    assert record == {**record, "bytes": 25, "file": "chat.mask", "format": "bits", "num_tokens": 7, "version": 1}
