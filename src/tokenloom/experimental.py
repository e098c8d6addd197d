"""Names that work and are tested, but whose shape may still change without notice.

Everything else a stage package exports (``tokenloom.serve``, ``tokenloom.builder``, ...) keeps its
signature across releases; these may not, for the reason beside each:

* :func:`simulate_job` and its :class:`JobReport` -- every rank of a DP x TP x PP x CP job served
  in one process, for demos and checks. The report holds what today's checks need (each step's
  global batch, the tensor-peer and context-parallel checks); what a planner or a CI check of a
  real job wants from it is not settled.
* :class:`GrainSource` -- a split as grain's ``RandomAccessDataSource``. grain's ``MapDataset.batch``
  reads it one record at a time (BENCHMARKS.md, "grain"), and the interface torchtitan's grain
  loader will take is still moving on its main branch; ``GrainStream``
  (:mod:`tokenloom.serve.grain_adapter`) is the stable way to feed grain. Importing it imports
  grain, so it loads on first use: ``import tokenloom.experimental`` loads neither grain nor torch.

A name leaves this module for its stage's package once its shape has held for a release.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tokenloom.serve.simulate import JobReport, simulate_job

if TYPE_CHECKING:  # pragma: no cover
    from tokenloom.serve.grain_adapter import GrainSource


def __getattr__(name: str) -> Any:
    """:class:`GrainSource`, imported (with grain) on first use."""
    if name == "GrainSource":
        try:
            from tokenloom.serve.grain_adapter import GrainSource
        except ModuleNotFoundError as exc:
            if exc.name != "grain":
                raise
            raise ImportError('tokenloom.experimental.GrainSource needs grain: pip install "tokenloom[grain]"') from exc
        return GrainSource
    raise AttributeError(f"module 'tokenloom.experimental' has no attribute {name!r}")


__all__ = ["GrainSource", "JobReport", "simulate_job"]
