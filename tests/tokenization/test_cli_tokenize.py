"""``tokenloom tokenize`` through the real command-line parser."""

from __future__ import annotations

import argparse
import json

import pytest
import zstandard

from tokenloom.cli.tokenization import _byte_size, add_tokenize_parser, run_tokenize
from tokenloom.errors import ConfigError, InputError
from tokenloom.io import IndexedDataset


def _parse(argv):
    parser = argparse.ArgumentParser()
    add_tokenize_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["tokenize", *argv])


def test_cli_writes_store_and_prints_summary(tmp_path, capsys):
    data = "".join(json.dumps({"doc": {"body": f"text {i}"}}) + "\n" for i in range(10)) + "oops\n"
    (tmp_path / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(data.encode()))
    args = _parse([str(tmp_path / "*.zst"), "-o", str(tmp_path / "out"), "--text-key", "doc.body",
                   "--workers", "0", "--skip-bad", "--chunk-size", "64", "--quiet"])
    assert args.run is run_tokenize and args.chunk_size == 64
    assert run_tokenize(args) == 0
    out = capsys.readouterr().out
    assert "10 documents, 70 tokens from 1 file" in out
    assert "skipped 1 bad record (malformed_json 1)" in out
    ds = IndexedDataset(tmp_path / "out")
    assert bytes(ds.get(9).tolist()[:-1]).decode() == "text 9" and ds.get(9)[-1] == 256


def test_cli_no_eod_and_lines(tmp_path, capsys):
    (tmp_path / "t.txt").write_text("ab\ncd\n")
    argv = [str(tmp_path / "t.txt"), "-o", str(tmp_path / "o"), "--lines", "--no-eod", "--workers", "0", "-q"]
    assert run_tokenize(_parse(argv)) == 0
    ds = IndexedDataset(tmp_path / "o")
    assert [ds.get(i).tolist() for i in range(len(ds))] == [[97, 98], [99, 100]]
    assert "no EOD appended" in capsys.readouterr().out


def test_cli_errors_add_the_flag_that_fixes_them(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n{"body": "y"}\n')
    with pytest.raises(InputError, match=r"a.jsonl:2: no key 'text'.*--skip-bad"):
        run_tokenize(_parse([str(tmp_path / "a.jsonl"), "-o", str(tmp_path / "o"), "--workers", "0", "-q"]))
    vocab_path = tmp_path / "tokenizer.json"
    tokenizers = pytest.importorskip("tokenizers")
    tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "x": 1}, unk_token="[UNK]")).save(str(vocab_path))
    with pytest.raises(ConfigError, match=r"--eod-id ID, or --no-eod"):
        run_tokenize(_parse([str(tmp_path / "a.jsonl"), "-o", str(tmp_path / "o"), "--tokenizer", str(vocab_path),
                             "-q"]))
    assert not (tmp_path / "o.idx").exists()


def test_cli_through_main_exits_2_with_one_line(tmp_path, capsys):
    from tokenloom.cli import main

    assert main(["tokenize", str(tmp_path / "missing*.jsonl"), "-o", str(tmp_path / "o")]) == 2
    assert "matches no file" in capsys.readouterr().err


def test_byte_sizes():
    assert [_byte_size(s) for s in ("1", "512K", "4M", "1GiB", "2mb")] == [1, 512 << 10, 4 << 20, 1 << 30, 2 << 20]
    for bad in ("0", "-1", "1.5M", "lots"):
        with pytest.raises(argparse.ArgumentTypeError):
            _byte_size(bad)
