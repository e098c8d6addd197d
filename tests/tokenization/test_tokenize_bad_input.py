"""Bad records name file and line; --skip-bad counts them; failures leave no store behind."""

from __future__ import annotations

import gzip
import json
import os
import re

import pytest

from tokenloom.errors import InputError
from tokenloom.io import IndexedDataset
from tokenloom.tokenization import TokenizeConfig, tokenize_to_store

GOOD = b'{"text": "fine"}\n'

# (file name, bytes after two good lines, reason, words the message must contain)
BAD_JSONL_LINES = [
    ("malformed.jsonl", b'{"text": "unterminated}\n', "malformed_json",
     "malformed JSON: Unterminated string starting at column 10"),
    ("missing.jsonl", b'{"body": "x"}\n', "missing_key", "no key 'text'"),
    ("number.jsonl", b'{"text": 42}\n', "not_a_string", "is a number, expected a string"),
    ("null.jsonl", b'{"text": null}\n', "not_a_string", "is null, expected a string"),
    ("array.jsonl", b'["text"]\n', "not_an_object", "expected a JSON object, got an array"),
    ("utf8.jsonl", b'{"text": "caf\xe9"}\n', "invalid_utf8", "invalid UTF-8 at byte 13 of the line"),
    ("surrogate.jsonl", b'{"text": "x\\ud800y"}\n', "invalid_unicode", "lone surrogate U+D800"),
]


def _no_store(prefix) -> bool:
    directory, name = os.path.split(prefix)
    leftovers = [f for f in os.listdir(directory) if f.startswith(name) or f.startswith("." + name)]
    return leftovers == []


@pytest.mark.parametrize("name,bad_line,reason,words", BAD_JSONL_LINES)
def test_bad_jsonl_record_names_file_and_line(tmp_path, name, bad_line, reason, words):
    path = tmp_path / name
    path.write_bytes(GOOD + b"\n" + GOOD + bad_line + GOOD)  # the bad record is on line 4
    prefix = str(tmp_path / "out")
    with pytest.raises(InputError) as info:
        tokenize_to_store([str(path)], prefix, TokenizeConfig(workers=0))
    assert str(info.value).startswith(f"{path}:4: ")
    assert words in str(info.value)
    assert not re.search(r"\b(\w+) \1\b", str(info.value)), str(info.value)  # no "at at"
    assert _no_store(prefix)

    summary = tokenize_to_store([str(path)], prefix, TokenizeConfig(workers=0, skip_bad=True))
    assert dict(summary.skipped) == {reason: 1}
    assert summary.num_documents == 3
    assert IndexedDataset(prefix).metadata["source"]["skipped"] == {reason: 1}


def test_invalid_utf8_in_text_files_names_the_line(tmp_path):
    whole = tmp_path / "doc.txt"
    whole.write_bytes(b"first line\nsecond \xff line\n")
    with pytest.raises(InputError, match=rf"^{whole}:2: invalid UTF-8 at byte 7 of the line"):
        tokenize_to_store([str(whole)], str(tmp_path / "a"), TokenizeConfig(workers=0))
    lines = tmp_path / "lines.txt.gz"
    lines.write_bytes(gzip.compress(b"ok\n\nok\n\xc3\x28\n"))
    with pytest.raises(InputError, match=rf"^{lines}:4: invalid UTF-8 at byte 0 of the line"):
        tokenize_to_store([str(lines)], str(tmp_path / "b"), TokenizeConfig(workers=0, lines=True))
    summary = tokenize_to_store([str(lines), str(whole)], str(tmp_path / "c"),
                                TokenizeConfig(workers=0, lines=True, skip_bad=True))
    assert dict(summary.skipped) == {"invalid_utf8": 2} and summary.num_documents == 3


def test_parquet_null_names_the_row(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"text": ["a", "b", None, "d"]}), path)
    with pytest.raises(InputError, match=rf"^{path}:row 3: the text is null"):
        tokenize_to_store([str(path)], str(tmp_path / "out"), TokenizeConfig(workers=0))


def test_first_bad_record_in_input_order_is_reported_across_workers_and_chunks(tmp_path):
    lines = [json.dumps({"text": f"document number {i}"}) for i in range(3000)]
    lines[1234] = '{"text": 1}'
    lines[2500] = "{broken"
    path = tmp_path / "many.jsonl"
    path.write_text("\n".join(lines) + "\n")
    prefix = str(tmp_path / "out")
    for threads in (False, True):
        with pytest.raises(InputError, match=rf"^{path}:1235: 'text' is a number"):
            tokenize_to_store([str(path)], prefix, TokenizeConfig(workers=2, threads=threads, chunk_bytes=500))
        assert _no_store(prefix)
    summary = tokenize_to_store([str(path)], prefix, TokenizeConfig(workers=2, chunk_bytes=500, skip_bad=True))
    assert dict(summary.skipped) == {"not_a_string": 1, "malformed_json": 1}
    assert summary.num_documents == 2998


class _Interrupt(KeyboardInterrupt):
    pass


@pytest.mark.parametrize("workers", [0, 2])
def test_interrupt_midway_leaves_no_store_and_no_temp_files(tmp_path, workers):
    inputs = tmp_path / "in"
    inputs.mkdir()
    (inputs / "big.jsonl").write_text("".join(json.dumps({"text": "x" * 100}) + "\n" for _ in range(5000)))
    prefix = str(tmp_path / "out")
    calls = []

    def progress(documents, tokens, input_bytes):
        calls.append(documents)
        if len(calls) == 3:
            raise _Interrupt()

    with pytest.raises(_Interrupt):
        tokenize_to_store([str(inputs)], prefix, TokenizeConfig(workers=workers, chunk_bytes=4096), progress=progress)
    assert os.listdir(tmp_path) == ["in"]  # no PREFIX.bin / .idx / .meta.json, no hidden temp files
    # an older store under the same name survives an interrupted rewrite untouched
    tokenize_to_store([str(inputs)], prefix, TokenizeConfig(workers=0))
    before = {s: open(prefix + s, "rb").read() for s in (".bin", ".idx", ".meta.json")}
    calls.clear()
    with pytest.raises(_Interrupt):
        tokenize_to_store([str(inputs)], prefix, TokenizeConfig(workers=workers, chunk_bytes=4096), progress=progress)
    assert {s: open(prefix + s, "rb").read() for s in (".bin", ".idx", ".meta.json")} == before
    assert sorted(os.listdir(tmp_path)) == ["in", "out.bin", "out.idx", "out.meta.json"]


class _DyingTokenizer:
    """Byte tokenizer whose worker process dies on the text 'die' (a crash, not an exception)."""

    vocab_size = 257
    eod_id = 256

    def encode_batch(self, texts):
        if "die" in texts:
            os._exit(3)
        from tokenloom.tokenization import ByteTokenizer

        return ByteTokenizer().encode_batch(texts)

    def record(self, *, append_eod):
        from tokenloom.tokenization import ByteTokenizer

        return ByteTokenizer().record(append_eod=append_eod)


def test_a_crashing_worker_fails_the_run_instead_of_hanging(tmp_path):
    from tokenloom.errors import BuildError

    texts = ["ok"] * 2000 + ["die"] + ["ok"] * 10
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    prefix = str(tmp_path / "out")
    with pytest.raises(BuildError, match="worker process died"):
        tokenize_to_store([str(path)], prefix, TokenizeConfig(workers=2, chunk_bytes=1000), tokenizer=_DyingTokenizer())
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]
