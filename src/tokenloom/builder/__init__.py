"""Build stage: a blend config -> ready indices for every split, on every rank, cached.

    import tokenloom
    result = tokenloom.build("build.yaml")     # or tokenloom.build(config, group=pg) inside a job
    train = result.split("train")              # a SampleSource for tokenloom.serve
    train.read_samples(*train.locate([0, 1]))  # megatron-core's BlendedDataset[0], [1]

Importing this package never imports torch; torch.distributed is used only when a group is given
or a distributed job (torchrun) is running.
"""

from tokenloom import _moved
from tokenloom.builder.cache_verify import VerifyReport, verify_cache
from tokenloom.builder.config import BuildConfig, load_build_config
from tokenloom.builder.items import BuildPlan
from tokenloom.builder.result import BuildResult
from tokenloom.builder.tokenize import tokenize_on_ranks

#: Names this package exported before its face was curated, and the module each is imported from
#: now; importing one from here still works, with a DeprecationWarning (:mod:`tokenloom._moved`).
_MOVED = {
    "build": "tokenloom",
    "WorkItem": "tokenloom.builder.items",
    "format_plan": "tokenloom.builder.items",
}


def __getattr__(name: str) -> object:
    return _moved.moved_attribute(__name__, name, _MOVED)


__all__ = [
    "BuildConfig",
    "BuildPlan",
    "BuildResult",
    "VerifyReport",
    "load_build_config",
    "tokenize_on_ranks",
    "verify_cache",
]
