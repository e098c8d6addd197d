"""Building from ``s3://`` stores, serving from them and tokenizing inputs kept there, against a real
S3 endpoint (moto's server on 127.0.0.1): equal, byte for byte, to the same work on local files,
also with 2 torchrun ranks and through injected faults."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("boto3")
pytest.importorskip("moto")

import tokenloom
from s3support import FaultProxy, make_bucket, moto_server, upload
from tokenloom.builder.cache import Cache
from tokenloom.io import IndexedDatasetWriter
from tokenloom.serve.loader import read_batch
from tokenloom.serve.stream import SampleStream
from tokenloom.tokenization import TokenizeConfig, tokenize_to_store

BUCKET = "build"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A moto server, a fault proxy before it, and three stores both local and uploaded."""
    root = tmp_path_factory.mktemp("s3build")
    with moto_server() as endpoint:
        make_bucket(endpoint, BUCKET)
        proxy = FaultProxy(endpoint)
        proxy.start()
        try:
            local, remote = [], []
            for k in range(3):
                rng = np.random.default_rng(k)
                lengths = rng.integers(1, 300, size=400 + 97 * k)
                prefix = str(root / f"store{k}")
                with IndexedDatasetWriter(prefix, dtype=np.uint16) as writer:
                    writer.add_documents(rng.integers(0, 1000, size=int(lengths.sum())).astype(np.uint16), lengths)
                    writer.finalize()
                local.append(prefix)
                for suffix in (".idx", ".bin"):
                    upload(endpoint, prefix + suffix, f"s3://{BUCKET}/stores/store{k}{suffix}")
                remote.append(f"s3://{BUCKET}/stores/store{k}")
            yield {"root": root, "endpoint": endpoint, "proxy": proxy, "local": local, "remote": remote}
        finally:
            proxy.stop()


def _env(url: str, cache_dir) -> dict:
    return {"AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1", "TOKENLOOM_S3_CACHE_DIR": str(cache_dir),
            "TOKENLOOM_S3_BLOCK_KIB": "32", "TOKENLOOM_S3_BACKOFF_S": "0.01",
            "TOKENLOOM_S3_READ_TIMEOUT_S": "1", "TOKENLOOM_S3_CACHE_MIB": "0.25"}  # smaller than the stores


@pytest.fixture()
def through_proxy(world, monkeypatch, tmp_path):
    for name, value in _env(world["proxy"].url, tmp_path / "node").items():
        monkeypatch.setenv(name, value)
    world["proxy"].clear()
    yield world["proxy"]
    world["proxy"].clear()


def _config(prefixes, cache_dir, **changes) -> dict:
    config = {"blend": {"prefixes": list(prefixes), "weights": [3.0, 5.0, 2.0]}, "split": "90,8,2",
              "seq_length": 64, "train_samples": 3000, "valid_samples": 200, "test_samples": 60, "seed": 1234,
              "cache_dir": str(cache_dir), "rng_workers": 0, "timeout_s": 60.0}
    config.update(changes)
    return config


def _arrays(cache_dir) -> list[bytes]:
    """Every index array of a cache, as .npy bytes, in a canonical order (item keys name the prefixes,
    so the same arrays built from s3:// and local stores sit under other keys)."""
    cache = Cache(str(cache_dir))
    return sorted(cache.npy_image(key, name[: -len(".npy")]) for key in cache.item_keys()
                  for name in cache.read_record(key)["files"])


def _served(result) -> dict[str, dict[str, np.ndarray]]:
    return {name: read_batch(SampleStream(source), np.arange(source.num_samples))
            for name, source in result.splits.items()}


def _assert_same_served(a, b) -> None:
    assert a.keys() == b.keys()
    for split in a:
        for field in a[split]:
            np.testing.assert_array_equal(a[split][field], b[split][field], err_msg=f"{split}/{field}")


@pytest.mark.parametrize("mode", ["exact", "stateless"])
def test_a_build_from_s3_equals_the_local_build_and_serves_the_same_samples(world, through_proxy, tmp_path, mode,
                                                                           monkeypatch):
    local = tokenloom.build(_config(world["local"], tmp_path / "local", mode=mode))
    faults = through_proxy.faults
    through_proxy.fail_next(2, status=503, code="SlowDown")
    through_proxy.cut_next(2)
    remote = tokenloom.build(_config(world["remote"], tmp_path / "remote", mode=mode))
    assert _arrays(tmp_path / "remote") == _arrays(tmp_path / "local")
    through_proxy.slow_next(1, 2.0)
    through_proxy.fail_next(3, status=500, code="InternalError")
    _assert_same_served(_served(remote), _served(local))
    assert through_proxy.faults - faults == 8 and not through_proxy.pending

    gets = through_proxy.object_gets
    monkeypatch.setenv("TOKENLOOM_S3_CACHE_DIR", str(tmp_path / "another-node"))
    again = tokenloom.build(_config(world["remote"], tmp_path / "remote", mode=mode))
    assert not again.built_keys and again.build_key == remote.build_key
    assert through_proxy.object_gets == gets  # a warm start on a fresh node: HEADs only, no object read
    assert not os.path.exists(tmp_path / "another-node")


def test_two_torchrun_ranks_build_from_s3_what_one_local_process_builds(world, tmp_path):
    config = tmp_path / "build.json"
    config.write_text(json.dumps(_config(world["remote"], tmp_path / "ranks")))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, **_env(world["endpoint"], tmp_path / "node"), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(port), "-m", "tokenloom.cli", "build", str(config), "--no-progress"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    tokenloom.build(_config(world["local"], tmp_path / "one"))
    assert _arrays(tmp_path / "ranks") == _arrays(tmp_path / "one")


def _jsonl(path, count: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    words = ["object", "store", "rank", "token", "ünï", "block"]
    with open(path, "w", encoding="utf-8") as f:
        for k in range(count):
            f.write(json.dumps({"text": f"{k} " + " ".join(rng.choice(words, size=int(rng.integers(1, 40))))}) + "\n")


def test_tokenizing_inputs_on_s3_equals_tokenizing_them_locally(world, through_proxy, tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    _jsonl(folder / "a.jsonl", 2000, 1)
    _jsonl(folder / "b.jsonl", 300, 2)
    (folder / "c.txt").write_text("a plain text document\n" * 3, encoding="utf-8")
    for name in ("a.jsonl", "b.jsonl", "c.txt"):
        upload(world["endpoint"], str(folder / name), f"s3://{BUCKET}/raw/{name}")
    tokenize_to_store([str(folder)], str(tmp_path / "local"), TokenizeConfig(workers=0))
    through_proxy.cut_next(1)
    through_proxy.fail_next(1)
    tokenize_to_store([f"s3://{BUCKET}/raw"], str(tmp_path / "remote"), TokenizeConfig(workers=0))
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"remote{suffix}").read_bytes() == (tmp_path / f"local{suffix}").read_bytes()
    meta = json.loads((tmp_path / "remote.meta.json").read_text())
    assert meta["source"]["inputs"] == [f"s3://{BUCKET}/raw/{n}" for n in ("a.jsonl", "b.jsonl", "c.txt")]

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(port), "-m", "tokenloom.cli", "tokenize", f"s3://{BUCKET}/raw/", "--output",
               str(tmp_path / "ranks"), "--workers", "0", "--chunk-size", "4096"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"ranks{suffix}").read_bytes() == (tmp_path / f"local{suffix}").read_bytes()


def test_dataloader_workers_serve_s3_stores_like_local_ones(world, through_proxy, tmp_path):
    """Forked DataLoader workers make their own S3 client, GET pool and block cache."""
    torch = pytest.importorskip("torch")
    from tokenloom.serve import BatchGeometry
    from tokenloom.serve.torch_adapter import build_dataloader

    geometry = BatchGeometry(global_batch_size=16, micro_batch_size=4, dp=1)
    local = tokenloom.build(_config(world["local"], tmp_path / "local")).split("train")
    remote = tokenloom.build(_config(world["remote"], tmp_path / "remote")).split("train")
    # a first read in this process before the fork: its client, pool and cache must not leak into workers
    read_batch(SampleStream(remote), np.arange(4))
    through_proxy.fail_next(2)
    through_proxy.cut_next(1)
    expected = [batch["tokens"] for batch in build_dataloader(local, geometry, max_steps=6, stateful=False)]
    got = [batch["tokens"] for batch in build_dataloader(remote, geometry, num_workers=2, max_steps=6,
                                                         stateful=False)]
    assert len(got) == len(expected) == 24
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
