"""Serving a mixture schedule (issue 40, step 6).

A build of three phases (the first ends where its ``until`` moves up to a step's end, the second
ramps, one store leaves after it and another enters in the third), in both modes and under a
batch-size ramp: a run resumed at a step inside any phase, on another DP x TP x PP x CP layout,
serves byte for byte the global batches of a run that never stopped; the batch geometry must step
as the build planned its phases (ConfigError naming both, from every loader and adapter); the
grain, JAX and torchtitan adapters serve the plain sampler's samples across a phase boundary and
resume across it.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import tokenloom
from serve_fixtures import write_corpus
from tokenloom.builder.config import build_config_from_dict
from tokenloom.errors import ConfigError
from tokenloom.index.schedule_exact import exact_phase_blends
from tokenloom.serve import BatchGeometry, BatchSizeSchedule, LoadMode, RankLoader, SampleOptions, Topology
from tokenloom.serve.jax_adapter import HostLoader, ShardOptions
from tokenloom.serve.sampler import MicroBatchSampler
from tokenloom.serve.topology import context_parallel_positions

SEQ, G = 16, 24
RAMP = [8, 8, 96]
"""rampup_batch_size: 6 steps of 8 samples, 3 of 16, then steps of G."""
RAMP_STEPS = ((0, 8), (48, 16), (96, 24))
OPTIONS = SampleOptions(eod_mask_loss=True, reset_position_ids=True)

#: Where the uninterrupted run is served (topology, micro-batch), and the layouts resumed on, one
#: per saved state, each with another DP and a TP, PP or CP axis (micro x dp divides every batch).
LAYOUTS = {
    False: ((Topology(dp=2), 3), [(Topology(dp=3, tp=2), 2), (Topology(dp=4, pp=2, cp=2), 3),
                                  (Topology(dp=1, tp=2, cp=2), 8), (Topology(dp=6), 1), (Topology(dp=2, pp=2), 4)]),
    True: ((Topology(dp=2), 2), [(Topology(dp=4, tp=2), 2), (Topology(dp=1, pp=2, cp=2), 8), (Topology(dp=8), 1),
                                 (Topology(dp=2, tp=2, cp=2), 1), (Topology(dp=4, pp=2), 1)]),
}


def _config(prefixes, cache_dir, mode: str, ramp: bool) -> dict:
    store0, store1, store2, store3 = prefixes
    phases = [  # store3 leaves after phase 2; store2 enters in phase 3
        {"blend": ["0.5", store0, "0.3", store1, "0.2", store3], "until": {"samples": 230}},
        {"blend": ["1", store0, "1", store1, "2", store3], "until": {"samples": 480}, "ramp": "linear"},
        {"blend": ["1", store0, "1", store1, "2", store2], "until": {"steps": 30}},
    ]
    config = {"phases": phases, "split": "100,0,0", "seq_length": SEQ, "global_batch_size": G, "valid_samples": 0,
              "test_samples": 0, "seed": 7, "mode": mode, "cache_dir": str(cache_dir), "rng_workers": 0,
              "timeout_s": 60.0}
    if ramp:
        config["rampup_batch_size"] = list(RAMP)
    return config


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """``builds(mode, ramp)`` -> (config, train split), each built once for the module."""
    root = tmp_path_factory.mktemp("serve-schedule")
    prefixes = write_corpus(root, 4, seed=23, num_documents=60)
    made: dict[tuple[str, bool], tuple[dict, object]] = {}

    def build(mode: str, ramp: bool = False):
        if (mode, ramp) not in made:
            config = _config(prefixes, root / f"cache-{mode}-{int(ramp)}", mode, ramp)
            made[mode, ramp] = (config, tokenloom.build(config).split("train"))
        return made[mode, ramp]

    return build


def _geometry(dp: int, micro: int, ramp: bool) -> BatchGeometry:
    schedule = BatchSizeSchedule.rampup(start=RAMP[0], increment=RAMP[1], ramp_samples=RAMP[2],
                                        global_batch_size=G) if ramp else None
    return BatchGeometry(global_batch_size=G, micro_batch_size=micro, dp=dp, schedule=schedule)


def _loaders(split, topology: Topology, micro: int, ramp: bool) -> list[RankLoader]:
    geometry = _geometry(topology.dp, micro, ramp)
    return [RankLoader(split, geometry, topology=topology, rank=r, options=OPTIONS, mode=LoadMode.EVERY_RANK)
            for r in range(topology.world_size)]


def _whole(chunks: list[dict], field: str, cp: int) -> np.ndarray:
    """``(B, SEQ)``: a field's context-parallel chunks put back in sequence order."""
    out = np.empty((chunks[0][field].shape[0], SEQ), dtype=chunks[0][field].dtype)
    for c, chunk in enumerate(chunks):
        out[:, context_parallel_positions(SEQ, cp, c)] = chunk[field]
    return out


def _output_of(outputs: list, topology: Topology, dp: int, pp: int, cp: int = 0, tp: int = 0):
    return outputs[topology.rank_of(dp_rank=dp, tp_rank=tp, pp_rank=pp, cp_rank=cp)]


def _serve(loaders: list[RankLoader], topology: Topology, *, save_at=()) -> tuple[list[dict], dict[int, dict]]:
    """Every step's global batch, from every rank, to the stream's end: dataset and sample ids (each
    data-parallel rank's), tokens (its first stage's context-parallel chunks put together), labels
    and loss mask (its last stage's); tensor-parallel peers must load what tensor rank 0 loads.
    Also the state saved before each step of ``save_at`` (the same on every rank, through JSON)."""
    steps, states = [], {}
    first, last = 0, topology.pp - 1
    while not loaders[0].sampler.exhausted():
        if len(steps) in save_at:
            saved = [loader.state_dict() for loader in loaders]
            assert all(s == saved[0] for s in saved)
            states[len(steps)] = json.loads(json.dumps(saved[0]))
        parts: dict[str, list] = {"dataset_id": [], "sample_id": [], "tokens": [], "labels": [], "loss_mask": []}
        for _ in range(loaders[0].sampler.num_micro_batches):
            located = []
            for d in range(topology.dp):
                head = loaders[topology.rank_of(dp_rank=d)]
                located.append(head.stream.locate(head.sampler.positions()))
            outputs = [loader.next_batch() for loader in loaders]
            for d, (dataset_ids, sample_ids) in enumerate(located):
                at = functools.partial(_output_of, outputs, topology, d)
                for tp in range(1, topology.tp):
                    for pp in {first, last}:
                        for cp in range(topology.cp):
                            for k, value in at(pp, cp, tp).items():
                                np.testing.assert_array_equal(value, at(pp, cp)[k])
                heads = [at(first, c) for c in range(topology.cp)]
                tails = [at(last, c) for c in range(topology.cp)]
                np.testing.assert_array_equal(heads[0]["dataset_id"], dataset_ids)
                parts["dataset_id"].append(dataset_ids)
                parts["sample_id"].append(sample_ids)
                parts["tokens"].append(_whole(heads, "tokens", topology.cp))
                parts["labels"].append(_whole(tails, "labels", topology.cp))
                parts["loss_mask"].append(_whole(tails, "loss_mask", topology.cp))
        steps.append({k: np.concatenate(v) for k, v in parts.items()})
    return steps, states


def _assert_same_batches(got: list[dict], expected: list[dict], what: str) -> None:
    assert len(got) == len(expected), what
    for step, (a, b) in enumerate(zip(got, expected)):
        for k in b:
            assert a[k].dtype == b[k].dtype, f"{what}: step {step} field {k}"
            np.testing.assert_array_equal(a[k], b[k], err_msg=f"{what}: step {step} field {k}")


def _check_the_run_follows_the_schedule(config: dict, split, steps: list[dict], mode: str) -> None:
    """The uninterrupted run against the build's own plan, not against serving: it serves the
    split's positions in order, each global batch inside one phase, per phase and store the
    rule's exact counts, every store's samples once each (the one leaving and the one entering
    too)."""
    plan = split.schedule.plan
    datasets = np.concatenate([s["dataset_id"] for s in steps]).astype(np.int64)
    samples = np.concatenate([s["sample_id"] for s in steps])
    assert datasets.shape[0] == plan.num_samples  # the last phase ends at a step's end here
    located = split.locate(np.arange(plan.num_samples, dtype=np.int64))
    np.testing.assert_array_equal(datasets, located[0])
    np.testing.assert_array_equal(samples, located[1])
    step_starts = np.cumsum([0] + [s["tokens"].shape[0] for s in steps])
    assert set(plan.boundaries) <= set(step_starts.tolist())  # no global batch straddles a phase boundary
    union = list(build_config_from_dict(config).schedule_stores.prefixes)
    served = [union.index(d.name) for d in split.datasets]
    counts = plan.counts if mode == "stateless" else exact_phase_blends(plan, backend="python").counts
    for k in range(plan.num_phases):
        window = datasets[plan.boundaries[k]:plan.boundaries[k + 1]]
        assert np.bincount(window, minlength=len(served)).tolist() == counts[k, served].tolist(), f"phase {k + 1}"
    names = [os.path.basename(d.name) for d in split.datasets]
    leaving, entering = names.index("store3"), names.index("store2")
    assert (datasets[plan.boundaries[2]:] != leaving).all() and (datasets[:plan.boundaries[2]] == leaving).any()
    assert (datasets[:plan.boundaries[2]] != entering).all() and (datasets[plan.boundaries[2]:] == entering).any()
    for d in range(len(served)):
        mine = samples[datasets == d]
        expected = np.arange(mine.shape[0])
        np.testing.assert_array_equal(mine if mode == "stateless" else np.sort(mine), expected, err_msg=names[d])


@pytest.mark.parametrize("ramp", [False, True], ids=["constant", "rampup"])
@pytest.mark.parametrize("mode", ["stateless", "exact"])
def test_a_resume_inside_every_phase_on_another_layout_serves_the_uninterrupted_batches(builds, mode, ramp):
    config, split = builds(mode, ramp)
    plan = split.schedule.plan
    assert plan.batch_steps == (RAMP_STEPS if ramp else ((0, G),)) and plan.ramps[1] is not None
    asked = build_config_from_dict(config).schedule_plan().requested[0]
    assert asked == 230 < plan.boundaries[1] == 240  # phase 1 moved up to its step's end
    bounds = plan.boundary_steps  # constant (0, 10, 20, 30); rampup (0, 15, 25, 30)
    # a step inside each phase, and each later phase's first step
    saves = sorted({(a + b) // 2 for a, b in itertools.pairwise(bounds)} | set(bounds[1:-1]))
    (topology, micro), resumed_on = LAYOUTS[ramp]
    reference, states = _serve(_loaders(split, topology, micro, ramp), topology, save_at=saves)
    assert len(reference) == bounds[-1] and sorted(states) == saves
    _check_the_run_follows_the_schedule(config, split, reference, mode)
    phases_saved_in = set()
    for (layout, layout_micro), step in zip(resumed_on, saves):
        state = states[step]
        assert state["step"] == step
        phases_saved_in.add(int(plan.phase_of(state["consumed_samples"])))
        loaders = _loaders(split, layout, layout_micro, ramp)
        for loader in loaders:
            loader.load_state_dict(state)
        got, _ = _serve(loaders, layout)
        _assert_same_batches(got, reference[step:], f"resumed at step {step} on {layout}, micro {layout_micro}")
    assert phases_saved_in == set(range(plan.num_phases))


def _phases_of_steps(sampler: MicroBatchSampler) -> list[set[int]]:
    """The phases (0-based, of the build's plan) each remaining global batch of ``sampler`` reads."""
    plan, probe, out = sampler.source.schedule.plan, sampler.copy(), []
    while not probe.exhausted():
        out.append(set(plan.phase_of(probe.stream.underlying(probe.global_batch_positions())).tolist()))
        probe.next_step()
    return out


@pytest.mark.parametrize("mode", ["stateless", "exact"])
def test_steps_skipped_across_a_phase_boundary_continue_in_the_next_phase_and_resume_elsewhere(builds, mode):
    _, split = builds(mode)
    topology, micro = Topology(dp=2), 3
    reference, _ = _serve(_loaders(split, topology, micro, False), topology)
    loaders = _loaders(split, topology, micro, False)
    for loader in loaders:
        loader.skip_steps(8, 12)  # phase 1's last two steps and phase 2's first two
    assert all(len(p) == 1 for p in _phases_of_steps(loaders[0].sampler))
    state = json.loads(json.dumps(loaders[0].state_dict()))
    served, _ = _serve(loaders, topology)
    _assert_same_batches(served, reference[:8] + reference[12:], "skipped [8, 12)")
    elsewhere = _loaders(split, Topology(dp=4, cp=2), 2, False)
    for loader in elsewhere:
        loader.load_state_dict(state)
    _assert_same_batches(_serve(elsewhere, Topology(dp=4, cp=2))[0], served, "the skip resumed on dp 4 x cp 2")


def test_a_quarantine_serves_each_phase_in_order_and_at_most_one_step_holds_each_boundary(builds):
    """Quarantined samples come out one by one, not a whole step at a time, so the steps after
    them leave the build's step grid: the step holding a phase boundary serves the end of one
    phase, then the start of the next (FORMAT.md, "Skips and quarantines"). Every other sample is
    still served once, in the build's order."""
    _, split = builds("stateless")
    sampler = MicroBatchSampler(split, _geometry(2, 3, False))
    sampler.next_step()
    origin = split.where([100])[0]  # a document of phase 1, served again in later phases
    sampler.quarantine([(origin.prefix, origin.pieces[0].document)])
    out = sampler.stream.quarantined
    assert out.size > 1
    straddling = [phases for phases in _phases_of_steps(sampler) if len(phases) > 1]
    assert len(straddling) <= len(split.schedule.plan.boundaries) - 2
    assert all(len(phases) == 2 and max(phases) - min(phases) == 1 for phases in straddling)
    probe, served = sampler.copy(), []
    while not probe.exhausted():
        served.append(probe.stream.underlying(probe.global_batch_positions()))
        probe.next_step()
    served = np.concatenate(served)
    kept = np.setdiff1d(np.arange(sampler.step_start, split.schedule.plan.num_samples), out)
    assert np.array_equal(served, kept[: served.shape[0]]) and kept.shape[0] - served.shape[0] < G


def test_steps_skipped_inside_a_batch_size_ramp_keep_every_global_batch_inside_one_phase(builds):
    """On a schedule the ramp is read at the stream's underlying position, skipped steps counted
    as consumed (as Megatron-LM counts a skipped iteration's samples), so later steps stay on the
    build's grid and no step holds a phase boundary."""
    _, split = builds("stateless", True)
    sampler = MicroBatchSampler(split, _geometry(2, 2, True))
    sampler.skip_steps(2, 4)
    assert [k for k, phases in enumerate(_phases_of_steps(sampler)) if len(phases) > 1] == []


# -- the geometry check --------------------------------------------------------------------------


def test_a_geometry_that_steps_otherwise_than_the_build_is_refused_naming_both(builds):
    _, split = builds("stateless")
    _, ramped = builds("stateless", True)
    with pytest.raises(ConfigError, match=r"on optimizer steps of global_batch_size 24 and no batch-size ramp .*"
                                          r"phase boundaries at samples 240 \(step 10\), 480 \(step 20\)\), but this "
                                          r"BatchGeometry has global_batch_size=12 and no schedule: step 0, from "
                                          r"sample 0, takes 24 samples in the build and 12 here.*Serve with the "
                                          r"build's batch sizes, BatchGeometry\(global_batch_size=24, \.\.\.\)"):
        RankLoader(split, BatchGeometry(global_batch_size=12, micro_batch_size=2, dp=2))
    steps = r"\(\(0, 8\), \(48, 16\), \(96, 24\)\)"
    with pytest.raises(ConfigError, match=rf"global_batch_size 24 after a batch-size ramp of \(threshold_samples, "
                                          rf"size\) steps {steps} .* but this BatchGeometry has global_batch_size=24 "
                                          rf"and no schedule: step 0, from sample 0, takes 8 samples in the build and "
                                          rf"24 here.*BatchGeometry\(global_batch_size=24, schedule=BatchSizeSchedule"
                                          rf"\(steps={steps}\), \.\.\.\)"):
        MicroBatchSampler(ramped, BatchGeometry(global_batch_size=24, micro_batch_size=2, dp=2))
    with pytest.raises(ConfigError, match=r"a schedule of steps \(\(0, 8\), \(40, 16\), \(96, 24\)\): step 5, from "
                                          r"sample 40, takes 8 samples in the build and 16 here"):
        MicroBatchSampler(ramped, BatchGeometry(global_batch_size=24, micro_batch_size=2, dp=2,
                                                schedule=BatchSizeSchedule.parse("0:8 40:16 96:24")))
    with pytest.raises(ConfigError, match=r"has global_batch_size=24 and a schedule of steps \(\(0, 8\), \(48, 24\)\): "
                                          r"step 0, from sample 0, takes 24 samples in the build and 8 here"):
        MicroBatchSampler(split, BatchGeometry(global_batch_size=24, micro_batch_size=2, dp=2,
                                               schedule=BatchSizeSchedule.parse("0:8 48:24")))
    # the JAX and grain loaders take only a global batch size: a ramped build is refused there too
    with pytest.raises(ConfigError, match="after a batch-size ramp"):
        HostLoader(ramped, global_batch_size=G, shard=ShardOptions(shard_index=0, shard_count=2))


def test_a_geometry_that_steps_alike_is_served(builds):
    _, split = builds("stateless")
    _, ramped = builds("stateless", True)
    # other thresholds, each inside the same step (43 in the step from 40, 90 in the one from 80)
    alike = BatchSizeSchedule.parse("0:8 43:16 90:24")
    assert alike.steps != RAMP_STEPS
    MicroBatchSampler(ramped, BatchGeometry(global_batch_size=G, micro_batch_size=4, dp=2, schedule=alike))
    # a change where the run has ended moves no phase
    later = BatchSizeSchedule.parse(f"0:{G} {split.num_samples}:{2 * G}")
    sampler = MicroBatchSampler(split, BatchGeometry(global_batch_size=2 * G, micro_batch_size=4, dp=2, schedule=later))
    assert len(sampler) == 30 * (G // 8)  # every step of the build, 3 micro-batches each


# -- the adapters --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain(builds):
    """mode -> (split, the plain sampler's uninterrupted global batches, its state before step 8):
    step 8 is in phase 1, two steps before phase 2 begins."""
    out = {}

    def get(mode: str):
        if mode not in out:
            _, split = builds(mode)
            (topology, micro), _ = LAYOUTS[False]
            steps, states = _serve(_loaders(split, topology, micro, False), topology, save_at=(8,))
            assert split.schedule.plan.boundary_steps[1] == 10
            out[mode] = (split, steps, states[8])
        return out[mode]

    return get


def _host_steps(batches: list[list[dict]]) -> list[dict]:
    """Every host's rows of each step, glued in host order (the global batch)."""
    return [{k: np.concatenate([b[step][k] for b in batches]) for k in batches[0][step]}
            for step in range(len(batches[0]))]


def _assert_host_batches(got: list[dict], expected: list[dict], what: str) -> None:
    assert len(got) == len(expected), what
    for step, (a, b) in enumerate(zip(got, expected)):
        for k in ("dataset_id", "tokens", "labels", "loss_mask"):
            np.testing.assert_array_equal(a[k], b[k], err_msg=f"{what}: step {step} field {k}")


@pytest.mark.parametrize("mode", ["stateless", "exact"])
def test_the_jax_host_loader_serves_the_sampler_across_phases_and_resumes_across_a_boundary(plain, mode):
    split, reference, state = plain(mode)
    halves = [list(HostLoader(split, global_batch_size=G, shard=ShardOptions(shard_index=p, shard_count=2),
                              options=OPTIONS, max_steps=12)) for p in range(2)]
    _assert_host_batches(_host_steps(halves), reference[:12], "two hosts")
    thirds = []
    for p in range(3):  # saved in phase 1 by the sampler at dp 2, resumed on 3 hosts into phase 2
        loader = HostLoader(split, global_batch_size=G, shard=ShardOptions(shard_index=p, shard_count=3),
                            options=OPTIONS, max_steps=22)
        loader.load_state_dict(state)
        thirds.append(list(loader))
    _assert_host_batches(_host_steps(thirds), reference[8:22], "resumed on three hosts")


_JAX_WORKER = """
import json, sys
import jax, numpy as np
import tokenloom
from tokenloom.serve import SampleOptions
from tokenloom.serve.jax_adapter import HostLoader, ShardOptions, make_global_batch

job = json.load(open(sys.argv[1]))
split = tokenloom.build(job["config"]).split("train")
mesh = jax.make_mesh((jax.device_count(),), ("data",))
loader = HostLoader(split, global_batch_size=job["global_batch_size"], shard=ShardOptions.from_jax(),
                    options=SampleOptions(**job["options"]), max_steps=job["max_steps"])
loader.load_state_dict(job["state"])
shards = []
for step, host_batch in enumerate(loader):
    for field, array in make_global_batch(host_batch, mesh).items():
        if field in ("tokens", "dataset_id"):
            for shard in array.addressable_shards:
                rows = shard.index[0]
                shards.append([step, field, rows.start, rows.stop, np.asarray(shard.data).tolist()])
json.dump({"devices": jax.device_count(), "shards": shards, "state": loader.state_dict()}, open(sys.argv[2], "w"))
"""


def test_jax_global_arrays_on_four_cpu_devices_resume_across_a_phase_boundary(builds, plain, tmp_path):
    pytest.importorskip("jax")
    config, _ = builds("stateless")
    _, reference, state = plain("stateless")
    job = {"config": config, "global_batch_size": G, "max_steps": 13, "state": state,
           "options": {"eod_mask_loss": True, "reset_position_ids": True}}
    (tmp_path / "job.json").write_text(json.dumps(job))
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), *sys.path])}
    done = subprocess.run([sys.executable, "-c", _JAX_WORKER, str(tmp_path / "job.json"), str(tmp_path / "out.json")],
                          env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["devices"] == 4 and out["state"]["step"] == 13
    seen = np.zeros((5, G), dtype=int)  # steps 8..12: phase 1's last two, phase 2's first three
    for step, field, start, stop, rows in out["shards"]:
        assert stop - start == G // 4
        np.testing.assert_array_equal(np.asarray(rows), reference[8 + step][field][start:stop])
        if field == "tokens":
            seen[step, start:stop] += 1
    assert (seen == 1).all()


@pytest.fixture(scope="module")
def grain_adapter():
    pytest.importorskip("grain")
    from absl import flags

    if not flags.FLAGS.is_parsed():  # grain reads absl flags a program's main would parse
        flags.FLAGS.mark_as_parsed()
    from tokenloom.serve import grain_adapter

    return grain_adapter


@pytest.mark.parametrize("mode", ["stateless", "exact"])
def test_grain_serves_the_sampler_across_phases_and_restores_across_a_boundary(builds, plain, grain_adapter, mode):
    split, reference, _ = plain(mode)
    GrainSource, GrainStream = grain_adapter.GrainSource, grain_adapter.GrainStream
    hosts = [iter(GrainStream(split, global_batch_size=G, shard=ShardOptions(shard_index=p, shard_count=4),
                              options=OPTIONS)) for p in range(4)]
    served = [[next(it) for _ in range(9)] for it in hosts]  # steps 0..8, the state saved in phase 1
    _assert_host_batches(_host_steps(served), reference[:9], "four hosts")
    states = [it.get_state() for it in hosts]
    assert all(s == states[0] for s in states)
    state = json.loads(json.dumps(states[0]))
    restored = []
    for p in range(2):  # on two hosts, through phase 2 into phase 3
        it = iter(GrainStream(split, global_batch_size=G, shard=ShardOptions(shard_index=p, shard_count=2),
                              options=OPTIONS, max_steps=23))
        it.set_state(state)
        restored.append(list(it))
    _assert_host_batches(_host_steps(restored), reference[9:23], "restored on two hosts")
    # grain's random access: the sample at each position around both boundaries
    source = GrainSource(split, options=OPTIONS)
    positions = np.array([0, 239, 240, 241, 479, 480, 719])
    records = source._getitems(positions.tolist())
    for position, record in zip(positions.tolist(), records):
        step, row = divmod(position, G)
        for k in ("dataset_id", "tokens", "labels"):
            np.testing.assert_array_equal(record[k], reference[step][k][row], err_msg=f"position {position} {k}")
    # a stream of one global batch size cannot serve a build with a batch-size ramp: refused when made
    with pytest.raises(ConfigError, match=r"after a batch-size ramp .* has global_batch_size=24 and no schedule"):
        GrainStream(builds(mode, True)[1], global_batch_size=G, shard=ShardOptions(shard_index=0, shard_count=1))


# -- torchtitan (examples/torchtitan_source.py, the release pip installs) ------------------------


@pytest.fixture(scope="module")
def torchtitan_example():
    pytest.importorskip("torch")
    pytest.importorskip("torchtitan.components.dataloader")
    examples = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")
    sys.path.insert(0, examples)
    try:
        import torchtitan_source
    finally:
        sys.path.remove(examples)
    return torchtitan_source


def _torchtitan_loader(example, path: str, *, dp: int, rank: int, local: int):
    config = example.TokenloomDataLoader.Config(dataset_path=path, global_batch_size=G)
    return config.build(dp_world_size=dp, dp_rank=rank, tokenizer=None, seq_len=SEQ, local_batch_size=local)


def _check_torchtitan_steps(example, loaders, dp: int, local: int, expected: list[dict], what: str) -> None:
    """Each rank's ``(input_dict, labels)`` are its rows of every expected global batch."""
    iterators = [iter(loader) for loader in loaders]
    for step, batch in enumerate(expected):
        for micro in range(G // (dp * local)):
            for rank, it in enumerate(iterators):
                input_dict, labels = next(it)
                rows = slice(micro * dp * local + rank * local, micro * dp * local + (rank + 1) * local)
                np.testing.assert_array_equal(input_dict["input"].numpy(), batch["tokens"][rows],
                                              err_msg=f"{what}: step {step}")
                masked = np.where(batch["loss_mask"][rows] == 0, example.IGNORE_INDEX, batch["labels"][rows])
                np.testing.assert_array_equal(labels.numpy(), masked, err_msg=f"{what}: step {step}")


def test_torchtitan_serves_the_sampler_across_phases_and_resumes_across_a_boundary(builds, plain, torchtitan_example,
                                                                                   tmp_path):
    yaml = pytest.importorskip("yaml")
    example = torchtitan_example
    config, _ = builds("stateless")
    _, reference, _ = plain("stateless")
    path = tmp_path / "build.yaml"
    path.write_text(yaml.safe_dump(config))
    saved = [_torchtitan_loader(example, str(path), dp=2, rank=r, local=4) for r in range(2)]
    _check_torchtitan_steps(example, saved, 2, 4, reference[:8], "dp 2")  # phase 1, to step 8
    states = [loader.state_dict() for loader in saved]
    assert states[0] == states[1] and json.loads(states[0]["tokenloom"])["step"] == 8
    resumed = [_torchtitan_loader(example, str(path), dp=4, rank=r, local=3) for r in range(4)]
    for loader in resumed:
        loader.load_state_dict(states[0])
    _check_torchtitan_steps(example, resumed, 4, 3, reference[8:12], "resumed at dp 4")  # into phase 2
    # a build with a batch-size ramp: the example's loader has no ramp, so it is refused with the reason
    ramped, _ = builds("stateless", True)
    (tmp_path / "ramped.yaml").write_text(yaml.safe_dump(ramped))
    with pytest.raises(ConfigError, match=r"after a batch-size ramp .* BatchGeometry has global_batch_size=24 and no "
                                          r"schedule"):
        _torchtitan_loader(example, str(tmp_path / "ramped.yaml"), dp=2, rank=0, local=4)


def test_the_torch_sampler_refuses_a_geometry_that_steps_otherwise(builds):
    pytest.importorskip("torch")
    from tokenloom.serve.torch_adapter import StatefulBatchSampler, build_dataloader

    _, ramped = builds("exact", True)
    with pytest.raises(ConfigError, match=r"after a batch-size ramp .* takes 8 samples in the build and 24 here"):
        StatefulBatchSampler(ramped, BatchGeometry(global_batch_size=G, micro_batch_size=4, dp=2))
    with pytest.raises(ConfigError, match=r"takes 8 samples in the build and 24 here"):
        build_dataloader(ramped, BatchGeometry(global_batch_size=G, micro_batch_size=4, dp=2), stateful=False)
    sampler = StatefulBatchSampler(ramped, _geometry(2, 4, True))
    assert sum(len(pairs) for pairs in sampler) == ramped.num_samples // 2  # every step of the ramp, half per rank
