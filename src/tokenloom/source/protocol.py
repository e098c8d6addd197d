"""What the serving stage reads from: a :class:`SampleSource`.

A source is one split of a build: a blend of ``num_samples`` packed samples, each drawn from one
dataset of the blend. Serving asks it two things, both vectorised over many positions at once:

* :meth:`SampleSource.locate` -- which dataset, and which sample of that dataset, sits at each
  global position of the blend;
* :meth:`SampleSource.read_samples` -- the tokens of many (dataset, sample) pairs, one row each.

``tokenloom.build``'s ``BuildResult.split(name)`` returns an object with this interface.
:class:`StoreBlendSource` is the same thing built in memory, directly from token stores and the
``tokenloom.index`` kernels, exactly as megatron-core's ``BlendedMegatronDatasetBuilder`` sizes
and builds a blended ``GPTDataset`` split.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence, runtime_checkable

import numpy as np

from tokenloom.errors import ConfigError
from tokenloom.index.blend_spec import DEFAULT_SURPLUS, megatron_normalize, megatron_sizes
from tokenloom.index.megatron_blend import megatron_blend
from tokenloom.index.megatron_gpt import PAD_TOKEN_ID, GPTIndices, build_megatron_gpt_indices
from tokenloom.index.split import SPLIT_NAMES, document_ids, split_document_ranges
from tokenloom.io import IndexedDataset
from tokenloom.source.gather import GATHER_BACKENDS, default_backend

MEGATRON_SURPLUS = DEFAULT_SURPLUS
"""megatron-core's default ``mid_level_dataset_surplus``: each dataset builds 0.5% more samples
than the blend asks of it."""


@dataclass(frozen=True, kw_only=True)
class DatasetInfo:
    """One dataset of a blend, as serving sees it."""

    name: str
    """A label for reports: the store prefix, or a name given in the build config."""

    weight: float
    """Target share of the blend's samples (the weights of a blend sum to 1)."""

    num_samples: int
    """Samples the dataset's index holds; ``sample_ids`` handed to ``read_samples`` stay below it."""

    eod_id: int | None
    """End-of-document token id from the store's tokenizer record; None when it has none."""


class SourceFields:
    """The read-only fields every in-memory :class:`SampleSource` shares; a subclass sets
    ``_build_key``, ``_seq_length``, ``_add_extra_token``, ``_pad_id`` and ``_datasets`` and
    defines ``num_samples``, ``locate`` and ``read_samples``."""

    _build_key: str
    _seq_length: int
    _add_extra_token: bool
    _pad_id: int
    _datasets: tuple[DatasetInfo, ...]

    @property
    def build_key(self) -> str:
        return self._build_key

    @property
    def seq_length(self) -> int:
        return self._seq_length

    @property
    def add_extra_token(self) -> bool:
        return self._add_extra_token

    @property
    def pad_id(self) -> int:
        return self._pad_id

    @property
    def datasets(self) -> tuple[DatasetInfo, ...]:
        return self._datasets


@runtime_checkable
class SampleSource(Protocol):
    """One split of a build, readable by position. Every method is vectorised."""

    @property
    def build_key(self) -> str:
        """Hex digest naming this build (config + inputs); a saved serving state carries it."""

    @property
    def num_samples(self) -> int:
        """Global positions in the blend: valid positions are ``[0, num_samples)``."""

    @property
    def seq_length(self) -> int:
        """Tokens per sample fed to the model (the labels are shifted by one)."""

    @property
    def add_extra_token(self) -> bool:
        """Whether each sample's row holds ``seq_length + 1`` tokens (megatron-core's default)."""

    @property
    def pad_id(self) -> int:
        """Token id filling short samples (megatron-core's pad id; -1 when the tokenizer has none)."""

    @property
    def datasets(self) -> tuple[DatasetInfo, ...]:
        """The blend's datasets, in dataset-id order."""

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(dataset_ids, sample_ids)``, two int64 arrays shaped like ``positions``."""

    def read_samples(self, dataset_ids: np.ndarray, sample_ids: np.ndarray) -> np.ndarray:
        """``(len(ids), seq_length + add_extra_token)`` int64 tokens, short rows padded with
        ``pad_id``; sample ``j`` of dataset ``d`` is row ``j`` of that dataset's index."""


def read_positions(source: SampleSource, positions) -> np.ndarray:
    """Tokens at global positions: ``source.read_samples(*source.locate(positions))``."""
    return source.read_samples(*source.locate(np.asarray(positions, dtype=np.int64)))


# --------------------------------------------------------------------------- reading packed samples


def gather_gpt_samples(indices: GPTIndices, store: IndexedDataset, sample_ids: np.ndarray, *,
                       pad_id: int = PAD_TOKEN_ID, backend: str | None = None, out: np.ndarray | None = None,
                       out_rows: np.ndarray | None = None) -> np.ndarray:
    """Tokens of many samples of one Megatron GPT index, copied in one call.

    Row ``k`` equals ``megatron_gpt_sample(indices, store, sample_ids[k]).tokens``: the
    ``seq_length + add_extra_token`` tokens, a short last sample padded with ``pad_id``.
    ``backend``: a key of ``tokenloom.source.gather.GATHER_BACKENDS`` (default: numba when
    installed, else numpy; identical results). With ``out`` and ``out_rows``, row ``k`` goes to
    ``out[out_rows[k]]`` instead (no intermediate block).
    """
    sample_ids = np.ascontiguousarray(sample_ids, dtype=np.int64)
    if out is None:
        out = np.empty((sample_ids.shape[0], indices.plan.sample_num_tokens), dtype=np.int64)  # (B, width)
        out_rows = np.arange(sample_ids.shape[0], dtype=np.int64)
    if sample_ids.shape[0]:
        GATHER_BACKENDS[_resolve(backend)][0](indices, store, sample_ids, pad_id, out,
                                              np.ascontiguousarray(out_rows, dtype=np.int64))
    return out


def _resolve(backend: str | None) -> str:
    name = default_backend() if backend is None else backend
    if name not in GATHER_BACKENDS:
        raise ConfigError(f"backend={backend!r}; expected one of {sorted(GATHER_BACKENDS)}")
    return name


# --------------------------------------------------------------------------- the in-memory source


def _eod_of(store: IndexedDataset) -> int | None:
    metadata = store.metadata or {}
    record = metadata.get("tokenizer") or {}
    eod = record.get("eod_id")
    return None if eod is None else int(eod)


def resolve_eod(store: IndexedDataset, eod_id: int | None) -> int | None:
    """The store's EOD id: its tokenizer record's, or ``eod_id`` when it has none."""
    recorded = _eod_of(store)
    if eod_id is not None and recorded is not None and int(eod_id) != recorded:
        raise ConfigError(f"{store.prefix}: eod_id={eod_id} but the store's tokenizer record says {recorded}; "
                          "drop eod_id or use stores made with that tokenizer")
    return recorded if eod_id is None else int(eod_id)


def check_blend_arguments(prefixes: Sequence[str], weights: Sequence[float] | None,
                          split_name: str) -> tuple[list[str], list[float]]:
    """Validate a blend's stores, weights (None: equal) and split name; return them normalised
    to lists of str and float."""
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
    return prefixes, weights


def read_by_dataset(dataset_ids, sample_ids, *, datasets: Sequence[DatasetInfo], width: int,
                    fill: Callable[[int, np.ndarray, np.ndarray, np.ndarray], None]) -> np.ndarray:
    """``(B, width)`` int64 tokens of (dataset, sample) pairs, gathered one dataset at a time.

    Every dataset id and sample id is checked against ``datasets`` first; then
    ``fill(d, rows, sample_ids_of_d, out)`` writes dataset ``d``'s samples into ``out[rows]``.
    """
    dataset_ids = np.asarray(dataset_ids, dtype=np.int64)
    sample_ids = np.asarray(sample_ids, dtype=np.int64)
    out = np.empty((dataset_ids.shape[0], width), dtype=np.int64)  # (B, seq_length + extra)
    for d in np.unique(dataset_ids):
        if not 0 <= d < len(datasets):
            raise ConfigError(f"dataset id {int(d)}; the blend has {len(datasets)} datasets")
        rows = np.flatnonzero(dataset_ids == d)
        wanted = sample_ids[rows]
        available = datasets[d].num_samples
        if wanted.min() < 0 or wanted.max() >= available:
            bad = int(wanted.min()) if wanted.min() < 0 else int(wanted.max())
            raise ConfigError(f"dataset {int(d)} ({datasets[d].name}) asked for sample {bad} but its index "
                              f"holds {available}; build it with more samples")
        fill(int(d), rows, wanted, out)
    return out


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode("utf-8")).hexdigest()


class StoreBlendSource(SourceFields):
    """A Megatron-exact blended split built in memory from token stores.

    Position ``i`` is megatron-core's ``BlendedDataset[i]`` for the same stores, weights, split,
    ``num_samples``, ``seq_length`` and ``seed`` (its ``random_seed``). Use
    :meth:`from_prefixes`; the constructor takes already-built parts.
    """

    def __init__(self, *, stores: Sequence[IndexedDataset], indices: Sequence[GPTIndices],
                 infos: Sequence[DatasetInfo], dataset_index: np.ndarray,
                 dataset_sample_index: np.ndarray, seq_length: int, add_extra_token: bool,
                 pad_id: int, build_key: str) -> None:
        self._stores = tuple(stores)
        self._indices = tuple(indices)
        self._datasets = tuple(infos)
        self.dataset_index = dataset_index
        """(num_samples,) int16: the dataset of each position (megatron-core's array)."""
        self.dataset_sample_index = dataset_sample_index
        """(num_samples,) int64: the sample of that dataset at each position."""
        self._seq_length = int(seq_length)
        self._add_extra_token = bool(add_extra_token)
        self._pad_id = int(pad_id)
        self._build_key = build_key

    @classmethod
    def from_prefixes(cls, prefixes: Sequence[str], weights: Sequence[float] | None = None, *,
                      num_samples: int, seq_length: int, seed: int = 1234, split: str = "1,0,0",
                      split_name: str = "train", add_extra_token: bool = True,
                      surplus: float = MEGATRON_SURPLUS, pad_id: int = PAD_TOKEN_ID,
                      drop_last_partial: bool = True, eod_id: int | None = None,
                      names: Sequence[str] | None = None) -> "StoreBlendSource":
        """Open the stores and build megatron-core's indices for one split of a weighted blend.

        ``weights`` default to equal; ``seed`` is megatron-core's ``random_seed``; ``split`` its
        split string and ``split_name`` one of "train", "valid", "test". ``drop_last_partial=False``
        keeps (and pads) a short last sample of the valid split, megatron-core's
        ``drop_last_partial_validation_sequence=False``; other splits always drop it. ``eod_id``
        supplies the end-of-document id for stores without a tokenizer record (e.g. written by
        Megatron-LM's preprocess_data.py); a store whose record says otherwise is a ConfigError.
        """
        prefixes, weights = check_blend_arguments(prefixes, weights, split_name)
        if isinstance(num_samples, bool) or not isinstance(num_samples, (int, np.integer)) or num_samples < 1:
            raise ConfigError(f"num_samples={num_samples!r}; expected a positive integer")
        if names is not None and len(names) != len(prefixes):
            raise ConfigError(f"{len(names)} names for {len(prefixes)} prefixes")
        sizes = megatron_sizes(weights, int(num_samples), surplus=surplus)
        # BlendedDataset normalises the builder's already normalised weights once more.
        blend_weights = megatron_normalize(megatron_normalize(weights)).tolist()
        built, blend_size = sizes.buffers, sizes.blended_size
        stores = [IndexedDataset(p) for p in prefixes]
        drop_last = split_name != "valid" or bool(drop_last_partial)
        indices, infos, inputs = [], [], []
        for d, (prefix, store) in enumerate(zip(prefixes, stores)):
            document_range = getattr(split_document_ranges(split, store.num_sequences), split_name)
            if document_range is None:
                raise ConfigError(f"split={split!r} gives the {split_name} split no weight; nothing to serve")
            gpt = build_megatron_gpt_indices(store.sequence_lengths, document_ids(document_range),
                                             num_samples=built[d], seq_length=seq_length, seed=seed,
                                             add_extra_token=add_extra_token,
                                             drop_last_partial=drop_last)
            indices.append(gpt)
            infos.append(DatasetInfo(name=prefix if names is None else names[d], weight=blend_weights[d],
                                     num_samples=gpt.num_samples, eod_id=resolve_eod(store, eod_id)))
            lengths_digest = hashlib.sha256(memoryview(np.ascontiguousarray(store.sequence_lengths))).hexdigest()
            inputs.append({"prefix": prefix, "num_sequences": store.num_sequences, "lengths_sha256": lengths_digest})
        dataset_index, dataset_sample_index = megatron_blend(blend_weights, blend_size)
        key = _digest({"kind": "store-blend", "inputs": inputs, "weights": weights,
                       "num_samples": int(num_samples), "seq_length": int(seq_length), "seed": int(seed),
                       "split": split, "split_name": split_name, "add_extra_token": bool(add_extra_token),
                       "surplus": surplus, "pad_id": int(pad_id), "drop_last_partial": drop_last})
        return cls(stores=stores, indices=indices, infos=infos, dataset_index=dataset_index,
                   dataset_sample_index=dataset_sample_index, seq_length=seq_length,
                   add_extra_token=add_extra_token, pad_id=pad_id, build_key=key)

    # -- SampleSource ---------------------------------------------------------------------------
    @property
    def num_samples(self) -> int:
        return int(self.dataset_index.shape[0])

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        positions = np.asarray(positions, dtype=np.int64)
        if positions.size and (positions.min() < 0 or positions.max() >= self.num_samples):
            raise ConfigError(
                f"positions span [{int(positions.min())}, {int(positions.max())}]; the blend has "
                f"{self.num_samples} samples; build with a larger num_samples to serve further"
            )
        return (self.dataset_index[positions].astype(np.int64),
                self.dataset_sample_index[positions].astype(np.int64))

    def read_samples(self, dataset_ids: np.ndarray, sample_ids: np.ndarray) -> np.ndarray:
        def fill(d, rows, wanted, out):
            gather_gpt_samples(self._indices[d], self._stores[d], wanted, pad_id=self._pad_id, out=out, out_rows=rows)

        return read_by_dataset(dataset_ids, sample_ids, datasets=self._datasets,
                               width=self._seq_length + int(self._add_extra_token), fill=fill)

    def __repr__(self) -> str:
        return (f"StoreBlendSource(datasets={len(self._datasets)}, num_samples={self.num_samples}, "
                f"seq_length={self._seq_length}, build_key={self._build_key[:12]})")


__all__ = [
    "DatasetInfo",
    "MEGATRON_SURPLUS",
    "SampleSource",
    "SourceFields",
    "StoreBlendSource",
    "gather_gpt_samples",
    "read_by_dataset",
    "read_positions",
    "resolve_eod",
]
