"""The one place that knows numba: is it installed, which backend runs, and compiling on first use.

numba comes with tokenloom (a dependency; the numpy/python backends serve platforms without it),
and importing it is slow (it loads LLVM), so nothing under ``tokenloom`` imports it at import time.
:func:`numba_available` asks the import system whether it is installed without importing it;
:func:`compiled` imports it when a kernel first runs.

A kernel is a plain Python function marked with :func:`jit` (the numba options it compiles
with), and that function stays the single source: a ``"python"`` backend runs it as it is, and
``compiled(kernel)`` is its numba dispatcher, made on first use. Kernels call each other by their
global names, so a compiled kernel must see its callees' dispatchers there: the first
:func:`compiled` of a module's kernels compiles them all into one namespace, a copy of the
module's globals in which every kernel name (the module's own, or one it imported from another
module, compiled in its own module's namespace) is bound to its dispatcher, and :func:`prange`
to ``numba.prange``. The copies keep their code objects (file, line), so numba's on-disk cache
(``cache=True``, which every kernel of tokenloom sets) finds their compiled code as it found the
decorated functions'.

The disk cache. numba keeps a kernel's compiled code under ``NUMBA_CACHE_DIR`` when that is set,
else in ``__pycache__`` beside the source, else (a site-packages install that is not the user's
to write) in the user-wide cache (``$XDG_CACHE_HOME/numba``, by default ``~/.cache/numba``). It
checks an entry against the content of the kernel's own file only: a kernel compiled with a
callee from another file (the stateless kernels call the Feistel network) would keep the old
callee's code after that file changed. So a module that binds kernels of other files gives its
kernels a qualified name ending in ``__deps_`` and a hash of those files' contents: a changed
callee is a different cache entry. Where numba finds no writable cache directory at all, the
kernels compile in memory (every process pays the compile) and one warning names
``NUMBA_CACHE_DIR``. tokenloom does not pick a directory itself: numba has one cache directory
per process, so that would move the user's own numba functions too, and a shared temporary
directory would run compiled code (pickles) that another user could have put there.

Every kernel with a choice of implementations picks it with :func:`resolve_backend`; its table
(a dict from backend name to a function or a NamedTuple of functions) lists only the backends
that can run here. A table's numba entries are :func:`compiled_on_call` kernels, or functions
that prepare a kernel's arguments and call ``compiled(kernel)``: building the table compiles
nothing.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import threading
import types
from collections.abc import Callable, Iterable
from typing import Any

from tokenloom.errors import ConfigError

__all__ = ["compiled", "compiled_on_call", "import_numba", "jit", "numba_available", "prange", "resolve_backend"]

_OPTIONS: dict[types.FunctionType, dict[str, Any]] = {}  # kernel -> its numba.njit options
_DISPATCHERS: dict[types.FunctionType, Callable] = {}  # kernel -> its dispatcher, once compiled
_LOCK = threading.Lock()
_SOURCES: dict[str, frozenset[str]] = {}  # module name -> the files its compiled kernels are made of
logger = logging.getLogger(__name__)


@functools.cache
def numba_available() -> bool:
    """Whether numba is installed (a dependency of tokenloom; absent on platforms without it);
    looked up once, without importing it."""
    return importlib.util.find_spec("numba") is not None


def import_numba() -> types.ModuleType:
    """The numba module, imported on the first call (a slow import: see the module's docstring)."""
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
    own, imported = [], []
    for name, value in module_globals.items():
        if value is prange:
            namespace[name] = numba.prange
        elif isinstance(value, types.FunctionType) and value in _OPTIONS:
            (own if value.__globals__ is module_globals else imported).append((name, value))
    for name, value in imported:
        if value not in _DISPATCHERS:
            _compile_module(value.__globals__, numba)
        namespace[name] = _DISPATCHERS[value]
    deps = _dependency_tag(module_globals)
    for name, value in own:
        copy = types.FunctionType(value.__code__, namespace, value.__name__, value.__defaults__, value.__closure__)
        copy.__kwdefaults__, copy.__doc__ = value.__kwdefaults__, value.__doc__
        copy.__qualname__ = value.__qualname__ + deps  # numba's cache file is named after it
        namespace[name] = _DISPATCHERS[value] = _njit(numba, copy, _OPTIONS[value])


def _source(module_globals: dict[str, Any]) -> str:
    """A module's file (its name where it has none)."""
    return module_globals.get("__file__") or module_globals["__name__"]


def _sources(module_globals: dict[str, Any]) -> frozenset[str]:
    """The files a module's compiled kernels are made of: its own and, transitively, those of
    the kernels it imported."""
    name = module_globals["__name__"]
    if name not in _SOURCES:
        _SOURCES[name] = frozenset()  # a cycle of kernel imports ends here
        found = {_source(module_globals)}
        for value in list(module_globals.values()):
            if (isinstance(value, types.FunctionType) and value in _OPTIONS
                    and value.__globals__ is not module_globals):
                found |= _sources(value.__globals__)
        _SOURCES[name] = frozenset(found)
    return _SOURCES[name]


def _dependency_tag(module_globals: dict[str, Any]) -> str:
    """``""``, or ``"__deps_"`` and a hash of the other files a module's kernels are made of."""
    foreign = sorted(_sources(module_globals) - {_source(module_globals)})
    if not foreign:
        return ""
    digest = hashlib.sha256()
    for path in foreign:
        try:
            with open(path, "rb") as f:
                digest.update(f.read())
        except OSError:  # not a file (numba cannot cache its kernels either)
            digest.update(path.encode())
    return "__deps_" + digest.hexdigest()[:16]


def _njit(numba: types.ModuleType, function: types.FunctionType, options: dict[str, Any]) -> Callable:
    """``numba.njit(**options)(function)``; in memory where numba has no writable cache directory."""
    try:
        return numba.njit(**options)(function)
    except RuntimeError as exc:  # numba: "cannot cache function ...: no locator available for file ..."
        if not options.get("cache") or "cannot cache" not in str(exc):
            raise
    _warn_no_cache_dir()
    return numba.njit(**{**options, "cache": False})(function)


@functools.cache
def _warn_no_cache_dir() -> None:
    logger.warning("numba found no writable cache directory for tokenloom's kernels in %s (neither their "
                   "__pycache__ nor the user-wide cache): they compile in memory, once per process; set "
                   "NUMBA_CACHE_DIR to a writable directory to keep them between processes",
                   os.path.dirname(os.path.dirname(__file__)))
