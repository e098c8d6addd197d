"""The PyTorch adapter: DataLoader with workers, torchdata's StatefulDataLoader, torchrun ranks."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

import tokenloom
from serve_fixtures import write_corpus
from tokenloom.errors import ConfigError
from tokenloom.serve import BatchGeometry, MixtureAudit, RankLoader, SampleOptions, Topology, read_audit_log
from tokenloom.source import StoreBlendSource

torch = pytest.importorskip("torch")
from tokenloom.serve.torch_adapter import build_dataloader  # noqa: E402

OPTIONS = SampleOptions(eod_mask_loss=True, reset_position_ids=True, create_attention_mask=True,
                        reset_attention_mask=True)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    prefixes = write_corpus(tmp_path_factory.mktemp("torch"), 2, seed=21, num_documents=70)
    return StoreBlendSource.from_prefixes(prefixes, [0.6, 0.4], num_samples=400, seq_length=16, seed=9)


def _assert_batches_equal(torch_batches, numpy_batches):
    assert len(torch_batches) == len(numpy_batches)
    for n, (a, b) in enumerate(zip(torch_batches, numpy_batches)):
        assert set(a) == set(b), (n, sorted(a), sorted(b))
        for k in b:
            assert a[k].numpy().dtype == b[k].dtype, (n, k)
            np.testing.assert_array_equal(a[k].numpy(), b[k], err_msg=f"batch {n} field {k}")


@pytest.mark.parametrize("rank", [0, 5, 6])
def test_dataloader_with_workers_equals_rank_loader(source, rank):
    topology = Topology(dp=2, pp=2, cp=2)  # ranks 0 (pp 0, cp 0) 5 (pp 1, cp 0... ) 6
    geometry = BatchGeometry(global_batch_size=8, micro_batch_size=2, dp=2)
    loader = build_dataloader(source, geometry, topology=topology, rank=rank, options=OPTIONS, num_workers=2,
                              prefetch_factor=2, pin_memory=False, max_steps=6)
    expected = list(RankLoader(source, geometry, topology=topology, rank=rank, options=OPTIONS, max_steps=6))
    _assert_batches_equal(list(loader), expected)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stateful_dataloader_resume(source, num_workers, tmp_path):
    pytest.importorskip("torchdata.stateful_dataloader")
    geometry = BatchGeometry(global_batch_size=8, micro_batch_size=2, dp=2)
    def make():
        return build_dataloader(source, geometry, rank=1, options=OPTIONS, num_workers=num_workers,
                                prefetch_factor=2 if num_workers else None, max_steps=10, stateful=True)

    full = list(make())
    loader = make()
    iterator = iter(loader)
    head = [next(iterator) for _ in range(7)]
    torch.save(loader.state_dict(), tmp_path / "state.pt")
    resumed = make()
    resumed.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=False))
    tail = list(resumed)
    assert len(head) + len(tail) == len(full) == 20
    for a, b in zip(head + tail, full):
        for k in b:
            assert torch.equal(a[k], b[k]), k


def test_plain_dataloader_sampler_state_and_refusals(source):
    geometry = BatchGeometry(global_batch_size=8, micro_batch_size=2, dp=2)
    loader = build_dataloader(source, geometry, rank=0, stateful=False, max_steps=3)
    assert isinstance(loader, torch.utils.data.DataLoader) and len(loader) == 6
    state = loader.batch_sampler.state_dict()
    assert state["consumed_samples"] == 0
    with pytest.raises(ConfigError, match="loads no data"):
        build_dataloader(source, geometry, topology=Topology(dp=2, pp=3), rank=2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_tp_pp_ranks_get_identical_tensors(source, tmp_path):
    """4 gloo ranks (tp=2, pp=2) launched by torchrun; tensor peers end up with equal tensors,
    equal to what one process reads, in both load modes, and with the document boundaries (the
    per-sample int32 cu_seqlens broadcast to the peers of both stages, then packed per micro-batch
    on every rank)."""
    out = tmp_path / "out"
    out.mkdir()
    prefixes = [d.name for d in source.datasets]
    # a schedule whose second phase doubles the sequence length: both stores change length
    length_runs = {"phases": [{"blend": ["1", prefixes[0], "1", prefixes[1]], "until": {"steps": 2}},
                              {"blend": ["1", prefixes[0], "3", prefixes[1]], "until": {"steps": 4},
                               "seq_length": 32}],
                   "split": "100,0,0", "seq_length": 16, "global_batch_size": 4, "valid_samples": 0,
                   "test_samples": 0, "seed": 9, "mode": "stateless", "cache_dir": str(tmp_path / "cache"),
                   "rng_workers": 0, "timeout_s": 60.0}
    runs = tokenloom.build(length_runs).split("train")
    config = {"prefixes": prefixes, "weights": [0.6, 0.4], "num_samples": 400,
              "seq_length": 16, "seed": 9, "out": str(out), "length_runs": length_runs}
    (tmp_path / "config.json").write_text(json.dumps(config))
    worker = os.path.join(os.path.dirname(__file__), "torchrun_serve_worker.py")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), *sys.path])}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-addr", "127.0.0.1",
               "--master-port", str(_free_port()), worker, str(tmp_path / "config.json")]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    topology = Topology(dp=1, tp=2, pp=2)
    geometry = BatchGeometry(global_batch_size=4, micro_batch_size=2, dp=1)
    expected_audit = MixtureAudit()
    for _ in RankLoader(source, geometry, max_steps=3, audit=expected_audit):
        pass
    for mode in ("broadcast", "every_rank", "documents"):  # rank 0 logged every step of the job
        logged = read_audit_log(out / f"{mode}-audit.jsonl").records
        assert [r["fingerprint"] for r in logged] == [r["fingerprint"] for r in expected_audit.records]
    modes = ("broadcast", "every_rank", "documents", "length_runs")
    for mode, rank in ((m, r) for m in modes for r in range(4)):
        got = np.load(out / f"{mode}-rank{rank}.npz")
        options = (SampleOptions(inter_document_masking=True, boundary_format="thd") if mode == "documents"
                   else SampleOptions())
        expected = list(RankLoader(runs if mode == "length_runs" else source, geometry, topology=topology,
                                   rank=topology.rank_of(pp_rank=topology.coordinates(rank).pp_rank),
                                   max_steps=4 if mode == "length_runs" else 3, options=options))
        if mode == "length_runs":  # two steps at each length: the receivers sized both
            assert [b.get("tokens", b.get("labels")).shape[1] for b in expected] == [16] * 4 + [32] * 4
        if mode == "documents":
            assert {"cu_seqlens", "max_seqlen", "document_ids"} <= set(expected[0])
            assert expected[0]["cu_seqlens"].ndim == 1 and expected[0]["max_seqlen"].ndim == 0
        names = sorted({k.split("/")[1] for k in got.files})
        assert names == sorted(expected[0])
        for n, batch in enumerate(expected):
            for k, v in batch.items():
                np.testing.assert_array_equal(got[f"{n}/{k}"], v, err_msg=f"{mode} rank {rank} batch {n} {k}")


def test_distributed_batches_fetch_whole_steps_and_resume_mid_step(source):
    from tokenloom.serve.torch_adapter import DistributedBatches

    topology = Topology(dp=2, pp=2)
    geometry = BatchGeometry(global_batch_size=12, micro_batch_size=2, dp=2)  # 3 micro-batches per step
    rank = topology.rank_of(dp_rank=1, pp_rank=1)
    expected = list(RankLoader(source, geometry, topology=topology, rank=rank, options=OPTIONS, max_steps=4))
    first = DistributedBatches(source, geometry, topology, rank, options=OPTIONS, num_workers=1, max_steps=4)
    head = [first.next_batch() for _ in range(4)]  # one step and one micro-batch into the next
    resumed = DistributedBatches(source, geometry, topology, rank, options=OPTIONS, max_steps=4)
    resumed.load_state_dict(first.state_dict())
    tail = list(resumed)
    _assert_batches_equal(head + tail, expected)


def test_distributed_batches_skip_steps_after_reading_ahead(source):
    from tokenloom.serve.torch_adapter import DistributedBatches

    topology = Topology(dp=2)
    geometry = BatchGeometry(global_batch_size=8, micro_batch_size=2, dp=2)  # 2 micro-batches per step
    reference = RankLoader(source, geometry, topology=topology, rank=1, options=OPTIONS, max_steps=8)
    expected = [reference.next_batch() for _ in range(4)]
    reference.skip_steps(3, 5)
    expected += list(reference)
    batches = DistributedBatches(source, geometry, topology, 1, options=OPTIONS, num_workers=1, max_steps=8)
    got = [batches.next_batch() for _ in range(4)]  # its worker has read steps 2 and 3 ahead by now
    batches.skip_steps(3, 5)
    got += list(batches)
    _assert_batches_equal(got, expected)
