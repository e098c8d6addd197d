"""Consistency checks and statistics of a token store (``tokenloom inspect``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from tokenloom.errors import FormatError
from tokenloom.io.format import HEADER_SIZE, meta_path
from tokenloom.io.loss_mask import RECORD_KEY, bits_digest, mask_path
from tokenloom.io.reader import IndexedDataset

_CHUNK = 1 << 24  # elements per pass over the big arrays: bounded memory at any corpus size


def validate(dataset: IndexedDataset) -> None:
    """Check every array of ``dataset`` against the others and against the .bin size.

    Raises FormatError naming the file, the byte offset of the first bad entry and what was
    expected. Runs in O(sequences) time with O(1) extra memory per chunk; a loss-mask sidecar is
    read whole too (1/8 byte per token) and its bits checked against the SHA-256 its record keeps.
    """
    n = dataset.num_sequences
    lengths, pointers, docs = dataset.sequence_lengths, dataset.sequence_pointers, dataset.document_indices
    pointers_offset = HEADER_SIZE + 4 * n
    docs_offset = pointers_offset + 8 * n
    itemsize = dataset.itemsize
    expected_pointer = 0
    for begin in range(0, n, _CHUNK):
        part_lengths = lengths[begin : begin + _CHUNK].astype(np.int64)
        part_pointers = pointers[begin : begin + _CHUNK]
        negative = np.flatnonzero(part_lengths < 0)
        if negative.size:
            i = begin + int(negative[0])
            raise FormatError(
                f"{dataset.idx_path}: sequence {i} has negative length {int(lengths[i])} "
                f"(byte {HEADER_SIZE + 4 * i}); expected >= 0"
            )
        # expected: (chunk,) byte offsets if sequences are stored back to back
        expected = expected_pointer + (np.cumsum(part_lengths) - part_lengths) * itemsize
        wrong = np.flatnonzero(part_pointers != expected)
        if wrong.size:
            i = begin + int(wrong[0])
            raise FormatError(
                f"{dataset.idx_path}: sequence {i} has pointer {int(pointers[i])} at byte "
                f"{pointers_offset + 8 * i}, expected {int(expected[wrong[0]])} (the previous "
                "pointer plus the previous length in bytes)"
            )
        expected_pointer = int(expected[-1] + part_lengths[-1] * itemsize)
    if expected_pointer != dataset.bin_size:
        raise FormatError(
            f"{dataset.bin_path}: file is {dataset.bin_size} bytes but {dataset.idx_path} "
            f"describes {expected_pointer} bytes of tokens"
        )
    if int(docs[0]) != 0:
        raise FormatError(
            f"{dataset.idx_path}: first document index is {int(docs[0])} at byte {docs_offset}, expected 0"
        )
    if int(docs[-1]) != n:
        raise FormatError(
            f"{dataset.idx_path}: last document index is {int(docs[-1])} at byte "
            f"{docs_offset + 8 * (docs.size - 1)}, expected the sequence count {n}"
        )
    for begin in range(0, docs.size - 1, _CHUNK):
        part = docs[begin : begin + _CHUNK + 1]
        steps = np.flatnonzero(np.diff(part) < 0)
        if steps.size:
            i = begin + int(steps[0]) + 1
            raise FormatError(
                f"{dataset.idx_path}: document index {i} is {int(docs[i])} at byte "
                f"{docs_offset + 8 * i}, smaller than the one before ({int(docs[i - 1])}); "
                "expected a non-decreasing array"
            )
    if dataset.has_loss_mask:  # opening it checked its size and header against the store
        record = dataset.metadata[RECORD_KEY]
        digest = bits_digest(dataset.loss_mask_bits, record["num_tokens"])
        if digest != record["sha256"]:
            raise FormatError(f"{mask_path(dataset.prefix)}: its bits have SHA-256 {digest[:16]}... but "
                              f"{meta_path(dataset.prefix)} records {record['sha256'][:16]}...; the mask was "
                              "changed or damaged after the store was written")


@dataclass(frozen=True, kw_only=True)
class LengthStats:
    """Summary of document lengths in tokens."""

    min: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: int


@dataclass(frozen=True, kw_only=True)
class StoreReport:
    """What ``tokenloom inspect`` prints about one store."""

    prefix: str
    dtype: str
    num_sequences: int
    num_documents: int
    num_tokens: int
    idx_bytes: int
    bin_bytes: int
    document_lengths: LengthStats | None
    """Lengths of documents in tokens (a document may span several sequences)."""
    empty_documents: int
    consistent: bool
    problem: str | None
    """The FormatError message when the store is inconsistent."""
    metadata: dict | None
    token_scan: dict | None = field(default=None)
    """With ``scan_tokens``: min and max token id, count of the EOD id, and ids >= vocab."""

    def to_dict(self) -> dict:
        return asdict(self)


def _document_lengths(dataset: IndexedDataset) -> np.ndarray:
    # document_lengths: (documents,) int64 tokens per document
    cumulative = np.concatenate([[0], np.cumsum(dataset.sequence_lengths, dtype=np.int64)])
    return np.diff(cumulative[np.asarray(dataset.document_indices)])


def _scan_tokens(dataset: IndexedDataset) -> dict:
    metadata = dataset.metadata or {}
    tokenizer = metadata.get("tokenizer") or {}
    eod_id, vocab_size = tokenizer.get("eod_id"), tokenizer.get("vocab_size")
    low, high, eod_count, out_of_vocab = None, None, 0, 0
    tokens = dataset.tokens
    for begin in range(0, tokens.size, _CHUNK):
        part = np.asarray(tokens[begin : begin + _CHUNK])
        low = int(part.min()) if low is None else min(low, int(part.min()))
        high = int(part.max()) if high is None else max(high, int(part.max()))
        if eod_id is not None:
            eod_count += int(np.count_nonzero(part == eod_id))
        if vocab_size is not None:
            out_of_vocab += int(np.count_nonzero(part >= vocab_size))
    return {
        "min_token_id": low,
        "max_token_id": high,
        "eod_id": eod_id,
        "eod_count": eod_count if eod_id is not None else None,
        "vocab_size": vocab_size,
        "ids_outside_vocab": out_of_vocab if vocab_size is not None else None,
    }


def inspect_store(prefix, *, scan_tokens: bool = False) -> StoreReport:
    """Open, validate and summarise the store at ``prefix``.

    A store that cannot be opened raises FormatError; one that opens but fails ``validate``
    is reported with ``consistent=False`` and the problem, so the counts are still shown.
    """
    dataset = IndexedDataset(prefix)
    try:
        validate(dataset)
        problem = None
    except FormatError as exc:
        problem = str(exc)
    stats, empty = None, 0
    if problem is None and dataset.num_documents > 0:
        doc_lengths = _document_lengths(dataset)
        p50, p90, p99 = np.percentile(doc_lengths, [50, 90, 99])
        stats = LengthStats(
            min=int(doc_lengths.min()),
            mean=float(doc_lengths.mean()),
            p50=float(p50),
            p90=float(p90),
            p99=float(p99),
            max=int(doc_lengths.max()),
        )
        empty = int(np.count_nonzero(doc_lengths == 0))
    return StoreReport(
        prefix=dataset.prefix,
        dtype=str(dataset.dtype),
        num_sequences=dataset.num_sequences,
        num_documents=dataset.num_documents,
        num_tokens=dataset.num_tokens,
        idx_bytes=dataset.header.expected_idx_size(),
        bin_bytes=dataset.bin_size,
        document_lengths=stats,
        empty_documents=empty,
        consistent=problem is None,
        problem=problem,
        metadata=dataset.metadata,
        token_scan=_scan_tokens(dataset) if scan_tokens and problem is None else None,
    )
