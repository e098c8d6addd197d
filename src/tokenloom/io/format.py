"""The Megatron-LM indexed dataset format: constants and the 34-byte .idx header.

``PREFIX.idx`` starts with a fixed header::

    offset  size  field
    0       9     magic  b"MMIDIDX\\x00\\x00"
    9       8     version, little-endian u64, always 1
    17      1     dtype code (see DTYPE_CODES)
    18      8     sequence count N, u64
    26      8     document-index count M, u64 (documents + 1)

followed by N int32 sequence lengths, N int64 byte pointers into ``PREFIX.bin`` and
M int64 document indices. FORMAT.md walks through a worked example.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from tokenloom.errors import ConfigError, FormatError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_SIZE = 34
_HEADER = struct.Struct("<9sQBQQ")
assert _HEADER.size == HEADER_SIZE  # a constant of this module, not a check on input

#: Megatron's dtype codes, in its numbering.
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
CODES_BY_DTYPE: dict[np.dtype, int] = {dtype: code for code, dtype in DTYPE_CODES.items()}

#: Vocabularies below this size are stored as uint16, as Megatron's preprocessing does.
UINT16_VOCAB_LIMIT = 65500

IDX_SUFFIX = ".idx"
BIN_SUFFIX = ".bin"
META_SUFFIX = ".meta.json"


@dataclass(frozen=True, kw_only=True)
class IdxHeader:
    """The fixed-size header at the start of every .idx file."""

    dtype: np.dtype
    """Element type of the tokens in the .bin file."""
    num_sequences: int
    """N: entries in the sequence-length and pointer arrays."""
    num_document_indices: int
    """M: entries in the document-index array (number of documents + 1)."""

    @property
    def num_documents(self) -> int:
        return self.num_document_indices - 1

    def expected_idx_size(self) -> int:
        """Exact size in bytes of an .idx file with this header."""
        return HEADER_SIZE + 12 * self.num_sequences + 8 * self.num_document_indices

    def pack(self) -> bytes:
        return _HEADER.pack(
            MAGIC, VERSION, CODES_BY_DTYPE[self.dtype], self.num_sequences, self.num_document_indices
        )


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """Token dtype Megatron's preprocessing picks: uint16 below 65500 ids, else int32."""
    if not isinstance(vocab_size, (int, np.integer)) or vocab_size < 1:
        raise ConfigError(f"vocab_size must be a positive integer, got {vocab_size!r}")
    return np.dtype(np.uint16) if vocab_size < UINT16_VOCAB_LIMIT else np.dtype(np.int32)


def check_token_dtype(dtype) -> np.dtype:
    """Normalise ``dtype`` and check that Megatron's format can record it."""
    try:
        dtype = np.dtype(dtype)
    except TypeError as exc:
        raise ConfigError(f"token dtype {dtype!r} is not a numpy dtype") from exc
    if dtype not in CODES_BY_DTYPE:
        names = ", ".join(str(d) for d in CODES_BY_DTYPE)
        raise ConfigError(f"token dtype {dtype} cannot be stored; Megatron's format allows {names}")
    return dtype


def parse_header(data: bytes, path: str) -> IdxHeader:
    """Decode the header from the first bytes of ``path``; FormatError on anything unexpected."""
    if len(data) < HEADER_SIZE:
        raise FormatError(
            f"{path}: file is {len(data)} bytes, shorter than the {HEADER_SIZE}-byte .idx header; "
            "is the file truncated?"
        )
    magic, version, code, num_sequences, num_document_indices = _HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise FormatError(
            f"{path}: bad magic {magic!r} at byte 0, expected {MAGIC!r}; is this a Megatron .idx file?"
        )
    if version != VERSION:
        raise FormatError(f"{path}: version {version} at byte 9, expected {VERSION}")
    if code not in DTYPE_CODES:
        raise FormatError(
            f"{path}: dtype code {code} at byte 17, expected one of {sorted(DTYPE_CODES)}"
        )
    if num_document_indices < 1:
        raise FormatError(
            f"{path}: document-index count 0 at byte 26, expected at least 1 "
            "(the array always starts with a 0 boundary)"
        )
    return IdxHeader(
        dtype=DTYPE_CODES[code],
        num_sequences=num_sequences,
        num_document_indices=num_document_indices,
    )


def idx_path(prefix: str) -> str:
    return prefix + IDX_SUFFIX


def bin_path(prefix: str) -> str:
    return prefix + BIN_SUFFIX


def meta_path(prefix: str) -> str:
    return prefix + META_SUFFIX


def normalize_prefix(prefix) -> str:
    """Accept ``PREFIX``, ``PREFIX.idx`` or ``PREFIX.bin`` (str or PathLike); return ``PREFIX``."""
    prefix = str(prefix)
    for suffix in (IDX_SUFFIX, BIN_SUFFIX):
        if prefix.endswith(suffix):
            return prefix[: -len(suffix)]
    return prefix
