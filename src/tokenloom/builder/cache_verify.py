"""Verifying a cache: every array of every item each manifest lists, hashed and checked against
its pack's index and the manifest (``tokenloom cache verify``). The layout it checks is described
in :mod:`tokenloom.builder.cache`.

The stores a manifest built from with a loss mask (``PREFIX.mask``) are checked too, where they are
local files: the arrays do not depend on the mask, but what a build serves does, so a mask that
changed since the build, or whose bits no longer match their SHA-256, or whose size does not match
its store, is a problem naming the file.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from tokenloom.builder.cache import BUILDS_DIR, Cache
from tokenloom.builder.packs import PACKS_DIR, array_digest
from tokenloom.errors import FormatError
from tokenloom.io import IndexedDataset, s3
from tokenloom.io.format import idx_path
from tokenloom.io.loss_mask import RECORD_KEY, bits_digest, mask_path


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
    masks_checked: set[str] = set()
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
        problems += _mask_problems(manifest, path, masks_checked)
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


def _mask_problems(manifest: dict, path: str, checked: set[str]) -> list[str]:
    """The problems of the local stores ``manifest`` built from with a loss mask (module docstring);
    each store once over all manifests."""
    problems = []
    for prefix, entry in (manifest.get("stores") or {}).items():
        recorded = ((entry or {}).get("fingerprint") or {}).get("mask_sha256")
        if recorded is None or prefix in checked or s3.is_remote(prefix) or not os.path.isfile(idx_path(prefix)):
            continue
        checked.add(prefix)
        try:
            store = IndexedDataset(prefix)
            if not store.has_loss_mask:
                problems.append(f"{prefix}: built with a loss mask (manifest {path}) but the store has none now; "
                                "rebuild, or restore PREFIX.mask and its record")
                continue
            record = store.metadata[RECORD_KEY]
            if record["sha256"] != recorded:
                problems.append(f"{mask_path(prefix)}: the loss mask changed since the build of manifest {path} "
                                f"(SHA-256 {record['sha256'][:16]}..., built with {recorded[:16]}...); rebuild to "
                                "serve the new mask")
                continue
            digest = bits_digest(store.loss_mask_bits, record["num_tokens"])
            if digest != recorded:
                problems.append(f"{mask_path(prefix)}: its bits have SHA-256 {digest[:16]}... but the build of "
                                f"manifest {path} and the store's record say {recorded[:16]}...; the mask was changed "
                                "or damaged")
        except FormatError as exc:
            problems.append(f"{exc} (a store of manifest {path})")
    return problems


__all__ = ["VerifyReport", "verify_cache"]
