"""Batch geometry and 3D-parallel planning: the first stage of plan -> tokenize -> build -> serve.

Before a run, decide tensor, pipeline and data parallel sizes, the micro-batch, and how long it
will take, from the published formulas (Narayanan et al. 2021; Korthikanti et al. 2022; ZeRO)::

    import tokenloom
    p = tokenloom.plan("gpt3-175b", "a100-80gb", num_gpus=1024,
                       global_batch_size=1536, train_tokens=300_000_000_000)
    p.best.label()              # 'tp=4 pp=16 dp=16 vpp=6 mbs=1 accum=96'
    p.training_days_estimate    # 33.8: 8TP/(nX), "about 34 days"
    p.geometry().write_json("geometry.json")   # read by tokenloom build and the loader

The parts, split by concern: specs (inputs) -> formulas (published equations) -> layout (one
candidate's cost) -> search (enumerate and rank) -> geometry (the file build and serve read) ->
report (the table); api holds :func:`plan`, which takes presets and keyword fields.
"""

from tokenloom.planning import formulas
from tokenloom.planning.api import plan
from tokenloom.planning.data_geometry import DataGeometry
from tokenloom.planning.formulas import (
    activation_bytes,
    activation_bytes_per_layer,
    flops_per_iteration,
    gpt_flops_per_iteration,
    gpt_parameter_count,
    model_state_bytes,
    model_state_bytes_per_parameter,
    parameter_count,
    pipeline_bubble_fraction,
    training_days_estimate,
)
from tokenloom.planning.layout import Layout, MemoryEstimate, evaluate_layout
from tokenloom.planning.presets import GPU_PRESETS, MODEL_PRESETS, cluster_preset, model_preset
from tokenloom.planning.report import format_plan
from tokenloom.planning.search import Plan, plan_layout
from tokenloom.planning.specs import ClusterSpec, ModelSpec, PlanOptions, TrainingSpec

__all__ = [
    "GPU_PRESETS",
    "MODEL_PRESETS",
    "ClusterSpec",
    "DataGeometry",
    "Layout",
    "MemoryEstimate",
    "ModelSpec",
    "Plan",
    "PlanOptions",
    "TrainingSpec",
    "activation_bytes",
    "activation_bytes_per_layer",
    "cluster_preset",
    "evaluate_layout",
    "flops_per_iteration",
    "format_plan",
    "formulas",
    "gpt_flops_per_iteration",
    "gpt_parameter_count",
    "model_preset",
    "model_state_bytes",
    "model_state_bytes_per_parameter",
    "parameter_count",
    "pipeline_bubble_fraction",
    "plan",
    "plan_layout",
    "training_days_estimate",
]
