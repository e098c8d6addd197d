"""tokenize_to_store end to end with the byte tokenizer: contents, determinism, sidecar."""

from __future__ import annotations

import filecmp
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenloom.errors import ConfigError, FormatError
from tokenloom.io import IndexedDataset
from tokenloom.tokenization import (
    TokenizeConfig,
    TokenizerRecord,
    load_tokenizer_record,
    tokenize_to_store,
)


def _write_jsonl(path, texts, key="text") -> str:
    with open(path, "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({key: text}) + "\n")
    return str(path)


def _stored(prefix) -> list[list[int]]:
    ds = IndexedDataset(prefix)
    return [ds.get(i).tolist() for i in range(len(ds))]


def _byte_reference(texts, *, append_eod=True) -> list[list[int]]:
    """The obviously-correct answer: each non-empty text's UTF-8 bytes, then 256."""
    return [list(t.encode()) + ([256] if append_eod else []) for t in texts if t]


_texts = st.lists(st.text(st.characters(blacklist_categories=("Cs",)), max_size=40), max_size=30)


@settings(max_examples=40, deadline=None)
@given(texts=_texts, chunk_bytes=st.integers(1, 300), append_eod=st.booleans())
def test_inline_pipeline_matches_reference(tmp_path_factory, texts, chunk_bytes, append_eod):
    directory = tmp_path_factory.mktemp("p")
    path = _write_jsonl(directory / "in.jsonl", texts)
    config = TokenizeConfig(workers=0, chunk_bytes=chunk_bytes, append_eod=append_eod)
    summary = tokenize_to_store([path], str(directory / "out"), config)
    expected = _byte_reference(texts, append_eod=append_eod)
    assert _stored(directory / "out") == expected
    assert summary.num_documents == len(expected)
    assert summary.num_tokens == sum(map(len, expected))
    assert summary.num_empty == sum(1 for t in texts if not t)
    assert IndexedDataset(directory / "out").dtype == np.uint16


def test_output_is_byte_identical_for_any_worker_count(tmp_path):
    rng = np.random.default_rng(0)
    words = ["alpha", "βeta", "gamma", "δέλτα", "🙂", "x" * 50]
    paths = []
    for f in range(3):
        texts = [" ".join(rng.choice(words, size=rng.integers(0, 40))) for _ in range(700)]
        paths.append(_write_jsonl(tmp_path / f"part{f}.jsonl", texts))
    outputs = []
    for workers, chunk_bytes, threads in [(0, 1 << 20, False), (1, 4096, False), (2, 1000, False), (3, 333, False),
                                          (3, 777, True)]:
        prefix = str(tmp_path / f"w{workers}{'t' if threads else ''}")
        tokenize_to_store([str(tmp_path / "part*.jsonl")], prefix,
                          TokenizeConfig(workers=workers, chunk_bytes=chunk_bytes, threads=threads))
        outputs.append(prefix)
    for other in outputs[1:]:
        for suffix in (".bin", ".idx", ".meta.json"):
            assert filecmp.cmp(outputs[0] + suffix, other + suffix, shallow=False), (other, suffix)
    texts = [json.loads(line)["text"] for p in paths for line in open(p, encoding="utf-8")]
    assert _stored(outputs[0]) == _byte_reference(texts)


def test_sidecar_records_tokenizer_and_source(tmp_path):
    path = _write_jsonl(tmp_path / "in.jsonl", ["ab", "", "c"])
    with open(path, "a") as f:
        f.write("not json\n")
    summary = tokenize_to_store([path], str(tmp_path / "out"), TokenizeConfig(workers=0, skip_bad=True))
    metadata = IndexedDataset(tmp_path / "out").metadata
    assert metadata["tokenizer"] == {
        "kind": "bytes", "name": "bytes", "path": None, "sha256": None,
        "vocab_size": 257, "eod_id": 256, "append_eod": True,
    }
    assert metadata["source"] == {
        "inputs": [path], "input_format": "auto", "text_key": "text", "column": "text", "lines": False,
        "documents": 2, "tokens": 5, "empty_documents": 1, "skipped": {"malformed_json": 1},
    }
    record = load_tokenizer_record(metadata)
    assert record == summary.tokenizer
    assert TokenizerRecord.from_dict(record.to_dict()) == record


def test_tokenizer_record_rejects_inconsistent_fields():
    good = TokenizerRecord(kind="bytes", name="bytes", path=None, sha256=None, vocab_size=257, eod_id=256,
                           append_eod=True).to_dict()
    for change in ({"kind": "sentencepiece"}, {"eod_id": 257}, {"vocab_size": 0}, {"eod_id": None}):
        with pytest.raises(FormatError):
            TokenizerRecord.from_dict({**good, **change})
    with pytest.raises(FormatError, match="missing field"):
        TokenizerRecord.from_dict({k: v for k, v in good.items() if k != "vocab_size"})
    assert load_tokenizer_record(None) is None and load_tokenizer_record({"other": 1}) is None


def test_mixed_formats_in_one_store(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    _write_jsonl(tmp_path / "a.jsonl", ["json doc"])
    (tmp_path / "b.txt").write_text("text doc\nsecond line\n")
    pq.write_table(pa.table({"text": ["parquet doc"]}), tmp_path / "c.parquet")
    tokenize_to_store([str(tmp_path)], str(tmp_path / "out"), TokenizeConfig(workers=0))
    assert _stored(tmp_path / "out") == _byte_reference(["json doc", "text doc\nsecond line\n", "parquet doc"])
    tokenize_to_store([str(tmp_path)], str(tmp_path / "lines"), TokenizeConfig(workers=0, lines=True, append_eod=False))
    expected = _byte_reference(["json doc", "text doc", "second line", "parquet doc"], append_eod=False)
    assert _stored(tmp_path / "lines") == expected


def test_progress_reports_every_document_token_and_input_byte(tmp_path):
    paths = [_write_jsonl(tmp_path / f"{i}.jsonl", [f"doc {i} {j}" for j in range(500)]) for i in range(2)]
    seen = np.zeros(3, dtype=np.int64)
    calls = []

    def progress(documents, tokens, input_bytes):
        seen[:] += (documents, tokens, input_bytes)
        calls.append(documents)

    summary = tokenize_to_store(paths, str(tmp_path / "out"), TokenizeConfig(workers=0, chunk_bytes=2048),
                                progress=progress)
    assert seen.tolist() == [summary.num_documents, summary.num_tokens, sum(len(open(p, "rb").read()) for p in paths)]
    assert len(calls) > 2


def test_bad_config_values_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="workers"):
        TokenizeConfig(workers=-1)
    with pytest.raises(ConfigError, match=r"threads 'yes', expected True, False or None"):
        TokenizeConfig(threads="yes")
    with pytest.raises(ConfigError, match="chunk_bytes"):
        TokenizeConfig(chunk_bytes=0)
    with pytest.raises(ConfigError, match="input_format"):
        TokenizeConfig(input_format="csv")
    path = _write_jsonl(tmp_path / "in.jsonl", ["x"])
    with pytest.raises(ConfigError, match="fixed at 256"):
        tokenize_to_store([path], str(tmp_path / "out"), TokenizeConfig(eod_id=0, workers=0))
    with pytest.raises(ConfigError, match="does not exist"):
        tokenize_to_store([path], str(tmp_path / "no" / "out"), TokenizeConfig(workers=0))
