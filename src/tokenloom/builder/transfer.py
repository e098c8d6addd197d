"""Items as byte blobs, for builds without a shared filesystem.

A blob is ``u64le(header length) | header JSON | .npy images...``; the header carries the item's
record and each array's name, size and SHA-256. The receiver checks every hash, then queues the
arrays into its own pack, published atomically like a local build's.
"""

from __future__ import annotations

import hashlib
import io
import json

import numpy as np

from tokenloom.builder.cache import Cache
from tokenloom.builder.packs import PackWriter
from tokenloom.errors import BuildError


def pack_item(cache: Cache, key: str) -> bytes:
    """Every array of item ``key`` (complete .npy images) and its record, as one blob."""
    record = cache.read_record(key)
    names = sorted(record["files"])
    images = [cache.npy_image(key, name[: -len(".npy")]) for name in names]
    header = {"record": record, "arrays": [
        {"name": name, "bytes": len(image), "sha256": hashlib.sha256(image).hexdigest()}
        for name, image in zip(names, images)]}
    head = json.dumps(header).encode("utf-8")
    return len(head).to_bytes(8, "little") + head + b"".join(images)


def unpack_item(packs: PackWriter, cache: Cache, key: str, blob: bytes) -> None:
    """Check a blob made by :func:`pack_item` and queue item ``key`` into ``packs``."""
    if cache.has(key):
        return
    head_size = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + head_size].decode("utf-8"))
    offset = 8 + head_size
    arrays = {}
    for entry in header["arrays"]:
        image = blob[offset:offset + entry["bytes"]]
        offset += entry["bytes"]
        if hashlib.sha256(image).hexdigest() != entry["sha256"]:
            raise BuildError(f"item {key}: {entry['name']} arrived damaged (SHA-256 mismatch)")
        arrays[entry["name"][: -len(".npy")]] = np.load(io.BytesIO(image), allow_pickle=False)
    record = {k: v for k, v in header["record"].items() if k not in ("files", "pack", "key", "format")}
    packs.add(key, arrays, record)


__all__ = ["pack_item", "unpack_item"]
