"""Best-fit decreasing packing: the kernel against a slow transcription of its rule, and the
properties that make it a packing (every token once, in order, no sample over capacity)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenloom.errors import ConfigError
from tokenloom.index.best_fit import pack_best_fit


def _reference(lengths, capacity: int, window: int) -> list[list[tuple[int, int, int]]]:
    """The module's rule in plain Python: samples as lists of (document, first token, length)."""
    samples = []
    for start in range(0, len(lengths), window):
        docs = range(start, min(len(lengths), start + window))
        for d in docs:
            samples.extend([[(d, k * capacity, capacity)] for k in range(lengths[d] // capacity)])
        remainders = sorted(((lengths[d] % capacity, d) for d in docs if lengths[d] % capacity),
                            key=lambda pair: (-pair[0], pair[1]))
        rooms, contents = [], []
        stacks: dict[int, list[int]] = {}  # room -> samples that reached it, the latest last
        for need, d in remainders:
            fits = [room for room, stack in stacks.items() if room >= need and stack]
            if fits:
                s = stacks[min(fits)].pop()
            else:
                s = len(rooms)
                rooms.append(capacity)
                contents.append([])
            contents[s].append((d, lengths[d] - need, need))
            rooms[s] -= need
            if rooms[s]:
                stacks.setdefault(rooms[s], []).append(s)
        samples.extend(contents)
    return samples


def _samples(packing) -> list[list[tuple[int, int, int]]]:
    return [[(int(packing.documents[p]), int(packing.begins[p]), int(packing.lengths[p]))
             for p in range(packing.offsets[s], packing.offsets[s + 1])] for s in range(packing.num_samples)]


_lengths = st.one_of(
    st.lists(st.integers(0, 80), max_size=120),  # around the capacity: cuts, remainders, empties
    st.lists(st.integers(0, 9), max_size=200),  # many small documents per sample
    st.lists(st.sampled_from([0, 1, 31, 32, 33, 64, 65, 200]), max_size=60),  # multiples and edges
)


@settings(max_examples=300, deadline=None)
@given(lengths=_lengths, capacity=st.integers(2, 40), window=st.integers(1, 70))
def test_the_kernel_packs_as_the_rule_says_and_loses_nothing(lengths, capacity, window):
    packing = pack_best_fit(np.array(lengths, dtype=np.int64), capacity, window=window)
    assert _samples(packing) == _reference(lengths, capacity, window)
    # a packing: no sample over capacity, no empty sample, every token of every document exactly
    # once, and a document's pieces in token order
    sizes = packing.sample_lengths()
    assert (sizes >= 1).all() and (sizes <= capacity).all()
    seen = {d: [] for d in range(len(lengths))}
    for d, begin, length in (piece for sample in _samples(packing) for piece in sample):
        seen[d].append((begin, length))
    for d, pieces in seen.items():
        assert [b for b, _ in pieces] == sorted(b for b, _ in pieces)
        covered = [t for b, n in pieces for t in range(b, b + n)]
        assert covered == list(range(lengths[d])), d
    assert packing.num_tokens == sum(lengths)


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(0, 50), max_size=60), capacity=st.integers(2, 30), window=st.integers(1, 30))
def test_the_interpreted_kernel_matches_the_compiled_one(lengths, capacity, window):
    lengths = np.array(lengths, dtype=np.int64)
    compiled = pack_best_fit(lengths, capacity, window=window, backend="numba")
    interpreted = pack_best_fit(lengths, capacity, window=window, backend="python")
    assert _samples(compiled) == _samples(interpreted)


def test_rooms_far_apart_use_the_summary_bitmap():
    """A capacity of 70,000 tokens spans 1,094 bitmap words: best fit must find a room many words
    above the one asked for, and none when no open sample has enough."""
    capacity = 70_000
    lengths = np.array([69_990, 4_999, 20, 9, 69_995], dtype=np.int64)  # 20 goes 1,000 words up, to 65,001
    packing = pack_best_fit(lengths, capacity, window=len(lengths))
    assert _samples(packing) == _reference(lengths.tolist(), capacity, len(lengths))
    assert [[(d, n) for d, _, n in sample] for sample in _samples(packing)] == [
        [(4, 69_995)], [(0, 69_990), (3, 9)], [(1, 4_999), (2, 20)]]


def test_documents_longer_than_a_sample_are_cut_and_the_rest_still_packs():
    packing = pack_best_fit(np.array([10, 3, 25, 4], dtype=np.int64), 8, window=4)
    # cut pieces first (10 -> 8 + 2, 25 -> 8 + 8 + 8 + 1), then the remainders 4, 3, 2, 1 best fit
    assert _samples(packing) == [[(0, 0, 8)], [(2, 0, 8)], [(2, 8, 8)], [(2, 16, 8)],
                                 [(3, 0, 4), (1, 0, 3), (2, 24, 1)], [(0, 8, 2)]]
    assert packing.cut_documents == 2
    assert packing.padding_fraction == pytest.approx(1 - 42 / 48)


def test_every_document_longer_than_a_sample_still_packs():
    lengths = np.full(50, 1000, dtype=np.int64)  # nothing to pair: 7 full pieces and a 104-token rest each
    packing = pack_best_fit(lengths, 128, window=16)
    assert packing.num_tokens == lengths.sum() and packing.cut_documents == 50
    assert (packing.sample_lengths() <= 128).all()


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"capacity": 1, "window": 4}, "capacity 1, expected an int >= 2"),
    ({"capacity": 8, "window": 0}, "window 0, expected a positive number of documents"),
    ({"capacity": 8, "window": 4, "backend": "gpu"}, "backend 'gpu'"),
])
def test_bad_arguments_are_config_errors(kwargs, words):
    with pytest.raises(ConfigError, match=words):
        pack_best_fit(np.array([3, 4]), **kwargs)
    with pytest.raises(ConfigError, match="document 1 has length -2"):
        pack_best_fit(np.array([3, -2]), 8, window=4)
