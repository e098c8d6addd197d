"""Balanced ranks in serving (BatchGeometry(balance=...)): every step serves the same samples with
the same fields, placed on (rank, micro-batch) slots by their cost; resumes on other layouts;
composes with skips, quarantines, weight changes and batch-size ramps; torch and JAX adapters."""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tokenloom
from balance_reference import reference_assign_slots, reference_batch_costs, reference_step_placement
from serve_fixtures import write_corpus
from tokenloom.cli import main as cli_main
from tokenloom.errors import ConfigError
from tokenloom.index import CostModel
from tokenloom.index.balance import assign_slots, served_document_pairs, slot_costs
from tokenloom.serve import (
    BatchGeometry,
    BatchSizeSchedule,
    MixtureAudit,
    RankLoader,
    SampleOptions,
    Topology,
    read_audit_log,
)
from tokenloom.serve import sampler as sampler_module
from tokenloom.serve.balance import balance_report, batch_costs, slots_of
from tokenloom.serve.sampler import MicroBatchSampler
from tokenloom.serve.simulate import simulate_job
from tokenloom.source import StoreBlendSource

MASKING = SampleOptions(inter_document_masking=True)
ATTENTION = CostModel(attention=1, tokens=1)  # attention dominates at seq_length 16, as at 32k with d = 4096


@pytest.fixture(scope="module", params=["exact", "stateless", "best_fit"])
def built(request, tmp_path_factory):
    """The build's config file and its train split."""
    root = tmp_path_factory.mktemp(f"balance-{request.param}")
    prefixes = write_corpus(root, 2, seed=43, num_documents=120, max_length=30)
    config = {"blend": {"prefixes": prefixes, "weights": [0.6, 0.4]}, "split": "100,0,0", "seq_length": 16,
              "train_samples": 600, "valid_samples": 0, "test_samples": 0, "seed": 5,
              "mode": "exact" if request.param == "best_fit" else request.param, "cache_dir": str(root / "cache")}
    if request.param == "best_fit":
        config["packing"] = "best_fit"
    path = root / "build.json"
    path.write_text(json.dumps(config))
    return path, tokenloom.build(config).split("train")


@pytest.fixture(scope="module")
def split(built):
    return built[1]


def _geometry(dp, *, micro=2, size=16, balance="attention", cost=ATTENTION):
    return BatchGeometry(global_batch_size=size, micro_batch_size=micro, dp=dp, balance=balance,
                         balance_cost=cost if balance == "attention" else None)


def _pairs(cu_seqlens: np.ndarray) -> np.ndarray:
    documents = np.diff(cu_seqlens.astype(np.int64), axis=-1)
    return (documents * (documents + 1) // 2).sum(axis=-1)


def test_a_balanced_job_serves_the_same_samples_and_fields_and_evens_the_ranks(split, tmp_path):
    topology = Topology(dp=4, tp=2, pp=2)
    plain = simulate_job(split, _geometry(4, balance=None), topology, num_steps=6, options=MASKING,
                         audit=MixtureAudit(tmp_path / "plain.jsonl"))
    balanced = simulate_job(split, _geometry(4), topology, num_steps=6, options=MASKING,
                            audit=MixtureAudit(tmp_path / "balanced.jsonl"))
    assert balanced.state == plain.state
    fingerprints = [[r["fingerprint"] for r in read_audit_log(tmp_path / f"{name}.jsonl").records]
                    for name in ("plain", "balanced")]
    assert fingerprints[0] == fingerprints[1] and len(fingerprints[0]) == 6
    moved = 0
    for step, (ours, theirs) in enumerate(zip(balanced.global_batches, plain.global_batches)):
        for name, value in theirs.items():  # bit-identical per sample, in stream order
            np.testing.assert_array_equal(ours[name], value, err_msg=f"step {step} {name}")
        # each rank's cost as the attention kernel sees the served boundaries
        pairs = _pairs(theirs["cu_seqlens"])  # (G,) stream order
        unbalanced = slot_costs(pairs * ATTENTION.attention + 16 * ATTENTION.tokens, np.arange(16), dp=4,
                                micro_batch_size=2)
        default = CostModel.for_width()  # what a job without balance is costed by
        np.testing.assert_array_equal(plain.rank_costs[step], slot_costs(
            pairs * default.attention + 16 * default.tokens, np.arange(16), dp=4, micro_batch_size=2))
        assert balanced.rank_costs[step].sum() == unbalanced.sum()
        assert balanced.rank_costs[step].sum(axis=0).max() <= unbalanced.sum(axis=0).max()
        moved += not np.array_equal(balanced.rank_costs[step], unbalanced)
    assert moved  # placement did change somewhere


def test_every_rank_reads_its_own_slots_and_where_reports_them(split):
    geometry = _geometry(4)
    samplers = [MicroBatchSampler(split, geometry, dp_rank=r, max_steps=5) for r in range(4)]
    placed = {}
    for step in range(5):
        served = []
        for micro in range(2):
            for r, sampler in enumerate(samplers):
                positions = sampler.positions()
                served.extend(positions.tolist())
                for p in positions.tolist():
                    placed[p] = (step, r, micro)
                sampler.advance()
        assert sorted(served) == list(range(16 * step, 16 * (step + 1)))  # no slot empty or filled twice
    slots = slots_of(samplers[0].stream, geometry, np.arange(80))
    assert [(s.step, s.dp_rank, s.micro_batch) for s in slots] == [placed[p] for p in range(80)]
    unbalanced = slots_of(samplers[0].stream, _geometry(4, balance=None), np.arange(16, 32))
    assert [(s.step, s.dp_rank, s.micro_batch) for s in unbalanced] == \
        [(1, (p % 8) // 2, p // 8) for p in range(16)]  # Megatron's order


def test_resume_on_another_layout_recomputes_the_placement(split):
    options = MASKING
    whole = simulate_job(split, _geometry(8, micro=1), Topology(dp=8), num_steps=5, options=options)
    first = simulate_job(split, _geometry(2), Topology(dp=2, pp=2, cp=2), num_steps=2, options=options)
    rest = simulate_job(split, _geometry(4, micro=4, size=16), Topology(dp=4), num_steps=3, options=options,
                        state=first.state)
    for step, batch in enumerate(first.global_batches + rest.global_batches):
        for name, value in whole.global_batches[step].items():
            np.testing.assert_array_equal(batch[name], value, err_msg=f"step {step} {name}")
    assert {**rest.state, "samples_per_micro_step": 8} == whole.state  # the state is the stream's, not the layout's
    # the placement on the new layout is the one computed there from scratch
    fresh = MicroBatchSampler(split, _geometry(4, micro=4, size=16), dp_rank=3)
    fresh.seek(2, 32)
    resumed = MicroBatchSampler(split, _geometry(4, micro=4, size=16), dp_rank=3)
    resumed.load_state_dict(first.state)
    np.testing.assert_array_equal(resumed.positions(), fresh.positions())


def test_skips_quarantines_weight_changes_and_ramps_compose(split):
    geometry = _geometry(2)
    plain = MicroBatchSampler(split, dataclasses.replace(geometry, balance=None, balance_cost=None))
    samplers = [MicroBatchSampler(split, geometry, dp_rank=r) for r in range(2)]
    document = split.where([40])[0]
    for sampler in (plain, *samplers):
        sampler.next_step()
        sampler.skip_steps(2, 4)
        sampler.quarantine([(document.prefix, document.pieces[0].document)])
        sampler.reweight([0.3, 0.7])
    for _ in range(5):
        served = []
        for _ in range(plain.num_micro_batches):
            for sampler in samplers:
                served.extend(sampler.positions().tolist())
                sampler.advance()
        assert sorted(served) == plain.global_batch_positions().tolist()
        plain.next_step()
    # a batch-size ramp: each step placed at its own size
    ramp = BatchSizeSchedule(steps=((0, 8), (24, 16)))
    ramped = [MicroBatchSampler(split, dataclasses.replace(geometry, schedule=ramp), dp_rank=r) for r in range(2)]
    starts = []
    while ramped[0].step < 6:
        starts.append(ramped[0].step_start)
        served = []
        for _ in range(ramped[0].num_micro_batches):
            for sampler in ramped:
                served.extend(sampler.positions().tolist())
                sampler.advance()
        assert sorted(served) == list(range(starts[-1], starts[-1] + len(served)))
    assert starts == [0, 8, 16, 24, 40, 56]


@st.composite
def _batches(draw):
    """Costs of a few global batches of one layout: many ties, or wide and distinct."""
    dp, micro, num_micro = draw(st.sampled_from([1, 2, 3, 4, 8, 16])), draw(st.integers(1, 3)), draw(st.integers(1, 4))
    size, steps = dp * micro * num_micro, draw(st.integers(1, 3))
    high = draw(st.sampled_from([3, 1000, 2**40]))
    costs = draw(st.lists(st.integers(0, high), min_size=size * steps, max_size=size * steps))
    return np.array(costs, dtype=np.int64).reshape(steps, size), dp, micro


@settings(max_examples=150, deadline=None)
@given(_batches())
def test_the_fast_assignment_is_the_reference_assignment(case):
    """The kernel's own stable sorts and the (steps, G) call place exactly as numpy's sorts did."""
    costs, dp, micro = case
    expected = np.stack([reference_assign_slots(row, dp, micro) for row in costs])
    np.testing.assert_array_equal(assign_slots(costs, dp=dp, micro_batch_size=micro), expected)
    np.testing.assert_array_equal(assign_slots(costs[0], dp=dp, micro_batch_size=micro), expected[0])
    np.testing.assert_array_equal(assign_slots(costs, dp=dp, micro_batch_size=micro, backend="python"), expected)


@pytest.mark.parametrize("balance", ["attention", "tokens"])
def test_steps_placed_ahead_are_the_steps_placed_alone(split, balance, monkeypatch):
    """The sampler places several steps at once (a window of PLACE_AHEAD_SAMPLES, here small so
    that windows end inside the run) from the index arrays; every step is the one the spans-based
    per-step reference places, also after a skip, quarantine, weight change or resume, and every
    sample's cost is the spans' cost."""
    monkeypatch.setattr(sampler_module, "PLACE_AHEAD_SAMPLES", 40)
    for dp, micro, size in ((4, 2, 16), (2, 1, 8), (8, 1, 16), (1, 4, 8)):
        geometry = _geometry(dp, micro=micro, size=size, balance=balance)
        sampler = MicroBatchSampler(split, geometry, dp_rank=dp - 1)
        np.testing.assert_array_equal(batch_costs(sampler.stream, np.arange(split.num_samples), geometry),
                                      reference_batch_costs(sampler.stream, np.arange(split.num_samples), geometry))
        document = split.where([3 * size + 1])[0]
        events = {2: "save", 3: "skip and quarantine", 7: "reweight", 9: "resume"}
        state, checked = None, 0
        for _ in range(14):
            event = events.pop(sampler.step, None)
            if event == "save":
                state = sampler.state_dict()
            elif event == "skip and quarantine":
                sampler.skip_steps(4, 5)
                sampler.quarantine([(document.prefix, document.pieces[0].document)])
            elif event == "reweight":
                sampler.reweight([0.3, 0.7])
            elif event == "resume":  # back to step 2, on the stream as it was there
                sampler.load_state_dict(state)
            if sampler.exhausted():
                break
            expected = reference_step_placement(sampler.stream, geometry, sampler.step_start, size)
            np.testing.assert_array_equal(sampler.placement(), expected,
                                          err_msg=f"{dp=} {size=} step {sampler.step} after {event}")
            checked += 1
            sampler.next_step()
        assert not events and checked == 14


def test_a_window_the_cost_guard_refuses_places_its_steps_one_by_one(split, monkeypatch):
    """CostModel.sample_costs refuses a batch whose summed costs could overflow; a window of steps
    is a larger batch than a step, so the sampler then places the step alone, as before."""
    monkeypatch.setattr(sampler_module, "PLACE_AHEAD_SAMPLES", 64)
    stream = MicroBatchSampler(split, _geometry(4)).stream
    pairs = reference_batch_costs(stream, np.arange(64), _geometry(4, cost=CostModel(attention=1, tokens=0)))
    datasets, _ = stream.locate(np.arange(64))
    window = max(int(pairs[datasets == d].max()) * int((datasets == d).sum()) for d in np.unique(datasets))
    geometry = _geometry(4, cost=CostModel(attention=-(-2**62 // window), tokens=0))  # the window's guard trips
    sampler = MicroBatchSampler(split, geometry, dp_rank=1)
    with pytest.raises(ConfigError, match="overflows int64"):
        batch_costs(sampler.stream, np.arange(64), geometry)
    for _ in range(4):
        np.testing.assert_array_equal(sampler.placement(),
                                      reference_step_placement(sampler.stream, geometry, sampler.step_start, 16))
        sampler.next_step()


def test_balance_by_tokens_keeps_megatrons_order_where_every_sample_is_full(split):
    geometry = _geometry(4, balance="tokens")
    sampler = MicroBatchSampler(split, geometry, dp_rank=1)
    costs = batch_costs(sampler.stream, np.arange(split.num_samples), geometry)
    if split.readers[0].__class__.__name__ == "BestFitReader":
        assert costs.min() < 16  # padded samples: their real tokens differ
    else:
        assert costs.tolist() == [16] * split.num_samples
        np.testing.assert_array_equal(sampler.placement(), np.arange(16))
    rows = list(RankLoader(split, geometry, topology=Topology(dp=4), rank=1, max_steps=2))
    assert len(rows) == 4 and rows[0]["tokens"].shape == (2, 16)


def test_the_default_cost_model_and_the_report(split):
    geometry = BatchGeometry(global_batch_size=32, micro_batch_size=2, dp=4, balance="attention")
    stream = MicroBatchSampler(split, geometry).stream
    costs = batch_costs(stream, np.arange(32), geometry)
    origins = split.where(np.arange(32))
    lengths = np.array([p.length for o in origins for p in o.pieces])
    bounds = np.concatenate([[0], np.cumsum([len(o.pieces) for o in origins])])
    pairs = served_document_pairs(lengths, bounds, 16, True)
    np.testing.assert_array_equal(costs, pairs * 4 * 4096 + 16 * 24 * 4096**2)
    report = balance_report(split, dataclasses.replace(geometry, balance_cost=ATTENTION), num_steps=5)
    assert report.balanced.shape == (5, 4, 4)
    assert (report.imbalance <= report.unbalanced_imbalance).all()
    assert (report.imbalance >= 1).all() and (report.bound >= 1).all()
    summary = report.summary()
    assert summary["steps"] == 5 and summary["balanced"]["max"] <= summary["unbalanced"]["max"]


def test_refusals(split, tmp_path):
    with pytest.raises(ConfigError, match=r"balance='attention'.*inter_document_masking=False.*balance='tokens'"):
        RankLoader(split, _geometry(2), topology=Topology(dp=2))
    with pytest.raises(ConfigError, match="balance='sequence'; expected None or one of"):
        BatchGeometry(global_batch_size=8, micro_batch_size=2, dp=2, balance="sequence")
    with pytest.raises(ConfigError, match=r"balance_cost=.*with balance='tokens'"):
        BatchGeometry(global_batch_size=8, micro_batch_size=2, dp=2, balance="tokens", balance_cost=ATTENTION)
    with pytest.raises(ConfigError, match="global batch size 12 is not divisible"):
        BatchGeometry(global_batch_size=12, micro_batch_size=2, dp=4, balance="attention")

    class TokensOnly:  # a SampleSource without document pieces
        def __getattr__(self, name):
            if name == "readers":
                raise AttributeError(name)
            return getattr(split, name)

    with pytest.raises(ConfigError, match="does not list its samples' document pieces"):
        MicroBatchSampler(TokensOnly(), _geometry(2))


@pytest.fixture(scope="module")
def memory_source(tmp_path_factory):
    prefixes = write_corpus(tmp_path_factory.mktemp("balance-adapters"), 2, seed=44, num_documents=90, max_length=30)
    return StoreBlendSource.from_prefixes(prefixes, [0.5, 0.5], num_samples=300, seq_length=16, seed=3)


def test_torch_dataloader_serves_the_balanced_placement(memory_source):
    pytest.importorskip("torch")
    from tokenloom.serve.torch_adapter import build_dataloader

    geometry = _geometry(2)
    for rank in range(2):
        loader = build_dataloader(memory_source, geometry, rank=rank, options=MASKING, num_workers=2, max_steps=4,
                                  whole_steps=True)
        expected = list(RankLoader(memory_source, geometry, rank=rank, options=MASKING, max_steps=4))
        got = list(loader)  # one item per step: the step's micro-batches of per-sample fields
        assert len(got) == 4
        for step, item in enumerate(got):
            for name in ("tokens", "cu_seqlens", "labels"):
                np.testing.assert_array_equal(  # 4 micro-batches of 2 per rank and step
                    item[name].numpy(), np.concatenate([expected[4 * step + m][name] for m in range(4)]))
    with pytest.raises(ConfigError, match="inter_document_masking=False"):
        build_dataloader(memory_source, geometry, options=SampleOptions())


def test_jax_hosts_place_the_global_batch_by_cost(memory_source):
    from tokenloom.serve.jax_adapter import HostLoader, ShardOptions

    segments = SampleOptions(inter_document_masking=True, boundary_format="segments")
    whole = list(HostLoader(memory_source, global_batch_size=16, shard=ShardOptions(shard_index=0, shard_count=1),
                            options=segments, max_steps=4))
    hosts = [list(HostLoader(memory_source, global_batch_size=16, shard=ShardOptions(shard_index=p, shard_count=4),
                             options=segments, max_steps=4, balance="attention")) for p in range(4)]
    changed = 0
    for step in range(4):
        rows = np.concatenate([hosts[p][step]["tokens"] for p in range(4)])
        assert sorted(map(tuple, rows.tolist())) == sorted(map(tuple, whole[step]["tokens"].tolist()))
        changed += not np.array_equal(rows, whole[step]["tokens"])
        def work(segmentation) -> int:  # sum over rows and documents of L(L+1)/2 (concat: no padding)
            lengths = np.concatenate([np.bincount(row)[1:] for row in segmentation])
            return int((lengths * (lengths + 1) // 2).sum())

        # every host holds 4 full rows, so the default cost orders hosts by attention pairs alone
        balanced = max(work(hosts[p][step]["inputs_segmentation"]) for p in range(4))
        assert balanced <= max(work(whole[step]["inputs_segmentation"][4 * p:4 * p + 4]) for p in range(4))
    assert changed


def test_where_find_and_balance_commands(built, capsys):
    config, split = built
    geometry = _geometry(4, cost=None)
    assert cli_main(["where", str(config), "--step", "1", "--global-batch-size", "16", "--dp", "4",
                     "--micro-batch-size", "2", "--balance", "attention", "--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    samplers = [MicroBatchSampler(split, geometry, dp_rank=r) for r in range(4)]
    for sampler in samplers:
        sampler.next_step()
    for micro in range(2):
        for r, sampler in enumerate(samplers):
            for p in sampler.positions().tolist():
                assert (records[p - 16]["step"], records[p - 16]["dp_rank"], records[p - 16]["micro_batch"]) == \
                    (1, r, micro)
            sampler.advance()
    piece = records[5]["pieces"][0]
    assert cli_main(["find", str(config), "--store", records[5]["prefix"], "--document", str(piece["document"]),
                     "--global-batch-size", "16", "--dp", "4", "--micro-batch-size", "2", "--balance", "attention",
                     "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    slots = slots_of(split, geometry, found["positions"])
    assert found["slots"] == [{"dp_rank": s.dp_rank, "micro_batch": s.micro_batch} for s in slots]
    assert cli_main(["balance", str(config), "--dp", "4", "--micro-batch-size", "2", "--global-batch-size", "16",
                     "--steps", "5", "--hidden-size", "64", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    report = balance_report(split, dataclasses.replace(geometry, balance_cost=CostModel.for_width(64)), num_steps=5)
    assert summary == report.summary()
    assert cli_main(["balance", str(config), "--dp", "4", "--micro-batch-size", "2", "--global-batch-size", "16",
                     "--steps", "5"]) == 0
    table = capsys.readouterr().out
    assert re.search(r"\| balanced +\| +1\.0\d\d \|", table) and "Megatron's order" in table
    assert cli_main(["where", str(config), "--positions", "0:4", "--balance", "tokens"]) == 2
    assert "--balance needs --dp" in capsys.readouterr().err


def test_grain_stream_places_the_hosts_rows_as_host_loader_does(memory_source):
    grain = pytest.importorskip("grain")  # noqa: F841 - the adapter imports it
    from tokenloom.serve.grain_adapter import GrainStream
    from tokenloom.serve.jax_adapter import HostLoader, ShardOptions

    for p in range(2):
        shard = ShardOptions(shard_index=p, shard_count=2)
        stream = iter(GrainStream(memory_source, global_batch_size=8, shard=shard, options=MASKING,
                                  balance="attention", max_steps=3))
        loader = HostLoader(memory_source, global_batch_size=8, shard=shard, options=MASKING, balance="attention",
                            max_steps=3)
        for _ in range(3):
            ours, theirs = next(stream), next(loader)
            np.testing.assert_array_equal(ours["tokens"], theirs["tokens"])
    with pytest.raises(ConfigError, match="inter_document_masking=False"):
        GrainStream(memory_source, global_batch_size=8, shard=ShardOptions(shard_index=0, shard_count=2),
                    balance="attention")


def test_the_data_geometry_file_carries_balance(tmp_path):
    from tokenloom.planning import DataGeometry

    plain = DataGeometry(seq_length=16, global_batch_size=16, micro_batch_size=2, data_parallel_size=4,
                         gradient_accumulation_steps=2, train_iters=10)
    assert "balance" not in plain.to_dict()  # files written before stay as they were
    assert BatchGeometry.from_data_geometry(plain).balance is None
    balanced = dataclasses.replace(plain, balance="attention")
    loaded = DataGeometry.load(balanced.write(tmp_path / "geometry.yaml"))
    assert loaded == balanced and BatchGeometry.from_data_geometry(loaded).balance == "attention"
    with pytest.raises(ConfigError, match=r"DataGeometry\.balance='flops'; expected one of"):
        dataclasses.replace(plain, balance="flops")


@pytest.mark.parametrize("form", ["thd", "segments"])
def test_every_boundary_format_serves_the_balanced_micro_batches(memory_source, form):
    options = SampleOptions(inter_document_masking=True, boundary_format=form)
    geometry = _geometry(2)
    for rank in range(2):
        ours = list(RankLoader(memory_source, geometry, rank=rank, options=options, max_steps=2))
        megatron = list(RankLoader(memory_source, geometry, rank=rank, options=MASKING, max_steps=2))
        for mine, reference in zip(ours, megatron):  # the same rows, in the other form
            np.testing.assert_array_equal(mine["tokens"].reshape(2, 16), reference["tokens"])
