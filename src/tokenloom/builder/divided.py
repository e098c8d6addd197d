"""An exact blend built by every rank: a range of positions each, written in place, hashed by block.

The train blend of a large exact build is its longest item (3.55e9 positions and 33 GiB at 5e12
tokens). Here every rank of the build computes a contiguous range of its positions and writes
them straight into their place in one file:

1. **Prepare.** The writer of each node (the lowest rank that sees that node's cache directory;
   one writer with a shared filesystem) takes the item's lock, creates the pack file in ``tmp/``
   at its final size with both arrays' ``.npy`` headers, and tells the other ranks its name.
2. **Compute.** Rank ``r`` runs megatron's greedy over positions ``[bounds[r], bounds[r + 1])``
   from a guessed start state, on its threads (:class:`~tokenloom.index.megatron_blend.MegatronGreedy`),
   one block of ``blend_block_samples`` positions at a time, each written in place (``os.pwrite``)
   as soon as it is computed: a rank holds one block of both arrays and the counts each block
   started from, never its whole range.
3. **Settle.** The ranks gather every range's start and end state; a range whose start was not
   the end of the range before is repaired from it (block by block: read back, replayed with
   ``MegatronGreedy.repair`` against the state the block was computed from, written again, until
   the runs meet), round after round until
   consecutive ranges agree. The arrays are then megatron-core's, byte for byte, for any number
   of ranks (the guess only decides how much is replayed).
4. **Hash.** Each rank reads its blocks back, hashes each, and syncs. Without a shared
   filesystem each block also travels over the build's group to every other node's writer.
5. **Publish.** The writer records the arrays' block hashes (their SHA-256 is the hash of the
   header's and the blocks' hashes: FORMAT.md, "Divided blends"), renames the file into
   ``packs/`` and writes the pack index last. Until then nothing refers to the file, so an
   interrupted build leaves no pack that looks valid; a failure on any rank removes it.

A schedule's blend (exact mode, several ``phases``) is divided the same way, its phases'
greedies laid end to end as one run (:class:`~tokenloom.index.schedule_exact.ScheduleGreedy`):
a rank's windows are its blocks cut again where a phase starts, whose state is exactly zero
(so a range crossing a phase boundary needs no guess there, and settling stops at it), and it
writes each greedy's raw ids and sample numbers, which a repair replays. After settling, the
ranks gather each phase's final counts from the rank that ended it, and step 4 makes each block
final before hashing it: the split's ids and the samples numbered on across phases (the
offsets), byte for byte :func:`~tokenloom.builder.exact.build_schedule_arrays`.

Every step ends with :func:`~tokenloom.builder.collective.agree`: a failure anywhere raises the
same BuildError on every rank, and a killed rank makes the others fail within the group timeout.
"""

from __future__ import annotations

import hashlib
import io
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from tokenloom.builder.cache import Cache, host_record
from tokenloom.builder.collective import agree, failure_from
from tokenloom.builder.exact import check_schedule_draws, schedule_greedy
from tokenloom.builder.items import WorkItem
from tokenloom.builder.packs import ALIGNMENT, CACHE_FORMAT_VERSION, PACKS_DIR, TMP_DIR, root_digest, write_pack_index
from tokenloom.errors import BuildError
from tokenloom.index.megatron_blend import MegatronGreedy, RangeRun, ranges_settled
from tokenloom.index.schedule_exact import ScheduleGreedy, phase_offsets
from tokenloom.io.writer import fsync_dir

#: The two arrays of a blend, in pack order, and the dtype of the second (the first is
#: megatron's dataset-id dtype: int16, int32 beyond 32766 datasets).
ARRAY_NAMES = ("dataset_index", "dataset_sample_index")


def npy_header_for(shape: tuple[int, ...], dtype: np.dtype) -> bytes:
    """The .npy header ``numpy.save`` writes for a C-ordered array of ``shape`` and ``dtype``."""
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buffer, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False,
                 "shape": tuple(shape)})
    return buffer.getvalue()


@dataclass(frozen=True, kw_only=True)
class ArraySlot:
    """Where one array of a divided blend lies in its pack."""

    name: str
    dtype: np.dtype
    size: int
    """Elements (the blend's positions)."""
    offset: int
    """Byte offset of the .npy image (header first)."""
    header: bytes
    """The .npy header."""

    @property
    def data_offset(self) -> int:
        return self.offset + len(self.header)

    @property
    def nbytes(self) -> int:
        """Bytes of the .npy image."""
        return len(self.header) + self.size * self.dtype.itemsize


def pack_layout(size: int, id_dtype: np.dtype) -> tuple[list[ArraySlot], int]:
    """The two arrays' slots in a pack holding only this blend, and the pack's size; every rank
    computes the same layout from the blend's size alone."""
    slots, offset = [], 0
    for name, dtype in zip(ARRAY_NAMES, (np.dtype(id_dtype), np.dtype(np.int64))):
        offset += -offset % ALIGNMENT
        header = npy_header_for((size,), dtype)
        slot = ArraySlot(name=name, dtype=dtype, size=size, offset=offset, header=header)
        slots.append(slot)
        offset += slot.nbytes
    return slots, offset


def block_digests(data: np.ndarray, block: int) -> list[str]:
    """SHA-256 of each run of ``block`` elements of ``data`` (the last may be shorter)."""
    view = data.reshape(-1)
    return [hashlib.sha256(memoryview(view[k:k + block]).cast("B")).hexdigest() for k in range(0, view.shape[0], block)]


@dataclass
class DividedContext:
    """What a rank needs to build its part of divided blends (set up by the runner)."""

    group: Any
    """The build's collective group for blends (gloo, or LocalGroup for one rank)."""
    cache: Cache
    writer_of: dict[int, int]
    """Rank -> the rank that writes its node's files (itself for a writer)."""
    threads: int
    """Threads of this rank's greedy."""
    block: int
    """Positions per hash block; every range but the last of a blend is whole blocks."""
    before_item: Callable[[WorkItem, int], None] | None = None


def build_divided_blend(ctx: DividedContext, item: WorkItem, bounds: tuple[int, ...]) -> dict[str, Any]:
    """Build blend ``item`` with every rank of ``ctx.group`` (each calls this, in the same order
    of items); returns the item's published record (the same on every rank)."""
    group, rank = ctx.group, ctx.group.rank
    params = item.params
    started = time.perf_counter()
    weights = np.asarray(params["weights"], dtype=np.float64)
    exhaustive = params["size"] is None  # weights are then the datasets' sizes
    size = int(sum(params["weights"])) if exhaustive else int(params["size"])
    if "schedule" in params:  # its phases' greedies' sizes, the last megatron-sized (not the plan's size)
        size = item.num_samples
    writer = ctx.writer_of[rank]
    writers = sorted(set(ctx.writer_of.values()))

    # 1. prepare: the node writers lock the item and make the file
    failure, skip, token, tmp = None, False, None, None
    greedy = slots = total = None
    try:
        if ctx.before_item is not None:
            ctx.before_item(item, rank)
        if "schedule" in params:
            greedy = schedule_greedy(params)
            if greedy.size != size:
                raise BuildError(f"{item.label}: the schedule's greedies make {greedy.size} positions, the item "
                                 f"{size}; the cache entry was made by another version: build again")
        else:
            greedy = MegatronGreedy.for_sizes(params["weights"]) if exhaustive else MegatronGreedy.for_weights(weights)
        slots, total = pack_layout(size, greedy.dataset_id_dtype)
        if rank == writer:
            token = ctx.cache.acquire(item.key)
            # always listed again (one item, the largest): not built twice for want of a listing
            if ctx.cache.has(item.key):
                skip = True  # another job published it while we waited for the lock
            else:
                ctx.cache.ensure()
                tmp = os.path.join(ctx.cache.root, TMP_DIR, f"{item.key[:20]}-{uuid.uuid4().hex[:12]}.bin")
                with open(tmp, "wb") as f:
                    f.truncate(total)
                    for slot in slots:
                        f.seek(slot.offset)
                        f.write(slot.header)
    except Exception as exc:
        failure = failure_from(exc, rank=rank, phase="build", item=item.label, folder=ctx.cache.root,
                                       needed=ctx.cache.expected_bytes)
    try:
        prepared = agree(group, failure, phase="build", payload=(skip, tmp))
        if all(prepared[w][0] for w in writers):
            return ctx.cache.read_record(item.key)
        if any(prepared[w][0] for w in writers):  # pragma: no cover - needs two jobs racing on some nodes only
            raise BuildError(f"{item.label}: another job published it on some nodes only while this build waited; "
                             "rerun the build: finished items are reused")
        path = prepared[writer][1]
        published = _compute_and_write(ctx, item, bounds, greedy, slots, path, prepared, writers, started)
    except BaseException:
        if tmp is not None:
            _remove(tmp)
        raise
    finally:
        if token is not None:
            ctx.cache.release(token)
    return published


def _compute_and_write(ctx: DividedContext, item: WorkItem, bounds, greedy: MegatronGreedy | ScheduleGreedy, slots,
                       path: str, prepared, writers: list[int], started: float) -> dict[str, Any]:
    """Steps 2-5 for this rank's range, one block of positions at a time: a rank holds one block of
    both arrays (``blend_block_samples`` positions, 10 MiB at the default), never its whole range,
    and keeps the greedy's state at each window's start and end to repair windows from. A
    schedule's windows are the blocks cut again at its phases' starts, where its greedy starts
    afresh (so one window is one phase's), and its blocks are written raw until step 4."""
    group, rank = ctx.group, ctx.group.rank
    a, b = bounds[rank], bounds[rank + 1]
    blocks = [(w, min(w + ctx.block, b)) for w in range(a, b, ctx.block)]  # whole hash blocks
    windows = _windows(blocks, greedy.restarts)
    buffers = (np.empty(min(ctx.block, b - a), dtype=slots[0].dtype), np.empty(min(ctx.block, b - a), dtype=np.int64))
    states: list[np.ndarray] = []  # the state each window's recorded steps started from
    ends: list[np.ndarray] = []  # ... and the state they ended in
    schedule = isinstance(greedy, ScheduleGreedy)
    fd = None
    try:
        # 2. compute this rank's range from a guessed start, window by window, writing each in place
        failure = run = None
        try:
            fd = os.open(path, os.O_RDWR)
            counts = greedy.guess(a)
            start_counts = counts.copy()
            for w0, w1 in windows:
                counts = greedy.carry(w0, counts)
                states.append(counts)
                out_dataset, out_sample = buffers[0][:w1 - w0], buffers[1][:w1 - w0]
                counts = greedy.fill(w0, w1, out_dataset, out_sample, counts=counts, threads=ctx.threads).end_counts
                ends.append(counts)
                _write_block(fd, slots, w0, (out_dataset, out_sample))
            run = RangeRun(start_counts, counts)
        except Exception as exc:
            failure = failure_from(exc, rank=rank, phase="build", item=item.label, folder=ctx.cache.root,
                                       needed=ctx.cache.expected_bytes)
        payload = None if run is None else (run.start_counts, run.end_counts)
        runs = [RangeRun(np.asarray(s), np.asarray(e))
                for s, e in agree(group, failure, phase="build", payload=payload)]
        # 3. settle: repair each range from the end of the range before, until they agree
        rounds = 0
        while not ranges_settled(runs, _true_starts(greedy, bounds, runs)):
            failure = None
            try:
                true_start = _true_starts(greedy, bounds, runs)[rank]
                end = _repair_blocks(greedy, fd, slots, windows, states, ends, true_start, buffers)
                run = RangeRun(np.array(true_start, dtype=np.int64), runs[rank].end_counts if end is None else end)
            except Exception as exc:
                failure = failure_from(exc, rank=rank, phase="build", item=item.label, folder=ctx.cache.root,
                                       needed=ctx.cache.expected_bytes)
            runs = [RangeRun(np.asarray(s), np.asarray(e)) for s, e in
                    agree(group, failure, phase="build",
                          payload=None if failure else (run.start_counts, run.end_counts))]
            rounds += 1
            if rounds > group.world_size:  # pragma: no cover - each round settles at least one more range
                raise BuildError(f"{item.label}: the ranges did not settle in {group.world_size} rounds; this is a bug")
        offsets = None
        if schedule:
            offsets = _schedule_offsets(ctx, item, greedy, windows, ends)
            check_schedule_draws(offsets, greedy.split_ids, greedy.run_start, item.params["dataset_lengths"])
        else:
            counts = runs[-1].end_counts  # (D,) samples the blend draws from each dataset
            lengths = np.asarray(item.params["dataset_lengths"], dtype=np.int64)
            over = np.flatnonzero(counts > lengths)
            if over.size:
                d = int(over[0])
                raise BuildError(f"the blend asks {int(counts[d])} samples of dataset {d}, whose index holds only "
                                 f"{int(lengths[d])}; raise mid_level_dataset_surplus (megatron-core fails here too)")
        # 4. hash the range's blocks as written (a schedule's first made final: its ids over the split's
        # stores and its samples numbered on), and send them to the writers of other nodes
        failure, digests = None, None
        try:
            digests = [[], []]
            state_at = dict(zip((w0 for w0, _ in windows), states))  # every block starts a window
            for w0, w1 in blocks:
                data = _read_block(fd, slots, w0, w1, buffers)
                if schedule and greedy.finish(w0, w1, *data, state_at[w0], offsets):
                    _write_block(fd, slots, w0, data)
                for k, array in enumerate(data):
                    digests[k] += block_digests(array, ctx.block)
            os.fsync(fd)
        except Exception as exc:
            failure = failure_from(exc, rank=rank, phase="build", item=item.label, folder=ctx.cache.root,
                                       needed=ctx.cache.expected_bytes)
    finally:
        if fd is not None:
            os.close(fd)
    gathered = agree(group, failure, phase="build", payload=digests)
    if len(writers) > 1:
        _send_ranges(ctx, item, bounds, slots, path, buffers)
    # 5. publish: the writers record the hashes, rename the file and write the pack index
    record, failure = None, None
    if rank in writers:
        try:
            record = _publish(ctx, item, bounds, slots, path, gathered, rounds, started)
        except Exception as exc:
            failure = failure_from(exc, rank=rank, phase="build", item=item.label, folder=ctx.cache.root,
                                       needed=ctx.cache.expected_bytes)
    records = agree(group, failure, phase="build", payload=record)
    return records[ctx.writer_of[rank]]


def _windows(blocks: list[tuple[int, int]], restarts: tuple[int, ...]) -> list[tuple[int, int]]:
    """The hash blocks cut again at the greedy's ``restarts``: one window never spans a restart."""
    out = []
    for w0, w1 in blocks:
        for cut in restarts:
            if w0 < cut < w1:
                out.append((w0, cut))
                w0 = cut
        out.append((w0, w1))
    return out


def _true_starts(greedy, bounds, runs: list[RangeRun]) -> list[np.ndarray]:
    """The state each rank's range must start from, given the ranges before it: the exact state at
    position 0 for the first, else what the range before ended in, carried over its end (a schedule's phase
    starts afresh)."""
    return [greedy.guess(0) if r == 0 else greedy.carry(bounds[r], runs[r - 1].end_counts) for r in range(len(runs))]


def _schedule_offsets(ctx: DividedContext, item: WorkItem, greedy: ScheduleGreedy, windows, ends) -> np.ndarray:
    """``(P + 1, D)`` the schedule's offsets, the same on every rank: each phase's final counts come
    from the rank whose range holds the phase's last position (its window ending there, settled)."""
    group, rank = ctx.group, ctx.group.rank
    failure, finished = None, None
    try:
        phase_at_end = {end: k for k, end in enumerate(greedy.phase_ends)}
        finished = {phase_at_end[w1]: ends[j] for j, (_, w1) in enumerate(windows) if w1 in phase_at_end}
    except Exception as exc:  # pragma: no cover - dictionaries of states in memory
        failure = failure_from(exc, rank=rank, phase="build", item=item.label, folder=ctx.cache.root,
                               needed=ctx.cache.expected_bytes)
    end_states = {}
    for part in agree(group, failure, phase="build", payload=finished):
        end_states.update(part)
    missing = sorted(set(range(len(greedy.phases))) - set(end_states))
    if missing:  # pragma: no cover - every phase's last position lies in one rank's range
        raise BuildError(f"{item.label}: no rank ended phase {missing[0] + 1}; this is a bug")
    return phase_offsets(greedy.phase_counts(end_states))


def _repair_blocks(greedy, fd: int, slots, windows, states: list[np.ndarray], ends: list[np.ndarray],
                   true_start: np.ndarray, buffers) -> np.ndarray | None:
    """Make the range megatron's steps from ``true_start``, window by window: each is repaired
    from the true state at its start (``repair`` against the state it was recorded from) until a
    window's true and recorded states meet, after which the rest of the range is already right
    (a schedule's meet at the next phase's start at the latest). ``states`` and ``ends`` are
    updated to what the windows now hold. Returns the range's new end state, or None when it is
    unchanged."""
    counts = np.array(true_start, dtype=np.int64)
    for k, (w0, w1) in enumerate(windows):
        counts = greedy.carry(w0, counts)
        if np.array_equal(counts, states[k]):
            return None  # the runs meet at this window's start: from here the recorded run is the true one
        out_dataset, out_sample = _read_block(fd, slots, w0, w1, buffers)
        end = greedy.repair(w0, w1, counts, states[k], out_dataset, out_sample)
        _write_block(fd, slots, w0, (out_dataset, out_sample))
        states[k] = counts
        if end is None:
            return None  # they met inside this window
        ends[k] = counts = end
    return counts


def _write_block(fd: int, slots, first: int, arrays) -> None:
    """Positions ``first ..`` of both arrays, written at their offsets in the pack file."""
    for slot, data in zip(slots, arrays):
        view = memoryview(np.ascontiguousarray(data)).cast("B")
        offset = slot.data_offset + first * slot.dtype.itemsize
        while view:
            written = os.pwrite(fd, view, offset)
            view, offset = view[written:], offset + written


def _read_block(fd: int, slots, first: int, stop: int, buffers) -> tuple[np.ndarray, np.ndarray]:
    """Positions ``first .. stop`` of both arrays from the pack file, into ``buffers``."""
    out = []
    for slot, buffer in zip(slots, buffers):
        data = buffer[:stop - first]
        view = memoryview(data).cast("B")
        offset = slot.data_offset + first * slot.dtype.itemsize
        while view:
            got = os.preadv(fd, [view], offset)
            if got == 0:
                raise BuildError(f"the blend's pack file ends before position {stop} of its {slot.name}; was it "
                                 "truncated while the build ran? Rerun the build")
            view, offset = view[got:], offset + got
        out.append(data)
    return out[0], out[1]


def _send_ranges(ctx: DividedContext, item: WorkItem, bounds, slots, path: str, buffers) -> None:
    """Without a shared filesystem: every rank's range to the writers of the other nodes, a block
    at a time (each rank reads its blocks back from its node's file). The ranks agree after each
    source's range: a rank that fails still takes part in every broadcast (a source that cannot
    read sends zeros), so the agreement carries its failure to every rank."""
    group, rank = ctx.group, ctx.group.rank
    receiving = rank == ctx.writer_of[rank]
    fd, failure = None, None
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as exc:
        failure = failure_from(exc, rank=rank, phase="transfer", item=item.label, folder=ctx.cache.root,
                                       needed=ctx.cache.expected_bytes)
    try:
        for source in range(group.world_size):
            for w0 in range(bounds[source], bounds[source + 1], ctx.block):
                w1 = min(w0 + ctx.block, bounds[source + 1])
                nbytes = [(w1 - w0) * slot.dtype.itemsize for slot in slots]
                blob = None
                if rank == source:
                    blob = bytes(sum(nbytes))
                    if failure is None:
                        try:
                            blob = b"".join(memoryview(a).cast("B").tobytes()
                                            for a in _read_block(fd, slots, w0, w1, buffers))
                        except Exception as exc:
                            failure = failure_from(exc, rank=rank, phase="transfer", item=item.label,
                                                   folder=ctx.cache.root,
                                       needed=ctx.cache.expected_bytes)
                try:
                    data = group.broadcast_bytes(blob, source, sum(nbytes))
                except Exception as exc:
                    raise BuildError(
                        f"rank {rank}: the process group failed while receiving positions {w0}..{w1} of "
                        f"{item.label} from rank {source} ({type(exc).__name__}: {exc}); a rank was killed or "
                        "hung. Rerun the build: finished items are reused") from exc
                if receiving and ctx.writer_of[source] != rank and failure is None:
                    try:
                        split = nbytes[0]
                        _write_block(fd, slots, w0, (np.frombuffer(data[:split], dtype=slots[0].dtype),
                                                     np.frombuffer(data[split:], dtype=slots[1].dtype)))
                    except Exception as exc:
                        failure = failure_from(exc, rank=rank, phase="transfer", item=item.label, folder=ctx.cache.root,
                                       needed=ctx.cache.expected_bytes)
            if source == group.world_size - 1 and receiving and failure is None:
                try:
                    os.fsync(fd)
                except OSError as exc:
                    failure = failure_from(exc, rank=rank, phase="transfer", item=item.label, folder=ctx.cache.root,
                                       needed=ctx.cache.expected_bytes)
            agree(group, failure, phase="transfer")
    finally:
        if fd is not None:
            os.close(fd)


def _publish(ctx: DividedContext, item: WorkItem, bounds, slots, path: str, gathered, rounds: int,
             started: float) -> dict[str, Any]:
    files = {}
    for k, slot in enumerate(slots):
        blocks = [digest for rank_digests in gathered for digest in rank_digests[k]]
        header_sha256 = hashlib.sha256(slot.header).hexdigest()
        files[f"{slot.name}.npy"] = {
            "offset": slot.offset, "data_offset": slot.data_offset, "bytes": slot.nbytes,
            "sha256": root_digest(header_sha256, blocks), "hash": "sha256-blocks",
            "block_bytes": ctx.block * slot.dtype.itemsize, "header_sha256": header_sha256, "blocks": blocks,
            "dtype": slot.dtype.str, "shape": [slot.size],
        }
    name = f"{time.strftime('%Y%m%dT%H%M%S')}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    final = os.path.join(ctx.cache.root, PACKS_DIR, f"{name}.bin")
    os.rename(path, final)
    fsync_dir(os.path.dirname(final))
    record = {
        "kind": item.kind, "label": item.label, "split": item.split, "params": dict(item.params),
        "num_samples": item.num_samples,
        "built_by": {"rank": ctx.group.rank, "ranks": list(range(ctx.group.world_size)), "bounds": list(bounds),
                     "settle_rounds": rounds, **host_record()},
        "seconds": round(time.perf_counter() - started, 6), "threads": ctx.threads,
        "megatron_md5": None if item.megatron is None else item.megatron.md5,
        "key": item.key, "format": CACHE_FORMAT_VERSION, "files": files, "pack": name,
    }
    write_pack_index(ctx.cache.root, name, {item.key: record})
    ctx.cache.refresh()
    return record


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


__all__ = ["ARRAY_NAMES", "ArraySlot", "DividedContext", "block_digests", "build_divided_blend", "npy_header_for",
           "pack_layout"]
