"""What a build hands the serving stage: every split's indices, opened by mmap.

``BuildResult.split("train")`` returns a :class:`BuiltSplit`, which implements
:class:`tokenloom.source.protocol.SampleSource`: ``locate(positions)`` gives ``(dataset_ids,
sample_ids)`` and ``read_samples`` their tokens, exactly as megatron-core's ``BlendedDataset``
(exact mode) would serve them. Nothing is copied into memory: the arrays are read-only memory
maps of the cache files, so every rank of a job can open the same build cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from tokenloom.builder.cache import Cache
from tokenloom.builder.items import BuildPlan, SplitPlan
from tokenloom.builder.stateless import open_stateless_gpt_index, read_stateless_samples, stateless_blend
from tokenloom.errors import ConfigError
from tokenloom.index.blend import Blend
from tokenloom.index.megatron_gpt import PAD_TOKEN_ID, GPTIndices
from tokenloom.index.stateless import StatelessGPTIndex
from tokenloom.io import IndexedDataset
from tokenloom.source.protocol import DatasetInfo, SourceFields, gather_gpt_samples, read_by_dataset, resolve_eod


@dataclass(frozen=True, kw_only=True, eq=False)
class DatasetIndex:
    """One store's packed-sample index for one split."""

    prefix: str
    """The store, as the config names it."""
    key: str
    """Cache key of the item."""
    store: IndexedDataset
    """The token store, opened by mmap."""
    indices: GPTIndices | StatelessGPTIndex
    """Exact mode: ``document_index``, ``sample_index``, ``shuffle_index`` (memory maps) and the
    epoch plan. Stateless mode: the Feistel index around its memory-mapped prefix sums."""

    @property
    def num_samples(self) -> int:
        return self.indices.num_samples


class BuiltSplit(SourceFields):
    """One split of a build, readable by position (a ``SampleSource``)."""

    def __init__(self, *, name: str, datasets: tuple[DatasetIndex, ...], weights: tuple[float, ...],
                 dataset_index: np.ndarray | None, dataset_sample_index: np.ndarray | None,
                 blend: Blend | None = None,
                 num_samples: int, seq_length: int, add_extra_token: bool, build_key: str,
                 pad_id: int = PAD_TOKEN_ID) -> None:
        self.name = name
        """``train``, ``valid`` or ``test``."""
        self.dataset_indices = datasets
        """The per-store indices, in blend order."""
        self.dataset_index = dataset_index
        """(num_samples,) int16 memory map: dataset of each position; None for a single store."""
        self.dataset_sample_index = dataset_sample_index
        """(num_samples,) int64 memory map: sample of that dataset; None for a single store."""
        self.blend = blend
        """Stateless mode: the closed-form blend that locates positions; None otherwise."""
        self._num_samples = int(num_samples)
        self._seq_length = int(seq_length)
        self._add_extra_token = bool(add_extra_token)
        self._build_key = build_key
        self._pad_id = int(pad_id)
        self._datasets = tuple(
            DatasetInfo(name=d.prefix, weight=float(w), num_samples=d.num_samples, eod_id=resolve_eod(d.store, None))
            for d, w in zip(datasets, weights)
        )

    # -- SampleSource ---------------------------------------------------------------------------
    @property
    def num_samples(self) -> int:
        return self._num_samples

    def __len__(self) -> int:
        return self._num_samples

    def locate(self, positions) -> tuple[np.ndarray, np.ndarray]:
        """``(dataset_ids, sample_ids)`` (int64, shaped like ``positions``) of blend positions."""
        positions = np.asarray(positions, dtype=np.int64)
        if positions.size and (positions.min() < 0 or positions.max() >= self._num_samples):
            raise ConfigError(
                f"positions span [{int(positions.min())}, {int(positions.max())}]; the {self.name} split "
                f"has {self._num_samples} samples"
            )
        if self.blend is not None:
            dataset_ids, sample_ids = self.blend.lookup(positions)
            return np.asarray(dataset_ids, dtype=np.int64), np.asarray(sample_ids, dtype=np.int64)
        if self.dataset_index is None:
            return np.zeros(positions.shape, dtype=np.int64), positions.copy()
        return (np.asarray(self.dataset_index[positions], dtype=np.int64),
                np.asarray(self.dataset_sample_index[positions], dtype=np.int64))

    def read_samples(self, dataset_ids, sample_ids) -> np.ndarray:
        """``(B, seq_length + add_extra_token)`` int64 tokens of (dataset, sample) pairs."""
        def fill(d, rows, wanted, out):
            dataset = self.dataset_indices[d]
            if isinstance(dataset.indices, StatelessGPTIndex):
                out[rows] = read_stateless_samples(dataset.indices, dataset.store, wanted)
            else:
                out[rows] = gather_gpt_samples(dataset.indices, dataset.store, wanted, pad_id=self._pad_id)

        return read_by_dataset(dataset_ids, sample_ids, datasets=self._datasets,
                               width=self._seq_length + int(self._add_extra_token), fill=fill)

    def __getitem__(self, position: int) -> np.ndarray:
        """Tokens of one blend position (megatron-core's ``BlendedDataset[i]["text"]``)."""
        return self.read_samples(*self.locate(np.array([position])))[0]

    def __repr__(self) -> str:
        return (f"BuiltSplit({self.name!r}, datasets={len(self.dataset_indices)}, "
                f"num_samples={self._num_samples}, seq_length={self._seq_length})")


class BuildResult:
    """A finished build: the splits, the plan, the cache files, timings. Opened by mmap."""

    def __init__(self, *, cache: Cache, plan: BuildPlan, build_key: str, mode: str, manifest_path: str | None,
                 seq_length: int, add_extra_token: bool, weights: Mapping[str, tuple[float, ...]],
                 timings: Mapping[str, float], built_keys: frozenset[str], rank: int) -> None:
        self.cache = cache
        self.plan = plan
        self.build_key = build_key
        """Hash of the array-affecting config and every item key."""
        self.manifest_path = manifest_path
        """This build's manifest in the cache (as seen from this rank)."""
        self.timings = dict(timings)
        """Seconds spent in each phase on this rank."""
        self.built_keys = built_keys
        """Items built by this run (all ranks); the rest came from the cache."""
        self.rank = rank
        """This process's rank in the build's group."""
        self.mode = mode
        """``exact`` or ``stateless``."""
        stores: dict[str, IndexedDataset] = {}
        self._items = {item.key: item for item in plan.items}
        self._splits: dict[str, BuiltSplit] = {}
        for split in plan.splits:
            self._splits[split.name] = self._open_split(split, stores, seq_length, add_extra_token,
                                                        weights[split.name])

    def _open_split(self, split: SplitPlan, stores, seq_length, add_extra_token, weights) -> BuiltSplit:
        datasets = []
        for prefix, key in zip(split.prefixes, split.dataset_keys):
            item = self._items[key]
            if prefix not in stores:
                stores[prefix] = IndexedDataset(prefix)
            if self.mode == "stateless":
                record = self.cache.read_record(key)
                indices = open_stateless_gpt_index(
                    stores[prefix], record, self.cache.open_array(key, "block_token_starts"),
                    self.cache.open_array(key, "document_keys"))
            else:
                indices = GPTIndices(
                    document_index=self.cache.open_array(key, "document_index"),
                    sample_index=self.cache.open_array(key, "sample_index"),
                    shuffle_index=self.cache.open_array(key, "shuffle_index"),
                    plan=item.epoch_plan, seed=int(item.params["seed"]))
            datasets.append(DatasetIndex(prefix=prefix, key=key, store=stores[prefix], indices=indices))
        dataset_index = dataset_sample_index = blend = None
        if split.blend_key is not None and self.mode == "stateless":
            blend = stateless_blend(self._items[split.blend_key].params)
        elif split.blend_key is not None:
            dataset_index = self.cache.open_array(split.blend_key, "dataset_index")
            dataset_sample_index = self.cache.open_array(split.blend_key, "dataset_sample_index")
        return BuiltSplit(name=split.name, datasets=tuple(datasets), weights=tuple(weights),
                          dataset_index=dataset_index, dataset_sample_index=dataset_sample_index,
                          blend=blend, num_samples=split.num_samples, seq_length=seq_length,
                          add_extra_token=add_extra_token, build_key=self.build_key)

    @property
    def splits(self) -> dict[str, BuiltSplit]:
        """The splits that have data, by name."""
        return dict(self._splits)

    def split(self, name: str) -> BuiltSplit:
        """One split (``train``, ``valid``, ``test``) as a ``SampleSource``."""
        if name not in self._splits:
            raise ConfigError(f"split {name!r} has no data in this build; it has {sorted(self._splits)}")
        return self._splits[name]

    def __repr__(self) -> str:
        parts = ", ".join(f"{n}={len(s)}" for n, s in self._splits.items())
        return f"BuildResult({self.cache.root!r}, {parts}, build_key={self.build_key[:12]})"


__all__ = ["BuildResult", "BuiltSplit", "DatasetIndex"]

