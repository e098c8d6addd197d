"""Encoding engines for a HuggingFace ``tokenizer.json``: gigatoken where it covers the tokenizer,
the ``tokenizers`` library where it does not.

gigatoken encodes byte-level BPE (GPT-2, Llama 3 and the like) and SentencePiece-style BPE with
byte fallback in Rust, many times faster per core than ``tokenizers``, with the same ids. It
reads the same ``tokenizer.json`` and refuses, when loading it, what it does not implement (a
Unigram or WordPiece model, a normalizer it lacks): that refusal is the decision. ``"auto"``
takes gigatoken when it loads the file and says why not when it does not; ``"gigatoken"`` makes
a refusal an error; ``"hf"`` always uses ``tokenizers``.

A loaded file can still be encoded differently in a corner neither library documents, so the
pipeline holds gigatoken to ``tokenizers`` on the first documents of every process
(:data:`GUARD_CHARACTERS` of text, :func:`first_difference`) and stops the run, before a store
exists, at the first document whose ids differ.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tokenloom.errors import ConfigError

ENGINES = ("auto", "gigatoken", "hf")
"""``TokenizeConfig.engine`` values: choose from the tokenizer's configuration, or force one."""

GUARD_CHARACTERS = 256 * 1024
"""Characters of text each process encodes with both engines before it trusts gigatoken alone
(a fixed cost, paid once per process at ``tokenizers``' speed, that stays small beside the
process's share of a corpus)."""


class GigatokenEncoder:
    """gigatoken's encoder for one ``tokenizer.json``; pickles as its path (a worker process
    loads the file again: gigatoken's Rust tokenizer does not pickle)."""

    def __init__(self, path: str) -> None:
        import gigatoken

        self.path = path
        self._tokenizer = gigatoken.Tokenizer(path)

    def __reduce__(self):
        return (GigatokenEncoder, (self.path,))

    def encode_batch(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """(tokens (T,) uint32 concatenated, lengths (len(texts),) int64), as
        ``HuggingFaceTokenizer.encode_batch`` returns them; the ids stay in gigatoken's own
        dtype, as the store's dtype is at most that wide. gigatoken decides its own threading:
        a thread pool in the main process, the calling thread inside a worker process."""
        return gigatoken_ids(self._tokenizer.encode_batch(list(texts)))

    def encode_few(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`encode_batch` of a few short texts (fill-in-the-middle's cut parts) on the
        calling thread into one padded array: the same ids, without the thread pool's hand-off
        and the awkward array, which cost more than encoding such parts. The padded array is
        (texts x longest), so this is for parts of one sample, not for documents."""
        ids, lengths = self._tokenizer.encode_batch_padded(list(texts), pad_id=0)  # (N, longest), (N,)
        lengths = np.asarray(lengths, dtype=np.int64)
        return ids[np.arange(ids.shape[1]) < lengths[:, None]], lengths  # row-major: (T,), back to back

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        """The bytes of ``ids`` as the tokenizer's decoder joins them (the caller drops the
        special tokens and makes text of the bytes, see ``HuggingFaceTokenizer.decode_batch``)."""
        return self._tokenizer.decode(ids)


def gigatoken_ids(encoded) -> tuple[np.ndarray, np.ndarray]:
    """gigatoken's ``encode_batch`` result (an awkward array, documents x ids) as ``(tokens (T,),
    lengths (documents,) int64)``."""
    layout = encoded.layout  # documents x ids
    if not hasattr(layout, "offsets"):  # not one offsets array: lay it out as one
        import awkward

        layout = awkward.to_packed(encoded).layout
    offsets = np.asarray(layout.offsets.data, dtype=np.int64)  # (documents + 1,)
    tokens = np.asarray(layout.content.data)[offsets[0]:offsets[-1]]  # (T,) uint32
    return tokens, np.diff(offsets)


def open_gigatoken(path: str) -> tuple[GigatokenEncoder | None, str | None]:
    """``(encoder, None)`` when gigatoken loads ``path``; else ``(None, why not)``."""
    try:
        import gigatoken  # noqa: F401 - only whether it is installed
    except ImportError:
        return None, "gigatoken is not installed (pip install 'tokenloom[tokenizers]')"
    try:
        return GigatokenEncoder(path), None
    except Exception as exc:  # gigatoken raises RuntimeError naming what it does not implement
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return None, f"gigatoken does not cover this tokenizer: {reason}"


def check_engine(engine: str) -> str:
    """``engine`` when it is one of :data:`ENGINES`; else a ConfigError."""
    if engine not in ENGINES:
        raise ConfigError(f"engine={engine!r}; expected one of {list(ENGINES)}")
    return engine


def differing_documents(ours: tuple[np.ndarray, np.ndarray], reference: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """Indices of the documents whose ids differ between two ``encode_batch`` results."""
    tokens, lengths = ours
    expected_tokens, expected_lengths = reference
    differ = lengths != expected_lengths
    same = np.flatnonzero(~differ & (lengths > 0))
    if same.size:
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        expected_starts = np.concatenate([[0], np.cumsum(expected_lengths)[:-1]])
        counts = lengths[same]
        # positions of every token of the equally long documents, on each side: (sum(counts),)
        within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        unequal = tokens[np.repeat(starts[same], counts) + within].astype(np.int64) != \
            expected_tokens[np.repeat(expected_starts[same], counts) + within]
        differ[same[np.add.reduceat(unequal, np.cumsum(counts) - counts) > 0]] = True
    return np.flatnonzero(differ)


def first_difference(ours: tuple[np.ndarray, np.ndarray],
                     reference: tuple[np.ndarray, np.ndarray]) -> tuple[int, int, int | None, int | None] | None:
    """Where two ``encode_batch`` results first differ: ``(document, position, id, reference id)``
    (an id is None where that side's document has ended), or None when they are equal."""
    tokens, lengths = ours
    expected_tokens, expected_lengths = reference
    if np.array_equal(lengths, expected_lengths) and np.array_equal(tokens, expected_tokens):
        return None
    document = int(differing_documents(ours, reference)[0])
    start, expected_start = int(lengths[:document].sum()), int(expected_lengths[:document].sum())
    a = tokens[start:start + lengths[document]]
    b = expected_tokens[expected_start:expected_start + expected_lengths[document]]
    common = min(a.shape[0], b.shape[0])
    unequal = np.flatnonzero(a[:common] != b[:common])
    position = int(unequal[0]) if unequal.size else common
    return (document, position, int(a[position]) if position < a.shape[0] else None,
            int(b[position]) if position < b.shape[0] else None)


__all__ = ["ENGINES", "GUARD_CHARACTERS", "GigatokenEncoder", "check_engine", "differing_documents", "first_difference",
           "gigatoken_ids", "open_gigatoken"]
