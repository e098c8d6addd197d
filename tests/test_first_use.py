"""First use of the compiled kernels: numba's disk cache carries them from one process to the next.

A fresh process that finds its kernels in the cache compiles nothing (numba's ``numba:compile``
event fires only on a real compile, never on a load from the disk cache); the cache works where the
package's own directory cannot be written (numba's user-wide cache); a kernel compiled with a
callee from another file is compiled again when that file changes; and where no cache directory
can be written at all the kernels still run.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

import tokenloom
from tokenloom.io.format import bin_path
from tokenloom.io.writer import write_index_file

pytest.importorskip("numba")

SRC = pathlib.Path(tokenloom.__file__).resolve().parents[1]


def _run(script: str, *args: str, pythonpath: str | os.PathLike = SRC, env: dict | None = None,
         timeout: float = 400) -> subprocess.CompletedProcess:
    environ = dict(os.environ if env is None else env)
    environ["PYTHONPATH"] = os.pathsep.join([str(pythonpath), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", script, *args], env=environ, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr
    return done


def _write_store(prefix: str, num_documents: int, seed: int) -> None:
    """A store of short documents (1 to 7 tokens): a real .idx and a sparse .bin of zeros."""
    lengths = np.random.default_rng(seed).integers(1, 8, num_documents).astype(np.int32)  # (N,)
    write_index_file(prefix + ".idx", np.dtype(np.uint16), lengths, np.arange(num_documents + 1, dtype=np.int64))
    with open(bin_path(prefix), "wb") as f:
        f.truncate(int(lengths.sum()) * 2)


#: Builds a blend of two stores in both modes and serves one micro-batch of each: with 1.3 M
#: document positions the builder takes its compiled kernels (sample walk, shuffle, greedy blend,
#: stateless index), and serving its compiled reads; prints the compile events and each kernel's
#: cache hits and misses.
BUILD_AND_SERVE = r"""
import json, os, sys
from numba.core import event
import tokenloom
import tokenloom.serve as ts
from tokenloom.index import kernels

stores, work = sys.argv[1], sys.argv[2]
blend = {"prefixes": [os.path.join(stores, "big"), os.path.join(stores, "small")], "weights": [0.8, 0.2]}
with event.install_recorder("numba:compile") as compiles:
    for mode in ("exact", "stateless"):
        result = tokenloom.build({"blend": blend, "split": "969,30,1", "seq_length": 64, "train_samples": 60000,
                                  "valid_samples": 2000, "test_samples": 100, "seed": 7, "mode": mode,
                                  "cache_dir": os.path.join(work, mode)})
        geometry = ts.BatchGeometry(global_batch_size=8, micro_batch_size=8, dp=1)
        ts.RankLoader(result.split("train"), geometry).next_batch()
print(json.dumps({
    "compiles": len(compiles.buffer),
    "kernels": {f"{k.__module__}.{k.__name__}": [sum(d.stats.cache_hits.values()), sum(d.stats.cache_misses.values())]
                for k, d in kernels._DISPATCHERS.items() if d.signatures},
}))
"""


@pytest.mark.timeout(900)
def test_a_fresh_process_loads_every_kernel_of_a_build_and_of_serving_from_the_cache(tmp_path):
    stores = tmp_path / "stores"
    stores.mkdir()
    _write_store(str(stores / "big"), 1_200_000, seed=1)
    _write_store(str(stores / "small"), 100_000, seed=2)
    # numba's cache where this checkout keeps it (the rest of the suite fills the same one)
    first = json.loads(_run(BUILD_AND_SERVE, str(stores), str(tmp_path / "first")).stdout)
    second = json.loads(_run(BUILD_AND_SERVE, str(stores), str(tmp_path / "second")).stdout)
    called = {"tokenloom.index.megatron_gpt._sample_index_walk", "tokenloom.index._randomstate_kernels.shuffle",
              "tokenloom.index._stateless_kernels._spans_numba", "tokenloom.index.blend._lookup_kernel",
              "tokenloom.source.gather._gpt_rows_kernel", "tokenloom.source.gather._span_rows_kernel"}
    for run in (first, second):  # the kernels called from Python (their callees compile with them)
        assert called <= set(run["kernels"]), run
        assert any(name.startswith("tokenloom.index.megatron_blend.") for name in run["kernels"]), run
    assert second["compiles"] == 0, second
    assert all(hits > 0 and misses == 0 for hits, misses in second["kernels"].values()), second


#: Runs one compiled kernel of the stateless index (which calls the Feistel kernels of another
#: file); prints its cache hits and misses.
ONE_KERNEL = r"""
import json, logging
import numpy as np
logging.basicConfig()
from tokenloom.index import _stateless_kernels
from tokenloom.index.kernels import compiled
kernel = compiled(_stateless_kernels._is_consecutive_numba)
assert kernel(np.arange(5, 9)) and not kernel(np.array([3, 1]))
print(json.dumps([sum(kernel.stats.cache_hits.values()), sum(kernel.stats.cache_misses.values())]))
"""


@pytest.fixture
def unwritable_package(tmp_path):
    """A copy of tokenloom whose kernels' ``__pycache__`` cannot be made (a file stands in its
    place: numba's in-tree cache fails as on a site-packages install owned by another user, also
    for root); ``(pythonpath, env)`` with numba's user-wide cache under ``tmp_path``."""
    shutil.copytree(SRC / "tokenloom", tmp_path / "src" / "tokenloom",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for package in ("index", "source"):
        (tmp_path / "src" / "tokenloom" / package / "__pycache__").write_text("not a directory")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env["XDG_CACHE_HOME"] = str(tmp_path / "user-cache")
    return tmp_path / "src", env


@pytest.mark.timeout(300)
def test_kernels_cache_in_the_user_wide_cache_when_the_package_is_not_writable(unwritable_package, tmp_path):
    pythonpath, env = unwritable_package
    assert json.loads(_run(ONE_KERNEL, pythonpath=pythonpath, env=env).stdout) == [0, 1]  # compiled
    assert json.loads(_run(ONE_KERNEL, pythonpath=pythonpath, env=env).stdout) == [1, 0]  # loaded
    assert list((tmp_path / "user-cache" / "numba").glob("index_*/_stateless_kernels._is_consecutive_numba*.nbi"))


@pytest.mark.timeout(300)
def test_a_changed_callee_in_another_file_compiles_the_kernel_again(unwritable_package):
    pythonpath, env = unwritable_package
    assert json.loads(_run(ONE_KERNEL, pythonpath=pythonpath, env=env).stdout)[1] == 1
    assert json.loads(_run(ONE_KERNEL, pythonpath=pythonpath, env=env).stdout) == [1, 0]
    with open(pythonpath / "tokenloom" / "index" / "feistel.py", "a") as f:
        f.write("\n# the Feistel kernels changed\n")  # the stateless kernels' own file did not
    assert json.loads(_run(ONE_KERNEL, pythonpath=pythonpath, env=env).stdout) == [0, 1]


@pytest.mark.timeout(300)
def test_kernels_run_uncached_with_one_warning_where_no_cache_directory_is_writable(unwritable_package, tmp_path):
    pythonpath, env = unwritable_package
    (tmp_path / "a-file").write_text("")
    env["XDG_CACHE_HOME"] = str(tmp_path / "a-file")  # the user-wide cache cannot be made either
    done = _run(ONE_KERNEL, pythonpath=pythonpath, env=env)
    assert json.loads(done.stdout) == [0, 1]
    assert done.stderr.count("numba found no writable cache directory") == 1
    assert "NUMBA_CACHE_DIR" in done.stderr
