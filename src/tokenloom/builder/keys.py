"""Cache keys: SHA-256 of canonical JSON.

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

#: Version of the cache layout and key material; bump it when either changes.
CACHE_FORMAT_VERSION = 1
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
        return [_normalise(v) for v in value]
    raise ConfigError(f"cannot key a value of type {type(value).__name__}: {value!r}")


def canonical_json(value: Any) -> str:
    """The one JSON text of ``value``: sorted keys, compact, exact floats."""
    return json.dumps(_normalise(value), sort_keys=True, separators=(",", ":"), allow_nan=False)


def hash_key(value: Any) -> str:
    """The cache key of ``value``: the first :data:`KEY_HEX_DIGITS` hex digits of SHA-256 of its
    canonical JSON."""
    return hashlib.sha256(canonical_json(value).encode("utf-8")).hexdigest()[:KEY_HEX_DIGITS]


__all__ = ["CACHE_FORMAT_VERSION", "KEY_HEX_DIGITS", "canonical_json", "hash_key"]
