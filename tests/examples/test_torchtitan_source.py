"""examples/torchtitan_source.py against torchtitan 0.3.0 as pip installs it: each rank gets its rows
of tokenloom's global batches in torchtitan's ``(input_dict, labels)`` shape, torchtitan's own
varlen metadata finds tokenloom's document boundaries in the positions, worker processes change
nothing, the state restores on another data-parallel degree, and the example's loop saved with DCP
on 2 ranks resumes on 1 with the losses of a run that never stopped."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
import yaml

torch = pytest.importorskip("torch")
pytest.importorskip("torchtitan.components.dataloader")

import tokenloom  # noqa: E402
from tokenloom.errors import ConfigError  # noqa: E402
from tokenloom.serve import BatchGeometry, SampleOptions  # noqa: E402
from tokenloom.serve.torch_adapter import ServeDataset, StatefulBatchSampler  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "torchtitan_source.py")
sys.path.insert(0, os.path.dirname(EXAMPLE))
import torchtitan_source as example  # noqa: E402

SEQ = 64


def _write_build(directory, store: str, packing: str) -> str:
    config = {"blend": [store], "split": "100,0,0", "seq_length": SEQ, "seed": 5, "train_samples": 16 * 40,
              "valid_samples": 0, "test_samples": 0, "cache": str(directory / "cache"), "packing": packing}
    path = directory / "build.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


@pytest.fixture(scope="module", params=["best_fit", "concat"])
def build(request, tmp_path_factory, stdlib_store) -> str:
    return _write_build(tmp_path_factory.mktemp(f"torchtitan-{request.param}"), stdlib_store, request.param)


def _loader(build: str, *, dp: int, rank: int, local: int, global_batch_size: int = 0, workers: int = 0):
    config = example.TokenloomDataLoader.Config(dataset_path=build, global_batch_size=global_batch_size,
                                                num_workers=workers)
    return config.build(dp_world_size=dp, dp_rank=rank, tokenizer=None, seq_len=SEQ, local_batch_size=local)


def _global_batches(build: str, global_batch_size: int, steps: int, start: int = 0) -> list[dict]:
    """tokenloom's own global batches (one process, every row), in torchtitan's terms."""
    split = tokenloom.build(build).split("train")
    dataset = ServeDataset(split, options=SampleOptions(eod_mask_loss=True, inter_document_masking=True),
                           fields=example.FIELDS)
    geometry = BatchGeometry(global_batch_size=global_batch_size, micro_batch_size=global_batch_size, dp=1)
    sampler = iter(StatefulBatchSampler(split, geometry))
    batches = [dataset[next(sampler)] for _ in range(start + steps)][start:]
    return [{"input": b["tokens"].clamp(min=0), "positions": b["position_ids"],
             "labels": b["labels"].masked_fill(b["loss_mask"] == 0, example.IGNORE_INDEX)} for b in batches]


def _equal(input_dict, labels, reference, rows) -> None:
    assert torch.equal(input_dict["input"], reference["input"][rows])
    assert torch.equal(input_dict["positions"], reference["positions"][rows])
    assert torch.equal(labels, reference["labels"][rows])


@pytest.mark.parametrize("dp, local, global_batch_size", [(2, 8, 0), (4, 2, 16)])
def test_each_rank_reads_its_rows_of_the_global_batches(build, dp, local, global_batch_size):
    """(4, 2, 16): 2 micro-batches per step, gradient accumulation's order (micro-step, then rank)."""
    reference = _global_batches(build, 16, 6)
    loaders = [iter(_loader(build, dp=dp, rank=r, local=local, global_batch_size=global_batch_size))
               for r in range(dp)]
    micro_steps = 16 // (dp * local)
    for step in range(6):
        for micro in range(micro_steps):
            for rank, loader in enumerate(loaders):
                input_dict, labels = next(loader)
                first = micro * dp * local + rank * local
                _equal(input_dict, labels, reference[step], slice(first, first + local))
    assert all(b["input"].min() >= 0 for b in reference)  # best-fit padding (-1) became a token id
    assert any((b["labels"] == example.IGNORE_INDEX).any() for b in reference)


def test_torchtitans_varlen_metadata_finds_tokenlooms_document_boundaries(build):
    from torchtitan.models.common.attention import create_varlen_metadata_for_document

    split = tokenloom.build(build).split("train")
    thd = ServeDataset(split, options=SampleOptions(eod_mask_loss=True, inter_document_masking=True,
                                                    boundary_format="thd"))
    sampler = iter(StatefulBatchSampler(split, BatchGeometry(global_batch_size=8, micro_batch_size=8, dp=1)))
    loader = iter(_loader(build, dp=1, rank=0, local=8))
    for _ in range(10):
        input_dict, _ = next(loader)
        ours = thd[next(sampler)]
        theirs = create_varlen_metadata_for_document(input_dict["positions"])
        expected = ours["cu_seqlens"][ours["cu_seqlens"] >= 0].to(torch.int32)  # -1: unused entries
        assert torch.equal(theirs.cu_seq_q, expected)
        assert theirs.max_q == int(ours["max_seqlen"])


def test_worker_processes_give_the_same_batches_and_state(build):
    plain, workers = _loader(build, dp=2, rank=1, local=4), _loader(build, dp=2, rank=1, local=4, workers=2)
    a, b = iter(plain), iter(workers)
    for _ in range(7):
        (x, y), (u, v) = next(a), next(b)
        assert torch.equal(x["input"], u["input"]) and torch.equal(x["positions"], u["positions"])
        assert torch.equal(y, v)
    # the workers read ahead; the state counts the 7 micro-batches the trainer was given
    assert plain.state_dict() == workers.state_dict()
    assert json.loads(workers.state_dict()["tokenloom"])["consumed_samples"] == 7 * 8


@pytest.mark.parametrize("dp_after", [1, 4])
def test_a_state_saved_at_dp2_resumes_at_another_degree(build, dp_after):
    saved = [_loader(build, dp=2, rank=r, local=8) for r in range(2)]
    for loader in saved:
        batches = iter(loader)
        for _ in range(5):
            next(batches)
    states = [loader.state_dict() for loader in saved]
    assert states[0] == states[1]  # one key, one value on every rank: DCP keeps one copy
    reference = _global_batches(build, 16, 4, start=5)
    local = 16 // dp_after
    resumed = [_loader(build, dp=dp_after, rank=r, local=local) for r in range(dp_after)]
    for loader in resumed:
        loader.load_state_dict(states[0])
    iterators = [iter(loader) for loader in resumed]
    for step in range(4):
        for rank, batches in enumerate(iterators):
            input_dict, labels = next(batches)
            _equal(input_dict, labels, reference[step], slice(rank * local, (rank + 1) * local))


def test_bad_configs_and_foreign_states_are_refused_plainly(build, tmp_path):
    with pytest.raises(ConfigError, match="dataset_path is empty"):
        example.TokenloomDataLoader.Config().build(dp_world_size=1, dp_rank=0, seq_len=SEQ, local_batch_size=4)
    with pytest.raises(ConfigError, match=r"seq_len=128 but the build .* seq_length=64"):
        example.TokenloomDataLoader.Config(dataset_path=build).build(dp_world_size=1, dp_rank=0, seq_len=128,
                                                                      local_batch_size=4)
    loader = _loader(build, dp=1, rank=0, local=4)
    with pytest.raises(ConfigError, match=r"keys \['dp_rank_0', 'world_size'\]; expected 'tokenloom'"):
        loader.load_state_dict({"dp_rank_0": b"", "world_size": 1})
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump({**yaml.safe_load(open(build)), "seed": 6}))
    with pytest.raises(ConfigError, match="build"):
        loader.load_state_dict(_loader(str(other), dp=1, rank=0, local=4).state_dict())


# --------------------------------------------------------------------------- the example's loop


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(build: str, *, ranks: int, args: list[str]) -> str:
    command = [sys.executable, EXAMPLE, build] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr",
        "127.0.0.1", "--master-port", str(_free_port()), EXAMPLE, build]
    result = subprocess.run([*command, "--global-batch-size", "16", *args], capture_output=True, text=True,
                            timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


def _losses(path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, open(path, encoding="utf-8"))}


def test_the_loop_learns_and_a_dcp_checkpoint_of_2_ranks_resumes_on_1(stdlib_store, tmp_path):
    build = _write_build(tmp_path, stdlib_store, "best_fit")
    whole = tmp_path / "whole.jsonl"
    out = _train(build, ranks=1, args=["--steps", "30", "--losses", str(whole), "--log-every", "10"])
    assert "step 30  loss" in out and "tokens/s" in out
    losses = _losses(whole)
    assert sorted(losses) == list(range(1, 31)) and losses[30] < losses[1] - 1.0
    first, second, checkpoint = tmp_path / "first.jsonl", tmp_path / "second.jsonl", tmp_path / "ckpt"
    _train(build, ranks=2, args=["--steps", "20", "--workers", "1", "--checkpoint", str(checkpoint),
                                 "--losses", str(first)])
    _train(build, ranks=1, args=["--steps", "30", "--checkpoint", str(checkpoint), "--resume",
                                 "--losses", str(second)])
    resumed = {**_losses(first), **_losses(second)}
    assert sorted(resumed) == list(range(1, 31))
    for step in range(1, 31):
        assert resumed[step] == pytest.approx(losses[step], rel=1e-4, abs=1e-5), step
    assert np.isfinite(list(resumed.values())).all()
