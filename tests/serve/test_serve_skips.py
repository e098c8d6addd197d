"""Skipping steps and quarantining documents: exact across resumes and layouts, full batches,
every later sample the one that followed, recorded in the audit log and by ``tokenloom audit``."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tokenloom
from serve_fixtures import write_corpus
from tokenloom.cli import main as cli_main
from tokenloom.errors import ConfigError
from tokenloom.serve import BatchGeometry, MixtureAudit, RankLoader, Topology, read_audit_log
from tokenloom.serve.sampler import MicroBatchSampler
from tokenloom.serve.stream import SampleStream

G, MICRO = 8, 2


@pytest.fixture(scope="module", params=["exact", "stateless", "best_fit"])
def split(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"skips-{request.param}")
    prefixes = write_corpus(root, 3, seed=5)
    config = {"blend": {"prefixes": prefixes, "weights": [5.0, 3.0, 2.0]}, "split": "100,0,0", "seq_length": 16,
              "train_samples": 2000, "valid_samples": 0, "test_samples": 0, "seed": 11,
              "mode": "exact" if request.param == "best_fit" else request.param, "cache_dir": str(root / "cache")}
    if request.param == "best_fit":
        config["packing"] = "best_fit"
    return tokenloom.build(config).split("train")


def _pairs(stream: SampleStream, positions) -> list[tuple[int, int]]:
    dataset_ids, sample_ids = stream.locate(np.asarray(positions))
    return list(zip(dataset_ids.tolist(), sample_ids.tolist()))


def _steps(sampler: MicroBatchSampler, count: int) -> list[list[tuple[int, int]]]:
    """The global batches of the next ``count`` steps (every rank's positions), advancing."""
    out = []
    for _ in range(count):
        out.append(_pairs(sampler.stream, sampler.global_batch_positions()))
        sampler.next_step()
    return out


def test_skipped_steps_are_never_served_and_later_steps_take_the_following_samples(split):
    geometry = BatchGeometry(global_batch_size=G, micro_batch_size=MICRO, dp=2)
    plain = MicroBatchSampler(split, geometry)
    reference = _steps(plain, 30)
    sampler = MicroBatchSampler(split, geometry)
    _steps(sampler, 4)
    sampler.skip_steps(10, 15)  # a loss spike around steps 10-14
    got = _steps(sampler, 20)
    assert got[:6] == reference[4:10]  # steps 4-9 as before
    assert got[6:] == reference[15:29]  # step 10 serves what step 15 would have, and so on
    assert all(len(batch) == G for batch in got)
    skipped = {pair for batch in reference[10:15] for pair in batch}
    assert not skipped & {pair for batch in got for pair in batch}


def test_a_state_with_skips_resumes_on_another_layout_with_the_same_stream(split):
    saved = MicroBatchSampler(split, BatchGeometry(global_batch_size=G, micro_batch_size=MICRO, dp=2))
    _steps(saved, 3)
    saved.skip_steps(5, 7)
    saved.skip_steps(6, 8)  # overlapping, after the first: steps are counted on the current stream
    state = json.loads(json.dumps(saved.state_dict()))  # JSON round trip
    assert state["schema_version"] == 3 and state["skipped_ranges"]
    expected = _steps(saved, 12)
    resumed = MicroBatchSampler(split, BatchGeometry(global_batch_size=G, micro_batch_size=1, dp=8))
    resumed.load_state_dict(state)
    assert _steps(resumed, 12) == expected
    v1 = dict(state, schema_version=1)  # an older state, before skips, reads as one without
    for key in ("skipped_ranges", "quarantine", "quarantined_positions"):
        v1.pop(key)
    old = MicroBatchSampler(split, BatchGeometry(global_batch_size=G, micro_batch_size=MICRO, dp=2))
    old.load_state_dict(v1)
    assert old.stream.num_samples == split.num_samples


def test_quarantined_documents_are_in_no_later_sample_before_or_after_a_weight_change(split):
    geometry = BatchGeometry(global_batch_size=G, micro_batch_size=MICRO, dp=2)
    plain = MicroBatchSampler(split, geometry)
    reference = _steps(plain, 40)
    sampler = MicroBatchSampler(split, geometry)
    served_before = _steps(sampler, 5)
    # the documents of two samples step 20 would serve, from two stores
    origins = split.where(np.array([20 * G, 20 * G + 3]))
    items = [(o.prefix, o.pieces[0].document) for o in origins]
    sampler.quarantine(items)
    after = _steps(sampler, 20)
    sampler.reweight([0.2, 0.3, 0.5])  # the quarantine holds in the new segment too
    after += _steps(sampler, 20)
    assert served_before == reference[:5]
    bad = {pos for prefix, document in items for pos in split.find(prefix, document).tolist()}
    assert bad and all(len(batch) == G for batch in after)
    for batch in after:
        for d, s in batch:
            spans = split.readers[d].spans(np.array([s]))
            holds = {(split.readers[d].prefix, int(doc)) for doc, n in zip(spans.document_ids, spans.lengths) if n > 0}
            assert not holds & set(items)
    # the samples that were not quarantined keep their order
    kept = [pair for batch in reference[5:] for pair in batch]
    quarantined_pairs = set(_pairs(plain.stream, sorted(p for p in bad if p >= 5 * G)))
    remaining = [pair for pair in kept if pair not in quarantined_pairs]
    assert [pair for batch in after[:20] for pair in batch] == remaining[:20 * G]
    # and the state carries it all to another layout
    state = sampler.state_dict()
    assert state["quarantine"] == [{"prefix": p, "document": d} for p, d in items]
    resumed = MicroBatchSampler(split, BatchGeometry(global_batch_size=G, micro_batch_size=4, dp=1))
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert _steps(resumed, 5) == _steps(sampler, 5)


def test_what_cannot_be_skipped_is_refused(split):
    sampler = MicroBatchSampler(split, BatchGeometry(global_batch_size=G, micro_batch_size=MICRO, dp=2))
    _steps(sampler, 3)
    with pytest.raises(ConfigError, match="step 3 is the next to serve"):
        sampler.skip_steps(1, 2)
    sampler.advance()
    with pytest.raises(ConfigError, match="between steps only"):
        sampler.skip_steps(5, 6)
    with pytest.raises(ConfigError, match="between steps only"):
        sampler.quarantine([(split.readers[0].prefix, 0)])
    sampler.next_step()
    with pytest.raises(ConfigError, match="is not in the train split"):
        sampler.quarantine([("/no/such/store", 0)])
    with pytest.raises(ConfigError, match="expected a \\(store prefix, document id\\) pair"):
        sampler.quarantine([("x",)])


def test_the_audit_log_records_what_was_skipped_and_the_command_reports_it(split, tmp_path, capsys):
    geometry = BatchGeometry(global_batch_size=G, micro_batch_size=MICRO, dp=1)
    audit = MixtureAudit(tmp_path / "audit.jsonl")
    loader = RankLoader(split, geometry, topology=Topology(dp=1), audit=audit, max_steps=12)
    for _ in range(3 * (G // MICRO)):
        loader.next_batch()
    loader.skip_steps(5, 7)
    for _ in range(9 * (G // MICRO)):
        loader.next_batch()
    log = read_audit_log(tmp_path / "audit.jsonl")
    jumped = [r for r in log.records if r.get("skipped")]
    assert [r["step"] for r in jumped] == [5] and jumped[0]["skipped_samples"] == 2 * G
    assert jumped[0]["skipped"] == [[5 * G, 7 * G]]
    assert cli_main(["audit", str(tmp_path / "audit.jsonl")]) == 0
    assert f"skipped {2 * G} samples in 1 range(s), jumped before step(s) 5" in capsys.readouterr().out
    assert cli_main(["audit", str(tmp_path / "audit.jsonl"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["skipped"]["skipped_samples"] == 2 * G


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 300), st.integers(0, 40)), max_size=6),
       st.lists(st.integers(0, 330), max_size=12))
def test_logical_positions_are_the_underlying_ones_left_in_order(ranges, singles):
    """Against the obvious reference: the list of underlying positions not taken out."""
    source = _tiny_source()
    skips = tuple((a, a + n) for a, n in ranges)
    stream = SampleStream(source, skips=skips, quarantined=np.asarray(singles, dtype=np.int64))
    removed = {p for a, b in skips for p in range(a, b)} | set(singles)
    kept = [p for p in range(source.num_samples) if p not in removed]
    assert stream.num_samples == len(kept)
    if kept:
        logical = np.arange(len(kept))
        assert stream.underlying(logical).tolist() == kept
        assert [stream.logical(u) for u in kept] == logical.tolist()
        got = stream.locate(logical)
        want = source.locate(np.asarray(kept))
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    low, high = 50, 200
    assert sum(b - a for a, b in stream.skipped_between(low, high)) == len(removed & set(range(low, high)))


_TINY: list = []


def _tiny_source():
    """A 320-sample in-memory blend, made once."""
    if not _TINY:
        import tempfile

        from tokenloom.source import StoreBlendSource

        root = tempfile.mkdtemp(prefix="tokenloom-skips-")
        prefixes = write_corpus(root, 2, seed=9)
        _TINY.append(StoreBlendSource.from_prefixes(prefixes, [0.6, 0.4], num_samples=320, seq_length=8, seed=1))
    return _TINY[0]
