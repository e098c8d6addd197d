"""Epoch planning and split strings, checked against megatron-core 0.19.2 itself."""

from __future__ import annotations

import logging
import types
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenloom.errors import ConfigError
from tokenloom.index.epochs import num_samples_in_index, plan_epochs
from tokenloom.index.split import (
    DocumentRange,
    document_ids,
    parse_split,
    split_bookends,
    split_document_ranges,
)

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _megatron():
    pytest.importorskip("megatron.core")
    warnings.filterwarnings("ignore", module="megatron")
    logging.getLogger("megatron").setLevel(logging.ERROR)
    from megatron.core.datasets import blended_megatron_dataset_config as config_module
    from megatron.core.datasets import gpt_dataset
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.utils import Split
    from megatron.core.tokenizers import MegatronTokenizer

    return config_module, gpt_dataset, BlendedMegatronDatasetBuilder, Split, MegatronTokenizer


# ---------------------------------------------------------------- split strings

weights = st.one_of(
    st.integers(0, 10_000).map(str),
    st.decimals(min_value=0, max_value=1000, places=3, allow_nan=False).map(lambda d: f"{d:f}"),
)
split_strings = st.lists(weights, min_size=1, max_size=3).filter(
    lambda ws: sum(float(w) for w in ws) > 0
).flatmap(lambda ws: st.sampled_from([",", ", ", " ", "/"]).map(lambda sep: sep.join(ws)))


@SETTINGS
@given(split=split_strings)
def test_parse_split_matches_megatron(split):
    config_module = _megatron()[0]
    assert list(parse_split(split)) == config_module.parse_and_normalize_split(split)
    assert list(split_bookends(split)) == config_module.convert_split_vector_to_split_matrix(
        config_module.parse_and_normalize_split(split)
    )


class _RecordingDataset:
    """Stands in for a MegatronDataset class: records the document ids megatron-core hands it."""

    num_documents = 0

    def __init__(self, low_level, path, indexed_indices, num_samples, split, config):
        self.indexed_indices = indexed_indices

    @staticmethod
    def build_low_level_dataset(path, config):
        return None

    @classmethod
    def numel_low_level_dataset(cls, low_level):
        return cls.num_documents


@SETTINGS
@given(split=split_strings, num_documents=st.one_of(st.integers(0, 50), st.integers(0, 3 * 10**6)))
def test_split_document_ranges_match_megatron_builder(split, num_documents):
    config_module, _gpt_dataset, Builder, _Split, _MegatronTokenizer = _megatron()
    _RecordingDataset.num_documents = num_documents
    config = types.SimpleNamespace(mock=True, fast_cache_load=False)  # all the builder reads
    builder = Builder(_RecordingDataset, [None, None, None], lambda: True, config)
    matrix = config_module.convert_split_vector_to_split_matrix(
        config_module.parse_and_normalize_split(split)
    )
    built = builder._build_megatron_dataset_splits("unused", matrix, [None, None, None])
    ours = split_document_ranges(split, num_documents)
    for theirs, mine in zip(built, ours):
        if theirs is None:
            assert mine is None
        else:
            ids = theirs.indexed_indices
            assert mine is not None and mine.num_documents == ids.shape[0]
            np.testing.assert_array_equal(document_ids(mine), ids)
            assert document_ids(mine).dtype == ids.dtype


def test_split_document_ranges_worked_example():
    assert split_document_ranges("969,30,1", 1000) == (
        DocumentRange(0, 969), DocumentRange(969, 999), DocumentRange(999, 1000)
    )
    # A missing weight means zero: no test split at all; rounding can leave a split empty.
    ranges = split_document_ranges("99,1", 7)
    assert ranges.test is None and ranges.valid == DocumentRange(7, 7)


@pytest.mark.parametrize("bad", ["", "abc", "1,2,3,4", "1..2,3", "-1,2", "0,0,0", "1;x"])
def test_parse_split_rejects_what_megatron_misreads(bad):
    with pytest.raises(ConfigError, match="split="):
        parse_split(bad)


def test_split_document_ranges_rejects_negative_count():
    with pytest.raises(ConfigError, match="num_documents=-1"):
        split_document_ranges("1,1,1", -1)


# ---------------------------------------------------------------- epoch plans


class _Lengths:
    def __init__(self, lengths):
        self.sequence_lengths = lengths


def _megatron_dataset(lengths, ids, num_samples, seq_length, seed, extra, valid, drop):
    _, gpt_dataset, _, Split, MegatronTokenizer = _megatron()
    config = gpt_dataset.GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length,
        tokenizer=MegatronTokenizer.from_pretrained(metadata_path={"library": "null-text"}, vocab_size=512),
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        add_extra_token_to_sequence=extra, drop_last_partial_validation_sequence=drop,
    )
    split = Split.valid if valid else Split.train
    return gpt_dataset.GPTDataset(_Lengths(lengths), None, ids, num_samples, split, config)


corpora = st.lists(st.integers(1, 300), min_size=1, max_size=40).map(lambda v: np.array(v, np.int32))


@SETTINGS
@given(lengths=corpora, seq_length=st.integers(1, 64), extra=st.booleans(), drop=st.booleans(),
       data=st.data())
def test_plan_epochs_matches_megatron(lengths, seq_length, extra, drop, data):
    ids = np.arange(data.draw(st.integers(0, lengths.shape[0] - 1)), lengths.shape[0], dtype=np.int32)
    tokens = int(lengths[ids].sum())
    num_samples = data.draw(st.one_of(st.none(), st.integers(0, 6 * tokens // seq_length + 3)))
    try:
        dataset = _megatron_dataset(lengths, ids, num_samples, seq_length, 1234, extra, True, drop)
    except AssertionError:
        with pytest.raises(ConfigError):
            plan_epochs(lengths, ids, num_samples=num_samples, seq_length=seq_length,
                        add_extra_token=extra, drop_last_partial=drop)
        return
    plan = plan_epochs(lengths, ids, num_samples=num_samples, seq_length=seq_length,
                       add_extra_token=extra, drop_last_partial=drop)
    assert plan.num_tokens_per_epoch == dataset._get_num_tokens_per_epoch()
    assert plan.num_epochs == dataset._get_num_epochs(plan.num_tokens_per_epoch)
    assert plan.num_samples_in_index == len(dataset)
    assert dataset.document_index.shape[0] == plan.num_epochs * ids.shape[0]


@SETTINGS
@given(lengths=corpora, seq_length=st.integers(1, 64), extra=st.booleans(), data=st.data())
def test_plan_epochs_properties(lengths, seq_length, extra, data):
    tokens = int(lengths.sum())
    num_samples = data.draw(st.integers(0, 8 * tokens // seq_length + 3))
    try:
        plan = plan_epochs(lengths, np.arange(lengths.shape[0]), num_samples=num_samples,
                           seq_length=seq_length, add_extra_token=extra)
    except ConfigError:
        return  # megatron-core's own final-epoch assertion; covered by the differential test
    needed = num_samples * seq_length + int(extra)
    # The fewest epochs whose tokens hold the request, and the index holds at least the request.
    assert plan.num_tokens_total >= needed
    assert plan.num_epochs == 1 or (plan.num_epochs - 1) * tokens < needed
    assert plan.num_samples_in_index >= num_samples
    if plan.separate_final_epoch:
        assert plan.num_epochs > 1
        assert plan.num_samples_from_final_epoch < 0.8 * plan.num_samples_per_epoch


def test_plan_epochs_none_means_one_epoch():
    plan = plan_epochs(np.array([5, 3], np.int32), np.arange(2), num_samples=None, seq_length=3)
    assert (plan.num_epochs, plan.num_samples_in_index, plan.separate_final_epoch) == (1, 2, False)


def test_plan_epochs_worked_example():
    # 8 tokens an epoch, 7 samples of 3 (+1) need 22 tokens: 3 epochs; the third contributes
    # 7 - (16 - 1) // 3 = 2 samples, not below int(0.8 * 2) = 1, so it is shuffled with the rest.
    plan = plan_epochs(np.array([5, 3], np.int32), np.arange(2), num_samples=7, seq_length=3)
    assert (plan.num_epochs, plan.num_samples_sans_final_epoch, plan.num_samples_from_final_epoch,
            plan.separate_final_epoch, plan.num_samples_in_index) == (3, 5, 2, False, 7)
    plan = plan_epochs(np.array([50, 30], np.int32), np.arange(2), num_samples=30, seq_length=3)
    assert (plan.num_epochs, plan.separate_final_epoch) == (2, True)


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_samples=4, seq_length=0), "seq_length=0"),
    (dict(num_samples=-1, seq_length=4), "num_samples=-1"),
    (dict(num_samples=1.5, seq_length=4), "num_samples=1.5"),
])
def test_plan_epochs_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        plan_epochs(np.array([5, 3], np.int32), np.arange(2), **kwargs)


def test_plan_epochs_rejects_empty_epoch():
    # megatron-core would loop forever counting epochs of zero tokens
    with pytest.raises(ConfigError, match="hold no tokens"):
        plan_epochs(np.array([0, 0], np.int32), np.arange(2), num_samples=3, seq_length=4)
    # ... but builds one empty epoch when no count is asked for, as megatron-core does
    plan = plan_epochs(np.array([0, 0], np.int32), np.arange(2), num_samples=None, seq_length=4)
    assert (plan.num_epochs, plan.num_samples_in_index) == (1, 0)


def test_float32_sample_count_quirk_matches_megatron():
    """Keeping the partial sample, megatron-core counts samples in float32: one document of
    2**30 + 2 tokens at seq_length 1024 gives 2**20 samples, not the exact 2**20 + 1."""
    lengths = np.array([2**30 + 2], np.int32)
    assert num_samples_in_index(2**30 + 2, seq_length=1024, add_extra_token=True,
                                drop_last_partial=False) == 2**20
    plan = plan_epochs(lengths, np.arange(1), num_samples=None, seq_length=1024,
                       drop_last_partial=False)
    dataset = _megatron_dataset(lengths, np.arange(1, dtype=np.int32), None, 1024, 7, True, True, False)
    assert len(dataset) == plan.num_samples_in_index == 2**20
