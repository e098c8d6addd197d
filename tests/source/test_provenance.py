"""Provenance without replay: ``where`` against the tokens each position serves, ``find`` against
brute force over every position of small builds (exact and stateless, blended and not), the two
inversions it rests on against their forward maps, and the ``where`` / ``find`` commands."""

from __future__ import annotations

import json
import os
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tokenloom
from tokenloom.cli import main as cli_main
from tokenloom.errors import ConfigError, PositionError
from tokenloom.index.blend import Blend
from tokenloom.index.stateless import build_stateless_gpt_index
from tokenloom.io import IndexedDatasetWriter


def _store(prefix: str, num_documents: int, seed: int, *, empty_every: int = 0) -> str:
    """A uint16 store; every ``empty_every``-th document (never the last) is empty."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 200, size=num_documents)
    if empty_every:
        lengths[empty_every - 1:-1:empty_every] = 0
    tokens = rng.integers(0, 1000, size=int(lengths.sum())).astype(np.uint16)
    with IndexedDatasetWriter(prefix, dtype=np.uint16) as writer:
        writer.add_documents(tokens, lengths)
        writer.finalize()
    return prefix


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("provenance")
    return [_store(str(root / "a"), 300, 1, empty_every=7), _store(str(root / "b"), 420, 2),
            _store(str(root / "c"), 150, 3, empty_every=11)]


def _config(stores, cache, mode: str, **changes) -> dict:
    """``mode``: exact, stateless, or best_fit (whole documents packed, blended in exact mode)."""
    config = {"blend": {"prefixes": list(stores), "weights": [5.0, 3.0, 2.0]}, "split": "90,8,2", "seq_length": 48,
              "train_samples": 1500, "valid_samples": 120, "test_samples": 40, "seed": 77,
              "mode": "exact" if mode == "best_fit" else mode, "cache_dir": str(cache), "rng_workers": 0}
    if mode == "best_fit":
        config["packing"] = "best_fit"
    config.update(changes)
    return config


@pytest.fixture(scope="module", params=["exact", "stateless", "best_fit"])
def built(request, stores, tmp_path_factory):
    cache = tmp_path_factory.mktemp(f"cache-{request.param}")
    blended = tokenloom.build(_config(stores, cache, request.param))
    single = tokenloom.build(_config(stores, cache, request.param, blend=None, split=None,
                                     blend_per_split=[{"prefixes": stores[1:2]}, None, None],
                                     valid_samples=None, test_samples=None))
    return request.param, blended, single


def _brute_force(source) -> dict[tuple[str, int], list[int]]:
    """(prefix, document) -> every position whose sample holds some of its tokens."""
    holding: dict[tuple[str, int], list[int]] = {}
    for origin in source.where(np.arange(source.num_samples)):
        for piece in origin.pieces:
            holding.setdefault((origin.prefix, piece.document), []).append(origin.position)
    return {key: sorted(set(v)) for key, v in holding.items()}


def _splits(built):
    _, blended, single = built
    return [blended.split(name) for name in blended.splits] + [single.split("train")]


def test_where_gives_the_pieces_each_position_serves(built):
    for source in _splits(built):
        origins = source.where(np.arange(source.num_samples))
        assert [o.position for o in origins] == list(range(source.num_samples))
        for origin in origins[:: max(1, source.num_samples // 300)]:
            reader = source.readers[origin.dataset]
            assert origin.prefix == reader.prefix
            tokens = np.concatenate([reader.store.get(p.document, offset=p.offset, length=p.length)
                                     for p in origin.pieces])
            served = source[origin.position]
            assert np.array_equal(tokens, served[:tokens.shape[0]])
            assert np.all(served[tokens.shape[0]:] == source.pad_id)  # a short last sample, or best fit, pads
            assert all(p.length > 0 for p in origin.pieces)


def test_find_equals_brute_force_for_every_document(built):
    mode, _, _ = built
    for source in _splits(built):
        truth = _brute_force(source)
        for reader in source.readers:
            for document in range(reader.store.num_sequences):
                got = source.find(reader.prefix, document)
                assert got.tolist() == truth.get((reader.prefix, document), []), (mode, source.name, document)


def test_find_names_what_it_cannot_answer(built):
    _, blended, _ = built
    source = blended.split("train")
    with pytest.raises(ConfigError, match="is not in the train split"):
        source.find("/no/such/store", 0)
    reader = source.readers[0]
    with pytest.raises(ConfigError, match=f"document {reader.store.num_sequences}; the store holds"):
        source.find(reader.prefix, reader.store.num_sequences)
    with pytest.raises(ConfigError, match="expected a document id"):
        source.find(reader.prefix, -1)
    with pytest.raises(PositionError):
        source.where([source.num_samples])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 20), min_size=1, max_size=8), st.integers(0, 5000), st.booleans(),
       st.integers(1, 300), st.integers(0, 2**40))
def test_blend_positions_of_inverts_lookup(weights, size, seeded, window, seed):
    if not any(weights):
        weights[0] = 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a positive weight may get no sample
        blend = Blend(weights, size, seed=seed if seeded else None, window=window if seeded else None)
    positions = np.arange(size, dtype=np.int64)
    dataset_ids, sample_ids = blend.lookup(positions)
    assert np.array_equal(blend.positions_of(dataset_ids, sample_ids), positions)


def test_blend_positions_of_refuses_samples_the_blend_does_not_take():
    blend = Blend([1.0, 3.0], 100)
    with pytest.raises(ConfigError, match="the blend takes 25 samples of it"):
        blend.positions_of(np.array([0]), np.array([25]))
    with pytest.raises(ConfigError, match="the blend has 2 datasets"):
        blend.positions_of(np.array([2]), np.array([0]))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=60), st.integers(2, 20), st.booleans(),
       st.integers(1, 400), st.sampled_from([1, 2, 4, 16]), st.integers(0, 2**40), st.booleans())
def test_stateless_samples_holding_inverts_spans(lengths, seq_length, extra, num_samples, block_size, seed, subset):
    lengths = np.asarray([*lengths, 5], dtype=np.int32)  # a last document with tokens
    ids = np.arange(0, lengths.shape[0], 2, dtype=np.int64) if subset else None
    tokens = int((lengths[ids] if ids is not None else lengths).sum())
    if tokens < seq_length + 1:
        return
    num_samples = min(num_samples, 3 * tokens // seq_length)  # up to about three epochs
    index = build_stateless_gpt_index(lengths, ids, num_samples=num_samples, seq_length=seq_length, seed=seed,
                                      add_extra_token=extra, block_size=block_size, backend="numpy")
    spans = index.spans(np.arange(index.num_samples))
    truth: dict[int, set[int]] = {}
    for k in range(index.num_samples):
        begin, end = spans.bounds[k], spans.bounds[k + 1]
        for document, length in zip(spans.document_ids[begin:end], spans.lengths[begin:end]):
            if length > 0:
                truth.setdefault(int(document), set()).add(k)
    for document in range(lengths.shape[0]):
        assert set(index.samples_holding(document).tolist()) == truth.get(document, set())


def test_the_where_and_find_commands(built, stores, capsys, tmp_path):
    mode, blended, _ = built
    config = tmp_path / "build.json"
    config.write_text(json.dumps(_config(stores, blended.cache.root, mode)))
    assert cli_main(["where", str(config), "--step", "2", "--global-batch-size", "4", "--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert [r["position"] for r in records] == [8, 9, 10, 11]
    assert set(records[0]) == {"position", "dataset", "prefix", "sample", "pieces"}
    assert set(records[0]["pieces"][0]) == {"document", "offset", "length"}
    source = blended.split("train")
    assert records == [o.to_dict() for o in source.where(np.arange(8, 12))]
    piece = records[0]["pieces"][0]
    assert cli_main(["find", str(config), "--store", records[0]["prefix"], "--document", str(piece["document"]),
                     "--global-batch-size", "4", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert 8 in found["positions"] and 2 in found["steps"]
    assert found["steps"] == sorted({p // 4 for p in found["positions"]})
    assert cli_main(["where", str(config), "--positions", "8:12", "--inter-document-masking", "--json"]) == 0
    with_boundaries = json.loads(capsys.readouterr().out)
    seq_length = source.seq_length
    for record in with_boundaries:  # every piece but the last ends a document; the last ends at S
        inner = np.cumsum([p["length"] for p in record["pieces"]])[:-1]
        ends = [0, *(int(e) for e in inner if e < seq_length), seq_length]
        assert record["cu_seqlens"] == ends and record["max_seqlen"] == max(np.diff(ends))
    assert cli_main(["where", str(config), "--positions", "3:5", "--inter-document-masking"]) == 0
    assert "cu_seqlens 0 " in capsys.readouterr().out
    assert cli_main(["where", str(config), "--positions", "3:5"]) == 0
    text = capsys.readouterr().out
    assert "position 3  dataset" in text and "position 4  dataset" in text and "document" in text
    assert cli_main(["where", str(config), "--positions", "3", "--text"]) == 2  # these stores record no tokenizer
    assert "--text needs a tokenizer" in capsys.readouterr().err
    assert cli_main(["where", str(config), "--positions", "5:2"]) == 2
    assert "expected 0 <= A < B" in capsys.readouterr().err


def test_where_shows_a_store_as_typed_from_here(built, stores, capsys, tmp_path, monkeypatch):
    """Text output names a store relative to the current directory when it lies below it (as the
    user would type it), else by its full path; ``--json`` always gives the full path."""
    mode, blended, _ = built
    config = tmp_path / "build.json"
    config.write_text(json.dumps(_config(stores, blended.cache.root, mode)))
    assert cli_main(["where", str(config), "--positions", "0", "--json"]) == 0
    prefix = json.loads(capsys.readouterr().out)[0]["prefix"]
    assert os.path.isabs(prefix)
    monkeypatch.chdir(os.path.dirname(prefix))
    assert cli_main(["where", str(config), "--positions", "0"]) == 0
    assert f"({os.path.basename(prefix)})" in capsys.readouterr().out
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert cli_main(["where", str(config), "--positions", "0"]) == 0
    assert f"({prefix})" in capsys.readouterr().out


def test_where_text_decodes_a_byte_store(tmp_path, capsys):
    from tokenloom.tokenization import TokenizeConfig, tokenize_to_store

    (tmp_path / "docs").mkdir()
    for k in range(40):
        (tmp_path / "docs" / f"{k:02d}.txt").write_text(f"document number {k}: " + "lorem ipsum " * (k + 3))
    prefix = tokenize_to_store([str(tmp_path / "docs")], str(tmp_path / "bytes"),
                               TokenizeConfig(tokenizer="bytes", workers=0)).prefix
    config = tmp_path / "build.json"
    config.write_text(json.dumps({"blend": [prefix], "split": "100,0,0", "seq_length": 32, "train_samples": 50,
                                  "seed": 3, "cache_dir": str(tmp_path / "cache")}))
    assert cli_main(["where", str(config), "--positions", "0:3", "--text", "--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    source = tokenloom.build(str(config)).split("train")
    for record in records:
        tokens = source[record["position"]]
        expected = "".join("<|eod|>" if t == 256 else chr(t) for t in tokens.tolist())  # ASCII text
        assert record["text"] == expected
    assert any("lorem ipsum" in r["text"] for r in records)
    assert os.path.isfile(prefix + ".idx")


def test_where_and_find_read_a_runs_state(built, stores, capsys, tmp_path):
    """With ``--state``, where and find read positions as the run served them: after a weight
    change and a quarantine, each record is the stream's sample with the weights in force there,
    and find lists the stream's positions holding the document (none of a quarantined one)."""
    from tokenloom.serve import BatchGeometry, RankLoader

    mode, blended, _ = built
    config = tmp_path / "build.json"
    config.write_text(json.dumps(_config(stores, blended.cache.root, mode)))
    source = blended.split("train")
    loader = RankLoader(source, BatchGeometry(global_batch_size=4, micro_batch_size=4, dp=1))
    for _ in range(3):
        loader.next_batch()
    loader.reweight([0.1, 0.2, 0.7][:len(source.datasets)])
    loader.next_batch()
    origin = loader.stream.where([20])[0]
    quarantined = (origin.prefix, origin.pieces[0].document)
    loader.quarantine([quarantined])
    stream = loader.stream
    state = tmp_path / "state.json"
    state.write_text(json.dumps(loader.state_dict()))
    assert cli_main(["where", str(config), "--positions", "0:40", "--state", str(state), "--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    datasets, samples = stream.locate(np.arange(40))
    assert [(r["dataset"], r["sample"]) for r in records] == list(zip(datasets.tolist(), samples.tolist()))
    assert records[0]["weights"] != records[-1]["weights"]  # the change at step 3
    assert all(np.allclose(r["weights"], stream.target_weights(r["position"])) for r in records)
    assert records != [o.to_dict() for o in source.where(np.arange(40))]  # not the build's order
    assert cli_main(["where", str(config), "--positions", "10:14", "--state", str(state)]) == 0
    assert "weights in force from position 10" in capsys.readouterr().out
    kept = records[30]["pieces"][0]
    assert cli_main(["find", str(config), "--store", records[30]["prefix"], "--document", str(kept["document"]),
                     "--state", str(state), "--json"]) == 0
    found = json.loads(capsys.readouterr().out)["positions"]
    assert 30 in found and found == stream.positions_holding(records[30]["prefix"], kept["document"]).tolist()
    for held in stream.where(np.asarray(found)):
        assert kept["document"] in [p.document for p in held.pieces if held.prefix == records[30]["prefix"]]
    assert cli_main(["find", str(config), "--store", quarantined[0], "--document", str(quarantined[1]),
                     "--state", str(state), "--json"]) == 0
    after = [p for p in json.loads(capsys.readouterr().out)["positions"] if p >= 16]
    assert after == []  # taken out of the stream from the quarantine on
    assert cli_main(["where", str(config), "--positions", "0:4", "--state", str(tmp_path / "missing.json")]) == 2
    assert "--state" in capsys.readouterr().err
