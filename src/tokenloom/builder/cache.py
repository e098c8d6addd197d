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

Where each concern lives: this module holds :class:`Cache` (the directory, the listing of the packs
and the records they index, opening arrays, manifests); :mod:`tokenloom.builder.packs` the pack
format (.npy headers, hashed writes, array digests, writing a pack and its index, reading them back,
:class:`PackWriter`); :mod:`tokenloom.builder.cache_locks` the item locks (``locks/items.lock``);
:mod:`tokenloom.builder.cache_verify` :func:`verify_cache`. Their imports run one way (verify ->
this module -> packs, locks), so each name is imported from the module that defines it.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from tokenloom.builder.cache_locks import LOCKS_DIR, ItemLocks
from tokenloom.builder.packs import (
    KEYS_SUFFIX,
    PACKS_DIR,
    TMP_DIR,
    PendingItem,
    not_indexed_error,
    read_pack_index,
    read_pack_keys,
    write_pack,
)
from tokenloom.errors import BuildError, FormatError
from tokenloom.io.writer import write_json_arrays_atomic

BUILDS_DIR = "builds"

#: How old the last listing of the packs may be when a build asks, after taking an item's lock
#: uncontended, whether another job published the item (:meth:`Cache.built_elsewhere`).
RELIST_S = 0.1


def host_record() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}


# ------------------------------------------------------------------------------------ the cache


class Cache:
    """A cache directory (created on first write)."""

    expected_bytes: int | None = None
    """What the build in progress writes here in all, when known: named if the disk fills."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(str(root))
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
        self._locks = ItemLocks(self.root, self.ensure)  # the item locks (cache_locks.py)

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
                    for key in read_pack_keys(os.path.join(directory, keys_name)):
                        self._unparsed.setdefault(key, []).append(name)
                else:  # written before key lists existed
                    self._parse_pack(name)
                self._seen_packs.add(name)
            self._listed_at = max(self._listed_at, listed_at)

    def _parse_pack(self, name: str) -> None:
        """Read the records of pack index ``name`` (the caller holds the index lock)."""
        self._add_records(name, read_pack_index(os.path.join(self.root, PACKS_DIR, name)))

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
                    raise not_indexed_error(os.path.join(self.root, PACKS_DIR, name), key)

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
            records = parsed[name] if name in parsed else read_pack_index(os.path.join(self.root, PACKS_DIR, name))
            for key in wanted:
                if key not in records:
                    raise not_indexed_error(os.path.join(self.root, PACKS_DIR, name), key)
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
    def publish_pack(self, items: list[PendingItem]) -> str:
        """Write ``items`` as one pack (data, fsync, rename; then the index the same way:
        :func:`~tokenloom.builder.packs.write_pack`) and learn its records."""
        self.ensure()
        name, records = write_pack(self.root, items, needed=self.expected_bytes)
        with self._index_lock:
            self._add_records(f"{name}.json", records)
            self._seen_packs.add(f"{name}.json")
        for item in items:
            if item.on_published is not None:
                item.on_published(records[item.key])
        return os.path.join(self.root, PACKS_DIR, f"{name}.bin")

    # -- locks ----------------------------------------------------------------------------------
    def acquire(self, key: str) -> int:
        """Take item ``key``'s lock (blocking while another builder holds it); returns the token
        to pass to :meth:`release`. How: :meth:`tokenloom.builder.cache_locks.ItemLocks.acquire`."""
        return self._locks.acquire(key)

    def built_elsewhere(self, key: str, token: int) -> bool:
        """Whether another job published item ``key``; ask right after :meth:`acquire` gave
        ``token``. The packs are listed again if that lock was held by another job (which has
        most likely just published the item) or the last listing is older than ``RELIST_S``;
        otherwise the packs already known answer. A build asks this for each item it makes, and
        listing the packs each time would cost every item a read of the whole directory, so the
        build's listings would grow with its items times its packs. A job that trails another by
        less than ``RELIST_S`` may build an item the other has just published: both copies hold
        identical bytes, and readers take the first pack's (see :meth:`_add_records`)."""
        stale = token in self._locks.contended or time.monotonic() - self._listed_at > RELIST_S
        return self.has(key, refresh=stale)

    def release(self, token: int) -> None:
        self._locks.release(token)

    def close_locks(self) -> None:
        """Release every lock this process holds on the cache."""
        self._locks.close()

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


__all__ = ["Cache", "host_record"]
