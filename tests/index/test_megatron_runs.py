"""Length runs in exact mode (FORMAT.md "Length runs"): each run of a store is megatron's sample
walk over a cut of one stream, megatron-core's document index over the epochs every run needs,
against a slow reference that shuffles that stream with numpy's own RandomState and spells out
every token: across the runs every stream token is an input exactly once, none is skipped, and
each run's samples are shuffled among themselves by a generator of its own."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from index_fixtures import megatron_pieces
from tokenloom.errors import ConfigError
from tokenloom.index.megatron_gpt import SAMPLE_INDEX_KERNELS
from tokenloom.index.megatron_runs import build_megatron_run_indices, build_run_sample_index, stream_epochs_for


def _reference_stream(ids: np.ndarray, seed: int, epochs: int) -> np.ndarray:
    """megatron-core's ``_build_document_index`` without a separate final epoch, spelt out."""
    stream = np.tile(ids.astype(np.int32), epochs)
    np.random.RandomState(seed).shuffle(stream)
    return stream


def _build_runs(lengths, ids, runs, seed, extra, kernel=None):
    """Every run's indices, each from the token the one before stopped at, on one stream."""
    tokens = int(lengths[ids].sum())
    reach = sum(n * s for n, s in runs) + extra
    epochs = stream_epochs_for(tokens, reach)
    out, first = [], 0
    for n, s in runs:
        out.append((first, build_megatron_run_indices(lengths, ids, first_token=first, num_samples=n, seq_length=s,
                                                      seed=seed, stream_epochs=epochs, add_extra_token=bool(extra),
                                                      kernel=kernel)))
        first += n * s
    return epochs, out


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(0, 9), min_size=1, max_size=14).filter(any),
       st.lists(st.tuples(st.integers(1, 6), st.integers(1, 9)), min_size=1, max_size=4),
       st.integers(0, 1), st.integers(0, 2**32 - 1), st.sampled_from(sorted(SAMPLE_INDEX_KERNELS)), st.data())
def test_every_stream_token_is_an_input_once_across_the_runs_none_skipped(lengths, runs, extra, seed, kernel, data):
    lengths = np.array([*lengths, 3], dtype=np.int32)  # the last document is outside the split
    ids = np.arange(data.draw(st.integers(1, len(lengths) - 1)), dtype=np.int64)
    if not lengths[ids].any():
        lengths[ids[0]] = 1
    epochs, built = _build_runs(lengths, ids, runs, seed, extra, kernel)
    stream = _reference_stream(ids, seed, epochs)
    tokens = [(int(d), o) for d in stream for o in range(int(lengths[d]))]  # every stream token, in order
    inputs = []
    for (first, indices), (n, s) in zip(built, runs):
        assert indices.num_samples == n and indices.plan.num_samples_in_index == n
        for k in range(n):  # sample k (unshuffled) holds stream tokens [first + k s, first + (k + 1) s + extra)
            read = [(d, o) for _, d, offset, stop in megatron_pieces(indices.document_index, indices.sample_index,
                                                                     k, extra)
                    for o in range(offset, int(lengths[d]) if stop is None else stop)]
            assert read == tokens[first + k * s:first + (k + 1) * s + extra], (first, k)
            inputs += read[:s]
        # the stream's ends summed a few positions at a time: the same arrays
        chunk = data.draw(st.integers(1, 5))
        again = build_run_sample_index(lengths, stream, indices.plan, first, kernel=kernel, chunk=chunk)
        np.testing.assert_array_equal(again[0], indices.document_index)
        np.testing.assert_array_equal(again[1], indices.sample_index)
        # one shuffled part, drawn by the run's own generator
        expected = np.random.RandomState([seed, first & 0xFFFFFFFF, first >> 32]).permutation(n)
        np.testing.assert_array_equal(indices.shuffle_index.astype(np.int64), expected)
    assert inputs == tokens[:len(inputs)]  # every stream token an input once, in order: none twice, none skipped


def test_runs_cut_one_stream_a_later_run_starting_inside_a_document():
    """Documents of 5, 3 and 4 tokens, seed 1234, a run of 2 samples of 3 then 3 samples of 4:
    the second run starts at stream token 6, inside the stream's second document."""
    lengths, ids = np.array([5, 3, 4], dtype=np.int32), np.arange(3)
    epochs, ((_, first), (t1, second)) = _build_runs(lengths, ids, [(2, 3), (3, 4)], 1234, 1)
    assert epochs == 2 and t1 == 6
    stream = _reference_stream(ids, 1234, 2)
    assert stream.tolist() == [2, 1, 2, 0, 1, 0]
    np.testing.assert_array_equal(first.document_index, [2, 1])
    np.testing.assert_array_equal(first.sample_index, [[0, 0], [0, 3], [1, 2]])
    # the second run's slice starts at the stream's second document, entered at its offset 2 (the
    # first run's last row); its rows are tokens 6, 10, 14 and 18 of the stream
    np.testing.assert_array_equal(second.document_index, stream[1:5])
    np.testing.assert_array_equal(second.sample_index, [[0, 2], [1, 3], [2, 3], [3, 2]])


def test_a_stream_too_short_for_the_run_is_refused():
    lengths = np.array([4, 4], dtype=np.int32)
    with pytest.raises(ConfigError, match="stream_epochs=1; expected at least the 2 epochs"):
        build_megatron_run_indices(lengths, np.arange(2), first_token=6, num_samples=2, seq_length=3, seed=1,
                                   stream_epochs=1)
    with pytest.raises(ConfigError, match="holds no tokens"):
        build_megatron_run_indices(np.zeros(2, dtype=np.int32), np.arange(2), first_token=0, num_samples=1,
                                   seq_length=3, seed=1, stream_epochs=1)
