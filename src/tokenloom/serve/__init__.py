"""Serving: exact micro-batches for every rank of a DP x TP x PP x CP job, resumable on any layout.

The last stage of plan -> tokenize -> build -> serve. A build's split (a :class:`SampleSource`)
becomes one global sample stream; :class:`BatchGeometry` cuts it into steps and micro-batches,
:class:`Topology` says which rank reads what, and :class:`RankLoader` yields numpy micro-batches
with megatron-core's fields. One batch pipeline, :class:`BatchPipeline` (:func:`read_fields`),
turns ``(dataset_id, sample_id)`` pairs into those fields for every loader, and their shapes and
dtypes (:func:`field_schema`) are derived from it. The PyTorch and JAX adapters (``tokenloom.serve.torch_adapter``,
``tokenloom.serve.jax_adapter``) only convert its arrays and import their frameworks lazily;
importing this package imports neither.
"""

from tokenloom.serve.audit import (
    MixtureAudit,
    batch_fingerprint,
    read_audit_log,
    summarize_audit,
    summarize_skips,
)
from tokenloom.serve.batch import BatchPipeline, FieldSpec, field_schema, read_fields
from tokenloom.serve.geometry import BatchGeometry, BatchSizeSchedule
from tokenloom.serve.loader import RankLoader, read_batch
from tokenloom.serve.sampler import (
    SCHEMA_VERSION,
    STATE_FORMAT,
    MicroBatchSampler,
    check_state,
)
from tokenloom.serve.samples import SampleOptions, build_fields
from tokenloom.serve.simulate import JobReport, simulate_job
from tokenloom.serve.stream import BlendSegment, SampleStream
from tokenloom.serve.topology import (
    LoadMode,
    RankCoordinates,
    RankPlan,
    Topology,
    context_parallel_positions,
    context_parallel_slice,
)
from tokenloom.source import (
    DatasetInfo,
    SampleSource,
    StatelessBlendSource,
    StoreBlendSource,
    gather_gpt_samples,
    read_positions,
)

__all__ = [
    "SCHEMA_VERSION",
    "STATE_FORMAT",
    "BatchGeometry",
    "BatchPipeline",
    "BatchSizeSchedule",
    "BlendSegment",
    "DatasetInfo",
    "FieldSpec",
    "JobReport",
    "LoadMode",
    "MicroBatchSampler",
    "MixtureAudit",
    "RankCoordinates",
    "RankLoader",
    "RankPlan",
    "SampleOptions",
    "SampleSource",
    "SampleStream",
    "StatelessBlendSource",
    "StoreBlendSource",
    "Topology",
    "batch_fingerprint",
    "build_fields",
    "check_state",
    "context_parallel_positions",
    "context_parallel_slice",
    "field_schema",
    "gather_gpt_samples",
    "read_audit_log",
    "read_batch",
    "read_fields",
    "read_positions",
    "simulate_job",
    "summarize_audit",
    "summarize_skips",
]
