"""``tokenloom.build(config, group=None)``: the build's entry point, and the order of its phases.

:func:`build` opens the build's groups and runs :func:`run`, which calls the phases on every rank
in order -- resolve, warm start or fingerprint, pack, plan, build, transfer, finalize, open -- and records
each one's wall and CPU seconds. The phases themselves live in :mod:`tokenloom.builder.phases`
(one module each, listed there in order) and share one
:class:`~tokenloom.builder.context.BuildContext`.

Each phase ends with :func:`tokenloom.builder.collective.agree`: statuses are gathered before anything
else happens, and a failure anywhere raises the same BuildError on every rank. (The build's
measured work rides on its agreement, and opening the result shares finalize's: a collective
costs every rank CPU time, most of all when ranks outnumber cores.)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from tokenloom.builder.collective import agree, collector_paused, open_group
from tokenloom.builder.config import as_build_config
from tokenloom.builder.context import BuildContext
from tokenloom.builder.items import BuildPlan, WorkItem
from tokenloom.builder.phases.build_items import build_items
from tokenloom.builder.phases.finalize import finalize, open_result
from tokenloom.builder.phases.fingerprint import fingerprint, warm_start
from tokenloom.builder.phases.pack import pack
from tokenloom.builder.phases.plan import make_plan, plan_from_record
from tokenloom.builder.phases.resolve import resolve
from tokenloom.builder.phases.transfer import transfer
from tokenloom.builder.result import BuildResult

log = logging.getLogger(__name__)

ProgressCallback = Callable[[int, int], None]
"""``on_progress(items_done, items_total)``; called on rank 0 only."""


def build(config, group=None, *, dry_run: bool = False, on_progress: ProgressCallback | None = None,
          on_plan: Callable[[BuildPlan, frozenset], None] | None = None,
          _before_item: Callable[[WorkItem, int], None] | None = None):
    """:func:`tokenloom.build`, whose docstring says what the arguments mean; ``_before_item(item,
    rank)`` is a test hook called before each item is built."""
    # TODO(ranks): a config file missing on one rank only fails that rank here, before the group
    # exists (its timeout is in the file), so the others wait for their timeout.
    config = as_build_config(config)
    group, owned = open_group(group, timeout_s=config.timeout_s)
    blend_group = None
    try:
        config = resolve(config, group)  # the step that reads files (epoch budgets), agreed on
        blend_group = group.sibling()  # divided blends talk on their own group, beside the items
        return run(BuildContext(config, group, blend_group, on_progress=on_progress, on_plan=on_plan,
                                before_item=_before_item, dry_run=dry_run))
    finally:
        if blend_group is not None and blend_group is not group:
            blend_group.close()
        group.close()
        if owned:
            import torch.distributed as dist

            dist.destroy_process_group()


def run(ctx: BuildContext) -> BuildResult | BuildPlan:
    """The phases in order on this rank, each one's seconds recorded in ``ctx.timings``; the
    result (the plan on a dry run)."""
    start = time.perf_counter()
    record = warm_start(ctx)
    if record is None:
        fingerprint(ctx)
    ctx.timed("fingerprint", start)

    if record is None and ctx.config.packing == "best_fit":
        start = time.perf_counter()
        pack(ctx)
        ctx.timed("pack", start)

    start = time.perf_counter()
    plan, nodes, present = make_plan(ctx) if record is None else plan_from_record(ctx, record)
    ctx.timed("plan", start)
    ctx.from_record = record is not None
    done = frozenset(k for k in (i.key for i in plan.items) if all(k in p for p in present.values()))
    if ctx.on_plan is not None:  # best-fit chunks packed by this run are not "cached"
        ctx.on_plan(plan, done - ctx.packed)
    if ctx.dry_run:
        return plan

    start = time.perf_counter()
    built, ctx.rank_seconds = build_items(ctx, plan)
    ctx.timed("build", start)

    start = time.perf_counter()
    if not ctx.config.shared_fs:
        transfer(ctx, plan, nodes, present, built)
    ctx.timed("transfer", start)
    built |= ctx.packed  # the chunks the pack phase built count as built by this run

    # finalize and open make thousands of lasting objects (manifest entries, the result's
    # per-item views): with the collector on, each of its full passes walks all that a rank
    # holds (torch and numba included), so the passes cost in proportion to the heap, not to
    # what finalize makes. No kernel compiles here, so nothing makes cyclic garbage in bulk
    # while it is paused.
    start = time.perf_counter()
    with collector_paused():
        build_key, failure = finalize(ctx, plan, nodes, built)
    ctx.timed("finalize", start)

    # open the result before the ranks agree, so that one collective covers both phases: it
    # reads the packs every rank has (the build's agreement said so), not the manifest
    start = time.perf_counter()
    result, failure = open_result(ctx, plan, build_key, built, failure)
    agree(ctx.group, failure, phase="finalize")
    result.rank_seconds = list(ctx.rank_seconds)
    result.warm_start = ctx.from_record
    result.traffic = ctx.group.traffic.add(ctx.blend_group.traffic) if ctx.blend_group is not ctx.group \
        else ctx.group.traffic
    ctx.timed("open", start)
    result.timings.update(ctx.timings)
    if ctx.rank == 0:
        log.info("build %s: %d items, %d built, timings %s", build_key[:12], len(plan.items),
                 len(built), ctx.timings)
    return result


__all__ = ["build"]
