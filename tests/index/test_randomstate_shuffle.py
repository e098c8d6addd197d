"""The numba shuffle against numpy's RandomState.shuffle: same array, same generator state."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("numba")

from tokenloom.index import randomstate_shuffle
from tokenloom.index.randomstate_shuffle import (
    fast_shuffle,
    interval_draws,
    shuffle_like_randomstate,
)

seeds = st.one_of(st.integers(0, 2**32 - 1), st.sampled_from([0, 2**32 - 1]))


def _same_state(a: np.random.RandomState, b: np.random.RandomState) -> bool:
    sa, sb = a.get_state(), b.get_state()
    return sa[0] == sb[0] and np.array_equal(sa[1], sb[1]) and sa[2:] == sb[2:]


@settings(max_examples=80, deadline=None)
@given(seed=seeds, sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=4),
       dtype=st.sampled_from([np.int32, np.uint32, np.int64]),
       block=st.sampled_from([1, 7, 640, 1 << 16]), warmup=st.integers(0, 700))
def test_fast_shuffle_is_randomstate_shuffle(seed, sizes, dtype, block, warmup):
    theirs, ours = np.random.RandomState(seed), np.random.RandomState(seed)
    theirs.randint(0, 2**31, warmup)  # start anywhere in the 624-word block
    ours.randint(0, 2**31, warmup)
    for size in sizes:  # consecutive shuffles continue the same stream
        expected = np.arange(size).astype(dtype)
        got = expected.copy()
        theirs.shuffle(expected)
        fast_shuffle(ours, got, block=block)
        np.testing.assert_array_equal(got, expected)
        assert _same_state(theirs, ours)
    assert theirs.randint(0, 2**63) == ours.randint(0, 2**63)


@pytest.mark.parametrize("size,block", [(65_536, 1 << 16), (65_537, 1 << 16), (100_003, 999), (1 << 18, 1 << 16)])
def test_fast_shuffle_is_randomstate_shuffle_across_blocks_and_masks(size, block):
    """Many 624-word regenerations, draw blocks and halvings of the mask in one shuffle (sizes
    at and just past a power of two, blocks that end mid-word-block), then a second shuffle that
    continues the stream."""
    theirs, ours = np.random.RandomState(size), np.random.RandomState(size)
    for n in (size, 5_000):
        expected = np.arange(n, dtype=np.int32)
        got = expected.copy()
        theirs.shuffle(expected)
        fast_shuffle(ours, got, block=block)
        np.testing.assert_array_equal(got, expected)
        assert _same_state(theirs, ours)


@settings(max_examples=60, deadline=None)
@given(seed=seeds, largest=st.one_of(st.integers(0, 2**32 - 1), st.integers(2**32, 2**64 - 2),
                                     st.sampled_from([0, 1, 2**32 - 1, 2**32, 2**63])))
def test_interval_draws_match_numpy_masked_draws(seed, largest):
    """Both 32-bit and 64-bit (high word first) draws, and no draw at all for [0, 0]."""
    theirs, ours = np.random.RandomState(seed), np.random.RandomState(seed)
    expected = theirs.randint(0, largest + 1, 40, dtype=np.uint64)
    np.testing.assert_array_equal(interval_draws(ours, largest, 40), expected)
    assert _same_state(theirs, ours)


def test_views_and_fallback_agree():
    base = np.arange(10_000, dtype=np.int32)
    a, b, c = base.copy(), base.copy(), base.copy()
    ra, rb, rc = (np.random.RandomState(11) for _ in range(3))
    ra.shuffle(a[:6000])
    ra.shuffle(a[6000:])
    fast_shuffle(rb, b[:6000])
    fast_shuffle(rb, b[6000:])
    shuffle_like_randomstate(rc, c[:6000], fast=False)
    shuffle_like_randomstate(rc, c[6000:], fast=False)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, c)
    strided = base.copy()[::2]  # not contiguous: handed to RandomState itself
    expected = strided.copy()
    np.random.RandomState(3).shuffle(expected)
    fast_shuffle(np.random.RandomState(3), strided)
    np.testing.assert_array_equal(strided, expected)


def test_other_bit_generators_and_dtypes_use_randomstate_itself():
    pcg = np.random.RandomState(np.random.PCG64(5))
    expected, got = np.arange(500), np.arange(500)
    np.random.RandomState(np.random.PCG64(5)).shuffle(expected)
    fast_shuffle(pcg, got)
    np.testing.assert_array_equal(got, expected)
    words = np.array([f"w{i}" for i in range(50)], dtype=object)
    expected_words = words.copy()
    np.random.RandomState(9).shuffle(expected_words)
    fast_shuffle(np.random.RandomState(9), words)
    np.testing.assert_array_equal(words, expected_words)


def test_small_arrays_keep_randomstates_own_shuffle_by_default(monkeypatch):
    """Below SMALL_SHUFFLE elements the default takes RandomState's shuffle (faster there, and no
    numba start-up); from it on, the kernel; the arrays are the same either way."""
    calls = []

    def kernel(random_state, array):
        calls.append(array.size)
        fast_shuffle(random_state, array)

    monkeypatch.setattr(randomstate_shuffle, "fast_shuffle", kernel)
    monkeypatch.setattr(randomstate_shuffle, "SMALL_SHUFFLE", 1000)
    shuffle_like_randomstate(np.random.RandomState(1), np.arange(999))
    assert calls == []
    shuffle_like_randomstate(np.random.RandomState(1), np.arange(1000))
    assert calls == [1000]
