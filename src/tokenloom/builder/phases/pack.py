"""Phase 1b, pack (``packing: best_fit`` only): the best-fit chunks no writer's cache holds.

The chunks are packed and published, divided over the ranks by longest processing time first;
the ranks gather every chunk's sample count, which the plan needs (:mod:`tokenloom.builder.best_fit`).
"""

from __future__ import annotations

from tokenloom.builder.best_fit import pack_stats
from tokenloom.builder.collective import agree
from tokenloom.builder.context import BuildContext
from tokenloom.builder.items import WorkItem, all_pack_items, assign_lpt
from tokenloom.builder.packs import PackWriter
from tokenloom.builder.phases.build_items import ProgressPoller, build_and_queue, build_one


def pack(ctx: BuildContext) -> None:
    """Build the best-fit chunks no writer's cache holds, divided over the ranks, and gather
    every chunk's counts into ``ctx.pack_stats`` (a dry run packs and writes nothing). Every
    rank learns them here: without a shared filesystem a chunk reaches the other nodes only
    after the build, and the split's ``gpt`` item, built before that, needs its counts."""
    failure = None
    items: list[WorkItem] = []
    known: dict[str, dict[str, int]] = {}
    _, writers = ctx.nodes()
    try:
        items = all_pack_items(ctx.config, ctx.infos)
        if ctx.rank in writers:
            ctx.cache.refresh()
            for item in items:
                if ctx.cache.has(item.key, refresh=False):
                    known[item.key] = pack_stats(ctx.cache.read_record(item.key))
    except Exception as exc:
        failure = ctx.failed(exc, "pack", None)
    for part in agree(ctx.group, failure, phase="pack", payload=known):
        ctx.pack_stats.update(part)
    missing = [item for item in items if item.key not in ctx.pack_stats]
    assignment = assign_lpt(missing, ctx.world)
    mine = [item for item in missing if assignment[item.key] == ctx.rank]
    counts: dict[str, dict[str, int] | None] = {}
    records: dict[str, dict] = {}
    # TODO(space): the chunks are written before the free-space check, which needs the plan and so
    # comes after this phase; a check of the chunks' own estimate here would stop a full disk earlier.
    packs = None if ctx.dry_run else PackWriter(ctx.cache)
    poller = ProgressPoller(ctx.cache, [], None, poll=False)
    try:
        for item in sorted(mine, key=lambda item: (-item.cost_s, item.key)):
            try:
                if ctx.before_item is not None:
                    ctx.before_item(item, ctx.rank)
                if packs is None:
                    counts[item.key] = pack_stats(build_one(ctx, item, None)[1])
                elif not build_and_queue(ctx, item, packs, records, poller, lambda: None):
                    counts[item.key] = None  # another job built it: read its record below
            except Exception as exc:
                failure = ctx.failed(exc, "pack", item.label)
                break
    finally:
        if packs is not None:
            try:
                packs.close()
            except Exception as exc:
                failure = failure or ctx.failed(exc, "pack", "publishing a pack")
            ctx.cache.close_locks()
    if failure is None:
        try:
            for key in list(counts):
                if counts[key] is None:
                    counts[key] = pack_stats(ctx.cache.read_record(key))
            counts.update({key: pack_stats(record) for key, record in records.items()})
        except Exception as exc:
            failure = ctx.failed(exc, "pack", "reading a chunk's record")
    for part, built in agree(ctx.group, failure, phase="pack", payload=(counts, sorted(records))):
        ctx.pack_stats.update(part)
        ctx.packed.update(built)


__all__ = ["pack"]
