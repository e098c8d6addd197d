"""Build stage: a blend config -> ready indices for every split, on every rank, cached.

    import tokenloom.build as tb
    result = tb.build("build.yaml")            # or tb.build(config, group=pg) inside a job
    train = result.split("train")              # a SampleSource for tokenloom.serve
    train.read_samples(*train.locate([0, 1]))  # megatron-core's BlendedDataset[0], [1]

Importing this package never imports torch; torch.distributed is used only when a group is given
or a distributed job (torchrun) is running.
"""

import sys
import types

from tokenloom.build.cache import VerifyReport, verify_cache
from tokenloom.build.config import BuildConfig, DatasetBlend, load_build_config
from tokenloom.build.items import BuildPlan, WorkItem, format_plan
from tokenloom.build.result import BuildResult, BuiltSplit, DatasetIndex
from tokenloom.build.runner import build

__all__ = [
    "BuildConfig",
    "BuildPlan",
    "BuildResult",
    "BuiltSplit",
    "DatasetBlend",
    "DatasetIndex",
    "VerifyReport",
    "WorkItem",
    "build",
    "format_plan",
    "load_build_config",
    "verify_cache",
]


class _CallableModule(types.ModuleType):
    """Makes ``tokenloom.build(config, group=None)`` call :func:`build` (the package stays a
    package: ``tokenloom.build.BuildConfig`` and friends work as usual)."""

    def __call__(self, config, group=None, **kwargs):
        return build(config, group, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
