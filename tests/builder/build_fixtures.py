"""Helpers shared by the build tests: small token stores, caches compared byte for byte, and a
launcher of real multi-process gloo builds on 127.0.0.1."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from tokenloom.io import IndexedDatasetWriter

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist_worker.py")


def write_store(prefix: str, num_documents: int, seed: int, *, max_length: int = 300) -> str:
    """A uint16 store of ``num_documents`` one-sequence documents with random lengths >= 1."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, max_length, size=num_documents)
    tokens = rng.integers(0, 1000, size=int(lengths.sum())).astype(np.uint16)
    with IndexedDatasetWriter(prefix, dtype=np.uint16) as writer:
        writer.add_documents(tokens, lengths)
        writer.finalize()
    return prefix


def make_stores(directory, count: int = 3, *, base_documents: int = 400) -> list[str]:
    os.makedirs(str(directory), exist_ok=True)
    return [write_store(os.path.join(str(directory), f"store{i}"), base_documents + 97 * i, seed=i)
            for i in range(count)]


#: ``NullTokenizer(1000).unique_identifiers`` of megatron-core (checked in megatron_fixtures).
NULL_TOKENIZER = {"class": "megatron.core.tokenizers.text.libraries.null_tokenizer.NullTokenizer",
                  "vocab_size": 1000, "eod_id": 999, "pad_id": -1}


def blend_config(prefixes, cache_dir, **changes) -> dict:
    """A weighted three-split blend config as a plain mapping."""
    weights = [3.0, 5.0, 2.0, 4.0][: len(prefixes)]
    config = {
        "blend": {"prefixes": list(prefixes), "weights": weights},
        "split": "90,8,2", "seq_length": 64, "train_samples": 3000, "valid_samples": 200,
        "test_samples": 60, "seed": 1234, "cache_dir": str(cache_dir), "rng_workers": 0,
        "timeout_s": 60.0, "megatron_tokenizer": dict(NULL_TOKENIZER),
    }
    config.update(changes)
    return config


def cache_files(cache_dir) -> dict[str, bytes]:
    """``<key>/<array>.npy`` -> the .npy bytes, for every array of every item of a cache."""
    from tokenloom.builder.cache import Cache

    cache = Cache(str(cache_dir))
    out = {}
    for key in cache.item_keys():
        for name in sorted(cache.read_record(key)["files"]):
            out[f"{key}/{name}"] = cache.npy_image(key, name[: -len(".npy")])
    return out


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world_size: int, steps: list[dict], out_dir, *, timeout_s: float = 120.0,
           hung_ranks: tuple[int, ...] = ()) -> list[dict | None]:
    """Run ``steps`` (see dist_worker.py) on ``world_size`` gloo ranks; return each rank's results
    (None for a rank that wrote none, e.g. one killed on purpose). ``hung_ranks`` (stopped on
    purpose) are killed once every other rank has exited."""
    port = free_port()
    out_dir = str(out_dir)
    env = dict(os.environ)
    src = os.path.join(os.path.dirname(WORKER), "..", "..", "src")
    env["PYTHONPATH"] = os.path.abspath(src) + os.pathsep + env.get("PYTHONPATH", "")
    procs = []
    for rank in range(world_size):
        args = [sys.executable, WORKER, str(rank), str(world_size), str(port), json.dumps(steps), out_dir]
        procs.append(subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout_s
    logs = []
    try:
        for rank, proc in enumerate(procs):
            if rank in hung_ranks:
                logs.append("")
                continue
            remaining = max(1.0, deadline - time.monotonic())
            out, _ = proc.communicate(timeout=remaining)
            logs.append(out.decode(errors="replace"))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    results = []
    for rank in range(world_size):
        path = os.path.join(out_dir, f"rank{rank}.json")
        if os.path.exists(path):
            with open(path) as f:
                results.append(json.load(f))
        else:
            results.append(None)
    for rank, result in enumerate(results):
        if result is not None and result.get("crashed"):
            raise AssertionError(f"rank {rank} crashed:\n{logs[rank]}")
    return results


def two_rank_build(values: dict, tmp_path, *, build_key: str, cache_dir) -> list[dict]:
    """The build config ``values`` again on two gloo ranks into ``tmp_path / "two"``: each rank's
    outcome, checked to have the one-process ``build_key`` and ``cache_dir``'s cache files."""
    pytest.importorskip("torch.distributed")
    (tmp_path / "out").mkdir()
    outcomes = [r["steps"][0] for r in launch(2, [{"config": {**values, "cache_dir": str(tmp_path / "two")}}],
                                              tmp_path / "out", timeout_s=240)]
    assert all(o["ok"] for o in outcomes), outcomes
    assert {o["build_key"] for o in outcomes} == {build_key}
    assert cache_files(tmp_path / "two") == cache_files(cache_dir)
    return outcomes
