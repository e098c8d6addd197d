"""Phase 2, plan: what the build is made of, what is missing, and which rank builds what.

:func:`make_plan` is the general path: every rank resolves the same items and keys from the
gathered ones, the writers check their cache, and all ranks agree on what is missing; missing
items go to ranks by longest processing time first, exact blends are cut into one range per rank.
Before that agreement every writer checks its disk (:func:`check_cache_space`). :func:`plan_from_record` is a
warm start's: the kept plan, every item present.
"""

from __future__ import annotations

from tokenloom.builder.collective import Failure, agree, failure_from
from tokenloom.builder.context import BuildContext
from tokenloom.builder.items import BuildPlan, assign_work, resolve_items, split_ranges, train_samples_per_epoch
from tokenloom.builder.starts import StartRecord
from tokenloom.io.space import check_space

Planned = tuple[BuildPlan, dict[int, int], dict[int, set]]
"""The plan, each rank's writer, and the keys each writer's cache holds."""


def plan_from_record(ctx: BuildContext, record: StartRecord) -> Planned:
    """The plan of a warm-start record: every item present, nothing to build."""
    nodes, writers = ctx.nodes()
    keys = frozenset(item.key for item in record.items)
    plan = assign_work(ctx.config, record.items, record.splits, ctx.world, [],
                       writers=tuple(sorted(writers)))
    ctx.writer_of = nodes
    return plan, nodes, {writer: keys for writer in writers}


def train_tokens_per_epoch(ctx: BuildContext) -> dict[str, int]:
    """Input tokens of an epoch of each train store's train documents (its tokens less the extra
    one): what ``max_epochs`` caps when a schedule's length runs read a store as tokens."""
    blend = ctx.config.blend_for_split(0)
    extra = int(ctx.config.add_extra_token)
    out = {}
    for prefix in () if blend is None else blend.prefixes:
        info = ctx.infos.get(prefix)
        bounds = None if info is None else split_ranges(ctx.config, info.num_sequences, prefix)[0]
        if bounds is not None:
            out[prefix] = max(0, info.tokens_in(*bounds) - extra)
    return out


def make_plan(ctx: BuildContext) -> Planned:
    """The plan of the stores' infos and the chunks' counts, after every writer looked in its
    cache and checked its disk (not on a dry run). A train split that needs more of a store than
    its ``max_epochs`` allows raises the ConfigError on every rank alike, with no collective: each
    computes it from the same gathered infos."""
    pack_samples = {key: stats["num_samples"] for key, stats in ctx.pack_stats.items()}
    ctx.config.check_max_epochs(train_samples_per_epoch(ctx.config, ctx.infos, pack_samples),
                                train_tokens_per_epoch(ctx))
    failure = None
    items = splits = None
    mine: set[str] | None = None
    try:  # every item; which rank builds what waits for what the caches hold
        items, splits = resolve_items(ctx.config, ctx.infos, ctx.made, pack_samples)
    except Exception as exc:
        failure = failure_from(exc, rank=ctx.rank, phase="plan", item=None)
    nodes, writers = ctx.nodes()
    if items is not None and ctx.rank in writers:
        try:
            ctx.cache.refresh()  # one listing of the packs, not one per item
            mine = {item.key for item in items if ctx.cache.has(item.key, refresh=False)}
        except Exception as exc:  # pragma: no cover - a broken filesystem
            failure = failure_from(exc, rank=ctx.rank, phase="plan", item="cache lookup")
        if mine is not None and not ctx.dry_run:
            failure = failure or check_cache_space(ctx, [item for item in items if item.key not in mine])
    gathered = agree(ctx.group, failure, phase="plan", payload=mine)
    present = {writer: gathered[writer] for writer in writers}
    everywhere_missing = [item for item in items if not any(item.key in keys for keys in present.values())]
    plan = assign_work(ctx.config, items, splits, ctx.world, everywhere_missing,
                       writers=tuple(sorted(writers)))
    ctx.writer_of = nodes
    return plan, nodes, present


def check_cache_space(ctx: BuildContext, missing) -> Failure | None:
    """A writer's check that its cache's filesystem holds the ``missing`` items it will receive
    (the plan's estimate), as this rank's failure or None. It rides on the plan's agreement, so a
    build too big for its disk fails on every rank before it writes, at no extra collective."""
    needed = sum(item.output_bytes for item in missing)
    ctx.cache.expected_bytes = needed
    try:
        if needed:
            check_space(ctx.cache.root, needed, f"the build ({len(missing)} items to write; "
                        "`tokenloom build --dry-run` prints this estimate)")
    except Exception as exc:
        return failure_from(exc, rank=ctx.rank, phase="plan", item=None)
    return None


__all__ = ["Planned", "check_cache_space", "make_plan", "plan_from_record"]
