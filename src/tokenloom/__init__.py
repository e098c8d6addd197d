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

from tokenloom import _moved
from tokenloom._version import __version__
from tokenloom.errors import (
    BuildError,
    ConfigError,
    FormatError,
    InputError,
    PositionError,
    StorageError,
    TokenloomError,
)

if TYPE_CHECKING:  # pragma: no cover
    import os
    from collections.abc import Callable, Mapping

    from tokenloom.builder import BuildConfig, BuildPlan, BuildResult
    from tokenloom.planning import ClusterSpec, ModelSpec, Plan, PlanOptions, TrainingSpec


def build(config: BuildConfig | Mapping[str, Any] | str | os.PathLike, group: Any = None, *, dry_run: bool = False,
          on_progress: Callable[[int, int], None] | None = None,
          on_plan: Callable[[BuildPlan, frozenset[str]], None] | None = None) -> BuildResult | BuildPlan:
    """Build (or reuse from the cache) every index of ``config`` and open them on every rank.

    ``config`` is a :class:`tokenloom.builder.BuildConfig`, a mapping, or a YAML/JSON path (its
    relative paths name files beside it). ``group`` is a torch.distributed process group of the
    ranks that build together (default: every rank of an initialised job, or this process alone);
    the build makes its own gloo group over those ranks. Every rank of the group calls ``build``
    with the same config.

    Returns a :class:`tokenloom.builder.BuildResult` (``result.split("train")`` is what serving
    reads), or with ``dry_run`` the :class:`tokenloom.builder.BuildPlan` (nothing written).
    ``on_plan(plan, cached_keys)`` is called on rank 0 once the plan is known; ``on_progress(done,
    total)`` reports items done while building, on rank 0.
    """
    from tokenloom.builder.runner import build as build_indices

    return build_indices(config, group, dry_run=dry_run, on_progress=on_progress, on_plan=on_plan)


def plan(model: ModelSpec | str, cluster: ClusterSpec | str, training: TrainingSpec | None = None,
         options: PlanOptions | None = None, *, num_gpus: int | None = None, **fields: Any) -> Plan:
    """Plan a training run's 3D-parallel layout and batch geometry.

    ``model`` and ``cluster`` are a :class:`tokenloom.planning.ModelSpec` and
    :class:`~tokenloom.planning.ClusterSpec`, or preset names
    (:func:`tokenloom.planning.model_preset_names`, :func:`~tokenloom.planning.gpu_preset_names`; a
    GPU preset needs ``num_gpus``). Instead of ``training`` and ``options`` objects
    (:class:`~tokenloom.planning.TrainingSpec`, :class:`~tokenloom.planning.PlanOptions`), their
    fields may be given as keywords (``global_batch_size=1536, recompute="full"``); ClusterSpec
    fields given as keywords override the preset or spec (``achieved_tflops=163``). Returns a
    :class:`tokenloom.planning.Plan`: the ranked layouts, ``best`` first.
    """
    from tokenloom.planning.api import plan as plan_run

    return plan_run(model, cluster, training, options, num_gpus=num_gpus, **fields)


#: Names this package exported before its face was curated, and the module each is imported from
#: now; importing one from here still works, with a DeprecationWarning (:mod:`tokenloom._moved`).
_MOVED = {
    "ClusterSpec": "tokenloom.planning",
    "DataGeometry": "tokenloom.planning",
    "ModelSpec": "tokenloom.planning",
    "Plan": "tokenloom.planning",
    "PlanOptions": "tokenloom.planning",
    "TrainingSpec": "tokenloom.planning",
    "plan_layout": "tokenloom.planning",
}


def __getattr__(name: str) -> Any:
    return _moved.moved_attribute(__name__, name, _MOVED)


__all__ = [
    "BuildError",
    "ConfigError",
    "FormatError",
    "InputError",
    "PositionError",
    "StorageError",
    "TokenloomError",
    "__version__",
    "build",
    "plan",
]
