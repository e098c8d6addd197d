"""Weight changes at scale (issue 41): a change takes over the work of the changes before it, a
resume loads the stored segments without rebuilding their blends, and the state packs its arrays.
Every fast path is checked against the plain implementation it replaced
(``weight_changes_reference.py``) on random series of changes, on a mixture schedule and on a
single blend, in both modes: the same segments, the same refusals with the same words, the same
samples at every position, the same counts."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tokenloom
import weight_changes_reference as reference
from serve_fixtures import write_corpus
from tokenloom.errors import ConfigError
from tokenloom.index.blend import Blend
from tokenloom.serve import weight_changes
from tokenloom.serve.weight_changes import BlendSegment, WeightChanges, pack_array, unpack_array

SEQ = 16


@pytest.fixture(scope="module", params=["schedule-stateless", "schedule-exact", "single-stateless", "single-exact"])
def source(request, tmp_path_factory):
    """The train split of a build: a two-phase schedule with headroom over four stores (the
    second phase leaves the third out), or a single blend of three."""
    kind, mode = request.param.split("-")
    root = tmp_path_factory.mktemp(request.param)
    s0, s1, s2, s3 = write_corpus(root, 4, seed=7, num_documents=80)
    config = {"split": "100,0,0", "seq_length": SEQ, "valid_samples": 0, "test_samples": 0, "seed": 5, "mode": mode,
              "cache_dir": str(root / "cache"), "rng_workers": 0, "timeout_s": 60.0}
    if kind == "schedule":
        config.update(phases=[{"blend": ["0.4", s0, "0.3", s1, "0.3", s2], "until": {"steps": 40}},
                              {"blend": ["0.3", s0, "0.3", s1, "0.4", s3], "until": {"steps": 70}}],
                      global_batch_size=16, headroom=0.6)
    else:
        config.update(blend=["0.5", s0, "0.3", s1, "0.2", s2], train_samples=1100)
    return tokenloom.build(config).split("train")


def _series(draw_changes, source, declared_at):
    """(position, weights) of a series of changes: mostly forward, sometimes back over the last one
    (it is replaced); mostly the declared weights scaled a little, sometimes far (refused, or a
    single blend's stream ends early)."""
    position, out = 0, []
    for step, factors, back, far in draw_changes:
        position = max(0, position - 3 * step) if back else position + step
        if position >= source.num_samples:
            break
        factors = np.asarray(factors[: len(source.datasets)])
        weights = factors ** 6 if far else np.asarray(declared_at(position)) * factors
        out.append((position, weights.tolist()))
    return out


changes_strategy = st.lists(st.tuples(st.integers(1, 60),
                                      st.lists(st.sampled_from([0.0, 0.9, 0.95, 1.0, 1.05, 1.1, 2.0]), min_size=4,
                                               max_size=4),
                                      st.integers(0, 5).map(lambda k: k == 0), st.integers(0, 9).map(lambda k: k == 0)),
                            min_size=8, max_size=60)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(changes=changes_strategy)
def test_a_series_of_changes_matches_the_plain_implementation(source, changes):
    fast, slow = WeightChanges(source), reference.WeightChanges(source)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a blend with a weight too small for a sample warns
        for position, weights in _series(changes, source, slow.declared_at):
            if sum(weights) == 0 or position > min(fast.num_samples, slow.num_samples):
                continue
            try:
                expected = slow.changed(position, weights)
            except ConfigError as exc:
                with pytest.raises(ConfigError) as refused:
                    fast.changed(position, weights)
                assert str(refused.value) == str(exc)
                continue
            fast = fast.changed(position, weights)
            slow = expected
            assert [(s.start, s.weights, s.dataset_offsets) for s in fast.segments] == \
                [(s.start, s.weights, s.dataset_offsets) for s in slow.segments]
            assert fast.num_samples == slow.num_samples
        # a resume: the same segments, read back from the state, made in one go
        stored = json.loads(json.dumps([s.to_dict() for s in fast.segments]))
        resumed = WeightChanges(source, tuple(BlendSegment.from_dict(s) for s in stored))
        positions = np.arange(slow.num_samples, dtype=np.int64)
        want = slow.locate(positions)
        for made in (fast, resumed):
            assert made.num_samples == slow.num_samples
            got = made.locate(positions)
            assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
            assert made.source_regions() == slow.source_regions()
            for _, _, k in made.source_regions():
                if k is not None:
                    assert np.array_equal(made.shift(k), slow.shift(k))
            for position in np.unique(np.linspace(0, slow.num_samples, 23).astype(np.int64)).tolist():
                assert np.array_equal(made.reached(position), slow.reached(position)), position
                assert made.target_at(min(position, slow.num_samples - 1)) == \
                    slow.target_at(min(position, slow.num_samples - 1))


@settings(max_examples=60, deadline=None)
@given(weights=st.lists(st.floats(0.0, 10.0), min_size=1, max_size=40).filter(lambda w: sum(w) > 0),
       size=st.integers(0, 3000), data=st.data())
def test_a_prefix_of_a_segments_blend_counts_the_same_looked_up_or_in_closed_form(weights, size, data):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        blend = Blend(np.asarray(weights), size)
    length = data.draw(st.integers(0, size))
    located, _ = blend.lookup(np.arange(length, dtype=np.int64))
    plain = np.bincount(located, minlength=len(weights))
    assert np.array_equal(weight_changes._prefix_counts(blend, length), plain)
    closed = blend.samples_before(np.arange(len(weights)), np.full(len(weights), length))
    assert np.array_equal(closed, plain)
    # a segment's counts without its tree are its blend's
    entry = weight_changes._Segment(BlendSegment(start=0, weights=tuple(weights), dataset_offsets=(0,) * len(weights)),
                                    size)
    assert np.array_equal(WeightChanges._counts(None, entry), blend.counts)


@settings(max_examples=100, deadline=None)
@given(floats=st.lists(st.floats(allow_nan=False), max_size=50), ints=st.lists(st.integers(-2**63, 2**63 - 1),
                                                                               max_size=50))
def test_packed_arrays_read_back_bit_for_bit(floats, ints):
    values = np.asarray(floats, dtype=np.float64)
    back = unpack_array(json.loads(json.dumps(pack_array(values, "<f8"))), "<f8")
    assert back.tobytes() == values.tobytes()
    assert unpack_array(pack_array(ints, "<i8"), "<i8").tolist() == ints


def test_a_schema_2_segment_reads_and_a_foreign_or_tampered_one_is_refused(source):
    weights = [0.2, 0.5, 0.3, 0.0][: len(source.datasets)]
    changes = WeightChanges(source).changed(32, weights).changed(96, weights[::-1])
    segment = changes.segments[-1]
    plain = {"start": segment.start, "weights": list(segment.weights), "dataset_offsets": list(segment.dataset_offsets)}
    assert BlendSegment.from_dict(plain) == segment == BlendSegment.from_dict(segment.to_dict())
    with pytest.raises(ConfigError, match=r"a blend segment packed as 'gzip'; this tokenloom reads "
                                          r"'le-shuffled-zlib-base64' \(serving-state schema 3\)"):
        BlendSegment.from_dict({**segment.to_dict(), "packed": "gzip"})
    with pytest.raises(ConfigError, match=r"malformed blend segment"):
        BlendSegment.from_dict({"start": 3})
    first, second = changes.segments
    moved = list(second.dataset_offsets)
    moved[0], moved[1] = moved[0] + 1, moved[1] - 1  # the same sum: found where the first blend is read
    tampered = BlendSegment(start=second.start, weights=second.weights, dataset_offsets=tuple(moved))
    resumed = WeightChanges(source, (first, tampered))
    with pytest.raises(ConfigError, match=r"the blend segment at position 96 continues dataset 0 from sample"):
        resumed.locate(np.arange(32, 40, dtype=np.int64))
    short = BlendSegment(start=second.start, weights=second.weights,
                         dataset_offsets=(second.dataset_offsets[0] - 1, *second.dataset_offsets[1:]))
    with pytest.raises(ConfigError, match=r"at position 96 continues the datasets from samples summing to 95"):
        WeightChanges(source, (first, short))
