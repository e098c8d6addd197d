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
import itertools
import threading
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from tokenloom.errors import ConfigError
from tokenloom.source.fim_options import FIM_TOKEN_KEYS, FimOptions

#: Each thread's generators for the rows of a micro-batch (``FimTransform._row_rngs``).
_POOL = threading.local()


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

    # Optional, for a micro-batch in two calls (FimTransform.apply_rows): ``decode_batch(list of
    # id lists) -> list[str]`` and ``encode_texts(texts) -> (ids back to back, lengths)``.


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

    def __repr__(self) -> str:  # what a grain checkpoint compares: no addresses
        return f"FimTransform({self.options!r}, codec={self.codec!r}, seed={self.seed})"

    def pieces(self, rows: np.ndarray, lengths=None) -> tuple[np.ndarray, np.ndarray]:
        """The document pieces of permuted ``rows`` ``(B, W)`` as a source reports them
        (:class:`~tokenloom.source.protocol.PieceRows`' ``ends`` ``(B, W + 1)`` and ``counts``
        ``(B,)``): a piece ends after each end-of-document token, and the last after the last
        column that is not the pad token (the pad tokens after it are padding), within each
        row's ``lengths`` (the columns before the source's own padding; None: all). The index's
        own pieces no longer hold: a permuted piece has other lengths."""
        rows = np.asarray(rows)
        batch, width = rows.shape
        lengths = np.full(batch, width, dtype=np.int64) if lengths is None else np.asarray(lengths, dtype=np.int64)
        ends = np.full((batch, width + 1), width, dtype=np.int32)  # (B, W + 1)
        counts = np.empty(batch, dtype=np.int32)  # (B,)
        for r in range(batch):
            row = rows[r, :int(lengths[r])]
            real = np.flatnonzero(row != self.pad_id)
            last = int(real[-1]) + 1 if real.shape[0] else 1  # a row of pad tokens: one (empty-text) piece
            mine = np.flatnonzero(row[:last] == self.eod_id) + 1
            if not mine.shape[0] or mine[-1] < last:
                mine = np.append(mine, last)
            ends[r, :mine.shape[0]] = mine
            counts[r] = mine.shape[0]
        return ends, counts

    def _id(self, what: str, spelt: str) -> int:
        found = self.codec.token_id(spelt)
        if found is None:
            raise ConfigError(f"{what}={spelt!r} is not a token of the tokenizer; expected a special token of its "
                              "vocabulary (add the FIM sentinels when training the tokenizer)")
        return int(found)

    def sample_rng(self, dataset: int, sample: int) -> np.random.RandomState:
        """The generator of sample ``sample`` of dataset ``dataset``: a ``RandomState`` seeded
        with four 32-bit words of BLAKE2b over ``(seed, dataset, sample)``."""
        return self._seed(np.random.RandomState(0), dataset, sample)

    def _seed(self, rng: np.random.RandomState, dataset: int, sample: int) -> np.random.RandomState:
        """``rng`` seeded as :meth:`sample_rng` seeds its generator (the same state)."""
        digest = hashlib.blake2b(f"tokenloom.fim\0{self.seed}\0{int(dataset)}\0{int(sample)}".encode(),
                                 digest_size=16).digest()
        rng.seed(np.frombuffer(digest, dtype="<u4"))
        return rng

    def _row_rngs(self, dataset_ids, sample_ids) -> list[np.random.RandomState]:
        """Each row's generator of a micro-batch, as :meth:`sample_rng` makes it, in generators
        this thread keeps for the next micro-batch: making a ``RandomState`` costs about ten
        times seeding one, a sizeable part of FIM's time per sample."""
        pairs = list(zip(np.asarray(dataset_ids).tolist(), np.asarray(sample_ids).tolist()))
        pool = _POOL.__dict__.setdefault("rngs", [])
        while len(pool) < len(pairs):
            pool.append(np.random.RandomState(0))
        return [self._seed(rng, d, s) for rng, (d, s) in zip(pool, pairs)]

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
        return self._fit(out, length)

    def apply_rows(self, rows: np.ndarray, dataset_ids, sample_ids, lengths=None) -> np.ndarray:
        """``(B, W)`` rows, each permuted with its own sample's generator (a new array): the
        same ids as :meth:`apply` row by row, with the tokenizer called a few times per
        micro-batch rather than per piece (the texts the rows wait on decoded together, every cut
        part encoded in one call), where the codec has ``decode_batch`` and ``encode_texts``:
        called piece by piece, they cost most of FIM. ``lengths``: each row's columns before
        its source's padding (a best-fit sample's whole documents; None: every column), which
        alone are permuted, kept to that length, the padding after them left as it is."""
        rows = np.asarray(rows, dtype=np.int64)
        width = rows.shape[1]
        widths = [width] * rows.shape[0] if lengths is None else np.asarray(lengths, dtype=np.int64).tolist()
        decode_batch = getattr(self.codec, "decode_batch", None)
        encode_texts = getattr(self.codec, "encode_texts", None)
        out = rows.copy()  # the source's padding stays
        if decode_batch is None or encode_texts is None:
            for k, (d, s) in enumerate(zip(np.asarray(dataset_ids).tolist(), np.asarray(sample_ids).tolist())):
                out[k, :widths[k]] = self.apply(rows[k, :widths[k]], self.sample_rng(d, s))
            return out
        # 1. the draws, row by row from each sample's generator, in Megatron-LM's order: a row's
        # draws stop where they need a run's text (how far it may be cut), and the runs every row
        # waits on are decoded in one call, until every row has drawn all it needs
        rngs = self._row_rngs(dataset_ids, sample_ids)
        drawing = [self._row_draws(self._layout(row[:n]), rng) for row, n, rng in zip(rows, widths, rngs)]
        plans: list = [None] * len(drawing)
        waiting = {}
        for k, draws in enumerate(drawing):
            self._advance(k, draws, None, waiting, plans)
        while waiting:
            order = list(waiting)
            texts = decode_batch([waiting[k].tolist() for k in order])
            waiting = {}
            for k, text in zip(order, texts):
                self._advance(k, drawing[k], text, waiting, plans)
        # 2. every cut part encoded at once, then each row put together and cut or padded
        strings = [text for plan in plans for piece in plan for item in piece if isinstance(item, tuple)
                   for text in item[1]]
        tokens, lengths = encode_texts(strings) if strings else (np.zeros(0, np.int64), np.zeros(0, np.int64))
        bounds = np.concatenate([[0], np.cumsum(lengths)]).tolist()
        encoded = iter(np.asarray(tokens, dtype=np.int64)[a:b] for a, b in itertools.pairwise(bounds))
        for k, plan in enumerate(plans):
            out[k, :widths[k]] = self._fit(self._join(plan, encoded), widths[k])
        return out

    def _layout(self, row: np.ndarray) -> list[tuple[bool, list, list]]:
        """The row's pieces between end-of-document tokens (an empty one dropped with its EOD),
        each as ``(split, parts, whole)``: ``split`` True where the piece is cut at the split
        token into fragments; ``parts`` the runs that may be permuted, with the split ids kept
        between them (an empty fragment is dropped with its split token, as Megatron-LM does);
        ``whole`` the piece as it is (what an unpermuted split piece stays), each followed by the
        piece's end-of-document token."""
        pieces, start = [], 0
        for at in np.flatnonzero(row == self.eod_id).tolist():
            if at > start:
                pieces.append((row[start:at], True))
            start = at + 1
        pieces.append((row[start:], False))
        out = []
        for piece, ends_in_eod in pieces:
            breaks = np.flatnonzero(piece == self.split_id) if self.split_id is not None else np.zeros(0, np.int64)
            if not breaks.shape[0]:
                parts: list = [piece]
            else:
                parts, begin = [], 0
                for at in breaks.tolist():
                    if at > begin:
                        parts += [piece[begin:at], self.split_id]
                    begin = at + 1
                parts.append(piece[begin:])
            tail = [self.eod_id] if ends_in_eod else []
            out.append((bool(breaks.shape[0]), parts + tail, [piece, *tail]))
        return out

    @staticmethod
    def _advance(k: int, draws, text, waiting: dict, plans: list) -> None:
        """Run row ``k``'s draws on (with ``text``, the one it waited for): it waits on its next
        run (``waiting[k]``), or its plan is done (``plans[k]``)."""
        try:
            waiting[k] = draws.send(text)
        except StopIteration as done:
            plans[k] = done.value

    def _row_draws(self, layout: list, rng: np.random.RandomState):
        """A generator of one row's draws (as :meth:`_split_and_permute`, piece by piece): it
        yields each run whose text it needs and is sent that text; it returns the row's plan,
        its pieces' parts with each permuted run replaced by ``(spm, (prefix, middle, suffix)
        texts)``, or a split piece ``whole`` where it draws no FIM."""
        plan = []
        for split, parts, whole in layout:
            if split and not rng.binomial(1, self.options.rate):
                plan.append(whole)
                continue
            rate = self.options.fragment_rate if split else self.options.rate
            out = []
            for part in parts:
                if not isinstance(part, np.ndarray) or not rng.binomial(1, rate):
                    out.append(part)
                    continue
                text = yield part
                if self.options.no_prefix is not None and text.startswith(self.options.no_prefix):
                    out.append(part)
                    continue
                low, high = sorted(rng.randint(low=0, high=len(text) + 1, size=2).tolist())
                out.append((bool(rng.binomial(1, self.options.spm_rate)), (text[:low], text[low:high], text[high:])))
            plan.append(out)
        return plan

    def _join(self, plan: list, encoded) -> np.ndarray:
        parts: list[np.ndarray] = []
        for piece in plan:
            for item in piece:
                if isinstance(item, np.ndarray):
                    parts.append(item)
                elif isinstance(item, tuple):
                    prefix, middle, suffix = next(encoded), next(encoded), next(encoded)
                    parts.append(self._arrange(item[0], prefix, middle, suffix))
                else:
                    parts.append(np.array([item], dtype=np.int64))
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def _arrange(self, spm: bool, prefix: np.ndarray, middle: np.ndarray, suffix: np.ndarray) -> np.ndarray:
        one = np.ones(1, dtype=np.int64)
        if spm:
            return np.concatenate([one * self.prefix_id, one * self.suffix_id, suffix, one * self.middle_id,
                                   prefix, middle])
        return np.concatenate([one * self.prefix_id, prefix, one * self.suffix_id, suffix, one * self.middle_id,
                               middle])

    def _fit(self, out: np.ndarray, length: int) -> np.ndarray:
        if out.shape[0] >= length:
            return out[:length]
        return np.concatenate([out, np.full(length - out.shape[0], self.pad_id, dtype=np.int64)])

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
        return self._arrange(bool(rng.binomial(1, self.options.spm_rate)), prefix, middle, suffix)


__all__ = ["FimCodec", "FimTransform"]
