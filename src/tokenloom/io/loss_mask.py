"""The loss-mask sidecar ``PREFIX.mask``: one bit per token of ``PREFIX.bin``, 1 where the token is
a target the loss counts (an assistant turn), 0 where it is not (a prompt).

A Megatron store holds tokens only; instruction and chat data need to say which tokens carry loss
(Megatron-LM's ``SFTDataset`` marks the others ``IGNORE_INDEX``, OLMo-core keeps ``label_mask``
arrays beside its token arrays). The sidecar sits beside ``.bin``/``.idx`` and leaves both
unchanged, so megatron-core still loads the tokens; tokenloom reads it, merges it and serves it.
Layout (FORMAT.md, "The loss-mask sidecar")::

    offset  size           field
    0       8              magic  b"TLMASK\\x00\\x01"
    8       8              version, little-endian u64, always 1
    16      8              token count T, u64 (the tokens of PREFIX.bin)
    24      ceil(T / 8)    the bits: token t is bit (t & 7) of byte 24 + (t >> 3), least
                           significant bit first (numpy's ``bitorder="little"``); the unused
                           high bits of the last byte are 0

The bits are aligned with the .bin (token t of the mask is the token at byte ``t * itemsize`` of
the .bin), not with the documents, so a reader finds a sequence's mask from the pointer it
already uses for its tokens, and a merge concatenates masks as it concatenates .bin files.

**Bits, not bytes.** A mask is 1/8 byte per token: 1/16 of a uint16 .bin, 1/32 of an int32
one, where a byte per token (OLMo-core's bool arrays) would add half of a uint16 store again.
Serving reads a micro-batch's bits in one compiled loop over its samples' pieces, a byte (8
tokens) at a time (:mod:`tokenloom.source.gather`), which reads 1/8 of the bytes a byte mask would
and costs about the same (BENCHMARKS.md, "Loss masks", measures both).

``PREFIX.meta.json`` records the sidecar under ``"loss_mask"`` (:func:`mask_record`): its file
name, size and the SHA-256 of its bits; the record is what says a store has a mask (a ``.mask``
file without one is ignored, as any other file beside a store is), and a store opens only when the
file's size and header agree with it and with the .bin (:func:`open_mask_bits`).
"""

from __future__ import annotations

import hashlib
import os
import struct

import numpy as np

from tokenloom.errors import FormatError, InputError

MASK_SUFFIX = ".mask"
MASK_MAGIC = b"TLMASK\x00\x01"
MASK_VERSION = 1
MASK_HEADER_SIZE = 24
_MASK_HEADER = struct.Struct("<8sQQ")
RECORD_KEY = "loss_mask"
"""The key of ``PREFIX.meta.json`` that records the sidecar."""

_CHUNK_TOKENS = 1 << 26
"""Tokens unpacked at once when a whole mask is streamed (8 MiB of bits, 64 MiB unpacked)."""


def mask_path(prefix: str) -> str:
    """``PREFIX.mask``."""
    return prefix + MASK_SUFFIX


def mask_file_bytes(num_tokens: int) -> int:
    """The exact size of the sidecar of a store of ``num_tokens`` tokens."""
    return MASK_HEADER_SIZE + (int(num_tokens) + 7) // 8


def pack_header(num_tokens: int) -> bytes:
    return _MASK_HEADER.pack(MASK_MAGIC, MASK_VERSION, int(num_tokens))


def check_mask_values(prefix: str, loss_mask, num_tokens: int, what: str) -> np.ndarray:
    """``loss_mask`` as a ``(num_tokens,)`` uint8 array of 0/1; InputError naming ``prefix`` and
    the values when it is not one 0 or 1 (bool or integer) per token of ``what``."""
    mask = np.asarray(loss_mask)
    if mask.ndim != 1 or mask.shape[0] != num_tokens:
        raise InputError(f"{prefix}: loss_mask of shape {mask.shape} for {what} of {num_tokens} tokens; expected one "
                         "0 or 1 per token")
    if mask.dtype == np.bool_:
        return mask.view(np.uint8)
    if not np.issubdtype(mask.dtype, np.integer):
        raise InputError(f"{prefix}: loss_mask of dtype {mask.dtype} for {what}; expected bool or integer 0/1")
    if mask.size:
        bad = np.flatnonzero((mask != 0) & (mask != 1))
        if bad.size:
            raise InputError(f"{prefix}: loss_mask holds {mask[bad[:5]].tolist()} (first at token {int(bad[0])}) "
                             f"for {what}; expected only 0 (outside the loss) and 1 (in the loss)")
    return mask.astype(np.uint8, copy=False)


class MaskBitsWriter:
    """Appends 0/1 values to a hidden temporary sidecar as packed bits (what
    ``IndexedDatasetWriter`` calls once a document has a mask); :meth:`finish` writes the header
    and returns the record for ``PREFIX.meta.json``; the caller renames the file into place."""

    def __init__(self, temp_path: str, fileobj) -> None:
        self.temp_path = temp_path
        self._file = fileobj
        self._file.write(b"\x00" * MASK_HEADER_SIZE)  # the header, written by finish() when T is known
        self._pending = np.zeros(0, dtype=np.uint8)  # (< 8,) values not yet a whole byte
        self._digest = hashlib.sha256()
        self.num_tokens = 0
        self.num_masked = 0

    def append(self, values: np.ndarray) -> None:
        """Append ``values`` ((n,) uint8 0/1)."""
        self.num_tokens += int(values.shape[0])
        self.num_masked += int(values.shape[0]) - int(np.count_nonzero(values))
        if self._pending.size:
            values = np.concatenate([self._pending, values])
        whole = values.shape[0] // 8 * 8
        self._write(np.packbits(values[:whole], bitorder="little"))
        self._pending = values[whole:].copy()

    def append_ones(self, count: int) -> None:
        """Append ``count`` ones (documents without a mask are all in the loss)."""
        for begin in range(0, int(count), _CHUNK_TOKENS):
            self.append(np.ones(min(_CHUNK_TOKENS, int(count) - begin), dtype=np.uint8))

    def append_bits(self, bits, num_tokens: int) -> None:
        """Append the first ``num_tokens`` values of another sidecar's bit bytes ``bits``."""
        for begin in range(0, int(num_tokens), _CHUNK_TOKENS):
            self.append(read_bit_range(bits, begin, min(num_tokens, begin + _CHUNK_TOKENS)))

    def _write(self, data: np.ndarray) -> None:
        if data.size:
            self._digest.update(data)
            self._file.write(data.tobytes())

    def finish(self, file_name: str) -> dict:
        """Write the last bits and the header, flush and fsync; the record of the sidecar."""
        if self._pending.size:
            self._write(np.packbits(self._pending, bitorder="little"))
            self._pending = np.zeros(0, dtype=np.uint8)
        self._file.flush()
        self._file.seek(0)
        self._file.write(pack_header(self.num_tokens))
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        return mask_record(file_name, self.num_tokens, self.num_masked, self._digest.hexdigest())

    def abort(self) -> None:
        try:
            self._file.close()
        except OSError:
            pass
        try:
            os.remove(self.temp_path)
        except FileNotFoundError:
            pass


def mask_record(file_name: str, num_tokens: int, num_masked: int, sha256: str) -> dict:
    """The ``"loss_mask"`` entry of ``PREFIX.meta.json``."""
    return {"file": file_name, "format": "bits", "version": MASK_VERSION, "num_tokens": int(num_tokens),
            "bytes": mask_file_bytes(num_tokens), "tokens_outside_loss": int(num_masked), "sha256": sha256}


def check_record(record, meta_file: str) -> dict:
    """The ``"loss_mask"`` record of ``meta_file``, checked for the fields a reader needs."""
    fields = {"file": str, "num_tokens": int, "bytes": int, "sha256": str}
    if not isinstance(record, dict) or any(not isinstance(record.get(k), t) for k, t in fields.items()):
        raise FormatError(f"{meta_file}: its \"{RECORD_KEY}\" entry {record!r:.200} is not a sidecar record; "
                          f"expected an object with {', '.join(f'{k} ({t.__name__})' for k, t in fields.items())}")
    if record.get("format", "bits") != "bits" or record.get("version", MASK_VERSION) != MASK_VERSION:
        raise FormatError(f"{meta_file}: loss-mask sidecar of format {record.get('format')!r} version "
                          f"{record.get('version')!r}; this tokenloom reads format 'bits' version {MASK_VERSION}")
    return record


def check_mask_header(head: bytes, path: str, size: int, record: dict, bin_tokens: int, meta_file: str) -> None:
    """FormatError unless the sidecar at ``path`` (``size`` bytes, starting with ``head``) is the
    one ``record`` describes and covers the ``bin_tokens`` tokens of the .bin."""
    if record["num_tokens"] != bin_tokens:
        raise FormatError(f"{meta_file}: its loss mask covers {record['num_tokens']} tokens but the .bin holds "
                          f"{bin_tokens}; the sidecar belongs to another store (write the store again)")
    if size != record["bytes"] or size != mask_file_bytes(bin_tokens):
        raise FormatError(f"{path}: file is {size} bytes but a mask of the store's {bin_tokens} tokens is "
                          f"{mask_file_bytes(bin_tokens)} bytes (and {meta_file} records {record['bytes']}); the "
                          f"sidecar is {'truncated' if size < mask_file_bytes(bin_tokens) else 'too long'} or belongs "
                          "to another store")
    if len(head) < MASK_HEADER_SIZE:
        raise FormatError(f"{path}: {len(head)} bytes, shorter than the {MASK_HEADER_SIZE}-byte mask header")
    magic, version, count = _MASK_HEADER.unpack_from(head, 0)
    if magic != MASK_MAGIC:
        raise FormatError(f"{path}: bad magic {magic!r} at byte 0, expected {MASK_MAGIC!r}; is this a tokenloom "
                          "loss-mask sidecar?")
    if version != MASK_VERSION:
        raise FormatError(f"{path}: version {version} at byte 8, expected {MASK_VERSION}")
    if count != bin_tokens:
        raise FormatError(f"{path}: header says {count} tokens at byte 16 but the store's .bin holds {bin_tokens}")


def bits_digest(bits, num_tokens: int) -> str:
    """SHA-256 of a sidecar's bit bytes (``bits``: the bytes after the header)."""
    digest = hashlib.sha256()
    size = (int(num_tokens) + 7) // 8
    step = 1 << 24
    for begin in range(0, size, step):
        digest.update(np.ascontiguousarray(bits[begin:min(size, begin + step)]))
    return digest.hexdigest()


def read_bit_range(bits, start: int, stop: int) -> np.ndarray:
    """``(stop - start,)`` uint8 0/1: the values of tokens ``[start, stop)`` from the bit bytes
    ``bits`` (a memory map, or a remote object's bytes: anything sliceable)."""
    if stop <= start:
        return np.zeros(0, dtype=np.uint8)
    first, last = start >> 3, (stop + 7) >> 3
    unpacked = np.unpackbits(np.asarray(bits[first:last]), bitorder="little")
    skip = start - (first << 3)
    return unpacked[skip:skip + (stop - start)]


def read_bits_at(bits, positions: np.ndarray) -> np.ndarray:
    """``positions.shape`` uint8 0/1: the values of the tokens at ``positions`` (int64)."""
    data = np.asarray(bits[positions >> 3])
    return (data >> (positions & 7).astype(np.uint8)) & np.uint8(1)


__all__ = [
    "MASK_HEADER_SIZE",
    "MASK_MAGIC",
    "MASK_SUFFIX",
    "MASK_VERSION",
    "RECORD_KEY",
    "MaskBitsWriter",
    "bits_digest",
    "check_mask_header",
    "check_mask_values",
    "check_record",
    "mask_file_bytes",
    "mask_path",
    "mask_record",
    "read_bit_range",
    "read_bits_at",
]
