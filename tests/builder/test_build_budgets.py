"""Token and epoch budgets instead of shares: the exact sample counts they ask for, in both modes
and in megatron-core itself, and the audit's report of tokens served against each budget."""

from __future__ import annotations

import math

import numpy as np
import pytest

import tokenloom
from build_fixtures import cache_files, make_stores
from tokenloom.builder.config import as_build_config
from tokenloom.errors import ConfigError, FormatError
from tokenloom.index.split import split_document_ranges
from tokenloom.io import IndexedDataset
from tokenloom.serve import BatchGeometry, MixtureAudit, RankLoader, summarize_audit

SEQ = 64


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    return make_stores(tmp_path_factory.mktemp("budget_stores"))


def _config(stores, cache, **blend) -> dict:
    return {"blend": {"prefixes": list(stores), **blend}, "split": "90,8,2", "seq_length": SEQ, "valid_samples": 60,
            "test_samples": 20, "seed": 5, "cache_dir": str(cache), "rng_workers": 0}


def _counts(split) -> list[int]:
    dataset_ids, _ = split.locate(np.arange(split.num_samples))
    return np.bincount(dataset_ids, minlength=len(split.readers)).tolist()


@pytest.mark.parametrize("mode", ["exact", "stateless"])
def test_token_budgets_give_each_dataset_exactly_its_samples(stores, tmp_path, mode):
    budgets = [SEQ * 700 + 63, SEQ * 250, SEQ * 51 + 1]  # not all whole samples: the remainder is not served
    config = {**_config(stores, tmp_path / "cache", tokens=budgets), "mode": mode}
    built = as_build_config(config)
    assert built.train_samples == 700 + 250 + 51
    assert built.blend.weights == (700.0, 250.0, 51.0) and built.blend.budget_tokens == tuple(budgets)
    assert as_build_config(built.to_dict()) == built  # the resolved config reads back as itself
    result = tokenloom.build(config)
    train = result.split("train")
    assert _counts(train) == [700, 250, 51]
    assert [d.budget_tokens for d in train.datasets] == budgets
    assert all(d.budget_tokens is None for d in result.split("valid").datasets)  # budgets count training data
    # the same arrays as the weights the budgets stand for
    plain = tokenloom.build({**_config(stores, tmp_path / "plain", weights=[700, 250, 51]), "mode": mode,
                             "train_samples": 1001})
    if mode == "exact":
        assert cache_files(tmp_path / "cache") == cache_files(tmp_path / "plain")
    for name in ("train", "valid", "test"):
        ours, theirs = result.split(name), plain.split(name)
        first = np.arange(20)
        assert np.array_equal(ours.read_samples(*ours.locate(first)), theirs.read_samples(*theirs.locate(first)))


def test_megatron_core_blends_budget_counts_exactly(stores, tmp_path):
    pytest.importorskip("megatron.core")
    from build_fixtures import NULL_TOKENIZER
    from megatron_fixtures import megatron_datasets

    config = {**_config(stores, tmp_path / "unused", tokens=[SEQ * 333, SEQ * 517, SEQ * 90]),
              "megatron_tokenizer": dict(NULL_TOKENIZER)}
    built = as_build_config(config)
    weighted = {**config, "blend": {"prefixes": list(stores), "weights": list(built.blend.weights)},
                "train_samples": built.train_samples}
    train, _, _ = megatron_datasets(weighted, tmp_path / "megatron")
    assert np.bincount(train.dataset_index, minlength=3).tolist() == [333, 517, 90]


def test_epoch_budgets_count_megatron_core_epochs_of_the_train_documents(stores, tmp_path):
    epochs = [1.0, 0.25, 2.5]
    config = as_build_config(_config(stores, tmp_path / "cache", epochs=epochs))
    # constructing the config reads no store: the counts wait for the build's resolve step
    assert not config.resolved and config.blend.weights is None and config.train_samples is None
    assert config.blend.budget_epochs == tuple(epochs)
    built = config.resolve()
    assert built.resolved and built.resolve() is built
    expected = []
    for prefix, e in zip(stores, epochs):
        store = IndexedDataset(prefix)
        train = split_document_ranges("90,8,2", store.num_sequences).train
        tokens = int(store.sequence_lengths[train.begin:train.end].sum())
        expected.append(math.floor(e * ((tokens - 1) // SEQ)))  # add_extra_token: one token fewer per epoch
    assert list(built.blend.weights) == expected and built.train_samples == sum(expected)
    assert built.blend.budget_tokens == tuple(c * SEQ for c in expected)
    assert _counts(tokenloom.build(_config(stores, tmp_path / "cache", epochs=epochs)).split("train")) == expected


def test_budgets_that_cannot_be_met_are_refused_by_name(stores, tmp_path):
    with pytest.raises(ConfigError, match=f"less than one sample of seq_length={SEQ}"):
        as_build_config(_config(stores, tmp_path, tokens=[SEQ * 10, SEQ - 1, SEQ * 10]))
    with pytest.raises(ConfigError, match="train_samples=5 but the tokens budgets of blend add up to 30"):
        as_build_config({**_config(stores, tmp_path, tokens=[SEQ * 10] * 3), "train_samples": 5})
    with pytest.raises(ConfigError, match="expected 'prefixes' and one of 'weights', 'tokens'"):
        as_build_config(_config(stores, tmp_path, tokens=[SEQ] * 3, weights=[1, 1, 1]))
    with pytest.raises(ConfigError, match="expected a positive whole number of tokens"):
        as_build_config(_config(stores, tmp_path, tokens=[SEQ * 10, -4, SEQ * 10]))
    with pytest.raises(ConfigError, match="expected one number per prefix"):
        as_build_config(_config(stores, tmp_path, epochs=[1.0]))
    # an epoch budget that cannot be met is refused by the resolve step (it reads the stores)
    tiny = as_build_config(_config(stores, tmp_path, epochs=[1.0, 1e-9, 1.0]))
    with pytest.raises(ConfigError, match=f"epochs budget 1e-09 of {stores[1]} is less than one sample"):
        tiny.resolve()
    with pytest.raises(ConfigError, match=r"train_samples=5 but the epochs budgets of blend add up to"):
        as_build_config({**_config(stores, tmp_path, epochs=[1.0] * 3), "train_samples": 5}).resolve()
    missing = as_build_config(_config([*stores[:2], str(tmp_path / "absent")], tmp_path, epochs=[1.0] * 3))
    with pytest.raises(FormatError, match="no token store at"):
        missing.resolve()
    per_split = {"blend_per_split": {"train": {"prefixes": stores[:1], "tokens": [SEQ * 10]},
                                     "valid": {"prefixes": stores[1:2], "tokens": [SEQ * 10]}},
                 "seq_length": SEQ, "valid_samples": 5, "cache_dir": str(tmp_path)}
    with pytest.raises(ConfigError, match=r"blend_per_split\[valid\] has a tokens budget"):
        as_build_config(per_split)


def test_the_audit_reports_tokens_served_against_each_budget(stores, tmp_path):
    budgets = [SEQ * 96, SEQ * 64, SEQ * 32]
    train = tokenloom.build(_config(stores, tmp_path / "cache", tokens=budgets)).split("train")
    audit = MixtureAudit(tmp_path / "audit.jsonl")
    for _ in RankLoader(train, BatchGeometry(global_batch_size=16, micro_batch_size=16, dp=1), audit=audit):
        pass  # the whole train split: 192 samples, 12 steps
    from tokenloom.serve import read_audit_log

    log = read_audit_log(tmp_path / "audit.jsonl")
    assert log.header["budget_tokens"] == budgets
    rows = summarize_audit(log)
    assert [r["budget_tokens"] for r in rows] == budgets
    assert [r["budget_used"] for r in rows] == [1.0, 1.0, 1.0]
