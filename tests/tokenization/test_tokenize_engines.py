"""Encoding engines: gigatoken where it covers a tokenizer.json, the tokenizers library where it
does not, the same ids either way, and a guard that stops a run at the first difference.

The five tokenizer families (``tokenization_fixtures``): gigatoken covers three, and the Unigram
model and the NFKC-normalised BPE must fall back and say so.
"""

from __future__ import annotations

import functools
import json
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("gigatoken")

from tokenization_fixtures import COVERED, NOT_COVERED  # noqa: E402
from tokenization_fixtures import corpus_files as _corpus_files  # noqa: E402
from tokenloom.cli import main as cli_main  # noqa: E402
from tokenloom.errors import ConfigError  # noqa: E402
from tokenloom.tokenization import TokenizeConfig, engines, load_tokenizer, pipeline, tokenize_to_store  # noqa: E402

TRICKY = [
    "",
    "a",
    "héllo wörld: e\u0301 (NFD) é (NFC), Å Å, ﬁ ligature, Ｆｕｌｌｗｉｄｔｈ, ① ², ǅ",
    "emoji 😀 👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️",
    "中文分词 日本語のテキスト 한국어 텍스트 ไทย العربية עברית",
    " " * 5000 + "x" + "\n" * 3000 + "\t" * 100 + "\r\n" * 50,
    "\x00\x01\x02\x1b[31mred\x1b[0m\x7f\x85\u2028\u2029\ufeff",
    "x <|endoftext|> y <|endoftext|><|endoftext|>",
    "it's they're we've I'm you'll he'd IT'S 1234567 3.14159 0x1F",
    "def f(x):\n    return x ** 2  # comment\n\n\nclass A:\n\tpass\n",
]


def _reference(path: str, texts) -> list[list[int]]:
    tokenizer = tokenizers.Tokenizer.from_file(path)
    return [e.ids for e in tokenizer.encode_batch(list(texts), add_special_tokens=False)]


@functools.cache
def _loaded(path: str):
    """One tokenizer per file for the hypothesis tests: loading (and reading the cached code point
    scan) costs more than an example."""
    return load_tokenizer(path)


def _split(tokens, lengths) -> list[list[int]]:
    return [part.tolist() for part in np.split(tokens, np.cumsum(lengths)[:-1])] if len(lengths) else []


def test_auto_takes_gigatoken_where_it_covers_the_tokenizer_and_says_why_not_elsewhere(tokenizer_files):
    for name in COVERED:
        tokenizer = load_tokenizer(tokenizer_files[name])
        assert (tokenizer.engine, tokenizer.engine_note) == ("gigatoken", None), name
    for name, why in (("unigram", 'Unsupported model type "Unigram"'), ("bpe_nfkc", "Unsupported normalizer")):
        tokenizer = load_tokenizer(tokenizer_files[name])
        assert tokenizer.engine == "hf", name
        assert tokenizer.engine_note.startswith("gigatoken does not cover this tokenizer:") and why in \
            tokenizer.engine_note, tokenizer.engine_note
        assert load_tokenizer(tokenizer_files[name], engine="hf").engine_note is None
    assert load_tokenizer(tokenizer_files["gpt2"], engine="hf").engine == "hf"


def test_forcing_an_engine_that_cannot_run_is_refused_by_name(tokenizer_files):
    with pytest.raises(ConfigError, match=r"unigram.json: engine='gigatoken' but gigatoken does not cover this "
                                          r"tokenizer: Unsupported model type \"Unigram\".*engine='hf'"):
        load_tokenizer(tokenizer_files["unigram"], engine="gigatoken")
    with pytest.raises(ConfigError, match="engine='fast'; expected one of"):
        TokenizeConfig(engine="fast")
    with pytest.raises(ConfigError, match="engine='hf' with the byte tokenizer"):
        load_tokenizer("bytes", engine="hf")


@pytest.mark.parametrize("name", COVERED + NOT_COVERED)
def test_every_family_encodes_the_tricky_texts_as_the_tokenizers_library_does(tokenizer_files, name):
    tokenizer = load_tokenizer(tokenizer_files[name])
    texts = [*TRICKY, "".join(open(f, encoding="utf-8").read() for f in _corpus_files()[:30])]  # ~1 MB
    assert len(texts[-1]) > 500_000
    assert _split(*tokenizer.encode_batch(texts)) == _reference(tokenizer_files[name], texts)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=st.lists(st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=300), min_size=1,
                      max_size=6))
def test_random_text_gets_the_same_ids_from_gigatoken(tokenizer_files, texts):
    for name in COVERED:
        tokenizer = _loaded(tokenizer_files[name])
        assert tokenizer.engine == "gigatoken"
        assert _split(*tokenizer.encode_batch(texts)) == _reference(tokenizer_files[name], texts), name
        assert _split(*tokenizer.encode_texts(texts)) == _reference(tokenizer_files[name], texts), name  # few


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_decode_gives_the_tokenizers_library_text_on_any_ids(tokenizer_files, data):
    """FIM decodes by gigatoken where the tokenizer is byte-level: the text must stay the
    ``tokenizers`` library's, special tokens skipped, on any ids, broken UTF-8 included (a
    sample cut inside a character), and every id of the vocabulary alone."""
    for name in COVERED + NOT_COVERED:
        tokenizer = _loaded(tokenizer_files[name])
        reference = tokenizers.Tokenizer.from_file(tokenizer_files[name])
        size = reference.get_vocab_size(with_added_tokens=True)
        low = st.integers(0, 300)  # the byte tokens and first merges: most ways to break UTF-8
        batch = data.draw(st.lists(st.lists(st.one_of(low, st.integers(0, size - 1)), max_size=40), max_size=4))
        expected = reference.decode_batch(batch, skip_special_tokens=True)
        assert tokenizer.decode_batch(batch) == expected, name
        assert [tokenizer.decode(ids) for ids in batch] == expected, name
    assert load_tokenizer(tokenizer_files["gpt2"])._gigatoken_drops() is not None  # the fast path is tested


def test_decode_of_each_id_and_of_added_tokens_that_are_not_special(tokenizer_files, tmp_path):
    for name in ("gpt2", "llama3"):
        tokenizer = load_tokenizer(tokenizer_files[name])
        reference = tokenizers.Tokenizer.from_file(tokenizer_files[name])
        every = [[i] for i in range(reference.get_vocab_size(with_added_tokens=True))]
        assert tokenizer.decode_batch(every) == reference.decode_batch(every, skip_special_tokens=True), name
    spec = json.load(open(tokenizer_files["gpt2"], encoding="utf-8"))
    spec["added_tokens"].append({**spec["added_tokens"][0], "id": len(spec["model"]["vocab"]) + 5,
                                 "content": "<file sep>", "special": False})
    path = tmp_path / "added.json"
    path.write_text(json.dumps(spec), encoding="utf-8")
    tokenizer, reference = load_tokenizer(str(path)), tokenizers.Tokenizer.from_file(str(path))
    assert tokenizer._gigatoken_drops() is None  # a non-special added token: tokenizers decodes
    ids = [[spec["added_tokens"][-1]["id"], 0, 40, 41]]
    assert tokenizer.decode_batch(ids) == reference.decode_batch(ids, skip_special_tokens=True)


def _jsonl(path, texts) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
        f.write('{"text": "a lone surrogate \\ud800 in JSON"}\n')  # skipped by both engines alike
        f.write(json.dumps({"text": "the end"}) + "\n")
    return str(path)


@pytest.mark.parametrize("name", ["gpt2", "sentencepiece_bpe"])
def test_a_store_made_with_gigatoken_is_byte_identical_to_one_made_with_tokenizers(tokenizer_files, tmp_path, name):
    texts = TRICKY + [open(f, encoding="utf-8").read() for f in _corpus_files()[:40]]
    source = _jsonl(tmp_path / "in.jsonl", texts)
    made = {}
    runs = (("gigatoken", 0, False), ("gigatoken", 2, False), ("gigatoken", 3, True), ("hf", 0, False))
    for engine, workers, threads in runs:
        prefix = str(tmp_path / f"{engine}-{workers}-{threads}")
        summary = tokenize_to_store([source], prefix, TokenizeConfig(tokenizer=tokenizer_files[name], engine=engine,
                                                                     workers=workers, threads=threads, skip_bad=True,
                                                                     chunk_bytes=64 * 1024))
        assert summary.engine == engine and summary.skipped == {"invalid_unicode": 1}
        made[runs.index((engine, workers, threads))] = {
            ext: open(prefix + ext, "rb").read() for ext in (".bin", ".idx", ".meta.json")}
    assert made[0] == made[1] == made[2] == made[3]


def test_the_guard_stops_a_run_at_the_first_document_the_engines_disagree_on(tokenizer_files, tmp_path, monkeypatch):
    """gigatoken made to get one id of the third document wrong: the run stops naming file:line
    and the position, and no store is left."""
    original = engines.GigatokenEncoder.encode_batch

    def wrong_in_the_third(self, texts):
        tokens, lengths = original(self, texts)
        for i, text in enumerate(texts):
            if text.startswith("the third"):
                tokens = tokens.copy()
                tokens[lengths[:i].sum() + 4] += 1
        return tokens, lengths

    monkeypatch.setattr(engines.GigatokenEncoder, "encode_batch", wrong_in_the_third)
    source = _jsonl(tmp_path / "in.jsonl", ["first document", "second one", "the third document, long enough"])
    prefix = str(tmp_path / "store")
    for workers, threads in ((0, False), (2, True)):  # threads share the patched encoder
        with pytest.raises(ConfigError, match=r"in.jsonl:3: gigatoken and the tokenizers library encode this "
                                              r"document differently from its token 4 on .*nothing was written"
                                              r".*engine='hf'"):
            tokenize_to_store([source], prefix, TokenizeConfig(tokenizer=tokenizer_files["gpt2"], workers=workers,
                                                               threads=threads, skip_bad=True, chunk_bytes=20))
        assert not [f for f in os.listdir(tmp_path) if f.startswith("store")]
    # past the guard's budget a run trusts gigatoken: the wrong id is not looked for there
    monkeypatch.setattr(pipeline, "GUARD_CHARACTERS", 10)  # the first document only
    tokenize_to_store([source], prefix, TokenizeConfig(tokenizer=tokenizer_files["gpt2"], workers=0, skip_bad=True))
    assert os.path.exists(prefix + ".bin")


def test_threads_are_the_default_with_gigatoken_and_processes_elsewhere(tokenizer_files, tmp_path, capsys):
    source = _jsonl(tmp_path / "in.jsonl", [f"text number {i}" for i in range(200)])
    gpt2 = tokenizer_files["gpt2"]
    runs = {}
    for name, options in [("giga", {"tokenizer": gpt2}),
                          ("giga_processes", {"tokenizer": gpt2, "threads": False, "workers": 2}),
                          ("hf", {"tokenizer": gpt2, "engine": "hf", "workers": 2}),
                          ("bytes", {"workers": 2})]:
        config = TokenizeConfig(chunk_bytes=500, skip_bad=True, **options)
        runs[name] = tokenize_to_store([source], str(tmp_path / name), config)
    cores = os.cpu_count() or 1
    assert (runs["giga"].threads, runs["giga"].workers) == (True, min(cores, pipeline.DEFAULT_THREADS))
    assert [(runs[n].threads, runs[n].workers) for n in ("giga_processes", "hf", "bytes")] == [(False, 2)] * 3
    assert cli_main(["tokenize", source, "-o", str(tmp_path / "cli"), "--tokenizer", gpt2, "--workers", "3",
                     "--skip-bad", "-q"]) == 0
    assert "engine gigatoken, 3 worker threads" in capsys.readouterr().out
    assert cli_main(["tokenize", source, "-o", str(tmp_path / "cli2"), "--tokenizer", gpt2, "--workers", "1",
                     "--processes", "--skip-bad", "-q"]) == 0
    assert "engine gigatoken, 1 worker process" in capsys.readouterr().out


def test_the_command_says_which_engine_ran_and_maps_a_refusal_to_its_flag(tokenizer_files, tmp_path, capsys):
    source = _jsonl(tmp_path / "in.jsonl", ["some text", "more text"])
    assert cli_main(["tokenize", source, "-o", str(tmp_path / "a"), "--tokenizer", tokenizer_files["gpt2"],
                     "--workers", "0", "--skip-bad", "-q"]) == 0
    assert "engine gigatoken, in the calling thread" in capsys.readouterr().out
    assert cli_main(["tokenize", source, "-o", str(tmp_path / "b"), "--tokenizer", tokenizer_files["unigram"],
                     "--workers", "0", "--skip-bad", "-q"]) == 0
    assert 'engine hf (gigatoken does not cover this tokenizer: Unsupported model type "Unigram"' in \
        capsys.readouterr().out
    assert cli_main(["tokenize", source, "-o", str(tmp_path / "c"), "--tokenizer", tokenizer_files["unigram"],
                     "--engine", "gigatoken", "--workers", "0", "-q"]) == 2
    assert "(--engine hf)" in capsys.readouterr().err
