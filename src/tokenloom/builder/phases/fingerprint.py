"""Phases 0 and 1: the warm start, and else the stores' fingerprints.

:func:`warm_start` takes the plan the last build of this config kept, where every rank proves it
current; :func:`fingerprint` is the general path: the ranks fingerprint the stores round-robin,
make those stores' dataset items, and gather both.
"""

from __future__ import annotations

import logging
import os

from tokenloom.builder.collective import agree, failure_from, node_key
from tokenloom.builder.context import BuildContext
from tokenloom.builder.items import dataset_items, ranges_for
from tokenloom.builder.starts import StartRecord, read_start, start_key, stores_unchanged
from tokenloom.builder.stores import FingerprintMemo, StoreInfo, fingerprint_store

log = logging.getLogger(__name__)


def warm_start(ctx: BuildContext) -> StartRecord | None:
    """The warm-start record's plan when every rank proves it current (its share of the stores
    unchanged, every item and the manifest in its cache), else None on every rank
    (:mod:`tokenloom.builder.starts`)."""
    ctx.start_key = start_key(ctx.config)
    if ctx.start_key is None:
        return None
    record, current = None, False
    try:
        record = read_start(ctx.cache.root, ctx.start_key)
        if record is not None:
            prefixes = ctx.config.prefixes
            current = (stores_unchanged(record, prefixes, range(ctx.rank, len(prefixes), ctx.world))
                       and os.path.isfile(ctx.cache.manifest_path(record.build_key))
                       and all(ctx.cache.has(item.key) for item in record.items))
    except Exception as exc:  # the general path reports real problems with their context
        log.warning("warm-start record %s not used (%s: %s)", ctx.start_key, type(exc).__name__, exc)
        current = False
    answers = agree(ctx.group, None, phase="fingerprint",
                    payload=(current, node_key(ctx.config.cache_dir), record.build_key if record else None))
    if not all(ok for ok, _, _ in answers) or len({key for _, _, key in answers}) != 1:
        return None
    ctx.node_keys = [key for _, key, _ in answers]
    return record


def fingerprint(ctx: BuildContext) -> dict[str, StoreInfo]:
    """Every store's info (into ``ctx.infos``, in the config's order) and the dataset items the
    ranks made (``ctx.made``); one rank per cache directory saves the memo's new entries."""
    prefixes = ctx.config.prefixes
    mine: dict[str, StoreInfo] = {}
    failure = None
    memo = None
    if ctx.config.verify_stores == "stat":
        memo = FingerprintMemo(os.path.join(ctx.config.cache_dir, "stores.json"))
    for prefix in prefixes[ctx.rank::ctx.world]:
        try:
            mine[prefix] = fingerprint_store(prefix, ranges_for(ctx.config, prefix), memo)
        except Exception as exc:
            failure = failure_from(exc, rank=ctx.rank, phase="fingerprint",
                                   item=ctx.config.describe_store(prefix))
            break
    made = {}
    if failure is None and ctx.config.packing == "concat":
        # the dataset items of these stores: planning's share that grows with them (a best-fit
        # item needs its chunks' sample counts, known after the pack phase)
        try:
            made = dataset_items(ctx.config, mine)
        except Exception as exc:
            failure = failure_from(exc, rank=ctx.rank, phase="plan", item=None)
    ctx.memo = memo
    fresh = memo.fresh if memo is not None else {}
    gathered = agree(ctx.group, failure, phase="fingerprint",
                     payload=(mine, node_key(ctx.config.cache_dir), fresh, made))
    infos: dict[str, StoreInfo] = {}
    ctx.made = {}
    for part, _, _, part_made in gathered:
        infos.update(part)
        ctx.made.update(part_made)
    ctx.node_keys = [key for _, key, _, _ in gathered]
    ctx.infos = {p: infos[p] for p in prefixes}
    # one rank per cache directory saves what every rank hashed afresh
    writer = 0 if ctx.config.shared_fs else ctx.node_keys.index(ctx.node_keys[ctx.rank])
    if memo is not None and ctx.rank == writer and not ctx.dry_run:  # a dry run writes nothing
        all_fresh: dict[str, dict] = {}
        for _, _, part, _ in gathered:
            all_fresh.update(part)
        try:
            os.makedirs(ctx.config.cache_dir, exist_ok=True)
        except OSError:
            pass
        memo.merge_and_save(all_fresh)
    return ctx.infos


__all__ = ["fingerprint", "warm_start"]
