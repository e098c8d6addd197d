"""Serving: exact micro-batches for every rank of a DP x TP x PP x CP job, resumable on any layout.

The last stage of plan -> tokenize -> build -> serve. A build's split (a
:class:`tokenloom.source.SampleSource`) becomes one global sample stream; :class:`BatchGeometry`
cuts it into steps and micro-batches, :class:`Topology` says which rank reads what, and
:class:`RankLoader` yields numpy micro-batches with megatron-core's fields, as
:class:`SampleOptions` asks. One batch pipeline, :class:`BatchPipeline`, turns ``(dataset_id,
sample_id)`` pairs into those fields for every loader, and their shapes and dtypes
(:func:`field_schema`) are derived from it. :class:`MixtureAudit` logs what each step served;
:class:`OnlineMixing` moves the weights with the loss the training loop reports.
``BatchGeometry(balance="attention")`` places each step's samples on the ranks by their attention
cost, decided from the index (:func:`balance_report` shows the imbalance it removes, :func:`slots_of`
where each position goes).

The framework adapters are modules of their own, imported by name: ``tokenloom.serve.torch_adapter``
(PyTorch), ``tokenloom.serve.jax_adapter`` (JAX) and ``tokenloom.serve.grain_adapter`` (grain). They
only convert the pipeline's arrays, and importing this package imports none of their frameworks.
This package exports what a user constructs or calls; the parts they are made of (the stream, the
sampler, the field kernels, the context-parallel split) stay importable from their modules.
"""

from tokenloom import _moved
from tokenloom.serve.audit import (
    MixtureAudit,
    batch_fingerprint,
    by_store,
    read_audit_log,
    summarize_audit,
    summarize_skips,
)
from tokenloom.serve.balance import BalanceReport, Slot, balance_report, slots_of
from tokenloom.serve.batch import BatchPipeline, FieldSpec, field_schema
from tokenloom.serve.fim import FimTransform
from tokenloom.serve.geometry import BatchGeometry, BatchSizeSchedule
from tokenloom.serve.loader import RankLoader
from tokenloom.serve.online import ExponentiatedGradient, OnlineMixing
from tokenloom.serve.sampler import stream_from_state
from tokenloom.serve.samples import SampleOptions
from tokenloom.serve.topology import LoadMode, Topology

#: Names this package exported before its face was curated, and the module each is imported from
#: now; importing one from here still works, with a DeprecationWarning (:mod:`tokenloom._moved`).
_MOVED = {
    "JobReport": "tokenloom.experimental",
    "simulate_job": "tokenloom.experimental",
    "read_fields": "tokenloom.serve.batch",
    "read_batch": "tokenloom.serve.loader",
    "MicroBatchSampler": "tokenloom.serve.sampler",
    "SCHEMA_VERSION": "tokenloom.serve.sampler",
    "STATE_FORMAT": "tokenloom.serve.sampler",
    "check_state": "tokenloom.serve.sampler",
    "build_fields": "tokenloom.serve.samples",
    "BlendSegment": "tokenloom.serve.weight_changes",
    "SampleStream": "tokenloom.serve.stream",
    "RankCoordinates": "tokenloom.serve.topology",
    "RankPlan": "tokenloom.serve.topology",
    "context_parallel_positions": "tokenloom.serve.topology",
    "context_parallel_slice": "tokenloom.serve.topology",
    "DatasetInfo": "tokenloom.source",
    "SampleSource": "tokenloom.source",
    "StatelessBlendSource": "tokenloom.source",
    "StoreBlendSource": "tokenloom.source",
    "read_positions": "tokenloom.source.protocol",
    "gather_gpt_samples": "tokenloom.source.readers",
    "FimOptions": "tokenloom.source",
}


def __getattr__(name: str) -> object:
    return _moved.moved_attribute(__name__, name, _MOVED)


__all__ = [
    "BalanceReport",
    "BatchGeometry",
    "BatchPipeline",
    "BatchSizeSchedule",
    "ExponentiatedGradient",
    "FieldSpec",
    "FimTransform",
    "LoadMode",
    "MixtureAudit",
    "OnlineMixing",
    "RankLoader",
    "SampleOptions",
    "Slot",
    "Topology",
    "balance_report",
    "batch_fingerprint",
    "by_store",
    "field_schema",
    "read_audit_log",
    "slots_of",
    "stream_from_state",
    "summarize_audit",
    "summarize_skips",
]
