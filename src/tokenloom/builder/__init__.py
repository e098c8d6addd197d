"""Build stage: a blend config -> ready indices for every split, on every rank, cached.

    import tokenloom
    result = tokenloom.build("build.yaml")     # or tokenloom.build(config, group=pg) inside a job
    train = result.split("train")              # a SampleSource for tokenloom.serve
    train.read_samples(*train.locate([0, 1]))  # megatron-core's BlendedDataset[0], [1]

Importing this package never imports torch; torch.distributed is used only when a group is given
or a distributed job (torchrun) is running.
"""

from tokenloom.builder.cache_verify import VerifyReport, verify_cache
from tokenloom.builder.config import BuildConfig, load_build_config
from tokenloom.builder.items import BuildPlan, WorkItem, format_plan
from tokenloom.builder.result import BuildResult
from tokenloom.builder.runner import build

__all__ = [
    "BuildConfig",
    "BuildPlan",
    "BuildResult",
    "VerifyReport",
    "WorkItem",
    "build",
    "format_plan",
    "load_build_config",
    "verify_cache",
]

