"""Serving from a real ``tokenloom.build`` result: the same stream as the in-memory source."""

from __future__ import annotations

import numpy as np
import pytest

import tokenloom
from serve_fixtures import write_corpus
from tokenloom.index.blend_spec import BlendSpec
from tokenloom.serve import BatchGeometry, Topology
from tokenloom.serve.loader import read_batch
from tokenloom.serve.simulate import simulate_job
from tokenloom.serve.stream import SampleStream
from tokenloom.source import SampleSource, StoreBlendSource

build_module = pytest.importorskip("tokenloom.builder")


def test_exact_build_split_serves_the_in_memory_stream(tmp_path):
    prefixes = write_corpus(tmp_path, 2, seed=5)
    config = build_module.BuildConfig(seq_length=16, blend=BlendSpec(prefixes=tuple(prefixes), weights=(0.6, 0.4)),
                                      split="1,0,0", train_samples=100, valid_samples=0, test_samples=0, seed=7,
                                      cache_dir=str(tmp_path / "cache"))
    train = tokenloom.build(config).split("train")
    assert isinstance(train, SampleSource)
    mine = StoreBlendSource.from_prefixes(prefixes, [0.6, 0.4], num_samples=100, seq_length=16, seed=7)
    assert train.num_samples == mine.num_samples
    ours, theirs = (read_batch(SampleStream(s), np.arange(s.num_samples)) for s in (mine, train))
    for name in ours:
        np.testing.assert_array_equal(theirs[name], ours[name], err_msg=name)
    report = simulate_job(train, BatchGeometry(global_batch_size=8, micro_batch_size=2, dp=2),
                          Topology(dp=2, tp=2, pp=2), num_steps=5)
    assert report.state["consumed_samples"] == 40 and report.state["build_key"] == train.build_key
