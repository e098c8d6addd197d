"""Keys: SHA-256 of canonical JSON, for cache items and for the build key a serving state carries.

A source's ``build_key`` names the stream it serves; a saved serving state and an audit log carry
it, and a resume against another build is refused. :func:`build_key` is the one function that
computes it, for a finished build (the builder) and for a source made in memory alike; the
builder keys each cache item with :func:`hash_key` of the item's parameters.

Canonical JSON has sorted keys, no whitespace, integers as integers, floats as the shortest string
that reads back to the same double (``repr``), and no NaN or infinity, so one set of parameters has
exactly one byte string and one key on every platform.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

from tokenloom.errors import ConfigError

#: Hex digits of SHA-256 kept in a key (160 bits).
KEY_HEX_DIGITS = 40


def _normalise(value: Any) -> Any:
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ConfigError(f"cannot key the non-finite number {value!r}")
        return float(value)
    if hasattr(value, "item") and callable(value.item) and getattr(value, "shape", None) == ():
        return _normalise(value.item())  # numpy scalars
    if isinstance(value, dict):
        return {str(k): _normalise(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        kinds = set(map(type, value))
        if kinds <= {str}:  # a blend's 10,000 prefixes or keys: nothing to convert, one check
            return list(value)
        if kinds <= {float, int}:
            if not all(map(math.isfinite, value)):
                raise ConfigError(f"cannot key the non-finite number in {value!r:.80}")
            return list(value)
        return [_normalise(v) for v in value]
    raise ConfigError(f"cannot key a value of type {type(value).__name__}: {value!r}")


def canonical_json(value: Any) -> str:
    """The one JSON text of ``value``: sorted keys, compact, exact floats."""
    return json.dumps(_normalise(value), sort_keys=True, separators=(",", ":"), allow_nan=False)


def hash_key(value: Any) -> str:
    """The cache key of ``value``: the first :data:`KEY_HEX_DIGITS` hex digits of SHA-256 of its
    canonical JSON."""
    return hashlib.sha256(canonical_json(value).encode("utf-8")).hexdigest()[:KEY_HEX_DIGITS]


def build_key(material: Any) -> str:
    """The build key of a source: :func:`hash_key` of everything that decides its stream (the
    config's array fields and every item key for a build; the inputs' fingerprints and the
    parameters for a source made in memory)."""
    return hash_key(material)


__all__ = ["KEY_HEX_DIGITS", "build_key", "canonical_json", "hash_key"]
