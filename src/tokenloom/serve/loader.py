"""Micro-batches for one rank of a DP x TP x PP x CP job, as numpy arrays.

    loader = RankLoader(source, BatchGeometry(global_batch_size=64, micro_batch_size=2, dp=4),
                        topology=Topology(dp=4, tp=2, pp=2), rank=rank)
    for batch in loader:          # None on ranks that receive by broadcast or need nothing
        ...
    state = loader.state_dict()   # the same on every rank; resume on any layout

:class:`RankSchedule` is what every per-rank loader shares (this one, the JAX ``HostLoader`` on
top of it, and the PyTorch ``DistributedBatches``): the micro-batch schedule, the audit, None
for middle pipeline stages, and the layout-free state. A subclass says how a rank gets one
micro-batch. Reads go through the one batch pipeline, :class:`tokenloom.serve.batch.BatchPipeline`:
one ``read_samples`` call per micro-batch, one gather per dataset in it (a compiled copy from the
memory map, or ``read_spans``; see ``tokenloom.source``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import numpy as np

from tokenloom.errors import ConfigError
from tokenloom.serve.audit import MixtureAudit
from tokenloom.serve.balance import check_balance
from tokenloom.serve.batch import BatchPipeline, check_eod
from tokenloom.serve.geometry import BatchGeometry
from tokenloom.serve.online import OnlineMixing
from tokenloom.serve.sampler import MicroBatchSampler, refuse_on_length_runs
from tokenloom.serve.samples import SampleOptions
from tokenloom.serve.stream import SampleStream
from tokenloom.serve.topology import LoadMode, RankPlan, Topology
from tokenloom.source import SampleSource

logger = logging.getLogger(__name__)


def read_batch(stream: SampleStream, positions, options: SampleOptions = SampleOptions()) -> dict[str, np.ndarray]:
    """Every field of the samples at global ``positions`` of ``stream`` (megatron-core's, plus
    ``dataset_id``): the batch pipeline on the located ``(dataset_id, sample_id)`` pairs."""
    dataset_ids, sample_ids = stream.locate(positions)  # (B,) int64 each
    return BatchPipeline(stream.source, options=options).read(dataset_ids, sample_ids)


class RankSchedule:
    """The schedule one rank follows, whatever it does with the data; every rank advances in step.

    Sets up the rank's plan and :class:`MicroBatchSampler`, refusing on every rank alike a
    topology whose dp differs from the geometry's, options that need EOD ids a dataset lacks, and
    a balance by attention without document boundaries.
    :meth:`next_batch` raises StopIteration when no step is left, logs a step to the audit before
    its first micro-batch, returns None on middle pipeline stages and otherwise what
    :meth:`_micro_batch` makes of the positions, then advances (a micro-batch whose read raises
    is not counted as served). The state is the sampler's: layout-free, the same on every rank.
    """

    def __init__(self, source: SampleSource | SampleStream, geometry: BatchGeometry, topology: Topology, rank: int,
                 *, options: SampleOptions, mode: LoadMode | str, max_steps: int | None,
                 audit: MixtureAudit | None, mixing: OnlineMixing | None = None) -> None:
        if topology.dp != geometry.dp:
            raise ConfigError(f"the topology has dp={topology.dp} but the batch geometry dp={geometry.dp}; "
                              "expected the same data-parallel size")
        self.topology = topology
        self.mode = LoadMode(mode)
        check_balance(geometry, options)
        self.plan: RankPlan = topology.plan(rank, self.mode, boundaries=options.boundary_fields)
        self.options = options
        self.sampler = MicroBatchSampler(source, geometry, dp_rank=self.plan.coordinates.dp_rank,
                                         max_steps=max_steps)
        check_eod(self.sampler.source, options)
        self.audit = audit
        """A :class:`~tokenloom.serve.audit.MixtureAudit` (give it to one rank) logs every step."""
        self.mixing = mixing
        """:class:`~tokenloom.serve.online.OnlineMixing`: weights that follow the reported loss."""
        if mixing is not None:
            refuse_on_length_runs(self.sampler.stream, "online mixing")
            mixing.attach(self.sampler)

    def _micro_batch(self, positions: np.ndarray):
        """This rank's micro-batch at ``positions`` (``(micro,)`` int64 global positions), called
        before the sampler advances past it, on ranks whose stage consumes fields."""
        raise NotImplementedError

    def __iter__(self) -> Iterator[Any]:
        while not self.sampler.exhausted():
            yield self.next_batch()

    def next_batch(self):
        """This rank's next micro-batch (None on a middle pipeline stage)."""
        sampler = self.sampler
        if sampler.exhausted():
            raise StopIteration
        if self.audit is not None and sampler.micro_batch == 0:
            self.audit.record_step(sampler)
        batch = self._micro_batch(sampler.positions()) if self.plan.fields else None
        sampler.advance()
        return batch

    def state_dict(self) -> dict[str, Any]:
        """Layout-free state; identical on every rank."""
        state = self.sampler.state_dict()
        if self.mixing is not None:
            state["online_mixing"] = self.mixing.state_dict()
        return state

    def report(self, tokens, loss_sums) -> bool:
        """After every optimizer step, on every rank: each dataset's tokens and summed loss in the
        step, all-reduced over data-parallel ranks (:class:`~tokenloom.serve.online.OnlineMixing`).
        True when it changed the weights of a later step."""
        if self.mixing is None:
            raise ConfigError("report() feeds online mixing; this loader has none (give mixing=OnlineMixing(...))")
        return self.mixing.report(self.sampler, tokens, loss_sums)

    def skip_steps(self, first: int, stop: int) -> None:
        """Never serve the samples of steps ``[first, stop)``; later steps get the samples that
        follow (:meth:`MicroBatchSampler.skip_steps`). Call it on every rank, between steps."""
        self.sampler.skip_steps(first, stop)

    def quarantine(self, items) -> None:
        """Never serve a sample holding a piece of any ``(store prefix, document id)`` of
        ``items`` from the next step on (:meth:`MicroBatchSampler.quarantine`). Every rank, between steps."""
        self.sampler.quarantine(items)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume (on any layout, between steps); when an audit log is attached, the next step's
        fingerprint is checked against it."""
        mixed = state.get("online_mixing") if isinstance(state, dict) else None
        if (mixed is None) != (self.mixing is None):
            raise ConfigError("the serving state was saved " + ("with" if mixed is not None else "without")
                              + " online mixing and this loader has " + ("none" if self.mixing is None else "it")
                              + "; resume with the mixing the run started with")
        self.sampler.load_state_dict(state)
        if self.mixing is not None:
            self.mixing.load_state_dict(mixed)
        if self.audit is not None:
            self.audit.check_resume(self.sampler)


class RankLoader(RankSchedule):
    """Iterates this rank's micro-batches as dicts of numpy arrays: the fields of its pipeline
    stage plus ``dataset_id``, cut to its context-parallel chunks; None on ranks that receive
    by broadcast (``LoadMode.BROADCAST``, tensor rank > 0) or need nothing."""

    def __init__(self, source: SampleSource | SampleStream, geometry: BatchGeometry, *,
                 topology: Topology | None = None, rank: int = 0, options: SampleOptions = SampleOptions(),
                 mode: LoadMode | str = LoadMode.BROADCAST, max_steps: int | None = None,
                 audit: MixtureAudit | None = None, mixing: OnlineMixing | None = None) -> None:
        super().__init__(source, geometry, topology or Topology(dp=geometry.dp), rank, options=options, mode=mode,
                         max_steps=max_steps, audit=audit, mixing=mixing)
        self.pipeline = BatchPipeline(self.sampler.source, options=options, fields=self.plan.fields,
                                      cp_size=self.topology.cp, cp_rank=self.plan.coordinates.cp_rank)
        """Reads this rank's fields (its stage's, its context-parallel chunks)."""

    @property
    def stream(self) -> SampleStream:
        return self.sampler.stream

    def _micro_batch(self, positions: np.ndarray) -> dict[str, np.ndarray] | None:
        if not self.plan.loads:
            return None
        dataset_ids, sample_ids = self.stream.locate(positions)  # (micro,) int64 each
        return self.pipeline.read(dataset_ids, sample_ids)

    def reweight(self, weights) -> None:
        """Change the blend weights from the next step on (see :meth:`MicroBatchSampler.reweight`)."""
        self.sampler.reweight(weights)
        stream = self.sampler.stream
        if stream.num_samples < stream.source.num_samples and self.plan.coordinates.rank == 0:
            logger.warning("with the new weights the stream ends at position %d of %d: a dataset's index runs "
                           "out there (build it with more samples to serve further)", stream.num_samples,
                           stream.source.num_samples)


__all__ = ["RankLoader", "RankSchedule", "read_batch"]
