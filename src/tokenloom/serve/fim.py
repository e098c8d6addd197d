"""Fill-in-the-middle (FIM): Megatron-LM's transformation, with draws that do not depend on the layout.

Code models are pretrained on samples cut in three at two character positions and put back as
prefix-suffix-middle (PSM) or suffix-prefix-middle (SPM) between sentinel tokens (Bavarian et al.
2022). Megatron-LM's ``GPTFIMDataset`` (``megatron/training/datasets/fim_dataset.py``) does it per
sample: it splits the sample at its end-of-document tokens (and, with ``fim_split_sample``, each
piece again at that token), and for each piece draws whether to permute it, where to cut the
piece's *text* (detokenized without special tokens), and PSM or SPM; the parts are tokenized
again and the sample is cut or padded back to its length. Its draws come from one
``np.random.RandomState`` per dataset consumed in the order samples are read, so a resumed run,
another data-parallel layout or a DataLoader worker permutes other samples than the uninterrupted
run did.

:class:`FimTransform` is the same transformation, draw for draw, with one ``RandomState`` per
sample seeded by ``(seed, dataset, sample)`` (:meth:`FimTransform.sample_rng`): which samples are
permuted, and how, is a pure function of the sample, whatever reads it. Given that generator,
Megatron-LM's own code permutes the sample to the same tokens (the differential test drives
``GPTFIMDataset`` with it). The draws, in order, for each piece (FORMAT.md, "Fill in the middle"):

1. with ``split_sample`` and a piece holding that token: ``binomial(1, rate)``; 0 leaves the
   piece as it is, else each fragment between split tokens is permuted at ``fragment_rate``;
2. per piece (or fragment) permuted at rate ``r``: ``binomial(1, r)``; then, if 1 and the text
   does not start with ``no_prefix``, ``randint(0, len(text) + 1, size=2)`` (sorted: the two cut
   points) and ``binomial(1, spm_rate)`` (1: SPM).

The tokenizer is a :class:`FimCodec`: text out of ids with special tokens removed, ids out of
text, and the id of a special token (the sentinels must be in the vocabulary: ConfigError
otherwise).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from tokenloom.errors import ConfigError

#: The keys of Megatron-LM's ``fim_extra_tokens``, in its order.
FIM_TOKEN_KEYS = ("prefix", "middle", "suffix", "pad", "eod")


class FimCodec(Protocol):
    """What FIM needs of the tokenizer the store was written with."""

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``, special tokens left out (Megatron-LM's
        ``ids_to_text(ids, remove_special_tokens=True)``)."""

    def encode_text(self, text: str) -> Sequence[int]:
        """The ids of ``text``, no special tokens added (Megatron-LM's ``text_to_ids``)."""

    def token_id(self, token: str) -> int | None:
        """The id of the token spelt ``token`` (a special token), or None when the vocabulary
        has none."""


def _rate(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0.0 <= value <= 1.0:
        raise ConfigError(f"{name}={value!r}; expected a probability in [0, 1]")
    return float(value)


@dataclass(frozen=True)
class FimOptions:
    """FIM in Megatron-LM's vocabulary (``GPTFIMDatasetConfig``): ``rate`` is ``fim_rate``,
    ``spm_rate`` ``fim_spm_rate``, ``extra_tokens`` ``fim_extra_tokens`` (the spelling of the
    prefix, middle, suffix, pad and end-of-document tokens), ``split_sample``
    ``fim_split_sample``, ``fragment_rate`` ``fim_fragment_rate``, ``no_prefix`` ``fim_no_prefix``."""

    rate: float
    """Probability that a piece of a sample (between end-of-document tokens) is permuted."""
    extra_tokens: Mapping[str, str]
    """The tokens' spellings by :data:`FIM_TOKEN_KEYS`, e.g. ``{"prefix": "<fim_prefix>", ...}``."""
    spm_rate: float = 0.5
    """Probability that a permuted piece is SPM rather than PSM."""
    split_sample: str | None = None
    """A token (e.g. a file separator) at which a piece is split again, each fragment permuted
    on its own at ``fragment_rate``."""
    fragment_rate: float | None = None
    """Probability that a fragment is permuted (with ``split_sample``)."""
    no_prefix: str | None = None
    """A piece whose text starts with this is never permuted."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "rate", _rate("fim_rate", self.rate))
        object.__setattr__(self, "spm_rate", _rate("fim_spm_rate", self.spm_rate))
        if not isinstance(self.extra_tokens, Mapping) or set(self.extra_tokens) != set(FIM_TOKEN_KEYS) \
                or not all(isinstance(v, str) and v for v in self.extra_tokens.values()):
            raise ConfigError(f"fim_extra_tokens={self.extra_tokens!r}; expected the spelling of each of "
                              f"{', '.join(FIM_TOKEN_KEYS)}, e.g. {{'prefix': '<fim_prefix>', 'middle': "
                              "'<fim_middle>', 'suffix': '<fim_suffix>', 'pad': '<fim_pad>', 'eod': '<|endoftext|>'}")
        object.__setattr__(self, "extra_tokens", dict(self.extra_tokens))
        if self.split_sample is not None:
            if not isinstance(self.split_sample, str) or not self.split_sample:
                raise ConfigError(f"fim_split_sample={self.split_sample!r}; expected the spelling of one token")
            if self.fragment_rate is None:
                raise ConfigError(f"fim_split_sample={self.split_sample!r} without fim_fragment_rate; each fragment "
                                  "is permuted at that rate: give it (Megatron-LM fails on the first sample without)")
        if self.fragment_rate is not None:
            object.__setattr__(self, "fragment_rate", _rate("fim_fragment_rate", self.fragment_rate))
        if self.no_prefix is not None and not isinstance(self.no_prefix, str):
            raise ConfigError(f"fim_no_prefix={self.no_prefix!r}; expected a string or None")

    @classmethod
    def from_megatron(cls, values: Mapping[str, Any]) -> FimOptions:
        """From Megatron-LM's names (``fim_rate``, ``fim_spm_rate``, ``fim_extra_tokens``,
        ``fim_split_sample``, ``fim_fragment_rate``, ``fim_no_prefix``)."""
        known = {"fim_rate": "rate", "fim_spm_rate": "spm_rate", "fim_extra_tokens": "extra_tokens",
                 "fim_split_sample": "split_sample", "fim_fragment_rate": "fragment_rate",
                 "fim_no_prefix": "no_prefix"}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ConfigError(f"unknown FIM key(s) {unknown}; expected {', '.join(known)}")
        if "fim_rate" not in values or "fim_extra_tokens" not in values:
            raise ConfigError("FIM needs fim_rate and fim_extra_tokens (the prefix, middle, suffix, pad and eod "
                              "tokens)")
        return cls(**{known[key]: value for key, value in values.items()})


class FimTransform:
    """:class:`FimOptions` on one tokenizer: permutes samples as Megatron-LM's ``GPTFIMDataset``
    does, each from its own generator (see the module docstring)."""

    def __init__(self, options: FimOptions, codec: FimCodec, *, seed: int) -> None:
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 1 << 64:
            raise ConfigError(f"seed={seed!r}; expected an integer in [0, 2**64)")
        self.options, self.codec, self.seed = options, codec, int(seed)
        ids = {}
        for key in FIM_TOKEN_KEYS:
            spelt = options.extra_tokens[key]
            ids[key] = self._id(f"fim_extra_tokens[{key!r}]", spelt)
        self.prefix_id, self.middle_id, self.suffix_id = ids["prefix"], ids["middle"], ids["suffix"]
        self.pad_id, self.eod_id = ids["pad"], ids["eod"]
        self.split_id = None if options.split_sample is None else self._id("fim_split_sample", options.split_sample)

    def _id(self, what: str, spelt: str) -> int:
        found = self.codec.token_id(spelt)
        if found is None:
            raise ConfigError(f"{what}={spelt!r} is not a token of the tokenizer; expected a special token of its "
                              "vocabulary (add the FIM sentinels when training the tokenizer)")
        return int(found)

    def sample_rng(self, dataset: int, sample: int) -> np.random.RandomState:
        """The generator of sample ``sample`` of dataset ``dataset``: a ``RandomState`` seeded
        with four 32-bit words of BLAKE2b over ``(seed, dataset, sample)``."""
        digest = hashlib.blake2b(f"tokenloom.fim\0{self.seed}\0{int(dataset)}\0{int(sample)}".encode(),
                                 digest_size=16).digest()
        return np.random.RandomState(np.frombuffer(digest, dtype="<u4"))

    def apply(self, sample: np.ndarray, rng: np.random.RandomState) -> np.ndarray:
        """``sample`` (1-D ids) permuted piece by piece with ``rng``, cut or padded (with the pad
        token) back to its length: Megatron-LM's ``_query_document_sample_shuffle_indices``
        after the read. An empty piece between two end-of-document tokens is dropped with the
        second one, as there (the sample is padded at its end instead)."""
        sample = np.asarray(sample, dtype=np.int64)
        length = sample.shape[0]
        breaks = np.flatnonzero(sample == self.eod_id)
        if breaks.shape[0]:
            parts: list[np.ndarray] = []
            start = 0
            for at in breaks.tolist():
                if at > start:
                    parts += [self._split_and_permute(sample[start:at], rng), np.array([self.eod_id], np.int64)]
                start = at + 1
            parts.append(self._split_and_permute(sample[start:], rng))
            out = np.concatenate(parts)
        else:
            out = self._split_and_permute(sample, rng)
        if out.shape[0] >= length:
            return out[:length]
        return np.concatenate([out, np.full(length - out.shape[0], self.pad_id, dtype=np.int64)])

    def apply_rows(self, rows: np.ndarray, dataset_ids, sample_ids) -> np.ndarray:
        """``(B, W)`` rows, each permuted with its own sample's generator (a new array)."""
        rows = np.asarray(rows, dtype=np.int64)
        out = np.empty_like(rows)
        for k, (d, s) in enumerate(zip(np.asarray(dataset_ids).tolist(), np.asarray(sample_ids).tolist())):
            out[k] = self.apply(rows[k], self.sample_rng(d, s))
        return out

    # -- Megatron-LM's steps, draw for draw ------------------------------------------------------
    def _split_and_permute(self, piece: np.ndarray, rng: np.random.RandomState) -> np.ndarray:
        if self.split_id is None:
            return self._permute(piece, self.options.rate, rng)
        breaks = np.flatnonzero(piece == self.split_id)
        if not breaks.shape[0]:
            return self._permute(piece, self.options.rate, rng)
        if not rng.binomial(1, self.options.rate):
            return piece
        parts: list[np.ndarray] = []
        start = 0
        for at in breaks.tolist():
            if at > start:
                parts += [self._permute(piece[start:at], self.options.fragment_rate, rng),
                          np.array([self.split_id], np.int64)]
            start = at + 1
        parts.append(self._permute(piece[start:], self.options.fragment_rate, rng))
        return np.concatenate(parts)

    def _permute(self, piece: np.ndarray, rate: float, rng: np.random.RandomState) -> np.ndarray:
        if not rng.binomial(1, rate):
            return piece
        text = self.codec.decode(piece.tolist())
        if self.options.no_prefix is not None and text.startswith(self.options.no_prefix):
            return piece
        low, high = sorted(rng.randint(low=0, high=len(text) + 1, size=2).tolist())

        def ids(part: str) -> np.ndarray:
            return np.asarray(list(self.codec.encode_text(part)), dtype=np.int64)

        prefix, middle, suffix = ids(text[:low]), ids(text[low:high]), ids(text[high:])
        one = np.ones(1, dtype=np.int64)
        if rng.binomial(1, self.options.spm_rate):  # SPM
            return np.concatenate([one * self.prefix_id, one * self.suffix_id, suffix, one * self.middle_id,
                                   prefix, middle])
        return np.concatenate([one * self.prefix_id, prefix, one * self.suffix_id, suffix, one * self.middle_id,
                               middle])


__all__ = ["FIM_TOKEN_KEYS", "FimCodec", "FimOptions", "FimTransform"]
