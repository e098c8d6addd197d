"""Tokenizers of five families, trained here on standard-library sources (no downloads), shared by
the engine and identity tests: GPT-2 style byte-level BPE, a Llama-3 style split regex before
byte-level BPE, SentencePiece-style BPE with byte fallback (all three covered by gigatoken), and
a Unigram model and an NFKC-normalised BPE, which gigatoken refuses."""

from __future__ import annotations

import glob
import os

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
COVERED = ("gpt2", "llama3", "sentencepiece_bpe")
NOT_COVERED = ("unigram", "bpe_nfkc")


def corpus_files() -> list[str]:
    return sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))[:60]


def train_tokenizer_files(directory) -> dict[str, str]:
    """The five families' tokenizer.json files under ``directory``, by family name."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    files = corpus_files()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    out = {}

    def bpe(name, pre_tokenizer, *, normalizer=None, byte_fallback=False, decoder=None, initial=alphabet):
        model = models.BPE(byte_fallback=True, unk_token="<unk>") if byte_fallback else models.BPE()
        tokenizer = Tokenizer(model)
        tokenizer.pre_tokenizer = pre_tokenizer
        if normalizer is not None:
            tokenizer.normalizer = normalizer
        if decoder is not None:
            tokenizer.decoder = decoder
        special = ["<|endoftext|>"] + (["<unk>"] + [f"<0x{i:02X}>" for i in range(256)] if byte_fallback else [])
        tokenizer.train(files, trainers.BpeTrainer(vocab_size=2000, special_tokens=special, initial_alphabet=initial,
                                                   show_progress=False))
        out[name] = str(directory / f"{name}.json")
        tokenizer.save(out[name])

    bpe("gpt2", pre_tokenizers.ByteLevel(add_prefix_space=False), decoder=decoders.ByteLevel())
    bpe("llama3", pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
                                           pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
        decoder=decoders.ByteLevel())
    bpe("sentencepiece_bpe", pre_tokenizers.Metaspace(), byte_fallback=True, initial=[],
        decoder=decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback()]))
    bpe("bpe_nfkc", pre_tokenizers.ByteLevel(add_prefix_space=False), normalizer=normalizers.NFKC())
    unigram = Tokenizer(models.Unigram())
    unigram.pre_tokenizer = pre_tokenizers.Metaspace()
    unigram.train(files, trainers.UnigramTrainer(vocab_size=1500, special_tokens=["<|endoftext|>", "<unk>"],
                                                 unk_token="<unk>", show_progress=False))
    out["unigram"] = str(directory / "unigram.json")
    unigram.save(out["unigram"])
    return out
