"""Warm-start records: a finished build's plan, reused when the next start can prove it unchanged.

Every start of a training job calls ``tokenloom.build`` with the same config, and usually nothing
has changed since the last one. The general path still fingerprints every store (the memo makes
that a ``stat`` per file, :mod:`tokenloom.builder.stores`), makes every store's dataset items,
gathers them on every rank and plans the blends: work on every rank that grows with the stores
(BENCHMARKS.md, "Warm start at 10,000 stores"), all of it repeating the work of the previous start.

So after a build, the writer rank of each cache directory keeps its plan in a **warm-start
record**, ``CACHE/starts/<start key>.pickle``. The start key hashes the whole config (every field,
not only the array fields: a changed field never reuses a record), tokenloom's version, the cache
format and the source of the modules that plan (:func:`plan_code_digest`). Beside the plan (its
items and splits) the record holds, for every store of the config, the ``stat`` of both files
that the store's fingerprint memo entry holds (size, mtime, ctime, inode, device) and when it was
taken, and the build key.

A later start with the same key takes the record when every rank finds, for its share of the
stores, all ten values unchanged and both files older than the entry by ``stores.RACY_NS``, and
finds every item of the plan in its cache and the build's manifest beside it. Then the plan is
the one the general path would compute: the plan depends only on the config (the key), the
code (the key), and each store's fingerprint and token counts, which the memo's argument proves
unchanged (a write to a file always moves its ctime; a replaced file has another inode; the
racy margin covers a write in the same clock tick). The ranks exchange one flag and their node
instead of every store's items. If any rank cannot prove it, all ranks take the general path,
which then writes a new record. Records are only written for ``verify_stores: stat`` builds of
local stores (an ``s3://`` store's memo check already costs a HEAD per object and is kept).

The record is a pickle, read back by an unpickler that builds only the plan's own classes
(:data:`_ALLOWED`) and refuses anything else, so a record cannot run code. A damaged, truncated
or foreign record is ignored with a warning: it only saves time, and the general path is always
there.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import io
import logging
import os
import pickle
from dataclasses import dataclass

import numpy as np

from tokenloom._version import __version__
from tokenloom.builder import stores as _stores
from tokenloom.builder.collective import collector_paused
from tokenloom.builder.config import BuildConfig
from tokenloom.builder.items import SplitPlan, WorkItem
from tokenloom.builder.packs import CACHE_FORMAT_VERSION
from tokenloom.builder.stores import FingerprintMemo, StoreInfo
from tokenloom.io import s3
from tokenloom.io.format import bin_path, idx_path, normalize_prefix
from tokenloom.source.keys import hash_key

log = logging.getLogger(__name__)

STARTS_DIR = "starts"
START_FORMAT = "tokenloom-warm-start"
START_VERSION = 1

_ALLOWED = {
    ("tokenloom.builder.items", "WorkItem"),
    ("tokenloom.builder.items", "SplitPlan"),
    ("tokenloom.index.epochs", "EpochPlan"),
    ("tokenloom.builder.megatron_names", "MegatronName"),
    ("collections", "OrderedDict"),
}
"""The only classes a record may construct: the plan's own dataclasses, and the ordered dict of
megatron-core's identifiers."""


class _PlanUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"a warm-start record may not build {module}.{name}")
        return super().find_class(module, name)


@dataclass(frozen=True)
class StartRecord:
    """A plan kept for the next start, with what proves its stores unchanged."""

    build_key: str
    """The build's key (its manifest is ``builds/<build_key>.json``)."""
    prefixes: tuple[str, ...]
    """The config's stores, in config order."""
    stats: np.ndarray
    """``(stores, 2, 5)`` int64: ``[size, mtime_ns, ctime_ns, inode, device]`` of each store's
    .idx and .bin, as its fingerprint memo entry recorded them."""
    seen_ns: np.ndarray
    """``(stores,)`` int64: when each store's stats were recorded."""
    items: tuple[WorkItem, ...]
    """The plan's items, in plan order."""
    splits: tuple[SplitPlan, ...]
    """The plan's splits."""


_PLAN_MODULES = (
    "tokenloom.builder.config", "tokenloom.builder.items", "tokenloom.builder.megatron_names",
    "tokenloom.builder.stores", "tokenloom.builder.starts", "tokenloom.index.blend", "tokenloom.index.blend_spec",
    "tokenloom.index.epochs", "tokenloom.index.split", "tokenloom.source.keys",
)
"""The modules whose code makes a plan from a config and fingerprints."""


@functools.lru_cache(maxsize=1)
def plan_code_digest() -> str:
    """SHA-256 of the source of :data:`_PLAN_MODULES`: a record made by other planning code (an
    edited checkout whose version did not change) is never taken. Empty where a source cannot be
    read (the version alone then keys the code)."""
    digest = hashlib.sha256()
    for name in _PLAN_MODULES:
        path = getattr(importlib.import_module(name), "__file__", None)
        try:
            with open(path, "rb") as f:
                digest.update(f.read())
        except (OSError, TypeError):
            return ""
    return digest.hexdigest()


def start_key(config: BuildConfig) -> str | None:
    """The key of ``config``'s warm-start record, or None where no record is kept (stores hashed
    on every build, or on object storage)."""
    if config.verify_stores != "stat" or any(s3.is_remote(p) for p in config.prefixes):
        return None
    return hash_key({"format": START_FORMAT, "version": START_VERSION, "cache_format": CACHE_FORMAT_VERSION,
                     "tokenloom": __version__, "code": plan_code_digest(), "config": config.to_dict()})


def record_path(cache_root: str, key: str) -> str:
    return os.path.join(cache_root, STARTS_DIR, f"{key}.pickle")


def write_start(cache_root: str, key: str, *, build_key: str, prefixes, infos: dict[str, StoreInfo],
                memo: FingerprintMemo, items, splits) -> bool:
    """Keep the plan of a finished build under ``key``; False (and nothing written) when a store's
    memo entry is missing or is not the fingerprint this build used. Atomic; a failure to write
    is a warning, never a build error."""
    stats = np.empty((len(prefixes), 2, 5), dtype=np.int64)
    seen = np.empty(len(prefixes), dtype=np.int64)
    for i, prefix in enumerate(prefixes):
        entry = memo.entries.get(memo.key_of(prefix))
        try:
            if entry is None or entry["fingerprint"] != infos[prefix].fingerprint.to_dict():
                return False
            stats[i] = entry["stats"]
            seen[i] = entry["seen_ns"]
        except (KeyError, TypeError, ValueError):
            return False
    payload = {"format": START_FORMAT, "version": START_VERSION, "key": key, "build_key": build_key,
               "prefixes": tuple(prefixes), "stats": stats.tobytes(), "seen_ns": seen.tobytes(),
               "items": tuple(items), "splits": tuple(splits)}
    path = record_path(cache_root, key)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "wb") as f:
            pickle.dump(payload, f, protocol=5)
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("%s: cannot keep the warm-start record (%s); the next start plans again", path, exc)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return False
    return True


def read_start(cache_root: str, key: str) -> StartRecord | None:
    """The record kept under ``key``, or None (none kept, or unusable: a warning says why)."""
    path = record_path(cache_root, key)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("%s: unreadable warm-start record (%s); planning again", path, exc)
        return None
    try:
        with collector_paused():  # thousands of items: no full collections while they are made
            payload = _PlanUnpickler(io.BytesIO(data)).load()
        if not isinstance(payload, dict) or payload.get("format") != START_FORMAT \
                or payload.get("version") != START_VERSION or payload.get("key") != key:
            raise ValueError("not a version-1 warm-start record of this config")
        prefixes = tuple(payload["prefixes"])
        stats = np.frombuffer(payload["stats"], dtype=np.int64).reshape(len(prefixes), 2, 5)
        seen = np.frombuffer(payload["seen_ns"], dtype=np.int64).reshape(len(prefixes))
        items, splits = tuple(payload["items"]), tuple(payload["splits"])
        if not all(isinstance(i, WorkItem) for i in items) or not all(isinstance(s, SplitPlan) for s in splits):
            raise ValueError("its plan holds other objects than items and splits")
        return StartRecord(build_key=str(payload["build_key"]), prefixes=prefixes, stats=stats, seen_ns=seen,
                           items=items, splits=splits)
    except Exception as exc:  # a damaged record only costs the time it would have saved
        log.warning("%s: unusable warm-start record (%s: %s); planning again", path, type(exc).__name__, exc)
        return None


def stores_unchanged(record: StartRecord, prefixes, indices) -> bool:
    """Whether the stores ``prefixes[i]`` for ``i`` in ``indices`` are provably the files the
    record's plan was made from: both files' five stat values equal, and both changed at least
    ``stores.RACY_NS`` before the values were recorded (the memo's rule)."""
    if tuple(prefixes) != record.prefixes:
        return False
    indices = list(indices)
    if not indices:
        return True
    now = np.empty((len(indices), 2, 5), dtype=np.int64)
    for row, i in enumerate(indices):
        prefix = normalize_prefix(prefixes[i])
        try:
            for column, path in enumerate((idx_path(prefix), bin_path(prefix))):
                st = os.stat(path)
                now[row, column] = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)
        except OSError:
            return False  # the general path names the missing file
    recorded = record.stats[indices]
    if not np.array_equal(now, recorded):
        return False
    changed = np.maximum(recorded[:, :, 1], recorded[:, :, 2]).max(axis=1)  # (stores,) last change of either file
    return bool(np.all(record.seen_ns[indices] - changed >= _stores.RACY_NS))


__all__ = ["STARTS_DIR", "StartRecord", "read_start", "record_path", "start_key", "stores_unchanged", "write_start"]
