"""HuggingFace tokenizer.json path, with tiny tokenizers built here (no downloads)."""

from __future__ import annotations

import filecmp
import hashlib
import json
import pickle

import numpy as np
import pytest

tokenizers = pytest.importorskip("tokenizers")

from tokenloom.errors import ConfigError  # noqa: E402
from tokenloom.io import IndexedDataset  # noqa: E402
from tokenloom.tokenization import HuggingFaceTokenizer, TokenizeConfig, load_tokenizer, tokenize_to_store  # noqa: E402

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "pack my box with five dozen liquor jugs",
    "Ünïcödé wörds and emoji 🙂 are bytes too",
    "def tokenize(text): return text.split()",
] * 20


def _train_bpe(path, *, special_tokens=("<|endoftext|>",), vocab_size=400) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return str(path)


def _word_level(path, vocab: dict[str, int]) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path))
    return str(path)


@pytest.fixture(scope="module")
def bpe_path(tmp_path_factory):
    return _train_bpe(tmp_path_factory.mktemp("bpe") / "tiny-bpe" / "tokenizer.json")


def test_pipeline_matches_the_tokenizers_own_encode(tmp_path, bpe_path):
    texts = [f"{CORPUS[i % 4]} number {i}" for i in range(400)] + ["", "never seen: zyxw 🙃"]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    reference = tokenizers.Tokenizer.from_file(bpe_path)
    eod = reference.token_to_id("<|endoftext|>")
    expected = [[*reference.encode(t, add_special_tokens=False).ids, eod] for t in texts if t]

    prefixes = []
    for workers in (0, 2):
        prefix = str(tmp_path / f"w{workers}")
        config = TokenizeConfig(tokenizer=bpe_path, workers=workers, chunk_bytes=2000)
        summary = tokenize_to_store([str(path)], prefix, config)
        prefixes.append(prefix)
    ds = IndexedDataset(prefixes[0])
    assert [ds.get(i).tolist() for i in range(len(ds))] == expected
    assert ds.dtype == np.uint16 and summary.num_empty == 1
    for suffix in (".bin", ".idx", ".meta.json"):
        assert filecmp.cmp(prefixes[0] + suffix, prefixes[1] + suffix, shallow=False)
    record = ds.metadata["tokenizer"]
    assert record == {
        "kind": "huggingface", "name": "tiny-bpe", "path": bpe_path,
        "sha256": hashlib.sha256(open(bpe_path, "rb").read()).hexdigest(),
        "vocab_size": reference.get_vocab_size(with_added_tokens=True), "eod_id": eod, "append_eod": True,
    }


def test_eod_id_comes_from_option_config_or_known_special_token(tmp_path):
    vocab = {"[UNK]": 0, "a": 1, "b": 2, "</s>": 3, "<end>": 4}
    path = _word_level(tmp_path / "tokenizer.json", vocab)
    assert load_tokenizer(path).eod_id == 3  # a known name
    assert load_tokenizer(str(tmp_path)).eod_id == 3  # the directory works too
    assert load_tokenizer(path, eod_id=1).eod_id == 1  # the option wins
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<end>"}}))
    assert load_tokenizer(path).eod_id == 4  # tokenizer_config.json's eos_token wins over guessing
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        load_tokenizer(path, eod_id=5)


def test_missing_eod_needs_an_id_or_no_eod(tmp_path):
    path = _word_level(tmp_path / "tokenizer.json", {"[UNK]": 0, "a": 1, "b": 2})
    with pytest.raises(ConfigError, match="cannot tell the end-of-document token"):
        load_tokenizer(path)
    data = tmp_path / "d.txt"
    data.write_text("a b a zzz\n")
    tokenize_to_store([str(data)], str(tmp_path / "out"), TokenizeConfig(tokenizer=path, append_eod=False, workers=0))
    ds = IndexedDataset(tmp_path / "out")
    assert ds.get(0).tolist() == [1, 2, 1, 0]
    assert ds.metadata["tokenizer"]["eod_id"] is None and ds.metadata["tokenizer"]["append_eod"] is False


def test_large_vocabulary_is_stored_as_int32(tmp_path):
    vocab = {f"w{i}": i for i in range(70_000)}
    vocab["<|endoftext|>"] = 70_000
    path = _word_level(tmp_path / "tokenizer.json", vocab)
    data = tmp_path / "d.txt"
    data.write_text("w1 w69999 w65535\n")
    tokenize_to_store([str(data)], str(tmp_path / "out"), TokenizeConfig(tokenizer=path, workers=0))
    ds = IndexedDataset(tmp_path / "out")
    assert ds.dtype == np.int32
    assert ds.get(0).tolist() == [1, 69_999, 65_535, 70_000]


def test_tokenizer_pickles_for_workers_and_bad_paths_are_config_errors(tmp_path, bpe_path):
    tokenizer = HuggingFaceTokenizer(bpe_path)
    clone = pickle.loads(pickle.dumps(tokenizer))
    tokens, lengths = clone.encode_batch(["the fox", "dog"])
    expected_tokens, expected_lengths = tokenizer.encode_batch(["the fox", "dog"])
    assert tokens.tolist() == expected_tokens.tolist() and lengths.tolist() == expected_lengths.tolist()
    with pytest.raises(ConfigError, match="no such file"):
        load_tokenizer(str(tmp_path / "missing.json"))
    (tmp_path / "broken.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"not a loadable HuggingFace tokenizer\.json"):
        load_tokenizer(str(tmp_path / "broken.json"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"no tokenizer\.json"):
        load_tokenizer(str(tmp_path / "empty"))


def test_lone_surrogate_is_reported_by_line_with_the_huggingface_tokenizer(tmp_path, bpe_path):
    from tokenloom.errors import InputError

    path = tmp_path / "s.jsonl"
    path.write_text('{"text": "fine"}\n{"text": "bad \\udc80 text"}\n{"text": "fine again"}\n')
    with pytest.raises(InputError, match=rf"^{path}:2: text is not valid Unicode: lone surrogate U\+DC80"):
        tokenize_to_store([str(path)], str(tmp_path / "out"), TokenizeConfig(tokenizer=bpe_path, workers=0))
    summary = tokenize_to_store([str(path)], str(tmp_path / "out"),
                                TokenizeConfig(tokenizer=bpe_path, workers=0, skip_bad=True))
    assert dict(summary.skipped) == {"invalid_unicode": 1} and summary.num_documents == 2
