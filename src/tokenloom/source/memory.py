"""Blended sources made in memory from token stores, without a build or a cache.

* :class:`StoreBlendSource` -- Megatron-exact: position ``i`` is megatron-core's
  ``BlendedDataset[i]`` for the same stores, weights, split, sample count and seed, sized and
  blended exactly as its ``BlendedMegatronDatasetBuilder`` does;
* :class:`StatelessBlendSource` -- tokenloom's stateless indices and closed-form blend: resident
  memory independent of the number of samples.

Both are :class:`~tokenloom.source.blended.BlendedSource` (the one blended source) with a
``from_prefixes`` constructor; a build makes the same objects from its cache.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import numpy as np

from tokenloom.errors import ConfigError
from tokenloom.index.blend import Blend
from tokenloom.index.blend_spec import DEFAULT_SURPLUS, BlendSpec
from tokenloom.index.megatron_blend import megatron_blend
from tokenloom.index.megatron_gpt import PAD_TOKEN_ID, build_megatron_gpt_indices
from tokenloom.index.split import SPLIT_NAMES, DocumentRange, document_ids, split_document_ranges
from tokenloom.index.stateless import DEFAULT_BLOCK_SIZE, build_stateless_gpt_index
from tokenloom.io import IndexedDataset
from tokenloom.source.blended import ArrayLocator, BlendedSource, BlendLocator
from tokenloom.source.keys import build_key
from tokenloom.source.readers import MegatronReader, StatelessReader
from tokenloom.validate import check_positive_int

MEGATRON_SURPLUS = DEFAULT_SURPLUS
"""megatron-core's default ``mid_level_dataset_surplus``: each dataset builds 0.5% more samples
than the blend asks of it."""


def check_blend_arguments(prefixes: Sequence[str], weights: Sequence[float] | None, split_name: str,
                          names: Sequence[str] | None = None) -> tuple[list[str], list[float]]:
    """Validate a blend's stores, weights (None: equal), split name and dataset names; return the
    stores and weights as lists of str and float."""
    prefixes = [str(p) for p in prefixes]
    if not prefixes:
        raise ConfigError("prefixes is empty; expected at least one token store prefix")
    weights = [1.0] * len(prefixes) if weights is None else [float(w) for w in weights]
    if len(weights) != len(prefixes):
        raise ConfigError(f"{len(weights)} weights for {len(prefixes)} prefixes; expected one weight per prefix")
    if any(not (w > 0 and math.isfinite(w)) for w in weights):
        raise ConfigError(f"weights={weights}; expected finite positive numbers")
    if split_name not in SPLIT_NAMES:
        raise ConfigError(f"split_name={split_name!r}; expected one of {SPLIT_NAMES}")
    if names is not None and len(names) != len(prefixes):
        raise ConfigError(f"{len(names)} names for {len(prefixes)} prefixes; expected one name per prefix")
    return prefixes, weights


def _split_range(store: IndexedDataset, split: str, split_name: str) -> DocumentRange:
    document_range = getattr(split_document_ranges(split, store.num_sequences), split_name)
    if document_range is None:
        raise ConfigError(f"split={split!r} gives the {split_name} split no weight; nothing to serve")
    return document_range


def _fingerprint(prefix: str, store: IndexedDataset) -> dict:
    """What a source made in memory keys its stream on: the store and its document lengths."""
    lengths = hashlib.sha256(memoryview(np.ascontiguousarray(store.sequence_lengths))).hexdigest()
    return {"prefix": prefix, "num_sequences": store.num_sequences, "lengths_sha256": lengths}


class StoreBlendSource(BlendedSource):
    """A Megatron-exact blended split built in memory from token stores (use :meth:`from_prefixes`)."""

    @classmethod
    def from_prefixes(cls, prefixes: Sequence[str], weights: Sequence[float] | None = None, *,
                      num_samples: int, seq_length: int, seed: int = 1234, split: str = "1,0,0",
                      split_name: str = "train", add_extra_token: bool = True,
                      surplus: float = MEGATRON_SURPLUS, pad_id: int = PAD_TOKEN_ID,
                      drop_last_partial: bool = True, eod_id: int | None = None,
                      names: Sequence[str] | None = None) -> StoreBlendSource:
        """Open the stores and build megatron-core's indices for one split of a weighted blend.

        ``weights`` default to equal; ``seed`` is megatron-core's ``random_seed``; ``split`` its
        split string and ``split_name`` one of "train", "valid", "test". ``drop_last_partial=False``
        keeps (and pads) a short last sample of the valid split, megatron-core's
        ``drop_last_partial_validation_sequence=False``; other splits always drop it. ``eod_id``
        supplies the end-of-document id for stores without a tokenizer record (e.g. written by
        Megatron-LM's preprocess_data.py); a store whose record says otherwise is a ConfigError.
        """
        prefixes, weights = check_blend_arguments(prefixes, weights, split_name, names)
        check_positive_int("num_samples", num_samples)
        sizes = BlendSpec(prefixes=tuple(prefixes), weights=tuple(weights)).megatron_sizes(
            int(num_samples), surplus=surplus)
        drop_last = split_name != "valid" or bool(drop_last_partial)
        readers, inputs = [], []
        for d, prefix in enumerate(prefixes):
            store = IndexedDataset(prefix)
            indices = build_megatron_gpt_indices(
                store.sequence_lengths, document_ids(_split_range(store, split, split_name)),
                num_samples=sizes.buffers[d], seq_length=seq_length, seed=seed,
                add_extra_token=add_extra_token, drop_last_partial=drop_last)
            readers.append(MegatronReader(name=prefix if names is None else names[d], store=store, indices=indices,
                                          pad_id=pad_id))
            inputs.append(_fingerprint(prefix, store))
        dataset_index, dataset_sample_index = megatron_blend(sizes.blend_weights, sizes.blended_size)
        key = build_key({"kind": "store-blend", "inputs": inputs, "weights": weights,
                         "num_samples": int(num_samples), "seq_length": int(seq_length), "seed": int(seed),
                         "split": split, "split_name": split_name, "add_extra_token": bool(add_extra_token),
                         "surplus": surplus, "pad_id": int(pad_id), "drop_last_partial": drop_last})
        source = cls(readers=readers, weights=sizes.blend_weights,
                     locator=ArrayLocator(dataset_index, dataset_sample_index), seq_length=seq_length,
                     add_extra_token=add_extra_token, build_key=key, pad_id=pad_id, name=split_name,
                     eod_ids=[eod_id] * len(readers))
        source.datasets  # noqa: B018 - the stores are open already: check their EOD ids now
        return source


class StatelessBlendSource(BlendedSource):
    """A blended split on stateless indices and a lookup blend, built in memory (use :meth:`from_prefixes`).

    Nothing grows with the number of samples: each dataset is a Feistel-shuffled index of
    8 / block_size bytes per document per epoch, the blend is O(datasets), the stores are memory
    maps. Not megatron-exact: use :class:`StoreBlendSource` (or an exact build) for that.
    """

    @classmethod
    def from_prefixes(cls, prefixes: Sequence[str], weights: Sequence[float] | None = None, *, num_samples: int,
                      seq_length: int, seed: int = 1234, split: str = "1,0,0", split_name: str = "train",
                      add_extra_token: bool = True, block_size: int = DEFAULT_BLOCK_SIZE,
                      eod_id: int | None = None, names: Sequence[str] | None = None) -> StatelessBlendSource:
        """Open the stores and index one split; each dataset gets the samples the blend's exact
        (largest-remainder) counts give it."""
        prefixes, weights = check_blend_arguments(prefixes, weights, split_name, names)
        blend = Blend(weights, int(num_samples), names=names)
        readers, inputs = [], []
        for d, prefix in enumerate(prefixes):
            store = IndexedDataset(prefix)
            document_range = _split_range(store, split, split_name)
            ids = (None if (document_range.begin, document_range.end) == (0, store.num_sequences)
                   else np.arange(document_range.begin, document_range.end, dtype=np.int64))
            indices = build_stateless_gpt_index(store.sequence_lengths, ids, num_samples=max(1, int(blend.counts[d])),
                                                seq_length=seq_length, seed=seed, add_extra_token=add_extra_token,
                                                block_size=block_size)
            readers.append(StatelessReader(name=prefix if names is None else names[d], store=store, indices=indices))
            inputs.append(_fingerprint(prefix, store))
        key = build_key({"kind": "stateless-blend", "inputs": inputs, "weights": weights,
                         "num_samples": int(num_samples), "seq_length": int(seq_length), "seed": int(seed),
                         "split": split, "split_name": split_name, "add_extra_token": bool(add_extra_token),
                         "block_size": int(block_size)})
        # stateless samples are whole windows of tokens: nothing is ever padded
        source = cls(readers=readers, weights=blend.weights.tolist(), locator=BlendLocator(blend),
                     seq_length=seq_length, add_extra_token=add_extra_token, build_key=key, pad_id=-1,
                     name=split_name, eod_ids=[eod_id] * len(readers))
        source.datasets  # noqa: B018 - the stores are open already: check their EOD ids now
        return source


__all__ = ["MEGATRON_SURPLUS", "StatelessBlendSource", "StoreBlendSource", "check_blend_arguments"]
