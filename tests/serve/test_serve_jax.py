"""The JAX adapter: per-process shards, and global arrays over 2 processes x 4 CPU devices (with
MaxText's inputs_segmentation and inputs_position)."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from serve_fixtures import write_corpus
from tokenloom.errors import ConfigError
from tokenloom.serve import SampleOptions
from tokenloom.serve.jax_adapter import HostLoader, ShardOptions
from tokenloom.source import StoreBlendSource

OPTIONS = SampleOptions(reset_position_ids=True, eod_mask_loss=True)
SEGMENTS = SampleOptions(eod_mask_loss=True, inter_document_masking=True, boundary_format="segments")
"""MaxText's packed inputs (the two-process test's options, as jax_serve_worker.py sets them)."""


@pytest.fixture(scope="module")
def prefixes(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("jax"), 2, seed=31, num_documents=60)


def _source(prefixes):
    return StoreBlendSource.from_prefixes(prefixes, [0.3, 0.7], num_samples=300, seq_length=8, seed=2)


def test_shards_concatenate_to_the_single_process_batch_and_resume_on_other_counts(prefixes):
    source = _source(prefixes)
    whole = list(HostLoader(source, global_batch_size=16, shard=ShardOptions(shard_index=0, shard_count=1),
                            options=OPTIONS, max_steps=6))
    halves = [list(HostLoader(source, global_batch_size=16, shard=ShardOptions(shard_index=p, shard_count=2),
                              options=OPTIONS, max_steps=6)) for p in range(2)]
    for step in range(6):
        for k in whole[step]:
            np.testing.assert_array_equal(np.concatenate([halves[0][step][k], halves[1][step][k]]), whole[step][k])
    # 3 steps on 2 processes, resumed on 4
    first = HostLoader(source, global_batch_size=16, shard=ShardOptions(shard_index=1, shard_count=2), options=OPTIONS)
    for _ in range(3):
        next(first)
    quarters = []
    for p in range(4):
        loader = HostLoader(source, global_batch_size=16, shard=ShardOptions(shard_index=p, shard_count=4),
                            options=OPTIONS, max_steps=6)
        loader.load_state_dict(first.state_dict())
        quarters.append(list(loader))
    for step in range(3):
        np.testing.assert_array_equal(np.concatenate([q[step]["tokens"] for q in quarters]), whole[3 + step]["tokens"])


def test_shard_options_checks_and_grain_duck_typing():
    class GrainLike:
        shard_index, shard_count = 1, 3

    assert ShardOptions.of(GrainLike()) == ShardOptions(shard_index=1, shard_count=3)
    with pytest.raises(ConfigError, match="shard_index=3"):
        ShardOptions(shard_index=3, shard_count=3)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_four_cpu_devices_make_one_global_array(prefixes, tmp_path):
    pytest.importorskip("jax")
    config = {"prefixes": prefixes, "port": _free_port(), "out": str(tmp_path)}
    (tmp_path / "config.json").write_text(json.dumps(config))
    worker = os.path.join(os.path.dirname(__file__), "jax_serve_worker.py")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), *sys.path])}
    processes = [subprocess.Popen([sys.executable, worker, str(tmp_path / "config.json"), str(p)], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for p in range(2)]
    try:
        outputs = [p.communicate(timeout=180)[0] for p in processes]
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, output in zip(processes, outputs):
        assert p.returncode == 0, output[-3000:]
    whole = list(HostLoader(_source(prefixes), global_batch_size=16, shard=ShardOptions(shard_index=0, shard_count=1),
                            options=SEGMENTS, max_steps=3))
    records = [json.loads((tmp_path / f"process{p}.json").read_text()) for p in range(2)]
    assert all(r["local_devices"] == 4 and r["global_shape"] == [16, 8] for r in records)
    _check_global_arrays([r["shards"] for r in records], whole)
    if importlib.util.find_spec("grain") is None:
        return
    # through grain: the same global arrays, and a state that restores on one process
    _check_global_arrays([r["grain_shards"] for r in records], whole)
    assert records[0]["grain_state"] == records[1]["grain_state"]
    from tokenloom.serve.grain_adapter import GrainStream

    one = iter(GrainStream(_source(prefixes), global_batch_size=16, shard=ShardOptions(shard_index=0, shard_count=1),
                           options=SEGMENTS, max_steps=5))
    one.set_state(records[1]["grain_state"])
    later = list(HostLoader(_source(prefixes), global_batch_size=16, shard=ShardOptions(shard_index=0, shard_count=1),
                            options=SEGMENTS, max_steps=5))[3:]
    got = list(one)
    assert len(got) == len(later) == 2
    for a, b in zip(got, later):
        for k in b:
            np.testing.assert_array_equal(a[k], b[k])


def _check_global_arrays(per_process_shards, whole) -> None:
    """The processes' device shards hold every row of every step's global batch once, equal to
    the one-process batches ``whole``."""
    seen = np.zeros((3, 16), dtype=int)
    fields = set()
    for shards in per_process_shards:
        for step, field, start, stop, rows in shards:
            fields.add(field)
            np.testing.assert_array_equal(np.array(rows), whole[step][field][start:stop])
            if field == "tokens":
                seen[step, start:stop] += 1
    assert (seen == 1).all()  # the 8 devices together hold every row of the global batch once
    assert {"inputs_segmentation", "inputs_position", "tokens", "labels", "loss_mask"} <= fields
