"""Online data mixing (issue 41, first step): the training loop reports each dataset's tokens and
loss after every step; every ``every`` steps DoReMi's exponentiated-gradient update picks the
weights of step ``t + lag``; a run stopped at any step and resumed on another layout serves the
same weights and the same batches as the run that never stopped; a domain made harder gains the
weight the update says; bad settings and reports are ConfigErrors naming the value."""

from __future__ import annotations

import json

import numpy as np
import pytest

import tokenloom
from serve_fixtures import write_corpus
from tokenloom.errors import ConfigError
from tokenloom.serve import BatchGeometry, ExponentiatedGradient, OnlineMixing, RankLoader, Topology

SEQ, G = 16, 16
#: per-token loss of each dataset: the second is harder
LOSS = np.array([2.0, 3.5, 2.0, 2.0])


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A stateless schedule of two phases over four stores, with headroom for weight changes:
    (its config, its train split)."""
    root = tmp_path_factory.mktemp("online")
    s0, s1, s2, s3 = write_corpus(root, 4, seed=5, num_documents=80)
    phases = [{"blend": ["0.4", s0, "0.3", s1, "0.3", s2], "until": {"steps": 40}},
              {"blend": ["0.3", s0, "0.3", s1, "0.4", s3], "until": {"steps": 70}}]
    config = {"phases": phases, "split": "100,0,0", "seq_length": SEQ, "global_batch_size": G,
              "valid_samples": 0, "test_samples": 0, "seed": 3, "mode": "stateless", "headroom": 1.0,
              "cache_dir": str(root / "cache"), "rng_workers": 0, "timeout_s": 60.0}
    return config, tokenloom.build(config).split("train")


@pytest.fixture(scope="module")
def split(built):
    return built[1]


def _mixing(num_datasets: int, learning_rate: float = 0.1, **changes) -> OnlineMixing:
    settings = {"every": 4, "lag": 2, "min_weight": 0.02}
    settings.update(changes)
    return OnlineMixing(ExponentiatedGradient(num_datasets, learning_rate=learning_rate), **settings)


def _loader(split, dp: int, micro: int, rank: int = 0) -> RankLoader:
    geometry = BatchGeometry(global_batch_size=G, micro_batch_size=micro, dp=dp)
    return RankLoader(split, geometry, topology=Topology(dp=dp), rank=rank, mixing=_mixing(len(split.datasets)))


def _run(loader: RankLoader, steps: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Serve ``steps`` steps, reporting after each what a training loop would: each dataset's
    tokens in the global batch and their loss (LOSS, varied a little by step)."""
    served = []
    for _ in range(steps):
        sampler = loader.sampler
        if sampler.exhausted():
            break
        step = sampler.step
        datasets, samples = loader.stream.locate(sampler.global_batch_positions())
        served.append((datasets, samples))
        for _ in range(sampler.num_micro_batches):
            loader.next_batch()
        tokens = np.bincount(datasets, minlength=len(LOSS)).astype(np.float64) * SEQ
        loss = LOSS + 0.05 * ((step * 7 + np.arange(len(LOSS))) % 3)
        loader.report(tokens, tokens * loss)
    return served


def test_a_run_stopped_anywhere_resumes_on_another_layout_with_the_same_weights_and_batches(split):
    reference = _loader(split, dp=2, micro=4)
    whole = _run(reference, 70)
    assert len(whole) == 70 and len(reference.mixing.history) >= 10
    assert [step for step, _ in reference.mixing.history][:3] == [5, 9, 13]  # decided after 4, 8, 12: 2 later
    for stop in (3, 4, 5, 6, 23, 39, 41, 57):  # in a window, at a decision, before it takes effect, at a phase
        first = _loader(split, dp=2, micro=4)
        before = _run(first, stop)
        state = json.loads(json.dumps(first.state_dict()))
        again = _loader(split, dp=4, micro=2, rank=3)
        again.load_state_dict(state)
        after = _run(again, 70 - stop)
        for k, ((d, s), (d0, s0)) in enumerate(zip(before + after, whole)):
            assert np.array_equal(d, d0) and np.array_equal(s, s0), (stop, k)
        assert again.mixing.history == reference.mixing.history, stop


def test_the_harder_domain_gains_the_weight_exponentiated_gradient_gives_it(split):
    loader = _loader(split, dp=1, micro=16)
    served = _run(loader, 40)  # phase 1: datasets 0, 1, 2 in use
    history = [(step, w) for step, w in loader.mixing.history if step < 40]
    # the slow reference: each window's mean loss per dataset, its excess over the window's mean,
    # the log-weights' sum, the softmax on the phase's datasets, the floor
    log_w = np.zeros(len(LOSS))
    for k, (step, weights) in enumerate(history):
        window = range(4 * k, 4 * k + 4)
        tokens = sum(np.bincount(served[t][0], minlength=4) * SEQ for t in window).astype(np.float64)
        losses = sum(np.bincount(served[t][0], minlength=4) * SEQ * (LOSS + 0.05 * ((t * 7 + np.arange(4)) % 3))
                     for t in window)
        seen = tokens > 0
        excess = np.where(seen, losses / np.maximum(tokens, 1) - losses[seen].sum() / tokens[seen].sum(), 0.0)
        log_w = log_w + 0.1 * excess
        p = np.exp(log_w - log_w.max()) * np.array([0.4, 0.3, 0.3, 0.0])  # over phase 1's weights
        expected = np.where(p > 0, 0.02 + (1 - 3 * 0.02) * p / p.sum(), 0.0)
        assert np.allclose(weights, expected, atol=1e-12), step
    harder = [w[1] for _, w in history]
    assert harder == sorted(harder) and harder[-1] > 0.45  # from 0.3, every decision up
    assert all(w[3] == 0.0 for _, w in history)  # phase 1 leaves store 3 out; it stays out
    # and the stream served them: the audit's target at a decided step is the decision
    step, weights = history[-1]
    assert loader.stream.target_weights(step * G) == pytest.approx(weights)


def test_bad_settings_and_reports_are_config_errors_naming_the_value(split):
    n = len(split.datasets)
    with pytest.raises(ConfigError, match=r"lag=0; expected an integer >= 1 \(steps\): weights are decided ahead"):
        _mixing(n, lag=0)
    with pytest.raises(ConfigError, match=r"every=0; expected an integer >= 1"):
        _mixing(n, every=0)
    with pytest.raises(ConfigError, match=r"min_weight=1.5; expected a fraction in \[0, 1\)"):
        _mixing(n, min_weight=1.5)
    loader = _loader(split, dp=1, micro=4)
    with pytest.raises(ConfigError, match=r"report: no step is served yet; expected one report after every"):
        loader.report(np.ones(n), np.ones(n))
    _run(loader, 1)
    with pytest.raises(ConfigError, match=r"report: step 0 is reported already"):
        loader.report(np.ones(n), np.ones(n))
    loader.next_batch()
    with pytest.raises(ConfigError, match=r"report after a whole step: 1 micro-batches of step 1 are served"):
        loader.report(np.ones(n), np.ones(n))
    for _ in range(loader.sampler.num_micro_batches - 1):
        loader.next_batch()
    with pytest.raises(ConfigError, match=r"tokens has 3 entries; expected 4, one per dataset"):
        loader.report(np.ones(3), np.ones(4))
    with pytest.raises(ConfigError, match=r"tokens=\[1.0, -1.0, 1.0, 1.0\]; expected finite non-negative numbers"):
        loader.report([1, -1, 1, 1], np.ones(n))
    with pytest.raises(ConfigError, match=r"loss_sums=\[1.0, nan, 1.0, 1.0\]; expected finite numbers"):
        loader.report(np.ones(n), [1, float("nan"), 1, 1])
    with pytest.raises(ConfigError, match=r"min_weight=0.3 for 4 datasets in use; expected below 0.25"):
        _mixing(n, min_weight=0.3).bounded(np.ones(n), support=np.ones(n, dtype=bool))
    with pytest.raises(ConfigError, match=r"all zero on the datasets in use \(\[0, 1\]\)"):
        _mixing(n).bounded(np.array([0.0, 0.0, 1.0, 1.0]), support=np.array([True, True, False, False]))
    plain = RankLoader(split, BatchGeometry(global_batch_size=G, micro_batch_size=16, dp=1))
    with pytest.raises(ConfigError, match=r"report\(\) feeds online mixing; this loader has none"):
        plain.report(np.ones(n), np.ones(n))
    with pytest.raises(ConfigError, match=r"the serving state was saved with online mixing and this loader has none"):
        plain.load_state_dict(loader.state_dict())
    other = RankLoader(split, BatchGeometry(global_batch_size=G, micro_batch_size=16, dp=1), mixing=_mixing(n, lag=3))
    with pytest.raises(ConfigError, match=r"online mixing has lag=2, this one 3; resume with the settings"):
        other.load_state_dict(loader.state_dict())


def test_a_decision_beyond_a_stores_room_is_refused_naming_it_and_changes_nothing(built, tmp_path):
    """The controller's weights are checked against what the build sized each store for (without
    headroom: the schedule's counts, up to the end of the epoch they fall in): a controller that
    drives the harder store's weight up fast runs it out, the decision is refused, and the
    controller, the history and the stream stay as they were before that report."""
    config, _ = built
    tight = tokenloom.build({**config, "headroom": 0.0, "cache_dir": str(tmp_path / "c")}).split("train")
    loader = RankLoader(tight, BatchGeometry(global_batch_size=G, micro_batch_size=16, dp=1),
                        mixing=_mixing(len(tight.datasets), learning_rate=5.0))
    for _ in range(40):
        datasets, _ = loader.stream.locate(loader.sampler.global_batch_positions())
        loader.next_batch()
        tokens = np.bincount(datasets, minlength=len(LOSS)).astype(np.float64) * SEQ
        controller, history, segments = (loader.mixing.controller.state_dict(), list(loader.mixing.history),
                                         loader.stream.segments)
        try:
            loader.report(tokens, tokens * LOSS)
        except ConfigError as exc:
            assert "its index holds" in str(exc) and "(phase 1)" in str(exc), exc
            assert loader.mixing.controller.state_dict() == controller and loader.mixing.history == history
            assert loader.stream.segments == segments
            break
    else:
        pytest.fail("no decision was refused")


def test_distributed_batches_with_dataloader_workers_serve_the_rank_loaders_decisions(split):
    """DistributedBatches reads ahead through DataLoader workers; a decision restarts them after
    what they read, so every micro-batch is the one RankLoader serves with the same reports."""
    pytest.importorskip("torch")
    from tokenloom.serve.torch_adapter import DistributedBatches

    geometry = BatchGeometry(global_batch_size=G, micro_batch_size=4, dp=2)
    expected_loader = RankLoader(split, geometry, topology=Topology(dp=2), rank=1, mixing=_mixing(4))
    batches = DistributedBatches(split, geometry, Topology(dp=2), 1, num_workers=1, mixing=_mixing(4))
    for step in range(20):
        for _ in range(2):
            want, got = expected_loader.next_batch(), batches.next_batch()
            assert np.array_equal(got["dataset_id"].numpy(), want["dataset_id"]), step
            assert np.array_equal(got["tokens"].numpy(), want["tokens"]), step
        tokens = np.full(4, 64.0)
        loss = tokens * (LOSS + 0.01 * step)
        assert expected_loader.report(tokens, loss) == batches.report(tokens, loss)
    assert batches.mixing.history == expected_loader.mixing.history and len(batches.mixing.history) == 5


def test_a_change_on_a_stateless_blend_counts_what_came_before_in_closed_form(tmp_path):
    """A series of decisions must not pass over the stream each time: the counts a change
    continues from come from the blend's closed form (its seeded windows: whole ones from the
    unseeded order, the partial one located) and equal a count of the positions served."""
    from tokenloom.index.blend import Blend
    from tokenloom.serve.stream import SampleStream
    from tokenloom.serve.weight_changes import _blend_prefix_counts, count_samples

    prefixes = write_corpus(tmp_path, 3, seed=9, num_documents=60)
    config = {"blend": ["0.5", prefixes[0], "0.3", prefixes[1], "0.2", prefixes[2]], "split": "100,0,0",
              "seq_length": SEQ, "train_samples": 3000, "valid_samples": 0, "test_samples": 0, "seed": 4,
              "mode": "stateless", "cache_dir": str(tmp_path / "c"), "timeout_s": 60.0}
    train = tokenloom.build(config).split("train")
    assert train.blend is not None
    stream = SampleStream(train)
    for position in (0, 1, 17, 64, 999, 2048):
        offsets = stream.reweighted(position, [0.2, 0.3, 0.5]).segments[-1].dataset_offsets
        assert list(offsets) == count_samples(position, train.locate, 3).tolist(), position
    seeded = Blend(np.array([0.5, 0.3, 0.2]), 3000, seed=4, window=64)  # windows shuffled
    located, _ = seeded.lookup(np.arange(3000, dtype=np.int64))
    for position in (0, 1, 63, 64, 65, 999, 3000):
        assert np.array_equal(_blend_prefix_counts(seeded, position), np.bincount(located[:position], minlength=3))


def test_the_state_holds_each_decision_once_and_a_schema_2_history_still_loads(split):
    """The history in the state is ``[step, position]``: the weights are the blend segment's there
    (in the sampler's state), not held twice; a history saved with its weights reads back as them."""
    loader = _loader(split, dp=1, micro=16)
    _run(loader, 20)
    state = json.loads(json.dumps(loader.state_dict()))
    steps = [step for step, _ in loader.mixing.history]
    positions = [segment["start"] for segment in state["blend_segments"]]
    assert state["online_mixing"]["history"] == [[step, step * G] for step in steps] and positions == [
        step * G for step in steps]
    assert [w for _, w in loader.mixing.history] == [s.weights for s in loader.stream.segments]
    old = {**state["online_mixing"], "history": [[step, list(w)] for step, w in loader.mixing.history]}
    plain = [{"start": s.start, "weights": list(s.weights), "dataset_offsets": list(s.dataset_offsets)}
             for s in loader.stream.segments]
    again = _loader(split, dp=2, micro=8)
    again.load_state_dict({**state, "schema_version": 2, "blend_segments": plain, "online_mixing": old})
    assert again.stream.segments == loader.stream.segments
    assert again.mixing.history == loader.mixing.history
    assert again.state_dict()["online_mixing"]["history"] == old["history"]


def test_jax_hosts_serve_the_rank_loaders_decisions_and_resume_on_another_host_count(split):
    """HostLoader takes online mixing: two hosts reporting the same global statistics serve the
    rows a RankLoader of two data-parallel ranks serves, with the same decisions; a state saved
    at step 17 resumes on four hosts with the same history."""
    from tokenloom.serve.jax_adapter import HostLoader, ShardOptions

    reference = _loader(split, dp=2, micro=8)
    whole = _run(reference, 30)
    hosts = [HostLoader(split, global_batch_size=G, shard=ShardOptions(shard_index=i, shard_count=2),
                        mixing=_mixing(len(split.datasets))) for i in range(2)]

    def serve(hosts, steps: int, first: int) -> None:
        for step in range(first, first + steps):
            rows = [next(host) for host in hosts]
            datasets = np.concatenate([r["dataset_id"] for r in rows]).astype(np.int64)
            got = np.concatenate([r["tokens"] for r in rows])
            expected = split.read_samples(*whole[step])[:, :-1]  # the same rows, whichever host holds each
            assert np.array_equal(got[np.lexsort(got.T)], expected[np.lexsort(expected.T)]), step
            tokens = np.bincount(datasets, minlength=len(LOSS)).astype(np.float64) * SEQ
            loss = LOSS + 0.05 * ((step * 7 + np.arange(len(LOSS))) % 3)
            assert len({host.report(tokens, tokens * loss) for host in hosts}) == 1

    serve(hosts, 17, 0)
    state = json.loads(json.dumps(hosts[0].state_dict()))
    assert state == json.loads(json.dumps(hosts[1].state_dict()))
    more = [HostLoader(split, global_batch_size=G, shard=ShardOptions(shard_index=i, shard_count=4),
                       mixing=_mixing(len(split.datasets))) for i in range(4)]
    for host in more:
        host.load_state_dict(state)
    serve(more, 13, 17)
    assert more[0].mixing.history == reference.mixing.history[:len(more[0].mixing.history)]
    assert len(more[0].mixing.history) >= 6
