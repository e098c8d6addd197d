"""Blend configuration against megatron-core's BlendedMegatronDatasetBuilder, end to end."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenloom.errors import ConfigError
from tokenloom.index.blend_spec import BlendSpec, megatron_sizes, plan_split_blends
from tokenloom.index.split import split_document_ranges

builder_module = pytest.importorskip("megatron.core.datasets.blended_megatron_dataset_builder")
from megatron.core.datasets.blended_dataset import BlendedDataset  # noqa: E402
from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig  # noqa: E402
from megatron.core.datasets.megatron_dataset import MegatronDataset  # noqa: E402
from megatron.core.datasets.utils import get_blend_from_list, normalize  # noqa: E402

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])

#: documents in each fake token store, by prefix
DOCUMENTS = {f"data/set{i}": 50 + 37 * i for i in range(8)}


class FakeMidLevelDataset(MegatronDataset):
    """A mid-level dataset whose samples are its documents, or ``num_samples`` when asked for."""

    @staticmethod
    def numel_low_level_dataset(low_level_dataset) -> int:
        return low_level_dataset

    @staticmethod
    def build_low_level_dataset(dataset_path, config):
        return DOCUMENTS[dataset_path]

    def __len__(self) -> int:
        return len(self.indices) if self.num_samples is None else self.num_samples

    def __getitem__(self, idx):
        return {}


def megatron_build(sizes, *, blend=None, split=None, blend_per_split=None):
    config = BlendedMegatronDatasetConfig(
        random_seed=1, sequence_length=8, blend=blend, split=split, blend_per_split=blend_per_split,
        tokenizer=None,
    )
    return builder_module.BlendedMegatronDatasetBuilder(
        FakeMidLevelDataset, sizes, lambda: True, config
    ).build()


def split_lengths(prefixes, split):
    """Samples per dataset per split of the fake stores: the documents megatron gives the split."""
    ranges = [split_document_ranges(split, DOCUMENTS[p]) for p in prefixes]
    return [[0 if r[i] is None else r[i].num_documents for r in ranges] for i in range(3)]


def assert_matches(ours, theirs):
    assert (ours is None) == (theirs is None)
    if ours is None:
        return
    dataset_ids, sample_ids = ours.build()
    if isinstance(theirs, BlendedDataset):
        assert np.array_equal(dataset_ids, theirs.dataset_index)
        assert np.array_equal(sample_ids, theirs.dataset_sample_index)
        assert ours.size == len(theirs)
        if ours.exhaustive_sizes is None and ours.weights is not None and theirs.size is not None:
            assert list(ours.weights) == list(theirs.weights)
        assert list(ours.dataset_num_samples) == [len(d) for d in theirs.datasets]
    else:  # a lone dataset, no blend: position i is sample i
        assert ours.size == len(theirs)
        assert np.array_equal(sample_ids, np.arange(len(theirs))) and not dataset_ids.any()


def compare_with_builder(ours, build) -> None:
    """Each split equal to megatron's, or a ConfigError where megatron overdraws its surplus."""
    try:
        theirs = build()
    except IndexError:  # megatron's greedy overdraws its 0.5% surplus (small splits)
        with pytest.raises(ConfigError, match="more than the"):
            for plan in ours:
                if plan is not None:
                    plan.build()
        return
    for mine, megatron_split in zip(ours, theirs):
        assert_matches(mine, megatron_split)


weights_strategy = st.lists(
    st.one_of(st.floats(1e-3, 1.0), st.integers(1, 100).map(float), st.sampled_from([1e-7, 0.5])),
    min_size=1, max_size=6,
)
split_strategy = st.sampled_from(["98,2,0", "969,30,1", "1,1,1", "100,0,0", "8,2", "0.7,0.2,0.1", "3,0,1"])
sizes_strategy = st.lists(st.integers(0, 3000), min_size=3, max_size=3)


@SETTINGS
@given(weights=weights_strategy, split=split_strategy, sizes=sizes_strategy)
def test_weighted_blend_matches_the_builder(weights, split, sizes):
    prefixes = list(DOCUMENTS)[: len(weights)]
    ours = plan_split_blends(num_samples=sizes, blend=BlendSpec(prefixes=prefixes, weights=weights), split=split)
    compare_with_builder(ours, lambda: megatron_build(sizes, blend=(prefixes, weights), split=split))


def test_targets_use_weights_normalised_once():
    # normalising twice moves 1425 * 18/90 across an integer: megatron sizes with one normalisation
    weights = [57.0, 18.0, 15.0]
    prefixes = list(DOCUMENTS)[:3]
    (train, _, _) = plan_split_blends(num_samples=[1425, 0, 0], blend=BlendSpec(prefixes=prefixes, weights=weights),
                                      split="1,0,0")
    assert train.size == 903 + 285 + 238
    (theirs, _, _) = megatron_build([1425, 0, 0], blend=(prefixes, weights), split="1,0,0")
    assert_matches(train, theirs)


def test_megatron_overdraw_is_reported():
    # valid split of 1 sample: targets ceil(w) = 1 each, blended length 4, dataset 0 drawn 3 times
    spec = BlendSpec(prefixes=("a", "b", "c", "d"), weights=(1.0, 0.25, 0.0625, 0.0625))
    with pytest.raises(IndexError):
        megatron_build([0, 1, 0], blend=(list(DOCUMENTS)[:4], list(spec.weights)), split="98,2,0")
    (_, valid, _) = plan_split_blends(num_samples=[0, 1, 0], blend=spec, split="98,2,0")
    assert valid.size == 4 and valid.dataset_num_samples == (2, 2, 2, 2)
    with pytest.raises(ConfigError, match="draws 3 samples from dataset 'a', more than the 2"):
        valid.build()


@SETTINGS
@given(num_datasets=st.integers(1, 6), split=split_strategy,
       sizes=st.lists(st.one_of(st.none(), st.integers(0, 400)), min_size=3, max_size=3))
def test_unweighted_blend_matches_the_builder(num_datasets, split, sizes):
    prefixes = list(DOCUMENTS)[:num_datasets]
    lengths = split_lengths(prefixes, split)
    spec = BlendSpec(prefixes=prefixes)
    try:
        theirs = megatron_build(sizes, blend=(prefixes, None), split=split)
    except AssertionError:  # megatron-core cannot blend a dataset with no samples in a split
        assert num_datasets > 1 and any(0 in per_split for per_split in lengths)
        with pytest.raises(ConfigError, match="no samples in split"):
            plan_split_blends(num_samples=sizes, blend=spec, split=split, dataset_num_samples=lengths)
        return
    ours = plan_split_blends(num_samples=sizes, blend=spec, split=split, dataset_num_samples=lengths)
    for mine, megatron_split in zip(ours, theirs):
        assert_matches(mine, megatron_split)


@SETTINGS
@given(weights=st.lists(st.one_of(st.none(), weights_strategy), min_size=3, max_size=3).filter(any),
       sizes=sizes_strategy)
def test_blend_per_split_matches_the_builder(weights, sizes):
    per_split, specs, lengths = [], [], []
    for i, w in enumerate(weights):
        if w is None:
            per_split.append(None)
            specs.append(None)
            lengths.append(None)
            continue
        prefixes = list(DOCUMENTS)[i : i + len(w)]
        per_split.append((prefixes, w))
        specs.append(BlendSpec(prefixes=prefixes, weights=w))
        lengths.append([DOCUMENTS[p] for p in prefixes])
    ours = plan_split_blends(num_samples=sizes, blend_per_split=specs, dataset_num_samples=lengths)
    compare_with_builder(ours, lambda: megatron_build(sizes, blend_per_split=per_split))


@SETTINGS
@given(weights=weights_strategy, num_samples=st.integers(0, 10**9), surplus=st.sampled_from([0.0, 0.005, 0.1]))
def test_megatron_sizes_match_megatron(weights, num_samples, surplus):
    normalised = normalize(weights)
    theirs_target = builder_module._get_size_per_split_per_dataset(normalised, [num_samples])
    theirs_buffer = builder_module._get_size_per_split_per_dataset(normalised, [num_samples], surplus=surplus)
    ours = megatron_sizes(weights, num_samples, surplus=surplus)
    assert list(ours.targets) == [t[0] for t in theirs_target]
    assert list(ours.buffers) == [b[0] for b in theirs_buffer]
    assert ours.blended_size == sum(ours.targets)
    assert num_samples <= ours.blended_size <= num_samples + len(weights)


@pytest.mark.parametrize(
    "items", [["30", "a", "70", "b"], ["a", "b", "c"], ["a", "b"], ["0.5", "x"], ["1e-3", "p", "2", "q"]]
)
def test_megatron_blend_lists(items):
    theirs = get_blend_from_list(items)
    ours = BlendSpec.from_megatron_list(items)
    assert list(ours.prefixes) == list(theirs[0])
    assert (ours.weights is None) == (theirs[1] is None)
    if ours.weights is not None:
        assert list(ours.weights) == list(theirs[1])


def test_tokenloom_mode_has_exact_sizes_and_counts():
    spec = BlendSpec(prefixes=("a", "b", "c"), weights=(0.5, 0.3, 0.2))
    plans = plan_split_blends(num_samples=[1001, 17, 0], blend=spec, split="90,5,5", mode="tokenloom")
    for plan, n in zip(plans, [1001, 17, 0]):
        dataset_ids, _sample_ids = plan.build()
        assert plan.size == n == len(dataset_ids)
        assert sum(plan.dataset_num_samples) == n
        assert np.array_equal(np.bincount(dataset_ids, minlength=3), plan.dataset_num_samples)
    exact = plan_split_blends(num_samples=[1001, 17, 0], blend=spec, split="90,5,5")
    assert exact[0].size == sum(math.ceil(1001 * w) for w in (0.5, 0.3, 0.2)) > 1001


def test_token_weights_become_token_shares():
    # dataset a's samples hold 4 tokens each, b's hold 1: equal token shares need 1 a per 4 b
    spec = BlendSpec(prefixes=("a", "b"), weights=(1.0, 1.0), weight_unit="token")
    weights = spec.sample_weights(dataset_num_samples=[100, 400], dataset_num_tokens=[400, 400])
    assert weights.tolist() == [0.2, 0.8]
    (plan, _, _) = plan_split_blends(num_samples=[1000, None, None], blend_per_split=[spec, None, None],
                                     mode="tokenloom", dataset_num_samples=[[100, 400], None, None],
                                     dataset_num_tokens=[[400, 400], None, None])
    counts = np.bincount(plan.build()[0], minlength=2)
    assert counts[0] * 4 == counts[1] * 1
    with pytest.raises(ConfigError, match="weight_unit='token' needs"):
        spec.sample_weights()
    with pytest.raises(ConfigError, match="samples only"):
        plan_split_blends(num_samples=[10, None, None], blend_per_split=[spec, None, None])


def test_seeded_tokenloom_plan_keeps_windows():
    spec = BlendSpec(prefixes=("a", "b"), weights=(3.0, 1.0))
    (plan, _, _) = plan_split_blends(num_samples=[256, 0, 0], blend=spec, split="1,0,0", mode="tokenloom",
                                     seed=7, window=64)
    dataset_ids, _ = plan.build()
    assert [int(np.sum(dataset_ids[k : k + 64] == 1)) for k in range(0, 256, 64)] == [16, 16, 16, 16]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(prefixes=("a", "b"), weights=(1.0,)), "1 weights for 2 prefixes"),
        (dict(prefixes=("a", "b"), weights=(1.0, float("nan"))), "'b'"),
        (dict(prefixes=("a",), weights=(-1.0,)), "'a'"),
        (dict(prefixes=("a", "b"), weights=(0.0, 0.0)), "zero"),
        (dict(prefixes=()), "non-empty"),
        (dict(prefixes="ab"), "non-empty"),
        (dict(prefixes=("a",), weight_unit="bytes"), "weight_unit"),
    ],
)
def test_bad_specs(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        BlendSpec(**kwargs)


def test_bad_plans():
    spec = BlendSpec(prefixes=("a", "b"), weights=(1.0, 2.0))
    with pytest.raises(ConfigError, match="split string"):
        plan_split_blends(num_samples=[1, 1, 1], blend=spec)
    with pytest.raises(ConfigError, match="exactly one"):
        plan_split_blends(num_samples=[1, 1, 1], blend=spec, blend_per_split=[spec, None, None], split="1")
    with pytest.raises(ConfigError, match="no num_samples"):
        plan_split_blends(num_samples=[None, 1, 1], blend=spec, split="1,1,1")
    with pytest.raises(ConfigError, match="mode"):
        plan_split_blends(num_samples=[1, 1, 1], blend=spec, split="1", mode="fast")
    with pytest.raises(ConfigError, match="dataset_num_samples"):
        plan_split_blends(num_samples=[5, 1, 1], blend=BlendSpec(prefixes=("a", "b")), split="1")
    with pytest.raises(ConfigError, match="positive weights"):
        plan_split_blends(num_samples=[5, 1, 1], blend=BlendSpec(prefixes=("a", "b"), weights=(1, 0)), split="1")
