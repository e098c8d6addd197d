"""grain: a built split as a grain data source, and tokenloom's stream as a grain dataset.

MaxText and torchtitan build their input pipelines on grain (grain's own worker processes,
prefetch, transformations, and checkpointing through its iterator state). Two ways in, both
reading through serve's one batch pipeline (:class:`~tokenloom.serve.batch.BatchPipeline`), so the
fields are the ones every other loader serves:

* :class:`GrainSource` -- grain's ``RandomAccessDataSource`` protocol over a split's global
  positions: ``source[i]`` is the sample at position ``i`` of the stream as a dict of per-sample
  fields (tokens, labels, loss mask, position ids, and the document-boundary fields its
  :class:`~tokenloom.serve.samples.SampleOptions` ask for), ``_getitems`` reads many in one
  gather. For a pipeline that keeps grain's own sampler, shuffling and sharding (torchtitan's
  ``RandomAccessDataSource``, ``grain.MapDataset.source``, ``grain.DataLoader``). It pickles to
  grain's worker processes without its arrays: a build's split maps its stores and index arrays
  in the worker, on the first read, as the torch adapter's workers do.
* :class:`GrainStream` -- tokenloom's global stream as a ``grain.IterDataset``: each element is
  this host's rows of one global batch, exactly :class:`~tokenloom.serve.jax_adapter.HostLoader`'s
  (process ``shard_index`` of ``shard_count`` reads rows ``[p G / P, (p + 1) G / P)`` of every
  global batch of ``G``), with weight changes, skips and quarantines (through the iterator's
  ``loader``). Its iterator's grain state
  is tokenloom's serving state (:meth:`GrainStreamIterator.get_state`): the same on every host and
  free of the layout, so a run checkpointed through grain on 4 hosts restores on 2 or 8 with the
  identical global batches. Under grain's worker processes (``mp_prefetch``), worker ``k`` of
  ``W`` reads steps ``k, k + W, ...`` and grain interleaves them back in order; grain keeps one
  such state per worker, so a restore needs the same number of workers (grain's rule), on any
  number of hosts.

This module imports grain at the top (like the torch adapter imports torch); ``tokenloom.serve``
does not import it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import grain
import numpy as np

from tokenloom.errors import ConfigError
from tokenloom.serve.audit import MixtureAudit
from tokenloom.serve.batch import BatchPipeline
from tokenloom.serve.jax_adapter import HostLoader, ShardOptions
from tokenloom.serve.samples import SampleOptions
from tokenloom.serve.stream import SampleStream
from tokenloom.source import SampleSource
from tokenloom.validate import is_integer

STATE_FORMAT = "tokenloom-grain-stream"
STATE_VERSION = 1


def _stream(source: SampleSource | SampleStream) -> SampleStream:
    return source if isinstance(source, SampleStream) else SampleStream(source)


class GrainSource:
    """grain's ``RandomAccessDataSource`` over the global positions of a split (module docstring).

    ``source``: a split (``BuildResult.split("train")``, any ``SampleSource``) or a
    :class:`~tokenloom.serve.stream.SampleStream` (its weight changes apply). ``options``: the
    fields (``boundary_format="thd"`` packs a whole micro-batch, so it is refused: a record is one
    sample). ``fields``: the names to keep (None: all, with ``dataset_id``).
    """

    def __init__(self, source: SampleSource | SampleStream, *, options: SampleOptions = SampleOptions(),
                 fields: Sequence[str] | None = None) -> None:
        if options.boundary_format == "thd":
            raise ConfigError("GrainSource with SampleOptions(boundary_format='thd'): the packed form joins the "
                              "samples of a micro-batch, and a grain record is one sample; expected 'megatron' "
                              "(per-sample cu_seqlens) or 'segments' (MaxText's), and pack after batching")
        self.stream = _stream(source)
        self.options = options
        self.fields = None if fields is None else tuple(fields)
        self._pipeline: BatchPipeline | None = None

    def __getstate__(self) -> dict:  # a worker builds its pipeline (and maps the arrays) itself
        return {"stream": self.stream, "options": self.options, "fields": self.fields}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["stream"], options=state["options"], fields=state["fields"])

    @property
    def pipeline(self) -> BatchPipeline:
        if self._pipeline is None:
            self._pipeline = BatchPipeline(self.stream.source, options=self.options, fields=self.fields)
        return self._pipeline

    def __len__(self) -> int:
        return int(self.stream.num_samples)

    def _check(self, positions: np.ndarray) -> None:
        n = len(self)
        if positions.size and (int(positions.min()) < 0 or int(positions.max()) >= n):
            bad = int(positions[(positions < 0) | (positions >= n)][0])
            raise IndexError(f"position {bad} of a split of {n} samples; expected 0 .. {n - 1}")

    def read(self, positions) -> dict[str, np.ndarray]:
        """The fields of the samples at ``positions``, batched: ``(len(positions), ...)`` each."""
        positions = np.asarray(positions, dtype=np.int64).reshape(-1)  # (B,)
        self._check(positions)
        dataset_ids, sample_ids = self.stream.locate(positions)
        return self.pipeline.read(dataset_ids, sample_ids)

    def __getitem__(self, position: int) -> dict[str, np.ndarray]:
        if not is_integer(position):
            raise TypeError(f"GrainSource[{position!r}]; expected an integer position")
        batch = self.read(np.array([int(position)]))
        return {name: value[0] for name, value in batch.items()}

    # TODO(grain): grain 0.2.18's MapDataset.batch reads records one by one and never calls this;
    # a batch would read in one gather only through a grain that does (or a batching transform of ours).
    def _getitems(self, positions: Sequence[int]) -> list[dict[str, np.ndarray]]:
        """Many records in one gather (grain's batched-read protocol)."""
        batch = self.read(np.asarray(list(positions), dtype=np.int64))
        return [{name: value[k] for name, value in batch.items()} for k in range(len(positions))]

    def __repr__(self) -> str:  # grain's DataLoader checks a restored state against it
        source = self.stream.source
        return (f"GrainSource(build_key={getattr(source, 'build_key', None)!r}, num_samples={len(self)}, "
                f"options={self.options!r}, fields={self.fields!r})")


class GrainStreamIterator(grain.DatasetIterator):
    """Iterates this host's rows of each global batch; its grain state is tokenloom's serving state."""

    def __init__(self, stream: GrainStream) -> None:
        super().__init__()
        self._dataset = stream
        self._loader = HostLoader(stream.source, global_batch_size=stream.global_batch_size, shard=stream.shard,
                                  options=stream.options, max_steps=stream.max_steps, audit=stream.audit,
                                  balance=stream.balance)
        first, self._stride = stream.worker_steps
        self._loader.pass_steps(first)  # a worker process starts at its own first step

    def __next__(self) -> dict[str, np.ndarray]:
        batch = next(self._loader)
        # the other workers' steps: passed now, so that the state names this worker's next step
        self._loader.pass_steps(self._stride - 1)
        return batch

    @property
    def loader(self) -> HostLoader:
        """The :class:`HostLoader` underneath: skips, quarantines and weight changes go through its
        ``skip_steps``, ``quarantine`` and ``reweight`` (every host, between steps) and travel in
        :meth:`get_state`."""
        return self._loader

    def get_state(self) -> dict[str, Any]:
        """JSON-ready: tokenloom's layout-free serving state (the same on every host)."""
        return {"format": STATE_FORMAT, "version": STATE_VERSION, "tokenloom": self._loader.state_dict()}

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`get_state`'s dict, saved on any number of hosts."""
        if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
            what = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise ConfigError(f"a grain state of {what}; expected one a GrainStream iterator saved "
                              f"(format {STATE_FORMAT!r})")
        if state.get("version") != STATE_VERSION:
            raise ConfigError(f"a {STATE_FORMAT} state of version {state.get('version')!r}; this tokenloom reads "
                              f"version {STATE_VERSION}")
        self._loader.load_state_dict(state["tokenloom"])

    def __str__(self) -> str:
        return f"GrainStreamIterator({self._dataset})"


class GrainStream(grain.IterDataset):
    """tokenloom's global stream as a ``grain.IterDataset`` of this host's rows per global batch.

    ``shard``: grain's ``ShardOptions`` (or tokenloom's, or anything with ``shard_index`` and
    ``shard_count``); ``global_batch_size`` must divide by ``shard_count``. ``options``: the
    fields, as :class:`HostLoader` takes them (``"segments"`` for MaxText's packed inputs).
    ``balance``: ``"attention"`` or ``"tokens"`` places each global batch's rows on the hosts by
    cost, as :class:`HostLoader` does (the batch holds the same rows).
    """

    def __init__(self, source: SampleSource | SampleStream, *, global_batch_size: int, shard,
                 options: SampleOptions = SampleOptions(), max_steps: int | None = None,
                 audit: MixtureAudit | None = None, balance: str | None = None) -> None:
        super().__init__()
        self.source = source
        self.balance = balance
        self.global_batch_size = global_batch_size
        self.shard = ShardOptions.of(shard)
        self.options = options
        self.max_steps = max_steps
        self.audit = audit
        # refuses a bad geometry or options here, not in the first next()
        HostLoader(source, global_batch_size=global_batch_size, shard=self.shard, options=options,
                   max_steps=max_steps, balance=balance)
        self.worker_steps = (0, 1)
        """``(first, stride)``: the steps this copy serves (grain's worker processes set it)."""

    def set_slice(self, sl: slice, sequential_slice: bool = False) -> None:
        """grain's worker processes: this copy serves every ``sl.step``-th step from ``sl.start``
        (called in the worker, before it iterates)."""
        if sequential_slice:
            raise ConfigError("GrainStream with mp_prefetch(sequential_slice=True): a stream of steps has no "
                              "contiguous block per worker; expected the default, interleaved steps")
        if self.audit is not None:
            raise ConfigError("GrainStream(audit=...) under grain's worker processes: each worker sees every "
                              "W-th step, so none can log the mixture; audit the host batches in the main process")
        start, _, step = sl.indices(1 << 62)
        self.worker_steps = (int(start), int(step))

    def __iter__(self) -> GrainStreamIterator:
        return GrainStreamIterator(self)

    def __str__(self) -> str:
        return (f"GrainStream(global_batch_size={self.global_batch_size}, shard={self.shard.shard_index}/"
                f"{self.shard.shard_count})")


# GrainSource is experimental (tokenloom.experimental says why); it stays defined here, beside the stream.
__all__ = ["GrainStream", "GrainStreamIterator"]
