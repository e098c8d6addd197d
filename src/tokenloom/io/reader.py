"""Memory-mapped reader of Megatron .bin/.idx token stores.

Opening a store reads only the 34-byte header and the file sizes; the arrays are
views into a read-only memory map, so resident memory does not grow with the corpus.
A prefix ``s3://bucket/key`` opens a store on object storage (:mod:`tokenloom.io.remote`): the
same arrays over a node-local copy of its .idx, and tokens read from the .bin in cached blocks.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np

from tokenloom.errors import ConfigError, FormatError, PositionError
from tokenloom.io import remote, s3
from tokenloom.io.format import (
    HEADER_SIZE,
    IdxHeader,
    bin_path,
    idx_path,
    meta_path,
    normalize_prefix,
    parse_header,
)
from tokenloom.io.loss_mask import (
    MASK_HEADER_SIZE,
    RECORD_KEY,
    check_mask_header,
    check_record,
    mask_path,
    read_bit_range,
    read_bits_at,
)
from tokenloom.validate import check_positions, is_integer


def _map_readonly(path: str) -> np.ndarray:
    """The whole file as a read-only uint8 array (an empty array for an empty file)."""
    if os.path.getsize(path) == 0:
        return np.zeros(0, dtype=np.uint8)
    return np.memmap(path, dtype=np.uint8, mode="r")


def _span_positions(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``(sum(lengths),)`` int64: the .bin positions of every token of spans ``starts``/``lengths``."""
    total = int(lengths.sum())
    # positions: (total,) int64 = start of each span + rank inside its span
    span_of_token = np.repeat(np.arange(lengths.size), lengths)
    first_out = np.cumsum(lengths) - lengths
    return starts[span_of_token] + (np.arange(total) - first_out[span_of_token])


# long: a store's one reader; its tokens, spans and their loss masks share one set of range checks
class IndexedDataset:
    """A Megatron-format token store, opened by prefix.

    Args:
        prefix: path without suffix (``data/wiki`` for ``data/wiki.idx`` + ``data/wiki.bin``);
            a path ending in ``.idx`` or ``.bin`` is accepted too.

    Opening checks, in O(1), that the header is sane, that the .idx size matches the counts it
    declares, and that the .bin is long enough for the last sequence. ``validate()`` checks
    every array (O(number of sequences)).
    """

    def __init__(self, prefix) -> None:
        self.prefix = normalize_prefix(prefix)
        self.idx_path = idx_path(self.prefix)
        self.bin_path = bin_path(self.prefix)
        self.is_remote = s3.is_remote(self.prefix)
        """An ``s3://`` store: its .idx is a node-local copy, its .bin is read in blocks (io.remote)."""
        self.idx_info = self.bin_info = None
        if self.is_remote:
            s3.parse_url(self.idx_path)  # a malformed URL is a ConfigError before any request
            self.idx_info, self.bin_info = s3.head(self.idx_path), s3.head(self.bin_path)
            idx_size, self.bin_size = self.idx_info.size, self.bin_info.size
            local_idx = remote.fetch_to_node_cache(self.idx_info)
        else:
            missing = [os.path.basename(p) for p in (self.idx_path, self.bin_path) if not os.path.isfile(p)]
            if missing:
                where, base = os.path.split(os.path.abspath(self.prefix))
                if len(missing) == 2:
                    raise FormatError(f"no token store at {self.prefix}: {where} has neither {base}.idx nor "
                                      f"{base}.bin")
                raise FormatError(f"{self.prefix}: {missing[0]} is missing from {where} (a token store is the "
                                  f"pair {base}.idx and {base}.bin)")
            local_idx = self.idx_path
            idx_size, self.bin_size = os.path.getsize(self.idx_path), os.path.getsize(self.bin_path)
        with open(local_idx, "rb") as f:
            head = f.read(HEADER_SIZE)
        self.header: IdxHeader = parse_header(head, self.idx_path)
        expected = self.header.expected_idx_size()
        if idx_size != expected:
            raise FormatError(
                f"{self.idx_path}: file is {idx_size} bytes but its header declares "
                f"{self.header.num_sequences} sequences and {self.header.num_document_indices} "
                f"document indices, which need exactly {expected} bytes; the file is "
                f"{'truncated' if idx_size < expected else 'longer than its header says'}"
            )
        self._idx = _map_readonly(local_idx)
        n, m = self.header.num_sequences, self.header.num_document_indices
        offset = HEADER_SIZE
        # sequence_lengths: (N,) int32; sequence_pointers: (N,) int64; document_indices: (M,) int64
        self.sequence_lengths = np.frombuffer(self._idx, dtype=np.int32, count=n, offset=offset)
        offset += 4 * n
        self.sequence_pointers = np.frombuffer(self._idx, dtype=np.int64, count=n, offset=offset)
        offset += 8 * n
        self.document_indices = np.frombuffer(self._idx, dtype=np.int64, count=m, offset=offset)

        self.dtype: np.dtype = self.header.dtype
        self.itemsize: int = self.dtype.itemsize
        if n:
            last_length = int(self.sequence_lengths[-1])
            last_pointer = int(self.sequence_pointers[-1])
            end = last_pointer + last_length * self.itemsize
            if last_length < 0 or last_pointer < 0 or end > self.bin_size:
                raise FormatError(
                    f"{self.bin_path}: file is {self.bin_size} bytes but the last sequence "
                    f"(pointer {last_pointer}, length {last_length}) ends at byte {end} per "
                    f"{self.idx_path}; the .bin is truncated or belongs to another .idx"
                )
        if self.is_remote:
            # tokens: reads (bin_size // itemsize,) tokens of self.dtype in blocks
            self.tokens = remote.RemoteTokens(self.bin_info, self.dtype)
        else:
            bin_bytes = _map_readonly(self.bin_path)
            usable = self.bin_size - self.bin_size % self.itemsize
            # tokens: (bin_size // itemsize,) of self.dtype
            self.tokens = bin_bytes[:usable].view(self.dtype)
        self._metadata: dict | None = None
        self._metadata_loaded = False
        self._mask_bits = None
        self._mask_checked = False
        self.mask_info = None
        """An ``s3://`` store's loss-mask object (its HEAD), once :attr:`loss_mask_bits` opened it."""

    # -- sizes ----------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.header.num_sequences

    @property
    def num_sequences(self) -> int:
        return self.header.num_sequences

    @property
    def num_documents(self) -> int:
        return self.header.num_documents

    @property
    def num_tokens(self) -> int:
        """Total tokens over all sequences (int64 sum, exact beyond 2^31)."""
        return int(self.sequence_lengths.sum(dtype=np.int64))

    @property
    def metadata(self) -> dict | None:
        """The ``PREFIX.meta.json`` sidecar (tokenizer record etc.), or None if absent."""
        if not self._metadata_loaded:
            path = meta_path(self.prefix)
            text = s3.get_small(path) if self.is_remote else None
            if text is not None or (not self.is_remote and os.path.isfile(path)):
                try:
                    if text is None:
                        with open(path, encoding="utf-8") as f:
                            text = f.read()
                    self._metadata = json.loads(text)
                except (OSError, ValueError) as exc:
                    raise FormatError(f"{path}: unreadable sidecar JSON: {exc}") from exc
                if not isinstance(self._metadata, dict):
                    raise FormatError(f"{path}: sidecar must hold a JSON object, got {self._metadata!r:.60}")
            self._metadata_loaded = True
        return self._metadata

    # -- the loss mask (tokenloom.io.loss_mask) --------------------------------------------------
    @property
    def has_loss_mask(self) -> bool:
        """Whether the store carries a loss-mask sidecar (``PREFIX.mask``, recorded in
        ``PREFIX.meta.json``); checked against the store when first asked (FormatError naming the
        file when its size or header does not match)."""
        return self.loss_mask_bits is not None

    @property
    def loss_mask_bits(self):
        """The sidecar's bit bytes (token t is bit ``t & 7`` of byte ``t >> 3``), a read-only
        array or a remote object's bytes read in blocks; None without a sidecar."""
        if not self._mask_checked:
            self._mask_bits = self._open_mask()
            self._mask_checked = True
        return self._mask_bits

    def _open_mask(self):
        record = (self.metadata or {}).get(RECORD_KEY)
        if record is None:
            return None
        meta_file = meta_path(self.prefix)
        record = check_record(record, meta_file)
        path = mask_path(self.prefix)
        bin_tokens = self.bin_size // self.itemsize
        if self.is_remote:
            info = self.mask_info = s3.head(path)
            head = s3.get_range(info, 0, min(info.size, MASK_HEADER_SIZE))
            check_mask_header(head, path, info.size, record, bin_tokens, meta_file)
            return remote.RemoteBytes(info, MASK_HEADER_SIZE)
        if not os.path.isfile(path):
            raise FormatError(f"{path}: missing, but {meta_file} records a loss-mask sidecar of {record['bytes']} "
                              "bytes; copy the .mask file with the store, or write the store again")
        with open(path, "rb") as f:
            head = f.read(MASK_HEADER_SIZE)
        check_mask_header(head, path, os.path.getsize(path), record, bin_tokens, meta_file)
        return _map_readonly(path)[MASK_HEADER_SIZE:]

    def get_loss_mask(self, sequence_id: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """The loss mask of tokens ``[offset, offset + length)`` of one sequence, sliced as
        :meth:`get`: ``(length,)`` uint8, 1 where the token is in the loss; all ones for a store
        without a sidecar (callers need no branch)."""
        tokens = self.get(sequence_id, offset, length)  # the range checks
        if self.loss_mask_bits is None:
            return np.ones(tokens.shape[0], dtype=np.uint8)
        start = int(self.sequence_pointers[self._check_sequence(sequence_id)]) // self.itemsize + offset
        return read_bit_range(self.loss_mask_bits, start, start + tokens.shape[0])

    def read_loss_mask_spans(self, sequence_ids, offsets, lengths) -> np.ndarray:
        """The loss masks of the spans :meth:`read_spans` reads, concatenated: ``(sum(lengths),)``
        uint8 (all ones without a sidecar)."""
        starts, lengths = self._span_starts(sequence_ids, offsets, lengths)
        total = int(lengths.sum())
        if self.loss_mask_bits is None:
            return np.ones(total, dtype=np.uint8)
        if starts.size == 1:
            return read_bit_range(self.loss_mask_bits, int(starts[0]), int(starts[0]) + total)
        return read_bits_at(self.loss_mask_bits, _span_positions(starts, lengths))

    # -- reads ----------------------------------------------------------------------------------
    def _check_sequence(self, sequence_id) -> int:
        n = self.header.num_sequences
        if not is_integer(sequence_id) or not -n <= sequence_id < n:
            raise PositionError(f"{self.prefix}: sequence {sequence_id!r} is out of range; the store holds {n} "
                                f"sequences (ids in [0, {n}), or negative from the end)")
        return int(sequence_id) % n if n else 0

    def get(self, sequence_id: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of one sequence (to its end if length is None)."""
        i = self._check_sequence(sequence_id)
        seq_length = int(self.sequence_lengths[i])
        if length is None:
            length = seq_length - offset
        if offset < 0 or length < 0 or offset + length > seq_length:
            raise PositionError(
                f"{self.prefix}: tokens [{offset}, {offset + length}) outside sequence {i} "
                f"of length {seq_length}"
            )
        start = int(self.sequence_pointers[i]) // self.itemsize + offset
        return self.tokens[start : start + length]

    def __getitem__(self, sequence_id) -> np.ndarray:
        if isinstance(sequence_id, slice):
            return [self.get(i) for i in range(*sequence_id.indices(len(self)))]
        return self.get(sequence_id)

    def window(self, sequence_id: int, offset: int, length: int) -> np.ndarray:
        """``length`` tokens starting at ``offset`` in ``sequence_id``, running on into the
        sequences stored after it (documents are contiguous in the .bin)."""
        i = self._check_sequence(sequence_id)
        start = int(self.sequence_pointers[i]) // self.itemsize + offset
        if offset < 0 or length < 0 or start + length > self.tokens.shape[0]:
            raise PositionError(
                f"{self.prefix}: window of {length} tokens at offset {offset} of sequence {i} "
                f"runs past the end of the store ({self.tokens.shape[0]} tokens)"
            )
        return self.tokens[start : start + length]

    def read_spans(self, sequence_ids, offsets, lengths) -> np.ndarray:
        """Concatenate many spans ``tokens[seq][offset:offset+length]`` in one vectorised gather.

        Returns a new array (not a view) of ``sum(lengths)`` tokens.
        """
        starts, lengths = self._span_starts(sequence_ids, offsets, lengths)
        if starts.size == 0:
            return np.zeros(0, dtype=self.dtype)
        total = int(lengths.sum())
        if self.is_remote:
            return self.tokens.read_runs(starts, lengths)
        if starts.size == 1:
            return np.array(self.tokens[starts[0] : starts[0] + total])
        return self.tokens[_span_positions(starts, lengths)]

    def _span_starts(self, sequence_ids, offsets, lengths) -> tuple[np.ndarray, np.ndarray]:
        """``(starts, lengths)``: each span's first token position in the .bin, and its length
        (int64); the spans checked against their sequences."""
        sequence_ids = np.asarray(sequence_ids, dtype=np.int64)
        offsets = np.asarray(offsets, dtype=np.int64)
        lengths = np.asarray(lengths, dtype=np.int64)
        if not sequence_ids.shape == offsets.shape == lengths.shape or sequence_ids.ndim != 1:
            raise ConfigError(
                f"read_spans needs three 1-D arrays of one length, got shapes "
                f"{sequence_ids.shape}, {offsets.shape}, {lengths.shape}"
            )
        if sequence_ids.size == 0:
            return sequence_ids, lengths
        n = self.header.num_sequences
        check_positions(sequence_ids, n, what=f"{self.prefix} holds {n} sequences", name="sequence ids")
        seq_lengths = self.sequence_lengths[sequence_ids].astype(np.int64)
        if (offsets < 0).any() or (lengths < 0).any() or (offsets + lengths > seq_lengths).any():
            bad = int(np.flatnonzero((offsets < 0) | (lengths < 0) | (offsets + lengths > seq_lengths))[0])
            raise PositionError(f"{self.prefix}: span {bad} (tokens [{int(offsets[bad])}, "
                                f"{int(offsets[bad] + lengths[bad])}) of sequence {int(sequence_ids[bad])}) runs "
                                f"outside its sequence of {int(seq_lengths[bad])} tokens")
        # starts: (num_spans,) int64 token positions in the .bin
        return self.sequence_pointers[sequence_ids] // self.itemsize + offsets, lengths

    def copy_bin_to(self, fileobj) -> None:
        """Write the whole .bin to the binary file ``fileobj`` (streamed; a remote one in large GETs)."""
        if self.is_remote:
            for chunk in self.tokens.iter_bytes():
                fileobj.write(chunk)
            return
        with open(self.bin_path, "rb") as src:
            shutil.copyfileobj(src, fileobj, 1 << 24)

    def close(self) -> None:
        """Drop the memory maps (views handed out earlier keep theirs alive)."""
        self._idx = self.tokens = self._mask_bits = None  # type: ignore[assignment]
        self._mask_checked = False

    def __repr__(self) -> str:
        return (
            f"IndexedDataset({self.prefix!r}, sequences={self.num_sequences}, "
            f"documents={self.num_documents}, dtype={self.dtype})"
        )
