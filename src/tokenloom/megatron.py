"""Megatron-LM's datasets, built by tokenloom on every rank: the entry point for ``pretrain_gpt.py``.

Megatron-LM's ``train_valid_test_datasets_provider`` hands megatron-core's
``BlendedMegatronDatasetBuilder`` a ``GPTDatasetConfig``; rank 0 builds every index while the
other ranks wait. :func:`build_megatron_datasets` takes the same arguments: every rank runs
:func:`tokenloom.build` on the same blend (the work divided over the job's ranks, megatron-core's
cache files written into the config's ``path_to_cache`` under megatron-core's own names and md5
keys), then megatron-core's builder loads its datasets from those files as cache hits. The samples
are megatron-core's own objects; tokenloom only wrote their arrays, bit for bit (the differential
tests hold them equal to megatron-core's).

In Megatron-LM's ``pretrain_gpt.py`` three lines change::

    from tokenloom.megatron import build_megatron_datasets           # new import
    ...
    train_ds, valid_ds, test_ds = build_megatron_datasets(           # instead of
        config, train_val_test_num_samples, is_built_on_rank=is_dataset_built_on_rank)
    # BlendedMegatronDatasetBuilder(GPTDataset, train_val_test_num_samples,
    #                               is_dataset_built_on_rank, config).build()

``--data-cache-path`` (the config's ``path_to_cache``) must be set: it is where megatron-core looks
for the arrays. megatron-core is imported when the function runs, not when this module is.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from tokenloom.errors import BuildError, ConfigError

#: GPTDatasetConfig settings that change which indices megatron-core builds in ways tokenloom does
#: not reproduce; a config that sets one is refused (megatron-core's builder handles it alone).
UNSUPPORTED = ("mock", "multiple_validation_sets", "full_validation", "sequences_per_dataset")


def _blend(value, what: str) -> dict | None:
    """megatron-core's ``(prefixes, weights or None)`` as a tokenloom blend."""
    if value is None:
        return None
    try:
        prefixes, weights = value
    except (TypeError, ValueError):
        raise ConfigError(f"{what}={value!r}; expected megatron-core's (prefixes, weights) pair") from None
    for prefix in prefixes:
        if "://" in str(prefix):
            raise ConfigError(f"{what} names {prefix!r}; this entry point hands the datasets to megatron-core to "
                              "load, and does not set up megatron-core's object-storage reader: build from "
                              "s3:// with tokenloom.build and serve with tokenloom's loaders, or load these "
                              "prefixes with megatron-core's own builder")
    return {"prefixes": [str(p) for p in prefixes], "weights": None if weights is None else list(weights)}


def megatron_build_config(config: Any, train_valid_test_num_samples: Sequence[int | None], *,
                          cache_dir: str | None = None, **options: Any) -> dict[str, Any]:
    """The tokenloom build config that writes exactly the indices megatron-core's builder would
    build for ``config`` (a ``GPTDatasetConfig``) and these sample counts.

    ``cache_dir``: tokenloom's own cache (default ``PATH_TO_CACHE/tokenloom``). ``options``: other
    build settings (``blend_threads``, ``timeout_s``, ``shared_fs``, ``verify_stores`` ...).
    """
    for name in UNSUPPORTED:
        if getattr(config, name, None):
            raise ConfigError(f"GPTDatasetConfig.{name}={getattr(config, name)!r}; tokenloom does not build for "
                              f"this setting; leave it unset or use megatron-core's builder")
    path_to_cache = getattr(config, "path_to_cache", None)
    if not path_to_cache:
        raise ConfigError("GPTDatasetConfig.path_to_cache is not set; tokenloom writes megatron-core's cache files "
                          "there and megatron-core loads them from there: pass --data-cache-path DIR")
    tokenizer = getattr(config, "tokenizer", None)
    identifiers = getattr(tokenizer, "unique_identifiers", None)
    if identifiers is None:
        raise ConfigError("GPTDatasetConfig.tokenizer is not set (or has no unique_identifiers); megatron-core "
                          "names its cache files by the tokenizer, so tokenloom needs it too")
    sizes = list(train_valid_test_num_samples)
    if len(sizes) != 3:
        raise ConfigError(f"train_valid_test_num_samples={train_valid_test_num_samples!r}; expected three counts "
                          "(train, valid, test), None for a split megatron-core sizes itself")
    per_split = getattr(config, "blend_per_split", None)
    build: dict[str, Any] = {
        "seq_length": int(config.sequence_length),
        "seed": int(config.random_seed),
        "train_samples": sizes[0], "valid_samples": sizes[1], "test_samples": sizes[2],
        "add_extra_token": bool(config.add_extra_token_to_sequence),
        "drop_last_partial_validation_sequence": bool(config.drop_last_partial_validation_sequence),
        "mid_level_dataset_surplus": float(config.mid_level_dataset_surplus),
        "megatron_tokenizer": dict(identifiers),
        "megatron_cache_dir": str(path_to_cache),
        "cache_dir": str(cache_dir) if cache_dir is not None else os.path.join(str(path_to_cache), "tokenloom"),
        "mode": "exact",
    }
    if per_split is not None and any(b is not None for b in per_split):
        build["blend_per_split"] = [_blend(b, f"blend_per_split[{i}]") for i, b in enumerate(per_split)]
    else:
        build["blend"] = _blend(getattr(config, "blend", None), "blend")
        build["split"] = config.split
    build.update(options)
    return build


def _loaded_names(dataset, out: list) -> None:
    """``(class, split, md5)`` of ``dataset`` and of every dataset it blends."""
    if dataset is None:
        return
    split = getattr(dataset, "index_split", None) or getattr(dataset, "split", None)
    out.append((type(dataset).__name__, getattr(split, "name", str(split)), dataset.unique_description_hash,
                dataset.unique_description))
    for child in getattr(dataset, "datasets", None) or ():
        _loaded_names(child, out)


def build_megatron_datasets(config: Any, train_valid_test_num_samples: Sequence[int | None], *,
                            is_built_on_rank: Callable[[], bool] | None = None, dataset_type: type | None = None,
                            cache_dir: str | None = None, group: Any = None, **options: Any) -> list:
    """megatron-core's ``[train, valid, test]`` datasets for ``config``, their indices built by
    tokenloom on every rank of the job (call it on every rank).

    ``is_built_on_rank``: Megatron-LM's ``is_dataset_built_on_rank`` (default: every rank);
    ranks where it is False get None, as with megatron-core's builder. ``dataset_type``: a
    ``GPTDataset`` class (default ``GPTDataset``). ``group``: the ranks that build (default every
    rank of the job); ``cache_dir`` and ``options`` go to :func:`megatron_build_config`.

    Raises BuildError when megatron-core did not load an index tokenloom wrote (it built it itself):
    the config has a setting that changes megatron-core's description of an index.
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset

    import tokenloom

    dataset_type = GPTDataset if dataset_type is None else dataset_type
    if not (isinstance(dataset_type, type) and issubclass(dataset_type, GPTDataset)):
        raise ConfigError(f"dataset_type={dataset_type!r}; tokenloom builds the indices of megatron-core's GPTDataset")
    result = tokenloom.build(megatron_build_config(config, train_valid_test_num_samples, cache_dir=cache_dir,
                                                   **options), group)
    written = {item.megatron.md5 for item in result.plan.items if item.megatron is not None}
    datasets = BlendedMegatronDatasetBuilder(dataset_type, list(train_valid_test_num_samples),
                                             is_built_on_rank or (lambda: True), config).build()
    loaded: list = []
    for dataset in datasets:
        _loaded_names(dataset, loaded)
    # the datasets first: a blend's description holds theirs, so theirs name the difference
    for class_name, split, md5, description in sorted(loaded, key=lambda entry: entry[0] == "BlendedDataset"):
        if md5 not in written:
            if len(description) > 2000:
                description = description[:2000] + " ..."
            raise BuildError(
                f"megatron-core's {class_name} {split} index {md5} is not one tokenloom wrote into "
                f"{config.path_to_cache}, so megatron-core built it itself: its description differs from "
                f"tokenloom's (a GPTDatasetConfig setting tokenloom does not model?). megatron-core's "
                f"description: {description}")
    return datasets


__all__ = ["UNSUPPORTED", "build_megatron_datasets", "megatron_build_config"]
