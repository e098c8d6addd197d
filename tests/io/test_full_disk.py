"""A full disk is a StorageError naming the folder, what was being written and the space: tokenize,
merge, build (checked before writing, and while writing) and the megatron-core export, on a small
filesystem that really fills. Exit status 2 on the command line; nothing half-written is left
looking valid. Where a tmpfs cannot be mounted, a file-size limit (``ulimit -f``) stands in."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import numpy as np
import pytest

import tokenloom
from tokenloom.cli import main as cli_main
from tokenloom.errors import BuildError, FormatError, StorageError
from tokenloom.io import IndexedDataset, IndexedDatasetWriter
from tokenloom.io.space import format_bytes

SMALL = 256 * 1024


def _mount(path, size: int) -> bool:
    os.makedirs(path, exist_ok=True)
    try:
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                                capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return result.returncode == 0


@pytest.fixture
def small_disk(tmp_path):
    """A 256 KiB filesystem (tmpfs), or a skip where this process may not mount one."""
    path = tmp_path / f"small-{uuid.uuid4().hex[:6]}"
    if not _mount(path, SMALL):
        pytest.skip("mounting a tmpfs needs root; test_a_file_size_limit_is_a_full_disk_too covers this machine")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def big_input(tmp_path_factory):
    """2 MB of JSON lines: about 2 MB of byte tokens, eight times the small disk."""
    path = tmp_path_factory.mktemp("input") / "big.jsonl"
    rng = np.random.default_rng(0)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(2000):
            f.write('{"text": "' + " ".join(f"{x:.6f}" for x in rng.random(110)) + '"}\n')
    return path


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """Two stores of 1.2 MB each (random uint16 tokens, EOD-free documents)."""
    directory = tmp_path_factory.mktemp("stores")
    rng = np.random.default_rng(1)
    prefixes = []
    for i in range(2):
        prefix = str(directory / f"s{i}")
        with IndexedDatasetWriter(prefix, dtype=np.uint16) as writer:
            lengths = rng.integers(100, 900, 1200)
            writer.add_documents(rng.integers(0, 1000, int(lengths.sum())).astype(np.uint16), lengths)
            writer.finalize()
        prefixes.append(prefix)
    return prefixes


def _leftovers(folder) -> list[str]:
    return sorted(os.listdir(folder))


def test_tokenize_into_a_full_disk(small_disk, big_input, capsys):
    code = cli_main(["tokenize", str(big_input), "--output", str(small_disk / "out"), "--tokenizer", "bytes",
                     "--workers", "0"])
    assert code == 2
    error = capsys.readouterr().err
    assert f"{small_disk}: no space is left on the device while writing the token store {small_disk / 'out'}" in error
    assert "(it needs about 3." in error and "Nothing partial was kept" in error  # 1.9 M uint16 tokens
    assert "Traceback" not in error and "Errno" not in error
    assert _leftovers(small_disk) == []  # no .bin, no .idx, no hidden temp file


def test_merge_into_a_full_disk_is_refused_before_writing(small_disk, stores, capsys):
    assert cli_main(["merge", *stores, "--output", str(small_disk / "merged")]) == 2
    error = capsys.readouterr().err
    needed = format_bytes(sum(os.path.getsize(p + suffix) for p in stores for suffix in (".bin", ".idx")))
    assert f"{small_disk}: the merged store {small_disk / 'merged'} needs about {needed} but " in error
    assert "KiB is free there" in error and "nothing was written yet" in error
    assert _leftovers(small_disk) == []


def test_merge_that_fills_the_disk_while_writing(small_disk, stores, monkeypatch):
    """The free space a filesystem reports can be gone by the time the copy runs."""
    monkeypatch.setattr("tokenloom.io.space.free_bytes", lambda folder: 1 << 40)
    needed = format_bytes(sum(os.path.getsize(p + suffix) for p in stores for suffix in (".bin", ".idx")))
    with pytest.raises(StorageError, match=r"no space is left on the device while writing the token store .*"
                                           rf"\(it needs about {needed}"):
        tokenloom.io.merge_stores(stores, str(small_disk / "merged"))
    assert _leftovers(small_disk) == []


def _build_config(stores, cache, **extra) -> dict:
    return {"blend": ["0.5", stores[0], "0.5", stores[1]], "split": "90,10,0", "seq_length": 64, "seed": 1,
            "train_samples": 60_000, "valid_samples": 200, "test_samples": 0, "cache": str(cache), **extra}


def test_a_build_bigger_than_its_disk_stops_before_writing(small_disk, stores, capsys, tmp_path):
    import yaml

    path = tmp_path / "build.yaml"
    path.write_text(yaml.safe_dump(_build_config(stores, small_disk / "cache")))
    assert cli_main(["build", str(path), "--dry-run"]) == 0
    assert "only 2" in capsys.readouterr().out.split("to write ")[1]  # the dry run says it will not fit
    assert cli_main(["build", str(path)]) == 2
    error = capsys.readouterr().err
    assert f"{small_disk / 'cache'}: the build (" in error and "MiB but 2" in error and "KiB is free there" in error
    assert "rank" not in error
    packs = small_disk / "cache" / "packs"
    assert not packs.exists() or _leftovers(packs) == []


def test_a_build_that_fills_its_disk_while_writing(small_disk, stores, monkeypatch):
    monkeypatch.setattr("tokenloom.io.space.free_bytes", lambda folder: 1 << 40)
    with pytest.raises(BuildError, match=r"cache: no space is left on the device while writing (a pack of \d+ built "
                                         r"item\(s\)|the arrays of blend train of 2 datasets) \(it needs about "
                                         r"[\d.]+ MiB") as caught:
        tokenloom.build(_build_config(stores, small_disk / "cache"))
    assert "[rank" not in str(caught.value)
    packs = small_disk / "cache" / "packs"
    assert not packs.exists() or not any(name.endswith((".json", ".keys")) for name in _leftovers(packs))
    # with room again, the same cache takes the same build: nothing left behind gets in the way
    monkeypatch.undo()
    subprocess.run(["mount", "-o", "remount,size=32m", str(small_disk)], check=True, timeout=30)
    result = tokenloom.build(_build_config(stores, small_disk / "cache"))
    assert result.split("train").num_samples == 60_000


def test_the_megatron_export_into_a_full_disk(small_disk, stores, tmp_path, monkeypatch):
    from tokenloom.builder.megatron_export import export_megatron_item

    result = tokenloom.build(_build_config(stores, tmp_path / "cache"))
    item = max((i for i in result.plan.items if i.megatron is not None), key=lambda i: i.output_bytes)
    with pytest.raises(StorageError, match=rf"{small_disk}: no space is left on the device while writing "
                                           r"megatron-core's files of (gpt|blend) train .*it needs about"):
        export_megatron_item(result.cache, item, str(small_disk))
    # whatever was placed is whole, and megatron-core takes nothing without the description
    assert not [name for name in _leftovers(small_disk) if name.startswith(".tokenloom.")]
    assert not [name for name in _leftovers(small_disk) if name.endswith("description.txt")]


LIMITED = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)       # a write past the limit fails instead of killing
resource.setrlimit(resource.RLIMIT_FSIZE, (BYTES, BYTES))
from tokenloom.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_file_size_limit_is_a_full_disk_too(tmp_path, big_input):
    """No mount needed: ``ulimit -f`` makes the writes fail the same way (EFBIG)."""
    out = tmp_path / "out"
    out.mkdir()
    limit = 300_000
    result = subprocess.run([sys.executable, "-c", LIMITED.replace("BYTES", str(limit)), "tokenize", str(big_input),
                             "--output", str(out / "store"), "--tokenizer", "bytes", "--workers", "0"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    assert f"{out}: a file-size limit (ulimit -f) was reached while writing the token store {out / 'store'}" in \
        result.stderr
    assert "Traceback" not in result.stderr
    assert _leftovers(out) == []
    assert not os.path.exists(str(out / "store") + ".idx")


def test_an_abort_on_a_full_disk_raises_nothing_of_its_own(small_disk):
    writer = IndexedDatasetWriter(str(small_disk / "w"), dtype=np.uint16)
    with pytest.raises(StorageError):
        for _ in range(100):  # 2 MB through a 4 MB buffer: the flush inside fails
            writer.add_document(np.zeros(10_000, dtype=np.uint16))
        writer.finalize()
    writer.abort()  # again: nothing to do, nothing raised
    assert _leftovers(small_disk) == []
    # a writer abandoned with 2 MB still in its buffer (another error stopped the run): closing
    # the file would flush them into the full disk; the abort discards them instead of raising
    abandoned = IndexedDatasetWriter(str(small_disk / "abandoned"), dtype=np.uint16)
    for _ in range(100):
        abandoned.add_document(np.zeros(10_000, dtype=np.uint16))
    abandoned.abort()
    assert _leftovers(small_disk) == []
    with pytest.raises(FormatError, match="no token store"):
        IndexedDataset(str(small_disk / "w"))
