"""The pack format: how a rank writes finished items into a pack and publishes it.

A pack is a ``.bin`` of many items' arrays, each a complete .npy image at a 64-byte aligned
offset, with its index (``.json``) and key list (``.keys``) beside it; the layout of the whole cache
directory is described in :mod:`tokenloom.builder.cache`. Here: the .npy header and hashed writes,
array digests (whole or in blocks), writing a pack and its index (:func:`write_pack`,
:func:`write_pack_index`), reading an index and a key list back, and :class:`PackWriter`, which
collects items and publishes them on a background thread through a :class:`PackPublisher` (a
:class:`~tokenloom.builder.cache.Cache` is one; the cache imports this module, not the reverse).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from tokenloom.errors import FormatError
from tokenloom.io.space import full_disk_error, is_full
from tokenloom.io.writer import fsync_dir, write_bytes_atomic, write_json_atomic

#: Version of the cache layout and key material; bump it when either changes.
CACHE_FORMAT_VERSION = 1

PACKS_DIR = "packs"
TMP_DIR = "tmp"
KEYS_SUFFIX = ".keys"
ALIGNMENT = 64
_HASH_CHUNK = 1 << 24

#: Bytes of arrays a pack collects before it is published (a pack is also published at the end).
#: A rank holds what it has not published (up to this, plus one pack being written), so this bounds
#: its memory: 8 MiB keeps it to 16 MiB of finished arrays. Smaller packs would hold less but make
#: more of them, and every listing of the packs reads the whole directory (:meth:`Cache.refresh`).
PACK_BYTES = 1 << 23


def npy_header(array: np.ndarray) -> bytes:
    """The .npy header ``numpy.save`` writes before ``array``'s bytes (format 1.0)."""
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, np.lib.format.header_data_from_array_1_0(array))
    return buffer.getvalue()


def _write_hashed(f, digest, data) -> None:
    view = memoryview(data).cast("B")
    for begin in range(0, len(view), _HASH_CHUNK):
        chunk = view[begin:begin + _HASH_CHUNK]
        digest.update(chunk)
        f.write(chunk)


def write_npy(path: str, array: np.ndarray) -> dict[str, Any]:
    """Write ``array`` as a .npy file (exactly what ``numpy.save`` writes), fsync it, and return
    ``{"bytes", "sha256"}``."""
    array = np.ascontiguousarray(array)
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        _write_hashed(f, digest, npy_header(array))
        if array.size:
            _write_hashed(f, digest, array.reshape(-1).view(np.uint8))
        f.flush()
        os.fsync(f.fileno())
        size = f.tell()
    return {"bytes": size, "sha256": digest.hexdigest()}


def sha256_range(path: str, offset: int, size: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(offset)
        remaining = size
        while remaining:
            chunk = f.read(min(_HASH_CHUNK, remaining))
            if not chunk:
                break
            digest.update(chunk)
            remaining -= len(chunk)
    return digest.hexdigest()


def root_digest(header_sha256: str, blocks: list[str]) -> str:
    """The SHA-256 of an array written in blocks (a divided blend): SHA-256 over the header's
    digest and every block's digest, in order (FORMAT.md, "Divided blends")."""
    digest = hashlib.sha256(bytes.fromhex(header_sha256))
    for block in blocks:
        digest.update(bytes.fromhex(block))
    return digest.hexdigest()


def array_digest(path: str, meta: Mapping[str, Any]) -> tuple[str, int | None]:
    """An array's digest as its file entry defines it (one SHA-256 of the .npy image, or
    ``"hash": "sha256-blocks"``: the root over the header and each block of ``block_bytes``),
    and the first block whose digest differs from the recorded one (None if none or no blocks)."""
    if meta.get("hash") != "sha256-blocks":
        return sha256_range(path, meta["offset"], meta["bytes"]), None
    header = sha256_range(path, meta["offset"], meta["data_offset"] - meta["offset"])
    blocks, bad = [], None
    end = meta["offset"] + meta["bytes"]
    for k, begin in enumerate(range(meta["data_offset"], end, meta["block_bytes"])):
        blocks.append(sha256_range(path, begin, min(meta["block_bytes"], end - begin)))
        if bad is None and (k >= len(meta["blocks"]) or blocks[-1] != meta["blocks"][k]):
            bad = k
    return root_digest(header, blocks), bad


# ------------------------------------------------------------------------------------ writing


def write_pack_index(root: str, name: str, records: Mapping[str, dict]) -> None:
    """Publish pack ``name``'s index: its key list (``<name>.keys``), then the index itself
    (``<name>.json``; the pack exists from that rename on). Both atomic."""
    directory = os.path.join(root, PACKS_DIR)
    write_bytes_atomic(os.path.join(directory, f"{name}{KEYS_SUFFIX}"),
                       "".join(f"{key}\n" for key in records).encode("ascii"))
    write_json_atomic(os.path.join(directory, f"{name}.json"),
                      {"format": "tokenloom-pack", "version": CACHE_FORMAT_VERSION, "pack": name,
                       "items": dict(records)}, compact=True)


@dataclass
class PendingItem:
    """An item a :class:`PackWriter` holds until its pack is written (its arrays are dropped then)."""

    key: str
    arrays: dict[str, np.ndarray]
    record: dict[str, Any]
    on_published: Callable[[dict], None] | None


def write_pack(root: str, items: list[PendingItem], *, needed: int | None = None) -> tuple[str, dict[str, dict]]:
    """Write ``items`` as one pack (data, fsync, rename; then the index the same way) into the
    cache at ``root``, whose directories exist; returns the pack's name and its records. A full
    disk names ``needed``, what the build writes in all, when known."""
    name = f"{time.strftime('%Y%m%dT%H%M%S')}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp = os.path.join(root, TMP_DIR, f"{name}.bin")
    final = os.path.join(root, PACKS_DIR, f"{name}.bin")
    records: dict[str, dict] = {}
    try:
        with open(tmp, "wb") as f:
            for item in items:
                files = {}
                for array_name, array in item.arrays.items():
                    pad = -f.tell() % ALIGNMENT
                    if pad:
                        f.write(b"\0" * pad)
                    offset = f.tell()
                    digest = hashlib.sha256()
                    header = npy_header(array)
                    _write_hashed(f, digest, header)
                    if array.size:
                        _write_hashed(f, digest, array.reshape(-1).view(np.uint8))
                    files[f"{array_name}.npy"] = {
                        "offset": offset, "data_offset": offset + len(header),
                        "bytes": f.tell() - offset, "sha256": digest.hexdigest(),
                        "dtype": array.dtype.str, "shape": list(array.shape),
                    }
                record = dict(item.record)
                record.update(key=item.key, format=CACHE_FORMAT_VERSION, files=files, pack=name)
                records[item.key] = record
                item.arrays = {}
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, final)
        fsync_dir(os.path.dirname(final))
        write_pack_index(root, name, records)
    except BaseException as exc:
        # a pack without its index is never read; a full disk takes its space back too
        keys = os.path.join(root, PACKS_DIR, f"{name}{KEYS_SUFFIX}")
        for path in (tmp, final, keys) if is_full(exc) else (tmp,):
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
        if is_full(exc):
            raise full_disk_error(exc, root, f"a pack of {len(items)} built item(s)", needed=needed) from None
        raise
    return name, records


# ------------------------------------------------------------------------------------ reading


def read_pack_keys(path: str) -> list[str]:
    """The item keys pack key list ``path`` names (FormatError if unreadable)."""
    try:
        with open(path, "rb") as f:
            return f.read().decode("ascii").split()
    except (OSError, UnicodeDecodeError) as exc:
        raise FormatError(f"{path}: unreadable pack key list: {exc}") from None


def read_pack_index(path: str) -> dict[str, dict]:
    """The records of pack index ``path``, read from disk (FormatError if unreadable)."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f).get("items", {})
    except (OSError, ValueError, AttributeError) as exc:
        raise FormatError(f"{path}: unreadable pack index: {exc}") from None


def not_indexed_error(path: str, key: str) -> FormatError:
    """The error for item ``key``, which the key list of pack index ``path`` names and the index does not."""
    name = os.path.basename(path)
    return FormatError(f"{path}: item {key} is in the pack's key list "
                       f"({name[: -len('.json')]}{KEYS_SUFFIX}) but not in its index; the pack index is "
                       "damaged (tokenloom cache verify)")


# ------------------------------------------------------------------------------------ the writer


class PackPublisher(Protocol):
    """Where a :class:`PackWriter` publishes its packs: :class:`~tokenloom.builder.cache.Cache` is
    the one the build uses (its ``publish_pack`` also learns the records it wrote)."""

    def publish_pack(self, items: list[PendingItem]) -> str:
        """Write ``items`` as one pack and publish it; returns the pack's .bin path."""


class PackWriter:
    """Collects finished items and publishes them in packs on a background thread.

    ``add`` returns at once; writing, hashing and fsync run on the publishing thread (they
    release the GIL) while the caller computes the next item. ``flush`` publishes what is
    collected; ``close`` publishes the rest and waits, re-raising the first failure.
    """

    def __init__(self, cache: PackPublisher, *, pack_bytes: int = PACK_BYTES, max_pending_packs: int = 1) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.cache = cache
        self.pack_bytes = pack_bytes
        self._items: list[PendingItem] = []
        self._bytes = 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenloom-pack")
        self._slots = threading.BoundedSemaphore(max_pending_packs)
        self._futures: list = []
        self._lock = threading.Lock()

    def add(self, key: str, arrays: Mapping[str, np.ndarray], record: Mapping[str, Any],
            on_published: Callable[[dict], None] | None = None) -> None:
        """Queue item ``key``; ``on_published(full_record)`` runs once its pack is published."""
        arrays = {name: np.ascontiguousarray(a) for name, a in arrays.items()}
        with self._lock:
            self._items.append(PendingItem(key, arrays, dict(record), on_published))
            self._bytes += sum(a.nbytes for a in arrays.values())
            full = self._bytes >= self.pack_bytes
        if full:
            self.flush()

    def flush(self) -> None:
        with self._lock:
            if not self._items:
                return
            items, self._items, self._bytes = self._items, [], 0
        self._slots.acquire()

        def run():
            try:
                return self.cache.publish_pack(items)
            finally:
                self._slots.release()

        self._futures.append(self._pool.submit(run))

    def close(self) -> None:
        """Publish everything queued and wait; re-raise the first failure."""
        try:
            self.flush()
        finally:
            first = None
            for future in self._futures:
                try:
                    future.result()
                except BaseException as exc:
                    first = first or exc
            self._futures = []
            self._pool.shutdown(wait=True)
            if first is not None:
                raise first


__all__ = [
    "ALIGNMENT",
    "CACHE_FORMAT_VERSION",
    "KEYS_SUFFIX",
    "PACKS_DIR",
    "PACK_BYTES",
    "TMP_DIR",
    "PackPublisher",
    "PackWriter",
    "PendingItem",
    "array_digest",
    "not_indexed_error",
    "npy_header",
    "read_pack_index",
    "read_pack_keys",
    "root_digest",
    "sha256_range",
    "write_npy",
    "write_pack",
    "write_pack_index",
]
