"""The best-fit index: every token of every document once per epoch, in one sample, in order;
chunks that change nothing; served ids that invert; windows refused when too small."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenloom.errors import ConfigError
from tokenloom.index import best_fit_index as bfi
from tokenloom.index.best_fit import pack_best_fit


def _index(lengths, begin, end, *, capacity, window, seed, num_samples, chunk_target=None, monkeypatch=None):
    if chunk_target is not None:
        monkeypatch.setattr(bfi, "CHUNK_TARGET_DOCUMENTS", chunk_target)
    chunks = [bfi.pack_chunk_arrays(bfi.pack_chunk(lengths, begin, end, first, stop, capacity=capacity,
                                                   window=window, seed=seed), lengths.shape[0])
              for first, stop in bfi.chunk_bounds(end - begin, window)]
    per_epoch = sum(int(c["offsets"].shape[0]) - 1 for c in chunks)
    plan = bfi.BestFitPlan.for_request(seq_length=capacity - 1, add_extra_token=True, num_samples=num_samples,
                                       samples_per_epoch=per_epoch)
    return bfi.BestFitIndex(plan=plan, seed=seed, chunks=chunks, begin=begin, end=end, window=window)


def _coverage(index, lengths, served: np.ndarray, capacity: int) -> dict[int, list[tuple[int, int, int]]]:
    """Document -> its (first token, tokens, sample) pieces over ``served``, checking each sample fits."""
    spans = index.spans(served)
    out: dict[int, list] = {}
    for k in range(served.shape[0]):
        pieces = range(int(spans.bounds[k]), int(spans.bounds[k + 1]))
        assert sum(int(spans.lengths[p]) for p in pieces) <= capacity
        for p in pieces:
            assert spans.lengths[p] >= 1
            out.setdefault(int(spans.document_ids[p]), []).append(
                (int(spans.offsets[p]), int(spans.lengths[p]), int(served[k])))
    return out


lengths_strategy = st.one_of(
    st.lists(st.integers(0, 40), min_size=1, max_size=300),  # short documents, some empty
    st.lists(st.integers(0, 400), min_size=1, max_size=120),  # many longer than a sample
    st.lists(st.sampled_from([0, 1, 16, 17, 33, 34, 200]), min_size=1, max_size=200),  # multiples of capacity
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=lengths_strategy, capacity=st.integers(2, 40), window=st.integers(1, 70), seed=st.integers(0, 2**32 - 1),
       cut=st.data(), chunk_windows=st.integers(1, 4), extra_epochs=st.integers(0, 2))
def test_every_token_once_per_epoch_in_one_sample_in_order(lengths, capacity, window, seed, cut, chunk_windows,
                                                           extra_epochs, monkeypatch):
    lengths = np.array(lengths, dtype=np.int64)
    begin = cut.draw(st.integers(0, lengths.shape[0] - 1))
    end = cut.draw(st.integers(begin + 1, lengths.shape[0]))
    if lengths[begin:end].sum() == 0:
        lengths[begin] = 1
    probe = _index(lengths, begin, end, capacity=capacity, window=window, seed=seed, num_samples=None,
                   chunk_target=window * chunk_windows, monkeypatch=monkeypatch)
    per_epoch = probe.plan.samples_per_epoch
    num_samples = per_epoch * (1 + extra_epochs) + cut.draw(st.integers(0, per_epoch - 1))
    index = _index(lengths, begin, end, capacity=capacity, window=window, seed=seed, num_samples=num_samples)
    assert index.num_samples == num_samples
    for epoch in range(num_samples // per_epoch):
        served = np.arange(epoch * per_epoch, (epoch + 1) * per_epoch)
        coverage = _coverage(index, lengths, served, capacity)
        for d in range(begin, end):
            pieces = sorted(coverage.pop(d, []))
            position = 0
            for first, size, _ in pieces:  # the pieces tile the document exactly once
                assert first == position
                position += size
            assert position == lengths[d]
            # whole unless longer than a sample: then every piece but the last fills a sample
            if lengths[d] <= capacity:
                assert len(pieces) == (1 if lengths[d] else 0)
            else:
                assert all(size == capacity for _, size, _ in pieces[:-1])
                assert len({sample for _, _, sample in pieces}) == len(pieces)
        assert not coverage  # nothing outside the split
    # the partial last epoch serves distinct packed samples
    tail = np.arange((num_samples // per_epoch) * per_epoch, num_samples)
    packed = index.packed_samples(tail)
    assert np.unique(packed).shape[0] == tail.shape[0]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=lengths_strategy, capacity=st.integers(2, 40), window=st.integers(1, 50),
       seed=st.integers(0, 1000), chunk_windows=st.integers(1, 3))
def test_chunks_laid_end_to_end_are_the_packing_of_the_whole_order(lengths, capacity, window, seed, chunk_windows,
                                                                   monkeypatch):
    lengths = np.array(lengths, dtype=np.int64)
    monkeypatch.setattr(bfi, "CHUNK_TARGET_DOCUMENTS", window * chunk_windows)
    n = lengths.shape[0]
    chunks = [bfi.pack_chunk(lengths, 0, n, first, stop, capacity=capacity, window=window, seed=seed)
              for first, stop in bfi.chunk_bounds(n, window)]
    order = bfi._document_order(n, seed)(np.arange(n))
    whole = pack_best_fit(lengths[order], capacity, window=window)
    assert np.array_equal(np.concatenate([c.documents for c in chunks]), order[whole.documents])
    assert np.array_equal(np.concatenate([c.begins for c in chunks]), whole.begins)
    assert np.array_equal(np.concatenate([c.lengths for c in chunks]), whole.lengths)
    assert sum(c.num_samples for c in chunks) == whole.num_samples


@settings(max_examples=30, deadline=None)
@given(lengths=lengths_strategy, capacity=st.integers(2, 30), seed=st.integers(0, 1000), epochs=st.integers(1, 3),
       data=st.data())
def test_samples_holding_is_the_inverse_of_spans(lengths, capacity, seed, epochs, data):
    lengths = np.array(lengths, dtype=np.int64)
    lengths[0] = max(1, lengths[0])
    n = lengths.shape[0]
    probe = _index(lengths, 0, n, capacity=capacity, window=16, seed=seed, num_samples=None)
    num_samples = data.draw(st.integers(1, probe.plan.samples_per_epoch * epochs))
    index = _index(lengths, 0, n, capacity=capacity, window=16, seed=seed, num_samples=num_samples)
    spans = index.spans(np.arange(num_samples))
    for d in {0, n - 1, data.draw(st.integers(0, n - 1))}:
        samples = np.repeat(np.arange(num_samples), np.diff(spans.bounds))
        expected = np.unique(samples[spans.document_ids == d])
        assert np.array_equal(index.samples_holding(d), expected)
    assert index.samples_holding(n).shape == (0,)


def test_pieces_are_stored_in_the_narrowest_types():
    lengths = np.array([5, 70, 3, 0, 9], dtype=np.int64)
    arrays = bfi.pack_chunk_arrays(bfi.pack_chunk(lengths, 0, 5, 0, 5, capacity=33, window=40, seed=1), 5)
    assert {name: a.dtype.name for name, a in arrays.items()} == {
        "documents": "int32", "begins": "int32", "lengths": "int32", "offsets": "int64"}


def test_a_sample_id_outside_the_split_is_refused():
    index = _index(np.array([3, 4, 5]), 0, 3, capacity=9, window=8, seed=0, num_samples=None)
    with pytest.raises(ConfigError, match=r"sample 7; expected 0 \.\. 1"):
        index.spans(np.array([0, 7]))


def test_a_window_smaller_than_a_sample_is_refused_with_the_smallest_value():
    with pytest.raises(ConfigError, match="expected at least 2049"):
        bfi.resolve_window(2048, 2049)
    assert bfi.resolve_window(None, 2049) == bfi.DEFAULT_WINDOW
    assert bfi.resolve_window(None, 131073) == 131073  # long samples: a window holds at least one
    assert bfi.resolve_window(5000, 2049) == 5000
    with pytest.raises(ConfigError, match="whole number of documents"):
        bfi.resolve_window(True, 10)


def test_chunks_are_whole_windows():
    assert bfi.chunk_documents(100_000) % 100_000 == 0
    assert bfi.chunk_documents(10**8) == 10**8  # a window larger than the target is one chunk
    assert bfi.chunk_bounds(0, 100) == [(0, 0)]
    size = bfi.chunk_documents(1000)
    assert bfi.chunk_bounds(size + 5, 1000) == [(0, size), (size, size + 5)]


def test_the_worked_example_of_format_md():
    lengths = np.array([3, 7, 2, 4, 6, 9, 1, 0])
    assert bfi._document_order(8, 2)(np.arange(8)).tolist() == [0, 5, 3, 6, 1, 2, 7, 4]
    packing = bfi.pack_chunk(lengths, 0, 8, 0, 8, capacity=5, window=8, seed=2)
    assert packing.documents.tolist() == [5, 1, 4, 5, 4, 3, 6, 0, 1, 2]
    assert packing.begins.tolist() == [0, 0, 0, 5, 5, 0, 0, 0, 5, 0]
    assert packing.lengths.tolist() == [5, 5, 5, 4, 1, 4, 1, 3, 2, 2]
    assert packing.offsets.tolist() == [0, 1, 2, 3, 5, 7, 9, 10]
    assert packing.cut_documents == 3 and packing.padding_fraction == pytest.approx(3 / 35)
    index = _index(lengths, 0, 8, capacity=5, window=8, seed=2, num_samples=10)
    assert index.packed_samples(np.arange(10)).tolist() == [4, 2, 0, 1, 6, 3, 5, 4, 2, 3]
    assert index.samples_holding(1).tolist() == [3, 6]
