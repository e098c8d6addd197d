"""A blended split on tokenloom's stateless indices: resident memory independent of corpus size.

Each dataset is a :class:`~tokenloom.index.stateless.StatelessGPTIndex` (Megatron's packed
samples, Feistel-shuffled, 8 / block_size bytes per document per epoch) and the blend a
:class:`~tokenloom.index.blend.Blend` read by lookup (O(datasets) memory). Nothing grows with the
number of samples; the token stores are memory maps. Not megatron-exact: use
:class:`~tokenloom.source.protocol.StoreBlendSource` (or an exact build) for that.
"""

from __future__ import annotations

import hashlib
import json
from typing import Sequence

import numpy as np

from tokenloom.errors import ConfigError
from tokenloom.index.blend import Blend
from tokenloom.index.split import split_document_ranges
from tokenloom.index.stateless import DEFAULT_BLOCK_SIZE, StatelessGPTIndex, build_stateless_gpt_index
from tokenloom.io import IndexedDataset
from tokenloom.source.gather import GATHER_BACKENDS, default_backend
from tokenloom.source.protocol import DatasetInfo, SourceFields, check_blend_arguments, read_by_dataset, resolve_eod


class StatelessBlendSource(SourceFields):
    """A :class:`~tokenloom.source.protocol.SampleSource` over stateless indices and a lookup blend."""

    def __init__(self, *, stores: Sequence[IndexedDataset], indices: Sequence[StatelessGPTIndex], blend: Blend,
                 infos: Sequence[DatasetInfo], seq_length: int, add_extra_token: bool, build_key: str) -> None:
        self._stores, self._indices, self.blend = tuple(stores), tuple(indices), blend
        self._datasets = tuple(infos)
        self._seq_length, self._add_extra_token, self._build_key = int(seq_length), bool(add_extra_token), build_key
        self._pad_id = -1  # stateless samples are whole windows of tokens: nothing is padded
        self.backend = default_backend()
        """Gather kernel (a key of ``tokenloom.source.gather.GATHER_BACKENDS``)."""

    @classmethod
    def from_prefixes(cls, prefixes: Sequence[str], weights: Sequence[float] | None = None, *, num_samples: int,
                      seq_length: int, seed: int = 1234, split: str = "1,0,0", split_name: str = "train",
                      add_extra_token: bool = True, block_size: int = DEFAULT_BLOCK_SIZE,
                      eod_id: int | None = None, names: Sequence[str] | None = None) -> "StatelessBlendSource":
        """Open the stores and index one split; each dataset gets the samples the blend's exact
        (largest-remainder) counts give it."""
        prefixes, weights = check_blend_arguments(prefixes, weights, split_name)
        blend = Blend(weights, int(num_samples), names=names)
        stores, indices, infos, inputs = [], [], [], []
        for d, prefix in enumerate(prefixes):
            store = IndexedDataset(prefix)
            document_range = getattr(split_document_ranges(split, store.num_sequences), split_name)
            if document_range is None:
                raise ConfigError(f"split={split!r} gives the {split_name} split no weight; nothing to serve")
            ids = (None if (document_range.begin, document_range.end) == (0, store.num_sequences)
                   else np.arange(document_range.begin, document_range.end, dtype=np.int64))
            index = build_stateless_gpt_index(store.sequence_lengths, ids, num_samples=max(1, int(blend.counts[d])),
                                              seq_length=seq_length, seed=seed, add_extra_token=add_extra_token,
                                              block_size=block_size)
            stores.append(store)
            indices.append(index)
            infos.append(DatasetInfo(name=prefix if names is None else names[d], weight=float(blend.weights[d]),
                                     num_samples=index.num_samples, eod_id=resolve_eod(store, eod_id)))
            inputs.append({"prefix": prefix, "num_sequences": store.num_sequences,
                           "lengths_sha256": hashlib.sha256(memoryview(store.sequence_lengths)).hexdigest()})
        key = hashlib.sha256(json.dumps({
            "kind": "stateless-blend", "inputs": inputs, "weights": weights, "num_samples": int(num_samples),
            "seq_length": int(seq_length), "seed": int(seed), "split": split, "split_name": split_name,
            "add_extra_token": bool(add_extra_token), "block_size": int(block_size)}, sort_keys=True).encode()).hexdigest()
        return cls(stores=stores, indices=indices, blend=blend, infos=infos, seq_length=seq_length,
                   add_extra_token=add_extra_token, build_key=key)

    @property
    def num_samples(self) -> int:
        return len(self.blend)

    def locate(self, positions) -> tuple[np.ndarray, np.ndarray]:
        return self.blend.lookup(np.asarray(positions, dtype=np.int64))

    def read_samples(self, dataset_ids, sample_ids) -> np.ndarray:
        def fill(d, rows, wanted, out):
            GATHER_BACKENDS[self.backend][1](self._stores[d], self._indices[d].spans(wanted), self.pad_id, out, rows)

        return read_by_dataset(dataset_ids, sample_ids, datasets=self._datasets,
                               width=self._seq_length + int(self._add_extra_token), fill=fill)

    def __repr__(self) -> str:
        return (f"StatelessBlendSource(datasets={len(self._datasets)}, num_samples={self.num_samples}, "
                f"seq_length={self._seq_length}, build_key={self._build_key[:12]})")


__all__ = ["StatelessBlendSource"]
