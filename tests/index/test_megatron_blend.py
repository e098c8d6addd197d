"""megatron_blend against megatron-core's own C++ greedy, on hypothesis-generated weights."""

from __future__ import annotations

import contextlib
import importlib
import itertools
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from index_fixtures import megatron_blending_indices as megatron
from tokenloom.errors import ConfigError

# the module, not the function tokenloom.index re-exports under the same name
mb = importlib.import_module("tokenloom.index.megatron_blend")

helpers_cpp = pytest.importorskip("megatron.core.datasets.helpers_cpp")

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def megatron_exhaustive(sizes):
    sizes = np.asarray(sizes, dtype=np.int64)
    total = int(sizes.sum())
    dataset_index = np.zeros(total, dtype=np.int16)
    dataset_sample_index = np.zeros(total, dtype=np.int64)
    helpers_cpp.build_exhaustive_blending_indices(dataset_index, dataset_sample_index, sizes, len(sizes))
    return dataset_index, dataset_sample_index


@contextlib.contextmanager
def scan_limit(num_datasets: int):
    """Route blends of up to ``num_datasets`` datasets to the plain scan, the rest to the pool."""
    saved = mb._SCAN_DATASETS
    mb._SCAN_DATASETS = num_datasets
    try:
        yield
    finally:
        mb._SCAN_DATASETS = saved


#: both kernels: the pool for every blend, then the plain scan for every blend
KERNEL_CHOICES = (0, 10**9)


def assert_same(ours, theirs):
    assert ours[0].dtype == theirs[0].dtype and ours[1].dtype == theirs[1].dtype
    mismatch = np.flatnonzero((ours[0] != theirs[0]) | (ours[1] != theirs[1]))
    assert mismatch.size == 0, f"first difference at sample {mismatch[:1]}"


@st.composite
def weight_vectors(draw, max_datasets=60):
    """Skewed, tiny, tied, equal and plain weights, normalised as megatron does, or raw."""
    d = draw(st.integers(1, max_datasets))
    kind = draw(st.sampled_from(["uniform", "tiny", "ties", "equal", "skewed", "integers"]))
    if kind == "uniform":
        w = draw(st.lists(st.floats(1e-6, 1.0), min_size=d, max_size=d))
    elif kind == "tiny":
        w = draw(st.lists(st.sampled_from([0.0, 1e-300, 1e-12, 1e-7, 0.3, 1.0, 5e-4]), min_size=d, max_size=d))
    elif kind == "ties":
        pool = draw(st.lists(st.floats(1e-3, 1.0), min_size=1, max_size=3))
        w = draw(st.lists(st.sampled_from(pool), min_size=d, max_size=d))
    elif kind == "equal":
        w = [1.0] * d
    elif kind == "skewed":
        w = [draw(st.floats(0.5, 1.0)) * 10.0 ** -draw(st.integers(0, 9)) for _ in range(d)]
    else:
        w = draw(st.lists(st.integers(1, 5), min_size=d, max_size=d))
    w = np.array(w, dtype=np.float64)
    if not np.any(w > 0):
        w[0] = 1.0  # megatron-core needs one positive weight to make sense
    if draw(st.booleans()):
        w = w / np.sum(w)  # megatron-core's normalize
    return w


@SETTINGS
@given(weights=weight_vectors(), size=st.integers(0, 6000))
def test_identical_to_megatron_core(weights, size):
    theirs = megatron(weights, size)
    for choice in KERNEL_CHOICES:
        with scan_limit(choice):
            assert_same(mb.megatron_blend(weights, size), theirs)


@SETTINGS
@given(sizes=st.lists(st.integers(1, 400), min_size=1, max_size=40))
def test_exhaustive_identical_to_megatron_core(sizes):
    theirs = megatron_exhaustive(sizes)
    for choice in KERNEL_CHOICES:
        with scan_limit(choice):
            assert_same(mb.megatron_exhaustive_blend(sizes), theirs)


@pytest.mark.parametrize("seed", [0, 1])
def test_long_run_with_adaptation_and_far_events(seed):
    """Long enough for theta to adapt many times and for tiny weights to be parked past the ring."""
    rng = np.random.default_rng(seed)
    weights = np.concatenate([rng.random(180), rng.random(20) * 1e-5])
    weights /= weights.sum()
    size = 200_000
    assert_same(mb.megatron_blend(weights, size), megatron(weights, size))


def test_exhaustive_long_run():
    rng = np.random.default_rng(2)
    sizes = rng.integers(1, 4000, size=300)
    assert_same(mb.megatron_exhaustive_blend(sizes), megatron_exhaustive(sizes))


def test_one_dataset_and_the_megatron_limit():
    assert_same(mb.megatron_blend([1.0], 1000), megatron([1.0], 1000))
    rng = np.random.default_rng(3)
    weights = rng.random(mb.MEGATRON_MAX_DATASETS)
    weights /= weights.sum()
    assert_same(mb.megatron_blend(weights, 4000), megatron(weights, 4000))


@contextlib.contextmanager
def patched(**values):
    """Set module constants of megatron_blend for the duration (chunk sizes, replay limits...)."""
    saved = {name: getattr(mb, name) for name in values}
    for name, value in values.items():
        setattr(mb, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(mb, name, value)


@SETTINGS
@given(weights=weight_vectors(), size=st.integers(0, 6000), threads=st.integers(2, 5),
       resync_steps=st.sampled_from([1, 7, 1 << 16]))
def test_threaded_chunks_identical_to_megatron_core(weights, size, threads, resync_steps):
    # tiny chunks, so that many chunk starts are guessed and repaired; a replay limit of 1 or 7
    # steps sends most repairs back to the fast kernel part-way through their chunk
    theirs = megatron(weights, size)
    for choice in KERNEL_CHOICES:
        with scan_limit(choice), patched(_MIN_CHUNK=16, _RESYNC_STEPS=resync_steps):
            assert_same(mb.megatron_blend(weights, size, threads=threads), theirs)


@SETTINGS
@given(sizes=st.lists(st.integers(1, 400), min_size=1, max_size=40), threads=st.integers(2, 5))
def test_threaded_exhaustive_identical_to_megatron_core(sizes, threads):
    theirs = megatron_exhaustive(sizes)
    for choice in KERNEL_CHOICES:
        with scan_limit(choice), patched(_MIN_CHUNK=16):
            assert_same(mb.megatron_exhaustive_blend(sizes, threads=threads), theirs)


def test_threaded_chunks_are_right_whatever_the_guess():
    # a guess far from the truth (every sample so far on one dataset): the repair replays the
    # whole chunk, or hands it back to the fast kernel, and the arrays are still megatron's
    rng = np.random.default_rng(4)
    weights = rng.random(300)
    weights /= weights.sum()
    size = 40_000

    def bad_guess(weights, limits, step, member_start, members):
        counts = np.zeros(len(weights), dtype=np.int64)
        counts[0] = step  # random weights: every dataset is a group of its own
        return counts

    theirs = megatron(weights, size)
    for resync_steps in (1 << 16, 100):
        with patched(_MIN_CHUNK=1000, _RESYNC_STEPS=resync_steps, _guess_counts=bad_guess):
            assert_same(mb.megatron_blend(weights, size, threads=4), theirs)


def test_threaded_long_run_meets_the_true_run_early():
    # realistic sizes: the guessed chunk starts are (nearly) the true states, and the threaded
    # arrays equal megatron-core's
    rng = np.random.default_rng(5)
    weights = rng.random(1000) + 1e-3
    weights /= weights.sum()
    size = 600_000
    with patched(_MIN_CHUNK=100_000):
        assert_same(mb.megatron_blend(weights, size, threads=3), megatron(weights, size))


@settings(max_examples=8, deadline=None)
@given(weights=weight_vectors(max_datasets=30), size=st.integers(0, 2500))
def test_python_backend_matches_compiled_and_reference(weights, size):
    reference = mb._reference_megatron_blend(weights, size)
    for choice in KERNEL_CHOICES:
        with scan_limit(choice):
            compiled = mb.megatron_blend(weights, size)
            assert np.array_equal(compiled[0], reference[0]) and np.array_equal(compiled[1], reference[1])
            if "numba" in mb.BACKENDS:
                assert_same(mb.megatron_blend(weights, size, backend="python"), compiled)


def test_rejects_what_megatron_cannot_blend():
    with pytest.raises(ConfigError, match="dataset 1"):
        mb.megatron_blend([0.5, float("nan")], 10)
    with pytest.raises(ConfigError, match="dataset 0"):
        mb.megatron_blend([-1.0, 2.0], 10)
    with pytest.raises(ConfigError, match="empty"):
        mb.megatron_blend([], 10)
    with pytest.raises(ConfigError, match="32766"):
        mb.megatron_blend(np.ones(32767), 10)
    with pytest.raises(ConfigError, match="dataset 2"):
        mb.megatron_exhaustive_blend([3, 4, 0])
    for threads in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="threads"):
            mb.megatron_blend([1.0, 2.0], 10, threads=threads)
    ids, _ = mb.megatron_blend(np.ones(32767), 10, allow_beyond_megatron=True)
    assert ids.dtype == np.int32 and list(ids) == list(range(10))


# ------------------------------------------------------------------ ranges on many ranks


def ranges_blend(greedy, size, bounds, threads=1):
    """What the ranks of a distributed build do, in one process: every range from its guessed
    start, then rounds of repair until consecutive ranges agree (settle_range, ranges_settled)."""
    outs = [(np.zeros(b - a, dtype=greedy.dataset_id_dtype), np.zeros(b - a, dtype=np.int64))
            for a, b in itertools.pairwise(bounds)]
    runs = [greedy.fill(a, b, *outs[r], threads=threads) for r, (a, b) in enumerate(itertools.pairwise(bounds))]
    rounds = 0
    while not mb.ranges_settled(runs):
        runs = [mb.settle_range(greedy, bounds, runs, r, *outs[r]) for r in range(len(runs))]
        rounds += 1
        assert rounds <= len(runs)
    return np.concatenate([o[0] for o in outs]), np.concatenate([o[1] for o in outs]), runs[-1].end_counts


def ranges_blend_in_blocks(greedy, size, bounds, block, path, threads=1):
    """The same, as tokenloom.builder.divided does it: each range computed and written one block
    at a time into one pack file, then repaired block by block from the state each block was
    recorded from (``_repair_blocks``); returns the file's two arrays and the blend's end state."""
    from tokenloom.builder import divided

    slots, total = divided.pack_layout(size, greedy.dataset_id_dtype)
    with open(path, "wb") as f:
        f.truncate(total)
    fd = os.open(path, os.O_RDWR)
    try:
        ranges = []
        for a, b in itertools.pairwise(bounds):
            windows = [(w, min(w + block, b)) for w in range(a, b, block)]
            buffers = (np.empty(block, dtype=greedy.dataset_id_dtype), np.empty(block, dtype=np.int64))
            counts, states, ends = greedy.guess(a), [], []
            start = counts.copy()
            for w0, w1 in windows:
                states.append(counts)
                out = (buffers[0][:w1 - w0], buffers[1][:w1 - w0])
                counts = greedy.fill(w0, w1, *out, counts=counts, threads=threads).end_counts
                ends.append(counts)
                divided._write_block(fd, slots, w0, out)
            ranges.append([mb.RangeRun(start, counts), windows, states, ends, buffers])
        rounds = 0
        while not mb.ranges_settled([r[0] for r in ranges]):
            runs = [r[0] for r in ranges]
            for k, (run, windows, states, ends, buffers) in enumerate(ranges):
                true_start = np.zeros(greedy.num_datasets, dtype=np.int64) if k == 0 else runs[k - 1].end_counts
                end = divided._repair_blocks(greedy, fd, slots, windows, states, ends, true_start, buffers)
                ranges[k][0] = mb.RangeRun(np.array(true_start), run.end_counts if end is None else end)
            rounds += 1
            assert rounds <= len(ranges)
        out = [np.fromfile(path, dtype=slot.dtype, count=size, offset=slot.data_offset) for slot in slots]
        return out[0], out[1], ranges[-1][0].end_counts
    finally:
        os.close(fd)


@st.composite
def rank_bounds(draw, size):
    """Range boundaries of 1 to 7 ranks over [0, size), empty ranges allowed (more ranks than work)."""
    ranks = draw(st.integers(1, 7))
    cuts = sorted(draw(st.lists(st.integers(0, size), min_size=ranks - 1, max_size=ranks - 1)))
    return [0, *cuts, size]


@SETTINGS
@given(weights=weight_vectors(), size=st.integers(1, 6000), data=st.data(), threads=st.integers(1, 3),
       block=st.sampled_from([1, 7, 64, 500, 10**6]), replay=st.sampled_from([4, 1 << 16]))
def test_ranges_in_blocks_through_a_file_identical_to_megatron_core(tmp_path_factory, weights, size, data, threads,
                                                                    block, replay):
    theirs = megatron(weights, size)
    cuts = data.draw(rank_bounds(size // block if block <= size else 0))
    bounds = [min(size, c * block) for c in cuts[:-1]] + [size]  # whole blocks, the last range takes the rest
    path = str(tmp_path_factory.mktemp("blocks") / "blend.bin")
    for choice in KERNEL_CHOICES:  # a short replay: block repairs that do not meet go on to the next block
        with scan_limit(choice), patched(_MIN_CHUNK=16, _RESYNC_STEPS=replay):
            greedy = mb.MegatronGreedy(weights, np.full(len(weights), -1, dtype=np.int64))
            dataset_ids, sample_ids, end = ranges_blend_in_blocks(greedy, size, bounds, block, path, threads)
            assert_same((dataset_ids, sample_ids), theirs)
            np.testing.assert_array_equal(end, np.bincount(theirs[0], minlength=len(weights)))


@SETTINGS
@given(weights=weight_vectors(), size=st.integers(1, 6000), data=st.data(), threads=st.integers(1, 3))
def test_ranges_on_many_ranks_identical_to_megatron_core(weights, size, data, threads):
    theirs = megatron(weights, size)
    bounds = data.draw(rank_bounds(size))
    for choice in KERNEL_CHOICES:
        with scan_limit(choice), patched(_MIN_CHUNK=16):
            greedy = mb.MegatronGreedy(weights, np.full(len(weights), -1, dtype=np.int64))
            dataset_ids, sample_ids, end = ranges_blend(greedy, size, bounds, threads)
            assert_same((dataset_ids, sample_ids), theirs)
            np.testing.assert_array_equal(end, np.bincount(theirs[0], minlength=len(weights)))


@SETTINGS
@given(sizes=st.lists(st.integers(1, 400), min_size=1, max_size=40), data=st.data())
def test_exhaustive_ranges_on_many_ranks_identical_to_megatron_core(sizes, data):
    theirs = megatron_exhaustive(sizes)
    total = int(np.sum(sizes))
    bounds = data.draw(rank_bounds(total))
    limits = np.asarray(sizes, dtype=np.int64)
    for choice in KERNEL_CHOICES:
        with scan_limit(choice):
            greedy = mb.MegatronGreedy(limits / np.float64(total), limits)
            assert_same(ranges_blend(greedy, total, bounds)[:2], theirs)


def test_ranges_settle_whatever_the_guess():
    # every guessed start wrong: each range's replay never meets, so its end state changes and the
    # ranges after it repair again; the rounds still end with megatron's arrays
    rng = np.random.default_rng(6)
    weights = rng.random(200)
    weights /= weights.sum()
    size = 30_000

    def bad_guess(weights, limits, step, member_start, members):
        counts = np.zeros(len(weights), dtype=np.int64)
        counts[0] = step
        return counts

    with patched(_guess_counts=bad_guess, _RESYNC_STEPS=50):
        greedy = mb.MegatronGreedy(weights, np.full(200, -1, dtype=np.int64))
        assert_same(ranges_blend(greedy, size, [0, 7_000, 7_000, 19_000, 30_000])[:2], megatron(weights, size))


@pytest.mark.parametrize("weights", [[0.25, 0.75], [0.5, 0.125, 0.375], [1.0]])
def test_positions_beyond_2_to_the_31(weights):
    # a range of steps past 2**31 (and 2**32), from a state there, against megatron's plain loop
    # from the same state: steps, counts and sample ids beyond int32 without running the 2**31
    # steps before them (a distributed build starts its ranks' ranges this way)
    w = np.asarray(weights, dtype=np.float64)
    greedy = mb.MegatronGreedy(w, np.full(len(w), -1, dtype=np.int64))
    for start in (2**31 - 3, 2**32 + 5):
        stop = start + 5000
        counts = greedy.guess(start)
        assert counts.sum() == start
        out_d = np.zeros(stop - start, dtype=greedy.dataset_id_dtype)
        out_s = np.zeros(stop - start, dtype=np.int64)
        run = greedy.fill(start, stop, out_d, out_s, counts=counts, threads=2)
        reference = counts.copy()
        for k, i in enumerate(range(start, stop)):  # megatron's loop, from the same state
            d = int(np.argmax(w * np.float64(max(i, 1)) - reference.astype(np.float64)))
            assert (out_d[k], out_s[k]) == (d, reference[d]), f"step {i}"
            reference[d] += 1
        np.testing.assert_array_equal(run.end_counts, reference)
        assert out_s.max() > 2**30
