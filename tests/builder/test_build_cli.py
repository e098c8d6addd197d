"""``tokenloom build`` and ``tokenloom cache verify`` through their argparse functions."""

from __future__ import annotations

import argparse

import pytest

from build_fixtures import make_stores
from tokenloom.cli.builder import add_build_parser, add_cache_parser
from tokenloom.errors import ConfigError


def _run(argv) -> int:
    parser = argparse.ArgumentParser(prog="tokenloom")
    commands = parser.add_subparsers(dest="command", required=True)
    add_build_parser(commands)
    add_cache_parser(commands)
    args = parser.parse_args(argv)
    return args.run(args)


@pytest.fixture()
def config_file(tmp_path):
    stores = make_stores(tmp_path / "stores")
    path = tmp_path / "build.yaml"
    path.write_text(
        "blend: [" + ", ".join(f"'{w}', '{p}'" for w, p in zip((3, 5, 2), stores)) + "]\n"
        "split: '90,8,2'\nseq_length: 64\ntrain_iters: 50\nglobal_batch_size: 16\n"
        "eval_interval: 25\neval_iters: 2\nseed: 7\n"
    )
    return path


def test_dry_run_prints_the_plan_and_writes_nothing(config_file, tmp_path, capsys):
    assert _run(["build", str(config_file), "--cache", str(tmp_path / "c"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "12 items (9 dataset indices, 3 blends), 0 already in the cache, 12 to build on 1 rank(s)" in out
    assert "train: 800 samples from 3 store(s) (blended)" in out
    assert "blend train of 3 datasets: 800 positions divided over 1 rank(s)" in out
    assert not (tmp_path / "c").exists()


def test_build_then_verify_then_detect_damage(config_file, tmp_path, capsys):
    cache = tmp_path / "c"
    assert _run(["build", str(config_file), "--cache", str(cache), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "train: 800 samples from 3 dataset(s)" in out and "12 built, 0 reused" in out
    assert "rank  predicted s  build wall s  build CPU s" in out and "\n   0  " in out
    assert _run(["build", str(config_file), "--cache", str(cache), "--no-progress"]) == 0
    assert "0 built, 12 reused" in capsys.readouterr().out
    assert _run(["cache", "verify", str(cache)]) == 0
    assert "12 items, 33 files checked: ok" in capsys.readouterr().out
    pack = next(p for p in (cache / "packs").iterdir() if p.suffix == ".bin")
    pack.write_bytes(pack.read_bytes()[:-4])
    assert _run(["cache", "verify", str(cache)]) == 1
    assert str(pack) in capsys.readouterr().out


def test_verify_stores_hash_rehashes_every_store(config_file, tmp_path, capsys, monkeypatch):
    import tokenloom.builder.stores as stores_module

    monkeypatch.setattr(stores_module, "RACY_NS", 0)
    cache = tmp_path / "c"
    assert _run(["build", str(config_file), "--cache", str(cache), "--no-progress"]) == 0
    opened = []
    real = stores_module.IndexedDataset
    monkeypatch.setattr(stores_module, "IndexedDataset", lambda prefix: opened.append(prefix) or real(prefix))
    assert _run(["build", str(config_file), "--cache", str(cache), "--no-progress"]) == 0
    assert opened == []  # the warm-start record answered for every store
    assert "12 reused (warm start: stores unchanged, the kept plan taken)" in capsys.readouterr().out
    assert _run(["build", str(config_file), "--cache", str(cache), "--no-progress", "--verify-stores", "hash"]) == 0
    out = capsys.readouterr().out
    assert len(opened) == 3 and "0 built, 12 reused;" in out and "warm start" not in out


def test_bad_mode_combination_is_a_config_error(config_file, tmp_path):
    with pytest.raises(ConfigError, match="megatron-core can only load exact-mode"):
        _run(["build", str(config_file), "--mode", "stateless", "--megatron-cache", str(tmp_path / "m")])
