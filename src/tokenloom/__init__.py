"""tokenloom: the data layer of large language model pretraining.

plan -> tokenize -> build -> serve. Importing tokenloom never imports torch or jax.
"""

from tokenloom.errors import BuildError, ConfigError, FormatError, InputError, TokenloomError

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "TokenloomError",
    "FormatError",
    "ConfigError",
    "InputError",
    "BuildError",
]
