"""``packing: best_fit`` through a build: whole documents once per epoch, padding outside the loss,
document boundaries, blends in both modes, the cache, resume, and the refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest

import tokenloom
import tokenloom.builder as tb
from build_fixtures import blend_config, cache_files, make_stores
from tokenloom.cli import main as cli_main
from tokenloom.errors import ConfigError
from tokenloom.index import best_fit_index
from tokenloom.io import IndexedDataset, IndexedDatasetWriter
from tokenloom.serve import BatchGeometry, RankLoader, SampleOptions, Topology
from tokenloom.serve.samples import build_fields


def _single(prefix, cache, **changes) -> dict:
    config = {"blend": {"prefixes": [prefix]}, "split": "80,15,5", "seq_length": 63, "seed": 21,
              "cache_dir": str(cache), "packing": "best_fit", "timeout_s": 60.0}
    config.update(changes)
    return config


def _check_epoch(source, store: IndexedDataset, begin: int, end: int) -> None:
    """One epoch of ``source`` (read directly from one store) holds every token of documents
    ``[begin, end)`` exactly once, whole documents in one sample, then padding."""
    capacity = source.seq_length + int(source.add_extra_token)
    positions = np.arange(source.num_samples)
    rows = source.read_samples(*source.locate(positions))
    covered = {}
    for origin in source.where(positions):
        row = rows[origin.position]
        column = 0
        for piece in origin.pieces:
            assert np.array_equal(row[column:column + piece.length],
                                  store.get(piece.document, offset=piece.offset, length=piece.length))
            column += piece.length
            covered.setdefault(piece.document, []).append((piece.offset, piece.length))
        assert np.all(row[column:] == source.pad_id)
    assert set(covered) <= set(range(begin, end))
    for document in range(begin, end):
        length = int(store.sequence_lengths[document])
        pieces = sorted(covered.get(document, []))
        assert sum(n for _, n in pieces) == length and [o for o, _ in pieces] == \
            list(np.cumsum([0] + [n for _, n in pieces])[:-1])
        assert len(pieces) == (0 if length == 0 else max(1, -(-length // capacity)))


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    return make_stores(tmp_path_factory.mktemp("bf-stores"), count=3, base_documents=500)


def test_one_epoch_of_each_split_holds_every_document_once(stores, tmp_path, monkeypatch):
    # small chunks: each split is packed as several chunks, by several items
    monkeypatch.setattr(best_fit_index, "CHUNK_TARGET_DOCUMENTS", 100)
    result = tokenloom.build(_single(stores[0], tmp_path / "cache", best_fit_window=64))
    chunks = [item for item in result.plan.items if item.kind == "pack"]
    assert len(chunks) >= 6
    store = IndexedDataset(stores[0])
    from tokenloom.index.split import split_document_ranges

    ranges = split_document_ranges("80,15,5", store.num_sequences)
    for name, bounds in zip(("train", "valid", "test"), ranges):
        _check_epoch(result.split(name), store, bounds.begin, bounds.end)
    report = result.packing_report()
    assert set(report) == {"train", "valid", "test"}
    train = report["train"]
    assert train.documents == ranges[0].end - ranges[0].begin
    assert train.samples_per_epoch == result.split("train").num_samples
    lengths = np.asarray(store.sequence_lengths[ranges[0].begin:ranges[0].end])
    assert train.tokens == int(lengths.sum()) and train.cut_documents == int((lengths > 64).sum())
    assert 0 <= train.padding_fraction < 0.05
    assert tb.verify_cache(str(tmp_path / "cache")).ok


def test_more_samples_than_an_epoch_serve_whole_epochs_then_a_subset(stores, tmp_path):
    one = tokenloom.build(_single(stores[1], tmp_path / "cache")).split("train")
    per_epoch = one.num_samples
    many = tokenloom.build(_single(stores[1], tmp_path / "cache", train_samples=2 * per_epoch + 5)).split("train")
    assert many.num_samples == 2 * per_epoch + 5
    _, first = many.locate(np.arange(per_epoch))
    _, second = many.locate(np.arange(per_epoch, 2 * per_epoch))
    packed = many.readers[0].indices.packed_samples
    assert sorted(packed(first)) == sorted(packed(second)) == list(range(per_epoch))
    assert not np.array_equal(packed(first), packed(second))  # each epoch shuffled on its own


def test_padding_stays_out_of_the_loss_and_the_boundaries_are_the_documents(stores, tmp_path):
    source = tokenloom.build(_single(stores[2], tmp_path / "cache")).split("train")
    positions = np.arange(min(64, source.num_samples))
    dataset_ids, sample_ids = source.locate(positions)
    rows = source.read_samples(dataset_ids, sample_ids)
    pieces = source.read_pieces(dataset_ids, sample_ids)
    fields = build_fields(rows, eod_ids=None, pad_id=source.pad_id, add_extra_token=True,
                          options=SampleOptions(inter_document_masking=True), pieces=(pieces.ends, pieces.counts))
    seq = source.seq_length
    padded = rows[:, 1:] == source.pad_id  # labels that are padding
    assert padded.any()
    assert np.all(fields["loss_mask"][padded] == 0) and np.all(fields["loss_mask"][~padded] == 1)
    for k, origin in enumerate(source.where(positions)):
        ends = np.cumsum([p.length for p in origin.pieces])
        inner = [int(e) for e in ends[:-1] if e < seq]
        expected = [0, *inner, seq]
        assert fields["cu_seqlens"][k, :len(expected)].tolist() == expected
        assert np.all(fields["cu_seqlens"][k, len(expected):] == seq)


@pytest.mark.parametrize("mode", ["exact", "stateless"])
def test_blends_in_either_mode_serve_packed_datasets(stores, tmp_path, mode):
    config = blend_config(stores, tmp_path / "cache", packing="best_fit", mode=mode, megatron_tokenizer=None)
    result = tokenloom.build(config)
    for name, wanted in (("train", 3000), ("valid", 200), ("test", 60)):
        source = result.split(name)
        assert source.num_samples >= wanted
        dataset_ids, sample_ids = source.locate(np.arange(source.num_samples))
        for d, reader in enumerate(source.readers):
            mine = sample_ids[dataset_ids == d]
            assert mine.size and int(mine.max()) < reader.num_samples
        counts = np.bincount(dataset_ids, minlength=3) / source.num_samples
        assert np.allclose(counts, np.array([3.0, 5.0, 2.0]) / 10, atol=0.02)
    assert {item.kind for item in result.plan.items} == {"pack", "gpt", "blend"}
    assert all(item.megatron is None for item in result.plan.items)
    again = tokenloom.build(config)
    assert not again.built_keys and again.build_key == result.build_key
    # more samples asked for: the blend and the datasets change, the packed chunks do not
    more = tokenloom.build({**config, "train_samples": 4000})
    assert {item.kind for item in more.plan.items if item.key in more.built_keys} == {"gpt", "blend"}
    assert tb.verify_cache(str(tmp_path / "cache")).ok


def test_two_caches_hold_the_same_bytes_and_the_seed_changes_them(stores, tmp_path):
    config = blend_config(stores, tmp_path / "a", packing="best_fit", megatron_tokenizer=None)
    first = tokenloom.build(config)
    second = tokenloom.build({**config, "cache_dir": str(tmp_path / "b")})
    assert first.build_key == second.build_key
    assert cache_files(tmp_path / "a") == cache_files(tmp_path / "b")
    other = tokenloom.build({**config, "cache_dir": str(tmp_path / "b"), "seed": 99})
    assert other.build_key != first.build_key
    assert not np.array_equal(other.split("train")[0], first.split("train")[0])


def test_every_document_longer_than_a_sample_still_builds_and_says_its_padding(tmp_path, capsys):
    prefix = str(tmp_path / "long")
    lengths = np.array([100, 130, 64, 200, 97] * 20)  # none shorter than a 64-token sample
    with IndexedDatasetWriter(prefix, dtype=np.uint16) as writer:
        writer.add_documents(np.arange(int(lengths.sum())).astype(np.uint16) % 1000, lengths)
        writer.finalize()
    config = _single(prefix, tmp_path / "cache", split="100,0,0", seq_length=63)
    result = tokenloom.build(config)
    report = result.packing_report()["train"]
    assert report.cut_documents == int((lengths > 64).sum())
    # 8 full pieces per five documents, and remainders of 36, 2, 0, 8 and 33 tokens packed best fit
    assert report.samples_per_epoch >= 20 * 8 + -(-20 * (36 + 2 + 8 + 33) // 64)
    assert report.padding_fraction == pytest.approx(1 - lengths.sum() / (64 * report.samples_per_epoch))
    assert report.padding_fraction > 0.05
    _check_epoch(result.split("train"), IndexedDataset(prefix), 0, lengths.shape[0])
    path = tmp_path / "build.json"
    path.write_text(json.dumps(config))
    assert cli_main(["build", str(path), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert f"padding {100 * report.padding_fraction:.2f}%" in out
    assert f"{report.cut_documents:,} of {lengths.shape[0]:,} documents cut" in out


def test_a_dry_run_packs_to_count_but_writes_nothing(stores, tmp_path):
    plan = tokenloom.build(_single(stores[0], tmp_path / "cache"), dry_run=True)
    assert any(item.kind == "pack" for item in plan.items)
    assert not (tmp_path / "cache" / "packs").exists() or not list((tmp_path / "cache" / "packs").iterdir())
    result = tokenloom.build(_single(stores[0], tmp_path / "cache"))
    assert [s.num_samples for s in plan.splits] == [result.split(s.name).num_samples for s in plan.splits]


def test_resume_on_another_layout_serves_the_same_batches(stores, tmp_path):
    config = blend_config(stores, tmp_path / "cache", packing="best_fit", megatron_tokenizer=None)
    source = tokenloom.build(config).split("train")
    options = SampleOptions(inter_document_masking=True)

    def loaders(dp):
        geometry = BatchGeometry(global_batch_size=8, micro_batch_size=2, dp=dp)
        return [RankLoader(source, geometry, topology=Topology(dp=dp), rank=r, options=options) for r in range(dp)]

    def steps(group, count):
        """Each step's fields in stream order (micro-batch by micro-batch, data-parallel ranks in order)."""
        out = []
        for _ in range(count):
            batches = [[loader.next_batch() for loader in group] for _ in range(group[0].sampler.num_micro_batches)]
            out.append({k: np.concatenate([b[k] for micro in batches for b in micro])
                        for k in ("tokens", "labels", "loss_mask", "cu_seqlens")})
        return out

    reference = steps(loaders(1), 6)
    first = loaders(2)
    assert all(np.array_equal(a[k], b[k]) for a, b in zip(steps(first, 3), reference) for k in a)
    state = json.loads(json.dumps(first[0].state_dict()))
    resumed = loaders(4)
    for loader in resumed:
        loader.load_state_dict(state)
    for want, have in zip(reference[3:], steps(resumed, 3)):
        for k in want:
            np.testing.assert_array_equal(want[k], have[k], err_msg=k)


def test_configs_that_cannot_mean_anything_are_refused(stores, tmp_path):
    base = _single(stores[0], tmp_path / "cache")
    with pytest.raises(ConfigError, match="megatron-core has no best-fit index"):
        tokenloom.build({**base, "megatron_cache_dir": str(tmp_path / "m")})
    with pytest.raises(ConfigError, match="expected at least 64"):
        tokenloom.build({**base, "best_fit_window": 63})
    with pytest.raises(ConfigError, match="only applies to packing: best_fit"):
        tokenloom.build({**base, "packing": "concat", "best_fit_window": 1000})
    with pytest.raises(ConfigError, match="packing='nope'; expected one of"):
        tokenloom.build({**base, "packing": "nope"})
    with pytest.raises(ConfigError, match="no partial sample"):
        tokenloom.build({**base, "drop_last_partial_validation_sequence": False})
    with pytest.raises(ConfigError, match="epoch budgets with packing='best_fit'"):
        tokenloom.build({**base, "blend": {"prefixes": [stores[0]], "epochs": [1.5]}})
