"""Input discovery and readers: every format, compression, globs, directories, chunking."""

from __future__ import annotations

import gzip
import json
import os

import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenloom.errors import InputError
from tokenloom.tokenization.inputs import (
    discover_inputs,
    iter_records,
    parse_chunk,
    read_chunks,
)


def _write(path, data: bytes, compression=None) -> str:
    if compression == "gzip":
        data = gzip.compress(data)
    elif compression == "zstd":
        data = zstandard.ZstdCompressor().compress(data)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return str(path)


def _jsonl(objects) -> bytes:
    return "".join(json.dumps(o) + "\n" for o in objects).encode()


def _records(path, **kwargs):
    (source,) = discover_inputs([path])
    return [(r.line_number, r.text) for r in iter_records(source, **kwargs)]


# -- discovery ------------------------------------------------------------------------------------
def test_discovery_orders_files_dirs_and_globs_deterministically(tmp_path):
    for name in ["b/2.jsonl", "b/1.jsonl.gz", "b/sub/0.txt", "b/.hidden.jsonl", "b/notes.csv", "b/store.meta.json",
                 "a.jsonl", "c.parquet"]:
        _write(tmp_path / name, b"{}\n")
    found = discover_inputs([str(tmp_path / "b"), str(tmp_path / "*.jsonl"), str(tmp_path / "a.jsonl")])
    names = [os.path.relpath(f.path, tmp_path) for f in found]
    # directory: sorted, recursive, known extensions only, hidden skipped; the glob; a.jsonl once
    assert names == ["b/1.jsonl.gz", "b/2.jsonl", "b/sub/0.txt", "a.jsonl"]
    assert [(f.format, f.compression) for f in found] == [("jsonl", "gzip"), ("jsonl", None), ("text", None),
                                                          ("jsonl", None)]
    recursive = discover_inputs([str(tmp_path / "**" / "*.jsonl*")])
    assert [os.path.relpath(f.path, tmp_path) for f in recursive] == ["a.jsonl", "b/1.jsonl.gz", "b/2.jsonl"]


def test_discovery_errors_name_the_pattern(tmp_path):
    with pytest.raises(InputError, match="matches no file"):
        discover_inputs([str(tmp_path / "*.jsonl")])
    with pytest.raises(InputError, match="no such file"):
        discover_inputs([str(tmp_path / "missing.jsonl")])
    (tmp_path / "empty").mkdir()
    _write(tmp_path / "empty" / "data.csv", b"x")
    with pytest.raises(InputError, match="holds no input files"):
        discover_inputs([str(tmp_path / "empty")])
    # naming the format reads every (non-hidden) file in the directory
    assert [f.format for f in discover_inputs([str(tmp_path / "empty")], input_format="text")] == ["text"]
    _write(tmp_path / "x.parquet.gz", b"x")
    with pytest.raises(InputError, match="Parquet"):
        discover_inputs([str(tmp_path / "x.parquet.gz")])


def test_explicit_file_with_unknown_extension_is_text(tmp_path):
    path = _write(tmp_path / "README", b"hello\n")
    assert _records(path) == [(1, "hello\n")]


# -- formats --------------------------------------------------------------------------------------
@pytest.mark.parametrize("compression,suffix", [(None, ""), ("gzip", ".gz"), ("zstd", ".zst")])
def test_jsonl_plain_gzip_zstd(tmp_path, compression, suffix):
    objects = [{"text": "first"}, {"text": "zweite ü"}, {"id": 3, "text": "third\nwith newline"}]
    data = _jsonl(objects[:2]) + b"\n  \n" + _jsonl(objects[2:])  # blank lines are not records
    path = _write(tmp_path / f"d.jsonl{suffix}", data, compression)
    assert _records(path) == [(1, "first"), (2, "zweite ü"), (5, "third\nwith newline")]


def test_jsonl_nested_key_and_crlf_and_no_final_newline(tmp_path):
    data = b'{"meta": {"body": "x"}}\r\n{"meta": {"body": "y"}, "meta.body": "literal"}'
    path = _write(tmp_path / "n.jsonl", data)
    assert _records(path, text_key="meta.body") == [(1, "x"), (2, "literal")]


@pytest.mark.parametrize("compression,suffix", [(None, ""), ("gzip", ".gz"), ("zstd", ".zst")])
def test_text_document_per_file_and_per_line(tmp_path, compression, suffix):
    data = "line one\r\n\nline två\n".encode()
    path = _write(tmp_path / f"t.txt{suffix}", data, compression)
    assert _records(path) == [(1, data.decode())]
    assert _records(path, lines=True) == [(1, "line one"), (3, "line två")]


def test_parquet_string_and_binary_columns(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.table({
        "content": pa.array(["a", "bb", "ccc", "dddd", "e"], pa.string()),
        "raw": pa.array([b"x", b"y", b"z", b"w", b"v"], pa.binary()),
    })
    path = str(tmp_path / "t.parquet")
    pq.write_table(table, path, row_group_size=2)
    assert _records(path, column="content") == [(1, "a"), (2, "bb"), (3, "ccc"), (4, "dddd"), (5, "e")]
    assert _records(path, column="raw") == [(1, "x"), (2, "y"), (3, "z"), (4, "w"), (5, "v")]
    with pytest.raises(InputError, match=r"no column 'text'.*content"):
        _records(path)


def test_parquet_non_string_column_is_rejected(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = str(tmp_path / "n.parquet")
    pq.write_table(pa.table({"text": pa.array([1, 2], pa.int64())}), path)
    with pytest.raises(InputError, match="type int64, expected a string column"):
        _records(path)


def test_truncated_gzip_is_an_input_error(tmp_path):
    data = gzip.compress(_jsonl([{"text": "x" * 1000}] * 100))
    path = _write(tmp_path / "cut.jsonl.gz", data[: len(data) // 2])
    with pytest.raises(InputError, match=r"cut\.jsonl\.gz"):
        _records(path)


# -- chunking does not change what is read -----------------------------------------------------------
_texts = st.lists(st.text(st.characters(blacklist_categories=("Cs",)), max_size=30), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(texts=_texts, chunk_bytes=st.integers(1, 200), compression=st.sampled_from([None, "gzip", "zstd"]))
def test_chunked_jsonl_reads_every_record_once_in_order(tmp_path_factory, texts, chunk_bytes, compression):
    suffix = {None: "", "gzip": ".gz", "zstd": ".zst"}[compression]
    path = _write(tmp_path_factory.mktemp("c") / f"x.jsonl{suffix}", _jsonl({"text": t} for t in texts), compression)
    (source,) = discover_inputs([path], input_format="jsonl")
    got = []
    for chunk in read_chunks(source, chunk_bytes=chunk_bytes):
        parsed = parse_chunk(chunk)
        assert parsed.bad == []
        got.extend(zip(parsed.line_numbers, parsed.texts))
    assert got == list(enumerate(texts, start=1))


@settings(max_examples=40, deadline=None)
@given(lines=st.lists(st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\n\r"), max_size=20),
                      max_size=30),
       chunk_bytes=st.integers(1, 100))
def test_chunked_text_lines_match_a_simple_split(tmp_path_factory, lines, chunk_bytes):
    path = _write(tmp_path_factory.mktemp("l") / "x.txt", "\n".join(lines).encode())
    (source,) = discover_inputs([path])
    got = []
    for chunk in read_chunks(source, lines=True, chunk_bytes=chunk_bytes):
        parsed = parse_chunk(chunk)
        got.extend(zip(parsed.line_numbers, parsed.texts))
    expected = [(i, line) for i, line in enumerate(lines, start=1) if line.strip()]
    assert got == expected


# -- the fast JSON parser reads what json reads ---------------------------------------------------
_ODD_LINES = [
    b'{"text": "plain"}', b'{"text": NaN}', b'{"n": 1e400, "text": "inf beside"}',
    b'{"n": 123456789012345678901234567890, "text": "big int beside"}', b'\xef\xbb\xbf{"text": "bom"}',
    b'{"text": "lone \\ud800 surrogate"}', b'{"text": "pair \\ud83d\\ude00"}', b"[1, 2]", b'"a string"', b"null",
    b'{"other": 1}', b'{"text": 5}', b'{"text": null}', b'{"meta": {"text": "nested"}}',
    b'{"meta.text": "dotted", "text": "top"}', b'{"text": "a", "text": "duplicate"}', b'{"text": "x",}',
    b'{"text": "raw \x01 control"}', b'{"text": "bad \xff utf8"}', b"   ", b"\t", b"\r", b'{"text": "crlf"}\r',
    "\u00a0".encode(), b"\x1c", "\u2028".encode(), b'{"text": "trailing"} junk', b'{"text": "\\u0000 nul"}',
    b'{"text": ""}', b"{}", b'{"text": "emoji \xf0\x9f\x98\x80 and \xe4\xb8\xad\xe6\x96\x87"}',
]


def _reference_parse(payload: bytes, first_line: int, text_key: str):
    """The JSONL rules, line by line with json (slow and plain): texts and bad records."""
    texts, bad = [], []
    for offset, raw in enumerate(payload.split(b"\n")):
        number = first_line + offset
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            bad.append((number, "invalid_utf8"))
            continue
        if not line or line.isspace():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            bad.append((number, "malformed_json"))
            continue
        if not isinstance(obj, dict):
            bad.append((number, "not_an_object"))
            continue
        value, found = obj, True
        if text_key in obj:
            value = obj[text_key]
        else:
            for part in text_key.split("."):
                if not isinstance(value, dict) or part not in value:
                    found = False
                    break
                value = value[part]
        if not found:
            bad.append((number, "missing_key"))
        elif not isinstance(value, str):
            bad.append((number, "not_a_string"))
        else:
            texts.append((number, value))
    return texts, bad


@settings(max_examples=150, deadline=None)
@given(lines=st.lists(st.one_of(st.sampled_from(_ODD_LINES),
                                st.text(max_size=40).map(lambda t: json.dumps({"text": t}).encode()),
                                st.text(max_size=40).map(lambda t: json.dumps({"text": t}, ensure_ascii=False)
                                                         .encode("utf-8", "surrogatepass"))),
                      max_size=25),
       text_key=st.sampled_from(["text", "meta.text"]), first_line=st.integers(1, 1000))
def test_fast_json_path_reads_what_json_reads(lines, text_key, first_line):
    """orjson parses the common line, json every other one: the texts, line numbers and bad
    records are those of a plain json reading, with orjson or without it."""
    from tokenloom.tokenization import inputs
    from tokenloom.tokenization.inputs import RawChunk

    pytest.importorskip("orjson")
    payload = b"\n".join(lines) + b"\n"
    chunk = RawChunk(path="x.jsonl", kind="jsonl", first_line=first_line, payload=payload, num_bytes=len(payload),
                     input_bytes_done=len(payload))
    expected = _reference_parse(payload, first_line, text_key)
    for fast in (True, False):
        with pytest.MonkeyPatch.context() as patch:
            if not fast:
                patch.setattr(inputs, "_fast_json_loads", lambda: None)
            parsed = parse_chunk(chunk, text_key=text_key)
        assert list(zip(parsed.line_numbers, parsed.texts)) == expected[0], fast
        assert [(b.line_number, b.reason) for b in parsed.bad] == expected[1], fast
