"""One global stream: resume on any layout, weights changed at a resume, states of other builds."""

from __future__ import annotations

import json

import numpy as np
import pytest

from serve_fixtures import write_corpus
from tokenloom.errors import ConfigError
from tokenloom.serve import (
    BatchGeometry,
    BatchSizeSchedule,
    MixtureAudit,
    RankLoader,
    SampleOptions,
    Topology,
    read_audit_log,
    summarize_audit,
)
from tokenloom.source import StoreBlendSource

GLOBAL, MICRO, SEQ = 16, 2, 12
OPTIONS = SampleOptions(eod_mask_loss=True, reset_position_ids=True)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    prefixes = write_corpus(tmp_path_factory.mktemp("resume"), 3, seed=11, num_documents=80)
    return StoreBlendSource.from_prefixes(prefixes, [0.5, 0.3, 0.2], num_samples=640, seq_length=SEQ, seed=3)


def _loaders(source, topology, geometry=None, **kwargs):
    geometry = geometry or BatchGeometry(global_batch_size=GLOBAL, micro_batch_size=MICRO, dp=topology.dp)
    return [RankLoader(source, geometry, topology=topology, rank=r, options=OPTIONS, **kwargs)
            for r in range(topology.world_size)]


def _run_steps(loaders, topology, num_steps):
    """Global batches (dict of (G, ...) arrays, in stream order) assembled from every rank."""
    steps = []
    for _ in range(num_steps):
        num_micro = loaders[0].sampler.num_micro_batches
        per_micro = []
        for _ in range(num_micro):
            outputs = [loader.next_batch() for loader in loaders]
            # in stream order: dp rank 0's samples, then dp rank 1's, ... (tp 0, first stage, cp 0)
            parts = [outputs[topology.rank_of(dp_rank=d)] for d in range(topology.dp)]
            per_micro.append({k: np.concatenate([p[k] for p in parts]) for k in parts[0]})
        steps.append({k: np.concatenate([m[k] for m in per_micro]) for k in per_micro[0]})
    return steps


def _assert_steps_equal(a, b):
    assert len(a) == len(b)
    for step, (x, y) in enumerate(zip(a, b)):
        assert set(x) == set(y)
        for k in x:
            np.testing.assert_array_equal(x[k], y[k], err_msg=f"step {step} field {k}")


def test_resume_at_dp2_and_dp8_equals_uninterrupted_dp1(source):
    reference = _run_steps(_loaders(source, Topology(dp=1)), Topology(dp=1), 20)
    first = _loaders(source, Topology(dp=4))
    _assert_steps_equal(_run_steps(first, Topology(dp=4), 10), reference[:10])
    states = [loader.state_dict() for loader in first]
    assert all(s == states[0] for s in states)
    state = json.loads(json.dumps(states[0]))  # survives JSON
    assert state["consumed_samples"] == 10 * GLOBAL
    for dp in (2, 8):
        resumed = _loaders(source, Topology(dp=dp))
        for loader in resumed:
            loader.load_state_dict(state)
        _assert_steps_equal(_run_steps(resumed, Topology(dp=dp), 10), reference[10:])


def test_resume_on_a_tp_pp_cp_layout_serves_the_same_tokens(source):
    reference = _run_steps(_loaders(source, Topology(dp=1)), Topology(dp=1), 8)
    first = _loaders(source, Topology(dp=4))
    _run_steps(first, Topology(dp=4), 5)
    topology = Topology(dp=2, tp=2, pp=2)
    resumed = _loaders(source, topology)
    for loader in resumed:
        loader.load_state_dict(first[0].state_dict())
    for step in range(5, 8):
        got = {"tokens": [], "labels": []}
        for _ in range(resumed[0].sampler.num_micro_batches):
            outputs = [loader.next_batch() for loader in resumed]
            for d in range(2):
                head = outputs[topology.rank_of(dp_rank=d, pp_rank=0)]
                tail = outputs[topology.rank_of(dp_rank=d, pp_rank=1)]
                assert "labels" not in head and "tokens" not in tail
                assert outputs[topology.rank_of(dp_rank=d, tp_rank=1)] is None  # receives by broadcast
                got["tokens"].append(head["tokens"])
                got["labels"].append(tail["labels"])
        np.testing.assert_array_equal(np.concatenate(got["tokens"]), reference[step]["tokens"])
        np.testing.assert_array_equal(np.concatenate(got["labels"]), reference[step]["labels"])


def test_mid_step_resume_same_layout_and_refusal_on_another(source):
    topology = Topology(dp=2)
    reference = _run_steps(_loaders(source, topology), topology, 4)
    loaders = _loaders(source, topology)
    _run_steps(loaders, topology, 1)
    for _ in range(2):  # two of the four micro-steps of step 1
        for loader in loaders:
            loader.next_batch()
    state = loaders[0].state_dict()
    assert state["micro_batch"] == 2 and state["consumed_samples"] == GLOBAL + 2 * MICRO * 2
    resumed = _loaders(source, topology)
    for loader in resumed:
        loader.load_state_dict(state)
    rest = [[loader.next_batch() for loader in resumed] for _ in range(2)]
    tokens = np.concatenate([np.concatenate([r[0]["tokens"], r[1]["tokens"]]) for r in rest])
    np.testing.assert_array_equal(tokens, reference[1]["tokens"][2 * MICRO * 2:])
    with pytest.raises(ConfigError, match="saved between steps"):
        _loaders(source, Topology(dp=4))[0].load_state_dict(state)


def test_state_of_another_build_is_refused(source, tmp_path):
    prefixes = write_corpus(tmp_path, 3, seed=11, num_documents=80)
    other = StoreBlendSource.from_prefixes(prefixes, [0.5, 0.3, 0.2], num_samples=640, seq_length=SEQ, seed=4)
    state = _loaders(other, Topology(dp=1))[0].state_dict()
    with pytest.raises(ConfigError, match="belongs to build"):
        _loaders(source, Topology(dp=1))[0].load_state_dict(state)
    with pytest.raises(ConfigError, match="schema version"):
        _loaders(source, Topology(dp=1))[0].load_state_dict({**state, "schema_version": 99})
    with pytest.raises(ConfigError, match="not a tokenloom serving state"):
        _loaders(source, Topology(dp=1))[0].load_state_dict({"consumed_samples": 3})


def _served_pairs(loader):
    pairs = []
    while not loader.sampler.exhausted():
        positions = loader.sampler.positions()
        pairs.append(np.stack(loader.stream.locate(positions), axis=1))
        loader.next_batch()
    return np.concatenate(pairs) if pairs else np.zeros((0, 2), np.int64)


def test_weight_change_at_resume_continues_every_dataset(source):
    loader = _loaders(source, Topology(dp=1))[0]
    served = []
    for _ in range(5 * GLOBAL // MICRO):
        served.append(np.stack(loader.stream.locate(loader.sampler.positions()), 1))
        loader.next_batch()
    state = loader.state_dict()
    resumed = _loaders(source, Topology(dp=2))
    new_weights = [0.1, 0.1, 0.8]
    for r in resumed:
        r.load_state_dict(state)
        r.reweight(new_weights)
    assert resumed[0].state_dict() == resumed[1].state_dict()
    after = [_served_pairs(r) for r in resumed]
    pairs = np.concatenate(served + after)
    for d in range(3):
        ids = np.sort(pairs[pairs[:, 0] == d, 1])
        # every dataset's samples are 0, 1, 2, ...: none repeated, none skipped
        np.testing.assert_array_equal(ids, np.arange(ids.shape[0]))
    # the new segment follows the new weights to within two samples per dataset (Blend's prefix bound)
    segment = np.concatenate(after)
    counts = np.bincount(segment[:, 0], minlength=3)
    assert np.all(np.abs(counts - np.array(new_weights) * segment.shape[0]) < 2.0)
    # it stops where dataset 2's index runs out, not by wrapping around
    assert resumed[0].stream.num_samples < source.num_samples
    assert pairs[pairs[:, 0] == 2, 1].max() < source.datasets[2].num_samples


def test_weight_change_survives_a_second_resume(source):
    topology = Topology(dp=2)
    a = _loaders(source, topology)
    for loader in a:
        loader.reweight([0.2, 0.2, 0.6])
    _run_steps(a, topology, 3)
    state = a[0].state_dict()
    assert len(state["blend_segments"]) == 1
    expected = _run_steps(a, topology, 3)
    b = _loaders(source, Topology(dp=4))
    for loader in b:
        loader.load_state_dict(state)
    _assert_steps_equal(_run_steps(b, Topology(dp=4), 3), expected)


def test_batch_size_schedule_resumes_on_another_layout(source):
    schedule = BatchSizeSchedule.parse("0:8 32:16 80:32")
    def geometry(dp):
        return BatchGeometry(global_batch_size=32, micro_batch_size=2, dp=dp, schedule=schedule)

    reference = _run_steps(_loaders(source, Topology(dp=1), geometry(1)), Topology(dp=1), 9)
    assert [s["tokens"].shape[0] for s in reference] == [8, 8, 8, 8, 16, 16, 16, 32, 32]
    first = _loaders(source, Topology(dp=2), geometry(2))
    _run_steps(first, Topology(dp=2), 5)
    resumed = _loaders(source, Topology(dp=4), geometry(4))
    for loader in resumed:
        loader.load_state_dict(first[0].state_dict())
    _assert_steps_equal(_run_steps(resumed, Topology(dp=4), 4), reference[5:])


def test_audit_log_and_fingerprint_check_on_resume(source, tmp_path):
    path = tmp_path / "audit.jsonl"
    loaders = _loaders(source, Topology(dp=2))
    loaders[0].audit = MixtureAudit(path)
    _run_steps(loaders, Topology(dp=2), 6)
    log = read_audit_log(path)
    assert [r["step"] for r in log.records] == list(range(6))
    assert log.header["datasets"] == [d.name for d in source.datasets]
    assert all(sum(r["tokens"]) == GLOBAL * SEQ for r in log.records)
    rows = summarize_audit(log)
    assert sum(row["tokens"] for row in rows) == 6 * GLOBAL * SEQ
    assert all(abs(row["drift"]) < 0.05 for row in rows)

    # resume at step 3 on another layout: the logged fingerprint of step 3 matches
    state = {**loaders[0].state_dict(), "consumed_samples": 3 * GLOBAL, "step": 3, "step_start_samples": 3 * GLOBAL}
    resumed = RankLoader(source, BatchGeometry(global_batch_size=GLOBAL, micro_batch_size=MICRO, dp=4),
                         topology=Topology(dp=4), rank=0, audit=MixtureAudit(path))
    resumed.load_state_dict(state)
    assert [r["step"] for r in read_audit_log(path).records] == [0, 1, 2]  # later lines replaced on resume

    # the run goes on from step 3 and logs it again; then a state one sample off is caught
    loaders = _loaders(source, Topology(dp=2))
    loaders[0].audit = MixtureAudit(path)
    loaders[0].load_state_dict(state)
    _run_steps(loaders, Topology(dp=2), 3)
    bad = {**state, "consumed_samples": 3 * GLOBAL + 1, "step_start_samples": 3 * GLOBAL + 1}
    checker = RankLoader(source, BatchGeometry(global_batch_size=GLOBAL, micro_batch_size=MICRO, dp=1),
                         rank=0, audit=MixtureAudit(path))
    with pytest.raises(ConfigError, match="step 3 was logged with fingerprint"):
        checker.load_state_dict(bad)


def test_audit_drift_follows_the_weights_in_force_after_a_change(source, tmp_path):
    path = tmp_path / "audit.jsonl"
    loader = _loaders(source, Topology(dp=1))[0]
    loader.audit = MixtureAudit(path)
    for _ in range(4 * GLOBAL // MICRO):
        loader.next_batch()
    loader.reweight([0.1, 0.1, 0.8])
    for _ in range(6 * GLOBAL // MICRO):
        loader.next_batch()
    records = read_audit_log(path).records
    assert records[-1]["target_weights"] == [0.1, 0.1, 0.8] and records[0]["target_weights"] != [0.1, 0.1, 0.8]
    for record in records:
        total_samples = (record["step"] + 1) * GLOBAL
        # the realised mixture stays within a few samples of what the weights in force asked for
        assert max(abs(d) for d in record["drift"]) * total_samples <= 4.0, record


def test_eod_options_need_an_eod_id(tmp_path):
    from serve_fixtures import write_store

    rng = np.random.default_rng(0)
    docs = [np.append(rng.integers(0, 90, 20), 99) for _ in range(30)]
    prefix = write_store(str(tmp_path / "bare"), docs, vocab_size=100, eod_id=None)  # no EOD in its record
    bare = StoreBlendSource.from_prefixes([prefix], num_samples=20, seq_length=8, seed=1)
    with pytest.raises(ConfigError, match="have no EOD id"):
        RankLoader(bare, BatchGeometry(global_batch_size=4, micro_batch_size=4, dp=1), options=OPTIONS)
    told = StoreBlendSource.from_prefixes([prefix], num_samples=20, seq_length=8, seed=1, eod_id=99)
    batch = RankLoader(told, BatchGeometry(global_batch_size=4, micro_batch_size=4, dp=1), options=OPTIONS).next_batch()
    np.testing.assert_array_equal(batch["loss_mask"][batch["tokens"] == 99], 0.0)
    assert (batch["tokens"] == 99).any()
