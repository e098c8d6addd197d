"""Training fields from token rows, as megatron-core's ``GPTDataset.__getitem__`` makes them.

From a ``(B, seq_length + 1)`` block of tokens (or ``(B, seq_length)`` without the extra token)
this builds, for every row at once:

* ``tokens`` -- the inputs, ``row[:-1]``;
* ``labels`` -- the targets, ``row[1:]`` (without the extra token: the row rolled left by one, its
  last label the pad id);
* ``loss_mask`` -- 1.0, 0.0 where the label is padding, and (``eod_mask_loss``) where the input
  token is the end-of-document id (the batch pipeline then multiplies in the stores' own loss
  masks, :func:`tokenloom.serve.batch.label_loss_mask`);
* ``position_ids`` -- ``0..S-1``, restarting at 0 after every EOD with ``reset_position_ids``;
* ``attention_mask`` (``create_attention_mask``) -- ``(B, 1, S, S)`` bool, True where attention is
  *masked*: above the diagonal, and with ``reset_attention_mask`` across EOD boundaries.

With ``inter_document_masking`` (megatron-core 0.19's switch of that name) a sample carries its
document boundaries instead of a mask, taken from the document pieces the index cut the sample
from (:class:`~tokenloom.source.protocol.PieceRows`), not from EOD tokens, so stores without EOD
tokens have them too:

* ``cu_seqlens`` -- ``(B, S + 1)`` int32: ``0``, the end of every piece, then ``S`` repeated
  (megatron-core pads it to a fixed length so samples stack). As megatron-core makes it: the
  extra token is taken off the last piece (a piece left empty is dropped), and the padding of a
  short sample belongs to its last document; empty documents inside a sample stay as repeated
  entries;
* ``max_seqlen`` -- ``(B,)`` int32: the longest document piece of each sample;
* ``position_ids`` -- restart at 0 at every piece (``reset_position_ids`` has no further effect).

megatron-core then returns no ``attention_mask``, so asking for both is refused. Nothing here is
S^2: the boundary fields cost one pass over each row (a compiled loop, or numpy where numba is
missing).

Then, as megatron-core does, pad ids in tokens and labels become 0 so the embedding can take them.
All numpy, no torch; the adapters wrap the arrays.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tokenloom.errors import ConfigError, FormatError, InputError
from tokenloom.index.kernels import compiled, jit, numba_available
from tokenloom.serve.fim import FimTransform

FIELD_NAMES = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask")
BOUNDARY_FORMATS = {
    "megatron": ("cu_seqlens", "max_seqlen"),
    "thd": ("cu_seqlens", "max_seqlen", "document_ids"),
    "segments": ("inputs_segmentation", "inputs_position"),
}
"""``SampleOptions.boundary_format`` -> the document-boundary fields it adds, named as the consumer
names them: megatron-core's per-sample ``cu_seqlens``/``max_seqlen``; packed THD for
FlashAttention's varlen functions and Transformer Engine (one ``cu_seqlens``/``max_seqlen`` per
micro-batch, :func:`tokenloom.serve.batch.pack_documents`) plus a per-token ``document_ids`` for
FlexAttention's block mask; MaxText's ``inputs_segmentation``/``inputs_position``."""
SAMPLE_WIDE_FIELDS = ("cu_seqlens", "max_seqlen")
"""Boundary fields that describe a whole sample, not one token: never cut along the sequence."""


@dataclass(frozen=True, kw_only=True)
class SampleOptions:
    """Which fields a sample carries and how its masks treat document boundaries (megatron-core's
    ``GPTDatasetConfig`` switches of the same names)."""

    eod_mask_loss: bool = False
    """Zero the loss where the input token is the end-of-document id."""

    reset_position_ids: bool = False
    """Restart position ids at 0 after every end-of-document token."""

    reset_attention_mask: bool = False
    """Forbid attention across end-of-document tokens (only with ``create_attention_mask``)."""

    create_attention_mask: bool = False
    """Add the ``(1, S, S)`` bool causal mask per sample (megatron-core's default is True; it is
    S^2 bytes per sample, so tokenloom leaves it to the attention kernel unless asked)."""

    inter_document_masking: bool = False
    """Carry each sample's document boundaries (``cu_seqlens``, ``max_seqlen``) and restart
    position ids per document, from the index's document pieces, so that attention can stay
    inside each document (megatron-core's ``GPTDatasetConfig.inter_document_masking``)."""

    boundary_format: str = "megatron"
    """The form of the boundaries with ``inter_document_masking`` (:data:`BOUNDARY_FORMATS`):
    ``"megatron"`` (megatron-core's per-sample fields), ``"thd"`` (packed per micro-batch, for
    FlashAttention / Transformer Engine, plus ``document_ids`` for FlexAttention) or
    ``"segments"`` (MaxText's segment ids and positions)."""

    fim: FimTransform | None = None
    """Fill-in-the-middle (:class:`~tokenloom.serve.fim.FimTransform`): each sample of the
    datasets of ``fim_stores`` is permuted, from its own generator, before its fields are made;
    the pad tokens it adds are outside the loss, and document boundaries follow its
    end-of-document tokens."""

    fim_stores: tuple[str, ...] | None = None
    """The store prefixes whose samples ``fim`` permutes (a blend of code and prose permutes the
    code); None: every dataset."""

    def __post_init__(self) -> None:
        for name in ("eod_mask_loss", "reset_position_ids", "reset_attention_mask", "create_attention_mask",
                     "inter_document_masking"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"SampleOptions.{name}={getattr(self, name)!r}; expected True or False")
        if self.fim is not None and not isinstance(self.fim, FimTransform):
            raise ConfigError(f"SampleOptions.fim={self.fim!r}; expected a tokenloom.serve.fim.FimTransform or None")
        if self.fim_stores is not None:
            if self.fim is None:
                raise ConfigError(f"SampleOptions.fim_stores={self.fim_stores!r} without fim; give fim "
                                  "(a FimTransform) or drop fim_stores")
            if isinstance(self.fim_stores, str) or not all(isinstance(p, str) and p for p in self.fim_stores):
                raise ConfigError(f"SampleOptions.fim_stores={self.fim_stores!r}; expected a list of store prefixes")
            object.__setattr__(self, "fim_stores", tuple(self.fim_stores))
        if self.boundary_format not in BOUNDARY_FORMATS:
            raise ConfigError(f"SampleOptions.boundary_format={self.boundary_format!r}; expected one of "
                              f"{sorted(BOUNDARY_FORMATS)}")
        if self.boundary_format != "megatron" and not self.inter_document_masking:
            raise ConfigError(f"SampleOptions(boundary_format={self.boundary_format!r}, "
                              "inter_document_masking=False); a boundary format needs inter_document_masking=True")
        if self.inter_document_masking and self.create_attention_mask:
            raise ConfigError(
                "SampleOptions(inter_document_masking=True, create_attention_mask=True); expected one of them: "
                "with inter_document_masking megatron-core's GPTDataset returns cu_seqlens and no attention_mask "
                "(Megatron-LM turns create_attention_mask_in_dataloader off), and the attention kernel takes "
                "the boundaries instead of an S x S mask")

    @property
    def boundary_fields(self) -> tuple[str, ...]:
        """The document-boundary fields these options add (none without inter_document_masking)."""
        return BOUNDARY_FORMATS[self.boundary_format] if self.inter_document_masking else ()

    @property
    def field_names(self) -> tuple[str, ...]:
        """The fields a sample carries, in megatron-core's order."""
        if self.inter_document_masking:
            return FIELD_NAMES[:4] + self.boundary_fields
        return FIELD_NAMES if self.create_attention_mask else tuple(n for n in FIELD_NAMES if n != "attention_mask")


def _segment_starts(is_eod: np.ndarray) -> np.ndarray:
    """(B, S) int64: for every position, where its document segment starts (after the last EOD
    strictly before it)."""
    batch, seq = is_eod.shape
    after_eod = np.zeros((batch, seq), dtype=bool)
    after_eod[:, 1:] = is_eod[:, :-1]  # position j follows an EOD at j - 1
    starts = np.where(after_eod, np.arange(seq, dtype=np.int64), 0)  # (B, S)
    return np.maximum.accumulate(starts, axis=1)


def build_fields(rows: np.ndarray, *, eod_ids, pad_id: int, add_extra_token: bool = True,
                 options: SampleOptions = SampleOptions(), pieces=None,
                 describe_row=None) -> dict[str, np.ndarray]:
    """The training fields of every row, vectorised; see the module docstring.

    ``eod_ids``: one id for all rows, or one per row (``(B,)``, e.g. per dataset); None or -1
    means no EOD handling for that row. ``pieces``: ``(ends, counts)`` of the rows' document
    pieces (:class:`~tokenloom.source.protocol.PieceRows`), needed by ``inter_document_masking``
    (``describe_row``: row index -> its name in an error, see :func:`document_fields`).
    Returns tokens/labels/position_ids int64 ``(B, S)``, loss_mask float32 ``(B, S)``,
    attention_mask bool ``(B, 1, S, S)`` when asked, and with ``inter_document_masking`` the
    fields of its ``boundary_format``: cu_seqlens int32 ``(B, S + 1)`` and max_seqlen int32
    ``(B,)`` (``"megatron"``; ``"thd"`` adds document_ids int32 ``(B, S)`` and is packed per
    micro-batch later), or inputs_segmentation and inputs_position int32 ``(B, S)``
    (``"segments"``).
    """
    if options.inter_document_masking and pieces is None:
        raise ConfigError("inter_document_masking needs the rows' document pieces (pieces=(ends, counts), "
                          "from a source's read_pieces); the rows alone do not say where documents end")
    rows = np.asarray(rows)
    if rows.ndim != 2:
        raise ConfigError(f"rows has shape {rows.shape}; expected (batch, seq_length + add_extra_token)")
    rows = rows.astype(np.int64, copy=False)
    if add_extra_token:
        tokens = rows[:, :-1].copy()  # (B, S)
        labels = rows[:, 1:].copy()  # (B, S)
    else:
        tokens = rows.copy()
        labels = np.empty_like(rows)
        labels[:, :-1] = rows[:, 1:]
        labels[:, -1] = pad_id
    batch, seq = tokens.shape
    by_document = options.inter_document_masking
    needs_eod = options.eod_mask_loss or (options.reset_position_ids and not by_document) or (
        options.reset_attention_mask and options.create_attention_mask)
    if needs_eod:
        eod = _eod_column(eod_ids, batch)  # (B, 1) broadcasts against (B, S)
        is_eod = (tokens == eod) & (eod >= 0)  # (B, S)

    loss_mask = np.ones((batch, seq), dtype=np.float32)
    if options.eod_mask_loss:
        loss_mask[is_eod] = 0.0
    if (options.reset_position_ids and not by_document) or (options.reset_attention_mask
                                                             and options.create_attention_mask):
        starts = _segment_starts(is_eod)
    if by_document:
        segments = None if options.boundary_format == "megatron" else np.empty((batch, seq), dtype=np.int32)
        cu_seqlens, max_seqlen, position_ids = document_fields(*pieces, seq_length=seq,
                                                               add_extra_token=add_extra_token,
                                                               describe_row=describe_row, segments=segments)
    elif options.reset_position_ids:
        position_ids = np.arange(seq, dtype=np.int64) - starts  # (B, S)
    else:
        position_ids = np.broadcast_to(np.arange(seq, dtype=np.int64), (batch, seq)).copy()
    fields = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}
    if by_document and options.boundary_format == "segments":
        fields["inputs_segmentation"] = segments
        fields["inputs_position"] = position_ids.astype(np.int32)
    elif by_document:
        fields["cu_seqlens"] = cu_seqlens
        fields["max_seqlen"] = max_seqlen
        if options.boundary_format == "thd":
            fields["document_ids"] = segments
    if options.create_attention_mask:
        causal = np.tril(np.ones((seq, seq), dtype=bool))  # (S, S) True = may attend
        if options.reset_attention_mask:
            # query q may attend key k <= q only inside q's segment: k >= start(q)
            allowed = causal[None] & (np.arange(seq)[None, None, :] >= starts[:, :, None])  # (B, S, S)
        else:
            allowed = np.broadcast_to(causal, (batch, seq, seq))
        fields["attention_mask"] = ~allowed[:, None]  # (B, 1, S, S) True = masked
    # padding: no loss on it, and ids the embedding can look up (one scan when there is none)
    if (pad_id >= 0 or rows.min() <= pad_id) or not add_extra_token:
        loss_mask[labels == pad_id] = 0.0
        tokens[tokens == pad_id] = 0
        labels[labels == pad_id] = 0
    return fields


def document_fields(ends: np.ndarray, counts: np.ndarray, *, seq_length: int, add_extra_token: bool,
                    backend: str | None = None, describe_row=None,
                    segments: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """megatron-core's boundary fields from the rows' document pieces (see the module docstring):
    ``cu_seqlens`` (B, S + 1) int32, ``max_seqlen`` (B,) int32, ``position_ids`` (B, S) int64.

    ``ends``/``counts``: :class:`~tokenloom.source.protocol.PieceRows`'s. ``backend``: "numba"
    (the default where installed) or "numpy"; identical results. ``describe_row``: row index ->
    what an error calls that row (default "row k of the batch"). ``segments``: a ``(B, S)`` int32
    array to fill with each input token's segment id, MaxText's convention: the row's non-empty
    documents numbered from 1, 0 on padding (the columns past the row's tokens).
    """
    counts = np.ascontiguousarray(counts, dtype=np.int32)
    batch = counts.shape[0]
    cu_seqlens = np.empty((batch, seq_length + 1), dtype=np.int32)  # (B, S + 1)
    max_seqlen = np.empty(batch, dtype=np.int32)  # (B,)
    position_ids = np.empty((batch, seq_length), dtype=np.int64)  # (B, S)
    if backend is None:
        backend = "numba" if numba_available() else "numpy"
    want_segments = segments is not None
    if not want_segments:
        segments = np.empty((1, 1), dtype=np.int32)
    if backend == "numba":
        bad = compiled(_document_fields_kernel)(np.ascontiguousarray(ends, dtype=np.int32), counts,
                                                np.int64(seq_length), bool(add_extra_token), cu_seqlens,
                                                max_seqlen, position_ids, want_segments, segments)
    elif backend == "numpy":
        bad = _document_fields_numpy(np.asarray(ends), counts, seq_length, bool(add_extra_token), cu_seqlens,
                                     max_seqlen, position_ids, segments if want_segments else None)
    else:
        raise ConfigError(f"backend={backend!r}; expected 'numba' or 'numpy'")
    name = describe_row or (lambda row: f"row {row} of the batch")
    if bad <= -2:
        raise InputError(f"{name(-2 - bad)} holds {int(counts[-2 - bad])} document pieces, more than "
                         f"the {seq_length} that cu_seqlens (seq_length + 1 entries) can list: its window is "
                         "mostly empty documents, and megatron-core's GPTDataset fails on such a sample too; "
                         "drop the empty documents from the store or serve without inter_document_masking")
    if bad >= 0:
        raise FormatError(f"{name(bad)} has {int(counts[bad])} document pieces ending at "
                          f"{np.asarray(ends)[bad, :max(int(counts[bad]), 0)].tolist()[:8]}...; expected 1 to "
                          f"{seq_length + int(add_extra_token)} pieces ending in order at column "
                          f"{seq_length + int(add_extra_token)} or before (the index does not match its store)")
    return cu_seqlens, max_seqlen, position_ids


@jit(cache=True, nogil=True)
def _document_fields_kernel(ends, counts, seq_length, add_extra_token, cu_seqlens, max_seqlen, position_ids,
                            want_segments, segments):
    """Fill the three outputs row by row (megatron-core's rules, the module docstring's); returns
    -1, the first row whose pieces cannot be a sample's, or ``-2 - row`` for a row with more
    documents than ``cu_seqlens`` has room for."""
    for r in range(counts.shape[0]):
        n = np.int64(counts[r])
        if n < 1 or n > ends.shape[1]:
            return r
        last_end = np.int64(ends[r, n - 1])
        if add_extra_token:  # the extra token belongs to no input position
            last_end -= 1
            previous = np.int64(ends[r, n - 2]) if n >= 2 else np.int64(0)
            if last_end == previous:  # the last piece held only the extra token
                n -= 1
        if n > seq_length:
            return -2 - r
        if last_end > seq_length:
            return r
        cu_row = cu_seqlens[r]  # (S + 1,) a row view: the loops below compile to plain stores
        cu_row[0] = 0
        for j in range(n - 1):
            end = np.int64(ends[r, j])
            if end < cu_row[j] or end > seq_length:
                return r
            cu_row[j + 1] = end
        n = max(n, np.int64(1))  # a sample of padding alone is one document of padding
        cu_row[n:] = seq_length  # the last document ends at S: a short sample's padding joins it
        positions = position_ids[r]  # (S,)
        longest = 0
        for j in range(n):
            start = np.int64(cu_row[j])
            length = np.int64(cu_row[j + 1]) - start
            longest = max(longest, length)
            for c in range(length):
                positions[start + c] = c
        max_seqlen[r] = longest
        if want_segments:  # non-empty documents from 1; 0 past the row's tokens (padding)
            tokens_end = min(np.int64(ends[r, counts[r] - 1]), seq_length)
            row_segments = segments[r]  # (S,)
            segment = 0
            for j in range(n):
                start = np.int64(cu_row[j])
                stop = min(np.int64(cu_row[j + 1]), tokens_end)
                if cu_row[j + 1] > start:
                    segment += 1
                for c in range(start, stop):
                    row_segments[c] = segment
            row_segments[max(tokens_end, np.int64(0)):] = 0
    return -1


def _document_fields_numpy(ends, counts, seq_length, add_extra_token, cu_seqlens, max_seqlen,
                           position_ids, segments=None) -> int:
    """:func:`_document_fields_kernel` in vectorised numpy (where numba is missing)."""
    batch = counts.shape[0]
    n = counts.astype(np.int64)  # (B,)
    if batch == 0:
        return -1
    if n.min() < 1 or n.max() > ends.shape[1]:
        return int(np.flatnonzero((n < 1) | (n > ends.shape[1]))[0])
    width = int(n.max())
    rows = np.arange(batch)
    piece_ends = ends[:, :width].astype(np.int64)  # (B, width); columns >= n undefined
    columns = np.arange(width)
    last_end = piece_ends[rows, n - 1]
    if add_extra_token:
        last_end = last_end - 1
        previous = np.where(n >= 2, piece_ends[rows, np.maximum(n - 2, 0)], 0)
        n = n - (last_end == previous)
    inner = columns[None, :] < (n - 1)[:, None]  # (B, width) the pieces before the last
    ordered = np.diff(np.where(inner, piece_ends, 0), axis=1, prepend=0) >= 0
    crowded = n > seq_length
    bad = crowded | (last_end > seq_length) | (inner & ((piece_ends > seq_length) | ~ordered)).any(axis=1)
    if bad.any():
        first = int(np.flatnonzero(bad)[0])
        return -2 - first if crowded[first] else first
    n = np.maximum(n, 1)
    cu_seqlens[:] = seq_length
    cu_seqlens[:, 0] = 0
    k = min(width, seq_length)
    cu_seqlens[:, 1:k + 1] = np.where(inner[:, :k], piece_ends[:, :k], seq_length)
    max_seqlen[:] = np.diff(cu_seqlens[:, :k + 1], axis=1).max(axis=1)
    # position = column - start of its document: mark each document's first column, carry it right
    starts = np.zeros((batch, seq_length), dtype=np.int64)  # (B, S)
    first_columns = cu_seqlens[:, :k].astype(np.int64)  # (B, k) starts of documents 0..k-1
    valid = (columns[None, :k] < n[:, None]) & (first_columns < seq_length)
    starts[np.nonzero(valid)[0], first_columns[valid]] = first_columns[valid]
    np.maximum.accumulate(starts, axis=1, out=starts)
    np.subtract(np.arange(seq_length, dtype=np.int64), starts, out=position_ids)
    if segments is not None:  # count the non-empty documents started at or before each column
        non_empty = valid & (cu_seqlens[:, 1:k + 1] > cu_seqlens[:, :k])
        marks = np.zeros((batch, seq_length), dtype=np.int32)
        marks[np.nonzero(non_empty)[0], first_columns[non_empty]] = 1
        np.cumsum(marks, axis=1, out=segments)
        tokens_end = ends[rows, counts.astype(np.int64) - 1].astype(np.int64)  # (B,) raw end of the last piece
        segments[np.arange(seq_length)[None, :] >= tokens_end[:, None]] = 0
    return -1


def _eod_column(eod_ids, batch: int) -> np.ndarray:
    """(B, 1) int64 EOD id of every row, -1 where there is none."""
    if eod_ids is None:
        return np.full((batch, 1), -1, dtype=np.int64)
    if isinstance(eod_ids, np.ndarray) and eod_ids.dtype.kind in "iu":
        return np.broadcast_to(eod_ids.astype(np.int64, copy=False).reshape(-1, 1), (batch, 1))
    values = [-1 if e is None else int(e) for e in np.atleast_1d(np.asarray(eod_ids, dtype=object))]
    return np.broadcast_to(np.asarray(values, dtype=np.int64).reshape(-1, 1), (batch, 1))


def _reference_fields(row: np.ndarray, *, eod_id, pad_id: int, add_extra_token: bool,
                      options: SampleOptions) -> dict[str, np.ndarray]:
    """One row, with loops over EOD positions exactly as megatron-core writes them (tests only)."""
    row = np.asarray(row, dtype=np.int64)
    tokens = row[:-1].copy() if add_extra_token else row.copy()
    labels = row[1:].copy() if add_extra_token else np.append(row[1:], pad_id)
    seq = tokens.shape[0]
    mask = np.tril(np.ones((seq, seq)))[None]
    loss_mask = np.ones(seq, dtype=np.float32)
    position_ids = np.arange(seq, dtype=np.int64)
    if eod_id is not None:
        if options.eod_mask_loss:
            loss_mask[tokens == eod_id] = 0.0
        previous = 0
        for i in np.flatnonzero(tokens == eod_id):
            if options.reset_attention_mask:
                mask[0, i + 1:, : i + 1] = 0
            if options.reset_position_ids:
                position_ids[i + 1:] -= i + 1 - previous
                previous = i + 1
    out = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}
    if options.create_attention_mask:
        out["attention_mask"] = mask < 0.5
    loss_mask[labels == pad_id] = 0.0
    tokens[tokens == pad_id] = 0
    labels[labels == pad_id] = 0
    return out


__all__ = ["BOUNDARY_FORMATS", "FIELD_NAMES", "SAMPLE_WIDE_FIELDS", "SampleOptions", "build_fields",
           "document_fields"]
