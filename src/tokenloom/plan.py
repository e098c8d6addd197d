"""Batch geometry and 3D-parallel planning: the first stage of plan -> tokenize -> build -> serve.

Before a run, decide tensor, pipeline and data parallel sizes, the micro-batch, and how long it
will take, from the published formulas (Narayanan et al. 2021; Korthikanti et al. 2022; ZeRO)::

    import tokenloom
    p = tokenloom.plan("gpt3-175b", "a100-80gb", num_gpus=1024,
                       global_batch_size=1536, train_tokens=300_000_000_000)
    p.best.label()              # 'tp=4 pp=16 dp=16 vpp=6 mbs=1 accum=96'
    p.training_days_estimate    # 33.8: 8TP/(nX), "about 34 days"
    p.geometry().write_json("geometry.json")   # read by tokenloom build and the loader

This module is callable: ``tokenloom.plan(...)`` is :func:`plan`, and ``tokenloom.plan.ModelSpec``
and friends are here too. The pieces live in :mod:`tokenloom.planning`.
"""

from __future__ import annotations

import sys
import types
from dataclasses import replace

from tokenloom.errors import ConfigError
from tokenloom.planning import formulas
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
from tokenloom.planning.geometry import DataGeometry
from tokenloom.planning.layout import Layout, MemoryEstimate, evaluate_layout
from tokenloom.planning.presets import GPU_PRESETS, MODEL_PRESETS, cluster_preset, model_preset
from tokenloom.planning.report import format_plan
from tokenloom.planning.search import Plan, plan_layout
from tokenloom.planning.specs import ClusterSpec, ModelSpec, PlanOptions, TrainingSpec

_OPTION_FIELDS = {f for f in PlanOptions.__dataclass_fields__}
_TRAINING_FIELDS = {f for f in TrainingSpec.__dataclass_fields__}
_CLUSTER_FIELDS = {f for f in ClusterSpec.__dataclass_fields__} - {"num_gpus"}


def plan(
    model: ModelSpec | str,
    cluster: ClusterSpec | str,
    training: TrainingSpec | None = None,
    options: PlanOptions | None = None,
    *,
    num_gpus: int | None = None,
    **fields: object,
) -> Plan:
    """Plan a run. ``model`` and ``cluster`` are specs or preset names (:data:`MODEL_PRESETS`,
    :data:`GPU_PRESETS`; a GPU preset needs ``num_gpus``). Instead of ``training`` and ``options``
    objects, their fields may be given as keywords (``global_batch_size=1536, recompute="full"``);
    ClusterSpec fields given as keywords override the preset or spec (``achieved_tflops=163``).
    """
    unknown = sorted(set(fields) - _OPTION_FIELDS - _TRAINING_FIELDS - _CLUSTER_FIELDS)
    if unknown:
        raise ConfigError(f"unknown plan arguments {unknown}; TrainingSpec fields are {sorted(_TRAINING_FIELDS)}, "
                          f"PlanOptions fields are {sorted(_OPTION_FIELDS)}, ClusterSpec fields are "
                          f"{sorted(_CLUSTER_FIELDS)}")
    model_spec = model_preset(model) if isinstance(model, str) else model
    cluster_fields = {k: v for k, v in fields.items() if k in _CLUSTER_FIELDS}
    if isinstance(cluster, str):
        if num_gpus is None:
            raise ConfigError(f"a cluster given by GPU preset name ({cluster!r}) needs num_gpus")
        cluster_spec = cluster_preset(cluster, num_gpus=num_gpus, **cluster_fields)
    else:
        if num_gpus is not None:
            cluster_fields["num_gpus"] = num_gpus
        cluster_spec = replace(cluster, **cluster_fields) if cluster_fields else cluster
    training_fields = {k: v for k, v in fields.items() if k in _TRAINING_FIELDS}
    option_fields = {k: v for k, v in fields.items() if k in _OPTION_FIELDS}
    if training is not None and training_fields:
        raise ConfigError(f"give either a TrainingSpec or its fields, not both (got {sorted(training_fields)})")
    if options is not None and option_fields:
        raise ConfigError(f"give either PlanOptions or its fields, not both (got {sorted(option_fields)})")
    training_spec = training if training is not None else TrainingSpec(**training_fields)
    option_spec = options if options is not None else PlanOptions(**option_fields)
    return plan_layout(model_spec, cluster_spec, training_spec, option_spec)


class _CallableModule(types.ModuleType):
    """Lets ``tokenloom.plan`` be both this module and the :func:`plan` function."""

    def __call__(self, *args: object, **kwargs: object) -> Plan:
        return plan(*args, **kwargs)  # type: ignore[arg-type]


sys.modules[__name__].__class__ = _CallableModule

__all__ = [
    "plan", "plan_layout", "Plan", "Layout", "MemoryEstimate", "evaluate_layout",
    "ModelSpec", "ClusterSpec", "TrainingSpec", "PlanOptions", "DataGeometry",
    "MODEL_PRESETS", "GPU_PRESETS", "model_preset", "cluster_preset", "format_plan", "formulas",
    "parameter_count", "gpt_parameter_count", "model_state_bytes", "model_state_bytes_per_parameter",
    "activation_bytes_per_layer", "activation_bytes", "flops_per_iteration", "gpt_flops_per_iteration",
    "pipeline_bubble_fraction", "training_days_estimate",
]
