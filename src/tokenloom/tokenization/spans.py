"""Pre-tokenized records with the spans in the loss -> tokens and a per-token loss mask.

One JSONL line is one document::

    {"input_ids": [9, 14, 3, 7, 7, 2], "loss_spans": [[2, 4], [5, 6]]}

``input_ids`` are the document's token ids (each in ``[0, vocab_size)`` of the store's tokenizer);
``loss_spans`` are half-open ranges ``[begin, end)`` of positions in ``input_ids`` whose tokens
are targets the loss counts (mask 1), in increasing order and not overlapping (adjacent is
fine); every other token has mask 0. The example's mask is ``0 0 1 1 0 1``. Spans rather than a
0/1 list per token: what a chat or instruction pipeline knows is where the answers are, and a
record stays a few numbers longer than its ids, not twice as long.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from tokenloom.tokenization.inputs import RecordError


@dataclasses.dataclass(kw_only=True)
class SpanDocuments:
    """Tokens and mask of a batch of span records; ``bad`` lists those left out."""

    tokens: np.ndarray  # (T,) int64 ids back to back
    lengths: np.ndarray  # (documents,) int64
    loss_mask: np.ndarray  # (T,) uint8
    bad: list[tuple[int, RecordError]]


def _ids_of(record: Any, where: str, vocab_size: int) -> np.ndarray:
    if not isinstance(record, dict) or "input_ids" not in record:
        keys = sorted(record)[:8] if isinstance(record, dict) else None
        raise RecordError("missing_key", f"{where}: no key 'input_ids' in the object (its keys: {keys})")
    ids = record["input_ids"]
    if not isinstance(ids, list) or not all(type(i) is int for i in ids):
        kind = type(ids).__name__ if not isinstance(ids, list) else "an array holding a non-integer"
        raise RecordError("bad_spans", f"{where}: 'input_ids' is {kind}, expected an array of integer token ids")
    array = np.asarray(ids, dtype=np.int64) if ids else np.zeros(0, np.int64)
    if array.size:
        outside = np.flatnonzero((array < 0) | (array >= vocab_size))
        if outside.size:
            k = int(outside[0])
            raise RecordError("bad_spans", f"{where}: input_ids[{k}] is {int(array[k])}, outside the "
                              f"tokenizer's vocabulary [0, {vocab_size})")
    return array


def _mask_of(record: dict, where: str, num_tokens: int) -> np.ndarray:
    if "loss_spans" not in record:
        raise RecordError("missing_key", f"{where}: no key 'loss_spans' (the [begin, end) token ranges in the "
                          "loss) in the object")
    spans = record["loss_spans"]
    if not isinstance(spans, list):
        raise RecordError("bad_spans", f"{where}: 'loss_spans' is {type(spans).__name__}, expected an array of "
                          "[begin, end] pairs")
    mask = np.zeros(num_tokens, dtype=np.uint8)
    previous_end = 0
    for k, span in enumerate(spans):
        if not (isinstance(span, list) and len(span) == 2 and all(type(v) is int for v in span)):
            raise RecordError("bad_spans", f"{where}: loss_spans[{k}] is {span!r}, expected [begin, end] "
                              "with integer token positions")
        begin, end = span
        if not 0 <= begin < end <= num_tokens:
            raise RecordError("bad_spans", f"{where}: loss_spans[{k}] = [{begin}, {end}] is not a non-empty "
                              f"range within the record's {num_tokens} input_ids (0 <= begin < end <= "
                              f"{num_tokens})")
        if begin < previous_end:
            raise RecordError("bad_spans", f"{where}: loss_spans[{k}] = [{begin}, {end}] starts before the "
                              f"previous span ends ({previous_end}); spans must be in order and not overlap")
        mask[begin:end] = 1
        previous_end = end
    return mask


def encode_span_records(records: Sequence[Any], where: Sequence[str], vocab_size: int, *,
                        first_bad_only: bool = False) -> SpanDocuments:
    """Check and gather ``records`` (parsed JSON lines; ``where[i]`` is ``path:line``): ids in
    the vocabulary, spans in range and in order. Empty ``input_ids`` give an empty document
    (the caller leaves it out, as an empty text)."""
    ids: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    bad: list[tuple[int, RecordError]] = []
    for index, (record, at) in enumerate(zip(records, where)):
        try:
            array = _ids_of(record, at, vocab_size)
            mask = _mask_of(record, at, array.size)
        except RecordError as exc:
            bad.append((index, exc))
            if first_bad_only:
                break
            continue
        ids.append(array)
        masks.append(mask)
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    tokens = np.concatenate(ids) if ids else np.zeros(0, np.int64)
    loss_mask = np.concatenate(masks) if masks else np.zeros(0, np.uint8)
    return SpanDocuments(tokens=tokens, lengths=lengths, loss_mask=loss_mask, bad=bad)


__all__ = ["SpanDocuments", "encode_span_records"]
