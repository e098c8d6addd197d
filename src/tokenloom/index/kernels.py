"""The one place that knows numba: is it installed, which backend runs, and compiling on first use.

numba comes with tokenloom (a dependency; the numpy/python backends serve platforms without it),
and importing it takes 0.3 to 2 seconds, so nothing under ``tokenloom`` imports it at import time.
:func:`numba_available` asks the import system whether it is installed without importing it;
:func:`compiled` imports it when a kernel first runs.

A kernel is a plain Python function marked with :func:`jit` (the numba options it compiles
with), and that function stays the single source: a ``"python"`` backend runs it as it is, and
``compiled(kernel)`` is its numba dispatcher, made on first use. Kernels call each other by their
global names, so a compiled kernel must see its callees' dispatchers there: the first
:func:`compiled` of a module's kernels compiles them all into one namespace, a copy of the
module's globals in which every kernel name (the module's own, or one it imported from another
module, compiled in its own module's namespace) is bound to its dispatcher, and :func:`prange`
to ``numba.prange``. The copies keep their code objects (file, line, qualified name), so
numba's on-disk cache (``cache=True``) finds their compiled code as it found the decorated
functions'.

Every kernel with a choice of implementations picks it with :func:`resolve_backend`; its table
(a dict from backend name to a function or a NamedTuple of functions) lists only the backends
that can run here. A table's numba entries are :func:`compiled_on_call` kernels, or functions
that prepare a kernel's arguments and call ``compiled(kernel)``: building the table compiles
nothing.
"""

from __future__ import annotations

import functools
import importlib.util
import threading
import types
from collections.abc import Callable, Iterable
from typing import Any

from tokenloom.errors import ConfigError

__all__ = ["compiled", "compiled_on_call", "import_numba", "jit", "numba_available", "prange", "resolve_backend"]

_OPTIONS: dict[types.FunctionType, dict[str, Any]] = {}  # kernel -> its numba.njit options
_DISPATCHERS: dict[types.FunctionType, Callable] = {}  # kernel -> its dispatcher, once compiled
_LOCK = threading.Lock()


@functools.cache
def numba_available() -> bool:
    """Whether numba is installed (a dependency of tokenloom; absent on platforms without it);
    looked up once, without importing it."""
    return importlib.util.find_spec("numba") is not None


def import_numba() -> types.ModuleType:
    """The numba module, imported on the first call (it takes 0.3 to 2 seconds)."""
    if not numba_available():
        raise ConfigError("a compiled kernel was asked for, but numba is not installed; expected numba, "
                          "which tokenloom depends on (pip install numba), or pick a numpy/python backend")
    import numba

    return numba


def resolve_backend(requested: str, available: Iterable[str], *, fallback: str, what: str = "backend") -> str:
    """``"auto"`` -> ``"numba"`` when it is ``available``, else ``fallback``; other names are checked.

    ``available``: the backends that can run here (a table's keys). ``what`` names the argument
    in the error. Every backend of a kernel returns identical results; they differ only in speed.
    """
    names = list(available)
    if requested == "auto":
        return "numba" if "numba" in names else fallback
    if requested not in names:
        raise ConfigError(f"{what}={requested!r} is not available; expected one of {['auto', *names]}"
                          + ("" if "numba" in names else " (numba is not installed: pip install numba)"))
    return requested


def jit(**options: Any) -> Callable[[types.FunctionType], types.FunctionType]:
    """Mark a module-level function as a kernel compiled with ``numba.njit(**options)``.

    Returns the function unchanged (it runs as plain Python); :func:`compiled` gives its
    dispatcher. Nothing is imported or compiled here.
    """

    def mark(function: types.FunctionType) -> types.FunctionType:
        _OPTIONS[function] = dict(options)
        return function

    return mark


def prange(*args: int) -> range:
    """``range`` in plain Python; ``numba.prange`` (a loop split over threads) once compiled."""
    return range(*args)


def compiled(kernel: types.FunctionType) -> Callable:
    """The numba dispatcher of ``kernel`` (a :func:`jit` function), made on its first use."""
    try:
        return _DISPATCHERS[kernel]
    except KeyError:
        return _compile(kernel)


def compiled_on_call(kernel: types.FunctionType) -> Callable:
    """A function that runs ``compiled(kernel)`` on its positional arguments: a backend table's
    entry, made at import time without compiling anything."""
    dispatcher = None

    @functools.wraps(kernel)
    def call(*args: Any) -> Any:
        nonlocal dispatcher
        if dispatcher is None:
            dispatcher = compiled(kernel)
        return dispatcher(*args)

    return call


def _compile(kernel: types.FunctionType) -> Callable:
    if kernel not in _OPTIONS:
        raise TypeError(f"{kernel!r} is not a kernel; expected a function marked with tokenloom.index.kernels.jit")
    numba = import_numba()
    with _LOCK:
        if kernel not in _DISPATCHERS:
            _compile_module(kernel.__globals__, numba)
    if kernel not in _DISPATCHERS:
        raise TypeError(f"{kernel!r} is not bound to a name of its module; expected a module-level kernel")
    return _DISPATCHERS[kernel]


def _compile_module(module_globals: dict[str, Any], numba: types.ModuleType) -> None:
    """Dispatchers for the kernels defined in one module, sharing one namespace (see above)."""
    namespace = dict(module_globals)
    imported = []
    for name, value in module_globals.items():
        if value is prange:
            namespace[name] = numba.prange
        elif isinstance(value, types.FunctionType) and value in _OPTIONS:
            if value.__globals__ is not module_globals:
                imported.append((name, value))
                continue
            copy = types.FunctionType(value.__code__, namespace, value.__name__, value.__defaults__,
                                      value.__closure__)
            copy.__kwdefaults__, copy.__qualname__, copy.__doc__ = (
                value.__kwdefaults__, value.__qualname__, value.__doc__)
            namespace[name] = _DISPATCHERS[value] = numba.njit(**_OPTIONS[value])(copy)
    for name, value in imported:
        if value not in _DISPATCHERS:
            _compile_module(value.__globals__, numba)
        namespace[name] = _DISPATCHERS[value]
