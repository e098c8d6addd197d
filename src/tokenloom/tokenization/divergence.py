"""The code points on which gigatoken can encode a tokenizer.json differently from ``tokenizers``.

Both engines split text into pieces before BPE merges them, and the split rules ask Unicode what
a character is: a letter (``\\p{L}``), a number (``\\p{N}``), whitespace (``\\s``). The two
libraries carry their own Unicode tables, of different versions: gigatoken 0.10 knows the
characters assigned in Unicode 17, ``tokenizers`` 0.23 sees them as unassigned. Where they
disagree about a character, they cut the text around it in different places, and wherever the
vocabulary holds a merge across such a cut the ids differ. Sampling documents (the pipeline's
guard) cannot find this: the characters are rare, and a model trained on such ids meets ids at
inference that its tokenizer never produces.

So identity is made by construction. For each tokenizer, every Unicode scalar value is encoded by
both engines in each of :data:`CONTEXTS` (after a space, between letters, between digits, between
punctuation, between newlines) and the code points where any context differs form the tokenizer's
:class:`Divergence`. The pipeline sends every document that holds one of them to ``tokenizers``
(:meth:`Divergence.holders`), so every document gets the reference ids.

Byte-level tokenizers (GPT-2, Llama 3, cl100k-like: a ``ByteLevel`` step in the pre-tokenizer)
are scanned through a *probe*: the file's normalizer and pre-tokenizer over a made-up BPE whose
merges join every byte with each context's neighbours (:func:`probe_tokenizer_json`). A cut
between a character and its neighbour then always shows in the ids, whatever the real
vocabulary merges, so the result holds for every vocabulary with these split rules and is
cached under the probe's hash (tokenizers that differ only in their vocabulary share one scan).
Other tokenizers (SentencePiece-style BPE with byte fallback, whose pre-tokenizer splits on
spaces only) are scanned as they are, keyed by the file's hash. Either key includes both
libraries' versions.

A scan encodes about 1.1 million code points x 5 contexts with each engine; the ``tokenizers``
side dominates. Code points are encoded :data:`GROUP` to a text, joined by a separator that no
probe merge touches, and only the code points of a text that differs are encoded one context at
a time, so a scan costs what the characters cost, not 5.5 million calls. The result is written
to :func:`cache_dir` (``TOKENLOOM_CACHE_DIR``, else ``$XDG_CACHE_HOME/tokenloom``, else
``~/.cache/tokenloom``), and a divided tokenize scans one part per rank
(:func:`scan_code_points` over :func:`scan_part`).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tokenloom.errors import ConfigError
from tokenloom.io.writer import write_json_atomic
from tokenloom.tokenization.engines import differing_documents, gigatoken_ids

logger = logging.getLogger(__name__)

CONTEXTS = (" {}", "a{}a", "1{}1", '"{}"', "\n{}\n")
"""Where each code point is tried: after a space, between letters, between digits, between
punctuation, between newlines (``{}`` is the code point). Between them they put a character of
every class the split patterns tell apart on either side of it."""

GROUP = 256
"""Contexts encoded to one text in the first pass; a text that differs is re-encoded one context
at a time, so only the code points that really differ are kept."""

SEPARATOR = "\x00"
"""Between the contexts of one text: a control character no probe merge touches, so no context
reaches into the next through a merge."""

SCAN_FORMAT = "tokenloom-engine-divergence"
SCAN_VERSION = 1
"""Bumped when what a scan tries changes; an older cached result is then scanned again."""

MAX_ROUTED_CODE_POINTS = 65536
"""A divergence larger than this (or holding any ASCII character) is not routed around: so many
documents would go to ``tokenizers`` that gigatoken would not pay; ``engine="auto"`` then
encodes with ``tokenizers`` and says why."""

_SURROGATES = (0xD800, 0xE000)


def all_code_points() -> np.ndarray:
    """Every Unicode scalar value, in order: (1,112,064,) int64 (the surrogates left out: a
    Python string may hold one, but no UTF-8 text can)."""
    points = np.arange(0x110000, dtype=np.int64)
    return points[(points < _SURROGATES[0]) | (points >= _SURROGATES[1])]


def scan_part(rank: int, world: int) -> np.ndarray:
    """Rank ``rank``'s contiguous share of :func:`all_code_points` when ``world`` ranks scan."""
    return np.array_split(all_code_points(), world)[rank]


def library_versions() -> dict[str, str]:
    """The installed ``gigatoken`` and ``tokenizers`` versions (part of every scan's key)."""
    return {name: importlib.metadata.version(name) for name in ("gigatoken", "tokenizers")}


def cache_dir() -> str:
    """Where scans are cached: ``TOKENLOOM_CACHE_DIR``, else ``$XDG_CACHE_HOME/tokenloom``, else
    ``~/.cache/tokenloom`` (a folder on a shared filesystem lets every node reuse a scan)."""
    explicit = os.environ.get("TOKENLOOM_CACHE_DIR")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tokenloom")


# -- the probe ------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _byte_symbols() -> tuple[str, ...]:
    """GPT-2's printable stand-in for each byte (what a ``ByteLevel`` vocabulary spells)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            symbols[byte] = chr(byte)
        else:
            symbols[byte] = chr(256 + extra)
            extra += 1
    return tuple(symbols[b] for b in range(256))


def _has_byte_level(step) -> bool:
    if not isinstance(step, dict):
        return False
    if step.get("type") == "ByteLevel":
        return True
    return any(_has_byte_level(inner) for inner in step.get("pretokenizers") or ())


def probe_tokenizer_json(config: dict) -> dict | None:
    """The probe for a byte-level tokenizer.json (its parsed JSON), or None when the tokenizer is
    not byte-level (it is then scanned as it is).

    The probe keeps what decides where text is cut (the normalizer and the pre-tokenizer) and
    replaces the model with a BPE over the 256 byte symbols whose only merges join a context's
    neighbour characters with every byte, on either side. Whether a neighbour and the code point
    between them end in one piece or two is then visible in the ids, whatever the real
    vocabulary would merge. Special tokens, the post-processor and the decoder play no part in
    where plain text is cut and are left out.
    """
    if config.get("model", {}).get("type") != "BPE" or not _has_byte_level(config.get("pre_tokenizer")):
        return None
    symbols = _byte_symbols()
    vocab = {symbol: i for i, symbol in enumerate(symbols)}
    merges = []
    separator = symbols[ord(SEPARATOR)]
    neighbours = sorted({byte for context in CONTEXTS for byte in context.replace("{}", "").encode()})
    for byte in neighbours:
        neighbour = symbols[byte]
        for other in symbols:
            if other == separator:
                continue
            for left, right in ((neighbour, other), (other, neighbour)):
                if left + right not in vocab:
                    vocab[left + right] = len(vocab)
                    merges.append([left, right])
    model = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
             "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
             "vocab": vocab, "merges": merges}
    return {"version": config.get("version", "1.0"), "truncation": None, "padding": None, "added_tokens": [],
            "normalizer": config.get("normalizer"), "pre_tokenizer": config.get("pre_tokenizer"),
            "post_processor": None, "decoder": None, "model": model}


# -- scanning -------------------------------------------------------------------------------------
class _Engines:
    """Both engines over one tokenizer.json text."""

    def __init__(self, text: str) -> None:
        import gigatoken
        import tokenizers

        self._fast = gigatoken.Tokenizer.from_json(text)
        self._reference = tokenizers.Tokenizer.from_str(text)

    def differing(self, texts: list[str]) -> np.ndarray:
        """Indices of ``texts`` whose ids differ between the engines."""
        fast_tokens, fast_lengths = gigatoken_ids(self._fast.encode_batch(texts))
        encode = getattr(self._reference, "encode_batch_fast", None) or self._reference.encode_batch
        encodings = encode(texts, add_special_tokens=False)
        ids = [encoding.ids for encoding in encodings]
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        tokens = np.fromiter((i for row in ids for i in row), dtype=np.int64, count=int(lengths.sum()))
        return differing_documents((fast_tokens, fast_lengths), (tokens, lengths))


def scan_code_points(text: str, code_points: np.ndarray) -> np.ndarray:
    """The code points of ``code_points`` (sorted) on which the two engines encode some context
    of :data:`CONTEXTS` differently, for the tokenizer.json ``text`` (a probe or a file)."""
    engines = _Engines(text)
    found: set[int] = set()
    for context in CONTEXTS:
        groups = [code_points[i:i + GROUP] for i in range(0, len(code_points), GROUP)]
        texts = [SEPARATOR.join(context.format(chr(c)) for c in group) for group in groups]
        suspects = [int(c) for index in engines.differing(texts) for c in groups[index]]
        if suspects:
            single = engines.differing([context.format(chr(c)) for c in suspects])
            found.update(suspects[i] for i in single)
    return np.array(sorted(found), dtype=np.int64)


# -- the result -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ScanTarget:
    """What a tokenizer's scan encodes, and the key its result is cached under."""

    text: str
    """The tokenizer.json encoded by both engines: the probe, or the file itself."""

    probe: bool
    key: str
    """Hex digest of (scan format, what is encoded, both libraries' versions)."""

    @classmethod
    def of(cls, raw: bytes) -> ScanTarget:
        """The target for the raw bytes of a tokenizer.json."""
        probe = probe_tokenizer_json(json.loads(raw))
        text = raw.decode("utf-8") if probe is None else json.dumps(probe, sort_keys=True, ensure_ascii=False)
        material = json.dumps({"format": SCAN_FORMAT, "version": SCAN_VERSION, "contexts": CONTEXTS,
                               "encoded": hashlib.sha256(text.encode("utf-8")).hexdigest(),
                               "libraries": library_versions()}, sort_keys=True)
        return cls(text=text, probe=probe is not None, key=hashlib.sha256(material.encode()).hexdigest()[:40])

    @property
    def cache_path(self) -> str:
        return os.path.join(cache_dir(), "engine-divergence", f"{self.key}.json")


class Divergence:
    """The code points one tokenizer.json's gigatoken ids may differ on, and the documents that
    hold one (which go to ``tokenizers``)."""

    def __init__(self, code_points: Sequence[int] | np.ndarray) -> None:
        self.code_points = np.unique(np.asarray(code_points, dtype=np.int64))  # (n,) sorted
        if self.code_points.size and (self.code_points[0] < 0 or self.code_points[-1] >= 0x110000):
            raise ValueError(f"code points outside [0, 0x110000): {self.code_points[[0, -1]].tolist()}")
        self._marked = np.zeros(0x110000 if self.code_points.size else 0, dtype=np.bool_)  # (0x110000,) bool
        self._marked[self.code_points] = True
        self._lowest = int(self.code_points[0]) if self.code_points.size else 0x110000

    def __len__(self) -> int:
        return int(self.code_points.size)

    def ranges(self) -> list[tuple[int, int]]:
        """The code points as inclusive ``(first, last)`` runs."""
        points = self.code_points
        if not points.size:
            return []
        breaks = np.flatnonzero(np.diff(points) != 1)
        firsts = np.concatenate([[points[0]], points[breaks + 1]])
        lasts = np.concatenate([points[breaks], [points[-1]]])
        return [(int(a), int(b)) for a, b in zip(firsts, lasts)]

    def describe(self, limit: int = 4) -> str:
        """``"4,657 code points (U+0897, U+10940-U+1095F, ...)"``."""
        runs = [f"U+{a:04X}" if a == b else f"U+{a:04X}-U+{b:04X}" for a, b in self.ranges()]
        shown = ", ".join(runs[:limit]) + (", ..." if len(runs) > limit else "")
        return f"{len(self):,} code point{'s' if len(self) != 1 else ''}" + (f" ({shown})" if runs else "")

    def too_large(self) -> str | None:
        """Why routing around this divergence does not pay, or None when it does."""
        if self.code_points.size and self.code_points[0] < 0x80:
            return f"it holds ASCII (U+{int(self.code_points[0]):04X}), so nearly every document would go to tokenizers"
        if len(self) > MAX_ROUTED_CODE_POINTS:
            return f"{len(self):,} code points are more than the {MAX_ROUTED_CODE_POINTS:,} worth routing around"
        return None

    def holders(self, texts: Sequence[str]) -> list[int]:
        """Indices of the ``texts`` holding a divergent code point, in order.

        An ASCII text is passed over without reading it (``str.isascii`` reads a flag CPython
        keeps). The others are joined and read once as UTF-32 code units: a batch whose largest
        code point is below the lowest divergent one is done after one ``max``, and otherwise
        each code unit is looked up in a table of all code points (numpy, not a regular
        expression: Python's ``re`` reads a character class many times slower)."""
        candidates = [i for i, text in enumerate(texts) if not text.isascii()] if self.code_points.size else []
        if not candidates:
            return []
        joined = "".join([texts[i] for i in candidates])
        # lone surrogates pass here; the engine refuses such a text later, naming it
        codes = np.frombuffer(joined.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)  # (characters,)
        if int(codes.max()) < self._lowest:
            return []
        hits = np.flatnonzero(np.take(self._marked, codes))
        if not hits.size:
            return []
        ends = np.cumsum([len(texts[i]) for i in candidates])  # (candidates,) where each text ends in `joined`
        return [candidates[k] for k in np.unique(np.searchsorted(ends, hits, side="right")).tolist()]

    def to_json(self, target: ScanTarget) -> dict:
        return {"format": SCAN_FORMAT, "version": SCAN_VERSION, "key": target.key, "probe": target.probe,
                "contexts": list(CONTEXTS), "libraries": library_versions(),
                "code_points": len(self), "ranges": [list(r) for r in self.ranges()]}

    @classmethod
    def from_json(cls, data: dict) -> Divergence:
        points = [p for first, last in data["ranges"] for p in range(int(first), int(last) + 1)]
        return cls(points)

    def __reduce__(self):
        return (Divergence, (self.code_points,))

    def __repr__(self) -> str:
        return f"Divergence({self.describe()})"


def load_cached(target: ScanTarget) -> Divergence | None:
    """The cached scan for ``target``, or None when there is none (or it cannot be read)."""
    try:
        with open(target.cache_path, encoding="utf-8") as f:
            data = json.load(f)
        if data.get("format") != SCAN_FORMAT or data.get("version") != SCAN_VERSION or data.get("key") != target.key:
            return None
        return Divergence.from_json(data)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def store_cached(target: ScanTarget, divergence: Divergence) -> None:
    """Write the scan where every later run (and every rank that sees the folder) finds it; a
    folder that cannot be written costs a warning, not the run (the scan is only a cache)."""
    try:
        os.makedirs(os.path.dirname(target.cache_path), exist_ok=True)
        write_json_atomic(target.cache_path, divergence.to_json(target))
    except OSError as exc:
        logger.warning("could not cache the engine scan at %s (%s); the next run scans again", target.cache_path, exc)


def divergence_for(raw: bytes, *, code_points: np.ndarray | None = None) -> Divergence:
    """The :class:`Divergence` of the tokenizer.json bytes ``raw``: cached, or scanned now over
    every code point and cached (``code_points`` limits a scan to a part, uncached: a divided
    run joins the parts itself)."""
    target = ScanTarget.of(raw)
    if code_points is not None:
        return Divergence(scan_code_points(target.text, code_points))
    cached = load_cached(target)
    if cached is not None:
        return cached
    logger.info("comparing gigatoken with tokenizers on every code point (once per tokenizer and library "
                "versions, cached at %s)", target.cache_path)
    divergence = Divergence(scan_code_points(target.text, all_code_points()))
    store_cached(target, divergence)
    return divergence


def refuse_forced(path: str, why: str) -> ConfigError:
    """The error for ``engine="gigatoken"`` on a tokenizer whose divergence is too large to route."""
    return ConfigError(f"{path}: engine='gigatoken' but gigatoken reads too many characters differently from "
                       f"the tokenizers library to route them ({why}); encode it with the tokenizers library "
                       "(engine='hf')")


__all__ = ["CONTEXTS", "GROUP", "MAX_ROUTED_CODE_POINTS", "Divergence", "ScanTarget", "all_code_points", "cache_dir",
           "divergence_for", "library_versions", "load_cached", "probe_tokenizer_json",
           "refuse_forced", "scan_code_points", "scan_part", "store_cached"]
