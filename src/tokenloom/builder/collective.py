"""The build's own collectives: a gloo group, statuses gathered before any barrier, no hangs.

The build never uses the job's default group for its traffic: it makes its own gloo group over
the same ranks (so it works under NCCL jobs, on CPU, with a timeout of its own). Every phase ends
with :func:`agree`: each rank contributes ``None`` or the failure it caught, all ranks gather
them, and if any rank failed every rank raises the same :class:`BuildError`, built from the
gathered list alone. A gather is one gloo gather on a root (a different rank each time) and one
broadcast from it, not gloo's ring all-gather, whose 2 (N - 1) dependent steps make each call's
latency grow with the ranks (:meth:`TorchGroup.all_gather_object`). A rank that died makes
the root's gather fail (gloo reports the closed connection); the root raises and closes the group,
so the ranks waiting for its broadcast fail too. A hung rank makes every rank fail at the group's
timeout. Survivors turn either into a BuildError.

Without torch (or outside a distributed job) :class:`LocalGroup` stands in with one rank.
"""

from __future__ import annotations

import gc
import logging
import os
import pickle
import socket
import threading
import time
import traceback
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from tokenloom.errors import BuildError, TokenloomError
from tokenloom.io.space import full_disk_error, is_full

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Failure:
    """What went wrong on one rank: enough to name the rank, the item and the cause."""

    rank: int
    """Rank in the build's group."""
    phase: str
    """``resolve``, ``fingerprint``, ``pack``, ``plan``, ``build``, ``transfer``, ``finalize``."""
    item: str | None
    """The item or store being worked on, or None."""
    error_type: str
    """Exception class name."""
    message: str
    """The exception's message."""
    for_users: bool = False
    """The exception is tokenloom's own (``tokenloom.errors``): its message is written for users."""

    def describe(self, ranks: int = 2) -> str:
        """The cause in the user's words first (a tokenloom error's message is written for them;
        any other names its type), then what was being done; the rank and the phase only where
        more than one rank ran (``ranks``)."""
        cause = self.message if self.for_users else f"{self.error_type}: {self.message}"
        if self.item and self.phase == "fingerprint":  # the item names the store, how it was found
            text = f"{self.item}: {cause}"
        elif self.item:
            doing = self.item if self.item.split()[0] in _ACTIVITIES else f"building {self.item}"
            text = f"{cause} (while {doing})"
        else:
            text = cause
        return text if ranks == 1 else f"{text} [rank {self.rank}, {self.phase} phase]"


_ACTIVITIES = frozenset({"publishing", "reading", "building", "writing", "tokenizing", "merging"})


class CollectiveBuildError(BuildError):
    """The BuildError :func:`agree` raises on every rank; ``failures`` are the ranks' own, so a
    caller that reports it again (a thread's failure joining a later phase) passes them on
    unchanged instead of wrapping the message."""

    def __init__(self, message: str, failures: list[Failure]) -> None:
        super().__init__(message)
        self.failures = failures


def failure_from(exc: BaseException, *, rank: int, phase: str, item: str | None, folder: str | None = None,
                 needed: int | None = None) -> Failure:
    """``exc`` as this rank's Failure. A full disk while writing into ``folder`` (the cache) becomes
    the StorageError that names the folder and the space (``needed``: what the build writes)."""
    if folder is not None and is_full(exc):
        what = item if item and item.split()[0] in _ACTIVITIES else f"the arrays of {item or 'the build'}"
        exc = full_disk_error(exc, folder, what.removeprefix("building "), needed=needed)
        item = None  # the message names it
    return Failure(rank=rank, phase=phase, item=item, error_type=type(exc).__name__, message=str(exc),
                   for_users=isinstance(exc, TokenloomError))


@dataclass
class Traffic:
    """What one rank's collectives cost: calls, bytes it contributed, seconds inside them (which
    include waiting for slower ranks)."""

    calls: int = 0
    bytes_sent: int = 0
    seconds: float = 0.0

    def add(self, other: Traffic) -> Traffic:
        return Traffic(self.calls + other.calls, self.bytes_sent + other.bytes_sent, self.seconds + other.seconds)


class LocalGroup:
    """One process: every collective is the identity."""

    rank = 0
    world_size = 1
    timeout_s = float("inf")

    def __init__(self) -> None:
        self.traffic = Traffic()

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def broadcast_bytes(self, data: bytes | None, src: int, size: int) -> bytes:
        return data if data is not None else b""

    def sibling(self) -> LocalGroup:
        """A second group over the same ranks: for one process, this one."""
        return self

    def barrier(self) -> None:
        pass

    def close(self) -> None:
        pass


_COLLECTOR_LOCK = threading.Lock()
_collector_holds = 0
_collector_was_enabled = False


@contextmanager
def collector_paused():
    """Python's cyclic garbage collector off for the block, back as it was when the last of
    several threads inside leaves (one thread's exit must not re-enable it under another)."""
    global _collector_holds, _collector_was_enabled
    with _COLLECTOR_LOCK:
        if _collector_holds == 0:
            _collector_was_enabled = gc.isenabled()
            gc.disable()
        _collector_holds += 1
    try:
        yield
    finally:
        with _COLLECTOR_LOCK:
            _collector_holds -= 1
            if _collector_holds == 0 and _collector_was_enabled:
                gc.enable()


SLOT_BYTES = 1024
"""Bytes each rank sends in the first round of a gather: its pickle's length and first bytes."""
TREE_WIDTH_BYTES = 1 << 22
"""The second round goes by gather and broadcast while ``width * ceil(log2(N))`` is at most this
(``width``: the longest pickle, to which every rank pads), else by gloo's ring all-gather. Of the
``N * width`` bytes of the round, the binomial broadcast sends all ``ceil(log2(N))`` times in turn
where the ring sends them once, but the ring waits for ``2 (N - 1)`` dependent steps. With ``L``
seconds a step and ``B`` bytes a second the tree is faster while ``width * log2(N) < 2 L B``. A
step is slow when the ranks do not arrive together, as in a build, where every rank is busy with
its own work between collectives: each of the ring's dependent steps waits for a rank that is
late, so ``L`` is large and the ring costs every rank CPU as well as time (BENCHMARKS.md, "Cluster
scale"). The bound, 4 MiB, is about ``2 L B`` for an assumed ``L`` = 200 us and ``B`` = 10 GB/s:
a width of 1 MB at 16 ranks, 400 kB at 1024, far above the build's payloads (the largest, the
gathered dataset items, grows with the stores a rank holds), so the ring is left to payloads
where its bytes per rank, which do not grow with ``N``, outweigh its steps."""


def _releasing_group(method):
    """A collective whose failure leaves no reference to the process group behind.

    torch's frames in a failed collective's traceback hold the group, in a reference cycle (its
    exception logger keeps the error), so until the cyclic collector happens to run, the group,
    and the connections that tell the ranks blocked on this one that it gave up, would outlive
    the :meth:`TorchGroup.close` of the caller's cleanup: those ranks would wait for this
    process's exit or their timeout. Clearing the frames lets close() release them at once."""

    def call(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except Exception as exc:
            traceback.clear_frames(exc.__traceback__)
            raise

    call.__name__, call.__doc__ = method.__name__, method.__doc__
    return call


class TorchGroup:
    """A gloo group of torch.distributed over the ranks of ``group`` (default: all ranks)."""

    def __init__(self, group=None, *, timeout_s: float) -> None:
        from datetime import timedelta

        import torch.distributed as dist

        self._dist = dist
        self.timeout_s = float(timeout_s)
        timeout = timedelta(seconds=self.timeout_s)
        parent = group if group is not None else dist.group.WORLD
        ranks = sorted(dist.get_process_group_ranks(parent))
        try:
            self.group = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout,
                                        use_local_synchronization=group is not None)
        except Exception as exc:  # pragma: no cover - depends on the job's setup
            raise BuildError(f"could not create the build's gloo group over ranks {ranks[:8]}...: {exc}") from exc
        self.ranks = ranks
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self._parent = group
        self.traffic = Traffic()
        """Calls, bytes this rank sent (pickled payloads; broadcasts it sourced) and seconds."""
        self._gathers = 0
        """Gathers so far: each has its own root, in turn (every rank counts the same calls)."""

    def sibling(self) -> TorchGroup:
        """Another gloo group over the same ranks (collective: every rank calls it), so two
        threads can run collectives at once, one group each."""
        return TorchGroup(self._parent, timeout_s=self.timeout_s)

    @_releasing_group
    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, by rank: pickled once, gathered on one rank and broadcast from it
        down a binomial tree, unpickled with the garbage collector paused. The root takes turns
        (group rank ``k mod N`` for the ``k``-th gather): it receives every rank's bytes and sends
        the most, work that grows with ``N`` while the others' does not, so no rank carries it
        on every call.

        The first round carries each rank's length and the first ``SLOT_BYTES - 8`` bytes of its
        pickle, which is all of it for most calls (an agreement with no failure and a small
        payload). When a pickle is longer, a second round carries every pickle whole, padded to
        the longest: gathered and broadcast again while that is cheaper
        (:data:`TREE_WIDTH_BYTES`), else by gloo's ring all-gather, which moves large payloads
        with no rank sending more than its share.

        gloo's all-gather is a ring of ``2 (N - 1)`` dependent steps, so its latency grows
        linearly with the ranks, as does each rank's CPU (a send and a receive every step); a
        gather is one step and the broadcast ``log2 N`` (BENCHMARKS.md, "Cluster scale").
        Unpickling with the collector paused matters as much for large payloads: thousands of
        unpickled items trigger collections that each walk everything the rank holds, a cost that
        grows with the heap, not the payload."""
        import numpy as np

        started = time.perf_counter()
        root = self._gathers % self.world_size
        self._gathers += 1
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        head = SLOT_BYTES - 8
        slot = np.zeros(SLOT_BYTES, dtype=np.uint8)
        slot[:8] = np.frombuffer(len(data).to_bytes(8, "little"), dtype=np.uint8)
        first = min(len(data), head)
        slot[8:8 + first] = np.frombuffer(data, dtype=np.uint8, count=first)
        table = self._gather_to_all(slot, root).reshape(self.world_size, SLOT_BYTES)
        lengths = table[:, :8].copy().view("<i8").ravel().tolist()
        width = max(lengths)
        if width > head:  # a second round: every pickle whole, padded to the longest
            mine = np.zeros(width, dtype=np.uint8)
            mine[:len(data)] = np.frombuffer(data, dtype=np.uint8)
            if width * (self.world_size - 1).bit_length() <= TREE_WIDTH_BYTES:
                table = self._gather_to_all(mine, root)
            else:
                table = self._ring_gather(mine)
            table, offset = table.reshape(self.world_size, width), 0
        else:
            offset = 8
        with collector_paused():
            out = [pickle.loads(table[r, offset:offset + n]) for r, n in enumerate(lengths)]
        self._count(len(data), started)
        return out

    def _gather_to_all(self, mine, root: int):
        """Every rank's equal-sized uint8 array ``mine``, concatenated by rank, on every rank: one
        gloo gather on group rank ``root``, then one broadcast from it."""
        import torch

        size = mine.size
        everything = torch.empty(size * self.world_size, dtype=torch.uint8)
        parts = list(everything.view(self.world_size, size)) if self.rank == root else None
        self._dist.gather(torch.from_numpy(mine), gather_list=parts, dst=self.ranks[root], group=self.group)
        self._dist.broadcast(everything, src=self.ranks[root], group=self.group)
        return everything.numpy()

    def _ring_gather(self, mine):
        """Every rank's equal-sized uint8 array ``mine``, concatenated by rank: gloo's ring."""
        import torch

        gather_into = getattr(self._dist, "all_gather_single", None) or self._dist.all_gather_into_tensor
        everything = torch.empty(mine.size * self.world_size, dtype=torch.uint8)
        gather_into(everything, torch.from_numpy(mine), group=self.group)
        return everything.numpy()

    def _count(self, nbytes: int, started: float) -> None:
        self.traffic.calls += 1
        self.traffic.bytes_sent += nbytes
        self.traffic.seconds += time.perf_counter() - started

    @_releasing_group
    def broadcast_bytes(self, data: bytes | None, src: int, size: int) -> bytes:
        """``size`` bytes from group rank ``src`` to every rank (``data`` is read on ``src``)."""
        import numpy as np
        import torch

        started = time.perf_counter()
        if self.rank == src:
            tensor = torch.from_numpy(np.frombuffer(bytearray(data), dtype=np.uint8))
        else:
            tensor = torch.empty(size, dtype=torch.uint8)
        self._dist.broadcast(tensor, src=self.ranks[src], group=self.group)
        self._count(size if self.rank == src else 0, started)
        return tensor.numpy().tobytes()

    def barrier(self) -> None:
        # a gather of nothing: completes only when every rank arrives, fails on a dead rank
        self.all_gather_object(None)

    def close(self) -> None:
        """Destroy the group and drop it: the last reference gone, gloo closes its connections,
        so a peer blocked on this rank fails at once instead of at its timeout or this process's
        exit (gloo's shutdown alone leaves them open)."""
        if self.group is None:
            return
        try:
            self._dist.destroy_process_group(self.group)
        except Exception:  # pragma: no cover - best effort on teardown
            pass
        self.group = None


def open_group(group=None, *, timeout_s: float):
    """The build's group: a gloo group over ``group``'s ranks, over the initialised default group,
    or :class:`LocalGroup` when torch.distributed is not in use. Returns ``(group, owned)`` where
    ``owned`` says this call initialised torch.distributed (from torchrun's environment) and the
    caller must destroy it."""
    owned = False
    if group is None and _dist_if_initialized() is None:
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return LocalGroup(), False
        from datetime import timedelta

        import torch.distributed as dist

        dist.init_process_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        owned = True
    import torch.distributed as dist

    if dist.get_world_size(group) == 1:
        return LocalGroup(), owned
    return TorchGroup(group, timeout_s=timeout_s), owned


def _dist_if_initialized():
    import sys

    if "torch.distributed" not in sys.modules:
        return None  # nobody imported torch.distributed, so no group can exist
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def gather(group, obj: Any, *, phase: str) -> list[Any]:
    """``all_gather_object`` that turns a broken group (a dead or hung rank) into a BuildError."""
    try:
        return group.all_gather_object(obj)
    except TokenloomError:
        raise
    except Exception as exc:
        detail = str(exc).splitlines()[0] if str(exc) else ""
        lowered = detail.lower()
        if "timed out" in lowered or isinstance(exc, TimeoutError):
            what = f"the other ranks did not answer in the {phase} phase within {group.timeout_s:g} s"
        elif any(word in lowered for word in ("closed", "reset", "broken pipe", "refused")):
            # a peer's process ended: the gather failed at once, not at the timeout
            what = f"the build's group broke in the {phase} phase (a peer's connection closed)"
        else:
            what = f"the build's gather failed in the {phase} phase"
        raise BuildError(
            f"{what[0].upper()}{what[1:]} ({type(exc).__name__}: {detail}); a rank was killed or hung. Rerun the "
            f"build: finished items are reused from the cache [rank {group.rank}]"
        ) from exc


def agree(group, failure: Failure | None, *, phase: str, payload: Any = None) -> list[Any]:
    """Gather every rank's ``(failure, payload)``; if any rank failed, raise the same BuildError
    on every rank. Returns the payloads, by rank."""
    statuses = gather(group, (failure, payload), phase=phase)
    failures = sorted({f for f, _ in statuses if f is not None}, key=lambda f: (f.rank, f.describe()))
    if failures:
        ranks = len(statuses)
        first = failures[0]
        more = "" if len(failures) == 1 else f" (and {len(failures) - 1} more: " + "; ".join(
            f.describe(ranks) for f in failures[1:4]) + ("; ..." if len(failures) > 4 else "") + ")"
        raise CollectiveBuildError(first.describe(ranks) + more, failures)
    return [p for _, p in statuses]


def node_key(cache_dir: str) -> tuple[str, str]:
    """Ranks with equal keys see the same cache directory (same host, same resolved path)."""
    return (socket.gethostname(), os.path.realpath(cache_dir))


def writers_by_node(keys: Sequence[tuple[str, str]]) -> dict[tuple[str, str], int]:
    """The lowest rank of each node key: the one that writes shared files there."""
    writers: dict[tuple[str, str], int] = {}
    for rank, key in enumerate(keys):
        writers.setdefault(key, rank)
    return writers


__all__ = [
    "CollectiveBuildError",
    "Failure",
    "LocalGroup",
    "TorchGroup",
    "Traffic",
    "agree",
    "failure_from",
    "gather",
    "node_key",
    "open_group",
    "writers_by_node",
]
