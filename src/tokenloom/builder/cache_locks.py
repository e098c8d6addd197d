"""The item locks of a cache: two builders of one item (two jobs sharing a cache) lock it first.

``CACHE/locks/items.lock`` holds advisory locks of builders, one byte per item key (the layout of
the whole cache directory is described in :mod:`tokenloom.builder.cache`). A ``Cache`` holds one
:class:`ItemLocks` and passes its ``acquire``, ``release`` and ``close_locks`` on to it; whether
another job published the item meanwhile (``Cache.built_elsewhere``) is a question of the cache's
listing of the packs, and is answered there.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
from collections.abc import Callable

LOCKS_DIR = "locks"
LOCK_FILE = "items.lock"

log = logging.getLogger(__name__)


class ItemLocks:
    """The locks this process takes on the items of the cache at ``root``; ``ensure`` creates the
    cache's directories (called before the lock file is first opened)."""

    def __init__(self, root: str, ensure: Callable[[], None]) -> None:
        self.root = root
        self._ensure = ensure
        self._lock_fd: int | None = None
        self.contended: set[int] = set()  # lock tokens this process waited for (or could not take)

    def acquire(self, key: str) -> int:
        """Take item ``key``'s lock (blocking while another builder holds it); returns the token
        to pass to :meth:`release`.

        One lock file serves every item: each key locks one byte of it (POSIX record locks), so
        locking costs no file creation. Record locks are per process; within a process each item
        is built once, so only other processes (other jobs) ever wait.
        """
        if self._lock_fd is None:
            self._ensure()
            self._lock_fd = os.open(os.path.join(self.root, LOCKS_DIR, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
        offset = int(key[:15], 16)  # 60 bits of the key: one byte of a sparse, never written file
        try:
            fcntl.lockf(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, offset)
            self.contended.discard(offset)
            return offset
        except OSError as exc:
            if exc.errno not in (errno.EACCES, errno.EAGAIN):  # not "held by another process"
                self.contended.add(offset)
                log.debug("%s: building item %s without its lock (%s)", self.root, key, exc)
                return offset
        self.contended.add(offset)  # another job holds it: most likely building the item now
        try:
            fcntl.lockf(self._lock_fd, fcntl.LOCK_EX, 1, offset)
        except OSError:
            # No locking on this filesystem, or EDEADLK: record locks belong to processes, so two
            # jobs whose threads wait on each other's held items form a cycle the kernel refuses.
            # Building without the lock is safe: both jobs write identical bytes, and the index
            # keeps the first pack published.
            log.debug("%s: building item %s without its lock", self.root, key)
        return offset

    def release(self, token: int) -> None:
        self.contended.discard(token)
        try:
            fcntl.lockf(self._lock_fd, fcntl.LOCK_UN, 1, token)
        except OSError:
            pass

    def close(self) -> None:
        """Release every lock this process holds on the cache."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


__all__ = ["LOCKS_DIR", "LOCK_FILE", "ItemLocks"]
