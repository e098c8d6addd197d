"""One reader per kind of packed-sample index: sample ids of one dataset -> rows of tokens.

A reader pairs a token store with the index that cuts it into samples:

* :class:`MegatronReader` -- megatron-core's three arrays (:class:`~tokenloom.index.megatron_gpt.GPTIndices`),
  in memory or memory-mapped from a build's cache;
* :class:`StatelessReader` -- tokenloom's Feistel index
  (:class:`~tokenloom.index.stateless.StatelessGPTIndex`), which computes each sample's document
  pieces from a seed and a few bytes per document;
* :class:`BestFitReader` -- whole documents packed best fit
  (:class:`~tokenloom.index.best_fit_index.BestFitIndex`): a sample's pieces, then padding.

Both copy a batch of samples straight from the memory-mapped store into rows of one
``(B, seq_length + add_extra_token)`` int64 block with one compiled call
(:mod:`tokenloom.source.gather`). A blended source (:mod:`tokenloom.source.blended`) holds one
reader per dataset.
"""

from __future__ import annotations

import errno
import resource
import threading
from collections.abc import Callable

import numpy as np

from tokenloom.errors import ConfigError, FormatError
from tokenloom.index.megatron_gpt import PAD_TOKEN_ID, GPTIndices
from tokenloom.index.stateless import SampleSpans, StatelessGPTIndex
from tokenloom.io import IndexedDataset
from tokenloom.io.s3 import is_remote
from tokenloom.source.gather import gather_kernels


def resolve_eod(store: IndexedDataset, eod_id: int | None) -> int | None:
    """The store's end-of-document id: its tokenizer record's, or ``eod_id`` when it has none;
    ConfigError when both exist and differ."""
    record = (store.metadata or {}).get("tokenizer") or {}
    recorded = None if record.get("eod_id") is None else int(record["eod_id"])
    if eod_id is not None and recorded is not None and int(eod_id) != recorded:
        raise ConfigError(f"{store.prefix}: eod_id={eod_id} but the store's tokenizer record says {recorded}; "
                          "drop eod_id or use stores made with that tokenizer")
    return recorded if eod_id is None else int(eod_id)


def gather_gpt_samples(indices: GPTIndices, store: IndexedDataset, sample_ids: np.ndarray, *,
                       pad_id: int = PAD_TOKEN_ID, backend: str | None = None, out: np.ndarray | None = None,
                       out_rows: np.ndarray | None = None, ends: np.ndarray | None = None,
                       counts: np.ndarray | None = None) -> np.ndarray:
    """Tokens of many samples of one Megatron GPT index, copied in one call.

    Row ``k`` equals ``megatron_gpt_sample(indices, store, sample_ids[k]).tokens``: the
    ``seq_length + add_extra_token`` tokens, a short last sample padded with ``pad_id``.
    ``backend``: a key of ``tokenloom.source.gather.GATHER_BACKENDS`` (default: numba when
    installed, else numpy; identical results). With ``out`` and ``out_rows``, row ``k`` goes to
    ``out[out_rows[k]]`` instead (no intermediate block). With ``ends`` and ``counts`` the rows'
    document pieces are recorded too (:mod:`tokenloom.source.gather`).
    """
    sample_ids = np.ascontiguousarray(sample_ids, dtype=np.int64)
    if out is None:
        out = np.empty((sample_ids.shape[0], indices.plan.sample_num_tokens), dtype=np.int64)  # (B, width)
        out_rows = np.arange(sample_ids.shape[0], dtype=np.int64)
    if sample_ids.shape[0]:
        gather_kernels(backend).gpt_rows(indices, store, sample_ids, pad_id, out,
                                         np.ascontiguousarray(out_rows, dtype=np.int64), ends, counts)
    return out


class StoreOpener:
    """Opens one token store on first use and keeps it open (shared by the readers of a store).

    A build over 10,000 stores opens none of them until serving reads from one: each open store
    holds two file descriptors (its .idx and .bin maps), so a process touches only what it reads.
    """

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._store: IndexedDataset | None = None
        self._lock = threading.Lock()

    @property
    def is_open(self) -> bool:
        return self._store is not None

    def __reduce__(self):  # a copy in another process opens the store there, on its first read
        return (StoreOpener, (self.prefix,))

    def __call__(self) -> IndexedDataset:
        if self._store is None:
            with self._lock:
                if self._store is None:
                    self._store = _open_store(self.prefix)
        return self._store


def _open_store(prefix: str) -> IndexedDataset:
    try:
        return IndexedDataset(prefix)
    except OSError as exc:
        if exc.errno != errno.EMFILE:
            raise
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        raise ConfigError(
            f"{prefix}: cannot open the store: this process has reached its limit of {soft} open files "
            "(ulimit -n); every store read from holds 2 (its .idx and .bin memory maps), so reading "
            f"from N stores needs about 2N + 100; raise the limit (ulimit -n) before starting the job") from exc


class DatasetReader:
    """Reads samples of one dataset (a store and its index); see the two kinds below.

    ``store`` and ``indices`` may be given as zero-argument callables (a :class:`StoreOpener`,
    a function that opens the index): they are called on the first read, and ``num_samples`` must
    then be given, so that opening a blend of thousands of datasets touches no store.
    """

    def __init__(self, *, name: str, store: IndexedDataset | Callable[[], IndexedDataset],
                 indices: GPTIndices | StatelessGPTIndex | Callable[[], GPTIndices | StatelessGPTIndex],
                 key: str | None = None, prefix: str | None = None, num_samples: int | None = None) -> None:
        self.name = name
        """The dataset's label: its store prefix, or a name given to the blend."""
        self.key = key
        """Cache key of the build item that made ``indices``; None for an index made in memory."""
        self._store = None if callable(store) else store
        self._open_store = store if self._store is None else None
        self._indices = None if callable(indices) else indices
        self._open_indices = indices if self._indices is None else None
        if self._indices is None and num_samples is None:
            raise ConfigError(f"{name}: a reader whose index opens on first use needs num_samples")
        self._num_samples = self._indices.num_samples if self._indices is not None else int(num_samples)
        self._prefix = prefix if prefix is not None else (self._store.prefix if self._store is not None
                                                          else getattr(store, "prefix", None))

    def __getstate__(self) -> dict:
        """A copy sent to another process (DataLoader or grain workers) opens its store and index
        itself where they open on first use, instead of carrying the mapped arrays' bytes."""
        state = dict(self.__dict__)
        if self._open_store is not None:
            state["_store"] = None
        if self._open_indices is not None:
            state["_indices"] = None
        return state

    @property
    def store_open(self) -> bool:
        """Whether this reader's store is open (a build's readers open it on their first read)."""
        return self._store is not None or bool(getattr(self._open_store, "is_open", False))

    @property
    def store(self) -> IndexedDataset:
        """The token store, memory-mapped (opened now if it was not)."""
        if self._store is None:
            self._store = self._open_store()
        return self._store

    @property
    def indices(self) -> GPTIndices | StatelessGPTIndex:
        """The packed-sample index over ``store`` (opened now if it was not)."""
        if self._indices is None:
            indices = self._open_indices()
            if indices.num_samples != self._num_samples:
                raise FormatError(f"{self.name}: its index holds {indices.num_samples} samples but the build "
                                  f"recorded {self._num_samples}; the cache entry {self.key} does not match "
                                  "its plan (run tokenloom verify on the cache)")
            self._indices = indices
        return self._indices

    @property
    def num_samples(self) -> int:
        """Samples in the index; sample ids handed to :meth:`read_into` stay below it."""
        return self._num_samples

    @property
    def prefix(self) -> str:
        """The store's path prefix."""
        return self._prefix if self._prefix is not None else self.store.prefix

    @property
    def is_remote(self) -> bool:
        """Whether the store is on object storage (known without opening it)."""
        if self._prefix is not None:
            return is_remote(self._prefix)
        return bool(getattr(self._store, "is_remote", False))

    def read_into(self, sample_ids: np.ndarray, out: np.ndarray, out_rows: np.ndarray, *,
                  backend: str | None = None, ends: np.ndarray | None = None,
                  counts: np.ndarray | None = None) -> None:
        """Write sample ``sample_ids[k]`` (served order) into ``out[out_rows[k]]``; with ``ends``
        and ``counts``, also where each of its document pieces ends in the row
        (``ends[out_rows[k], :counts[out_rows[k]]]``, :class:`~tokenloom.source.protocol.PieceRows`)."""
        raise NotImplementedError

    def spans(self, sample_ids) -> SampleSpans:
        """The document pieces of samples ``sample_ids`` (served order): which documents of the
        store, from which token and how many, each sample reads (provenance, without the tokens)."""
        raise NotImplementedError

    def loss_masks_into(self, sample_ids: np.ndarray, out: np.ndarray, out_rows: np.ndarray, *,
                        backend: str | None = None) -> None:
        """Write the store's loss mask of sample ``sample_ids[k]`` into ``out[out_rows[k]]``
        (uint8), column for column with the row :meth:`read_into` writes: the masks of the pieces
        :meth:`spans` lists, in order, then 1 on the padding after them (the padding mask, not
        this one, keeps padding out of the loss). A store without a sidecar gives ones."""
        sample_ids = np.ascontiguousarray(sample_ids, dtype=np.int64)
        out_rows = np.ascontiguousarray(out_rows, dtype=np.int64)
        if not self.store.has_loss_mask or sample_ids.shape[0] == 0:
            out[out_rows] = 1
            return
        gather_kernels(backend).mask_rows(self.store, self.spans(sample_ids), out, out_rows)

    def read(self, sample_ids, *, backend: str | None = None) -> np.ndarray:
        """``(len(sample_ids), seq_length + add_extra_token)`` int64 tokens."""
        sample_ids = np.ascontiguousarray(sample_ids, dtype=np.int64)
        out = np.empty((sample_ids.shape[0], self.indices.plan.sample_num_tokens), dtype=np.int64)
        self.read_into(sample_ids, out, np.arange(sample_ids.shape[0], dtype=np.int64), backend=backend)
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, num_samples={self.num_samples})"


class MegatronReader(DatasetReader):
    """A dataset on megatron-core's arrays: sample ``i`` is megatron-core's ``GPTDataset[i]``."""

    def __init__(self, *, name: str, store, indices, key: str | None = None, pad_id: int = PAD_TOKEN_ID,
                 prefix: str | None = None, num_samples: int | None = None) -> None:
        super().__init__(name=name, store=store, indices=indices, key=key, prefix=prefix, num_samples=num_samples)
        self.pad_id = int(pad_id)
        """Fills the short last sample a validation split keeps (``drop_last_partial=False``)."""

    def read_into(self, sample_ids: np.ndarray, out: np.ndarray, out_rows: np.ndarray, *,
                  backend: str | None = None, ends: np.ndarray | None = None,
                  counts: np.ndarray | None = None) -> None:
        gather_gpt_samples(self.indices, self.store, sample_ids, pad_id=self.pad_id, backend=backend, out=out,
                           out_rows=out_rows, ends=ends, counts=counts)

    def spans(self, sample_ids) -> SampleSpans:
        # the pieces megatron-core's GPTDataset reads: from the first position's offset to the
        # last position's offset (plus the extra token), whole documents between
        indices = self.indices
        sample_ids = np.ascontiguousarray(sample_ids, dtype=np.int64)
        extra = int(indices.plan.add_extra_token)
        rows = indices.shuffle_index[sample_ids].astype(np.int64)  # (B,)
        begin = indices.sample_index[rows].astype(np.int64)  # (B, 2): position, offset
        end = indices.sample_index[rows + 1].astype(np.int64)  # (B, 2)
        num_parts = end[:, 0] - begin[:, 0] + 1  # (B,)
        bounds = np.zeros(sample_ids.shape[0] + 1, dtype=np.int64)
        np.cumsum(num_parts, out=bounds[1:])
        sample_of_part = np.repeat(np.arange(sample_ids.shape[0]), num_parts)  # (P,)
        positions = begin[sample_of_part, 0] + (np.arange(sample_of_part.shape[0]) - bounds[sample_of_part])
        documents = indices.document_index[positions].astype(np.int64)  # (P,)
        offsets = np.where(positions == begin[sample_of_part, 0], begin[sample_of_part, 1], 0)
        lengths = self.store.sequence_lengths[documents].astype(np.int64)
        stops = np.where(positions == end[sample_of_part, 0], end[sample_of_part, 1] + extra, lengths)
        return SampleSpans(bounds=bounds, document_ids=documents, offsets=offsets, lengths=stops - offsets,
                           positions=positions)


class StatelessReader(DatasetReader):
    """A dataset on tokenloom's stateless index: every sample is a whole window of tokens."""

    def __init__(self, *, name: str, store, indices, key: str | None = None, prefix: str | None = None,
                 num_samples: int | None = None) -> None:
        super().__init__(name=name, store=store, indices=indices, key=key, prefix=prefix, num_samples=num_samples)

    def read_into(self, sample_ids: np.ndarray, out: np.ndarray, out_rows: np.ndarray, *,
                  backend: str | None = None, ends: np.ndarray | None = None,
                  counts: np.ndarray | None = None) -> None:
        sample_ids = np.ascontiguousarray(sample_ids, dtype=np.int64)
        spans = self.indices.spans(sample_ids)
        rows = np.ascontiguousarray(out_rows, dtype=np.int64)
        gather_kernels(backend).span_rows(self.store, spans, PAD_TOKEN_ID, out, rows, ends, counts, sample_ids)

    def spans(self, sample_ids) -> SampleSpans:
        return self.indices.spans(np.ascontiguousarray(sample_ids, dtype=np.int64))


class BestFitReader(StatelessReader):
    """A dataset of whole documents packed best fit: a sample is its pieces, then padding
    (:data:`~tokenloom.index.megatron_gpt.PAD_TOKEN_ID`, which the fields keep out of the loss).
    The stateless reader's gather serves it: both kinds hand over a sample's pieces, and the
    gather pads what they leave of the row."""


__all__ = ["BestFitReader", "DatasetReader", "MegatronReader", "StatelessReader", "StoreOpener", "gather_gpt_samples",
           "resolve_eod"]
