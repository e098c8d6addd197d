"""Argument checks every stage repeats, each raising the error a user can act on.

An integer argument is a Python ``int`` or a numpy integer, never a ``bool`` (``True`` is an
``int`` to Python, but ``num_samples=True`` is a mistake). Each check names the argument, the
value received and what was expected::

    check_positive_int("num_samples", 0)    # ConfigError: num_samples=0; expected a positive integer
    check_positions(positions, 100, what="the train split holds 100 samples")   # PositionError
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from tokenloom.errors import ConfigError, PositionError


def is_integer(value: Any) -> bool:
    """Whether ``value`` is an ``int`` or a numpy integer, and not a ``bool``."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_number(value: Any) -> bool:
    """Whether ``value`` is an int or float (numpy's too), and not a ``bool``."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


def check_int(name: str, value: Any, *, minimum: int | None = None, maximum: int | None = None,
              expected: str | None = None) -> int:
    """``value`` as an int, when it is an integer in ``[minimum, maximum]`` (either bound may be
    None); ConfigError ``"{name}={value!r}; expected {expected}"`` otherwise. ``expected``
    defaults to a description of the bounds."""
    if is_integer(value) and (minimum is None or value >= minimum) and (maximum is None or value <= maximum):
        return int(value)
    if expected is None:
        if minimum is None and maximum is None:
            expected = "an integer"
        elif maximum is None:
            expected = {0: "a non-negative integer", 1: "a positive integer"}.get(minimum, f"an integer >= {minimum}")
        elif minimum is None:
            expected = f"an integer <= {maximum}"
        else:
            expected = f"an integer in [{minimum}, {maximum}]"
    raise ConfigError(f"{name}={value!r}; expected {expected}")


def check_positive_int(name: str, value: Any) -> int:
    """``value`` as an int when it is an integer >= 1; ConfigError naming ``name`` otherwise."""
    return check_int(name, value, minimum=1)


def check_non_negative_int(name: str, value: Any) -> int:
    """``value`` as an int when it is an integer >= 0; ConfigError naming ``name`` otherwise."""
    return check_int(name, value, minimum=0)


def check_number(name: str, value: Any, *, positive: bool = False, finite: bool = True,
                 expected: str | None = None) -> float:
    """``value`` as a float when it is a (finite, and with ``positive`` strictly positive) number;
    ConfigError ``"{name}={value!r}; expected {expected}"`` otherwise."""
    if is_number(value) and (not finite or math.isfinite(value)) and (not positive or value > 0):
        return float(value)
    if expected is None:
        expected = "a positive number" if positive else ("a finite number" if finite else "a number")
    raise ConfigError(f"{name}={value!r}; expected {expected}")


def check_positions(positions: np.ndarray, size: int, *, what: str, name: str = "positions",
                    hint: str = "") -> None:
    """PositionError unless every entry of ``positions`` lies in ``[0, size)``. The message names
    the span found (as ``name``), what holds the ``size`` entries (``what``, e.g. "the train split
    holds 100 samples"), the valid range and ``hint``."""
    if positions.size and (positions.min() < 0 or positions.max() >= size):
        raise PositionError(f"{name} span [{int(positions.min())}, {int(positions.max())}]; {what}: expected "
                            f"{name} in [0, {size})" + (f"; {hint}" if hint else ""))


__all__ = [
    "check_int",
    "check_non_negative_int",
    "check_number",
    "check_positions",
    "check_positive_int",
    "is_integer",
    "is_number",
]
