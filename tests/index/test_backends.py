"""Every kernel picks its backend the same way, and an unknown backend is a clear ConfigError."""

import numpy as np
import pytest

from tokenloom.errors import ConfigError
from tokenloom.index import Blend, FeistelPermutation, megatron_blend
from tokenloom.index._backends import choose_backend


def test_auto_prefers_numba_then_the_fallback():
    assert choose_backend("auto", ("numpy", "numba"), fallback="numpy") == "numba"
    assert choose_backend("auto", ("python",), fallback="python") == "python"
    assert choose_backend("numpy", ("numpy", "numba"), fallback="numpy") == "numpy"


def test_unknown_backend_names_the_choices_and_the_extra():
    with pytest.raises(ConfigError, match=r"backend='gpu' is not available; expected one of \['auto', 'numpy'\] "
                                          r"\(install tokenloom\[fast\] for numba\)"):
        choose_backend("gpu", ("numpy",), fallback="numpy")


@pytest.mark.parametrize("call", [
    lambda: Blend([0.5, 0.5], 10, backend="gpu"),
    lambda: megatron_blend(np.array([0.5, 0.5]), 10, backend="gpu"),
    lambda: FeistelPermutation.from_seed(10, seed=1, purpose="x", backend="gpu"),
])
def test_each_kernel_refuses_an_unknown_backend(call):
    with pytest.raises(ConfigError, match="backend='gpu' is not available"):
        call()
