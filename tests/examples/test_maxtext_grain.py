"""examples/maxtext_grain.py on 4 CPU devices: grain workers feed global arrays, the loss falls, and
a run saved on 2 JAX processes resumes on 1 with the same losses as a run that never stopped."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import yaml

pytest.importorskip("jax")
pytest.importorskip("grain")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "maxtext_grain.py")
ENV = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def build(tmp_path_factory, stdlib_store):
    """A best-fit build of a byte-tokenized store of real text (standard-library sources)."""
    directory = tmp_path_factory.mktemp("maxtext")
    config = {"blend": [stdlib_store], "split": "100,0,0", "seq_length": 64, "seed": 3, "train_samples": 16 * 40,
              "valid_samples": 0, "test_samples": 0, "cache": str(directory / "cache"), "packing": "best_fit"}
    path = directory / "build.yaml"
    path.write_text(yaml.safe_dump(config))
    return directory, str(path)


def _run(build: str, args: list[str], *, processes: int = 1) -> list[subprocess.CompletedProcess]:
    port = _free_port()
    commands = [[sys.executable, EXAMPLE, build, "--global-batch-size", "16", *args]
                + (["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(processes), "--process-id", str(p)]
                   if processes > 1 else []) for p in range(processes)]
    running = [subprocess.Popen(c, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for c in commands]
    done = []
    for process, command in zip(running, commands):
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, err[-4000:]
        done.append(subprocess.CompletedProcess(command, process.returncode, out, err))
    return done


def _losses(path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, open(path, encoding="utf-8"))}


def test_the_loss_falls_and_a_two_process_run_resumes_on_one(build):
    directory, config = build
    whole = directory / "whole.jsonl"
    out = _run(config, ["--steps", "30", "--workers", "2", "--losses", str(whole), "--log-every", "10"])[0].stdout
    assert "step 30  loss" in out and "tokens/s" in out
    losses = _losses(whole)
    assert sorted(losses) == list(range(1, 31))
    assert losses[30] < losses[1] - 0.5  # it learns from the batches it is fed
    # 2 processes (2 devices' worth of rows each... 4 CPU devices each, 8 in all) to step 20, saved
    first = directory / "first.jsonl"
    checkpoint = directory / "ckpt"
    _run(config, ["--steps", "20", "--workers", "2", "--checkpoint", str(checkpoint), "--losses", str(first)],
         processes=2)
    assert sorted(os.listdir(checkpoint)) == ["bigram.npy", "model.json", "process_0-of-2.json", "process_1-of-2.json"]
    # resumed on 1 process, the same 2 grain workers
    second = directory / "second.jsonl"
    _run(config, ["--steps", "30", "--workers", "2", "--checkpoint", str(checkpoint), "--resume",
                  "--losses", str(second)])
    resumed = {**_losses(first), **_losses(second)}
    assert sorted(resumed) == list(range(1, 31))
    for step in range(1, 31):
        assert resumed[step] == pytest.approx(losses[step], rel=1e-4, abs=1e-5), step
