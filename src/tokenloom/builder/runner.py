"""``tokenloom.build(config, group=None)``: the phases of a build, on every rank.

0. **warm start** -- when the last build of this config kept its plan and every rank proves its
   share of the stores unchanged (:mod:`tokenloom.builder.starts`), the ranks take that plan and
   skip 1 and most of 2;
1. **fingerprint** -- ranks fingerprint the stores round-robin (a store unchanged since the
   memo recorded it is not opened: :mod:`tokenloom.builder.stores`), make those stores' dataset
   items, and gather both;
   **pack** (``packing: best_fit`` only) -- the chunks of every split's documents that no writer's
   cache holds are packed and published, divided over the ranks by longest processing time first;
   the ranks gather every chunk's sample count, which the plan needs (:mod:`tokenloom.builder.best_fit`);
2. **plan** -- every rank resolves the same items and keys from the gathered ones, the writers
   check their cache, and all ranks agree on what is missing; missing items go to ranks by longest
   processing time first, exact blends are cut into one range per rank;
3. **build** -- each rank builds its items (locks per item, atomic publication);
4. **transfer** -- without a shared filesystem, each finished item travels over the group to one
   writer per node that lacks it;
5. **finalize** -- writers record the manifest (and the megatron-core cache) and keep the plan
   for the next start; every rank opens the result by mmap.

Each phase ends with :func:`tokenloom.builder.collective.agree`: statuses are gathered before anything
else happens, and a failure anywhere raises the same BuildError on every rank. (The build's
measured work rides on its agreement, and opening the result shares finalize's: a collective
costs every rank CPU time, most of all when ranks outnumber cores.)
"""

from __future__ import annotations

import logging
import os
import platform
import resource
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from tokenloom._version import __version__
from tokenloom.builder.best_fit import build_gpt_arrays as build_best_fit_gpt_arrays
from tokenloom.builder.best_fit import build_pack_arrays, pack_stats
from tokenloom.builder.cache import CACHE_FORMAT_VERSION, Cache, PackWriter, host_record
from tokenloom.builder.collective import (
    CollectiveBuildError,
    Failure,
    agree,
    collector_paused,
    failure_from,
    node_key,
    open_group,
    writers_by_node,
)
from tokenloom.builder.config import BuildConfig, array_config, as_build_config
from tokenloom.builder.divided import DividedContext, build_divided_blend
from tokenloom.builder.exact import (
    SMALL_WALK_POSITIONS,
    ShuffleDrawer,
    build_blend_arrays,
    build_gpt_arrays,
    plan_to_dict,
)
from tokenloom.builder.items import (
    BuildPlan,
    WorkItem,
    all_pack_items,
    assign_lpt,
    assign_work,
    dataset_items,
    ranges_for,
    resolve_items,
)
from tokenloom.builder.megatron_export import export_megatron_item
from tokenloom.builder.result import BuildResult
from tokenloom.builder.starts import StartRecord, read_start, start_key, stores_unchanged, write_start
from tokenloom.builder.stateless import build_stateless_blend_arrays, build_stateless_gpt_arrays
from tokenloom.builder.stores import FingerprintMemo, StoreInfo, fingerprint_store
from tokenloom.builder.transfer import pack_item, unpack_item
from tokenloom.errors import BuildError
from tokenloom.io.space import check_space, full_disk_error, is_full
from tokenloom.io.writer import compact_json
from tokenloom.source.keys import build_key as make_build_key
from tokenloom.source.keys import canonical_json

log = logging.getLogger(__name__)

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

ProgressCallback = Callable[[int, int], None]
"""``on_progress(items_done, items_total)``; called on rank 0 only."""


def build(config, group=None, *, dry_run: bool = False, on_progress: ProgressCallback | None = None,
          on_plan: Callable[[BuildPlan, frozenset], None] | None = None,
          _before_item: Callable[[WorkItem, int], None] | None = None):
    """Build (or reuse from the cache) every index of ``config`` and open them on every rank.

    ``config`` is a :class:`BuildConfig`, a mapping, or a YAML/JSON path. ``group`` is a
    torch.distributed process group of the ranks that build together (default: every rank of an
    initialised job, or this process alone); the build makes its own gloo group over those ranks.
    Every rank of the group must call ``build`` with the same config.

    Returns a :class:`BuildResult`, or with ``dry_run`` the :class:`BuildPlan` (nothing written).
    ``on_plan(plan, cached_keys)`` is called on rank 0 once the plan is known; ``on_progress``
    reports items done while building, on rank 0.
    """
    config = as_build_config(config)
    group, owned = open_group(group, timeout_s=config.timeout_s)
    blend_group = None
    try:
        blend_group = group.sibling()  # divided blends talk on their own group, beside the items
        return _Build(config, group, blend_group, on_progress, on_plan, _before_item).run(dry_run)
    finally:
        if blend_group is not None and blend_group is not group:
            blend_group.close()
        group.close()
        if owned:
            import torch.distributed as dist

            dist.destroy_process_group()


class _Build:
    def __init__(self, config: BuildConfig, group, blend_group, on_progress, on_plan, before_item) -> None:
        self.config = config
        self.group = group
        self.blend_group = blend_group
        self.rank = group.rank
        self.world = group.world_size
        self.cache = Cache(config.cache_dir)
        self.on_progress = on_progress if group.rank == 0 else None
        self.on_plan = on_plan if group.rank == 0 else None
        self.before_item = before_item
        self.timings: dict[str, float] = {}
        self.start_key: str | None = None
        self._memo: FingerprintMemo | None = None

    def _failed(self, exc: BaseException, phase: str, item: str | None):
        """This rank's Failure in a phase that writes into the cache (a full disk names it)."""
        return failure_from(exc, rank=self.rank, phase=phase, item=item, folder=self.cache.root,
                            needed=self.cache.expected_bytes)

    def _timed(self, phase: str, start: float) -> None:
        """Record the phase's wall seconds (``<phase>_s``) and this process's CPU seconds in it,
        every thread (``<phase>_cpu_s``), since the last call."""
        self.timings[f"{phase}_s"] = round(time.perf_counter() - start, 6)
        cpu = time.process_time()
        self.timings[f"{phase}_cpu_s"] = round(cpu - self._cpu_mark, 6)
        self._cpu_mark = cpu

    def run(self, dry_run: bool):
        self._cpu_mark = time.process_time()
        self.dry_run = dry_run
        start = time.perf_counter()
        record = self._warm_start()
        infos = None if record is not None else self._fingerprint()
        self._timed("fingerprint", start)

        self._pack_stats: dict[str, dict[str, int]] = {}
        self._packed: set[str] = set()
        if record is None and self.config.packing == "best_fit":
            start = time.perf_counter()
            self._pack()
            self._timed("pack", start)

        start = time.perf_counter()
        plan, nodes, present = self._plan() if record is None else self._plan_from(record)
        self._timed("plan", start)
        self.from_record = record is not None
        done = frozenset(k for k in (i.key for i in plan.items) if all(k in p for p in present.values()))
        if self.on_plan is not None:  # best-fit chunks packed by this run are not "cached"
            self.on_plan(plan, done - self._packed)
        if dry_run:
            return plan

        start = time.perf_counter()
        built, self.rank_seconds = self._build_items(plan)
        self._timed("build", start)

        start = time.perf_counter()
        if not self.config.shared_fs:
            self._transfer(plan, nodes, present, built)
        self._timed("transfer", start)
        built |= self._packed  # the chunks the pack phase built count as built by this run

        # finalize and open make thousands of lasting objects (manifest entries, the result's
        # per-item views): with the collector on, each of its full passes walks all that a rank
        # holds (torch and numba included), so the passes cost in proportion to the heap, not to
        # what finalize makes. No kernel compiles here, so nothing makes cyclic garbage in bulk
        # while it is paused.
        start = time.perf_counter()
        with collector_paused():
            build_key, failure = self._finalize(plan, infos, nodes, built)
        self._timed("finalize", start)

        # open the result before the ranks agree, so that one collective covers both phases: it
        # reads the packs every rank has (the build's agreement said so), not the manifest
        start = time.perf_counter()
        result = None
        if failure is None:
            try:
                with collector_paused():
                    result = BuildResult(cache=self.cache, plan=plan, build_key=build_key, mode=self.config.mode,
                                         manifest_path=self.cache.manifest_path(build_key),
                                         seq_length=self.config.seq_length,
                                         add_extra_token=self.config.add_extra_token,
                                         weights=self._split_weights(plan), timings=self.timings,
                                         built_keys=frozenset(built), rank=self.rank, budgets=self._budgets())
            except Exception as exc:
                failure = failure_from(exc, rank=self.rank, phase="open", item=None)
        agree(self.group, failure, phase="finalize")
        result.rank_seconds = list(self.rank_seconds)
        result.warm_start = self.from_record
        result.traffic = self.group.traffic.add(self.blend_group.traffic) if self.blend_group is not self.group \
            else self.group.traffic
        self._timed("open", start)
        result.timings.update(self.timings)
        if self.rank == 0:
            log.info("build %s: %d items, %d built, timings %s", build_key[:12], len(plan.items),
                     len(built), self.timings)
        return result

    # -- 1. fingerprint -------------------------------------------------------------------------
    def _fingerprint(self) -> dict[str, StoreInfo]:
        prefixes = self.config.prefixes
        mine: dict[str, StoreInfo] = {}
        failure = None
        memo = None
        if self.config.verify_stores == "stat":
            memo = FingerprintMemo(os.path.join(self.config.cache_dir, "stores.json"))
        for prefix in prefixes[self.rank::self.world]:
            try:
                mine[prefix] = fingerprint_store(prefix, ranges_for(self.config, prefix), memo)
            except Exception as exc:
                failure = failure_from(exc, rank=self.rank, phase="fingerprint",
                                       item=self.config.describe_store(prefix))
                break
        made = {}
        if failure is None and self.config.packing == "concat":
            # the dataset items of these stores: planning's share that grows with them (a best-fit
            # item needs its chunks' sample counts, known after the pack phase)
            try:
                made = dataset_items(self.config, mine)
            except Exception as exc:
                failure = failure_from(exc, rank=self.rank, phase="plan", item=None)
        self._memo = memo
        fresh = memo.fresh if memo is not None else {}
        gathered = agree(self.group, failure, phase="fingerprint",
                         payload=(mine, node_key(self.config.cache_dir), fresh, made))
        infos: dict[str, StoreInfo] = {}
        self._made = {}
        for part, _, _, part_made in gathered:
            infos.update(part)
            self._made.update(part_made)
        self._node_keys = [key for _, key, _, _ in gathered]
        self.infos = {p: infos[p] for p in prefixes}
        # one rank per cache directory saves what every rank hashed afresh
        writer = 0 if self.config.shared_fs else self._node_keys.index(self._node_keys[self.rank])
        if memo is not None and self.rank == writer and not self.dry_run:  # a dry run writes nothing
            all_fresh: dict[str, dict] = {}
            for _, _, part, _ in gathered:
                all_fresh.update(part)
            try:
                os.makedirs(self.config.cache_dir, exist_ok=True)
            except OSError:
                pass
            memo.merge_and_save(all_fresh)
        return self.infos

    # -- 1b. pack (best fit) ----------------------------------------------------------------------
    def _pack(self) -> None:
        """Build the best-fit chunks no writer's cache holds, divided over the ranks, and gather
        every chunk's counts into ``self._pack_stats`` (a dry run packs and writes nothing). Every
        rank learns them here: without a shared filesystem a chunk reaches the other nodes only
        after the build, and the split's ``gpt`` item, built before that, needs its counts."""
        failure = None
        items: list[WorkItem] = []
        known: dict[str, dict[str, int]] = {}
        _, writers = self._nodes()
        try:
            items = all_pack_items(self.config, self.infos)
            if self.rank in writers:
                self.cache.refresh()
                for item in items:
                    if self.cache.has(item.key, refresh=False):
                        known[item.key] = pack_stats(self.cache.read_record(item.key))
        except Exception as exc:
            failure = self._failed(exc, "pack", None)
        for part in agree(self.group, failure, phase="pack", payload=known):
            self._pack_stats.update(part)
        missing = [item for item in items if item.key not in self._pack_stats]
        assignment = assign_lpt(missing, self.world)
        mine = [item for item in missing if assignment[item.key] == self.rank]
        counts: dict[str, dict[str, int] | None] = {}
        records: dict[str, dict] = {}
        packs = None if self.dry_run else PackWriter(self.cache)
        poller = _ProgressPoller(self.cache, [], None, poll=False)
        try:
            for item in sorted(mine, key=lambda item: (-item.cost_s, item.key)):
                try:
                    if self.before_item is not None:
                        self.before_item(item, self.rank)
                    if packs is None:
                        counts[item.key] = pack_stats(self._build_one(item, None)[1])
                    elif not self._build_and_queue(item, packs, records, poller, lambda: None):
                        counts[item.key] = None  # another job built it: read its record below
                except Exception as exc:
                    failure = self._failed(exc, "pack", item.label)
                    break
        finally:
            if packs is not None:
                try:
                    packs.close()
                except Exception as exc:
                    failure = failure or self._failed(exc, "pack", "publishing a pack")
                self.cache.close_locks()
        if failure is None:
            try:
                for key in list(counts):
                    if counts[key] is None:
                        counts[key] = pack_stats(self.cache.read_record(key))
                counts.update({key: pack_stats(record) for key, record in records.items()})
            except Exception as exc:
                failure = self._failed(exc, "pack", "reading a chunk's record")
        for part, built in agree(self.group, failure, phase="pack", payload=(counts, sorted(records))):
            self._pack_stats.update(part)
            self._packed.update(built)

    def _warm_start(self) -> StartRecord | None:
        """The warm-start record's plan when every rank proves it current (its share of the stores
        unchanged, every item and the manifest in its cache), else None on every rank
        (:mod:`tokenloom.builder.starts`)."""
        self.start_key = start_key(self.config)
        if self.start_key is None:
            return None
        record, current = None, False
        try:
            record = read_start(self.cache.root, self.start_key)
            if record is not None:
                prefixes = self.config.prefixes
                current = (stores_unchanged(record, prefixes, range(self.rank, len(prefixes), self.world))
                           and os.path.isfile(self.cache.manifest_path(record.build_key))
                           and all(self.cache.has(item.key) for item in record.items))
        except Exception as exc:  # the general path reports real problems with their context
            log.warning("warm-start record %s not used (%s: %s)", self.start_key, type(exc).__name__, exc)
            current = False
        answers = agree(self.group, None, phase="fingerprint",
                        payload=(current, node_key(self.config.cache_dir), record.build_key if record else None))
        if not all(ok for ok, _, _ in answers) or len({key for _, _, key in answers}) != 1:
            return None
        self._node_keys = [key for _, key, _ in answers]
        return record

    # -- 2. plan --------------------------------------------------------------------------------
    def _nodes(self) -> tuple[dict[int, int], dict[int, int]]:
        """Each rank's writer (the rank that writes its cache directory) and the writers."""
        if self.config.shared_fs:
            return {rank: 0 for rank in range(self.world)}, {0: 0}
        by_key = writers_by_node(self._node_keys)
        nodes = {rank: by_key[key] for rank, key in enumerate(self._node_keys)}
        return nodes, {w: w for w in set(nodes.values())}

    def _plan_from(self, record: StartRecord):
        """The plan of a warm-start record: every item present, nothing to build."""
        nodes, writers = self._nodes()
        keys = frozenset(item.key for item in record.items)
        plan = assign_work(self.config, record.items, record.splits, self.world, [],
                           writers=tuple(sorted(writers)))
        self.writer_of = nodes
        return plan, nodes, {writer: keys for writer in writers}

    def _plan(self):
        failure = None
        items = splits = None
        mine: set[str] | None = None
        try:  # every item; which rank builds what waits for what the caches hold
            items, splits = resolve_items(self.config, self.infos, self._made,
                                          {key: stats["num_samples"] for key, stats in self._pack_stats.items()})
        except Exception as exc:
            failure = failure_from(exc, rank=self.rank, phase="plan", item=None)
        nodes, writers = self._nodes()
        if items is not None and self.rank in writers:
            try:
                self.cache.refresh()  # one listing of the packs, not one per item
                mine = {item.key for item in items if self.cache.has(item.key, refresh=False)}
            except Exception as exc:  # pragma: no cover - a broken filesystem
                failure = failure_from(exc, rank=self.rank, phase="plan", item="cache lookup")
        gathered = agree(self.group, failure, phase="plan", payload=mine)
        present = {writer: gathered[writer] for writer in writers}
        everywhere_missing = [item for item in items if not any(item.key in keys for keys in present.values())]
        plan = assign_work(self.config, items, splits, self.world, everywhere_missing,
                           writers=tuple(sorted(writers)))
        self.writer_of = nodes
        if not self.dry_run:
            self._check_space(items, present, writers)
        return plan, nodes, present

    def _check_space(self, items, present, writers) -> None:
        """Every writer checks that its cache's filesystem holds what it will receive (the plan's
        estimate), so that a build too big for its disk fails on every rank before it writes."""
        failure = None
        if self.rank in writers:
            missing = [item for item in items if item.key not in present[self.rank]]
            needed = sum(item.output_bytes for item in missing)
            self.cache.expected_bytes = needed
            try:
                if needed:
                    check_space(self.cache.root, needed, f"the build ({len(missing)} items to write; "
                                "`tokenloom build --dry-run` prints this estimate)")
            except Exception as exc:
                failure = failure_from(exc, rank=self.rank, phase="plan", item=None)
        agree(self.group, failure, phase="plan")

    # -- 3. build -------------------------------------------------------------------------------
    def _build_items(self, plan: BuildPlan) -> tuple[set[str], list[dict]]:
        """Build this rank's items and ranges. Returns the keys of every item any rank built, and
        every rank's predicted and measured work (for the manifest and the result)."""
        started, cpu = time.perf_counter(), _cpu_seconds()
        mine = plan.items_of_rank(self.rank)
        exact = self.config.mode == "exact" and self.config.packing == "concat"  # megatron-core's shuffles
        gpt_jobs = [(item.prefix, item.params, item.epoch_plan) for item in mine if item.kind == "gpt" and exact]
        records: dict[str, dict] = {}
        failure = None
        poller = _ProgressPoller(self.cache, [*plan.assignment, *plan.divided], self.on_progress,
                                 poll=self.config.shared_fs and self.world > 1)
        # background draws: only with enough work and a spare core (shuffle_workers)
        draw_cost = sum(item.cost_s for item in mine if item.kind == "gpt")
        workers = shuffle_workers(self.config.rng_workers, draw_cost, self._cores_per_rank())
        drawer = ShuffleDrawer(gpt_jobs, workers) if gpt_jobs else None
        packs = PackWriter(self.cache)
        positions = sum(_positions(item) for item in mine if item.kind == "gpt")
        self._compiled_walk = True if positions >= SMALL_WALK_POSITIONS else None
        gpt_seen = 0
        # blends run on a thread beside the dataset items (their kernel releases the GIL): a
        # stateless blend on its rank, every exact blend on every rank, a range each
        blends = [item for item in mine if item.kind == "blend"]
        divided = plan.divided_items()
        blend_thread = (_BlendThread(self, blends, divided, plan, packs, records, poller)
                        if blends or divided else None)
        try:
            for item in mine:
                if item.kind == "blend":
                    continue
                try:
                    draws_index = gpt_seen  # the drawer serves the dataset items in this order
                    gpt_seen += 1
                    if self.before_item is not None:
                        self.before_item(item, self.rank)
                    self._build_and_queue(item, packs, records, poller,
                                          lambda i=draws_index: drawer.get(i) if exact else None)
                except Exception as exc:
                    failure = self._failed(exc, "build", item.label)
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
                    failure = self._failed(exc, "build", "publishing a pack")
            self.cache.close_locks()
        measured = {"rank": self.rank, "predicted_s": round(plan.seconds_per_rank()[self.rank], 6),
                    "wall_s": round(time.perf_counter() - started, 6), "cpu_s": round(_cpu_seconds() - cpu, 6)}
        # the keys alone: writers read the records from their cache for the manifest, and every
        # rank unpickling every rank's records cost each rank as much as the manifest costs one
        gathered = agree(self.group, failure, phase="build", payload=(sorted(records), measured))
        poller.stop()
        return {key for keys, _ in gathered for key in keys}, [work for _, work in gathered]

    def _build_and_queue(self, item: WorkItem, packs: PackWriter, records: dict, poller, get_draws) -> bool:
        """Build ``item`` under its lock and queue it for publication; False if another job had
        already built it."""
        token = self.cache.acquire(item.key)
        try:
            draws = get_draws()
            if self.cache.built_elsewhere(item.key, token):
                self.cache.release(token)  # another job built it while we waited
                return False
            arrays, record = self._build_one(item, draws)
        except BaseException:
            self.cache.release(token)
            raise

        def published(full, token=token, key=item.key):
            self.cache.release(token)
            records[key] = full
            poller.done_locally(key)

        packs.add(item.key, arrays, record, published)
        return True

    def _blend_threads(self) -> int:
        """Threads for an exact blend: the config's, or this rank's share of its host's cores."""
        if self.config.blend_threads:
            return self.config.blend_threads
        return self._cores_per_rank()

    def _cores_per_rank(self) -> int:
        """This rank's share of its host's cores (at least 1)."""
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # pragma: no cover - not on Linux
            cores = os.cpu_count() or 1
        host = self._node_keys[self.rank][0] if self._node_keys else None
        ranks_here = sum(1 for key in self._node_keys if key[0] == host) if self._node_keys else 1
        return max(1, cores // max(1, ranks_here))

    def _build_one(self, item: WorkItem, draws):
        """The arrays of ``item`` and its record."""
        started = time.perf_counter()
        extra: dict[str, Any] = {}
        if item.kind == "pack":
            arrays, extra = build_pack_arrays(item.prefix, item.params)
        elif item.kind == "gpt" and self.config.packing == "best_fit":
            arrays, extra = build_best_fit_gpt_arrays(item.params, self._pack_stats)
        elif (self.config.mode, item.kind) == ("exact", "gpt"):
            arrays, epoch_plan = build_gpt_arrays(item.prefix, item.params, draws, plan=item.epoch_plan,
                                                  compiled=self._compiled_walk)
            extra["plan"] = plan_to_dict(epoch_plan)
        elif (self.config.mode, item.kind) == ("exact", "blend"):
            extra["threads"] = self._blend_threads()
            arrays = build_blend_arrays(item.params, threads=extra["threads"])
        elif item.kind == "gpt":
            arrays, extra = build_stateless_gpt_arrays(item.prefix, item.params, compiled=self._compiled_walk)
        else:
            arrays = build_stateless_blend_arrays(item.params)
        record = {
            "kind": item.kind, "label": item.label, "split": item.split, "params": dict(item.params),
            "num_samples": extra.pop("num_samples", item.num_samples), "built_by": {"rank": self.rank, **host_record()},
            "seconds": round(time.perf_counter() - started, 6),
            "megatron_md5": None if item.megatron is None else item.megatron.md5, **extra,
        }
        return arrays, record

    # -- 4. transfer ----------------------------------------------------------------------------
    def _transfer(self, plan: BuildPlan, nodes: dict[int, int], present: dict[int, set],
                  built: set[str]) -> None:
        writers = sorted(present)
        failure = None
        packs = PackWriter(self.cache)
        try:
            for item in plan.items:
                if item.key in plan.divided:
                    continue  # every node's writer received every range while it was built
                needing = [w for w in writers if item.key not in present[w]
                           and not (item.key in built and nodes[plan.assignment[item.key]] == w)]
                if not needing:
                    continue
                if item.key in plan.assignment:
                    source = plan.assignment[item.key]
                else:
                    source = next(w for w in writers if item.key in present[w])
                size_blob = blob = None
                if self.rank == source:
                    try:
                        blob = pack_item(self.cache, item.key)
                    except Exception as exc:
                        failure = failure or self._failed(exc, "transfer", item.label)
                        blob = b""
                    size_blob = len(blob).to_bytes(8, "little")
                try:
                    size = int.from_bytes(self.group.broadcast_bytes(size_blob, source, 8), "little")
                    data = self.group.broadcast_bytes(blob, source, size) if size else b""
                except Exception as exc:
                    raise BuildError(
                        f"rank {self.rank}: the process group failed while receiving {item.label} from "
                        f"rank {source} ({type(exc).__name__}: {exc}); a rank was killed or hung. Rerun "
                        "the build: finished items are reused"
                    ) from exc
                if self.rank in needing and failure is None and size:
                    try:
                        unpack_item(packs, self.cache, item.key, data)
                    except Exception as exc:
                        failure = self._failed(exc, "transfer", item.label)
        finally:
            try:
                packs.close()
            except Exception as exc:
                failure = failure or self._failed(exc, "transfer", "publishing a pack")
        agree(self.group, failure, phase="transfer")

    # -- 5. finalize ----------------------------------------------------------------------------
    def _finalize(self, plan: BuildPlan, infos, nodes, built) -> tuple[str, Failure | None]:
        """The build key; the writers write the manifest and keep the plan for the next start, and
        ranks place megatron-core's files. Returns this rank's failure (the caller agrees)."""
        arrays_config = array_config(self.config)
        build_key = make_build_key({
            "format": CACHE_FORMAT_VERSION, "config": arrays_config,
            "items": sorted(item.key for item in plan.items),
            "splits": [[s.name, list(s.dataset_keys), s.blend_key] for s in plan.splits],
        })
        failure = None
        writer = nodes[self.rank] == self.rank
        try:
            if writer:
                manifest_path = self.cache.manifest_path(build_key)
                if built or not os.path.isfile(manifest_path):  # a warm start keeps the manifest
                    if infos is None:
                        raise BuildError(f"{manifest_path}: the build's manifest vanished while the build "
                                         "started from its warm-start record; run the build again")
                    self._write_manifest(plan, infos, built, build_key, arrays_config)
                if infos is not None and self.start_key is not None and self._memo is not None:
                    write_start(self.cache.root, self.start_key, build_key=build_key, prefixes=self.config.prefixes,
                                infos=infos, memo=self._memo, items=plan.items, splits=plan.splits)
            if self.config.megatron_cache_dir is not None:
                # on a shared filesystem every rank places a share of the items; else each node's writer all
                if self.config.shared_fs:
                    share = plan.items[self.rank::self.world]
                else:
                    share = plan.items if writer else ()
                for item in share:
                    export_megatron_item(self.cache, item, self.config.megatron_cache_dir)
        except Exception as exc:
            if is_full(exc):  # the manifest or the warm-start record (the export says its own)
                exc = full_disk_error(exc, self.cache.root, "the build's manifest")
            failure = self._failed(exc, "finalize", None)
        return build_key, failure

    def _write_manifest(self, plan, infos, built, build_key, array_config) -> str:
        # this node's copy of each record (its own pack offsets), one pack index at a time, each
        # entry kept as its compact JSON text and the file written as it goes: the writer holds
        # about the manifest's bytes once, not thousands of records, their dicts and the text
        items = {item.key: item for item in plan.items}
        held = {}
        for key, record in self.cache.stream_records(list(items)):
            item = items[key]
            held[key] = compact_json({
                "key": key, "kind": item.kind, "split": item.split, "label": item.label,
                "pack": record["pack"], "files": record["files"], "built_this_run": key in built,
                "built_by_rank": record["built_by"]["rank"], "seconds": record["seconds"],
                "megatron_md5": record.get("megatron_md5"),
            })
        manifest = {
            "format": "tokenloom-build-manifest", "version": CACHE_FORMAT_VERSION,
            "build_key": build_key, "tokenloom_version": __version__,
            "numpy_version": np.__version__, "python_version": platform.python_version(),
            "created": host_record(), "world_size": self.world,
            "config": self.config.to_dict(), "array_config_json": canonical_json(array_config),
            "stores": {p: {"fingerprint": i.fingerprint.to_dict(), "num_sequences": i.num_sequences,
                           "num_tokens": i.num_tokens} for p, i in infos.items()},
            "splits": [{"name": s.name, "prefixes": list(s.prefixes), "dataset_keys": list(s.dataset_keys),
                        "blend_key": s.blend_key, "num_samples": s.num_samples} for s in plan.splits],
            "timings_rank0": dict(self.timings), "ranks": list(self.rank_seconds),
        }
        # in the plan's order, each entry dropped once written
        return self.cache.write_manifest(build_key, manifest, items=(held.pop(item.key) for item in plan.items))

    def _budgets(self) -> dict[str, dict[str, int]] | None:
        """The train split's token budgets by store, where the config gave budgets."""
        blend = self.config.blend_for_split(0)
        if blend is None or blend.budget_tokens is None:
            return None
        return {"train": dict(zip(blend.prefixes, blend.budget_tokens))}

    def _split_weights(self, plan: BuildPlan) -> dict[str, tuple[float, ...]]:
        out = {}
        for split in plan.splits:
            if split.blend_key is None:
                out[split.name] = (1.0,)
                continue
            weights = np.asarray(plan.item(split.blend_key).params["weights"], dtype=np.float64)
            out[split.name] = tuple((weights / weights.sum()).tolist())
        return out


class _BlendThread:
    """Builds blends on a thread while the main thread builds dataset items: this rank's own
    (stateless) blends, then its range of every divided (exact) blend, with the other ranks over
    the build's second group (:mod:`tokenloom.builder.divided`)."""

    def __init__(self, build: _Build, items: list[WorkItem], divided: list[WorkItem], plan: BuildPlan, packs,
                 records, poller) -> None:
        self.failure = None
        self._thread = threading.Thread(target=self._run, args=(build, items, divided, plan, packs, records, poller),
                                        name="tokenloom-blend", daemon=True)
        self._thread.start()

    def _run(self, build, items, divided, plan, packs, records, poller) -> None:
        for item in items:
            try:
                if build.before_item is not None:
                    build.before_item(item, build.rank)
                build._build_and_queue(item, packs, records, poller, lambda: None)
            except Exception as exc:
                self.failure = build._failed(exc, "build", item.label)
                break
        if not divided:
            return
        # every rank takes part in every divided blend: the collectives inside carry a failure
        # to all ranks instead of leaving them waiting
        context = DividedContext(group=build.blend_group, cache=build.cache, writer_of=build.writer_of,
                                 threads=build._blend_threads(), block=build.config.blend_block_samples,
                                 before_item=build.before_item)
        for item in divided:
            try:
                records[item.key] = build_divided_blend(context, item, plan.divided[item.key])
                poller.done_locally(item.key)
            except CollectiveBuildError as exc:  # already every rank's: pass the original on
                self.failure = self.failure or exc.failures[0]
                return
            except Exception as exc:
                self.failure = self.failure or build._failed(exc, "build", item.label)
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


class _ProgressPoller:
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


__all__ = ["build"]

