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
report (the table). :func:`tokenloom.plan` takes presets and keyword fields; this package
exports the specs, :func:`plan_layout` over them, the presets and the report. The equations are
:mod:`tokenloom.planning.formulas`, imported by name.
"""

from tokenloom import _moved
from tokenloom.planning.data_geometry import DataGeometry
from tokenloom.planning.layout import Layout, MemoryEstimate, evaluate_layout
from tokenloom.planning.presets import cluster_preset, gpu_preset_names, model_preset, model_preset_names
from tokenloom.planning.report import format_plan
from tokenloom.planning.search import Plan, plan_layout
from tokenloom.planning.specs import ClusterSpec, ModelSpec, PlanOptions, TrainingSpec

#: Names this package exported before its face was curated, and the module each is imported from
#: now; importing one from here still works, with a DeprecationWarning (:mod:`tokenloom._moved`).
_MOVED = {
    "plan": "tokenloom",
    "activation_bytes": "tokenloom.planning.formulas",
    "activation_bytes_per_layer": "tokenloom.planning.formulas",
    "flops_per_iteration": "tokenloom.planning.formulas",
    "gpt_flops_per_iteration": "tokenloom.planning.formulas",
    "gpt_parameter_count": "tokenloom.planning.formulas",
    "model_state_bytes": "tokenloom.planning.formulas",
    "model_state_bytes_per_parameter": "tokenloom.planning.formulas",
    "parameter_count": "tokenloom.planning.formulas",
    "pipeline_bubble_fraction": "tokenloom.planning.formulas",
    "training_days_estimate": "tokenloom.planning.formulas",
    "GPU_PRESETS": "tokenloom.planning.presets",
    "MODEL_PRESETS": "tokenloom.planning.presets",
}


def __getattr__(name: str) -> object:
    return _moved.moved_attribute(__name__, name, _MOVED)


__all__ = [
    "ClusterSpec",
    "DataGeometry",
    "Layout",
    "MemoryEstimate",
    "ModelSpec",
    "Plan",
    "PlanOptions",
    "TrainingSpec",
    "cluster_preset",
    "evaluate_layout",
    "format_plan",
    "gpu_preset_names",
    "model_preset",
    "model_preset_names",
    "plan_layout",
]
