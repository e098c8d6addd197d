"""Micro-batches for one rank of a DP x TP x PP x CP job, as numpy arrays.

    loader = RankLoader(source, BatchGeometry(global_batch_size=64, micro_batch_size=2, dp=4),
                        topology=Topology(dp=4, tp=2, pp=2), rank=rank)
    for batch in loader:          # None on ranks that receive by broadcast or need nothing
        ...
    state = loader.state_dict()   # the same on every rank; resume on any layout

Reads go through the one batch pipeline, :class:`tokenloom.serve.batch.BatchPipeline`: one
``read_samples`` call per micro-batch, one gather per dataset in it (a compiled copy from the
memory map, or ``read_spans``; see ``tokenloom.source``).
"""

from __future__ import annotations

import logging
from typing import Any, Iterator

import numpy as np

from tokenloom.errors import ConfigError
from tokenloom.serve.audit import MixtureAudit
from tokenloom.serve.batch import BatchPipeline, check_eod
from tokenloom.serve.geometry import BatchGeometry
from tokenloom.serve.sampler import MicroBatchSampler
from tokenloom.serve.samples import SampleOptions
from tokenloom.serve.stream import SampleStream
from tokenloom.serve.topology import LoadMode, Topology
from tokenloom.source import SampleSource

logger = logging.getLogger(__name__)


def read_batch(stream: SampleStream, positions, options: SampleOptions = SampleOptions()) -> dict[str, np.ndarray]:
    """Every field of the samples at global ``positions`` of ``stream`` (megatron-core's, plus
    ``dataset_id``): the batch pipeline on the located ``(dataset_id, sample_id)`` pairs."""
    dataset_ids, sample_ids = stream.locate(positions)  # (B,) int64 each
    return BatchPipeline(stream.source, options=options).read(dataset_ids, sample_ids)


class RankLoader:
    """Iterates this rank's micro-batches; every rank advances in step, loaders or not."""

    def __init__(self, source: SampleSource | SampleStream, geometry: BatchGeometry, *,
                 topology: Topology | None = None, rank: int = 0, options: SampleOptions = SampleOptions(),
                 mode: LoadMode | str = LoadMode.BROADCAST, max_steps: int | None = None,
                 audit: MixtureAudit | None = None) -> None:
        self.topology = topology or Topology(dp=geometry.dp)
        if self.topology.dp != geometry.dp:
            raise ConfigError(f"the topology has dp={self.topology.dp} but the batch geometry dp={geometry.dp}; "
                              "expected the same data-parallel size")
        self.plan = self.topology.plan(rank, mode)
        self.options = options
        self.sampler = MicroBatchSampler(source, geometry, dp_rank=self.plan.coordinates.dp_rank,
                                         max_steps=max_steps)
        check_eod(self.sampler.source, options)
        self.pipeline = BatchPipeline(self.sampler.source, options=options, fields=self.plan.fields,
                                      cp_size=self.topology.cp, cp_rank=self.plan.coordinates.cp_rank)
        """Reads this rank's fields (its stage's, its context-parallel chunks)."""
        self.audit = audit

    @property
    def stream(self) -> SampleStream:
        return self.sampler.stream

    def __iter__(self) -> Iterator[dict[str, np.ndarray] | None]:
        while not self.sampler.exhausted():
            yield self.next_batch()

    def next_batch(self) -> dict[str, np.ndarray] | None:
        """This rank's next micro-batch (None when it receives by broadcast or needs nothing)."""
        if self.sampler.exhausted():
            raise StopIteration
        if self.audit is not None and self.sampler.micro_batch == 0:
            self.audit.record_step(self.sampler)
        positions = self.sampler.positions()
        self.sampler.advance()
        if not self.plan.loads:
            return None
        return self.pipeline.read(*self.stream.locate(positions))

    def state_dict(self) -> dict[str, Any]:
        """Layout-free state; identical on every rank."""
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume; when an audit log is attached, the next step's fingerprint is checked against it."""
        self.sampler.load_state_dict(state)
        if self.audit is not None:
            self.audit.check_resume(self.sampler)

    def reweight(self, weights) -> None:
        """Change the blend weights from the next step on (see :meth:`MicroBatchSampler.reweight`)."""
        self.sampler.reweight(weights)
        stream = self.sampler.stream
        if stream.num_samples < stream.source.num_samples and self.plan.coordinates.rank == 0:
            logger.warning("with the new weights the stream ends at position %d of %d: a dataset's index runs "
                           "out there (build it with more samples to serve further)", stream.num_samples,
                           stream.source.num_samples)


__all__ = ["RankLoader", "read_batch"]
