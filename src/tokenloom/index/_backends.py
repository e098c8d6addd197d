"""Choosing between a kernel's implementations (numba when installed, a pure fallback otherwise)."""

from __future__ import annotations

from typing import Container, Iterable

from tokenloom.errors import ConfigError


def choose_backend(backend: str, available: Container[str] | Iterable[str], *, fallback: str) -> str:
    """``"auto"`` -> ``"numba"`` when it is ``available``, else ``fallback``; other names are checked.

    Every backend of a kernel returns identical results; they differ only in speed.
    """
    names = list(available)
    if backend == "auto":
        return "numba" if "numba" in names else fallback
    if backend not in names:
        raise ConfigError(f"backend={backend!r} is not available; expected one of {['auto', *names]}"
                          + ("" if "numba" in names else " (install tokenloom[fast] for numba)"))
    return backend
