"""A schedule that changes the sequence length (issue 40, FORMAT.md "Length runs"): the build reads
each store whose sequence length changes as its length runs, each an index of its own cut from
the store's one token stream from the token the run before stopped at; a store of one length is
indexed as without a schedule. Held here against the plan and the store's own documents: the
columns and their keys, the counts per phase, every token an input once per epoch round (none
twice, none skipped), where/find, the dry run, two gloo ranks, and the refusals."""

from __future__ import annotations

import math
import os
from collections import Counter

import numpy as np
import pytest

import tokenloom
from build_fixtures import make_stores, two_rank_build
from tokenloom.builder.cache import Cache
from tokenloom.builder.config import build_config_from_dict
from tokenloom.builder.exact import build_schedule_arrays
from tokenloom.builder.schedule import run_counts
from tokenloom.errors import ConfigError
from tokenloom.index.schedule_exact import exact_phase_blends
from tokenloom.index.split import split_document_ranges
from tokenloom.io import IndexedDataset

SEQ, LONG = 64, 256
#: store0 changes length twice (three runs, crossing an epoch of its train documents); store1 keeps
#: SEQ in phases 1 and 3 (one run across phase 2, where it has no samples); store2 is only in the
#: long phase (one run, at LONG).
PHASES = [
    {"blend": ["0.6", "store0", "0.4", "store1"], "until": {"samples": 640}},
    {"blend": ["1", "store0", "1", "store2"], "until": {"samples": 960}, "seq_length": LONG},
    {"blend": ["1", "store0", "1", "store1"], "until": {"steps": 80}},
]


def _config(stores, cache_dir, phases=PHASES, **changes) -> dict:
    phases = [{**p, "blend": [os.path.join(stores, v) if v.startswith("store") else v for v in p["blend"]]}
              for p in phases]
    config = {"phases": phases, "split": "90,8,2", "seq_length": SEQ, "global_batch_size": 16,
              "valid_samples": 40, "test_samples": 20, "seed": 7, "mode": "stateless",
              "cache_dir": str(cache_dir), "rng_workers": 0, "timeout_s": 60.0}
    config.update(changes)
    return config


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("length-runs")
    make_stores(root / "stores", count=3)
    return root


@pytest.fixture(scope="module", params=["stateless", "exact"])
def built(stores, request):
    root = stores / request.param
    values = _config(str(stores / "stores"), root / "cache", mode=request.param)
    return root, values, build_config_from_dict(values), tokenloom.build(values)


def _runs(config) -> np.ndarray:
    """``(P, D)``: what each phase takes of each store as its runs hold them (the plan's counts;
    exact mode: megatron's targets of each phase's greedy)."""
    return run_counts(config.schedule_plan(), config.mode)


def _sizes(config, runs: list[int]) -> list[int]:
    """The samples of a store's runs' indices: as planned; exact mode, the last with megatron's buffer."""
    if config.mode == "stateless":
        return runs
    return [*runs[:-1], math.ceil(runs[-1] * (1 + config.mid_level_dataset_surplus))]


def _names(split) -> list[str]:
    return [os.path.basename(reader.name) for reader in split.readers]


def test_each_store_whose_length_changes_is_read_as_its_runs(built):
    _, _, config, result = built
    plan, train = config.schedule_plan(), result.split("train")
    assert plan.seq_lengths == (SEQ, LONG, SEQ) and plan.boundaries == (0, 640, 960, 1280)
    assert _names(train) == ["store0", "store0", "store0", "store1", "store2"]
    assert train.seq_lengths.tolist() == [SEQ, LONG, SEQ, SEQ, LONG]
    items = [result.plan.item(key) for key in result.plan.splits[0].dataset_keys]
    n0 = [int(_runs(config)[k, 0]) for k in range(3)]  # store0's samples in each phase, each phase one run
    assert [item.num_samples for item in items[:3]] == _sizes(config, n0)
    # run r of store0 starts at the stream token its earlier runs' samples end at
    assert [item.params["first_token"] for item in items[:3]] == [0, n0[0] * SEQ, n0[0] * SEQ + n0[1] * LONG]
    assert [item.params["seq_length"] for item in items] == [SEQ, LONG, SEQ, SEQ, LONG]
    # a store of one length is indexed as without a schedule: no first_token in its key
    assert "first_token" not in items[3].params and "first_token" not in items[4].params
    assert items[3].num_samples >= int(plan.totals[1])
    if config.mode == "exact":  # one stream for store0's runs: the epochs they reach in all
        reach = n0[0] * SEQ + n0[1] * LONG + items[2].num_samples * SEQ + 1
        assert {item.params["stream_epochs"] for item in items[:3]} == {items[2].epoch_plan.num_epochs}
        assert items[2].epoch_plan.num_epochs == -(-reach // items[2].epoch_plan.num_tokens_per_epoch)
    columns = result.plan.item(result.plan.splits[0].blend_key).params["schedule"]["columns"]
    assert [c[:3] for c in columns] == [[0, SEQ, 0], [0, LONG, n0[0] * SEQ], [0, SEQ, n0[0] * SEQ + n0[1] * LONG],
                                        [1, SEQ, None], [2, LONG, None]]
    # the valid and test splits blend the stores at the build's sequence length
    assert result.split("valid").seq_lengths.tolist() == [SEQ] * len(result.split("valid").readers)


def test_each_phase_serves_the_rules_counts_from_its_own_runs(built):
    """Per phase, each store's samples are the plan's counts (stateless) or megatron-core's
    greedy's over the phase (exact), all from the run of the phase's length; each run serves its
    own samples once each, numbered from 0 (store0's first two runs every sample they hold)."""
    _, _, config, result = built
    plan, train = config.schedule_plan(), result.split("train")
    datasets, samples = train.locate(np.arange(len(train)))
    counts = plan.counts if config.mode == "stateless" else exact_phase_blends(plan).counts
    store_of = [0, 0, 0, 1, 2]  # the union's id of each column
    for k in range(plan.num_phases):
        window = datasets[plan.boundaries[k]:plan.boundaries[k + 1]]
        assert set(train.seq_lengths[window].tolist()) == {plan.seq_lengths[k]}, f"phase {k + 1}"
        assert {store_of[c] for c in window.tolist()} == set(np.flatnonzero(counts[k]).tolist())
        if k + 1 < plan.num_phases or config.mode == "stateless":  # exact's last phase is megatron-sized
            per_store = np.zeros(plan.num_datasets, dtype=np.int64)
            np.add.at(per_store, np.asarray(store_of)[window], 1)
            assert per_store.tolist() == counts[k].tolist(), f"phase {k + 1}"
    for column in range(len(train.readers)):  # every run serves its samples once each
        mine = samples[datasets == column]
        assert sorted(mine.tolist()) == list(range(mine.size)) and mine.size <= train.readers[column].num_samples
        if column < 2 or (config.mode == "stateless" and column < 3):
            assert mine.size == train.readers[column].num_samples


def _inputs(origin, width: int) -> list[tuple[int, int]]:
    """The ``(document, offset)`` of each input token of a sample (its first ``width``)."""
    out = []
    for piece in origin.pieces:
        out += [(piece.document, piece.offset + i) for i in range(piece.length)]
    return out[:width]


def test_a_store_reads_on_from_the_token_its_last_run_stopped_at(built):
    """store0 takes 1.3 epochs of its train documents over three runs of two lengths: every token
    of an epoch is an input once before any is an input again (none twice, none skipped), so
    each token is an input ``m`` or ``m + 1`` times and they add up to the runs' tokens. Exact
    mode's stream is megatron-core's document index over both epochs shuffled together: there
    the runs' samples, every one, read the stream's tokens from the first on, each once."""
    _, _, config, result = built
    plan, train = config.schedule_plan(), result.split("train")
    store = train.readers[0].store
    begin, end = split_document_ranges("90,8,2", store.num_sequences)[0]
    lengths = np.asarray(store.sequence_lengths[begin:end])
    epoch = int(lengths.sum())
    if config.mode == "exact":
        seen, taken = [], 0
        for reader in train.readers[:3]:
            spans = reader.spans(np.argsort(reader.indices.shuffle_index))  # every sample, in stream order
            width = reader.indices.plan.seq_length
            for k in range(reader.num_samples):
                lo, hi = spans.bounds[k], spans.bounds[k + 1]
                tokens = [(int(d), int(o) + i) for d, o, n in zip(spans.document_ids[lo:hi], spans.offsets[lo:hi],
                                                                  spans.lengths[lo:hi]) for i in range(int(n))]
                seen += tokens[:width]
            taken += reader.num_samples * width
        epochs = result.plan.item(result.plan.splits[0].dataset_keys[0]).params["stream_epochs"]
        stream = np.tile(np.arange(begin, end, dtype=np.int32), epochs)
        np.random.RandomState(config.seed).shuffle(stream)  # megatron-core's document index
        assert seen == [(int(d), o) for d in stream for o in range(int(store.sequence_lengths[d]))][:taken]
        assert epoch < taken < 2 * epoch == epochs * epoch
        return
    origins = [o for o in train.where(np.arange(len(train))) if o.dataset < 3]
    seen = Counter()
    for origin in origins:
        seen.update(_inputs(origin, int(train.seq_lengths[origin.dataset])))
    taken = sum(int(plan.counts[k, 0]) * plan.seq_lengths[k] for k in range(3))
    assert sum(seen.values()) == taken
    assert epoch < taken < 2 * epoch  # the runs cross an epoch
    every = {(begin + d, t) for d in range(end - begin) for t in range(int(lengths[d]))}
    assert set(seen) == every  # no token skipped
    assert set(seen.values()) == {1, 2} and sum(v == 2 for v in seen.values()) == taken - epoch
    # the second round starts at the start of documents (of the second epoch's order) and runs on
    # from there: every document read twice is read twice from its first token up to some point
    twice = Counter(d for (d, _), v in seen.items() if v == 2)
    partly = [d for d, n in twice.items() if n != lengths[d - begin]]
    assert len(partly) <= 1 and all(seen[(d, 0)] == 2 for d in partly)


class _Lengths:
    """The only part of a low-level dataset megatron-core reads to build its indices."""

    def __init__(self, lengths):
        self.sequence_lengths = lengths


def test_a_store_of_one_run_is_megatron_cores_own_dataset(built):
    """Exact mode: store1 (one run at SEQ) and store2 (one run at LONG) have megatron-core's own
    GPTDataset arrays for their train documents, sample count and sequence length."""
    _, _, config, result = built
    if config.mode != "exact":
        pytest.skip("megatron-core builds exact mode's arrays only")
    pytest.importorskip("megatron.core")
    from megatron.core.datasets import gpt_dataset
    from megatron.core.datasets.utils import Split
    from megatron.core.tokenizers import MegatronTokenizer

    train = result.split("train")
    for reader, key in list(zip(train.readers, result.plan.splits[0].dataset_keys))[3:]:
        params = result.plan.item(key).params
        assert "first_token" not in params and "stream_epochs" not in params
        mcfg = gpt_dataset.GPTDatasetConfig(
            random_seed=config.seed, sequence_length=params["seq_length"],
            tokenizer=MegatronTokenizer.from_pretrained(metadata_path={"library": "null-text"}, vocab_size=512),
            reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False)
        ids = np.arange(params["begin"], params["end"], dtype=np.int32)
        theirs = gpt_dataset.GPTDataset(_Lengths(np.asarray(reader.store.sequence_lengths)), None, ids,
                                        params["num_samples"], Split.train, mcfg)
        for name in ("document_index", "sample_index", "shuffle_index"):
            ours, expected = np.asarray(getattr(reader.indices, name)), getattr(theirs, name)
            assert ours.dtype == expected.dtype, name
            np.testing.assert_array_equal(ours, expected, err_msg=f"{reader.name} {name}")


def test_where_and_find_round_trip_across_runs(built):
    result = built[3]
    train = result.split("train")
    positions = np.array([3, 639, 640, 700, 959, 960, 1279])
    for origin in train.where(positions):
        assert origin.position in train.find(origin.prefix, origin.pieces[0].document)
        assert sum(p.length for p in origin.pieces) == train.seq_lengths[origin.dataset] + 1


def test_where_gives_the_pieces_a_sample_is_read_from_in_every_run(built):
    """In both modes, the pieces ``where`` names, read from the store, are the served sample's
    tokens, at its run's width, through every run of every store."""
    result = built[3]
    train = result.split("train")
    positions = np.arange(0, len(train), 7)
    dataset_ids, sample_ids = train.locate(positions)
    stores: dict = {}
    for k, origin in enumerate(train.where(positions)):
        row = train.read_samples(dataset_ids[k:k + 1], sample_ids[k:k + 1])[0]  # one width per read
        store = stores.setdefault(origin.prefix, IndexedDataset(origin.prefix))
        tokens = np.concatenate([store.get(p.document, p.offset, p.length) for p in origin.pieces])
        width = int(train.seq_lengths[origin.dataset]) + 1
        np.testing.assert_array_equal(tokens[:width], row[:width], err_msg=f"position {origin.position}")


def test_the_dry_run_says_where_each_run_starts(built):
    _, _, config, _ = built
    text = config.describe_schedule()
    assert "length runs" in text and "seq_length 256" in text
    assert text.count("store0: phases") == 3 and "store1: phases" not in text


def test_the_audit_counts_each_runs_tokens_and_summarises_stores(built, tmp_path):
    from tokenloom.serve import BatchGeometry, MixtureAudit, RankLoader, read_audit_log, summarize_audit

    _, _, config, result = built
    plan, train = config.schedule_plan(), result.split("train")
    path = tmp_path / "audit.jsonl"
    loader = RankLoader(train, BatchGeometry(global_batch_size=16, micro_batch_size=8, dp=2), rank=0,
                        audit=MixtureAudit(path))
    widths = {tuple(batch["tokens"].shape) for batch in loader}
    assert widths == {(8, SEQ), (8, LONG)}
    log = read_audit_log(path)
    assert log.header["seq_lengths"] == [SEQ, LONG, SEQ, SEQ, LONG]
    last = log.records[-1]
    counts = plan.counts if config.mode == "stateless" else exact_phase_blends(plan).counts
    tokens = [sum(int(counts[k, d]) * plan.seq_lengths[k] for k in range(3)) for d in range(3)]
    by_store = {row["dataset"]: row for row in summarize_audit(log)}
    assert [by_store[p]["tokens"] for p in config.schedule_stores.prefixes] == tokens
    assert sum(last["cumulative_tokens"]) == sum(tokens)
    assert max(abs(d) for r in log.records for d in r["drift"]) < 0.05


def test_a_rebuild_takes_everything_from_the_cache(built):
    _, values, _, result = built
    again = tokenloom.build(values)
    assert again.build_key == result.build_key and not again.built_keys


@pytest.mark.timeout(300)
def test_two_gloo_ranks_build_the_bytes_one_process_builds(built, tmp_path):
    """Exact mode: the cache of two ranks holds what the one-process greedy over every phase makes
    (``build_schedule_arrays``), each run's samples numbered from 0."""
    root, values, config, result = built
    two_rank_build(values, tmp_path, build_key=result.build_key, cache_dir=root / "cache")
    if config.mode == "exact":
        key = result.plan.splits[0].blend_key
        cache = Cache(str(tmp_path / "two"))
        for name, array in build_schedule_arrays(result.plan.item(key).params).items():
            assert np.array_equal(cache.open_array(key, name), array), name


def test_any_ranges_of_the_blend_settle_into_the_one_process_arrays(built, tmp_path):
    """Exact mode: the schedule's blend divided into ranges anywhere (inside a phase, across a
    change of length, empty), settled and made final as a divided build does (each run's ids and
    numbering from the column tables), is the one-process greedy's arrays."""
    from test_build_schedule_exact import _divided_in_one_process
    from tokenloom.builder.exact import schedule_greedy

    _, _, config, result = built
    if config.mode != "exact":
        pytest.skip("a stateless schedule has no blend arrays to divide")
    params = result.plan.item(result.plan.splits[0].blend_key).params
    expected, greedy = build_schedule_arrays(params), schedule_greedy(params)
    size = greedy.size
    for bounds, block in [([0, 700, size], 64), ([0, 640, 960, size], 100), ([0, 0, 1000, size, size], 7),
                          ([0, 333, 901, 1111, size], 50)]:
        dataset_index, sample_index, _ = _divided_in_one_process(greedy, bounds, block, tmp_path / "pack.bin")
        assert np.array_equal(dataset_index, expected["dataset_index"]), bounds
        assert np.array_equal(sample_index, expected["dataset_sample_index"]), bounds


@pytest.mark.parametrize("changes, key", [
    ({"packing": "best_fit"}, "packing: best_fit"),
    ({"headroom": 0.1}, "headroom"),
])
def test_what_length_runs_do_not_build_yet_is_refused_naming_the_phase(tmp_path, changes, key):
    config = _config(str(tmp_path / "stores"), tmp_path / "cache", **changes)
    with pytest.raises(ConfigError, match=f"phase 2: seq_length: {LONG} .*{key}"):
        build_config_from_dict(config)


def test_max_epochs_caps_the_tokens_a_stores_runs_read(built, tmp_path):
    """store0's runs read 1.34 epochs of its train documents (tokens, at two lengths): a cap above
    builds; one below is refused naming the store and the phase where its tokens pass the cap."""
    _, values, config, result = built
    plan = config.schedule_plan()
    store = result.split("train").readers[0].store
    begin, end = split_document_ranges("90,8,2", store.num_sequences)[0]
    epoch = int(np.asarray(store.sequence_lengths[begin:end]).sum()) - 1  # input tokens: less the extra one
    read = np.cumsum([int(plan.counts[k, 0]) * plan.seq_lengths[k] for k in range(3)])
    capped = tokenloom.build({**values, "max_epochs": {values["phases"][0]["blend"][1]: 1.5}})
    assert capped.split("train").seq_lengths.tolist() == [SEQ, LONG, SEQ, SEQ, LONG]
    cap = (read[1] + 1) / epoch  # phase 2 fits, phase 3 does not
    with pytest.raises(ConfigError, match=rf"store0'.* reads {read[2]:,} tokens .* end of phase 3 .* more than the "
                                          rf"{int(cap * epoch):,} its max_epochs allows"):
        tokenloom.build({**values, "max_epochs": cap, "cache_dir": str(tmp_path / "cache")})


def test_the_where_command_gives_boundaries_at_each_samples_width(built, tmp_path, capsys):
    import json

    from tokenloom.cli import main as cli_main

    _, values, _, _ = built
    config = tmp_path / "build.json"
    config.write_text(json.dumps(values))
    assert cli_main(["where", str(config), "--positions", "636:644", "--inter-document-masking", "--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert [r["cu_seqlens"][-1] for r in records] == [SEQ] * 4 + [LONG] * 4  # phase 2 starts at 640


@pytest.mark.parametrize("mode", ["stateless", "exact"])
def test_phases_all_at_another_length_than_the_builds_serve_at_theirs(stores, tmp_path, mode):
    """Every phase at LONG with the build's seq_length SEQ: no store changes length, but the train
    split is indexed at LONG (the valid and test splits at SEQ); in exact mode each store's item
    is the one a schedule at LONG throughout makes (same key: megatron-core's own arrays)."""
    phases = [{**p, "seq_length": LONG} for p in PHASES]
    values = _config(str(stores / "stores"), tmp_path / "cache", phases=phases, mode=mode)
    result = tokenloom.build(values)
    if mode == "exact":
        at_long = tokenloom.build({**values, "seq_length": LONG, "cache_dir": str(tmp_path / "at-long"),
                                   "phases": [{k: v for k, v in p.items() if k != "seq_length"}
                                              for p in values["phases"]]})
        assert result.plan.splits[0].dataset_keys == at_long.plan.splits[0].dataset_keys
    train = result.split("train")
    assert train.seq_lengths.tolist() == [LONG] * len(train.readers)
    assert {result.plan.item(k).params["seq_length"] for k in result.plan.splits[0].dataset_keys} == {LONG}
    assert train.read_samples(*train.locate(np.arange(4))).shape == (4, LONG + 1)
    assert result.split("valid").seq_lengths.tolist() == [SEQ] * len(result.split("valid").readers)
    assert "length runs: none" in build_config_from_dict(values).describe_schedule()
