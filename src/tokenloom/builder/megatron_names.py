"""megatron-core's cache file names: descriptions, md5 keys, and the files each index needs.

megatron-core 0.19.2 names a cached index ``{md5}-{Class}-{split}-{affix}`` where ``md5`` is the
MD5 of a *description*: a JSON text (4-space indent, keys in insertion order) of the dataset's
identifiers. For a ``GPTDataset`` the identifiers are, in order: ``class``, ``dataset_path`` (the
prefix as the job wrote it), ``num_samples``, ``index_split``, then the config's ``random_seed``,
``sequence_length``, ``split``, ``split_matrix`` and ``tokenizer`` (the tokenizer's own
``unique_identifiers``). A ``BlendedDataset`` lists ``class``, its datasets' identifiers, ``split``,
``weights`` and ``size``. Note what is missing: ``add_extra_token_to_sequence`` and
``drop_last_partial_validation_sequence`` change the arrays but not the name, so megatron-core
reuses a stale cache when they change. tokenloom's own keys (:mod:`tokenloom.source.keys`) include them.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tokenloom.index.split import split_bookends

GPT_CLASS = "GPTDataset"
BLEND_CLASS = "BlendedDataset"
#: The .npy files of each class, by tokenloom's array name -> megatron-core's affix.
GPT_FILES = {"document_index": "document_index.npy", "sample_index": "sample_index.npy",
             "shuffle_index": "shuffle_index.npy"}
BLEND_FILES = {"dataset_index": "dataset_index.npy", "dataset_sample_index": "dataset_sample_index.npy"}


@dataclass(frozen=True, kw_only=True)
class MegatronName:
    """Where megatron-core looks for one cached index."""

    identifiers: Mapping[str, Any]
    """What megatron-core describes the index by, in its order (an OrderedDict)."""
    class_name: str
    """``GPTDataset`` or ``BlendedDataset``."""
    split: str
    """``train``, ``valid`` or ``test``."""

    @functools.cached_property
    def description(self) -> str:
        """The description text megatron-core writes beside the arrays and hashes (made on first
        use: a plan of thousands of items needs none of them unless it writes megatron's cache)."""
        return json.dumps(self.identifiers, indent=4)

    @property
    def md5(self) -> str:
        return hashlib.md5(self.description.encode("utf-8"), usedforsecurity=False).hexdigest()

    def file_name(self, affix: str) -> str:
        """``{md5}-{class}-{split}-{affix}``, e.g. affix ``description.txt``."""
        return f"{self.md5}-{self.class_name}-{self.split}-{affix}"

    def array_files(self) -> dict[str, str]:
        """tokenloom array name -> megatron-core file name."""
        files = GPT_FILES if self.class_name == GPT_CLASS else BLEND_FILES
        return {array: self.file_name(affix) for array, affix in files.items()}


def split_matrix(split: str | None) -> list | None:
    """megatron-core's ``split_matrix`` for the description (None with per-split blends)."""
    if split is None:
        return None
    return [None if bookend is None else list(bookend) for bookend in split_bookends(split)]


def gpt_identifiers(*, dataset_path: str, num_samples: int | None, split: str, random_seed: int,
                    sequence_length: int, split_string: str | None,
                    tokenizer: Mapping[str, Any] | None) -> OrderedDict[str, Any]:
    """The identifiers megatron-core hashes for one ``GPTDataset`` split."""
    identifiers: OrderedDict[str, Any] = OrderedDict()
    identifiers["class"] = GPT_CLASS
    identifiers["dataset_path"] = dataset_path
    identifiers["num_samples"] = num_samples
    identifiers["index_split"] = split
    identifiers["random_seed"] = random_seed
    identifiers["sequence_length"] = sequence_length
    identifiers["split"] = split_string
    identifiers["split_matrix"] = split_matrix(split_string)
    identifiers["tokenizer"] = None if tokenizer is None else OrderedDict(tokenizer)
    return identifiers


def gpt_name(identifiers: Mapping[str, Any]) -> MegatronName:
    return MegatronName(identifiers=identifiers, class_name=GPT_CLASS, split=identifiers["index_split"])


def blend_name(*, datasets: list[Mapping[str, Any]], split: str, weights: list,
               size: int | None) -> MegatronName:
    """The name of a ``BlendedDataset``; ``weights`` exactly as megatron-core holds them."""
    identifiers: OrderedDict[str, Any] = OrderedDict()
    identifiers["class"] = BLEND_CLASS
    identifiers["datasets"] = list(datasets)
    identifiers["split"] = split
    identifiers["weights"] = list(weights)
    identifiers["size"] = size
    return MegatronName(identifiers=identifiers, class_name=BLEND_CLASS, split=split)


__all__ = [
    "BLEND_CLASS", "BLEND_FILES", "GPT_CLASS", "GPT_FILES", "MegatronName",
    "blend_name", "gpt_identifiers", "gpt_name", "split_matrix",
]
