"""Fuzz the .idx/.bin parser: corrupted, truncated and lying files raise FormatError, nothing else."""

import struct

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenloom.errors import FormatError
from tokenloom.io import IndexedDataset, IndexedDatasetWriter, inspect_store, validate

BASE_DOCS = [[1, 2, 3], [4], [5, 6, 7, 8], [], [9, 10]]


def _fresh_store(directory):
    prefix = str(directory / "s")
    with IndexedDatasetWriter(prefix, dtype=np.uint16) as w:
        for d in BASE_DOCS:
            w.add_document(d)
        w.finalize()
    return prefix


def _open_everything(prefix):
    """Everything a user can do with a store; only FormatError may escape."""
    try:
        ds = IndexedDataset(prefix)
        validate(ds)
    except FormatError:
        return "rejected"
    for i in range(len(ds)):
        ds.get(i)
    inspect_store(prefix, scan_tokens=True)
    return "accepted"


corruption = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 200), st.integers(1, 255)),
    st.tuples(st.just("truncate_idx"), st.integers(0, 200), st.just(0)),
    st.tuples(st.just("truncate_bin"), st.integers(0, 30), st.just(0)),
    st.tuples(st.just("extend_idx"), st.integers(1, 64), st.integers(0, 255)),
    st.tuples(
        st.just("header_field"),
        st.sampled_from([9, 17, 18, 26]),
        st.integers(0, 2**64 - 1),
    ),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(corruption, min_size=1, max_size=3))
def test_corrupted_stores_raise_format_error_only(tmp_path, ops):
    prefix = _fresh_store(tmp_path)
    idx = bytearray(open(prefix + ".idx", "rb").read())
    binary = bytearray(open(prefix + ".bin", "rb").read())
    for kind, where, value in ops:
        if kind == "flip" and idx:
            idx[where % len(idx)] ^= value
        elif kind == "truncate_idx":
            del idx[where % (len(idx) + 1) :]
        elif kind == "truncate_bin":
            del binary[where % (len(binary) + 1) :]
        elif kind == "extend_idx":
            idx.extend(bytes([value]) * where)
        elif kind == "header_field" and len(idx) >= 34:
            if where == 17:
                idx[17] = value % 256
            else:
                struct.pack_into("<Q", idx, where, value)
    open(prefix + ".idx", "wb").write(bytes(idx))
    open(prefix + ".bin", "wb").write(bytes(binary))
    _open_everything(prefix)


@settings(max_examples=200, deadline=None)
@given(blob=st.binary(max_size=300), bin_blob=st.binary(max_size=64))
def test_arbitrary_bytes_never_crash(tmp_path_factory, blob, bin_blob):
    directory = tmp_path_factory.mktemp("blob")
    prefix = str(directory / "s")
    open(prefix + ".idx", "wb").write(blob)
    open(prefix + ".bin", "wb").write(bin_blob)
    _open_everything(prefix)


@settings(max_examples=200, deadline=None)
@given(
    num_sequences=st.integers(0, 2**64 - 1),
    num_document_indices=st.integers(0, 2**64 - 1),
    code=st.integers(0, 255),
)
def test_lying_headers_fail_fast(tmp_path_factory, num_sequences, num_document_indices, code):
    """A header claiming 2^63 sequences must fail at open, in O(1), not allocate or hang."""
    directory = tmp_path_factory.mktemp("lie")
    prefix = str(directory / "s")
    header = struct.pack("<9sQBQQ", b"MMIDIDX\x00\x00", 1, code, num_sequences, num_document_indices)
    open(prefix + ".idx", "wb").write(header + bytes(64))
    open(prefix + ".bin", "wb").write(bytes(16))
    _open_everything(prefix)
