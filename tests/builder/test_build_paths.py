"""Paths mean files: a config file's relative paths name files beside it, whatever directory the
build runs from, and its build key is what it was; paths given in Python or on the command line
are the current directory's; a store is matched by the file it names however it is spelt; and a
missing store or a misspelt key is reported in the user's words."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

import tokenloom
from build_fixtures import make_stores
from tokenloom.cli import main as cli_main
from tokenloom.errors import BuildError, ConfigError
from tokenloom.source.provenance import datasets_of


def _config(stores: str = "stores", cache: str = "cache") -> dict:
    return {"blend": ["0.6", f"{stores}/store0", "0.4", f"{stores}/store1"], "split": "90,10,0", "seq_length": 32,
            "seed": 3, "train_samples": 4000, "valid_samples": 20, "test_samples": 0, "cache": cache}


@pytest.fixture
def project(tmp_path, monkeypatch):
    """``project/build.yaml`` with relative paths to ``project/stores``; the test runs from tmp_path."""
    folder = tmp_path / "project"
    make_stores(folder / "stores", 2, base_documents=200)
    (folder / "build.yaml").write_text(yaml.safe_dump(_config()))
    monkeypatch.chdir(tmp_path)
    return folder


def test_a_config_files_relative_paths_name_files_beside_it_and_keep_its_build_key(project, monkeypatch):
    outside = tokenloom.build("project/build.yaml")  # from the parent folder
    assert outside.split("train").readers[0].prefix == str(project / "stores" / "store0")
    assert os.path.isdir(project / "cache") and not os.path.exists("cache")
    monkeypatch.chdir(project)
    inside = tokenloom.build("build.yaml")
    assert inside.build_key == outside.build_key and not inside.built_keys  # the same build, from the cache
    # the key is the one the same config had when its paths were the current directory's
    spelt = tokenloom.build({**_config(), "cache": str(project / "cache-python")})
    assert spelt.build_key == outside.build_key


def test_paths_given_in_python_or_on_the_command_line_are_the_current_directorys(project, tmp_path, monkeypatch,
                                                                                 capsys):
    with pytest.raises(BuildError, match=r"no token store at stores/store0"):
        tokenloom.build(_config())  # tmp_path has no stores/
    assert cli_main(["build", "project/build.yaml", "--cache", "elsewhere"]) == 0
    assert os.path.isdir(tmp_path / "elsewhere") and not os.path.exists(project / "elsewhere")


def test_a_missing_store_says_which_where_and_how_on_one_process(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "b1"
    folder.mkdir()
    (folder / "build.yaml").write_text(yaml.safe_dump(_config()))
    monkeypatch.chdir(tmp_path)
    assert cli_main(["build", "b1/build.yaml"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("tokenloom build: error: store 'stores/store0' (relative to the config file's folder "
                            f"{folder}: {folder / 'stores' / 'store0'}): no token store at "), error
    assert f"{folder / 'stores'} has neither store0.idx nor store0.bin" in error
    assert "rank" not in error and "phase" not in error and "FormatError" not in error


def test_an_unknown_key_gets_a_did_you_mean_and_the_aliases(tmp_path, capsys):
    path = tmp_path / "typo.yaml"
    for key, meant in (("seq_lenght", "seq_length"), ("cahce", "cache")):
        path.write_text(yaml.safe_dump({**_config(), key: 1}))
        with pytest.raises(ConfigError, match=rf"unknown key '{key}'; did you mean '{meant}'\?") as caught:
            tokenloom.build(str(path))
        assert "cache_dir (or cache, data_cache_path)" in str(caught.value)
    path.write_text(yaml.safe_dump({**_config(), "zzzz": 1}))
    with pytest.raises(ConfigError, match=r"unknown key 'zzzz' The keys are: "):
        tokenloom.build(str(path))


def test_a_store_is_matched_by_the_file_it_names_however_it_is_spelt(project, tmp_path, monkeypatch):
    split = tokenloom.build("project/build.yaml").split("train")
    os.symlink(project / "stores", tmp_path / "linked")
    os.symlink(project / "stores" / "store1.idx", tmp_path / "alias.idx")
    monkeypatch.chdir(project)
    for spelling in ("stores/store0", "./stores/store0", str(project / "stores" / "store0"),
                     "stores/../stores/store0.idx", str(tmp_path / "linked" / "store0"), "../linked/store0.bin"):
        assert datasets_of(split, spelling) == [0], spelling
    assert datasets_of(split, "../alias") == [1]  # a link to a store's .idx names that store
    with pytest.raises(ConfigError, match=r"store 'stores/nope' \(.*/project/stores/nope\) is not in the train split"):
        datasets_of(split, "stores/nope")


def test_find_takes_the_store_as_written_on_the_command_line(project, capsys):
    assert cli_main(["find", "project/build.yaml", "--store", "project/stores/store0", "--document", "5",
                     "--global-batch-size", "8"]) == 0
    assert "document 5 of project/stores/store0" in capsys.readouterr().out


def test_a_closed_pipe_ends_a_command_quietly(project):
    """``tokenloom where ... | head -1``: exit 0, nothing on stderr."""
    tokenloom.build("project/build.yaml")  # so that the command only prints positions
    process = subprocess.Popen([sys.executable, "-m", "tokenloom.cli", "where", "project/build.yaml", "--positions",
                                "0:4000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = process.stdout.readline()
    process.stdout.close()
    stderr = process.stderr.read().decode()
    assert process.wait(timeout=120) == 0, stderr
    assert first.startswith(b"position 0") and stderr == ""


def test_megatron_cores_names_use_the_stores_as_the_config_spelt_them(project, monkeypatch):
    """megatron-core hashes the path its own job was given: a config's relative spelling, not the
    path tokenloom resolved it to, so its cache files keep their names."""
    result = tokenloom.build("project/build.yaml")
    paths = {item.megatron.identifiers["dataset_path"] for item in result.plan.items
             if item.kind == "gpt" and item.megatron is not None}
    assert paths == {"stores/store0", "stores/store1"}
    monkeypatch.chdir(project)
    python = tokenloom.build({**_config(), "cache": str(project / "cache-python")})
    names = sorted(item.megatron.file_name("x") for item in python.plan.items if item.megatron is not None)
    assert names == sorted(item.megatron.file_name("x") for item in result.plan.items if item.megatron is not None)
