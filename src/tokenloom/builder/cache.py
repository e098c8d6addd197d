"""The cache directory: packs of finished items, a manifest per build, and verification.

Layout (FORMAT.md walks through an example)::

    CACHE/
      packs/<pack>.bin        arrays of many items, each a complete .npy image (what numpy.save
                              writes) at a 64-byte aligned offset
      packs/<pack>.json       the pack's index: every item's record and, per array, offset,
                              size, SHA-256, dtype and shape; an item exists once an index lists it
      packs/<pack>.keys       the keys the index lists, one per line, written before the index:
                              a reader learns where every item is from these and parses an
                              index only when it needs one of its records
      builds/<build_key>.json the manifest of one build: versions, config, stores, items, timings
      locks/items.lock        advisory locks of builders (one byte per item key)
      tmp/                    packs being written (never read)

A rank gathers the items it builds into a pack and publishes it in three atomic steps: the .bin
is written into ``tmp/`` with its hashes computed on the way, fsynced and renamed into ``packs/``,
then its key list and its index are written the same way. A reader only follows an index, so it
never sees a half-written array. Items cost no file each (a pack of thousands of items is two files and one fsync,
and one memory map serves all its arrays when opened).

Two builders of one item (two jobs sharing a cache) lock it first, so one builds while the other
waits and then finds it in the first one's pack (:meth:`Cache.built_elsewhere`). Where locks do
not work (some network filesystems), or where one job trails the other by less than ``RELIST_S``,
both may build it: both packs hold identical arrays, and readers take either.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import io
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from tokenloom.errors import BuildError, FormatError
from tokenloom.io.space import full_disk_error, is_full
from tokenloom.io.writer import fsync_dir, write_bytes_atomic, write_json_arrays_atomic, write_json_atomic

#: Version of the cache layout and key material; bump it when either changes.
CACHE_FORMAT_VERSION = 1

PACKS_DIR = "packs"
BUILDS_DIR = "builds"
LOCKS_DIR = "locks"
LOCK_FILE = "items.lock"
TMP_DIR = "tmp"
KEYS_SUFFIX = ".keys"
ALIGNMENT = 64
_HASH_CHUNK = 1 << 24

#: Bytes of arrays a pack collects before it is published (a pack is also published at the end).
#: A rank holds what it has not published (up to this, plus one pack being written), so this bounds
#: its memory: 8 MiB keeps it to 16 MiB of finished arrays. Smaller packs would hold less but make
#: more of them, and every listing of the packs reads the whole directory (:meth:`Cache.refresh`).
PACK_BYTES = 1 << 23

#: How old the last listing of the packs may be when a build asks, after taking an item's lock
#: uncontended, whether another job published the item (:meth:`Cache.built_elsewhere`).
RELIST_S = 0.1

log = logging.getLogger(__name__)


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


def host_record() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}


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
class _PendingItem:
    key: str
    arrays: dict[str, np.ndarray]
    record: dict[str, Any]
    on_published: Callable[[dict], None] | None


class PackWriter:
    """Collects finished items and publishes them in packs on a background thread.

    ``add`` returns at once; writing, hashing and fsync run on the publishing thread (they
    release the GIL) while the caller computes the next item. ``flush`` publishes what is
    collected; ``close`` publishes the rest and waits, re-raising the first failure.
    """

    def __init__(self, cache: Cache, *, pack_bytes: int = PACK_BYTES, max_pending_packs: int = 1) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.cache = cache
        self.pack_bytes = pack_bytes
        self._items: list[_PendingItem] = []
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
            self._items.append(_PendingItem(key, arrays, dict(record), on_published))
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


# ------------------------------------------------------------------------------------ the cache


class Cache:
    """A cache directory (created on first write)."""

    expected_bytes: int | None = None
    """What the build in progress writes here in all, when known: named if the disk fills."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(str(root))
        self._lock_fd: int | None = None
        self._ensured = False
        self._index: dict[str, tuple[str, dict]] = {}  # key -> (pack .bin path, record)
        # key -> {pack .bin path: record}: every copy. Two jobs may both build an item (see
        # acquire); their copies hold identical bytes at different offsets of different packs.
        self._copies: dict[str, dict[str, dict]] = {}
        self._seen_packs: set[str] = set()  # pack index names whose keys are known
        self._other_names: set[str] = set()  # names in packs/ that are not pack indexes (.bin, key lists)
        self._parsed: set[str] = set()  # pack index names whose records are read
        # key -> pack index names whose key list names it and whose records are not read yet
        self._unparsed: dict[str, list[str]] = {}
        self._maps: dict[str, np.memmap] = {}
        self._index_lock = threading.Lock()
        self._listed_at = float("-inf")  # time.monotonic() when the last listing of packs/ began
        self._contended: set[int] = set()  # lock tokens this process waited for (or could not take)

    def __reduce__(self):  # a copy in another process reads the indexes and maps the packs anew
        return (Cache, (self.root,))

    def ensure(self) -> None:
        if self._ensured:
            return
        for name in (PACKS_DIR, BUILDS_DIR, LOCKS_DIR, TMP_DIR):
            os.makedirs(os.path.join(self.root, name), exist_ok=True)
        self._ensured = True

    # -- the index ------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Learn the packs published since the last look: from a pack's key list where it has
        one (its index is parsed when one of its records is first asked for), else from its index."""
        directory = os.path.join(self.root, PACKS_DIR)
        listed_at = time.monotonic()
        try:
            present = set(os.listdir(directory))
        except FileNotFoundError:  # nothing published yet
            self._listed_at = max(self._listed_at, listed_at)
            return
        with self._index_lock:
            # a build asks after every item it is about to make, with hundreds of packs listed:
            # the names already known are dropped in one set difference, not looked at one by one
            for name in sorted(present.difference(self._seen_packs, self._other_names)):
                if not name.endswith(".json"):
                    self._other_names.add(name)
                    continue
                keys_name = name[: -len(".json")] + KEYS_SUFFIX
                if keys_name in present:
                    path = os.path.join(directory, keys_name)
                    try:
                        with open(path, "rb") as f:
                            keys = f.read().decode("ascii").split()
                    except (OSError, UnicodeDecodeError) as exc:
                        raise FormatError(f"{path}: unreadable pack key list: {exc}") from None
                    for key in keys:
                        self._unparsed.setdefault(key, []).append(name)
                else:  # written before key lists existed
                    self._parse_pack(name)
                self._seen_packs.add(name)
            self._listed_at = max(self._listed_at, listed_at)

    def _read_pack_index(self, name: str) -> dict[str, dict]:
        """The records of pack index ``name``, read from disk (FormatError if unreadable)."""
        path = os.path.join(self.root, PACKS_DIR, name)
        try:
            with open(path, encoding="utf-8") as f:
                return json.load(f).get("items", {})
        except (OSError, ValueError, AttributeError) as exc:
            raise FormatError(f"{path}: unreadable pack index: {exc}") from None

    def _not_indexed(self, name: str, key: str) -> FormatError:
        return FormatError(f"{os.path.join(self.root, PACKS_DIR, name)}: item {key} is in the pack's key list "
                           f"({name[: -len('.json')]}{KEYS_SUFFIX}) but not in its index; the pack index is "
                           "damaged (tokenloom cache verify)")

    def _parse_pack(self, name: str) -> None:
        """Read the records of pack index ``name`` (the caller holds the index lock)."""
        self._add_records(name, self._read_pack_index(name))

    def _add_records(self, name: str, records: Mapping[str, dict]) -> None:
        """Index the records of pack index ``name``. Of several copies of an item (two jobs built
        it), readers take the one of the first pack in name order."""
        bin_path = os.path.join(self.root, PACKS_DIR, name[: -len(".json")] + ".bin")
        self._parsed.add(name)
        for key, record in records.items():
            self._copies.setdefault(key, {})[bin_path] = record
            held = self._index.get(key)
            if held is None or bin_path < held[0]:
                self._index[key] = (bin_path, record)

    def _resolve(self, key: str) -> None:
        """Parse the indexes of the packs whose key lists name ``key`` and have not been read."""
        with self._index_lock:
            names = self._unparsed.get(key, [])
            for name in names:
                if name not in self._parsed:
                    self._parse_pack(name)  # a damaged index raises, and raises again when asked again
            self._unparsed.pop(key, None)
            for name in names:
                bin_path = os.path.join(self.root, PACKS_DIR, name[: -len(".json")] + ".bin")
                if bin_path not in self._copies.get(key, {}):
                    raise self._not_indexed(name, key)

    def has(self, key: str, *, refresh: bool = True) -> bool:
        """Whether item ``key`` is in a published pack."""
        if key not in self._index and key not in self._unparsed and refresh:
            self.refresh()
        return key in self._index or key in self._unparsed

    def item_keys(self) -> list[str]:
        """Every item key in a published pack (refreshed), sorted."""
        self.refresh()
        return sorted(set(self._index) | set(self._unparsed))

    def read_record(self, key: str) -> dict[str, Any]:
        return self.entry(key)[1]

    def entry(self, key: str) -> tuple[str, dict[str, Any]]:
        """``(pack .bin path, record)`` of item ``key``: the copy readers use."""
        if not self.has(key):
            raise BuildError(f"{self.root}: cache item {key} is missing; rebuild it")
        if key in self._unparsed:
            self._resolve(key)
        return self._index[key]

    def stream_records(self, keys) -> Iterator[tuple[str, dict[str, Any]]]:
        """``(key, record)`` for each of ``keys``: the copy :meth:`entry` would give, read one pack
        index at a time and not kept (a manifest of thousands of items without holding all their
        records at once). Raises BuildError for a key no pack holds."""
        self.refresh()
        chosen: dict[str, list[str]] = {}  # pack index name -> the keys read from it
        with self._index_lock:
            for key in keys:
                names = set(self._unparsed.get(key, ()))
                names.update(os.path.basename(b)[: -len(".bin")] + ".json" for b in self._copies.get(key, {}))
                if not names:
                    raise BuildError(f"{self.root}: cache item {key} is missing; rebuild it")
                chosen.setdefault(min(names), []).append(key)  # the first pack in name order, as entry()
            parsed = {name: {k: self._copies[k][os.path.join(self.root, PACKS_DIR, name[: -len(".json")] + ".bin")]
                             for k in wanted} for name, wanted in chosen.items() if name in self._parsed}
        for name, wanted in sorted(chosen.items()):
            records = parsed[name] if name in parsed else self._read_pack_index(name)
            for key in wanted:
                if key not in records:
                    raise self._not_indexed(name, key)
                yield key, records[key]

    def copies(self, key: str) -> dict[str, dict[str, Any]]:
        """Every copy of item ``key``: pack .bin path -> record (empty if no pack holds it)."""
        if self.has(key, refresh=False):
            self.entry(key)
        return dict(self._copies.get(key, {}))

    def parse_all(self) -> list[str]:
        """Parse every pack index not read yet; returns one line per index that cannot be read
        or whose key list disagrees with it (what ``verify`` reports)."""
        self.refresh()
        problems = []
        with self._index_lock:
            listed: dict[str, set[str]] = {}
            for key, names in self._unparsed.items():
                for name in names:
                    listed.setdefault(name, set()).add(key)
            self._unparsed = {}
            for name in sorted(self._seen_packs - self._parsed):
                try:
                    self._parse_pack(name)
                except FormatError as exc:
                    problems.append(str(exc))
                    listed.pop(name, None)
        directory = os.path.join(self.root, PACKS_DIR)
        for name, keys in sorted(listed.items()):
            bin_path = os.path.join(directory, name[: -len(".json")] + ".bin")
            indexed = {key for key, copies in self._copies.items() if bin_path in copies}
            if keys != indexed:
                problems.append(f"{os.path.join(directory, name)}: its key list names {len(keys)} item(s), "
                                f"its index {len(indexed)}; they differ "
                                f"(e.g. {sorted(keys ^ indexed)[0]}); the pack index is damaged")
        return problems

    def locate(self, key: str, name: str) -> tuple[str, dict[str, Any]]:
        """``(pack path, file entry)`` of array ``name`` of item ``key``."""
        path, record = self.entry(key)
        entry = record["files"].get(f"{name}.npy")
        if entry is None:
            raise BuildError(f"{self.root}: cache item {key} has no array {name!r}; rebuild it")
        return path, entry

    def open_array(self, key: str, name: str) -> np.ndarray:
        """Array ``name`` of item ``key``: a read-only memory map into its pack."""
        path, entry = self.locate(key, name)
        pack = self._maps.get(path)
        if pack is None:
            try:
                pack = np.memmap(path, dtype=np.uint8, mode="r")
            except (OSError, ValueError) as exc:
                raise BuildError(f"{path}: cannot map pack: {exc}") from None
            self._maps[path] = pack
        begin, end = entry["data_offset"], entry["offset"] + entry["bytes"]
        if end > pack.shape[0]:
            raise FormatError(f"{path}: array {name} of item {key} ends at byte {end}, past the pack's "
                              f"{pack.shape[0]} bytes; the pack is truncated")
        dtype = np.dtype(entry["dtype"])
        return pack[begin:end].view(dtype).reshape(entry["shape"])

    def npy_image(self, key: str, name: str) -> bytes:
        """The complete .npy file of array ``name`` of item ``key`` (bytes numpy.save writes)."""
        path, entry = self.locate(key, name)
        with open(path, "rb") as f:
            f.seek(entry["offset"])
            return f.read(entry["bytes"])

    # -- writing --------------------------------------------------------------------------------
    def publish_pack(self, items: list[_PendingItem]) -> str:
        """Write ``items`` as one pack (data, fsync, rename; then the index the same way)."""
        self.ensure()
        name = f"{time.strftime('%Y%m%dT%H%M%S')}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp = os.path.join(self.root, TMP_DIR, f"{name}.bin")
        final = os.path.join(self.root, PACKS_DIR, f"{name}.bin")
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
            write_pack_index(self.root, name, records)
        except BaseException as exc:
            # a pack without its index is never read; a full disk takes its space back too
            keys = os.path.join(self.root, PACKS_DIR, f"{name}{KEYS_SUFFIX}")
            for path in (tmp, final, keys) if is_full(exc) else (tmp,):
                try:
                    os.remove(path)
                except FileNotFoundError:
                    pass
            if is_full(exc):
                raise full_disk_error(exc, self.root, f"a pack of {len(items)} built item(s)",
                                      needed=self.expected_bytes) from None
            raise
        with self._index_lock:
            self._add_records(f"{name}.json", records)
            self._seen_packs.add(f"{name}.json")
        for item in items:
            if item.on_published is not None:
                item.on_published(records[item.key])
        return final

    # -- locks ----------------------------------------------------------------------------------
    def acquire(self, key: str) -> int:
        """Take item ``key``'s lock (blocking while another builder holds it); returns the token
        to pass to :meth:`release`.

        One lock file serves every item: each key locks one byte of it (POSIX record locks), so
        locking costs no file creation. Record locks are per process; within a process each item
        is built once, so only other processes (other jobs) ever wait.
        """
        if self._lock_fd is None:
            self.ensure()
            self._lock_fd = os.open(os.path.join(self.root, LOCKS_DIR, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
        offset = int(key[:15], 16)  # 60 bits of the key: one byte of a sparse, never written file
        try:
            fcntl.lockf(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, offset)
            self._contended.discard(offset)
            return offset
        except OSError as exc:
            if exc.errno not in (errno.EACCES, errno.EAGAIN):  # not "held by another process"
                self._contended.add(offset)
                log.debug("%s: building item %s without its lock (%s)", self.root, key, exc)
                return offset
        self._contended.add(offset)  # another job holds it: most likely building the item now
        try:
            fcntl.lockf(self._lock_fd, fcntl.LOCK_EX, 1, offset)
        except OSError:
            # No locking on this filesystem, or EDEADLK: record locks belong to processes, so two
            # jobs whose threads wait on each other's held items form a cycle the kernel refuses.
            # Building without the lock is safe: both jobs write identical bytes, and the index
            # keeps the first pack published.
            log.debug("%s: building item %s without its lock", self.root, key)
        return offset

    def built_elsewhere(self, key: str, token: int) -> bool:
        """Whether another job published item ``key``; ask right after :meth:`acquire` gave
        ``token``. The packs are listed again if that lock was held by another job (which has
        most likely just published the item) or the last listing is older than ``RELIST_S``;
        otherwise the packs already known answer. A build asks this for each item it makes, and
        listing the packs each time would cost every item a read of the whole directory, so the
        build's listings would grow with its items times its packs. A job that trails another by
        less than ``RELIST_S`` may build an item the other has just published: both copies hold
        identical bytes, and readers take the first pack's (see :meth:`_add_records`)."""
        stale = token in self._contended or time.monotonic() - self._listed_at > RELIST_S
        return self.has(key, refresh=stale)

    def release(self, token: int) -> None:
        self._contended.discard(token)
        try:
            fcntl.lockf(self._lock_fd, fcntl.LOCK_UN, 1, token)
        except OSError:
            pass

    def close_locks(self) -> None:
        """Release every lock this process holds on the cache."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # -- manifests ------------------------------------------------------------------------------
    def manifest_path(self, build_key: str) -> str:
        return os.path.join(self.root, BUILDS_DIR, f"{build_key}.json")

    def write_manifest(self, build_key: str, manifest: Mapping[str, Any], items: Iterable[str] = ()) -> str:
        """Write ``builds/<build_key>.json``: ``manifest``'s fields and ``items``, the entries as
        compact JSON texts, streamed (atomic: the old file or the whole new one)."""
        self.ensure()
        path = self.manifest_path(build_key)
        write_json_arrays_atomic(path, manifest, {"items": items})
        return path

    def manifests(self) -> list[str]:
        directory = os.path.join(self.root, BUILDS_DIR)
        if not os.path.isdir(directory):
            return []
        return sorted(os.path.join(directory, n) for n in os.listdir(directory) if n.endswith(".json"))


# ------------------------------------------------------------------------------------ verify


@dataclass(frozen=True, kw_only=True)
class VerifyReport:
    """What ``verify_cache`` found."""

    root: str
    """The cache directory."""
    manifests: int
    """Manifests read."""
    items: int
    """Items checked."""
    files: int
    """Arrays hashed."""
    problems: tuple[str, ...]
    """One line per problem, naming the file; empty when the cache is sound."""

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_cache(root: str) -> VerifyReport:
    """Check every array of every item each manifest lists: its pack present and long enough,
    its bytes with the recorded SHA-256, the pack's index agreeing with the manifest."""
    cache = Cache(root)
    if not os.path.isdir(cache.root):
        raise FormatError(f"{cache.root}: no such cache directory")
    problems: list[str] = cache.parse_all()
    checked: set[str] = set()
    files = 0
    manifests = cache.manifests()
    if not manifests:
        problems.append(f"{os.path.join(cache.root, BUILDS_DIR)}: no build manifest; is this a tokenloom cache?")
    for path in manifests:
        try:
            with open(path, encoding="utf-8") as f:
                manifest = json.load(f)
        except (OSError, ValueError) as exc:
            problems.append(f"{path}: unreadable manifest: {exc}")
            continue
        for entry in manifest.get("items", []):
            key = entry.get("key")
            if key in checked:
                continue
            checked.add(key)
            if not cache.has(key, refresh=False):
                problems.append(f"item {key} ({entry.get('label')}, listed in {path}) is in no pack index")
                continue
            pack_path, record = cache.entry(key)
            if entry.get("pack") is not None:  # the copy this manifest's build uses
                pack_path = os.path.join(cache.root, PACKS_DIR, f"{entry['pack']}.bin")
                record = cache.copies(key).get(pack_path)
                if record is None:
                    problems.append(f"{pack_path[:-4]}.json: does not index item {key}, which manifest {path} "
                                    "places in that pack")
                    continue
            if record.get("files") != entry.get("files"):
                problems.append(f"{pack_path[:-4]}.json: item {key} differs from manifest {path}")
            if not os.path.isfile(pack_path):
                problems.append(f"{pack_path}: missing (holds item {key}, {entry.get('label')})")
                continue
            size = os.path.getsize(pack_path)
            for name, meta in entry.get("files", {}).items():
                where = f"{pack_path} [{name} of item {key}, bytes {meta['offset']}..{meta['offset'] + meta['bytes']}]"
                if meta["offset"] + meta["bytes"] > size:
                    problems.append(f"{where}: past the end of the {size}-byte pack; truncated")
                    continue
                files += 1
                digest, bad_block = array_digest(pack_path, meta)
                if digest != meta["sha256"]:
                    block = ""
                    if bad_block is not None:
                        begin = meta["data_offset"] + bad_block * meta["block_bytes"]
                        end = min(begin + meta["block_bytes"], meta["offset"] + meta["bytes"])
                        block = f" (block {bad_block}, bytes {begin}..{end}, is the first that differs)"
                    problems.append(f"{where}: SHA-256 {digest[:16]}..., manifest says {meta['sha256'][:16]}..."
                                    f"{block}; the pack was changed or damaged")
    return VerifyReport(root=cache.root, manifests=len(manifests), items=len(checked), files=files,
                        problems=tuple(problems))


__all__ = [
    "CACHE_FORMAT_VERSION",
    "Cache",
    "PackWriter",
    "VerifyReport",
    "array_digest",
    "host_record",
    "npy_header",
    "root_digest",
    "sha256_range",
    "verify_cache",
    "write_npy",
    "write_pack_index",
]
