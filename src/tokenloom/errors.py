"""One vocabulary of errors for everything tokenloom raises on purpose.

Every message names the file or value at fault, what was found, and what was
expected, so a user can act on it without reading a traceback. The CLI turns any
``TokenloomError`` into one line on stderr and exit code 2.
"""

from __future__ import annotations


class TokenloomError(Exception):
    """Base class of every error tokenloom raises deliberately."""


class FormatError(TokenloomError, ValueError):
    """A file on disk is not what its format promises (bad magic, truncated, inconsistent)."""


class ConfigError(TokenloomError, ValueError):
    """A configuration value or argument is out of range or inconsistent with another."""


class PositionError(ConfigError, IndexError):
    """A position, sample or document index outside the range that holds data.

    Both a :class:`ConfigError` (a bad argument) and an :class:`IndexError`, so Python's sequence
    protocols (iteration by ``__getitem__``, ``except IndexError``) see the end of a sequence.
    """


class InputError(TokenloomError, ValueError):
    """Raw input data (a JSON line, a text file, a Parquet column) cannot be used as given."""


class StorageError(TokenloomError, RuntimeError):
    """Storage failed: a disk filled up, or object storage refused a request (403) or kept failing
    after every retry."""


class BuildError(TokenloomError, RuntimeError):
    """Building an index failed; in a distributed build every rank raises the same one."""


__all__ = ["BuildError", "ConfigError", "FormatError", "InputError", "PositionError", "StorageError",
           "TokenloomError"]
