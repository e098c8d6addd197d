"""What one build shares between its phases, on one rank: :class:`BuildContext`.

The phases (:mod:`tokenloom.builder.phases`) are functions of this context: it holds the config,
the build's two groups, this rank's place in them, its cache, the caller's callbacks and the
timings, the state one phase hands to the next (the stores' infos, the best-fit chunks' counts,
each rank's writer, every rank's measured work, ...), and the helpers every phase uses (a rank's
failure, a phase's timing, the node layout, the cores a rank may use). Keeping these in one small
object lets each phase live in its own module without a class that holds them all.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from tokenloom.builder.cache import Cache
from tokenloom.builder.collective import failure_from, writers_by_node
from tokenloom.builder.config import BuildConfig
from tokenloom.builder.items import BuildPlan, GptItems, WorkItem
from tokenloom.builder.stores import FingerprintMemo, StoreInfo


class BuildContext:
    """One build on one rank: its inputs, the state its phases pass along, and their helpers."""

    def __init__(self, config: BuildConfig, group, blend_group, *,
                 on_progress: Callable[[int, int], None] | None = None,
                 on_plan: Callable[[BuildPlan, frozenset], None] | None = None,
                 before_item: Callable[[WorkItem, int], None] | None = None, dry_run: bool = False) -> None:
        self.config = config
        self.group = group
        self.blend_group = blend_group
        """The divided blends' own group, beside the items' (may be ``group`` itself)."""
        self.rank: int = group.rank
        self.world: int = group.world_size
        self.cache = Cache(config.cache_dir)
        self.on_progress = on_progress if group.rank == 0 else None
        self.on_plan = on_plan if group.rank == 0 else None
        self.before_item = before_item
        self.dry_run = dry_run
        """Plan only: nothing is written (the memo, the chunks and the items included)."""
        self.timings: dict[str, float] = {}
        # -- the state the phases pass along, in the order they set it
        self.start_key: str | None = None
        """The warm-start record's key (None: this config keeps no record)."""
        self.memo: FingerprintMemo | None = None
        """The fingerprint memo the fingerprint phase used (None: every store hashed)."""
        self.node_keys: list[tuple[str, str]] = []
        """Every rank's :func:`tokenloom.builder.collective.node_key`, by rank."""
        self.infos: dict[str, StoreInfo] | None = None
        """Every store's info, in the config's order (None on a warm start, which skips them)."""
        self.made: GptItems = {}
        """The dataset items the ranks made while fingerprinting, gathered."""
        self.pack_stats: dict[str, dict[str, int]] = {}
        """Every best-fit chunk's counts (``pack`` item key -> its stats), gathered."""
        self.packed: set[str] = set()
        """The chunks the pack phase built (on any rank)."""
        self.writer_of: dict[int, int] = {}
        """Each rank's writer: the rank that writes its cache directory."""
        self.from_record = False
        """The plan came from the warm-start record."""
        self.compiled_walk: bool | None = None
        """The build phase's choice of the compiled sample walk for this rank's ``gpt`` items."""
        self.rank_seconds: list[dict[str, Any]] = []
        """Every rank's predicted and measured work in the build phase."""
        self._cpu_mark = time.process_time()  # the first phase's CPU seconds count from here

    def failed(self, exc: BaseException, phase: str, item: str | None):
        """This rank's Failure in a phase that writes into the cache (a full disk names it)."""
        return failure_from(exc, rank=self.rank, phase=phase, item=item, folder=self.cache.root,
                            needed=self.cache.expected_bytes)

    def timed(self, phase: str, start: float) -> None:
        """Record the phase's wall seconds (``<phase>_s``) and this process's CPU seconds in it,
        every thread (``<phase>_cpu_s``), since the last call."""
        self.timings[f"{phase}_s"] = round(time.perf_counter() - start, 6)
        cpu = time.process_time()
        self.timings[f"{phase}_cpu_s"] = round(cpu - self._cpu_mark, 6)
        self._cpu_mark = cpu

    def nodes(self) -> tuple[dict[int, int], dict[int, int]]:
        """Each rank's writer (the rank that writes its cache directory) and the writers."""
        if self.config.shared_fs:
            return {rank: 0 for rank in range(self.world)}, {0: 0}
        by_key = writers_by_node(self.node_keys)
        nodes = {rank: by_key[key] for rank, key in enumerate(self.node_keys)}
        return nodes, {w: w for w in set(nodes.values())}

    def cores_per_rank(self) -> int:
        """This rank's share of its host's cores (at least 1)."""
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # pragma: no cover - not on Linux
            cores = os.cpu_count() or 1
        host = self.node_keys[self.rank][0] if self.node_keys else None
        ranks_here = sum(1 for key in self.node_keys if key[0] == host) if self.node_keys else 1
        return max(1, cores // max(1, ranks_here))

    def blend_threads(self) -> int:
        """Threads for an exact blend: the config's, or this rank's share of its host's cores."""
        if self.config.blend_threads:
            return self.config.blend_threads
        return self.cores_per_rank()


__all__ = ["BuildContext"]
