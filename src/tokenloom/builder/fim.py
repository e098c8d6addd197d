"""A build config's fill-in-the-middle, made ready to serve: the stores' tokenizer found and checked.

FIM cuts a sample's *text*, so serving needs the tokenizer the permuted stores were written with.
Each store's ``PREFIX.meta.json`` records it (``tokenloom tokenize``: kind, path, SHA-256); this
module loads it once per opened build, refuses stores tokenized by different tokenizers or by one
that is not a HuggingFace ``tokenizer.json`` (FIM needs the sentinel tokens in its vocabulary),
and checks the sentinels, so a config that cannot be served fails when the build opens, naming
the store and the file, rather than at the first permuted sample.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence

from tokenloom.errors import ConfigError
from tokenloom.source.fim_options import FIM_TOKEN_KEYS, FimConfig, FimSettings
from tokenloom.tokenization.tokenizers import load_tokenizer


def _file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fim_settings(fim: FimConfig, *, seed: int, prefixes: Sequence[str],
                 metadata_of: Callable[[str], dict | None]) -> FimSettings:
    """``fim`` over the build's stores ``prefixes`` (those it permutes: ``fim.stores``, else
    every one), with the tokenizer their sidecars record (``metadata_of(prefix)``: the store's
    ``PREFIX.meta.json``). ConfigError naming the store and the tokenizer file when a store has
    no HuggingFace tokenizer record, two stores differ, the file is gone or changed since, or a
    sentinel of ``fim_extra_tokens`` is not one of its tokens."""
    permuted = list(dict.fromkeys(fim.stores if fim.stores is not None else prefixes))
    chosen: tuple[str, dict] | None = None
    for prefix in permuted:
        record = (metadata_of(prefix) or {}).get("tokenizer") or {}
        if record.get("kind") != "huggingface" or not record.get("path"):
            raise ConfigError(f"fim: store {prefix!r} was tokenized with {record.get('kind') or 'no recorded'} "
                              "tokenizer; FIM cuts a sample's text and needs the HuggingFace tokenizer.json it was "
                              "tokenized with (tokenloom tokenize --tokenizer PATH records it): list only such stores "
                              "in fim.stores")
        if chosen is None:
            chosen = (prefix, record)
        elif record.get("sha256") != chosen[1].get("sha256"):
            raise ConfigError(f"fim: stores {chosen[0]!r} and {prefix!r} were tokenized by different tokenizers "
                              f"({chosen[1].get('path')} and {record.get('path')}); FIM re-encodes with one: "
                              "permute the stores of one tokenizer")
    if chosen is None:
        raise ConfigError("fim: the config names no store to permute")
    prefix, record = chosen
    path = str(record["path"])
    if not os.path.isfile(path):
        raise ConfigError(f"fim: store {prefix!r} was tokenized with {path}, which is not there now; FIM needs that "
                          "tokenizer.json to cut and re-encode its samples")
    if record.get("sha256") and _file_sha256(path) != record["sha256"]:
        raise ConfigError(f"fim: {path} changed since store {prefix!r} was tokenized with it (SHA-256 "
                          f"{str(record['sha256'])[:12]}... recorded); FIM would re-encode with another tokenizer")
    codec = load_tokenizer(path, require_eod=False)
    for key in FIM_TOKEN_KEYS:
        spelt = fim.options.extra_tokens[key]
        if codec.token_id(spelt) is None:
            raise ConfigError(f"fim: fim_extra_tokens[{key!r}]={spelt!r} is not a token of {path} (the tokenizer "
                              f"of store {prefix!r}); expected a special token of its vocabulary")
    if fim.options.split_sample is not None and codec.token_id(fim.options.split_sample) is None:
        raise ConfigError(f"fim: fim_split_sample={fim.options.split_sample!r} is not a token of {path} (the "
                          f"tokenizer of store {prefix!r})")
    return FimSettings(options=fim.options, stores=fim.stores, codec=codec, seed=int(seed))


__all__ = ["fim_settings"]
