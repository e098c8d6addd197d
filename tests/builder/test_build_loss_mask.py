"""The build knows the loss-mask sidecar: a store's fingerprint holds its mask (an unmasked store's
keeps its old keys), the memo notices a mask changed in place, a sidecar that does not match its
store is named, and ``cache verify`` checks the masks its builds served."""

from __future__ import annotations

import os

import numpy as np
import pytest

import tokenloom
import tokenloom.builder as tb
from tokenloom.builder.stores import FingerprintMemo, fingerprint_store
from tokenloom.cli import main as cli_main
from tokenloom.errors import BuildError
from tokenloom.io import IndexedDataset, IndexedDatasetWriter
from tokenloom.io.loss_mask import mask_path


def _write(prefix, *, seed, masked=True):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(5, 80, size=120)
    tokens = rng.integers(0, 900, size=int(lengths.sum()))
    mask = (rng.random(tokens.size) < 0.7).astype(np.uint8) if masked else None
    with IndexedDatasetWriter(prefix) as writer:
        writer.add_documents(tokens, lengths, loss_mask=mask)
        writer.finalize({"tokenizer": {"kind": "bytes", "name": "bytes", "eod_id": 999, "vocab_size": 1000}})
    return prefix


def _config(prefixes, cache):
    return {"blend": {"prefixes": list(prefixes)}, "split": "100,0,0", "valid_samples": 0, "test_samples": 0,
            "seq_length": 32, "train_samples": 200, "seed": 3, "cache_dir": str(cache), "rng_workers": 0}


def _ranges(num_sequences):
    return [(0, num_sequences)]


def _flip_last_byte(path):
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)[0]
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last ^ 0x01]))


def test_the_fingerprint_holds_the_mask_and_an_unmasked_store_keeps_its_keys(tmp_path):
    plain = fingerprint_store(_write(str(tmp_path / "plain"), seed=1, masked=False), _ranges)
    assert set(plain.fingerprint.to_dict()) == {"idx_bytes", "bin_bytes", "idx_mtime_ns", "bin_mtime_ns",
                                                "idx_sha256"}
    prefix = _write(str(tmp_path / "chat"), seed=1)
    masked = fingerprint_store(prefix, _ranges)
    record = IndexedDataset(prefix).metadata["loss_mask"]
    assert masked.fingerprint.mask_sha256 == record["sha256"]
    assert masked.fingerprint.mask_bytes == os.path.getsize(mask_path(prefix))
    assert masked.fingerprint.idx_sha256 == plain.fingerprint.idx_sha256  # same tokens: only the mask differs
    _write(prefix, seed=1)  # rewritten with the same tokens and mask: the same mask SHA-256
    assert fingerprint_store(prefix, _ranges).fingerprint.mask_sha256 == masked.fingerprint.mask_sha256
    with IndexedDatasetWriter(prefix) as writer:  # the same tokens, another mask
        store = IndexedDataset(str(tmp_path / "plain"))
        writer.add_documents(np.asarray(store.tokens), store.sequence_lengths,
                             loss_mask=np.zeros(store.num_tokens, np.uint8))
        writer.finalize({"tokenizer": {"kind": "bytes", "name": "bytes", "eod_id": 999, "vocab_size": 1000}})
    changed = fingerprint_store(prefix, _ranges).fingerprint
    assert changed.idx_sha256 == masked.fingerprint.idx_sha256
    assert changed.mask_sha256 != masked.fingerprint.mask_sha256


def test_the_memo_notices_a_mask_changed_in_place(tmp_path, monkeypatch):
    monkeypatch.setattr("tokenloom.builder.stores.RACY_NS", 0)
    prefix = _write(str(tmp_path / "chat"), seed=2)
    memo = FingerprintMemo(str(tmp_path / "stores.json"))
    first = fingerprint_store(prefix, _ranges, memo)
    memo.merge_and_save(memo.fresh)
    memo = FingerprintMemo(str(tmp_path / "stores.json"))
    assert fingerprint_store(prefix, _ranges, memo) == first and memo.hits == 1
    stat = os.stat(mask_path(prefix))
    _flip_last_byte(mask_path(prefix))
    os.utime(mask_path(prefix), ns=(stat.st_atime_ns, stat.st_mtime_ns))  # mtime put back: ctime still moves
    again = fingerprint_store(prefix, _ranges, memo)
    assert memo.hits == 1 and again.fingerprint.mask_bytes == first.fingerprint.mask_bytes


def test_a_build_names_a_sidecar_that_does_not_match_and_verify_checks_the_masks(tmp_path, capsys):
    chat, prose = _write(str(tmp_path / "chat"), seed=3), _write(str(tmp_path / "prose"), seed=4, masked=False)
    cache = tmp_path / "cache"
    built = tokenloom.build(_config([chat, prose], cache))
    assert built.split("train").has_loss_mask(0) and not built.split("train").has_loss_mask(1)
    assert tb.verify_cache(str(cache)).ok
    _flip_last_byte(mask_path(chat))  # the bits, not the record: verify hashes them
    report = tb.verify_cache(str(cache))
    assert len(report.problems) == 1 and "chat.mask: its bits have SHA-256" in report.problems[0]
    _write(chat, seed=5)  # another mask, recorded: the build's fingerprint no longer holds
    report = tb.verify_cache(str(cache))
    assert len(report.problems) == 1 and "the loss mask changed since the build" in report.problems[0]
    assert cli_main(["cache", "verify", str(cache)]) != 0
    assert "chat.mask" in capsys.readouterr().out
    rebuilt = tokenloom.build(_config([chat, prose], cache))
    assert rebuilt.build_key != built.build_key
    with open(mask_path(chat), "ab") as f:
        f.write(b"\x00")
    with pytest.raises(BuildError, match=r"chat\.mask: file is \d+ bytes but a mask of the store's \d+ tokens"):
        tokenloom.build(_config([chat, prose], tmp_path / "cache2"))


def test_the_merge_command_carries_the_masks_and_inspect_shows_them(tmp_path, capsys):
    chat, prose = _write(str(tmp_path / "chat"), seed=6), _write(str(tmp_path / "prose"), seed=7, masked=False)
    assert cli_main(["merge", chat, prose, "--output", str(tmp_path / "merged")]) == 0
    merged, a, b = IndexedDataset(str(tmp_path / "merged")), IndexedDataset(chat), IndexedDataset(prose)
    assert merged.has_loss_mask
    np.testing.assert_array_equal(merged.get_loss_mask(0), a.get_loss_mask(0))
    np.testing.assert_array_equal(merged.get_loss_mask(len(a)), np.ones(len(b.get(0)), np.uint8))
    capsys.readouterr()
    assert cli_main(["inspect", str(tmp_path / "merged")]) == 0
    record = merged.metadata["loss_mask"]
    assert (f"loss mask  merged.mask {record['bytes']:,} B   tokens outside the loss "
            f"{record['tokens_outside_loss']:,}") in capsys.readouterr().out
    assert record["tokens_outside_loss"] == int((a.get_loss_mask(0) == 0).sum()) + sum(
        int((a.get_loss_mask(i) == 0).sum()) for i in range(1, len(a)))
