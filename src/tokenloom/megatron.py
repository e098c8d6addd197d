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

``--data-cache-path`` (the config's ``path_to_cache``) must be set, except for mock data: it is
where megatron-core looks for the arrays. megatron-core is imported when the function runs, not when this module is.

What the config's settings do here. megatron-core's name for an index (its md5) covers the class,
the store, the sample count, the split and ``random_seed``, ``sequence_length``, ``split``,
``split_matrix`` and ``tokenizer`` (``MegatronDataset._key_config_attributes``); any other setting
leaves the arrays and their names alone, and megatron-core serves them as it would after building:

- ``mock`` (``--mock-data``; megatron-core sets it when the config has no blend): there is no store
  and nothing to build, so the config goes to megatron-core's builder as it is, with
  ``MockGPTDataset`` in place of ``GPTDataset`` (what ``pretrain_gpt.py`` picks for mock data);
  ``path_to_cache`` may be unset.
- ``sequences_per_dataset`` (``--per-dataset-sequences-path``: prefix -> (sequences, document
  indices) of its .idx header, so megatron-core need not read the headers): checked against each
  .idx before anything is built (every rank reads each header once, as megatron-core would without
  the dict). A count that disagrees makes megatron-core fail after the build with a bare assertion
  or a short buffer, and a store whose token type is not the one megatron-core infers from the
  tokenizer's vocabulary (it then ignores the header's) is read as noise without an error: both
  are a ConfigError naming the prefix, the given and the real values.
- ``multiple_validation_sets`` with a ``blend_per_split`` validation blend of several prefixes:
  megatron-core returns a list of validation datasets, one per prefix, each the whole store with
  the validation sample count; tokenloom builds each as a single-prefix validation blend, which
  megatron-core names the same.
- ``full_validation``: only asks (with ``multiple_validation_sets``) that the validation sample
  count be None, one epoch, as Megatron-LM passes it.
- ``inter_document_masking``, ``create_attention_mask``, ``reset_*``, ``eod_mask_loss`` and the
  parallel sizes change what ``__getitem__`` returns, not the indices.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

from tokenloom.errors import BuildError, ConfigError
from tokenloom.validate import is_integer

logger = logging.getLogger(__name__)


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


def _sizes(train_valid_test_num_samples: Sequence[int | None]) -> list:
    """megatron-core's ``sizes``, checked before it indexes them per split."""
    sizes = list(train_valid_test_num_samples)
    if len(sizes) != 3:
        raise ConfigError(f"train_valid_test_num_samples={train_valid_test_num_samples!r}; expected three counts "
                          "(train, valid, test), None for a split megatron-core sizes itself")
    return sizes


def _validation_sets(per_split: list, sizes: list, config: Any) -> list[str]:
    """The prefixes megatron-core serves as separate validation datasets (``multiple_validation_sets``
    with a validation blend of several prefixes: ``BlendedMegatronDatasetBuilder`` builds each one
    alone), or [] when it blends the validation split as usual."""
    valid = per_split[1]
    if not getattr(config, "multiple_validation_sets", None) or valid is None or len(valid["prefixes"]) < 2:
        return []
    if getattr(config, "full_validation", None) and sizes[1] is not None:
        raise ConfigError(f"full_validation with multiple_validation_sets and {sizes[1]} validation samples; "
                          "megatron-core builds one whole epoch of each validation set for full validation and "
                          "asserts that the validation count is None (Megatron-LM passes None): pass None")
    if sizes[1] is None and valid["weights"] is not None:
        raise ConfigError(f"blend_per_split[1] has weights {valid['weights']} but the validation sample count is "
                          "None; megatron-core refuses weights without a count: drop the weights or pass a count")
    return list(dict.fromkeys(valid["prefixes"]))


def megatron_build_configs(config: Any, train_valid_test_num_samples: Sequence[int | None], *,
                           cache_dir: str | None = None, **options: Any) -> list[dict[str, Any]]:
    """The tokenloom build configs that write exactly the indices megatron-core's builder would
    build for ``config`` (a ``GPTDatasetConfig``) and these sample counts: one, and with
    ``multiple_validation_sets`` one more per separate validation set (megatron-core builds each
    alone, as a single-prefix validation blend). Reads no file.

    ``cache_dir``: tokenloom's own cache (default ``PATH_TO_CACHE/tokenloom``). ``options``: other
    build settings (``blend_threads``, ``timeout_s``, ``shared_fs``, ``verify_stores`` ...).
    """
    if getattr(config, "mock", False):
        raise ConfigError("GPTDatasetConfig.mock=True (no blend, megatron-core's mock data): there is no store and "
                          "nothing for tokenloom to build; build_megatron_datasets hands such a config to "
                          "megatron-core's builder")
    path_to_cache = getattr(config, "path_to_cache", None)
    if not path_to_cache:
        raise ConfigError("GPTDatasetConfig.path_to_cache is not set; tokenloom writes megatron-core's cache files "
                          "there and megatron-core loads them from there: pass --data-cache-path DIR")
    tokenizer = getattr(config, "tokenizer", None)
    identifiers = getattr(tokenizer, "unique_identifiers", None)
    if identifiers is None:
        raise ConfigError("GPTDatasetConfig.tokenizer is not set (or has no unique_identifiers); megatron-core "
                          "names its cache files by the tokenizer, so tokenloom needs it too")
    sizes = _sizes(train_valid_test_num_samples)
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
        **options,
    }
    per_split = getattr(config, "blend_per_split", None)
    if per_split is None or not any(b is not None for b in per_split):
        return [{**build, "blend": _blend(getattr(config, "blend", None), "blend"), "split": config.split}]
    blends = [_blend(b, f"blend_per_split[{i}]") for i, b in enumerate(per_split)]
    separate = _validation_sets(blends, sizes, config)
    if separate:
        blends[1] = None
    configs = [{**build, "blend_per_split": blends}] if any(b is not None for b in blends) else []
    for prefix in separate:
        configs.append({**build, "blend_per_split": [None, {"prefixes": [prefix], "weights": None}, None]})
    return configs


def _check_sequences_per_dataset(config: Any, prefixes: Sequence[str]) -> None:
    """Hold ``config.sequences_per_dataset`` (prefix -> (sequence count, document index count), as
    Megatron-LM's ``tools/build_sequences_per_dataset.py`` writes it) to the .idx headers.

    megatron-core trusts the dict instead of each header, and its token type to the tokenizer's
    vocabulary size instead of the header's code: a wrong count fails later in megatron-core as a
    bare assertion or a short buffer, after the whole build, and a wrong token type reads the .bin
    as noise without any error. The headers are read with megatron-core's own reader, the one that
    tool uses.
    """
    counts = getattr(config, "sequences_per_dataset", None)
    if not counts:
        return
    from megatron.core.datasets.indexed_dataset import DType, _IndexReader, get_idx_path

    missing = [p for p in prefixes if p not in counts]
    if missing:
        raise ConfigError(f"GPTDatasetConfig.sequences_per_dataset has no entry for {missing[:5]}"
                          f"{' ...' if len(missing) > 5 else ''} ({len(missing)} of the blend's {len(prefixes)} "
                          "prefixes); megatron-core looks up every prefix of the blend in it: rebuild the file "
                          "with Megatron-LM's tools/build_sequences_per_dataset.py for this blend")
    code = getattr(config, "token_dtype_code", None)
    assumed = None if code is None else DType.dtype_from_code(code)
    for prefix in prefixes:
        given = counts[prefix]
        if not given:
            continue  # megatron-core reads this prefix's header itself
        if isinstance(given, (str, bytes)) or not hasattr(given, "__len__") or len(given) != 2 \
                or not all(is_integer(v) for v in given):
            raise ConfigError(f"GPTDatasetConfig.sequences_per_dataset[{prefix!r}]={given!r}; expected "
                              "(sequence count, document index count) from its .idx header")
        try:
            header = _IndexReader(get_idx_path(prefix), False)
        except (OSError, AssertionError):
            continue  # not a readable .idx: tokenloom.build names what is wrong with the store
        real = (int(header.sequence_count), int(header.document_count))
        if (int(given[0]), int(given[1])) != real:
            raise ConfigError(f"GPTDatasetConfig.sequences_per_dataset[{prefix!r}]=({given[0]}, {given[1]}) but "
                              f"{prefix}.idx holds {real[0]} sequences and {real[1]} document indices; "
                              "megatron-core would read the index by the given counts instead of the header's "
                              "(and fail on it after the build): rebuild the file with Megatron-LM's "
                              "tools/build_sequences_per_dataset.py")
        if assumed is not None and header.dtype != assumed:
            raise ConfigError(f"{prefix}.idx stores {header.dtype.__name__} tokens, but with sequences_per_dataset "
                              f"megatron-core reads them as {assumed.__name__}, the type it infers from the "
                              f"tokenizer's vocab_size={config.tokenizer.vocab_size}, and would serve noise: "
                              "tokenize with this tokenizer or drop sequences_per_dataset")


def _prefixes(builds: list[dict[str, Any]]) -> list[str]:
    """Every store prefix the build configs read, in first-seen order."""
    seen: dict[str, None] = {}
    for build in builds:
        for blend in (build.get("blend"), *(build.get("blend_per_split") or ())):
            if blend is not None:
                seen.update(dict.fromkeys(blend["prefixes"]))
    return list(seen)


def _loaded_names(dataset, out: list) -> None:
    """``(class, split, md5)`` of ``dataset`` and of every dataset it blends (or of each of a list
    of validation datasets)."""
    if dataset is None:
        return
    if isinstance(dataset, list):
        for member in dataset:
            _loaded_names(member, out)
        return
    split = getattr(dataset, "index_split", None) or getattr(dataset, "split", None)
    out.append((type(dataset).__name__, getattr(split, "name", str(split)), dataset.unique_description_hash,
                dataset.unique_description))
    for child in getattr(dataset, "datasets", None) or ():
        _loaded_names(child, out)


def _mock_datasets(config: Any, sizes: list, is_built_on_rank: Callable[[], bool], dataset_type: type) -> list:
    """megatron-core's mock datasets: its builder over its generated documents, as without tokenloom."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset
    from megatron.core.utils import log_single_rank

    if dataset_type is GPTDataset:  # pretrain_gpt.py picks MockGPTDataset for --mock-data
        dataset_type = MockGPTDataset
    log_single_rank(logger, logging.INFO, f"mock data (no blend): nothing for tokenloom to build; megatron-core's "
                                          f"builder makes the {dataset_type.__name__} splits itself")
    return BlendedMegatronDatasetBuilder(dataset_type, sizes, is_built_on_rank, config).build()


def build_megatron_datasets(config: Any, train_valid_test_num_samples: Sequence[int | None], *,
                            is_built_on_rank: Callable[[], bool] | None = None, dataset_type: type | None = None,
                            cache_dir: str | None = None, group: Any = None, **options: Any) -> list:
    """megatron-core's ``[train, valid, test]`` datasets for ``config``, their indices built by
    tokenloom on every rank of the job (call it on every rank).

    ``is_built_on_rank``: Megatron-LM's ``is_dataset_built_on_rank`` (default: every rank);
    ranks where it is False get None, as with megatron-core's builder. ``dataset_type``: a
    ``GPTDataset`` class (default ``GPTDataset``; ``MockGPTDataset`` for mock data). ``group``: the
    ranks that build (default every rank of the job); ``cache_dir`` and ``options`` go to
    :func:`megatron_build_configs`. With ``multiple_validation_sets`` the validation entry may be
    a list of datasets, as megatron-core returns it.

    Raises ConfigError before building when ``sequences_per_dataset`` disagrees with a store, and
    BuildError when megatron-core did not load an index tokenloom wrote (it built it itself): the
    config has a setting that changes megatron-core's description of an index.
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset

    import tokenloom

    dataset_type = GPTDataset if dataset_type is None else dataset_type
    if not (isinstance(dataset_type, type) and issubclass(dataset_type, GPTDataset)):
        raise ConfigError(f"dataset_type={dataset_type!r}; tokenloom builds the indices of megatron-core's GPTDataset")
    sizes = _sizes(train_valid_test_num_samples)
    is_built_on_rank = is_built_on_rank or (lambda: True)
    if getattr(config, "mock", False):
        return _mock_datasets(config, sizes, is_built_on_rank, dataset_type)
    builds = megatron_build_configs(config, sizes, cache_dir=cache_dir, **options)
    _check_sequences_per_dataset(config, _prefixes(builds))
    written = set()
    for build in builds:
        result = tokenloom.build(build, group)
        written.update(item.megatron.md5 for item in result.plan.items if item.megatron is not None)
    datasets = BlendedMegatronDatasetBuilder(dataset_type, sizes, is_built_on_rank, config).build()
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


__all__ = ["build_megatron_datasets", "megatron_build_configs"]
