"""Exact-mode items: megatron-core's arrays, with the RandomState draws started early.

A ``gpt`` item's arrays come from three steps: the document shuffle and the sample shuffle draw
from one ``RandomState(seed)`` (in that order) and depend only on sizes known from the plan; the
sample walk needs the shuffled document index. :class:`ShuffleDrawer` runs the draws of this
rank's items in background processes, a couple of items ahead, while the main process walks the
previous item; both orders of work give the same arrays as megatron-core's single thread.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import pickle
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

from tokenloom.builder.schedule import run_counts, schedule_columns, schedule_plan_of
from tokenloom.errors import BuildError
from tokenloom.index.epochs import EpochPlan, plan_epochs, plan_run_epochs
from tokenloom.index.megatron_blend import megatron_blend, megatron_dataset_id_dtype, megatron_exhaustive_blend
from tokenloom.index.megatron_gpt import build_document_index, build_sample_index, build_shuffle_index
from tokenloom.index.megatron_runs import build_run_sample_index, build_run_shuffle_index, build_run_stream
from tokenloom.index.schedule_exact import (
    ScheduleGreedy,
    exact_phase_blends,
    plan_exact_phases,
    run_draws,
    split_tables,
)
from tokenloom.index.split import DocumentRange, document_ids
from tokenloom.io import IndexedDataset

#: Items each background process may run ahead of the walks (bounds the memory held in flight).
LOOKAHEAD_PER_WORKER = 2
#: Document positions below which the sample walk uses the numpy kernel (identical arrays); a
#: rank whose items hold more positions in all compiles the numba walk for every item.
SMALL_WALK_POSITIONS = 1 << 20
#: Blend sizes below which the blend runs uncompiled (identical arrays, no JIT start-up).
SMALL_BLEND_SAMPLES = 4_000


def plan_gpt(store: IndexedDataset, params: Mapping[str, Any]) -> EpochPlan:
    """The epoch plan of a ``gpt`` item (megatron-core's arithmetic; a length run's, for a run)."""
    ids = document_ids(DocumentRange(params["begin"], params["end"]))
    if "first_token" in params:
        tokens = int(np.asarray(store.sequence_lengths[params["begin"]:params["end"]]).sum(dtype=np.int64))
        return plan_run_epochs(tokens, ids.shape[0], first_token=params["first_token"],
                               num_samples=params["num_samples"], seq_length=params["seq_length"],
                               add_extra_token=params["add_extra_token"])
    return plan_epochs(store.sequence_lengths, ids, num_samples=params["num_samples"],
                       seq_length=params["seq_length"], add_extra_token=params["add_extra_token"],
                       drop_last_partial=params["drop_last_partial"])


def draw_shuffles(prefix: str, params: Mapping[str, Any], store: IndexedDataset | None = None,
                  plan: EpochPlan | None = None) -> tuple[EpochPlan, np.ndarray, np.ndarray]:
    """The item's RandomState work: ``(plan, document_index, shuffle_index)``. ``store``: the
    store at ``prefix`` if the caller has it open; ``plan``: the item's epoch plan if the caller
    made it (the build plans every item from its store's token counts; planning again here sums
    the lengths of every document of the split).

    The shuffle index is drawn after the document index from the same RandomState, exactly as
    megatron-core does; its length is known from the plan before any walk.
    """
    if plan is None:
        plan = plan_gpt(IndexedDataset(prefix) if store is None else store, params)
    random_state = np.random.RandomState(params["seed"])
    ids = document_ids(DocumentRange(params["begin"], params["end"]))
    if "first_token" in params:  # a length run: its store's whole stream, then its own shuffle
        stream = build_run_stream(ids, plan, params["stream_epochs"], random_state)  # (epochs * docs,) int32
        return plan, stream, build_run_shuffle_index(plan.num_samples_in_index, seed=params["seed"],
                                                     first_token=params["first_token"])
    document_index = build_document_index(ids, plan, random_state)  # (epochs * docs,) int32
    shuffle_index = build_shuffle_index(plan, plan.num_samples_in_index, random_state)  # (S,)
    return plan, document_index, shuffle_index


def build_gpt_arrays(prefix: str, params: Mapping[str, Any],
                     draws: tuple[EpochPlan, np.ndarray, np.ndarray] | None = None, *,
                     plan: EpochPlan | None = None,
                     compiled: bool | None = None) -> tuple[dict[str, np.ndarray], EpochPlan]:
    """The three arrays of a ``gpt`` item (drawing the shuffles here if ``draws`` is None, from
    ``plan`` if given: see :func:`draw_shuffles`).

    ``compiled`` picks the numba sample walk (True) or the numpy one (False; identical arrays);
    None decides by the item's size. A rank with much work compiles once and gains on every item.
    """
    store = IndexedDataset(prefix)
    if draws is None:
        draws = draw_shuffles(prefix, params, store, plan)
    plan, document_index, shuffle_index = draws
    lengths = store.sequence_lengths
    if document_index.shape[0] * 2 > lengths.shape[0]:
        lengths = np.array(lengths)  # dense access: read the lengths once instead of paging
    # small walks skip the numba kernel: compiling it costs more than the numpy kernel's walk
    if compiled is None:
        compiled = document_index.shape[0] >= SMALL_WALK_POSITIONS
    kernel = None if compiled else "numpy"
    if "first_token" in params:  # a length run: its slice of the stream, walked from its first token
        document_index, sample_index = build_run_sample_index(lengths, document_index, plan, params["first_token"],
                                                              kernel=kernel)
    else:
        sample_index = build_sample_index(lengths, document_index, plan, kernel=kernel)  # (S + 1, 2)
    if sample_index.shape[0] - 1 != shuffle_index.shape[0]:
        raise BuildError(
            f"{prefix}: the sample walk made {sample_index.shape[0] - 1} samples but the plan promised "
            f"{shuffle_index.shape[0]}; the store changed during the build?"
        )
    arrays = {"document_index": document_index, "sample_index": sample_index, "shuffle_index": shuffle_index}
    return arrays, plan


def build_blend_arrays(params: Mapping[str, Any], *, threads: int = 1) -> dict[str, np.ndarray]:
    """megatron-core's ``dataset_index`` and ``dataset_sample_index`` of a ``blend`` item
    (``threads``: see :func:`tokenloom.index.megatron_blend.megatron_blend`; same arrays); a
    schedule's (its params carry ``schedule``): :func:`build_schedule_arrays`."""
    if "schedule" in params:
        return build_schedule_arrays(params, threads=threads)
    lengths = params["dataset_lengths"]
    size = sum(params["weights"]) if params["size"] is None else params["size"]
    backend = "python" if size < SMALL_BLEND_SAMPLES else "auto"  # same arrays, no compile
    if params["size"] is None:
        dataset_index, dataset_sample_index = megatron_exhaustive_blend(params["weights"], backend=backend,
                                                                        threads=threads)
    else:
        dataset_index, dataset_sample_index = megatron_blend(params["weights"], params["size"], backend=backend,
                                                             threads=threads)
    counts = np.bincount(dataset_index.astype(np.int64), minlength=len(lengths))  # (D,)
    over = np.flatnonzero(counts > np.asarray(lengths, dtype=np.int64))
    if over.size:
        d = int(over[0])
        raise BuildError(
            f"the blend asks {int(counts[d])} samples of dataset {d}, whose index holds only "
            f"{lengths[d]}; raise mid_level_dataset_surplus (megatron-core fails here too)"
        )
    return {"dataset_index": dataset_index, "dataset_sample_index": dataset_sample_index}


def build_schedule_arrays(params: Mapping[str, Any], *, threads: int = 1) -> dict[str, np.ndarray]:
    """The train blend of an exact schedule build in one process: each phase's megatron-core greedy
    over its active datasets (:func:`tokenloom.index.schedule_exact.exact_phase_blends`), laid end
    to end. The build divides the same arrays over its ranks (:func:`schedule_greedy`, run by
    :mod:`tokenloom.builder.divided`); this is their one-process reference.

    ``dataset_index`` ``(N,)`` int16 (int32 from 32767 datasets) numbers the split's datasets
    (the schedule's ``served``, in the split's order, or their length runs, ``columns``), as
    megatron-core's does; ``dataset_sample_index`` ``(N,)`` int64 has each phase's offsets added, so
    every dataset's samples run on across the phases (``0..total - 1``, none twice; a length run's
    from its first phase). BuildError where the greedy draws more of a dataset than its index holds
    (megatron-core fails on its last phase's overshoot there too)."""
    plan = schedule_plan_of(params["schedule"])
    blends = exact_phase_blends(plan, backend="python" if plan.num_samples < SMALL_BLEND_SAMPLES else "auto",
                                threads=threads)
    split_ids, run_start = split_tables(plan.num_phases, plan.num_datasets, params["schedule"]["served"],
                                        schedule_runs(params, plan))
    check_schedule_draws(blends.offsets, split_ids, run_start, params["dataset_lengths"])
    dtype = megatron_dataset_id_dtype(max(plan.num_datasets, len(params["dataset_lengths"])))
    dataset_index = np.concatenate([split_ids[k, d].astype(dtype) for k, d in enumerate(blends.dataset_index)])
    every = np.arange(plan.num_datasets)
    dataset_sample_index = np.concatenate([  # each phase's samples numbered on within its run
        s + (blends.offsets[k] - blends.offsets[run_start[k], every])[d.astype(np.int64)]
        for k, (d, s) in enumerate(zip(blends.dataset_index, blends.dataset_sample_index))])
    return {"dataset_index": dataset_index, "dataset_sample_index": dataset_sample_index.astype(np.int64)}


def schedule_runs(params: Mapping[str, Any], plan) -> list[tuple[int, tuple[int, ...]]] | None:
    """The split's datasets of an exact schedule item as ``(store, phases)`` when they are length
    runs (its params carry ``columns``), cut again from the plan; None when they are its stores.
    BuildError when they are not the runs recorded."""
    recorded = params["schedule"].get("columns")
    if recorded is None:
        return None
    columns = schedule_columns(plan, params["schedule"]["served"], run_counts(plan, "exact"))
    if [c.to_list() for c in columns] != [list(c) for c in recorded]:
        raise BuildError(f"the schedule's length runs cut again are {[c.to_list() for c in columns]}, not the "
                         f"recorded {recorded}; the cache entry was made by another version: build again")
    return [(c.store, c.phases) for c in columns]


def schedule_greedy(params: Mapping[str, Any]) -> ScheduleGreedy:
    """The greedies of an exact schedule's blend item (its params carry ``schedule``) as one run
    a divided build computes range by range: the plan recorded in the params, planned again."""
    plan = schedule_plan_of(params["schedule"])
    return ScheduleGreedy(plan_exact_phases(plan), params["schedule"]["served"], columns=schedule_runs(params, plan))


def check_schedule_draws(offsets: np.ndarray, split_ids: np.ndarray, run_start: np.ndarray, dataset_lengths) -> None:
    """BuildError when a schedule's greedies draw more of a dataset than its index holds, naming
    the dataset (the union's id; a length run's phases and its id in the split) and the first
    phase that overdraws. ``offsets``:
    ``(P + 1, D)`` the union's samples before each phase; ``split_ids``, ``run_start``:
    :func:`~tokenloom.index.schedule_exact.split_tables`; ``dataset_lengths``: the split's
    datasets' index sizes."""
    lengths = np.asarray(dataset_lengths, dtype=np.int64)
    drawn = run_draws(offsets, split_ids, run_start)
    over = np.flatnonzero(drawn > lengths[:drawn.shape[0]])
    if over.size:
        c = int(over[0])
        phases, stores = np.nonzero(split_ids == c)
        d = int(stores[0])
        by_phase = offsets[phases + 1, d] - offsets[run_start[phases[0], d], d]  # drawn by the end of each
        k = int(phases[int(np.argmax(by_phase > lengths[c]))])
        runs = np.unique(split_ids[:, d][split_ids[:, d] >= 0])
        run = "" if runs.shape[0] < 2 else \
            f" in its length run of phases {phases[0] + 1}..{phases[-1] + 1} (the split's dataset {c})"
        raise BuildError(f"the schedule's greedy draws {int(by_phase.max())} samples of dataset {d}{run} by the end of "
                         f"phase {k + 1}, whose index holds only {int(lengths[c])}; raise mid_level_dataset_surplus "
                         "(megatron-core fails here too)")


def plan_to_dict(plan: EpochPlan) -> dict[str, Any]:
    # its fields are plain numbers and flags: no need for asdict, which recurses into every field
    # and deep-copies each value, a cost paid again for every item
    return {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)}


def plan_from_dict(data: Mapping[str, Any]) -> EpochPlan:
    return EpochPlan(**data)


class ShuffleDrawer:
    """Draws the shuffles of a sequence of ``gpt`` items ahead of time in background processes.

    ``jobs`` are ``(prefix, params)`` or ``(prefix, params, epoch plan)``. ``get(i)`` returns the
    draws of job ``i`` (in order). With ``workers=0`` it returns None: the walk draws them itself,
    with the store it opens. The workers are plain subprocesses (``python -c``) fed pickled jobs
    over a pipe, so the caller's ``__main__`` is never re-imported (as multiprocessing's spawn
    would) and no threads are forked.
    """

    def __init__(self, jobs: list[tuple], workers: int) -> None:
        self._jobs = [(job[0], job[1], job[2] if len(job) > 2 else None) for job in jobs]
        self._next = 0  # next job to send
        self._procs: list[subprocess.Popen] = []
        self._sent: collections.deque[int] = collections.deque()  # worker of each job in flight
        if workers > 0 and len(jobs) > 1:
            env = dict(os.environ)
            src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
            for _ in range(workers):
                self._procs.append(subprocess.Popen(
                    [sys.executable, "-c", "from tokenloom.builder.exact import drawer_main; drawer_main()"],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env))
            self._ahead = workers * LOOKAHEAD_PER_WORKER
            self._fill()

    def _fill(self) -> None:
        while self._procs and self._next < len(self._jobs) and len(self._sent) < self._ahead:
            worker = self._next % len(self._procs)
            _send(self._procs[worker].stdin, self._jobs[self._next])
            self._sent.append(worker)
            self._next += 1

    def get(self, index: int):
        if not self._procs:
            return None
        worker = self._sent.popleft()
        status, value = _receive(self._procs[worker].stdout)
        self._fill()
        if status != "ok":
            raise BuildError(f"the background shuffle worker failed: {value}")
        return value

    def close(self) -> None:
        for proc in self._procs:
            try:
                proc.stdin.close()
            except OSError:
                pass
        for proc in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._procs = []


def _send(stream, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(len(data).to_bytes(8, "little"))
    stream.write(data)
    stream.flush()


def _receive(stream):
    head = stream.read(8)
    if len(head) < 8:
        return "error", "the worker exited"
    size = int.from_bytes(head, "little")
    return pickle.loads(stream.read(size))


def drawer_main() -> None:
    """The background worker: read ``(prefix, params, plan)`` jobs from stdin, write draws to stdout."""
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while True:
        head = stdin.read(8)
        if len(head) < 8:
            return
        prefix, params, plan = pickle.loads(stdin.read(int.from_bytes(head, "little")))
        try:
            result = ("ok", draw_shuffles(prefix, params, plan=plan))
        except Exception as exc:  # reported to the parent, which fails the item
            result = ("error", f"{type(exc).__name__}: {exc}")
        _send(stdout, result)


__all__ = ["ShuffleDrawer", "build_blend_arrays", "build_gpt_arrays", "build_schedule_arrays",
           "check_schedule_draws", "draw_shuffles", "plan_from_dict", "plan_gpt", "plan_to_dict", "schedule_greedy",
           "schedule_runs"]
