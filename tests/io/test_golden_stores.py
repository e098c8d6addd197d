"""Stores written by megatron-core (committed under tests/golden/stores) read and re-write exactly."""

import json
import os

import numpy as np
import pytest

from tokenloom.io import IndexedDataset, IndexedDatasetWriter, validate

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "golden", "stores")
EXPECTED = json.load(open(os.path.join(GOLDEN, "expected.json")))


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_golden_store_reads_and_rewrites_byte_identically(tmp_path, name):
    spec = EXPECTED[name]
    ds = IndexedDataset(os.path.join(GOLDEN, name))
    validate(ds)
    assert ds.dtype == np.dtype(spec["dtype"])
    flat = [seq for doc in spec["documents"] for seq in doc]
    assert len(ds) == len(flat)
    for i, seq in enumerate(flat):
        np.testing.assert_array_equal(ds.get(i), np.asarray(seq, dtype=ds.dtype))
    np.testing.assert_array_equal(ds.document_indices, np.cumsum([0] + [len(d) for d in spec["documents"]]))

    prefix = str(tmp_path / name)
    with IndexedDatasetWriter(prefix, dtype=ds.dtype) as w:
        for doc in spec["documents"]:
            for seq in doc:
                w.add_sequence(np.asarray(seq, dtype=np.int64))
            w.end_document()
        w.finalize()
    for suffix in (".idx", ".bin"):
        with open(prefix + suffix, "rb") as ours, open(os.path.join(GOLDEN, name + suffix), "rb") as theirs:
            assert ours.read() == theirs.read(), suffix
