"""Streaming writer of Megatron .bin/.idx token stores, finalized atomically.

Tokens stream into a hidden temporary .bin beside the target; lengths are kept in
memory as numpy chunks (4 bytes per sequence). ``finalize`` computes the pointer and
document arrays vectorised, writes the .idx to a temporary file, fsyncs both and renames
them into place, the .idx last: a store whose .idx exists is complete. A crash, an
exception inside ``with`` or Ctrl-C leaves no file under the target names.

Loss masks (``loss_mask=`` of the ``add_*`` methods) stream the same way into a hidden
temporary ``PREFIX.mask`` (:mod:`tokenloom.io.loss_mask`), opened when the first document
brings one (the tokens before it are all in the loss); ``finalize`` renames it into place
before the .idx and records it in ``PREFIX.meta.json``.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from tokenloom.errors import ConfigError, InputError
from tokenloom.io.format import (
    IdxHeader,
    bin_path,
    check_token_dtype,
    idx_path,
    meta_path,
    normalize_prefix,
)
from tokenloom.io.loss_mask import RECORD_KEY, MaskBitsWriter, check_mask_values, mask_path
from tokenloom.io.s3 import is_remote
from tokenloom.io.space import full_disk_error, is_full

_INT32_MAX = np.iinfo(np.int32).max


def fsync_dir(directory: str) -> None:
    """Make a rename inside ``directory`` durable (best effort where directories cannot be fsynced)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _temp_beside(path: str) -> tuple[int, str]:
    directory, name = os.path.split(os.path.abspath(path))
    return tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)


def write_json_atomic(path: str, payload, *, compact: bool = False) -> None:
    """Write ``payload`` as JSON to ``path`` via a temp file, fsync and rename.

    Indented for people to read, or ``compact`` (one line, no spaces) for the large records only
    programs read: Python's C encoder writes only that form (an indent sends ``json`` to its
    pure-Python encoder).
    """
    if compact:
        text = compact_json(payload)
    else:
        text = json.dumps(payload, indent=2, sort_keys=True)
    write_bytes_atomic(path, (text + "\n").encode("utf-8"))


def write_json_arrays_atomic(path: str, payload: Mapping[str, Any], arrays: Mapping[str, Iterable[str]]) -> None:
    """``write_json_atomic(path, {**payload, **arrays}, compact=True)`` without holding the whole
    text: each name of ``arrays`` becomes a JSON array of the given elements, each already
    compact JSON (``compact_json``), written as they come. The file is byte-identical to the
    one-shot form (keys sorted, no spaces), so a reader cannot tell them apart."""
    clash = set(payload) & set(arrays)
    if clash:
        raise ValueError(f"{path}: fields {sorted(clash)} given both as values and as arrays")
    names = sorted([*payload, *arrays])

    def write(f) -> None:
        f.write(b"{")
        for n, name in enumerate(names):
            f.write((("," if n else "") + json.dumps(name) + ":").encode("utf-8"))
            if name in payload:
                f.write(compact_json(payload[name]).encode("utf-8"))
                continue
            f.write(b"[")
            for i, element in enumerate(arrays[name]):
                f.write((b"," if i else b"") + element.encode("utf-8"))
            f.write(b"]")
        f.write(b"}\n")

    _write_atomic(path, write)


def compact_json(value: Any) -> str:
    """The text ``write_json_atomic(..., compact=True)`` gives ``value``: sorted keys, no spaces."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def write_bytes_atomic(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temp file beside it, fsync and rename: ``path`` holds the
    old content or the new, never a part."""
    _write_atomic(path, lambda f: f.write(data))


def _write_atomic(path: str, write: Callable[[Any], Any]) -> None:
    """``write(f)`` into a buffered temp file beside ``path``, fsync and rename onto ``path``; the
    temp file is removed if anything fails."""
    fd, tmp = _temp_beside(path)
    try:
        with os.fdopen(fd, "wb", buffering=1 << 20) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        _remove_quietly(tmp)
        raise


def _close_quietly(f) -> None:
    """Close a file being discarded; flushing its buffer into a full disk fails, and is not needed."""
    try:
        f.close()
    except OSError:
        pass


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def write_index_file(path: str, dtype: np.dtype, sequence_lengths, document_indices) -> None:
    """Write a complete .idx for contiguous sequences (pointers derived from the lengths).

    ``sequence_lengths`` (N,) and ``document_indices`` (M,) are written as int32 / int64.
    The file goes to ``path`` directly; callers that need atomicity pass a temp path.
    """
    sequence_lengths = np.ascontiguousarray(sequence_lengths, dtype=np.int32)
    document_indices = np.ascontiguousarray(document_indices, dtype=np.int64)
    header = IdxHeader(
        dtype=dtype,
        num_sequences=int(sequence_lengths.size),
        num_document_indices=int(document_indices.size),
    )
    with open(path, "wb", buffering=0) as f:
        f.write(header.pack())
        f.write(memoryview(sequence_lengths).cast("B"))
        # sequence_pointers: (N,) int64 byte offsets, computed and written a chunk at a time
        chunk = 1 << 23
        carry = 0
        for begin in range(0, sequence_lengths.size, chunk):
            part = sequence_lengths[begin : begin + chunk]
            pointers = np.cumsum(part, dtype=np.int64)  # token offsets of each sequence's end
            end = int(pointers[-1])
            pointers -= part
            pointers += carry
            pointers *= dtype.itemsize
            carry += end
            f.write(memoryview(pointers).cast("B"))
        f.write(memoryview(document_indices).cast("B"))
        os.fsync(f.fileno())


# long: one streaming writer of the three files (tokens, index, mask), whose adds share its checks and state
class IndexedDatasetWriter:
    """Write a token store at ``prefix`` in one streaming pass.

    Args:
        prefix: target path without suffix; ``prefix.bin`` / ``prefix.idx`` appear only
            when ``finalize`` succeeds (replacing an older store of that name).
        dtype: token dtype; use ``dtype_for_vocab(vocab_size)`` to pick it like Megatron.

    A document is one or more sequences: ``add_document`` writes a one-sequence document,
    ``add_sequence`` + ``end_document`` build multi-sequence ones (Megatron's ``add_item``
    / ``end_document``), ``add_documents`` appends many one-sequence documents at once.
    """

    def __init__(self, prefix, *, dtype=np.uint16) -> None:
        self.prefix = normalize_prefix(prefix)
        if is_remote(self.prefix):
            raise ConfigError(f"{self.prefix}: stores are written to local (or parallel) filesystems only; write "
                              "it to a local path and upload both files (for example with `aws s3 cp`)")
        self.dtype = check_token_dtype(dtype)
        directory = os.path.dirname(os.path.abspath(self.prefix))
        if not os.path.isdir(directory):
            raise ConfigError(f"{self.prefix}: output directory {directory} does not exist")
        fd, self._bin_tmp = _temp_beside(bin_path(self.prefix))
        self._bin = os.fdopen(fd, "wb", buffering=1 << 22)
        self._length_chunks: list[np.ndarray] = []
        self._boundary_chunks: list[np.ndarray] = [np.zeros(1, dtype=np.int64)]
        self._num_sequences = 0
        self._num_tokens = 0
        self._last_boundary = 0
        self._state = "open"
        self._mask: MaskBitsWriter | None = None
        """The sidecar's bits, from the first document given a loss mask on."""
        self.expected_bytes: int | None = None
        """What the whole store will take, where the caller knows it (a merge): named when the
        disk fills."""
        if np.issubdtype(self.dtype, np.integer):
            info = np.iinfo(self.dtype)
            self._token_range = (int(info.min), int(info.max))
        else:
            self._token_range = None

    # -- adding data ----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._state != "open":
            raise ConfigError(f"{self.prefix}: writer is already {self._state}")

    def _as_tokens(self, tokens) -> np.ndarray:
        tokens = np.asarray(tokens)
        if tokens.ndim != 1:
            raise InputError(f"{self.prefix}: tokens must be a 1-D array, got shape {tokens.shape}")
        if tokens.size and self._token_range is not None and tokens.dtype != self.dtype:
            if not np.issubdtype(tokens.dtype, np.integer):
                raise InputError(
                    f"{self.prefix}: tokens of dtype {tokens.dtype} given to an integer store "
                    f"of dtype {self.dtype}"
                )
            low, high = int(tokens.min()), int(tokens.max())
            if low < self._token_range[0] or high > self._token_range[1]:
                bad = low if low < self._token_range[0] else high
                raise InputError(
                    f"{self.prefix}: token id {bad} does not fit the store dtype {self.dtype} "
                    f"(range {self._token_range[0]}..{self._token_range[1]}); use a wider dtype "
                    "(int32 for vocabularies of 65500 ids or more)"
                )
        return np.ascontiguousarray(tokens, dtype=self.dtype)

    def _full(self, exc: OSError, *, needed: int | None = None):
        """The StorageError of a full disk, after discarding everything written."""
        self.abort()
        return full_disk_error(exc, os.path.dirname(os.path.abspath(self.prefix)), f"the token store {self.prefix}",
                               needed=needed if needed is not None else self.expected_bytes,
                               written=self._num_tokens * self.dtype.itemsize)

    def _as_mask(self, loss_mask, tokens: np.ndarray, what: str) -> np.ndarray | None:
        if loss_mask is None:
            return None
        return check_mask_values(self.prefix, loss_mask, int(tokens.size), what)

    def _start_mask(self) -> MaskBitsWriter:
        """The sidecar's writer, opened now if no document had a mask yet (those are all ones)."""
        if self._mask is None:
            fd, tmp = _temp_beside(mask_path(self.prefix))
            self._mask = MaskBitsWriter(tmp, os.fdopen(fd, "wb", buffering=1 << 20))
            self._mask.append_ones(self._num_tokens)
        return self._mask

    def _append(self, tokens: np.ndarray, lengths: np.ndarray, mask: np.ndarray | None = None) -> None:
        try:
            self._bin.write(tokens.tobytes())
            if mask is not None:
                self._start_mask().append(mask)
            elif self._mask is not None:
                self._mask.append_ones(tokens.size)
        except OSError as exc:
            if is_full(exc):
                raise self._full(exc) from None
            raise
        self._length_chunks.append(lengths.astype(np.int32))
        self._num_sequences += int(lengths.size)
        self._num_tokens += int(tokens.size)

    def add_sequence(self, tokens, *, loss_mask=None) -> None:
        """Append one sequence to the current document (close it with ``end_document``).

        ``loss_mask``: one 0 or 1 (bool or integer) per token, 1 where the token is a target the
        loss counts; None: every token is. A store gets a ``PREFIX.mask`` sidecar once any
        sequence has a mask (module docstring)."""
        self._check_open()
        tokens = self._as_tokens(tokens)
        if tokens.size > _INT32_MAX:
            raise InputError(
                f"{self.prefix}: a sequence of {tokens.size} tokens exceeds the format's int32 "
                "length field; split the document"
            )
        mask = self._as_mask(loss_mask, tokens, f"sequence {self._num_sequences}")
        self._append(tokens, np.array([tokens.size], dtype=np.int64), mask)

    def end_document(self) -> None:
        """Close the current document after the sequences added since the last one."""
        self._check_open()
        if self._num_sequences == self._last_boundary:
            raise ConfigError(f"{self.prefix}: end_document() with no sequence since the last one")
        self._boundary_chunks.append(np.array([self._num_sequences], dtype=np.int64))
        self._last_boundary = self._num_sequences

    def add_document(self, tokens, *, loss_mask=None) -> None:
        """Append one document of one sequence (``loss_mask``: as :meth:`add_sequence`)."""
        self.add_sequence(tokens, loss_mask=loss_mask)
        self.end_document()

    def add_documents(self, tokens, lengths, *, loss_mask=None) -> None:
        """Append ``len(lengths)`` one-sequence documents whose tokens are concatenated;
        ``loss_mask``: one 0 or 1 per token of ``tokens`` (as :meth:`add_sequence`), or None."""
        self._check_open()
        if self._num_sequences != self._last_boundary:
            raise ConfigError(f"{self.prefix}: add_documents() inside an open document")
        tokens = self._as_tokens(tokens)
        lengths = np.asarray(lengths)
        if lengths.ndim != 1 or (lengths.size and not np.issubdtype(lengths.dtype, np.integer)):
            raise InputError(f"{self.prefix}: lengths must be a 1-D integer array, got {lengths.dtype} {lengths.shape}")
        lengths = lengths.astype(np.int64)
        if lengths.size and (lengths.min() < 0 or lengths.max() > _INT32_MAX):
            raise InputError(f"{self.prefix}: document lengths must lie in [0, 2^31), got min {lengths.min()} "
                             f"max {lengths.max()}")
        if int(lengths.sum()) != tokens.size:
            raise InputError(
                f"{self.prefix}: lengths sum to {int(lengths.sum())} but {tokens.size} tokens were given"
            )
        mask = self._as_mask(loss_mask, tokens, f"documents {self._last_boundary}..")
        self._append(tokens, lengths, mask)
        self._boundary_chunks.append(self._num_sequences - lengths.size + 1 + np.arange(lengths.size, dtype=np.int64))
        self._last_boundary = self._num_sequences

    @property
    def temp_bin_path(self) -> str:
        """The hidden .bin being written (renamed to ``PREFIX.bin`` by :meth:`finalize`)."""
        return self._bin_tmp

    def reserve(self, num_bytes: int) -> None:
        """Size the hidden .bin to ``num_bytes`` so that other processes can write parts of it at
        their offsets (then :meth:`append_store` with ``copy_bytes=False`` records each part)."""
        self._check_open()
        self._bin.flush()
        os.truncate(self._bin_tmp, int(num_bytes))
        self._bin.seek(0, os.SEEK_END)

    def append_store(self, dataset, *, copy_bytes: bool = True) -> None:
        """Append every document of an open ``IndexedDataset``, copying its .bin as bytes.

        The caller validates ``dataset`` first (``tokenloom.io.validate``): its .bin must hold
        exactly the tokens its .idx describes. Its loss mask comes along (ones where it has none,
        once this store has a mask). ``copy_bytes=False`` records the documents only:
        their bytes were written into :attr:`temp_bin_path` at this point by someone else
        (after :meth:`reserve`).
        """
        self._check_open()
        if self._num_sequences != self._last_boundary:
            raise ConfigError(f"{self.prefix}: append_store() inside an open document")
        if dataset.dtype != self.dtype:
            raise ConfigError(
                f"cannot append {dataset.prefix} (dtype {dataset.dtype}) to {self.prefix} "
                f"(dtype {self.dtype}); stores must share one token dtype"
            )
        try:
            if copy_bytes:
                dataset.copy_bin_to(self._bin)
            if dataset.has_loss_mask:
                self._start_mask().append_bits(dataset.loss_mask_bits, dataset.num_tokens)
            elif self._mask is not None:
                self._mask.append_ones(dataset.num_tokens)
        except OSError as exc:
            if is_full(exc):
                raise self._full(exc) from None
            raise
        self._length_chunks.append(np.array(dataset.sequence_lengths, dtype=np.int32))
        # boundaries of the appended documents, shifted past the sequences already written
        self._boundary_chunks.append(np.asarray(dataset.document_indices[1:]) + self._num_sequences)
        self._num_sequences += dataset.num_sequences
        self._num_tokens += dataset.num_tokens
        self._last_boundary = self._num_sequences

    @property
    def num_sequences(self) -> int:
        return self._num_sequences

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    # -- ending -------------------------------------------------------------------------------
    def finalize(self, metadata: dict | None = None) -> None:
        """Make the store visible: fsync, write the .idx, rename both (the .idx last).

        ``metadata`` (a JSON-serialisable dict) becomes the ``PREFIX.meta.json`` sidecar, with
        the loss mask's record (:mod:`tokenloom.io.loss_mask`) when a document had a mask; an
        older ``PREFIX.mask`` is removed when none did.
        """
        self._check_open()
        if self._num_sequences != self._last_boundary:
            raise ConfigError(f"{self.prefix}: finalize() with an open document; call end_document()")
        idx_tmp = None
        mask_tmp = None if self._mask is None else self._mask.temp_path
        try:
            self._bin.flush()
            os.fsync(self._bin.fileno())
            self._bin.close()
            if metadata is not None and RECORD_KEY in metadata:  # another store's record: not this store's
                metadata = {k: v for k, v in metadata.items() if k != RECORD_KEY}
            if self._mask is not None:
                record = self._mask.finish(os.path.basename(mask_path(self.prefix)))
                metadata = {**(metadata or {}), RECORD_KEY: record}
            lengths = (
                np.concatenate(self._length_chunks) if self._length_chunks else np.zeros(0, np.int32)
            )
            boundaries = np.concatenate(self._boundary_chunks)
            fd, idx_tmp = _temp_beside(idx_path(self.prefix))
            os.close(fd)
            write_index_file(idx_tmp, self.dtype, lengths, boundaries)
            # An older store under this name must not look valid beside the new .bin.
            _remove_quietly(idx_path(self.prefix))
            if mask_tmp is not None:
                os.replace(mask_tmp, mask_path(self.prefix))
            else:
                _remove_quietly(mask_path(self.prefix))
            if metadata is not None:
                write_json_atomic(meta_path(self.prefix), metadata)
            else:
                _remove_quietly(meta_path(self.prefix))
            os.replace(self._bin_tmp, bin_path(self.prefix))
            os.replace(idx_tmp, idx_path(self.prefix))
            fsync_dir(os.path.dirname(os.path.abspath(self.prefix)))
        except BaseException as exc:
            self._state = "aborted"
            _close_quietly(self._bin)
            _remove_quietly(self._bin_tmp)
            if idx_tmp is not None:
                _remove_quietly(idx_tmp)
            if self._mask is not None:
                self._mask.abort()
            if is_full(exc):
                index_bytes = 8 * (self._num_sequences * 2 + self._last_boundary + 1) + 64
                raise full_disk_error(exc, os.path.dirname(os.path.abspath(self.prefix)),
                                      f"the token store {self.prefix}",
                                      needed=self.expected_bytes or self._num_tokens * self.dtype.itemsize
                                      + index_bytes) from None
            raise
        self._state = "finalized"

    def abort(self) -> None:
        """Discard everything written; nothing appears under the target names."""
        if self._state != "open":
            return
        self._state = "aborted"
        _close_quietly(self._bin)  # its buffer goes with the file: a full disk must not fail the abort
        _remove_quietly(self._bin_tmp)
        if self._mask is not None:
            self._mask.abort()

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif self._state == "open":
            self.abort()
            raise ConfigError(
                f"{self.prefix}: writer left without finalize(); nothing was written"
            )

    def __del__(self) -> None:  # last resort: never leave temp files behind
        if getattr(self, "_state", None) == "open":
            try:
                self.abort()
            except Exception:
                pass
