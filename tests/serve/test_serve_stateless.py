"""The stateless source: batched reads equal the index's own per-sample read."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serve_fixtures import write_corpus
from tokenloom.serve import BatchGeometry, RankLoader, Topology
from tokenloom.source import SampleSource, StatelessBlendSource, StoreBlendSource


@pytest.fixture(scope="module")
def prefixes(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("stateless"), 3, seed=51, num_documents=90)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seq_length=st.integers(1, 64), num_samples=st.integers(1, 300), seed=st.integers(0, 2**40),
       extra=st.booleans(), split=st.sampled_from(["1,0,0", "3,1,0"]), data=st.data())
def test_batched_read_equals_per_sample_read(prefixes, seq_length, num_samples, seed, extra, split, data):
    source = StatelessBlendSource.from_prefixes(prefixes, [0.2, 0.5, 0.3], num_samples=num_samples,
                                                seq_length=seq_length, seed=seed, add_extra_token=extra, split=split)
    positions = np.array(data.draw(st.lists(st.integers(0, num_samples - 1), min_size=1, max_size=16)))
    dataset_ids, sample_ids = source.locate(positions)
    rows = source.read_samples(dataset_ids, sample_ids)
    source.backend = "numpy"
    np.testing.assert_array_equal(source.read_samples(dataset_ids, sample_ids), rows)
    for k in range(positions.shape[0]):
        d = int(dataset_ids[k])
        expected = source.readers[d].indices.read(source.readers[d].store, int(sample_ids[k]))
        np.testing.assert_array_equal(rows[k], expected)


def test_sources_satisfy_the_protocol_and_serve_through_the_loader(prefixes):
    stateless = StatelessBlendSource.from_prefixes(prefixes, [0.2, 0.5, 0.3], num_samples=200, seq_length=8, seed=5)
    exact = StoreBlendSource.from_prefixes(prefixes, [0.2, 0.5, 0.3], num_samples=200, seq_length=8, seed=5)
    assert isinstance(stateless, SampleSource) and isinstance(exact, SampleSource)
    geometry = BatchGeometry(global_batch_size=20, micro_batch_size=5, dp=2)
    batches = [list(RankLoader(stateless, geometry, topology=Topology(dp=2), rank=r)) for r in range(2)]
    served = np.concatenate([b["dataset_id"] for pair in zip(*batches) for b in pair])
    assert served.shape[0] == 200
    np.testing.assert_array_equal(np.bincount(served, minlength=3), stateless.blend.counts)
