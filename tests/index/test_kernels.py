"""The one kernel module: backends are picked one way, numba loads on first use, never at import."""

import importlib
import os
import pathlib
import pkgutil
import subprocess
import sys

import numpy as np
import pytest

import tokenloom
from tokenloom.errors import ConfigError
from tokenloom.index import Blend, FeistelPermutation, _stateless_kernels, feistel, kernels, megatron_blend
from tokenloom.index.kernels import compiled, compiled_on_call, jit, prange, resolve_backend


@jit(inline="always")
def _double(x):
    return 2 * x


@jit()
def _quadruple(x):
    return _double(_double(x))


@jit(parallel=True)
def _sum_in_parallel(values):
    total = 0
    for k in prange(values.shape[0]):
        total += values[k]
    return total


def test_auto_prefers_numba_then_the_fallback():
    assert resolve_backend("auto", ("numpy", "numba"), fallback="numpy") == "numba"
    assert resolve_backend("auto", ("python",), fallback="python") == "python"
    assert resolve_backend("numpy", ("numpy", "numba"), fallback="numpy") == "numpy"


def test_unknown_backend_names_the_choices_and_how_to_get_numba():
    with pytest.raises(ConfigError, match=r"backend='gpu' is not available; expected one of \['auto', 'numpy'\] "
                                          r"\(numba is not installed: pip install numba\)"):
        resolve_backend("gpu", ("numpy",), fallback="numpy")
    with pytest.raises(ConfigError, match=r"kernel='gpu' is not available; expected one of \['auto', 'numpy', "
                                          r"'numba'\]$"):
        resolve_backend("gpu", ("numpy", "numba"), fallback="numpy", what="kernel")


@pytest.mark.parametrize("call", [
    lambda: Blend([0.5, 0.5], 10, backend="gpu"),
    lambda: megatron_blend(np.array([0.5, 0.5]), 10, backend="gpu"),
    lambda: FeistelPermutation.from_seed(10, seed=1, purpose="x", backend="gpu"),
])
def test_each_kernel_refuses_an_unknown_backend(call):
    with pytest.raises(ConfigError, match="backend='gpu' is not available"):
        call()


def test_importing_the_index_and_serve_does_not_import_numba():
    src = str(pathlib.Path(tokenloom.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    code = ("import sys, tokenloom.index, tokenloom.serve, tokenloom.source.gather; "
            "print(tokenloom.__file__, 'numba' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         check=True).stdout.split()
    assert out == [tokenloom.__file__, "False"]


def test_kernels_run_as_plain_python():
    assert _quadruple(3) == 12
    assert _sum_in_parallel(np.arange(5)) == 10


def test_a_kernel_compiles_with_its_callees_compiled():
    numba = pytest.importorskip("numba")
    quadruple = compiled(_quadruple)
    assert quadruple is compiled(_quadruple)  # made once
    assert quadruple(3) == 12
    assert quadruple.py_func.__globals__["_double"] is compiled(_double)
    assert quadruple.py_func.__globals__["prange"] is numba.prange
    assert globals()["_double"] is _double  # the module itself keeps its plain functions


def test_kernels_imported_from_another_module_are_bound_to_their_own_dispatchers():
    pytest.importorskip("numba")
    namespace = compiled(_stateless_kernels._spans_numba).py_func.__globals__
    assert namespace["_permute_numba"] is compiled(feistel._permute_numba)
    assert namespace["permute_into"] is compiled(feistel.permute_into)
    # the Feistel kernels' own namespace: permute_into calls the compiled network
    assert compiled(feistel.permute_into).py_func.__globals__["_network_batch"] is compiled(feistel._network_batch)


def test_every_kernel_of_tokenloom_is_cached_on_disk():
    for module in pkgutil.walk_packages(tokenloom.__path__, "tokenloom."):
        if not module.name.endswith("__main__") and module.name != "tokenloom.serve.torch_adapter":
            importlib.import_module(module.name)
    ours = {k: options for k, options in kernels._OPTIONS.items() if k.__module__.startswith("tokenloom.")}
    assert len(ours) > 30
    assert [f"{k.__module__}.{k.__name__}" for k, options in ours.items() if options.get("cache") is not True] == []


def test_kernels_compiled_with_another_files_kernels_are_cached_under_a_name_that_follows_that_file():
    pytest.importorskip("numba")
    spans = compiled(_stateless_kernels._spans_numba).py_func.__qualname__
    assert spans.startswith("_spans_numba__deps_") and len(spans) == len("_spans_numba__deps_") + 16
    assert compiled(_stateless_kernels._is_consecutive_numba).py_func.__qualname__.endswith(spans[-23:])
    assert compiled(feistel._permute_numba).py_func.__qualname__ == "_permute_numba"  # only its own file


def test_compiled_on_call_compiles_on_the_first_call():
    pytest.importorskip("numba")
    quadruple = compiled_on_call(_quadruple)
    assert quadruple.__name__ == "_quadruple" and quadruple(5) == 20


def test_only_marked_functions_compile():
    def plain(x):
        return x

    with pytest.raises(TypeError, match="not a kernel"):
        compiled(plain)
