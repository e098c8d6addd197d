"""megatron-core's own builder on a build config: loading a cache without building anything, or
building from scratch for comparison."""

from __future__ import annotations

import contextlib
import logging
import warnings

import pytest

from build_fixtures import NULL_TOKENIZER


def _megatron():
    warnings.filterwarnings("ignore")
    logging.getLogger("megatron").setLevel(logging.ERROR)
    pytest.importorskip("megatron.core")
    from megatron.core.datasets import helpers
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    return helpers, BlendedMegatronDatasetBuilder, GPTDataset, GPTDatasetConfig, NullTokenizer


def _blend(value):
    if value is None:
        return None
    if isinstance(value, dict):
        return (list(value["prefixes"]), None if value.get("weights") is None else list(value["weights"]))
    return value


def gpt_dataset_config(config: dict, path_to_cache, **settings):
    """megatron-core's GPTDatasetConfig for a tokenloom config mapping (NullTokenizer(1000));
    ``path_to_cache`` None leaves it unset; ``settings`` are further GPTDatasetConfig fields
    (``sequences_per_dataset``, ``inter_document_masking``, ``multiple_validation_sets`` ...)."""
    _, _, _, GPTDatasetConfig, NullTokenizer = _megatron()
    tokenizer = NullTokenizer(1000)
    assert dict(tokenizer.unique_identifiers) == NULL_TOKENIZER
    per_split = config.get("blend_per_split")
    if isinstance(per_split, dict):
        per_split = [_blend(per_split.get(n)) for n in ("train", "valid", "test")]
    elif per_split is not None:
        per_split = [_blend(b) for b in per_split]
    mcfg = GPTDatasetConfig(
        random_seed=config.get("seed", 1234), sequence_length=config["seq_length"],
        blend=_blend(config.get("blend")), blend_per_split=per_split, split=config.get("split"),
        path_to_cache=None if path_to_cache is None else str(path_to_cache), tokenizer=tokenizer,
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        add_extra_token_to_sequence=config.get("add_extra_token", True),
        drop_last_partial_validation_sequence=config.get("drop_last_partial_validation_sequence", True),
        mid_level_dataset_surplus=config.get("mid_level_dataset_surplus", 0.005),
        **settings,
    )
    return mcfg


def megatron_datasets(config: dict, path_to_cache, *, dataset_type=None, sizes=None, **settings):
    """megatron-core's BlendedMegatronDatasetBuilder(...).build() for a tokenloom config mapping
    (``dataset_type`` default GPTDataset; ``sizes`` default the config's sample counts)."""
    _, Builder, GPTDataset, _, _ = _megatron()
    if sizes is None:
        sizes = [config.get("train_samples"), config.get("valid_samples"), config.get("test_samples")]
    return Builder(dataset_type or GPTDataset, list(sizes), lambda: True,
                   gpt_dataset_config(config, path_to_cache, **settings)).build()


@contextlib.contextmanager
def refusing_megatron_builders():
    """megatron-core's index builders replaced by ones that fail: inside, it can only load."""
    helpers = _megatron()[0]

    def refuse(*args, **kwargs):
        raise AssertionError("megatron-core built an index instead of loading it from the cache")

    saved = {name: getattr(helpers, name) for name in
             ("build_sample_idx", "build_blending_indices", "build_exhaustive_blending_indices")}
    try:
        for name in saved:
            setattr(helpers, name, refuse)
        yield
    finally:
        for name, function in saved.items():
            setattr(helpers, name, function)


def megatron_build_without_building(config: dict, path_to_cache):
    """megatron-core's datasets from ``path_to_cache``, failing if it would build any array."""
    with refusing_megatron_builders():
        return megatron_datasets(config, path_to_cache)
