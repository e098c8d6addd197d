"""tokenloom: the data layer of large language model pretraining.

plan -> tokenize -> build -> serve. The two entry points are plain functions::

    import tokenloom
    p = tokenloom.plan("gpt3-175b", "a100-80gb", num_gpus=1024, global_batch_size=1536)
    result = tokenloom.build("build.yaml")        # on every rank of a job, or alone

Importing tokenloom is light: the stage packages (``tokenloom.planning``, ``tokenloom.tokenization``,
``tokenloom.builder``, ``tokenloom.serve``, ...) load when first used, and torch, jax and numba
only when a function needs them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tokenloom._version import __version__
from tokenloom.errors import BuildError, ConfigError, FormatError, InputError, PositionError, TokenloomError

if TYPE_CHECKING:  # pragma: no cover
    from tokenloom.builder import BuildPlan, BuildResult
    from tokenloom.planning import Plan


def build(config: Any, group: Any = None, **options: Any) -> BuildResult | BuildPlan:
    """Build (or reuse from the cache) every index of ``config`` and open them on every rank.

    ``config`` is a :class:`tokenloom.builder.BuildConfig`, a mapping, or a YAML/JSON path;
    ``group`` a torch.distributed process group (default: every rank of a running job, or this
    process alone). See :func:`tokenloom.builder.build` for ``dry_run`` and the callbacks.
    """
    from tokenloom.builder.runner import build as build_indices

    return build_indices(config, group, **options)


def plan(*args: Any, **kwargs: Any) -> Plan:
    """Plan a training run's 3D-parallel layout and batch geometry; see :func:`tokenloom.planning.plan`."""
    from tokenloom.planning.api import plan as plan_run

    return plan_run(*args, **kwargs)


_PLANNING_NAMES = ("ClusterSpec", "DataGeometry", "ModelSpec", "Plan", "PlanOptions", "TrainingSpec", "plan_layout")


def __getattr__(name: str) -> Any:
    """The planner's types, loaded on first use (``tokenloom.ModelSpec`` and friends)."""
    if name in _PLANNING_NAMES:
        import tokenloom.planning as planning

        return getattr(planning, name)
    raise AttributeError(f"module 'tokenloom' has no attribute {name!r}")


__all__ = [
    "BuildError",
    "ClusterSpec",
    "ConfigError",
    "DataGeometry",
    "FormatError",
    "InputError",
    "ModelSpec",
    "Plan",
    "PlanOptions",
    "PositionError",
    "TokenloomError",
    "TrainingSpec",
    "__version__",
    "build",
    "plan",
    "plan_layout",
]
