"""A full disk, said plainly: which folder, what was being written, what it needs, what is free.

Writers turn the operating system's "no space left on device" (and its kin: a quota, a file-size
limit) into a :class:`~tokenloom.errors.StorageError` through :func:`full_disk_error`, after
removing what they had half written, so that a user reads the folder and the sizes instead of
``OSError: [Errno 28]``. Builds check their estimated size against the free space before they
start (:func:`check_space`).
"""

from __future__ import annotations

import errno
import os
import shutil

from tokenloom.errors import StorageError

FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
"""No space left, a quota reached, a file-size limit (``ulimit -f``) reached."""


def is_full(exc: BaseException) -> bool:
    """Whether ``exc`` says the disk (or a quota, or a file-size limit) is full."""
    return isinstance(exc, OSError) and exc.errno in FULL_ERRNOS


def free_bytes(folder: str) -> int | None:
    """Bytes free to this user in the filesystem holding ``folder`` (or its nearest existing parent);
    None where that cannot be known (an object store, a filesystem that does not say)."""
    if "://" in str(folder):
        return None
    path = os.path.abspath(str(folder))
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def format_bytes(count: int | float) -> str:
    """``1.5 GiB``, ``320 KiB``, ``12 bytes``."""
    count = float(count)
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count:,.0f} {unit}" if unit == "bytes" else f"{count:,.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


def full_disk_error(exc: OSError, folder: str, what: str, *, needed: int | None = None,
                    written: int | None = None) -> StorageError:
    """The StorageError for ``exc`` (a full disk while writing ``what`` into ``folder``). The
    writer has already removed its partial files."""
    limit = exc.errno == errno.EFBIG
    cause = "a file-size limit (ulimit -f) was reached" if limit else (
        "the disk quota is used up" if exc.errno == errno.EDQUOT else "no space is left on the device")
    sizes = []
    if needed is not None:
        sizes.append(f"it needs about {format_bytes(needed)}")
    elif written is not None:
        sizes.append(f"it needs more than the {format_bytes(written)} of tokens it had taken")
    free = free_bytes(folder)
    if free is not None and not limit:
        sizes.append(f"{format_bytes(free)} is free there now")
    detail = f" ({'; '.join(sizes)})" if sizes else ""
    return StorageError(f"{folder}: {cause} while writing {what}{detail}. Nothing partial was kept: free some "
                        "space or write elsewhere, and run again")


def check_space(folder: str, needed: int, what: str) -> None:
    """StorageError before writing when the filesystem of ``folder`` has less than ``needed``
    bytes free (where it says how much it has)."""
    free = free_bytes(folder)
    if free is not None and needed > free:
        raise StorageError(f"{folder}: {what} needs about {format_bytes(needed)} but {format_bytes(free)} is free "
                           "there; free some space or write elsewhere (nothing was written yet)")


__all__ = ["FULL_ERRNOS", "check_space", "format_bytes", "free_bytes", "full_disk_error", "is_full"]
