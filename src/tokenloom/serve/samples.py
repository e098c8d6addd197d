"""Training fields from token rows, as megatron-core's ``GPTDataset.__getitem__`` makes them.

From a ``(B, seq_length + 1)`` block of tokens (or ``(B, seq_length)`` without the extra token)
this builds, for every row at once:

* ``tokens`` -- the inputs, ``row[:-1]``;
* ``labels`` -- the targets, ``row[1:]`` (without the extra token: the row rolled left by one, its
  last label the pad id);
* ``loss_mask`` -- 1.0, 0.0 where the label is padding, and (``eod_mask_loss``) where the input
  token is the end-of-document id;
* ``position_ids`` -- ``0..S-1``, restarting at 0 after every EOD with ``reset_position_ids``;
* ``attention_mask`` (``create_attention_mask``) -- ``(B, 1, S, S)`` bool, True where attention is
  *masked*: above the diagonal, and with ``reset_attention_mask`` across EOD boundaries.

Then, as megatron-core does, pad ids in tokens and labels become 0 so the embedding can take them.
All numpy, no torch; the adapters wrap the arrays.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tokenloom.errors import ConfigError

FIELD_NAMES = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask")


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

    def __post_init__(self) -> None:
        for name in ("eod_mask_loss", "reset_position_ids", "reset_attention_mask", "create_attention_mask"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"SampleOptions.{name}={getattr(self, name)!r}; expected True or False")

    @property
    def field_names(self) -> tuple[str, ...]:
        """The fields a sample carries, in megatron-core's order."""
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
                 options: SampleOptions = SampleOptions()) -> dict[str, np.ndarray]:
    """The training fields of every row, vectorised; see the module docstring.

    ``eod_ids``: one id for all rows, or one per row (``(B,)``, e.g. per dataset); None or -1
    means no EOD handling for that row. Returns tokens/labels/position_ids int64 ``(B, S)``,
    loss_mask float32 ``(B, S)``, attention_mask bool ``(B, 1, S, S)`` when asked.
    """
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
    needs_eod = options.eod_mask_loss or options.reset_position_ids or (
        options.reset_attention_mask and options.create_attention_mask)
    if needs_eod:
        eod = _eod_column(eod_ids, batch)  # (B, 1) broadcasts against (B, S)
        is_eod = (tokens == eod) & (eod >= 0)  # (B, S)

    loss_mask = np.ones((batch, seq), dtype=np.float32)
    if options.eod_mask_loss:
        loss_mask[is_eod] = 0.0
    if options.reset_position_ids or (options.reset_attention_mask and options.create_attention_mask):
        starts = _segment_starts(is_eod)
    if options.reset_position_ids:
        position_ids = np.arange(seq, dtype=np.int64) - starts  # (B, S)
    else:
        position_ids = np.broadcast_to(np.arange(seq, dtype=np.int64), (batch, seq)).copy()
    fields = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}
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


__all__ = ["FIELD_NAMES", "SampleOptions", "build_fields"]
