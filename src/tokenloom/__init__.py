"""tokenloom: the data layer of large language model pretraining.

plan -> tokenize -> build -> serve. Importing tokenloom never imports torch or jax.
"""

from tokenloom import plan  # the module, callable as tokenloom.plan(...)
from tokenloom.errors import BuildError, ConfigError, FormatError, InputError, TokenloomError
from tokenloom.plan import (
    ClusterSpec,
    DataGeometry,
    ModelSpec,
    Plan,
    PlanOptions,
    TrainingSpec,
    plan_layout,
)

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "TokenloomError",
    "FormatError",
    "ConfigError",
    "InputError",
    "BuildError",
    "plan",
    "plan_layout",
    "Plan",
    "ModelSpec",
    "ClusterSpec",
    "TrainingSpec",
    "PlanOptions",
    "DataGeometry",
]
