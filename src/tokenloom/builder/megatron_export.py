"""Write exact-mode items under megatron-core's names, so its builder finds them as cache hits.

For each item, each array's .npy image is copied out of its tokenloom pack to
``{md5}-{class}-{split}-{affix}`` in the megatron cache directory (temp file, rename), and the
description text megatron-core hashes is written beside them last. megatron-core checks that all four (GPT) or
three (blend) files exist and then memory-maps the arrays; the bytes are those ``numpy.save``
writes, so its loads return our arrays. Names follow :mod:`tokenloom.builder.megatron_names`.
"""

from __future__ import annotations

import os
import tempfile

from tokenloom.builder.cache import Cache
from tokenloom.builder.items import WorkItem
from tokenloom.io.space import full_disk_error, is_full


def _write_bytes(target: str, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".tokenloom.", suffix=".tmp", dir=os.path.dirname(target))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _write_text(target: str, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".tokenloom.", suffix=".tmp", dir=os.path.dirname(target))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def export_megatron_item(cache: Cache, item: WorkItem, directory: str) -> list[str]:
    """Place item's arrays and description in ``directory`` under megatron-core's names. A full
    disk is a StorageError naming the folder; the files already placed are whole (temp file,
    rename) and megatron-core takes an item only once its description, written last, is there."""
    try:
        return _export(cache, item, directory)
    except OSError as exc:
        if is_full(exc):
            raise full_disk_error(exc, directory, f"megatron-core's files of {item.label}",
                                  needed=item.output_bytes) from None
        raise


def _export(cache: Cache, item: WorkItem, directory: str) -> list[str]:
    if item.megatron is None:
        return []
    os.makedirs(directory, exist_ok=True)
    written = []
    for array, file_name in item.megatron.array_files().items():
        target = os.path.join(directory, file_name)
        if not os.path.exists(target):
            _write_bytes(target, cache.npy_image(item.key, array))
        written.append(target)
    description = os.path.join(directory, item.megatron.file_name("description.txt"))
    if not os.path.exists(description):
        _write_text(description, item.megatron.description)
    written.append(description)
    return written


__all__ = ["export_megatron_item"]
