"""Serving a schedule of several phases (issue 40), in both modes.

A weight change at run time replaces the weights of the phase holding it up to that phase's end,
later phases follow as declared, and every store numbers on from the sample it really reached;
``headroom`` sizes the stores for it, and a change that takes more of a store than its index holds
is refused with the store, the phase and the numbers. The audit log gives each step's phase and
marks the changes; its expectation at a resume sums each step's target (a ramp's too); the
mixture plot draws each step's target with the phase boundaries."""

from __future__ import annotations

import math

import numpy as np
import pytest

import tokenloom
from build_fixtures import make_stores
from test_build_schedule_stateless import _config
from tokenloom.builder.config import build_config_from_dict
from tokenloom.errors import ConfigError
from tokenloom.index.blend import largest_remainder_counts
from tokenloom.serve import MixtureAudit, RankLoader, read_audit_log
from tokenloom.serve.audit import expected_samples
from tokenloom.serve.geometry import BatchGeometry
from tokenloom.serve.sampler import MicroBatchSampler
from tokenloom.serve.stream import SampleStream

#: phase ends of test_build_schedule_stateless's PHASES (16 samples a step)
ENDS = (1008, 1504, 1920)


@pytest.fixture(scope="module", params=["stateless", "exact"])
def built(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"weights_{request.param}")
    make_stores(root / "stores", count=4)
    values = _config(str(root / "stores"), root / "cache", mode=request.param, headroom=0.5)
    return values, build_config_from_dict(values), tokenloom.build(values)


def _served(stream: SampleStream) -> tuple[np.ndarray, np.ndarray]:
    return stream.locate(np.arange(stream.num_samples, dtype=np.int64))


def _check_numbering(stream: SampleStream) -> None:
    """Every store serves its samples 0, 1, 2, ... in the order of the stream: none twice, none
    skipped, however the weights changed."""
    datasets, samples = _served(stream)
    for d, info in enumerate(stream.source.datasets):
        mine = samples[datasets == d]
        assert mine.tolist() == list(range(mine.shape[0])), d
        assert mine.shape[0] <= info.num_samples


def test_headroom_sizes_every_store_by_the_schedules_need_and_half_again(built):
    _, config, result = built
    plan = config.schedule_plan()
    train = result.plan.splits[0]
    union = list(config.schedule_stores.prefixes)
    if config.mode == "stateless":
        need = {p: int(plan.totals[union.index(p)]) for p in train.prefixes}
    else:
        from tokenloom.index.schedule_exact import exact_buffers, plan_exact_phases

        buffers = exact_buffers(plan_exact_phases(plan), surplus=config.mid_level_dataset_surplus)
        need = {p: int(buffers[union.index(p)]) for p in train.prefixes}
    for prefix, key in zip(train.prefixes, train.dataset_keys):
        assert result.plan.item(key).params["num_samples"] == math.ceil(need[prefix] * 1.5)
    assert "headroom 0.5: each store's index holds 1.5 x its total" in config.describe_schedule()


def test_a_change_replaces_the_phase_to_its_end_and_later_phases_follow_as_declared(built):
    _, _, result = built
    train = result.split("train")
    base = SampleStream(train)
    weights = [0.1, 0.7, 0.2][: len(train.datasets)] + [0.0] * max(0, len(train.datasets) - 3)
    changed = base.reweighted(480, weights)  # step 30 of phase 1
    before_d, before_s = _served(base)
    after_d, after_s = _served(changed)
    assert changed.num_samples == base.num_samples >= ENDS[-1]  # exact: megatron's last few
    # before the change: untouched
    assert np.array_equal(after_d[:480], before_d[:480]) and np.array_equal(after_s[:480], before_s[:480])
    # to the phase's end: the new weights' exact counts
    counts = np.bincount(after_d[480:ENDS[0]], minlength=len(train.datasets))
    expected = largest_remainder_counts(np.asarray(weights) / sum(weights), ENDS[0] - 480)
    assert counts.tolist() == expected.tolist()
    assert changed.target_weights(700) == pytest.approx(np.asarray(weights) / sum(weights))
    # later phases: the declared mixture, each store numbered on from where it really stopped
    assert np.array_equal(after_d[ENDS[0]:], before_d[ENDS[0]:])
    assert changed.target_weights(ENDS[0]) == pytest.approx(base.target_weights(ENDS[0]))
    reached = np.bincount(after_d[:ENDS[0]], minlength=len(train.datasets))
    planned = np.bincount(before_d[:ENDS[0]], minlength=len(train.datasets))
    shift = (reached - planned)[after_d[ENDS[0]:]]
    assert np.array_equal(after_s[ENDS[0]:], before_s[ENDS[0]:] + shift)
    _check_numbering(changed)
    # what the next change continues from: the closed form equals a count of the positions
    for position in (0, 479, 480, 900, ENDS[0], 1300, ENDS[-1]):
        assert np.array_equal(changed.changes.reached(position),
                              np.bincount(after_d[:position], minlength=len(train.datasets))), position


def test_changes_inside_a_ramp_and_in_two_phases_compose(built):
    _, _, result = built
    train = result.split("train")
    n = len(train.datasets)
    stream = SampleStream(train).reweighted(320, np.eye(n)[0] + 0.1)  # phase 1
    stream = stream.reweighted(640, np.eye(n)[1] + 0.1)  # phase 1 again: replaces the rest of it
    stream = stream.reweighted(1200, np.eye(n)[0] + 1.0)  # inside phase 2's ramp: its rest is constant
    datasets, _ = _served(stream)
    assert [s.start for s in stream.segments] == [320, 640, 1200]
    rest = np.bincount(datasets[1200:ENDS[1]], minlength=n)
    w = np.eye(n)[0] + 1.0
    assert rest.tolist() == largest_remainder_counts(w / w.sum(), ENDS[1] - 1200).tolist()
    assert stream.target_weights(1300) == stream.target_weights(1500) == pytest.approx(w / w.sum())
    assert stream.target_weights(ENDS[1]) == pytest.approx(SampleStream(train).target_weights(ENDS[1]))
    _check_numbering(stream)
    # a change before an earlier one replaces it (a resume from an older state)
    again = stream.reweighted(480, np.ones(n))
    assert [s.start for s in again.segments] == [320, 480]
    _check_numbering(again)


def test_a_change_resumes_on_another_layout_from_the_state(built):
    _, _, result = built
    train = result.split("train")
    first = MicroBatchSampler(train, BatchGeometry(global_batch_size=16, micro_batch_size=2, dp=2))
    for _ in range(30 * first.num_micro_batches):  # 30 steps
        first.advance()
    first.reweight([0.2, 0.5, 0.3, 0.0][: len(train.datasets)])
    state = first.state_dict()
    twin = MicroBatchSampler(train, BatchGeometry(global_batch_size=16, micro_batch_size=4, dp=4), dp_rank=3)
    twin.load_state_dict(state)
    positions = np.arange(480, ENDS[-1], dtype=np.int64)
    assert twin.step == 30 and twin.step_start == 480
    for a, b in zip(first.stream.locate(positions), twin.stream.locate(positions)):
        assert np.array_equal(a, b)


def test_a_quarantine_after_a_change_finds_the_document_in_every_later_phase(built):
    _, _, result = built
    train = result.split("train")
    stream = SampleStream(train).reweighted(480, [0.1, 0.6, 0.3, 0.0][: len(train.datasets)])
    datasets, samples = _served(stream)
    origin = train.where([1700])[0]
    item = (origin.prefix, origin.pieces[0].document)
    out = stream.quarantined_from(480, [item])
    # the slow reference: every position from 480 whose sample's pieces hold that document,
    # read from the dataset's own spans
    holding = []
    for p in range(480, stream.num_samples):
        reader = train.readers[int(datasets[p])]
        spans = reader.spans(np.asarray([samples[p]]))
        documents = spans.document_ids[spans.lengths > 0].tolist()
        if reader.prefix == item[0] and item[1] in documents:
            holding.append(p)
    assert len(holding) >= 1 and out.quarantined.tolist() == holding


def test_a_change_beyond_a_stores_index_is_refused_with_the_store_phase_and_numbers(tmp_path):
    make_stores(tmp_path / "stores", count=4)
    values = _config(str(tmp_path / "stores"), tmp_path / "cache", mode="stateless")
    train = tokenloom.build(values).split("train")
    stream = SampleStream(train)
    with pytest.raises(ConfigError, match=r"dataset 1 \('.*store1'\): the weight change at position 480 "
                                          r"\(phase 1\) "
                                          r"would have it serve \d+ samples by the end of phase 3, more than the "
                                          r"\d+ its index holds .*give it less weight, build with more "
                                          r"headroom, or put the new weights"):
        stream.reweighted(480, [0.0, 1.0, 0.0, 0.0])
    roomy = tokenloom.build({**values, "headroom": 0.1}).split("train")
    with pytest.raises(ConfigError, match=r"dataset 1 .*more than the \d+ its index holds"):
        SampleStream(roomy).reweighted(16, [0.0, 1.0, 0.0, 0.0])  # a whole phase of one store: past 10%
    _check_numbering(SampleStream(roomy).reweighted(480, [0.6, 0.4, 0.0, 0.0]))  # a small change fits


def test_headroom_is_in_the_build_key_and_a_config_without_it_keeps_its_key(tmp_path):
    from tokenloom.builder.config import array_config
    from tokenloom.source.keys import hash_key

    values = _config(str(tmp_path / "stores"), tmp_path / "c")
    plain = build_config_from_dict(values)
    assert "headroom" not in array_config(plain)
    roomy = build_config_from_dict({**values, "headroom": 0.25})
    assert array_config(roomy)["headroom"] == 0.25 and hash_key(array_config(roomy)) != hash_key(array_config(plain))


def test_headroom_is_refused_without_several_phases_and_capped_by_max_epochs(tmp_path):
    make_stores(tmp_path / "stores", count=4)
    stores = str(tmp_path / "stores")
    one = [{"blend": ["1", "store0"], "until": {"samples": 300}}]
    with pytest.raises(ConfigError, match=r"headroom=0.2 without a schedule of several phases"):
        build_config_from_dict(_config(stores, tmp_path / "c", phases=one, headroom=0.2))
    with pytest.raises(ConfigError, match=r"headroom=-1; expected a fraction"):
        build_config_from_dict(_config(stores, tmp_path / "c", headroom=-1))
    with pytest.raises(ConfigError, match=r"headroom=0.1 with max_epochs and packing: best_fit; a best-fit store's "
                                          r"epoch is known only once its documents are packed"):
        build_config_from_dict(_config(stores, tmp_path / "c", headroom=0.1, max_epochs=2, packing="best_fit"))
    values = _config(stores, tmp_path / "c", headroom=100.0, max_epochs=2.0)
    result = tokenloom.build(values)
    config = build_config_from_dict(values)
    plan = config.schedule_plan()
    union = list(config.schedule_stores.prefixes)
    train = result.plan.splits[0]
    for prefix, key in zip(train.prefixes, train.dataset_keys):
        n = result.plan.item(key).params["num_samples"]
        need = int(plan.totals[union.index(prefix)])
        two_epochs = 2 * config._train_samples_per_epoch(prefix, "test")
        assert n == max(need, min(101 * need, two_epochs)), prefix  # never below the schedule's own need
    assert any(101 * int(plan.totals[union.index(p)]) > 2 * config._train_samples_per_epoch(p, "test")
               for p in train.prefixes)  # the cap bites somewhere


def _audited_run(train, path, *, until: int, state_at: int | None = None):
    """Steps ``[0, until)`` of dp=2 with a change inside phase 1 (step 30) and inside the ramp
    (step 80), two steps skipped at 100; the state before step ``state_at``."""
    loader = RankLoader(train, BatchGeometry(global_batch_size=16, micro_batch_size=4, dp=2),
                        audit=MixtureAudit(path))
    n, state = len(train.datasets), None
    for step in range(until):
        if step == state_at:
            state = loader.state_dict()
        if step == 30:
            loader.reweight([0.6, 0.4, 0.0, 0.0][:n])
        if step == 80:
            loader.reweight([0.45, 0.55, 0.0, 0.0][:n])
        if step == 100:
            loader.skip_steps(100, 102)
        for _ in range(2):
            loader.next_batch()
    return loader, state


def test_the_audit_logs_each_steps_phase_and_the_changes_and_a_resume_sums_the_same_targets(built, tmp_path):
    _, config, result = built
    train = result.split("train")
    loader, state = _audited_run(train, tmp_path / "audit.jsonl", until=115, state_at=90)
    records = read_audit_log(tmp_path / "audit.jsonl").records
    assert [r["step"] for r in records] == list(range(115))
    phase_of = config.schedule_plan().phase_of
    stream = loader.stream
    for r in records:
        assert r["phase"] == int(phase_of(int(stream.underlying(np.array([r["consumed_samples"]]))[0]))) + 1
    assert {r["phase"] for r in records} == {1, 2, 3}
    assert [r["step"] for r in records if r.get("weights_changed")] == [30, 80]
    ramp = np.array([r["target_weights"] for r in records if r["phase"] == 2 and r["step"] < 80])
    assert ramp.shape[0] > 10 and np.allclose(np.diff(ramp, n=2, axis=0), 0.0, atol=1e-12)  # a straight line
    assert not np.allclose(ramp[0], ramp[-1])
    # the slow reference: each step's target times its samples, summed
    summed = np.cumsum([np.asarray(r["target_weights"]) * r["global_batch_size"] for r in records], axis=0)
    for r in records[1:]:
        expected = expected_samples(stream, r["consumed_samples"])
        assert np.allclose(expected, summed[r["step"] - 1], rtol=1e-12), r["step"]
    # a resume at step 90 (inside the ramp's changed rest) on another layout logs the same drift
    again = RankLoader(train, BatchGeometry(global_batch_size=16, micro_batch_size=2, dp=4),
                       audit=MixtureAudit(None))
    again.load_state_dict(state)
    for step in range(90, 115):
        if step == 100:
            again.skip_steps(100, 102)
        for _ in range(2):
            again.next_batch()
    for resumed, first in zip(again.audit.records, records[90:]):
        assert resumed["fingerprint"] == first["fingerprint"] and resumed["phase"] == first["phase"]
        assert np.allclose(resumed["drift"], first["drift"], atol=1e-12), resumed["step"]


def test_the_mixture_plot_of_a_schedule_draws_each_steps_target_and_the_phases(built, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import tokenloom.plots as plots

    _, _, result = built
    _audited_run(result.split("train"), tmp_path / "audit.jsonl", until=115)
    kept = []
    monkeypatch.setattr(plots, "_save", lambda fig, out: (kept.append(fig), fig.canvas.draw(), out)[-1])
    plots.plot_mixture(read_audit_log(tmp_path / "audit.jsonl"), str(tmp_path / "mixture.png"))
    now, cumulative = kept[0].axes
    phases = [t.get_text() for t in now.texts]
    assert phases == ["phase 1", "phase 2", "phase 3"]
    boundaries = sorted({int(line.get_xdata()[0]) for line in now.get_lines() if line.get_linestyle() == "-"
                         and len(line.get_xdata()) == 2})
    assert boundaries == [63, 94]  # the steps phases 2 and 3 begin (1008 and 1504 samples, 16 a step)
    changes = [line for line in cumulative.get_lines() if line.get_label() == "weights changed"]
    assert len(changes) == 1 and int(changes[0].get_xdata()[0]) == 30  # only the first is labelled
    dashed = [line for line in now.get_lines() if line.get_linestyle() not in ("-", ":")]
    ramp = [np.asarray(line.get_ydata())[64:79] for line in dashed]
    assert any(np.ptp(y) > 0.01 and np.allclose(np.diff(y, n=2), 0.0, atol=1e-12) for y in ramp)  # sloped, straight


def test_samples_reached_counts_the_served_positions_after_changes_skips_and_quarantines(built):
    """The count a resume starts the audit from: closed form on a stateless schedule, less what was
    taken out; the slow reference counts the positions served."""
    from tokenloom.serve.weight_changes import count_samples

    _, _, result = built
    train = result.split("train")
    stream = SampleStream(train).reweighted(480, [0.3, 0.5, 0.2, 0.0][: len(train.datasets)])
    stream = stream.skipped(600, 664).reweighted(1100, [0.5, 0.5, 0.0, 0.0][: len(train.datasets)])
    origin = train.where([1700])[0]
    stream = stream.quarantined_from(1200, [(origin.prefix, origin.pieces[0].document)])
    assert stream.quarantined.size and stream.skips
    for position in (0, 479, 480, 600, 601, 1000, 1100, 1300, stream.num_samples):
        assert np.array_equal(stream.samples_reached(position),
                              count_samples(position, stream.locate, len(train.datasets))), position


def test_a_series_of_changes_equals_the_stream_made_from_its_segments_at_once(built):
    """Each change takes over the work of the changes before it (their blends, shifts and room
    checks); the stream made from the same segments in one go serves the same samples."""
    _, _, result = built
    train = result.split("train")
    rng = np.random.default_rng(11)
    stream = SampleStream(train)
    for position in range(48, ENDS[-1] - 16, 48):  # 39 changes, three phases, one a ramp
        weights = np.asarray(stream.changes.declared_at(position)) * (1 + 0.1 * rng.random(len(train.datasets)))
        stream = stream.reweighted(position, weights)
    again = SampleStream(train, stream.segments)
    positions = np.arange(stream.num_samples, dtype=np.int64)
    for a, b in zip(stream.locate(positions), again.locate(positions)):
        assert np.array_equal(a, b)
    _check_numbering(stream)
