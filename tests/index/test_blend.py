"""tokenloom's Blend: exact counts, the prefix bound, random access, seeded windows."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenloom.errors import ConfigError
from tokenloom.index import blend as blend_module
from tokenloom.index.blend import MAX_BLEND_SIZE, Blend, largest_remainder_counts

SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def weight_vectors(draw, max_datasets=80):
    """Skewed, tiny, equal, tied and many weights."""
    kind = draw(st.sampled_from(["uniform", "skewed", "tiny", "equal", "ties", "many"]))
    d = draw(st.integers(1, 400 if kind == "many" else max_datasets))
    if kind in ("uniform", "many"):
        return np.array(draw(st.lists(st.floats(1e-3, 1.0), min_size=d, max_size=d)))
    if kind == "skewed":
        return np.array([draw(st.floats(0.5, 1.0)) * 10.0 ** -draw(st.integers(0, 8)) for _ in range(d)])
    if kind == "tiny":
        return np.array([*draw(st.lists(st.sampled_from([1e-09, 1e-05, 0.0, 1.0, 3.0]), min_size=d, max_size=d)), 1.0])
    if kind == "equal":
        return np.ones(d)
    pool = draw(st.lists(st.floats(1e-3, 1.0), min_size=1, max_size=3))
    return np.array(draw(st.lists(st.sampled_from(pool), min_size=d, max_size=d)))


def quiet_blend(*args, **kwargs) -> Blend:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return Blend(*args, **kwargs)


def reference_order(counts: np.ndarray) -> list[int]:
    """The order straight from its definition: Python integers, recursion over the Huffman tree."""
    node_count, left_count, left, right, root = blend_module._huffman_tree(counts)

    def sequence(node: int) -> list[int]:
        if node < 0:
            return [-node - 1] * int(counts[-node - 1])
        c_v, c_a, h = int(node_count[node]), int(left_count[node]), int(node_count[node]) // 2
        seq_a, seq_b = iter(sequence(int(left[node]))), iter(sequence(int(right[node])))
        out = []
        for j in range(c_v):
            to_a = ((j + 1) * c_a + h) // c_v > (j * c_a + h) // c_v
            out.append(next(seq_a) if to_a else next(seq_b))
        return out

    return sequence(root)


def ranks(dataset_ids: np.ndarray) -> np.ndarray:
    """For every position, how many earlier positions hold the same dataset."""
    out = np.empty(len(dataset_ids), dtype=np.int64)
    seen: dict[int, int] = {}
    for p, d in enumerate(dataset_ids.tolist()):
        out[p] = seen.get(d, 0)
        seen[d] = out[p] + 1
    return out


@SETTINGS
@given(weights=weight_vectors(), size=st.integers(0, 5000))
def test_counts_are_largest_remainder(weights, size):
    counts = largest_remainder_counts(weights, size)
    assert counts.sum() == size
    quota = weights / weights.sum() * size
    assert np.all(np.abs(counts - quota) < 1)
    # nobody who got rounded down has a larger remainder than somebody rounded up
    up = counts > np.floor(quota)
    frac = quota - np.floor(quota)
    if up.any() and (~up).any():
        assert frac[up].min() >= frac[~up].max()


@SETTINGS
@given(weights=weight_vectors(), size=st.integers(1, 3000))
def test_every_prefix_is_within_the_bound(weights, size):
    blend = quiet_blend(weights, size)
    dataset_ids, sample_ids = blend.materialize()
    assert np.array_equal(np.bincount(dataset_ids, minlength=len(weights)), blend.counts)
    assert np.array_equal(sample_ids, ranks(dataset_ids))
    assert np.all(blend.prefix_bound < 2)
    # prefix counts: (size, D) is small enough here
    one_hot = np.zeros((size, len(weights)), dtype=np.int32)
    one_hot[np.arange(size), dataset_ids] = 1
    prefix = np.cumsum(one_hot, axis=0)  # (size, D): samples of d among the first L + 1
    lengths = np.arange(1, size + 1)[:, None]
    realised = np.abs(prefix - lengths * blend.counts / size)
    assert np.all(realised <= blend.prefix_bound + 1e-9)
    against_weights = np.abs(prefix - lengths * blend.weights)
    assert np.all(against_weights < blend.prefix_bound + 1)


@settings(max_examples=25, deadline=None)
@given(weights=weight_vectors(max_datasets=25), size=st.integers(1, 1500))
def test_kernels_agree_with_the_definition(weights, size):
    blend = quiet_blend(weights, size)
    expected = reference_order(blend.counts)
    for backend in blend_module.BACKENDS:
        other = quiet_blend(weights, size, backend=backend)
        dataset_ids, sample_ids = other.materialize()
        assert dataset_ids.tolist() == expected
        looked_up = other.lookup(np.arange(size))
        assert looked_up[0].tolist() == expected and np.array_equal(looked_up[1], sample_ids)


@settings(max_examples=25, deadline=None)
@given(weights=weight_vectors(max_datasets=25), size=st.integers(1, 1500), threads=st.integers(2, 7))
def test_threaded_materialize_equals_the_definition(weights, size, threads):
    # tiny ranges, so that every range starts inside every node's run, at any Bresenham state
    expected = reference_order(quiet_blend(weights, size).counts)
    saved = blend_module._MIN_MATERIALIZE_CHUNK
    blend_module._MIN_MATERIALIZE_CHUNK = 1
    try:
        for backend in blend_module.BACKENDS:
            blend = quiet_blend(weights, size, backend=backend)
            dataset_ids, sample_ids = blend.materialize(threads=threads)
            assert dataset_ids.tolist() == expected
            assert np.array_equal(sample_ids, ranks(dataset_ids))
    finally:
        blend_module._MIN_MATERIALIZE_CHUNK = saved


def test_materialize_rejects_a_bad_thread_count():
    for threads in (0, -2, 1.5, True):
        with pytest.raises(ConfigError, match="threads"):
            Blend([1.0, 2.0], 100).materialize(threads=threads)


def test_lookup_near_the_largest_size_does_not_overflow():
    weights = np.array([0.5, 0.25, 0.125, 0.0625, 0.0625, 1e-3])
    blend = quiet_blend(weights, MAX_BLEND_SIZE)
    positions = np.array([0, 1, 12345, MAX_BLEND_SIZE // 3, MAX_BLEND_SIZE - 2, MAX_BLEND_SIZE - 1])
    node_count, left_count, left, right, root = blend_module._huffman_tree(blend.counts)
    for backend in blend_module.BACKENDS:
        dataset_ids, sample_ids = quiet_blend(weights, MAX_BLEND_SIZE, backend=backend).lookup(positions)
        for p, d, s in zip(positions.tolist(), dataset_ids.tolist(), sample_ids.tolist()):
            node, j = root, p  # walk with Python integers
            while node >= 0:
                c_v, c_a, h = int(node_count[node]), int(left_count[node]), int(node_count[node]) // 2
                q = (j * c_a + h) // c_v
                to_a = ((j + 1) * c_a + h) // c_v > q
                node, j = (int(left[node]), q) if to_a else (int(right[node]), j - q)
            assert (d, s) == (-node - 1, j)
    assert dataset_ids[-1] >= 0


@SETTINGS
@given(weights=weight_vectors(max_datasets=30), size=st.integers(1, 2000), window=st.integers(1, 300),
       seed=st.integers(0, 2**64 - 1))
def test_seeded_windows_keep_their_exact_mix(weights, size, window, seed):
    plain = quiet_blend(weights, size)
    seeded = quiet_blend(weights, size, seed=seed, window=window)
    plain_ids, plain_samples = plain.materialize()
    ids, samples = seeded.materialize()
    looked_up = seeded.lookup(np.arange(size)[::-1])
    assert np.array_equal(looked_up[0][::-1], ids) and np.array_equal(looked_up[1][::-1], samples)
    for start in range(0, size, window):
        part = slice(start, start + window)
        assert sorted(zip(ids[part].tolist(), samples[part].tolist())) == sorted(
            zip(plain_ids[part].tolist(), plain_samples[part].tolist())
        )


def test_seed_changes_the_order_and_is_reproducible():
    weights = np.arange(1, 21, dtype=np.float64)
    a = Blend(weights, 4096, seed=1, window=512).materialize()[0]
    b = Blend(weights, 4096, seed=1, window=512).materialize()[0]
    c = Blend(weights, 4096, seed=2, window=512).materialize()[0]
    plain = Blend(weights, 4096).materialize()[0]
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c) and not np.array_equal(a, plain)


def test_lookup_keeps_shape_and_checks_range():
    blend = Blend([1.0, 2.0, 3.0], 100)
    ids, samples = blend.lookup(np.array([[0, 1], [98, 99]]))
    assert ids.shape == (2, 2) and samples.shape == (2, 2)
    with pytest.raises(ConfigError, match=r"\[0, 100\)"):
        blend.lookup([100])
    with pytest.raises(ConfigError, match="integers"):
        blend.lookup([0.5])


def test_dataset_id_dtype_follows_megatrons_limit():
    with pytest.warns(UserWarning, match=r"32756 dataset\(s\) .* dataset 10 with weight 1, .* and 32746 more"):
        assert Blend(np.ones(32766), 10).materialize()[0].dtype == np.int16
    ids, _ = Blend(np.ones(32767), 40000).materialize()
    assert ids.dtype == np.int32 and ids.max() == 32766


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ([1.0, -0.5], "dataset 1"),
        ([float("nan"), 1.0], "dataset 0"),
        ([1.0, 2.0, float("inf")], "dataset 2"),
        ([0.0, 0.0], "all 2 weights are zero"),
        ([], "non-empty"),
    ],
)
def test_bad_weights_are_config_errors(weights, message):
    with pytest.raises(ConfigError, match=message):
        Blend(weights, 10)


def test_bad_names_size_and_seed():
    with pytest.raises(ConfigError, match="'web'"):
        Blend([1.0, -1.0], 10, names=["books", "web"])
    with pytest.raises(ConfigError, match="size"):
        Blend([1.0], MAX_BLEND_SIZE + 1)
    with pytest.raises(ConfigError, match="window"):
        Blend([1.0], 10, seed=3)
    with pytest.raises(ConfigError, match="seed"):
        Blend([1.0], 10, window=3)


def test_a_starved_dataset_is_named_in_a_warning():
    with pytest.warns(UserWarning, match=r"dataset 1 \('rare'\) with weight 1e-06"):
        blend = Blend([1.0, 1e-6], 1000, names=["common", "rare"])
    assert blend.counts.tolist() == [1000, 0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Blend([1.0, 0.0], 1000)  # a zero weight is a choice, not a surprise


def test_samples_before_counts_a_prefix_of_the_blend():
    rng = np.random.default_rng(5)
    for _ in range(50):
        weights = rng.random(int(rng.integers(1, 12))) ** 3
        weights[rng.random(weights.shape[0]) < 0.3] = 0
        weights[0] += 0.1
        size = int(rng.integers(0, 400))
        blend = quiet_blend(weights, size)
        prefix = np.zeros((size + 1, weights.shape[0]), dtype=np.int64)
        prefix[np.arange(1, size + 1), blend.materialize()[0]] = 1
        prefix = np.cumsum(prefix, axis=0)
        lengths, datasets = np.meshgrid(np.arange(size + 1), np.arange(weights.shape[0]), indexing="ij")
        assert np.array_equal(blend.samples_before(datasets, lengths), prefix)
    with pytest.raises(ConfigError, match="unseeded"):
        Blend([1.0, 1.0], 8, seed=1, window=4).samples_before(np.array([0]), np.array([1]))
