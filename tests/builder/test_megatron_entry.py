"""tokenloom.megatron: the dataset provider of Megatron-LM's pretrain_gpt.py with the indices
built by tokenloom on every rank and megatron-core loading its own datasets from them, building
nothing itself."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import numpy as np
import pytest

pytest.importorskip("megatron.core")
from build_fixtures import blend_config, free_port, make_stores
from megatron_fixtures import gpt_dataset_config, megatron_datasets, refusing_megatron_builders
from tokenloom.errors import BuildError, ConfigError
from tokenloom.io import IndexedDataset, IndexedDatasetWriter
from tokenloom.megatron import build_megatron_datasets, megatron_build_configs

HERE = os.path.dirname(os.path.abspath(__file__))
POSITIONS = [0, 1, 5, 64, 199, 1000, 2999]


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    return make_stores(tmp_path_factory.mktemp("megatron_entry_stores"))


def _sizes(config: dict) -> list:
    return [config["train_samples"], config["valid_samples"], config["test_samples"]]


def _same_dataset(a, b) -> None:
    assert type(a) is type(b) and len(a) == len(b)
    assert a.unique_description_hash == b.unique_description_hash
    for i in sorted({0, 1, len(a) // 3, len(a) - 1}):
        ours, theirs = a[i], b[i]
        assert ours.keys() == theirs.keys()
        for field in theirs:
            np.testing.assert_array_equal(ours[field], theirs[field], err_msg=f"{field} of sample {i}")


def _same(ours, theirs) -> None:
    """Field for field the same datasets (a list where megatron-core returns several validation sets)."""
    assert len(ours) == len(theirs) == 3
    for a, b in zip(ours, theirs):
        assert (a is None) == (b is None)
        if a is None:
            continue
        assert isinstance(a, list) == isinstance(b, list)
        for member_a, member_b in zip(*((a, b) if isinstance(a, list) else ([a], [b])), strict=True):
            _same_dataset(member_a, member_b)


def _hashes(datasets) -> list:
    return [None if d is None else [m.unique_description_hash for m in d] if isinstance(d, list)
            else d.unique_description_hash for d in datasets]


@pytest.mark.parametrize("per_split", [False, True])
def test_the_datasets_are_megatron_cores_own_and_it_builds_none(stores, tmp_path, per_split):
    config = blend_config(stores, tmp_path / "unused")
    if per_split:
        blend = config.pop("blend")
        config.pop("split")
        config["blend_per_split"] = [blend, {"prefixes": stores[:1], "weights": None}, None]
        config["test_samples"] = None
    reference = megatron_datasets(config, tmp_path / "megatron")  # megatron-core builds them itself
    megatron_config = gpt_dataset_config(config, tmp_path / "ours")
    with refusing_megatron_builders():
        ours = build_megatron_datasets(megatron_config, _sizes(config))
    _same(ours, reference)
    assert os.path.isfile(os.path.join(tmp_path, "ours", "tokenloom", "stores.json"))  # tokenloom's cache inside
    with refusing_megatron_builders():  # a restart: the cache answers, megatron-core loads
        again = build_megatron_datasets(megatron_config, _sizes(config))
    _same(again, reference)


def test_two_ranks_divide_the_build_and_each_loads_the_same_datasets(stores, tmp_path):
    config = blend_config(stores, tmp_path / "unused")
    case = {"config": config, "path_to_cache": str(tmp_path / "ours"), "cache_dir": str(tmp_path / "tl"),
            "sizes": _sizes(config), "positions": POSITIONS}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([HERE, *sys.path])}
    port = free_port()
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "megatron_entry_worker.py"), str(rank), "2",
                               str(port), json.dumps(case), str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for rank in range(2)]
    deadline = time.monotonic() + 180
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0].decode(errors="replace"))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, result in enumerate(results):
        assert "crashed" not in result, f"rank {rank}:\n{result['crashed']}\n{logs[rank][-3000:]}"
    assert results[0]["splits"] == results[1]["splits"]
    reference = megatron_datasets(config, tmp_path / "megatron")
    for got, want in zip(results[0]["splits"], reference):
        assert got["length"] == len(want) and got["md5"] == want.unique_description_hash
        for position, tokens in got["tokens"].items():
            assert tokens == [int(t) for t in want[int(position)]["tokens"]]
    manifest = json.loads(next((tmp_path / "tl" / "builds").iterdir()).read_text())
    assert {entry["built_by_rank"] for entry in manifest["items"]} == {0, 1}  # both ranks built a share


def test_the_build_config_speaks_for_megatron_cores(stores, tmp_path):
    config = blend_config(stores, tmp_path / "unused", seed=77, seq_length=33, add_extra_token=False)
    [built] = megatron_build_configs(gpt_dataset_config(config, tmp_path / "m"), [10, None, 3], blend_threads=1)
    assert built["blend"] == {"prefixes": list(stores), "weights": config["blend"]["weights"]}
    assert (built["seed"], built["seq_length"], built["split"], built["add_extra_token"]) == (77, 33, "90,8,2", False)
    assert (built["train_samples"], built["valid_samples"], built["test_samples"]) == (10, None, 3)
    assert built["megatron_cache_dir"] == str(tmp_path / "m") and built["blend_threads"] == 1
    assert built["cache_dir"] == os.path.join(str(tmp_path / "m"), "tokenloom") and built["mode"] == "exact"


def test_what_it_cannot_build_is_refused_by_name(stores, tmp_path):
    config = blend_config(stores, tmp_path / "unused")
    megatron_config = gpt_dataset_config(config, tmp_path / "m")
    megatron_config.path_to_cache = None
    with pytest.raises(ConfigError, match=r"path_to_cache is not set.*--data-cache-path"):
        megatron_build_configs(megatron_config, _sizes(config))
    with pytest.raises(ConfigError, match=r"mock=True .*nothing for tokenloom to build"):
        megatron_build_configs(gpt_dataset_config({"seq_length": 64}, tmp_path / "m"), _sizes(config))
    megatron_config = gpt_dataset_config(config, tmp_path / "m")
    megatron_config.blend = (["s3://bucket/web"], None)
    with pytest.raises(ConfigError, match="s3://bucket/web"):
        megatron_build_configs(megatron_config, _sizes(config))
    with pytest.raises(ConfigError, match="expected three counts"):
        megatron_build_configs(gpt_dataset_config(config, tmp_path / "m"), [1, 2])


def test_an_index_megatron_core_describes_otherwise_is_a_build_error(stores, tmp_path, monkeypatch):
    # a megatron-core whose descriptions hold one more setting: tokenloom's files do not match,
    # megatron-core builds the index itself, and the call says so instead of returning quietly
    from megatron.core.datasets.gpt_dataset import GPTDataset

    keys = GPTDataset._key_config_attributes
    monkeypatch.setattr(GPTDataset, "_key_config_attributes", staticmethod(lambda: [*keys(), "eod_mask_loss"]))
    config = blend_config(stores, tmp_path / "unused", train_samples=300, valid_samples=30, test_samples=10)
    with pytest.raises(BuildError, match=r"(?s)GPTDataset train index .* built it itself.*eod_mask_loss"):
        build_megatron_datasets(gpt_dataset_config(config, tmp_path / "m"), _sizes(config))


# -- sequences_per_dataset (--per-dataset-sequences-path) ------------------------------------------


def _header_counts(prefixes) -> dict:
    """What Megatron-LM's tools/build_sequences_per_dataset.py writes: prefix -> [sequences,
    document indices] of its .idx header (lists, as json.load returns them)."""
    out = {}
    for prefix in prefixes:
        store = IndexedDataset(prefix)
        out[prefix] = [store.header.num_sequences, store.header.num_document_indices]
    return out


def test_sequences_per_dataset_serves_megatron_cores_own_datasets_and_names_them_alike(stores, tmp_path):
    config = blend_config(stores, tmp_path / "unused", train_samples=600, valid_samples=60, test_samples=20)
    counts = _header_counts(stores)
    reference = megatron_datasets(config, tmp_path / "megatron", sequences_per_dataset=counts)
    # the counts are not in megatron-core's description: the same cache files without them
    with refusing_megatron_builders():
        assert _hashes(megatron_datasets(config, tmp_path / "megatron")) == _hashes(reference)
    megatron_config = gpt_dataset_config(config, tmp_path / "ours", sequences_per_dataset=counts)
    with refusing_megatron_builders():
        ours = build_megatron_datasets(megatron_config, _sizes(config))
    _same(ours, reference)
    store = ours[0].datasets[0].dataset  # megatron-core's IndexedDataset, opened with the given counts
    assert store.sequences_per_dataset == counts[stores[0]] and store.path_prefix == stores[0]


def test_sequences_per_dataset_that_disagrees_with_a_store_is_refused_before_building(stores, tmp_path):
    config = blend_config(stores, tmp_path / "unused")
    real = _header_counts(stores)
    cases = [
        ({**real, stores[1]: [real[stores[1]][0] - 1, real[stores[1]][1]]}, "sequence count"),
        ({**real, stores[2]: [real[stores[2]][0], real[stores[2]][1] + 1]}, "document index count"),
    ]
    for counts, what in cases:
        prefix = stores[1] if what == "sequence count" else stores[2]
        given = tuple(counts[prefix])
        with pytest.raises(ConfigError, match=rf"(?s)\[{prefix!r}\]=\({given[0]}, {given[1]}\) but .*holds "
                                              rf"{real[prefix][0]} sequences and {real[prefix][1]} document"):
            build_megatron_datasets(gpt_dataset_config(config, tmp_path / "m", sequences_per_dataset=counts),
                                    _sizes(config))
    missing = {p: real[p] for p in stores[:2]}
    with pytest.raises(ConfigError, match=rf"no entry for \[{stores[2]!r}\] \(1 of the blend's 3"):
        build_megatron_datasets(gpt_dataset_config(config, tmp_path / "m", sequences_per_dataset=missing),
                                _sizes(config))
    malformed = {**real, stores[0]: [real[stores[0]][0]]}
    with pytest.raises(ConfigError, match=r"expected \(sequence count, document index count\)"):
        build_megatron_datasets(gpt_dataset_config(config, tmp_path / "m", sequences_per_dataset=malformed),
                                _sizes(config))
    assert not os.path.exists(tmp_path / "m")  # refused before tokenloom built anything


def test_sequences_per_dataset_over_a_store_of_another_token_type_is_refused(tmp_path):
    # megatron-core takes the token type from the tokenizer's vocabulary when it has the counts:
    # an int32 store under a 1000-token vocabulary (uint16) is read as noise, without an error
    prefix = str(tmp_path / "wide")
    lengths = np.arange(1, 81) % 37 + 1
    with IndexedDatasetWriter(prefix, dtype=np.int32) as writer:
        writer.add_documents(np.arange(int(lengths.sum()), dtype=np.int32) % 1000, lengths)
        writer.finalize()
    config = {"blend": {"prefixes": [prefix], "weights": None}, "split": "100,0,0", "seq_length": 16,
              "train_samples": 20, "valid_samples": None, "test_samples": None}
    counts = _header_counts([prefix])
    honest = megatron_datasets(config, tmp_path / "plain")
    misread = megatron_datasets(config, tmp_path / "counts", sequences_per_dataset=counts)
    assert not np.array_equal(misread[0][0]["tokens"], honest[0][0]["tokens"])
    with pytest.raises(ConfigError, match=rf"{prefix}\.idx stores int32 tokens.* reads them as uint16.*vocab_size"):
        build_megatron_datasets(gpt_dataset_config(config, tmp_path / "m", sequences_per_dataset=counts),
                                [20, None, None])


# -- mock data (--mock-data) ---------------------------------------------------------------------


def test_mock_data_is_megatron_cores_own_with_no_cache_and_one_log_line(caplog):
    from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset

    class MyMock(MockGPTDataset):
        pass

    config = {"seq_length": 64, "seed": 5}
    sizes = [300, 40, 20]
    reference = megatron_datasets(config, None, dataset_type=MockGPTDataset, sizes=sizes)
    megatron_config = gpt_dataset_config(config, None)
    assert megatron_config.mock and megatron_config.path_to_cache is None
    for dataset_type, expected in ((None, MockGPTDataset), (GPTDataset, MockGPTDataset), (MyMock, MyMock)):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="tokenloom.megatron"):
            ours = build_megatron_datasets(megatron_config, sizes, dataset_type=dataset_type)
        assert [type(d) for d in ours] == [expected] * 3
        if expected is MockGPTDataset:
            _same(ours, reference)
        else:  # another class, another description; the same samples
            for a, b in zip(ours, reference):
                assert len(a) == len(b)
                np.testing.assert_array_equal(a[len(a) - 1]["tokens"], b[len(b) - 1]["tokens"])
        notes = [r.getMessage() for r in caplog.records if r.name == "tokenloom.megatron"]
        assert len(notes) == 1 and "nothing for tokenloom to build" in notes[0], notes


# -- settings that change what a sample holds or how megatron-core returns the splits ------------


def test_inter_document_masking_serves_megatron_cores_cu_seqlens(stores, tmp_path):
    config = blend_config(stores, tmp_path / "unused", train_samples=600, valid_samples=60, test_samples=20)
    reference = megatron_datasets(config, tmp_path / "megatron", inter_document_masking=True)
    with refusing_megatron_builders():  # not in megatron-core's description: the same cache files
        assert _hashes(megatron_datasets(config, tmp_path / "megatron")) == _hashes(reference)
    megatron_config = gpt_dataset_config(config, tmp_path / "ours", inter_document_masking=True)
    with refusing_megatron_builders():
        ours = build_megatron_datasets(megatron_config, _sizes(config))
    _same(ours, reference)  # every field, cu_seqlens and max_seqlen among them
    cu_seqlens = [ours[0][i]["cu_seqlens"] for i in range(20)]
    assert any(int(c[1]) < config["seq_length"] for c in cu_seqlens)  # samples that span documents


@pytest.mark.parametrize("case", ["multiple", "multiple+full", "full"])
def test_validation_settings_serve_megatron_cores_datasets(stores, tmp_path, case):
    # multiple_validation_sets: a list of one whole-store dataset per validation prefix;
    # full_validation: one epoch of validation (Megatron-LM passes None for its size)
    if case == "full":
        config = blend_config(stores, tmp_path / "unused", valid_samples=None)
        config["blend"]["weights"] = None  # megatron-core blends by weight only with a sample count
    else:
        config = blend_config(stores, tmp_path / "unused", valid_samples=None if case == "multiple+full" else 200)
        config.pop("split")
        config["blend_per_split"] = [config.pop("blend"), {"prefixes": stores[1:], "weights": None}, None]
        config["test_samples"] = None
    settings = {"multiple_validation_sets": case != "full", "full_validation": case != "multiple"}
    reference = megatron_datasets(config, tmp_path / "megatron", **settings)
    assert isinstance(reference[1], list) == (case != "full")
    with refusing_megatron_builders():
        ours = build_megatron_datasets(gpt_dataset_config(config, tmp_path / "ours", **settings), _sizes(config))
    _same(ours, reference)


def test_validation_settings_megatron_core_refuses_are_refused_before_building(stores, tmp_path):
    # megatron-core asserts on both, but only after tokenloom would have built the rest
    config = blend_config(stores, tmp_path / "unused")
    config.pop("split")
    config["blend_per_split"] = [config.pop("blend"), {"prefixes": stores[1:], "weights": None}, None]
    megatron_config = gpt_dataset_config(config, tmp_path / "m", multiple_validation_sets=True, full_validation=True)
    with pytest.raises(ConfigError, match=r"full_validation with multiple_validation_sets and 200 validation"):
        build_megatron_datasets(megatron_config, [3000, 200, None])
    config["blend_per_split"][1]["weights"] = [1.0, 2.0]  # megatron-core: weights need a count
    weighted = gpt_dataset_config(config, tmp_path / "m", multiple_validation_sets=True, full_validation=True)
    with pytest.raises(ConfigError, match=r"weights \[1\.0, 2\.0\] but the validation sample count is None"):
        build_megatron_datasets(weighted, [3000, None, None])
    assert not os.path.exists(tmp_path / "m")
    built = megatron_build_configs(gpt_dataset_config(config, tmp_path / "m", multiple_validation_sets=True),
                                   [3000, 200, None])
    assert [b["blend_per_split"][1] for b in built] == [None, *({"prefixes": [p], "weights": None}
                                                               for p in stores[1:])]  # each set alone, unweighted
