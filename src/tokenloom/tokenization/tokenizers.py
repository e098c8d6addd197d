"""Tokenizers: the built-in byte tokenizer and any HuggingFace ``tokenizer.json``.

Both turn a batch of strings into one concatenated id array plus per-text lengths, the
shape the token store writer takes. ``load_tokenizer("bytes")`` needs nothing installed;
``load_tokenizer("path/to/tokenizer.json")`` needs the ``tokenizers`` library and encodes with
gigatoken where gigatoken covers the tokenizer (both in ``pip install 'tokenloom[tokenizers]'``;
:mod:`tokenloom.tokenization.engines`). Tokenizer objects pickle, so worker processes receive
them whole.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import threading
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from tokenloom.errors import ConfigError
from tokenloom.tokenization.divergence import (
    Divergence,
    ScanTarget,
    divergence_for,
    load_cached,
    refuse_forced,
    scan_code_points,
    scan_part,
    store_cached,
)
from tokenloom.tokenization.engines import check_engine, open_gigatoken
from tokenloom.tokenization.record import TokenizerRecord
from tokenloom.validate import is_integer

BYTE_VOCAB_SIZE = 257
"""Ids 0-255 are the UTF-8 bytes, 256 is the end-of-document id."""

BYTE_EOD_ID = 256

EOD_TOKEN_CANDIDATES = (
    "<|endoftext|>",
    "<|end_of_text|>",
    "</s>",
    "<eos>",
    "<|eos|>",
    "[EOS]",
    "<EOS>",
    "<|im_end|>",
)
"""Special tokens tried, in order, as the end-of-document id of a HuggingFace tokenizer
whose directory has no ``tokenizer_config.json`` naming its ``eos_token``."""


class Tokenizer(Protocol):
    """What the pipeline needs from a tokenizer."""

    vocab_size: int
    eod_id: int | None

    def encode_batch(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """Encode texts; return (tokens (T,) concatenated, lengths (len(texts),) int64). The ids
        are int64 or an unsigned dtype of the engine's own (gigatoken's uint32)."""
        ...

    def record(self, *, append_eod: bool) -> TokenizerRecord:
        """The sidecar record describing this tokenizer."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0-255, end of document 256; vocab_size 257. Needs no files."""

    vocab_size = BYTE_VOCAB_SIZE
    eod_id: int | None = BYTE_EOD_ID

    def __init__(self, *, eod_id: int | None = None) -> None:
        if eod_id is not None and eod_id != BYTE_EOD_ID:
            raise ConfigError(
                f"the byte tokenizer's end-of-document id is fixed at {BYTE_EOD_ID}, got {eod_id}"
            )

    def encode_batch(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        encoded = [text.encode("utf-8") for text in texts]
        lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
        # tokens: (sum(lengths),) int64 byte values
        tokens = np.frombuffer(b"".join(encoded), dtype=np.uint8).astype(np.int64)
        return tokens, lengths

    def record(self, *, append_eod: bool) -> TokenizerRecord:
        return TokenizerRecord(
            kind="bytes",
            name="bytes",
            path=None,
            sha256=None,
            vocab_size=self.vocab_size,
            eod_id=self.eod_id,
            append_eod=append_eod,
        )

    def __repr__(self) -> str:
        return "ByteTokenizer()"


def _require_tokenizers():
    try:
        import tokenizers
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ConfigError(
            "a HuggingFace tokenizer.json needs the 'tokenizers' library; "
            "install it with: pip install 'tokenloom[tokenizers]'"
        ) from exc
    return tokenizers


def _resolve_tokenizer_json(path: str) -> str:
    if os.path.isdir(path):
        candidate = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(candidate):
            raise ConfigError(f"{path}: directory has no tokenizer.json; pass the file itself")
        return os.path.abspath(candidate)
    if not os.path.isfile(path):
        raise ConfigError(
            f"tokenizer {path!r}: no such file; expected 'bytes' or the path of a "
            "HuggingFace tokenizer.json (or its directory)"
        )
    return os.path.abspath(path)


def _eos_from_tokenizer_config(json_path: str) -> str | None:
    """The ``eos_token`` named by a ``tokenizer_config.json`` beside the tokenizer, if any."""
    config_path = os.path.join(os.path.dirname(json_path), "tokenizer_config.json")
    if not os.path.isfile(config_path):
        return None
    try:
        with open(config_path, encoding="utf-8") as f:
            eos = json.load(f).get("eos_token")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(eos, dict):
        eos = eos.get("content")
    return eos if isinstance(eos, str) else None


class HuggingFaceTokenizer:
    """A HuggingFace ``tokenizers`` tokenizer loaded from ``tokenizer.json``.

    Args:
        path: the tokenizer.json, or a directory holding one.
        eod_id: end-of-document id; None finds it from ``tokenizer_config.json``'s
            ``eos_token`` or from the special tokens in ``EOD_TOKEN_CANDIDATES``.
        require_eod: raise ConfigError when no end-of-document id can be found.

        engine: ``"auto"`` encodes with gigatoken where it covers the tokenizer and with
            ``tokenizers`` where it does not (:mod:`tokenloom.tokenization.engines`);
            ``"gigatoken"`` or ``"hf"`` forces one.

    Texts are encoded without the post-processor's special tokens (no BOS/CLS); the
    pipeline appends the end-of-document id itself. ``engine`` says which engine encodes and
    ``engine_note`` why ``tokenizers`` does when gigatoken was not taken.

    With gigatoken, the ids are ``tokenizers``' on every document by construction: before the
    first encode, the code points the engines read differently are found
    (:mod:`tokenloom.tokenization.divergence`: cached, else scanned once) and a document holding
    one is encoded by ``tokenizers`` (:meth:`encode_batch_routed` counts them). A divergence too
    large to route makes ``"auto"`` take ``tokenizers`` for everything, and ``"gigatoken"`` an
    error.
    """

    def __init__(self, path: str, *, eod_id: int | None = None, require_eod: bool = True,
                 engine: str = "auto") -> None:
        tokenizers = _require_tokenizers()
        self.path = _resolve_tokenizer_json(os.fspath(path))
        with open(self.path, "rb") as f:
            raw = f.read()
        self.sha256 = hashlib.sha256(raw).hexdigest()
        self._raw = raw
        try:
            self._tokenizer = tokenizers.Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as exc:
            raise ConfigError(f"{self.path}: not a loadable HuggingFace tokenizer.json: {exc}") from exc
        self.vocab_size = int(self._tokenizer.get_vocab_size(with_added_tokens=True))
        parent = os.path.basename(os.path.dirname(self.path))
        self.name = parent or os.path.basename(self.path)
        self.eod_id = self._find_eod_id(eod_id, require_eod)
        self._fast, self.engine_note = None, None
        if check_engine(engine) != "hf":
            self._fast, self.engine_note = open_gigatoken(self.path)
            if self._fast is None and engine == "gigatoken":
                raise ConfigError(f"{self.path}: engine='gigatoken' but {self.engine_note}; encode it with the "
                                  "tokenizers library (engine='hf')")
        self.engine = "gigatoken" if self._fast is not None else "hf"
        self._engine_requested = engine
        self.divergence: Divergence | None = None
        """The code points routed to ``tokenizers`` (None until :meth:`route_divergent`)."""

    def _find_eod_id(self, eod_id: int | None, require_eod: bool) -> int | None:
        if eod_id is not None:
            if not is_integer(eod_id) or not 0 <= eod_id < self.vocab_size:
                raise ConfigError(
                    f"{self.path}: end-of-document id {eod_id!r} is outside the vocabulary "
                    f"[0, {self.vocab_size})"
                )
            return int(eod_id)
        named = _eos_from_tokenizer_config(self.path)
        for token in ((named,) if named else ()) + EOD_TOKEN_CANDIDATES:
            found = self._tokenizer.token_to_id(token)
            if found is not None:
                return int(found)
        if require_eod:
            raise ConfigError(
                f"{self.path}: cannot tell the end-of-document token: no tokenizer_config.json "
                f"eos_token and none of {list(EOD_TOKEN_CANDIDATES)} is in the vocabulary; "
                "give the id explicitly, or do not append one"
            )
        return None

    def route_divergent(self, divergence: Divergence | None = None) -> None:
        """Find the code points gigatoken reads differently, once: ``divergence`` when a divided
        run scanned it, else the cached scan, else a scan now (and cached). Called before
        the first encode; worker processes receive the result with the tokenizer."""
        if self._fast is None or self.divergence is not None:
            return
        with _ROUTING_LOCK:
            if self.divergence is not None:
                return
            found = divergence if divergence is not None else self._scanned(divergence_for, self._raw)
            why = found.too_large()
            if why is not None:
                if self._engine_requested == "gigatoken":
                    raise refuse_forced(self.path, why)
                self._fast, self.engine = None, "hf"
                self.engine_note = f"gigatoken reads {found.describe()} differently from tokenizers: {why}"
            self.divergence = found

    def divergence_share(self, rank: int, world: int) -> dict | None:
        """This rank's part of a scan divided over ``world`` ranks (see
        :meth:`join_divergence_shares`): ``{"cached": code points}`` when this rank finds the
        scan cached, ``{"share": the divergent code points of its share}`` when it scanned, None
        when nothing is to be found (gigatoken does not encode, or the divergence is known)."""
        if self._fast is None or self.divergence is not None:
            return None
        target = ScanTarget.of(self._raw)
        cached = load_cached(target)
        if cached is not None:
            return {"cached": cached.code_points.tolist()}
        return {"share": self._scanned(scan_code_points, target.text, scan_part(rank, world)).tolist()}

    def _scanned(self, scan, *args):
        """``scan(*args)``, its failure (an engine that refuses the probe) said in the user's words."""
        try:
            return scan(*args)
        except ConfigError:
            raise
        except Exception as exc:
            raise ConfigError(f"{self.path}: could not compare gigatoken with the tokenizers library on every "
                              f"code point ({type(exc).__name__}: {exc}); encode it with the tokenizers library "
                              "(engine='hf')") from exc

    def join_divergence_shares(self, shares: Sequence[dict | None], *, store: bool) -> None:
        """Take the divergence from every rank's :meth:`divergence_share`: a cached one where a
        rank had it (every cached scan of one key is the same), else the union of the shares,
        cached when ``store`` (one rank writes it)."""
        shares = [share for share in shares if share]
        if not shares:
            return
        cached = next((share["cached"] for share in shares if "cached" in share), None)
        if cached is not None:
            self.route_divergent(Divergence(cached))
            return
        found = Divergence([point for share in shares for point in share["share"]])
        if store:
            store_cached(ScanTarget.of(self._raw), found)
        self.route_divergent(found)

    def encode_batch(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        tokens, lengths, _ = self.encode_batch_routed(texts)
        return tokens, lengths

    def encode_batch_routed(self, texts: Sequence[str], *, few: bool = False) -> tuple[np.ndarray, np.ndarray, int]:
        """:meth:`encode_batch` plus how many of ``texts`` went to ``tokenizers`` because they
        hold a code point gigatoken reads differently. ``few``: a few short texts, encoded on
        the calling thread (``GigatokenEncoder.encode_few``)."""
        if self._fast is not None:
            self.route_divergent()
        if self._fast is None:
            return (*self.encode_batch_reference(texts), 0)
        encode = self._fast.encode_few if few else self._fast.encode_batch
        routed = self.divergence.holders(texts)
        if not routed:
            return (*encode(texts), 0)
        chosen = set(routed)
        rest = [i for i in range(len(texts)) if i not in chosen]
        fast_tokens, fast_lengths = encode([texts[i] for i in rest])
        slow_tokens, slow_lengths = self.encode_batch_reference([texts[i] for i in routed])
        lengths = np.empty(len(texts), dtype=np.int64)
        lengths[rest], lengths[routed] = fast_lengths, slow_lengths
        # gigatoken's dtype (uint32) holds every id of the vocabulary, the reference's int64 ids too
        tokens = np.empty(int(lengths.sum()), dtype=fast_tokens.dtype)  # (T,)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        sides = ((rest, fast_tokens, fast_lengths), (routed, slow_tokens, slow_lengths))
        for order, side_tokens, side_lengths in sides:
            # where each of this side's tokens goes: its document's start + its place in it, (side's T,)
            within = np.arange(side_tokens.size) - np.repeat(np.cumsum(side_lengths) - side_lengths, side_lengths)
            tokens[np.repeat(starts[order], side_lengths) + within] = side_tokens
        return tokens, lengths, len(routed)

    def characters_at(self, text: str, position: int) -> tuple[int, int]:
        """The characters ``[start, end)`` of ``text`` that ``tokenizers``' token ``position``
        covers (``(len(text), len(text))`` past its last token): where a message about a
        differing token points."""
        offsets = self._tokenizer.encode(text, add_special_tokens=False).offsets
        return (int(offsets[position][0]), int(offsets[position][1])) if position < len(offsets) else \
            (len(text), len(text))

    # -- what fill-in-the-middle needs (tokenloom.serve.fim.FimCodec) ----------------------------
    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids`` without special tokens (Megatron-LM's ``ids_to_text(ids,
        remove_special_tokens=True)``): ``tokenizers``' text, by gigatoken where that is the
        same text (:meth:`_gigatoken_drops`)."""
        return self.decode_batch([ids])[0]

    def decode_batch(self, batch: Sequence[Sequence[int]]) -> list[str]:
        """:meth:`decode` of each list of ids. gigatoken's decode is an order of magnitude
        faster than ``tokenizers``' (most of what fill-in-the-middle costs after its encode);
        ``tokenizers`` decodes where gigatoken's bytes would not be its text."""
        arrays = [np.asarray(ids, dtype=np.int64).reshape(-1) for ids in batch]
        drops = self._gigatoken_drops()
        if drops is None or any(a.size and (a.min() < 0 or a.max() >= drops.shape[0]) for a in arrays):
            return self._tokenizer.decode_batch([a.tolist() for a in arrays], skip_special_tokens=True)
        try:  # tokenizers turns broken UTF-8 into U+FFFD as Python's "replace" does (maximal subparts)
            return [self._fast.decode_bytes(a[~drops[a]].tolist()).decode("utf-8", "replace") for a in arrays]
        except Exception:  # an id gigatoken has no bytes for (a hole in the vocabulary): tokenizers' rule
            return self._tokenizer.decode_batch([a.tolist() for a in arrays], skip_special_tokens=True)

    def _gigatoken_drops(self) -> np.ndarray | None:
        """``(vocab_size,)`` bool, the ids :meth:`decode` drops (the special tokens), where
        gigatoken's decode gives ``tokenizers``' text: a tokenizer whose decoder is ByteLevel
        alone (each id's bytes, joined) and whose added tokens are all special (a non-special
        added token goes through the decoder as text, which gigatoken may not copy). None:
        decode with ``tokenizers``."""
        if "_drops" not in self.__dict__:
            drops = None
            if self._fast is not None and hasattr(self._fast, "decode_bytes"):
                spec = json.loads(self._raw)
                added = spec.get("added_tokens") or []
                if (spec.get("decoder") or {}).get("type") == "ByteLevel" and all(a.get("special") for a in added):
                    drops = np.zeros(self.vocab_size, dtype=bool)
                    drops[[int(a["id"]) for a in added if 0 <= int(a["id"]) < self.vocab_size]] = True
            self.__dict__["_drops"] = drops
        return self.__dict__["_drops"]

    def encode_texts(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`encode_text` of each text in one call, as ``(ids back to back, lengths)``: by
        gigatoken where it covers the tokenizer (the ids are ``tokenizers``' by construction, as
        :meth:`encode_batch` holds them; an order of magnitude faster, which is most of what FIM
        costs), else the ``tokenizers`` library's batch. The first call on a machine may scan the
        tokenizer once for the code points gigatoken reads differently (cached per tokenizer:
        :meth:`route_divergent`)."""
        tokens, lengths, _ = self.encode_batch_routed(texts, few=True)
        return np.asarray(tokens, dtype=np.int64), lengths

    def encode_text(self, text: str) -> list[int]:
        """The ids of one ``text`` by the ``tokenizers`` library, no special tokens added (what
        the store's documents were encoded to, gigatoken or not)."""
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def token_id(self, token: str) -> int | None:
        """The id of the token spelt ``token``, or None."""
        found = self._tokenizer.token_to_id(token)
        return None if found is None else int(found)

    def encode_batch_reference(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`encode_batch` by the ``tokenizers`` library, whatever the engine (what
        gigatoken is held to)."""
        # encode_batch_fast (tokenizers >= 0.20) skips the character offsets we do not need
        encode = getattr(self._tokenizer, "encode_batch_fast", None) or self._tokenizer.encode_batch
        encodings = encode(list(texts), add_special_tokens=False)
        ids = [encoding.ids for encoding in encodings]
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        total = int(lengths.sum())
        # tokens: (total,) int64, the documents' ids back to back
        tokens = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64, count=total)
        return tokens, lengths

    def record(self, *, append_eod: bool) -> TokenizerRecord:
        return TokenizerRecord(
            kind="huggingface",
            name=self.name,
            path=self.path,
            sha256=self.sha256,
            vocab_size=self.vocab_size,
            eod_id=self.eod_id,
            append_eod=append_eod,
        )

    def __repr__(self) -> str:
        return (f"HuggingFaceTokenizer({self.path!r}, vocab_size={self.vocab_size}, eod_id={self.eod_id}, "
                f"engine={self.engine!r})")


def _byte_tokenizer(spec: str, *, eod_id=None, require_eod=True, engine="auto") -> ByteTokenizer:
    if check_engine(engine) != "auto":
        raise ConfigError(f"engine={engine!r} with the byte tokenizer; engines apply to a HuggingFace "
                          "tokenizer.json (the byte tokenizer is its own engine): leave engine='auto'")
    return ByteTokenizer(eod_id=eod_id)


_ROUTING_LOCK = threading.Lock()  # the worker threads of a run find the divergence once


TOKENIZERS: dict[str, Callable[..., Tokenizer]] = {
    "bytes": _byte_tokenizer,
    "huggingface": lambda spec, *, eod_id=None, require_eod=True, engine="auto": HuggingFaceTokenizer(
        spec, eod_id=eod_id, require_eod=require_eod, engine=engine
    ),
}
"""Tokenizer kind -> factory(spec, eod_id=..., require_eod=..., engine=...)."""


def tokenizer_kind(spec: str) -> str:
    """``"bytes"`` for the built-in tokenizer, ``"huggingface"`` for anything else (a path)."""
    return "bytes" if spec == "bytes" else "huggingface"


def load_tokenizer(spec: str = "bytes", *, eod_id: int | None = None, require_eod: bool = True,
                   engine: str = "auto") -> Tokenizer:
    """Load ``"bytes"`` or a HuggingFace tokenizer.json path (see ``HuggingFaceTokenizer``;
    ``engine`` chooses how a tokenizer.json encodes)."""
    return TOKENIZERS[tokenizer_kind(spec)](spec, eod_id=eod_id, require_eod=require_eod, engine=engine)


__all__ = [
    "BYTE_EOD_ID",
    "BYTE_VOCAB_SIZE",
    "EOD_TOKEN_CANDIDATES",
    "TOKENIZERS",
    "ByteTokenizer",
    "HuggingFaceTokenizer",
    "Tokenizer",
    "load_tokenizer",
    "tokenizer_kind",
]
