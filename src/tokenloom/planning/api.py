"""``plan(model, cluster, ...)``: presets and keyword fields in, a ranked :class:`Plan` out.

The one function a user calls; :func:`tokenloom.plan` is this function, imported on first use.
"""

from __future__ import annotations

from dataclasses import replace

from tokenloom.errors import ConfigError
from tokenloom.planning.presets import cluster_preset, model_preset
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
    """:func:`tokenloom.plan`, whose docstring says what the arguments mean."""
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


__all__ = ["plan"]
