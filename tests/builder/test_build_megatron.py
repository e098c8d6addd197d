"""Differential tests against megatron-core itself: on hypothesis-generated configs, the cache a
tokenloom build writes with ``megatron_cache_dir`` is loaded by megatron-core's
BlendedMegatronDatasetBuilder as cache hits (it builds nothing), and the arrays it loads equal
those it builds itself from scratch, which equal tokenloom's."""

from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from build_fixtures import NULL_TOKENIZER, write_store

pytest.importorskip("megatron.core")
import tokenloom
from megatron_fixtures import megatron_build_without_building, megatron_datasets

SPLIT_NAMES = ("train", "valid", "test")


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron_stores")
    return [write_store(str(root / f"s{i}"), 300 + 150 * i, seed=10 + i, max_length=200) for i in range(3)]


@st.composite
def configs(draw, prefixes):
    count = draw(st.integers(1, 3))
    chosen = draw(st.permutations(prefixes))[:count]
    weighted = draw(st.booleans())
    weights = [float(draw(st.integers(1, 9))) for _ in chosen] if weighted else None
    samples = [draw(st.integers(1, 3000)), draw(st.integers(1, 300)), draw(st.integers(1, 100))]
    if not weighted and draw(st.booleans()):
        samples[draw(st.integers(0, 2))] = None
    config = {
        "seq_length": draw(st.sampled_from([16, 33, 64])), "seed": draw(st.integers(0, 2**31)),
        "add_extra_token": draw(st.booleans()),
        "drop_last_partial_validation_sequence": draw(st.booleans()),
        "train_samples": samples[0], "valid_samples": samples[1], "test_samples": samples[2],
        "megatron_tokenizer": dict(NULL_TOKENIZER), "rng_workers": 0,
    }
    blend = {"prefixes": list(chosen), "weights": weights}
    if draw(st.booleans()):
        config["blend"] = blend
        config["split"] = draw(st.sampled_from(["90,8,2", "98,2", "1", "80,10,10", "70,30,0"]))
    else:
        present = draw(st.lists(st.booleans(), min_size=3, max_size=3).filter(any))
        config["blend_per_split"] = [blend if p else None for p in present]
    return config


def _arrays_of(dataset) -> list[np.ndarray]:
    """megatron-core's arrays of one split, blended or not, in a fixed order."""
    if dataset is None:
        return []
    if hasattr(dataset, "dataset_index"):
        out = [np.asarray(dataset.dataset_index), np.asarray(dataset.dataset_sample_index)]
        for part in dataset.datasets:
            out += _arrays_of(part)
        return out
    return [np.asarray(dataset.document_index), np.asarray(dataset.sample_index),
            np.asarray(dataset.shuffle_index)]


def _our_arrays(split) -> list[np.ndarray]:
    out = []
    if split.dataset_index is not None:
        out += [np.asarray(split.dataset_index), np.asarray(split.dataset_sample_index)]
    for d in split.readers:
        out += [np.asarray(d.indices.document_index), np.asarray(d.indices.sample_index),
                np.asarray(d.indices.shuffle_index)]
    return out


def _assert_same(left: list[np.ndarray], right: list[np.ndarray]) -> None:
    assert len(left) == len(right)
    for a, b in zip(left, right):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert np.array_equal(a, b)


@pytest.mark.timeout(600)
def test_megatron_core_loads_tokenloom_caches_as_hits(stores):
    @settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(configs(stores))
    def check(config):
        work = tempfile.mkdtemp(prefix="tl-megatron-")
        try:
            ours = tokenloom.build(dict(config, cache_dir=os.path.join(work, "cache"),
                                        megatron_cache_dir=os.path.join(work, "megatron")))
            loaded = megatron_build_without_building(config, os.path.join(work, "megatron"))
            fresh = megatron_datasets(config, os.path.join(work, "fresh"))
            for name, hit, built in zip(SPLIT_NAMES, loaded, fresh):
                assert (hit is None) == (built is None) == (name not in ours.splits)
                if built is None:
                    continue
                _assert_same(_arrays_of(hit), _arrays_of(built))
                _assert_same(_our_arrays(ours.split(name)), _arrays_of(built))
                split = ours.split(name)
                assert len(built) == split.num_samples
                for i in {0, len(built) // 2, len(built) - 1}:
                    text = built[i]["tokens"].numpy()
                    mine = split[i]
                    if config["add_extra_token"]:
                        mine = mine[:-1]
                    assert np.array_equal(text, np.where(mine == -1, 0, mine))
            # megatron-core's own cache and ours name the same files
            assert sorted(os.listdir(os.path.join(work, "fresh"))) == \
                sorted(os.listdir(os.path.join(work, "megatron")))
        finally:
            shutil.rmtree(work, ignore_errors=True)

    check()
