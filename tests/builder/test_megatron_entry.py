"""tokenloom.megatron: the dataset provider of Megatron-LM's pretrain_gpt.py with the indices
built by tokenloom on every rank and megatron-core loading its own datasets from them, building
nothing itself."""

from __future__ import annotations

import json
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
from tokenloom.megatron import build_megatron_datasets, megatron_build_config

HERE = os.path.dirname(os.path.abspath(__file__))
POSITIONS = [0, 1, 5, 64, 199, 1000, 2999]


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    return make_stores(tmp_path_factory.mktemp("megatron_entry_stores"))


def _sizes(config: dict) -> list:
    return [config["train_samples"], config["valid_samples"], config["test_samples"]]


def _same(ours, theirs) -> None:
    assert len(ours) == len(theirs) == 3
    for a, b in zip(ours, theirs):
        assert (a is None) == (b is None)
        if a is None:
            continue
        assert type(a) is type(b) and len(a) == len(b)
        assert a.unique_description_hash == b.unique_description_hash
        for i in sorted({0, 1, len(a) // 3, len(a) - 1}):
            for field in ("tokens", "labels", "loss_mask", "position_ids"):
                np.testing.assert_array_equal(a[i][field], b[i][field], err_msg=f"{field} of sample {i}")


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
    built = megatron_build_config(gpt_dataset_config(config, tmp_path / "m"), [10, None, 3], blend_threads=1)
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
        megatron_build_config(megatron_config, _sizes(config))
    megatron_config = gpt_dataset_config(config, tmp_path / "m")
    megatron_config.mock = True
    with pytest.raises(ConfigError, match=r"GPTDatasetConfig\.mock=True"):
        megatron_build_config(megatron_config, _sizes(config))
    megatron_config = gpt_dataset_config(config, tmp_path / "m")
    megatron_config.blend = (["s3://bucket/web"], None)
    with pytest.raises(ConfigError, match="s3://bucket/web"):
        megatron_build_config(megatron_config, _sizes(config))
    with pytest.raises(ConfigError, match="expected three counts"):
        megatron_build_config(gpt_dataset_config(config, tmp_path / "m"), [1, 2])


def test_an_index_megatron_core_describes_otherwise_is_a_build_error(stores, tmp_path, monkeypatch):
    # a megatron-core whose descriptions hold one more setting: tokenloom's files do not match,
    # megatron-core builds the index itself, and the call says so instead of returning quietly
    from megatron.core.datasets.gpt_dataset import GPTDataset

    keys = GPTDataset._key_config_attributes
    monkeypatch.setattr(GPTDataset, "_key_config_attributes", staticmethod(lambda: [*keys(), "eod_mask_loss"]))
    config = blend_config(stores, tmp_path / "unused", train_samples=300, valid_samples=30, test_samples=10)
    with pytest.raises(BuildError, match=r"(?s)GPTDataset train index .* built it itself.*eod_mask_loss"):
        build_megatron_datasets(gpt_dataset_config(config, tmp_path / "m"), _sizes(config))
