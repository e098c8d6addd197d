"""The keyed Feistel permutation: bijection, inverse, backends, reproducibility, statistics."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenloom.errors import ConfigError
from tokenloom.index.feistel import (
    BACKENDS,
    FeistelPermutation,
    default_rounds,
    derive_round_keys,
    feistel_bits,
)

BACKEND_NAMES = sorted(BACKENDS)
MASK64 = (1 << 64) - 1


# ----------------------------------------------------------------------------- a slow reference


def _reference_keys(seed: int, purpose: str, epoch: int, size: int, rounds: int) -> list[int]:
    tag = purpose.encode()
    message = b"tokenloom.feistel.v1" + struct.pack("<QQQQ", seed, epoch, size, len(tag)) + tag
    digest = hashlib.blake2b(message, digest_size=8 * rounds).digest()
    return [int.from_bytes(digest[8 * r:8 * r + 8], "little") for r in range(rounds)]


def _reference_fmix(z: int) -> int:
    z ^= z >> 33
    z = (z * 0xFF51AFD7ED558CCD) & MASK64
    z ^= z >> 33
    z = (z * 0xC4CEB9FE1A85EC53) & MASK64
    return z ^ (z >> 33)


def _reference_perm(i: int, size: int, seed: int, purpose: str, epoch: int = 0) -> int:
    """FORMAT.md's construction in Python integers, one index at a time."""
    rounds = 8 if max(8, (size - 1).bit_length()) <= 16 else 4
    keys = _reference_keys(seed, purpose, epoch, size, rounds)
    bits = max(8, (size - 1).bit_length())
    x = i
    while True:
        w = bits // 2
        for key in keys:
            h = bits - w
            lo, hi = x & ((1 << w) - 1), x >> w
            x = (lo << h) | ((hi + _reference_fmix(lo ^ key)) % (1 << h))
            w = h
        if x < size:
            return x


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("size", [1, 2, 3, 10, 255, 256, 257, 1000, 65536, 65537, 123457])
def test_matches_the_slow_reference(size, backend):
    perm = FeistelPermutation.from_seed(size, seed=99, purpose="documents", epoch=3, backend=backend)
    indices = np.unique(np.linspace(0, size - 1, 50).astype(np.int64))
    expected = [_reference_perm(int(i), size, 99, "documents", 3) for i in indices]
    assert perm(indices).tolist() == expected


def test_golden_values_pin_the_construction():
    # Changing these changes every stateless index: bump KEY_DERIVATION_TAG instead.
    assert derive_round_keys(seed=0, purpose="documents", epoch=0, size=10, rounds=2) == (
        8291620282430875548, 6018325471540984144)
    perm = FeistelPermutation.from_seed(10, seed=1234, purpose="documents")
    assert perm(np.arange(10)).tolist() == [9, 6, 5, 2, 4, 8, 3, 7, 1, 0]


# ----------------------------------------------------------------------------- bijection


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_bijection_exhaustive_for_small_sizes(backend):
    for size in [*list(range(1, 300)), 511, 512, 513, 4095, 4096, 4097, 70001]:
        perm = FeistelPermutation.from_seed(size, seed=size, purpose="t", backend=backend)
        image = perm(np.arange(size))
        assert np.array_equal(np.sort(image), np.arange(size)), size
        assert np.array_equal(perm.inverse(image), np.arange(size)), size


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("size", [2**31 + 11, 2**33 + 7, 2**40, 3 * 2**50 + 1, 2**62])
def test_bijection_sampled_for_large_sizes(size, backend):
    rng = np.random.default_rng(size % 1000)
    indices = np.unique(rng.integers(0, size, 20_000, dtype=np.int64))
    indices = np.concatenate([indices, [0, size - 1]])
    indices = np.unique(indices)
    perm = FeistelPermutation.from_seed(size, seed=7, purpose="t", backend=backend)
    image = perm(indices)
    assert image.dtype == np.int64
    assert image.min() >= 0 and image.max() < size
    assert len(np.unique(image)) == len(indices)  # injective on the sample
    assert np.array_equal(perm.inverse(image), indices)
    # the image is spread over the whole range, not clustered near the inputs
    assert abs(np.median(image) / size - 0.5) < 0.05


@settings(max_examples=60, deadline=None)
@given(size=st.integers(1, 2**62), seed=st.integers(0, 2**64 - 1), epoch=st.integers(0, 1000),
       data=st.data())
def test_backends_agree(size, seed, epoch, data):
    indices = np.array(data.draw(st.lists(st.integers(0, size - 1), min_size=1, max_size=40)), dtype=np.int64)
    results = [FeistelPermutation.from_seed(size, seed=seed, purpose="p", epoch=epoch, backend=name)(indices)
               for name in BACKEND_NAMES]
    inverses = [FeistelPermutation.from_seed(size, seed=seed, purpose="p", epoch=epoch, backend=name).inverse(indices)
                for name in BACKEND_NAMES]
    for other, other_inverse in zip(results[1:], inverses[1:]):
        assert np.array_equal(results[0], other)
        assert np.array_equal(inverses[0], other_inverse)


def test_shapes_and_scalars():
    perm = FeistelPermutation.from_seed(1000, seed=1, purpose="t")
    grid = np.arange(12).reshape(3, 4)
    assert perm(grid).shape == (3, 4)
    assert int(perm(5)) == int(perm(np.array([5]))[0])
    assert perm(np.array([], dtype=np.int64)).shape == (0,)
    assert perm.bits == feistel_bits(1000) == 10


# ----------------------------------------------------------------------------- keys


def test_same_inputs_same_permutation_different_keys_different_permutation():
    x = np.arange(1000)
    base = FeistelPermutation.from_seed(1000, seed=5, purpose="documents", epoch=0)(x)
    assert np.array_equal(base, FeistelPermutation.from_seed(1000, seed=5, purpose="documents", epoch=0)(x))
    for other in (dict(seed=6, purpose="documents", epoch=0), dict(seed=5, purpose="samples", epoch=0),
                  dict(seed=5, purpose="documents", epoch=1)):
        assert not np.array_equal(base, FeistelPermutation.from_seed(1000, **other)(x)), other
    # the size is part of the key: a prefix of a larger permutation is not reused
    assert not np.array_equal(base[:999], FeistelPermutation.from_seed(999, seed=5, purpose="documents")(x[:999]))


def test_default_rounds():
    assert default_rounds(10) == 8 and default_rounds(2**16) == 8
    assert default_rounds(2**16 + 1) == 4 and default_rounds(2**40) == 4


@pytest.mark.parametrize(
    "call, needle",
    [
        (lambda: FeistelPermutation.from_seed(0, seed=1, purpose="t"), "size=0"),
        (lambda: FeistelPermutation.from_seed(2**62 + 1, seed=1, purpose="t"), "size="),
        (lambda: FeistelPermutation.from_seed(10, seed=-1, purpose="t"), "seed=-1"),
        (lambda: FeistelPermutation.from_seed(10, seed=2**64, purpose="t"), "seed="),
        (lambda: FeistelPermutation.from_seed(10, seed=1, purpose="t", rounds=0), "rounds=0"),
        (lambda: FeistelPermutation.from_seed(10, seed=1, purpose="t", rounds=9), "rounds=9"),
        (lambda: FeistelPermutation.from_seed(10, seed=1, purpose="t")(np.array([10])), "[0, 10)"),
        (lambda: FeistelPermutation.from_seed(10, seed=1, purpose="t")(np.array([-1])), "[0, 10)"),
        (lambda: FeistelPermutation.from_seed(10, seed=1, purpose="t")(np.array([1.5])), "float"),
        (lambda: FeistelPermutation.from_seed(10, seed=1, purpose="t", backend="cuda"), "cuda"),
    ],
)
def test_bad_arguments_raise_config_error(call, needle):
    with pytest.raises(ConfigError, match=None) as error:
        call()
    assert needle in str(error.value)


# ----------------------------------------------------------------------------- statistics


def _position_chi2(perms: np.ndarray) -> float:
    """Chi-square of how often element j lands at position i, against uniform (df = (n-1)^2)."""
    reps, n = perms.shape
    counts = np.zeros((n, n))
    np.add.at(counts, (np.broadcast_to(np.arange(n), perms.shape), perms), 1)
    expected = reps / n
    return float(((counts - expected) ** 2 / expected).sum())


def _pair_chi2(perms: np.ndarray) -> float:
    """Chi-square of ordered adjacent pairs (perm[i], perm[i+1]) against uniform off the diagonal."""
    reps, n = perms.shape
    counts = np.zeros((n, n))
    np.add.at(counts, (perms[:, :-1], perms[:, 1:]), 1)
    off = ~np.eye(n, dtype=bool)
    expected = reps * (n - 1) / (n * (n - 1))
    return float(((counts[off] - expected) ** 2 / expected).sum())


def _feistel_perms(n: int, reps: int) -> np.ndarray:
    x = np.arange(n)
    return np.stack([FeistelPermutation.from_seed(n, seed=s, purpose="stats")(x) for s in range(reps)])


def _numpy_perms(n: int, reps: int) -> np.ndarray:
    rng = np.random.default_rng(12345)
    return np.stack([rng.permutation(n) for _ in range(reps)])


# Thresholds: chi2/df well above 1 + 5 sd; each test is also run on numpy's true shuffle
# (must pass) and on bad shuffles (must fail), so the statistic is shown to discriminate.
def _position_ok(perms):
    n = perms.shape[1]
    df = (n - 1) ** 2
    return _position_chi2(perms) < df + 6 * np.sqrt(2 * df)


def _pairs_ok(perms):
    n = perms.shape[1]
    df = n * (n - 1) - 1
    # adjacent pairs within a permutation are dependent: allow a wider band
    return _pair_chi2(perms) < df + 8 * np.sqrt(2 * df)


@pytest.mark.parametrize("n", [2, 3, 5, 10, 17])
def test_statistics_match_a_true_shuffle_small(n):
    reps = 6000
    assert _position_ok(_numpy_perms(n, reps))
    assert _position_ok(_feistel_perms(n, reps))
    if n > 2:
        assert _pairs_ok(_numpy_perms(n, reps))
        assert _pairs_ok(_feistel_perms(n, reps))


def test_the_statistics_reject_bad_shuffles():
    n, reps = 10, 6000
    rng = np.random.default_rng(0)
    identity = np.broadcast_to(np.arange(n), (reps, n))
    rotation = (np.arange(n)[None, :] + rng.integers(0, n, reps)[:, None]) % n  # uniform positions!
    reversal_or_not = np.where(rng.random(reps)[:, None] < 0.5, np.arange(n), np.arange(n)[::-1])
    assert not _position_ok(identity)
    assert _position_ok(rotation) and not _pairs_ok(rotation)  # why the pair test exists
    assert not _pairs_ok(reversal_or_not)


def test_statistics_match_a_true_shuffle_large():
    """Large domains (4 rounds): where elements land and how close neighbours stay."""
    n, reps = 70_000, 300
    x = np.arange(n)
    for perms in (np.stack([FeistelPermutation.from_seed(n, seed=s, purpose="big")(x) for s in range(reps)]),
                  _numpy_perms(n, reps)):
        # positions: the first 64 elements' images, in 16 equal bins, uniform
        bins = perms[:, :64] * 16 // n
        counts = np.stack([np.bincount(bins[:, j], minlength=16) for j in range(64)])
        expected = reps / 16
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        df = 64 * 15
        assert chi2 < df + 6 * np.sqrt(2 * df)
        # neighbours: P(0 < |perm[i+1] - perm[i]| < m) for two distinct uniform draws is
        # 2 * ((m-1) n - m (m-1) / 2) / (n (n-1)) = 0.019872; 3 rounds give 0.02059 and fail
        m = n // 100
        exact = 2 * ((m - 1) * n - m * (m - 1) / 2) / (n * (n - 1))
        near = np.mean(np.abs(np.diff(perms, axis=1)) < m)
        assert abs(near - exact) < 0.0003, near
        # fixed points: one per permutation on average
        assert abs(np.mean(np.sum(perms == x, axis=1)) - 1.0) < 0.25
