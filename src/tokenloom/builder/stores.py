"""Fingerprints of the input token stores: what a cache key knows about each store.

A fingerprint holds the sizes and modification times of ``PREFIX.idx`` and ``PREFIX.bin`` and a
SHA-256 over the .idx header (counts and dtype) and the sequence lengths, which are all a packed
index reads (GPT splits cut sequences; pointers and document boundaries do not change any array).
Any change that could change an index changes the hash; a touch that changes only the mtime changes
the fingerprint too, so the cache errs towards rebuilding.

A store with a loss-mask sidecar (``PREFIX.mask``, FORMAT.md "The loss-mask sidecar") adds its
size, modification time and the SHA-256 of its bits as its ``PREFIX.meta.json`` records it: the
packed index does not read the mask, but the samples served from it do, so a changed mask is a
changed store. The bits are not hashed again here (they are 1/8 byte per token, far more than
the sequence lengths); a mask rewritten by the writer has a new recorded SHA-256, one edited in
place a new size or mtime. A store without one keeps the fingerprint (and cache keys) it had.
Opening the mask checks its size and header against the store: a sidecar that does not match is
a FormatError naming the file.

Fingerprinting also measures what the planner needs: sequences and tokens in each split range.

**Known stores are not hashed again** (:class:`FingerprintMemo`, ``verify_stores="stat"``). The
memo (``CACHE/stores.json``) keeps each store's fingerprint with the ``stat`` of both files taken
*before* they were read: size, mtime and ctime in nanoseconds, inode and device. A later build
takes the recorded fingerprint when all ten values are equal, and hashes the store again otherwise.
This is safe because any write to a file moves its ctime to the current time, and no call can set
ctime back (``touch -d``, ``cp -p`` and ``rsync -t`` restore mtime, not ctime; a replaced file
has a new inode). One race remains: a write in the same clock tick as the recorded stat leaves
every time unchanged. So an entry whose files changed less than :data:`RACY_NS` before it was
recorded is never trusted (as git treats racily clean entries): the store is hashed again until
its files are older than that (clocks of the hosts that write the stores and that build must agree
within that margin). Filesystems that do not keep ctime (some object-store mounts)
should use ``verify_stores="hash"``, which hashes every store on every build as before.

A store on object storage (``s3://``) is recorded by each object's size, Last-Modified and ETag
from a HEAD request. Every upload gives an object a new Last-Modified and ETag (the MD5 of the content
for a plain upload), and nothing can set them back, so equal values mean the same objects; there is
no racy window to wait out.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass

import numpy as np

from tokenloom.errors import TokenloomError
from tokenloom.io import IndexedDataset, s3
from tokenloom.io.format import bin_path, idx_path, normalize_prefix
from tokenloom.io.loss_mask import RECORD_KEY, mask_path

log = logging.getLogger(__name__)

_HASH_CHUNK = 1 << 24  # bytes hashed per update

RACY_NS = 2_000_000_000
"""An entry is trusted only if both files were last changed at least this long (2 s, above the
coarsest timestamp granularity of common filesystems) before their stat was recorded."""

MEMO_FORMAT = "tokenloom-store-fingerprints"
MEMO_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class StoreFingerprint:
    """Identity of one token store as the cache sees it."""

    idx_bytes: int
    """Size of ``PREFIX.idx``."""
    bin_bytes: int
    """Size of ``PREFIX.bin``."""
    idx_mtime_ns: int
    """Modification time of ``PREFIX.idx``, nanoseconds."""
    bin_mtime_ns: int
    """Modification time of ``PREFIX.bin``, nanoseconds."""
    idx_sha256: str
    """SHA-256 of the .idx header and the sequence lengths."""
    mask_bytes: int | None = None
    """Size of ``PREFIX.mask``; None: the store has no loss mask."""
    mask_mtime_ns: int | None = None
    """Modification time of ``PREFIX.mask``, nanoseconds (an object's Last-Modified)."""
    mask_sha256: str | None = None
    """SHA-256 of the mask's bits, as ``PREFIX.meta.json`` records it."""

    def to_dict(self) -> dict:
        out = {
            "idx_bytes": self.idx_bytes, "bin_bytes": self.bin_bytes,
            "idx_mtime_ns": self.idx_mtime_ns, "bin_mtime_ns": self.bin_mtime_ns,
            "idx_sha256": self.idx_sha256,
        }
        if self.mask_sha256 is not None:  # only then: an unmasked store keeps its old keys
            out.update(mask_bytes=self.mask_bytes, mask_mtime_ns=self.mask_mtime_ns, mask_sha256=self.mask_sha256)
        return out


@dataclass(frozen=True, kw_only=True)
class StoreInfo:
    """A fingerprinted store and the counts the planner needs."""

    prefix: str
    """The prefix as the config names it."""
    fingerprint: StoreFingerprint
    """Sizes, times and hash of the store's files."""
    num_sequences: int
    """Sequences in the store (GPT splits cut sequences, as megatron-core does)."""
    num_tokens: int
    """Tokens in the store."""
    range_tokens: tuple[tuple[int, int, int], ...]
    """``(begin, end, tokens)`` for every sequence range the build asked about."""

    def tokens_in(self, begin: int, end: int) -> int:
        """Tokens in sequences ``[begin, end)`` (a range passed to :func:`fingerprint_store`)."""
        for b, e, tokens in self.range_tokens:
            if (b, e) == (begin, end):
                return tokens
        raise KeyError((begin, end))


def _hash_array(digest, array: np.ndarray) -> None:
    flat = array.reshape(-1).view(np.uint8)
    for begin in range(0, flat.shape[0], _HASH_CHUNK):
        digest.update(flat[begin:begin + _HASH_CHUNK])


def _stat_record(path: str) -> list:
    if s3.is_remote(path):
        return _object_record(s3.head(path))
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def _object_record(info) -> list:
    """What the memo keeps of an object: size, Last-Modified and ETag (module docstring)."""
    return [info.size, info.last_modified_ns, info.etag]


def fingerprint_store(prefix: str, ranges_for, memo: FingerprintMemo | None = None) -> StoreInfo:
    """Open ``prefix``, hash it and count tokens in the ranges ``ranges_for(num_sequences)`` lists.

    ``ranges_for`` maps the store's sequence count to the ``(begin, end)`` sequence ranges the
    build uses (the split ranges depend on the count). With a ``memo``, a store whose files are
    unchanged since the memo recorded it (see the module's docstring) is not opened at all.
    """
    if memo is not None:
        known = memo.lookup(prefix, ranges_for)
        if known is not None:
            return known
    store = IndexedDataset(prefix)
    if store.is_remote:  # the HEADs the store was opened with (its .idx copy was checked against them)
        stats = [_object_record(store.idx_info), _object_record(store.bin_info)]
        if store.has_loss_mask:
            stats.append(_object_record(store.mask_info))
    else:
        stats = [_stat_record(store.idx_path), _stat_record(store.bin_path)]  # before reading: see RACY_NS
        if os.path.isfile(mask_path(store.prefix)):
            stats.append(_stat_record(mask_path(store.prefix)))
    seen_ns = time.time_ns()
    digest = hashlib.sha256()
    digest.update(store.header.pack())
    _hash_array(digest, store.sequence_lengths)
    mask = {}
    if store.has_loss_mask:  # opening it checked its size and header (FormatError naming the file)
        mask = {"mask_bytes": stats[2][0], "mask_mtime_ns": stats[2][1],
                "mask_sha256": store.metadata[RECORD_KEY]["sha256"]}
    fingerprint = StoreFingerprint(
        idx_bytes=stats[0][0], bin_bytes=stats[1][0],
        idx_mtime_ns=stats[0][1], bin_mtime_ns=stats[1][1],
        idx_sha256=digest.hexdigest(), **mask,
    )
    lengths = store.sequence_lengths
    ranges = []
    for begin, end in ranges_for(store.num_sequences):
        ranges.append((begin, end, int(np.sum(lengths[begin:end], dtype=np.int64))))
    num_tokens = int(np.sum(lengths, dtype=np.int64))
    store.close()
    info = StoreInfo(prefix=prefix, fingerprint=fingerprint, num_sequences=store.num_sequences,
                     num_tokens=num_tokens, range_tokens=tuple(ranges))
    if memo is not None:
        memo.record(info, stats, seen_ns)
    return info


class FingerprintMemo:
    """Fingerprints of stores already hashed, kept in ``CACHE/stores.json`` between builds.

    ``lookup`` answers from the memo when a store's files are unchanged (module docstring);
    ``record`` notes a fresh fingerprint; ``merge_and_save`` writes the memo atomically with
    what every rank recorded. An unreadable or foreign memo is ignored (every store is hashed,
    as without one), never an error: it only saves time.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.entries: dict[str, dict] = {}
        self.fresh: dict[str, dict] = {}
        """Entries recorded by this process (to be gathered and saved)."""
        self.hits = 0
        try:
            with open(path, encoding="utf-8") as f:
                memo = json.load(f)
            if memo.get("format") == MEMO_FORMAT and memo.get("version") == MEMO_VERSION:
                self.entries = dict(memo["stores"])
            else:
                log.warning("%s: not a version-%d store fingerprint memo; hashing every store", path, MEMO_VERSION)
        except FileNotFoundError:
            pass
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("%s: unreadable store fingerprint memo (%s); hashing every store", path, exc)

    @staticmethod
    def key_of(prefix: str) -> str:
        """The memo's key of ``prefix``: its URL, or its absolute path."""
        prefix = normalize_prefix(prefix)
        return prefix if s3.is_remote(prefix) else os.path.abspath(prefix)

    def lookup(self, prefix: str, ranges_for) -> StoreInfo | None:
        """The recorded StoreInfo of ``prefix`` when its files are provably unchanged, else None."""
        try:
            return self._lookup(prefix, ranges_for)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:  # a damaged entry: hash again
            log.warning("%s: unusable memo entry for %s (%r); hashing it", self.path, prefix, exc)
            return None

    def _lookup(self, prefix: str, ranges_for) -> StoreInfo | None:
        entry = self.entries.get(self.key_of(prefix))
        if entry is None:
            return None
        prefix_path = normalize_prefix(prefix)
        try:
            stats = [_stat_record(idx_path(prefix_path)), _stat_record(bin_path(prefix_path))]
            # the mask's stat where fingerprinting took one: a local file present, or a remote
            # store recorded with a mask (no HEAD for the mask every unmasked remote store lacks)
            if len(entry["stats"]) > 2 or (not s3.is_remote(prefix_path) and os.path.isfile(mask_path(prefix_path))):
                stats.append(_stat_record(mask_path(prefix_path)))
        except (OSError, TokenloomError):
            return None  # fingerprinting proper reports the missing file
        if stats != entry["stats"]:
            return None
        if not s3.is_remote(prefix_path) and any(entry["seen_ns"] - max(stat[1], stat[2]) < RACY_NS for stat in stats):
            return None  # changed too close to when it was recorded: not provably unchanged
        wanted = ranges_for(entry["num_sequences"])
        known = {(b, e): t for b, e, t in entry["ranges"]}
        if any((b, e) not in known for b, e in wanted):
            return None  # other split ranges than recorded: count them afresh
        self.hits += 1
        return StoreInfo(prefix=prefix, fingerprint=StoreFingerprint(**entry["fingerprint"]),
                         num_sequences=entry["num_sequences"], num_tokens=entry["num_tokens"],
                         range_tokens=tuple((b, e, known[(b, e)]) for b, e in wanted))

    def record(self, info: StoreInfo, stats: list[list[int]], seen_ns: int) -> None:
        key = self.key_of(info.prefix)
        old = self.entries.get(key)
        ranges = {}
        if isinstance(old, dict) and old.get("stats") == stats:  # same files: keep the ranges counted before
            try:
                ranges = {(b, e): t for b, e, t in old.get("ranges", ())}
            except (TypeError, ValueError):
                ranges = {}
        ranges.update({(b, e): t for b, e, t in info.range_tokens})
        self.fresh[key] = {"stats": stats, "seen_ns": seen_ns, "fingerprint": info.fingerprint.to_dict(),
                           "num_sequences": info.num_sequences, "num_tokens": info.num_tokens,
                           "ranges": sorted([b, e, t] for (b, e), t in ranges.items())}

    def merge_and_save(self, fresh: dict[str, dict]) -> None:
        """Write the memo with ``fresh`` entries (every rank's) over the loaded ones; atomic."""
        if not fresh:
            return
        entries = dict(self.entries)
        entries.update(fresh)
        tmp = f"{self.path}.tmp-{os.getpid()}"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(json.dumps({"format": MEMO_FORMAT, "version": MEMO_VERSION, "stores": entries},
                                   separators=(",", ":")))  # dumps, not dump: the C encoder
            os.replace(tmp, self.path)
        except OSError as exc:  # a read-only cache still builds; the next build hashes again
            log.warning("%s: cannot save the store fingerprint memo (%s)", self.path, exc)
            try:
                os.unlink(tmp)
            except OSError:
                pass
        self.entries = entries


__all__ = ["RACY_NS", "FingerprintMemo", "StoreFingerprint", "StoreInfo", "fingerprint_store"]
