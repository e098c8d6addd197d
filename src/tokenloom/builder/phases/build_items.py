"""Phase 3, build: each rank builds its items (locks per item, atomic publication).

:func:`build_items` runs the phase: this rank's dataset items on the calling thread, its blends
and its ranges of the divided blends on a :class:`BlendThread` beside them, progress counted by a
:class:`ProgressPoller`. :func:`build_and_queue` and :func:`build_one` build one item (the pack
phase builds its chunks with them too); :func:`shuffle_workers` decides whether a rank draws its
shuffles in background processes.
"""

from __future__ import annotations

import resource
import threading
import time
from typing import Any

from tokenloom.builder.best_fit import build_gpt_arrays as build_best_fit_gpt_arrays
from tokenloom.builder.best_fit import build_pack_arrays
from tokenloom.builder.cache import Cache, host_record
from tokenloom.builder.collective import CollectiveBuildError, agree
from tokenloom.builder.context import BuildContext
from tokenloom.builder.divided import DividedContext, build_divided_blend
from tokenloom.builder.exact import (
    SMALL_WALK_POSITIONS,
    ShuffleDrawer,
    build_blend_arrays,
    build_gpt_arrays,
    plan_to_dict,
)
from tokenloom.builder.items import BuildPlan, WorkItem
from tokenloom.builder.packs import PackWriter
from tokenloom.builder.stateless import build_stateless_blend_arrays, build_stateless_gpt_arrays

MIN_BACKGROUND_WORK_S = 2.0
"""Estimated seconds of ``gpt`` work below which a rank draws its shuffles inline."""


def shuffle_workers(requested: int, draw_cost_s: float, cores_per_rank: int) -> int:
    """Background shuffle processes for a rank: the ``requested`` ones where its dataset items'
    estimated work repays starting a process (:data:`MIN_BACKGROUND_WORK_S`) and the rank has a
    core to spare for them (its share of the host's cores is 2 or more); else none, and the rank
    draws inline. Where every core already runs a rank, a worker has no core of its own to draw
    on: it only takes turns with its rank and adds its start-up, its own import of numba and the
    copies of its arrays through a pipe, so the rank's CPU goes up, not down (BENCHMARKS.md,
    "Cluster scale")."""
    return requested if draw_cost_s > MIN_BACKGROUND_WORK_S and cores_per_rank >= 2 else 0


def build_items(ctx: BuildContext, plan: BuildPlan) -> tuple[set[str], list[dict]]:
    """Build this rank's items and ranges. Returns the keys of every item any rank built, and
    every rank's predicted and measured work (for the manifest and the result)."""
    started, cpu = time.perf_counter(), _cpu_seconds()
    mine = plan.items_of_rank(ctx.rank)
    exact = ctx.config.mode == "exact" and ctx.config.packing == "concat"  # megatron-core's shuffles
    gpt_jobs = [(item.prefix, item.params, item.epoch_plan) for item in mine if item.kind == "gpt" and exact]
    records: dict[str, dict] = {}
    failure = None
    poller = ProgressPoller(ctx.cache, [*plan.assignment, *plan.divided], ctx.on_progress,
                            poll=ctx.config.shared_fs and ctx.world > 1)
    # background draws: only with enough work and a spare core (shuffle_workers)
    draw_cost = sum(item.cost_s for item in mine if item.kind == "gpt")
    workers = shuffle_workers(ctx.config.rng_workers, draw_cost, ctx.cores_per_rank())
    drawer = ShuffleDrawer(gpt_jobs, workers) if gpt_jobs else None
    packs = PackWriter(ctx.cache)
    positions = sum(_positions(item) for item in mine if item.kind == "gpt")
    ctx.compiled_walk = True if positions >= SMALL_WALK_POSITIONS else None
    gpt_seen = 0
    # blends run on a thread beside the dataset items (their kernel releases the GIL): a
    # stateless blend on its rank, every exact blend on every rank, a range each
    blends = [item for item in mine if item.kind == "blend"]
    divided = plan.divided_items()
    blend_thread = (BlendThread(ctx, blends, divided, plan, packs, records, poller)
                    if blends or divided else None)
    try:
        for item in mine:
            if item.kind == "blend":
                continue
            try:
                draws_index = gpt_seen  # the drawer serves the dataset items in this order
                gpt_seen += 1
                if ctx.before_item is not None:
                    ctx.before_item(item, ctx.rank)
                build_and_queue(ctx, item, packs, records, poller,
                                lambda i=draws_index: drawer.get(i) if exact else None)
            except Exception as exc:
                failure = ctx.failed(exc, "build", item.label)
                break
            if blend_thread is not None and blend_thread.failure is not None:
                break
    finally:
        if blend_thread is not None:
            blend_thread.join()
            failure = failure or blend_thread.failure
        if drawer is not None:
            drawer.close()
        try:
            packs.close()  # publishes what was finished, even after a failure
        except Exception as exc:
            if failure is None:
                failure = ctx.failed(exc, "build", "publishing a pack")
        ctx.cache.close_locks()
    measured = {"rank": ctx.rank, "predicted_s": round(plan.seconds_per_rank()[ctx.rank], 6),
                "wall_s": round(time.perf_counter() - started, 6), "cpu_s": round(_cpu_seconds() - cpu, 6)}
    # the keys alone: writers read the records from their cache for the manifest, and every
    # rank unpickling every rank's records cost each rank as much as the manifest costs one
    gathered = agree(ctx.group, failure, phase="build", payload=(sorted(records), measured))
    poller.stop()
    return {key for keys, _ in gathered for key in keys}, [work for _, work in gathered]


def build_and_queue(ctx: BuildContext, item: WorkItem, packs: PackWriter, records: dict, poller,
                    get_draws) -> bool:
    """Build ``item`` under its lock and queue it for publication; False if another job had
    already built it."""
    token = ctx.cache.acquire(item.key)
    try:
        draws = get_draws()
        if ctx.cache.built_elsewhere(item.key, token):
            ctx.cache.release(token)  # another job built it while we waited
            return False
        arrays, record = build_one(ctx, item, draws)
    except BaseException:
        ctx.cache.release(token)
        raise

    def published(full, token=token, key=item.key):
        ctx.cache.release(token)
        records[key] = full
        poller.done_locally(key)

    packs.add(item.key, arrays, record, published)
    return True


def build_one(ctx: BuildContext, item: WorkItem, draws):
    """The arrays of ``item`` and its record."""
    started = time.perf_counter()
    extra: dict[str, Any] = {}
    if item.kind == "pack":
        arrays, extra = build_pack_arrays(item.prefix, item.params)
    elif item.kind == "gpt" and ctx.config.packing == "best_fit":
        arrays, extra = build_best_fit_gpt_arrays(item.params, ctx.pack_stats)
    elif (ctx.config.mode, item.kind) == ("exact", "gpt"):
        arrays, epoch_plan = build_gpt_arrays(item.prefix, item.params, draws, plan=item.epoch_plan,
                                              compiled=ctx.compiled_walk)
        extra["plan"] = plan_to_dict(epoch_plan)
    elif (ctx.config.mode, item.kind) == ("exact", "blend"):
        extra["threads"] = ctx.blend_threads()
        arrays = build_blend_arrays(item.params, threads=extra["threads"])
    elif item.kind == "gpt":
        arrays, extra = build_stateless_gpt_arrays(item.prefix, item.params, compiled=ctx.compiled_walk)
    else:
        arrays = build_stateless_blend_arrays(item.params)
    record = {
        "kind": item.kind, "label": item.label, "split": item.split, "params": dict(item.params),
        "num_samples": extra.pop("num_samples", item.num_samples), "built_by": {"rank": ctx.rank, **host_record()},
        "seconds": round(time.perf_counter() - started, 6),
        "megatron_md5": None if item.megatron is None else item.megatron.md5, **extra,
    }
    return arrays, record


class BlendThread:
    """Builds blends on a thread while the main thread builds dataset items: this rank's own
    (stateless) blends, then its range of every divided (exact) blend, with the other ranks over
    the build's second group (:mod:`tokenloom.builder.divided`)."""

    def __init__(self, ctx: BuildContext, items: list[WorkItem], divided: list[WorkItem], plan: BuildPlan, packs,
                 records, poller) -> None:
        self.failure = None
        self._thread = threading.Thread(target=self._run, args=(ctx, items, divided, plan, packs, records, poller),
                                        name="tokenloom-blend", daemon=True)
        self._thread.start()

    def _run(self, ctx, items, divided, plan, packs, records, poller) -> None:
        for item in items:
            try:
                if ctx.before_item is not None:
                    ctx.before_item(item, ctx.rank)
                build_and_queue(ctx, item, packs, records, poller, lambda: None)
            except Exception as exc:
                self.failure = ctx.failed(exc, "build", item.label)
                break
        if not divided:
            return
        # every rank takes part in every divided blend: the collectives inside carry a failure
        # to all ranks instead of leaving them waiting
        context = DividedContext(group=ctx.blend_group, cache=ctx.cache, writer_of=ctx.writer_of,
                                 threads=ctx.blend_threads(), block=ctx.config.blend_block_samples,
                                 before_item=ctx.before_item)
        for item in divided:
            try:
                records[item.key] = build_divided_blend(context, item, plan.divided[item.key])
                poller.done_locally(item.key)
            except CollectiveBuildError as exc:  # already every rank's: pass the original on
                self.failure = self.failure or exc.failures[0]
                return
            except Exception as exc:
                self.failure = self.failure or ctx.failed(exc, "build", item.label)
                return

    def join(self) -> None:
        self._thread.join()


def _cpu_seconds() -> float:
    """CPU seconds of this process, every thread, plus its reaped children (shuffle workers)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _positions(item: WorkItem) -> int:
    """Document positions of a ``gpt`` item (none for best fit: its chunks were packed before)."""
    if item.epoch_plan is None:
        return 0
    return item.epoch_plan.num_epochs * item.epoch_plan.num_documents


class ProgressPoller:
    """Counts finished items for rank 0's progress callback: its own, and (with a shared
    filesystem) those other ranks publish, by polling the cache every half second."""

    def __init__(self, cache: Cache, keys: list[str], callback, *, poll: bool) -> None:
        self.cache = cache
        self.keys = keys
        self.callback = callback
        self.local: set[str] = set()
        self._stop = threading.Event()
        self._thread = None
        if callback is not None:
            callback(0, len(keys))
            if poll and keys:
                self._thread = threading.Thread(target=self._run, daemon=True, name="tokenloom-progress")
                self._thread.start()

    def _count(self) -> int:
        return sum(1 for k in self.keys if k in self.local or self.cache.has(k))

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self.callback(self._count(), len(self.keys))

    def done_locally(self, key: str) -> None:
        if self.callback is None:
            return
        self.local.add(key)
        if self._thread is None:
            self.callback(len(self.local), len(self.keys))

    def stop(self) -> None:
        if self.callback is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.callback(len(self.keys), len(self.keys))


__all__ = ["MIN_BACKGROUND_WORK_S", "BlendThread", "ProgressPoller", "build_and_queue", "build_items", "build_one",
           "shuffle_workers"]
