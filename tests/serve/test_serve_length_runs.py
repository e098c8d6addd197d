"""Serving a schedule that changes the sequence length (issue 40, FORMAT.md "Length runs"): every
step's rows have its phase's width on every rank and adapter, a run resumed inside the long
phase or at the start of the next, on another DP x TP x PP x CP layout, serves byte for byte the
global batches of a run that never stopped, packed (THD) boundaries follow each step's width, and
a batch that would mix two widths is refused naming both."""

from __future__ import annotations

import json

import numpy as np
import pytest

import tokenloom
from serve_fixtures import write_corpus
from tokenloom.errors import ConfigError
from tokenloom.serve import BatchGeometry, LoadMode, RankLoader, SampleOptions, Topology
from tokenloom.serve.jax_adapter import HostLoader, ShardOptions
from tokenloom.serve.topology import context_parallel_positions

SEQ, LONG, G = 16, 32, 24
OPTIONS = SampleOptions(eod_mask_loss=True, reset_position_ids=True)


@pytest.fixture(scope="module", params=["stateless", "exact"])
def split(tmp_path_factory, request):
    root = tmp_path_factory.mktemp(f"serve-length-runs-{request.param}")
    store0, store1, store2 = write_corpus(root, 3, seed=31, num_documents=60)
    phases = [  # store0 changes length twice; store2 only in the long phase
        {"blend": ["1", store0, "1", store1], "until": {"steps": 4}},
        {"blend": ["1", store0, "1", store2], "until": {"steps": 8}, "seq_length": LONG},
        {"blend": ["1", store0, "1", store1], "until": {"steps": 12}},
    ]
    config = {"phases": phases, "split": "100,0,0", "seq_length": SEQ, "global_batch_size": G, "valid_samples": 0,
              "test_samples": 0, "seed": 7, "mode": request.param, "cache_dir": str(root / "cache"),
              "rng_workers": 0, "timeout_s": 60.0}
    return tokenloom.build(config).split("train")


def _serve(split, topology: Topology, micro: int, *, state=None, save_at=()) -> tuple[list[dict], dict]:
    """Every step's global batch: dataset and sample ids, tokens (first stage, context-parallel
    chunks put back together) and labels (last stage); tensor peers must load what rank 0 loads."""
    geometry = BatchGeometry(global_batch_size=G, micro_batch_size=micro, dp=topology.dp)
    loaders = [RankLoader(split, geometry, topology=topology, rank=r, options=OPTIONS, mode=LoadMode.EVERY_RANK)
               for r in range(topology.world_size)]
    if state is not None:
        for loader in loaders:
            loader.load_state_dict(state)
    steps, states = [], {}
    while not loaders[0].sampler.exhausted():
        step = loaders[0].sampler.step
        if step in save_at:
            states[step] = json.loads(json.dumps(loaders[0].state_dict()))
        parts: dict[str, list] = {"dataset_id": [], "sample_id": [], "tokens": [], "labels": []}
        for _ in range(loaders[0].sampler.num_micro_batches):
            located = [loaders[topology.rank_of(dp_rank=d)].stream.locate(
                loaders[topology.rank_of(dp_rank=d)].sampler.positions()) for d in range(topology.dp)]
            outputs = [loader.next_batch() for loader in loaders]
            for d, (dataset_ids, sample_ids) in enumerate(located):
                def at(pp, cp, tp=0, d=d, outputs=outputs):
                    return outputs[topology.rank_of(dp_rank=d, tp_rank=tp, pp_rank=pp, cp_rank=cp)]
                for tp in range(1, topology.tp):
                    for k, value in at(0, 0, tp).items():
                        np.testing.assert_array_equal(value, at(0, 0)[k])
                parts["dataset_id"].append(dataset_ids)
                parts["sample_id"].append(sample_ids)
                for field, pp in (("tokens", 0), ("labels", topology.pp - 1)):
                    chunks = [at(pp, c)[field] for c in range(topology.cp)]
                    width = chunks[0].shape[1] * topology.cp
                    whole = np.empty((chunks[0].shape[0], width), dtype=chunks[0].dtype)
                    for c, chunk in enumerate(chunks):
                        whole[:, context_parallel_positions(width, topology.cp, c)] = chunk
                    parts[field].append(whole)
        steps.append({k: np.concatenate(v) for k, v in parts.items()})
    return steps, states


def test_each_step_has_its_phases_width_and_a_resume_on_another_layout_serves_the_same(split):
    plan = split.schedule.plan
    reference, states = _serve(split, Topology(dp=2), 3, save_at=(6, 8))
    assert len(reference) == 12
    widths = [step["tokens"].shape[1] for step in reference]
    assert widths == [SEQ] * 4 + [LONG] * 4 + [SEQ] * 4
    with pytest.raises(ConfigError, match=r"shard=\(0, 2\); expected ShardOptions"):
        HostLoader(split, global_batch_size=G, shard=(0, 2))
    datasets = np.concatenate([s["dataset_id"] for s in reference])
    np.testing.assert_array_equal(datasets, split.locate(np.arange(plan.num_samples))[0])
    for step in reference:  # the rows are the samples' tokens, read at their run's width
        rows = split.read_samples(step["dataset_id"], step["sample_id"])
        np.testing.assert_array_equal(step["tokens"], rows[:, :-1])
        np.testing.assert_array_equal(step["labels"], rows[:, 1:])
    for (layout, micro), step in zip([(Topology(dp=3, tp=2, cp=2), 2), (Topology(dp=4, pp=2, cp=2), 3)], (6, 8)):
        resumed, _ = _serve(split, layout, micro, state=states[step])
        assert len(resumed) == 12 - step
        for got, expected in zip(resumed, reference[step:]):
            for field in expected:
                np.testing.assert_array_equal(got[field], expected[field], err_msg=f"{layout} from step {step}")


def test_packed_boundaries_follow_each_steps_width(split):
    loader = RankLoader(split, BatchGeometry(global_batch_size=G, micro_batch_size=4, dp=1),
                        options=SampleOptions(inter_document_masking=True, boundary_format="thd"))
    ends = []
    for _ in range(loader.sampler.num_micro_batches * 12):
        batch = loader.next_batch()
        assert batch["tokens"].shape[1] == batch["cu_seqlens"][-1] // 4  # (4, S): the packed sequence ends at 4 S
        ends.append(int(batch["cu_seqlens"][-1]))
    per_step = loader.sampler.num_micro_batches
    assert set(ends[:4 * per_step]) == {4 * SEQ} and set(ends[4 * per_step:8 * per_step]) == {4 * LONG}


def test_a_batch_of_two_widths_is_refused_naming_both(split):
    boundary = split.schedule.plan.boundaries[1]
    datasets, samples = split.locate(np.arange(boundary - 2, boundary + 2))
    with pytest.raises(ConfigError, match=f"sequence lengths {SEQ} .* and {LONG} .*one phase's sequence length"):
        split.read_samples(datasets, samples)


def test_jax_hosts_get_each_steps_width(split):
    hosts = [HostLoader(split, global_batch_size=G, shard=ShardOptions(shard_index=i, shard_count=2)) for i in range(2)]
    widths = []
    for _ in range(12):
        batches = [next(host) for host in hosts]
        assert {b["tokens"].shape for b in batches} == {(G // 2, batches[0]["tokens"].shape[1])}
        widths.append(batches[0]["tokens"].shape[1])
    assert widths == [SEQ] * 4 + [LONG] * 4 + [SEQ] * 4
    with pytest.raises(ConfigError, match=r"shard=\(0, 2\); expected ShardOptions"):
        HostLoader(split, global_batch_size=G, shard=(0, 2))


def test_a_quarantine_keeps_every_step_at_one_width_and_resumes_alike(split):
    """A quarantine removes single samples, so the change of length would fall inside a step: the
    old phase's samples of that step are dropped (skipped, fewer than one step), and a resume
    from a state saved after it serves the same."""
    loader = RankLoader(split, BatchGeometry(global_batch_size=G, micro_batch_size=4, dp=1))
    for _ in range(2 * loader.sampler.num_micro_batches):  # steps 0 and 1
        loader.next_batch()
    origin = split.where([G * 2 + 5])[0]  # a sample of step 2
    loader.quarantine([(origin.prefix, origin.pieces[0].document)])
    dropped = loader.stream.quarantined.shape[0]
    assert dropped % G > 0  # without the realignment the change of length would fall inside a step
    state = json.loads(json.dumps(loader.state_dict()))

    def rest(loader) -> tuple[list[set], np.ndarray]:
        widths, served = [], []
        while not loader.sampler.exhausted():
            if loader.sampler.micro_batch == 0:
                widths.append(set())
            datasets, samples = loader.stream.locate(loader.sampler.positions())
            widths[-1].update(split.seq_lengths[datasets].tolist())
            served.append(np.stack([datasets, samples]))
            loader.next_batch()
        return widths, np.concatenate(served, axis=1)

    widths, served = rest(loader)
    assert all(len(w) == 1 for w in widths) and set().union(*widths) == {SEQ, LONG}
    skips = loader.stream.skips  # the old phase's samples of the straddling step (around a quarantined one)
    begin, end = skips[0][0], skips[-1][1]
    assert end == split.schedule.plan.boundaries[1] and 0 < end - begin < G
    gone = {p for a, b in skips for p in range(a, b)} | set(loader.stream.quarantined.tolist())
    assert set(range(begin, end)) <= gone
    again = RankLoader(split, BatchGeometry(global_batch_size=G, micro_batch_size=8, dp=1))
    again.load_state_dict(state)
    np.testing.assert_array_equal(rest(again)[1], served)


def test_weight_changes_are_refused_with_the_reason(split):
    from tokenloom.serve import ExponentiatedGradient, OnlineMixing

    loader = RankLoader(split, BatchGeometry(global_batch_size=G, micro_batch_size=4, dp=1))
    with pytest.raises(ConfigError, match="a weight change at run time on this build: its schedule has phases at"):
        loader.reweight([0.2] * len(split.readers))
    with pytest.raises(ConfigError, match="online mixing on this build"):
        RankLoader(split, BatchGeometry(global_batch_size=G, micro_batch_size=4, dp=1),
                   mixing=OnlineMixing(ExponentiatedGradient(len(split.readers)), every=2, lag=1))
