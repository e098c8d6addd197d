"""The one blended source: global positions -> (dataset, sample) -> tokens, over one reader per dataset.

A :class:`BlendedSource` is one split of a build. A *locator* (the contract:
:class:`~tokenloom.source.protocol.Locator`) says which dataset and which of its samples sit at
each global position, and which positions hold given samples; one reader per dataset
(:mod:`tokenloom.source.readers`) turns sample ids into tokens. Four locators cover every build:

* :class:`ArrayLocator` -- megatron-core's ``dataset_index`` / ``dataset_sample_index`` arrays
  (exact mode; in memory or memory-mapped from the cache);
* :class:`BlendLocator` -- tokenloom's closed-form :class:`~tokenloom.index.blend.Blend`
  (stateless mode; O(datasets) memory);
* :class:`ScheduleLocator` -- a mixture schedule's closed-form plan,
  :class:`~tokenloom.index.schedule.SchedulePlan` (stateless mode; state per phase);
* :class:`DirectLocator` -- a split that reads one dataset unblended: position ``i`` is its sample ``i``.

The build stage produces these sources (``BuildResult.split(name)``), ``StoreBlendSource`` and
``StatelessBlendSource`` (:mod:`tokenloom.source.memory`) make them in memory, and the serving
stage consumes them through the :class:`~tokenloom.source.protocol.SampleSource` protocol.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from tokenloom.errors import ConfigError, PositionError
from tokenloom.index.blend import Blend
from tokenloom.index.megatron_gpt import PAD_TOKEN_ID
from tokenloom.index.schedule import SchedulePlan
from tokenloom.io.s3 import settings
from tokenloom.source.fim_options import FimSettings
from tokenloom.source.protocol import DatasetInfo, Locator, PieceRows
from tokenloom.source.provenance import SampleOrigin, find, where
from tokenloom.source.readers import DatasetReader, resolve_eod
from tokenloom.validate import check_positions

#: Positions of the blend arrays one step of :meth:`ArrayLocator.positions_of` reads (bounds the
#: memory of a pass over arrays as long as the blend).
_PASS_POSITIONS = 1 << 24


class ArrayLocator:
    """megatron-core's blend arrays, in memory or memory-mapped (exact mode).

    The arrays may be given as zero-argument callables that map them (a build's cache files):
    they are then mapped on first use, ``num_samples`` must be given, and a pickled copy (a
    DataLoader or grain worker) maps them anew instead of carrying their bytes."""

    def __init__(self, dataset_index: np.ndarray | Callable[[], np.ndarray],
                 dataset_sample_index: np.ndarray | Callable[[], np.ndarray], *,
                 num_samples: int | None = None) -> None:
        lazy = callable(dataset_index)
        self._openers = (dataset_index, dataset_sample_index) if lazy else None
        self._arrays = None if lazy else (dataset_index, dataset_sample_index)
        if lazy and num_samples is None:
            raise ConfigError("an ArrayLocator whose arrays open on first use needs num_samples")
        self._num_samples = int(num_samples) if lazy else int(dataset_index.shape[0])

    def _opened(self) -> tuple[np.ndarray, np.ndarray]:
        if self._arrays is None:
            arrays = (self._openers[0](), self._openers[1]())
            if any(a.shape[0] != self._num_samples for a in arrays):
                raise ConfigError(f"the blend's arrays hold {arrays[0].shape[0]} and {arrays[1].shape[0]} positions "
                                  f"but the build recorded {self._num_samples}; run tokenloom cache verify")
            self._arrays = arrays
        return self._arrays

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        if self._openers is not None:
            state["_arrays"] = None  # the copy maps its own
        return state

    @property
    def dataset_index(self) -> np.ndarray:
        """(num_samples,) int16 (int32 beyond 32766 datasets): the dataset of each position."""
        return self._opened()[0]

    @property
    def dataset_sample_index(self) -> np.ndarray:
        """(num_samples,) int64: the sample of that dataset at each position."""
        return self._opened()[1]

    @property
    def num_samples(self) -> int:
        return self._num_samples

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return (np.asarray(self.dataset_index[positions], dtype=np.int64),
                np.asarray(self.dataset_sample_index[positions], dtype=np.int64))

    def positions_of(self, dataset_id: int, sample_ids: np.ndarray) -> np.ndarray:
        """Ascending positions holding samples ``sample_ids`` of dataset ``dataset_id``: one pass over
        the blend arrays (:class:`~tokenloom.source.protocol.Locator`)."""
        out = []
        wanted = np.unique(sample_ids)
        for begin in range(0, self.num_samples, _PASS_POSITIONS):
            datasets = np.asarray(self.dataset_index[begin:begin + _PASS_POSITIONS])
            mine = np.flatnonzero(datasets == dataset_id)
            samples = np.asarray(self.dataset_sample_index[begin:begin + _PASS_POSITIONS])[mine]
            out.append(begin + mine[np.isin(samples, wanted)])
        return np.concatenate(out)


class BlendLocator:
    """tokenloom's closed-form blend: positions are located on demand (stateless mode)."""

    def __init__(self, blend: Blend) -> None:
        self.blend = blend

    @property
    def num_samples(self) -> int:
        return len(self.blend)

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        dataset_ids, sample_ids = self.blend.lookup(positions)
        return np.asarray(dataset_ids, dtype=np.int64), np.asarray(sample_ids, dtype=np.int64)

    def positions_of(self, dataset_id: int, sample_ids: np.ndarray) -> np.ndarray:
        """Ascending positions holding samples ``sample_ids`` of dataset ``dataset_id``: the blend
        takes the first ``counts[dataset_id]`` of them, each where the closed form places it."""
        kept = sample_ids[sample_ids < int(self.blend.counts[dataset_id])]
        return np.sort(self.blend.positions_of(np.full(kept.shape[0], dataset_id, dtype=np.int64), kept))


class ScheduleLocator:
    """A mixture schedule's closed-form plan: phase by phase, every dataset numbered on from where
    it stopped (stateless mode).

    The plan numbers the union of the phases' stores; the split reads ``datasets`` of them (those
    the schedule takes samples from), in that order, so the locator maps the plan's dataset ids to
    the split's and back. A schedule that changes the sequence length reads each store as its
    length runs (FORMAT.md "Length runs"): ``columns`` then gives the split's datasets as ``(store,
    seq_length, first_token, begin, samples)`` rows (``builder.schedule.ScheduleColumn``), and a
    store's sample ``s`` of the plan is sample ``s - begin`` of the run holding it. In exact mode the
    runs hold megatron's targets of their phases, not the plan's counts (``counts``, ``(P, D)``: what
    the columns number); the blend's arrays then locate positions, and this locator gives the
    schedule's phases, widths and targets only."""

    def __init__(self, plan: SchedulePlan, datasets: Sequence[int] | None = None,
                 columns: Sequence[Sequence[int | None]] | None = None, counts: np.ndarray | None = None) -> None:
        self.plan = plan
        self._counts = plan.counts if counts is None else np.asarray(counts, dtype=np.int64)
        self._closed_form = counts is None or np.array_equal(self._counts, plan.counts)
        union = plan.num_datasets
        # ids: (split datasets,) the plan's id of each; local: (union,) the split's id, -1 if unread
        self._ids = np.arange(union, dtype=np.int64) if datasets is None else np.asarray(datasets, dtype=np.int64)
        if self._ids.ndim != 1 or len(np.unique(self._ids)) != len(self._ids) or \
                (self._ids.size and not 0 <= self._ids.min() <= self._ids.max() < union):
            raise ConfigError(f"datasets={list(datasets)!r}; expected distinct dataset ids of the schedule's "
                              f"{union}")
        unread = np.setdiff1d(np.flatnonzero(plan.totals > 0), self._ids)
        if unread.size:
            raise ConfigError(f"the schedule serves dataset {int(unread[0])} but datasets={list(datasets)!r} "
                              "leaves it out; expected every dataset with samples")
        self._local = np.full(union, -1, dtype=np.int64)
        self._local[self._ids] = np.arange(len(self._ids), dtype=np.int64)
        self.columns = None if columns is None else [tuple(c) for c in columns]
        """The split's datasets as length runs (see the class docstring), or None: one per store."""
        self.seq_lengths: tuple[int, ...] = tuple(plan.seq_lengths[0] for _ in self._ids)
        """Tokens per sample of each of the split's datasets."""
        if self.columns is not None:
            self._runs_of(self.columns)

    def _runs_of(self, columns: list[tuple]) -> None:
        """The column tables: each column's store, first sample and samples; each (phase, store)'s
        column (the run serving the store's next sample there)."""
        plan = self.plan
        store = np.array([c[0] for c in columns], dtype=np.int64)  # (C,)
        begin = np.array([c[3] for c in columns], dtype=np.int64)
        samples = np.array([c[4] for c in columns], dtype=np.int64)
        if set(store.tolist()) != set(self._ids.tolist()) or (np.diff(store) < 0).any():
            raise ConfigError(f"length-run columns over stores {sorted(set(store.tolist()))}; expected the runs "
                              f"of the split's stores {self._ids.tolist()}, store by store")
        ends = {}
        for c, (d, b, n) in enumerate(zip(store.tolist(), begin.tolist(), samples.tolist())):
            if b != ends.get(d, 0) or n < 1:
                raise ConfigError(f"length-run column {c} of store {d} covers its samples [{b}, {b + n}); expected a "
                                  f"run of at least one sample starting at {ends.get(d, 0)}, where its last run ended")
            ends[d] = b + n
        totals = self._counts.sum(axis=0)  # (union,) what the columns number of each store
        cumulative = np.cumsum(self._counts, axis=0) - self._counts  # (P, union) numbered before each phase
        short = [d for d in ends if ends[d] != int(totals[d])]
        if short:
            d = short[0]
            raise ConfigError(f"the length runs of store {d} hold {ends[d]} samples but the schedule takes "
                              f"{int(totals[d])} of it; expected runs covering exactly its samples")
        # column of (phase, store): the run holding the store's first sample of the phase (its
        # last run once it has served them all), so each phase's weights land on one run each
        table = np.full((plan.num_phases, plan.num_datasets), -1, dtype=np.int64)  # (P, union)
        for d in self._ids.tolist():
            mine = np.flatnonzero(store == d)
            first = np.minimum(cumulative[:, d], ends[d] - 1)  # (P,)
            table[:, d] = mine[np.searchsorted(begin[mine], first, side="right") - 1]
        self._store, self._begin, self._samples, self._table = store, begin, samples, table
        self.seq_lengths = tuple(int(c[1]) for c in columns)

    @property
    def num_samples(self) -> int:
        return self.plan.num_samples

    @property
    def num_columns(self) -> int:
        """The split's datasets: its stores, or their length runs."""
        return len(self._ids) if self.columns is None else len(self.columns)

    def _check_closed_form(self) -> None:
        if not self._closed_form:
            raise ConfigError("this schedule's length runs are numbered by exact mode's greedy, not the plan's "
                              "closed form; locate its positions with the blend's arrays (ArrayLocator)")

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        self._check_closed_form()
        phases, datasets, samples = self.plan.locate(positions)
        if self.columns is None:
            return self._local[datasets], samples
        columns = self._table[phases, datasets]
        return columns, samples - self._begin[columns]

    def positions_of(self, dataset_id: int, sample_ids: np.ndarray) -> np.ndarray:
        """Ascending positions holding samples ``sample_ids`` of dataset ``dataset_id``: the
        schedule takes the first ``totals`` of them (of a run: its ``samples``), each where its
        closed form places it."""
        self._check_closed_form()
        if self.columns is None:
            union, begin, count = int(self._ids[dataset_id]), 0, int(self.plan.totals[int(self._ids[dataset_id])])
        else:
            union, begin, count = (int(self._store[dataset_id]), int(self._begin[dataset_id]),
                                   int(self._samples[dataset_id]))
        kept = sample_ids[(sample_ids >= 0) & (sample_ids < count)]
        return np.sort(self.plan.positions_of(union, kept + begin))

    def samples_reached(self, position: int) -> np.ndarray:
        """``(datasets,)`` int64: samples of each of the split's datasets in positions
        ``[0, position)``, closed form (what a weight change at ``position`` continues from)."""
        self._check_closed_form()
        reached = self.plan.samples_reached(position)
        if self.columns is None:
            return reached[self._ids]
        return np.clip(reached[self._store] - self._begin, 0, self._samples)

    def targets_at(self, positions) -> np.ndarray:
        """``(n, datasets)`` float64: :meth:`target_weights` at each of ``positions`` at once."""
        positions = np.asarray(positions, dtype=np.int64).reshape(-1)
        weights = self.plan.target_weights(positions)  # (n, union)
        if self.columns is None:
            return weights[:, self._ids]
        # each store's weight goes to the run serving it in the position's phase
        phases = self.plan.phase_of(positions)
        out = np.zeros((positions.shape[0], self.num_columns), dtype=np.float64)
        # a phase's stores land on distinct runs, so no cell is written twice
        out[np.arange(positions.shape[0])[:, None], self._table[phases][:, self._ids]] = weights[:, self._ids]
        return out

    def target_weights(self, position: int) -> tuple[float, ...]:
        """The mixture the schedule aims at, at ``position``, over the split's datasets: the
        phase's weights, or a ramp's step's interpolated weights."""
        return tuple(float(w) for w in self.targets_at(np.array([position], dtype=np.int64))[0])


class DirectLocator:
    """One dataset, unblended: position ``i`` is sample ``i`` of dataset 0."""

    def __init__(self, num_samples: int) -> None:
        self._num_samples = int(num_samples)

    @property
    def num_samples(self) -> int:
        return self._num_samples

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return np.zeros(positions.shape, dtype=np.int64), positions.astype(np.int64, copy=True)

    def positions_of(self, dataset_id: int, sample_ids: np.ndarray) -> np.ndarray:
        """Position ``i`` holds sample ``i``: the ``sample_ids`` inside the split."""
        return sample_ids[sample_ids < self.num_samples]


def read_by_dataset(dataset_ids, sample_ids, *, datasets: Sequence[DatasetInfo | DatasetReader], width: int,
                    fill: Callable[[int, np.ndarray, np.ndarray, np.ndarray], None],
                    concurrently: bool = False, dtype=np.int64) -> np.ndarray:
    """``(B, width)`` int64 tokens (or ``dtype`` values) of (dataset, sample) pairs, gathered one
    dataset at a time.

    Every dataset id and sample id is checked first against ``datasets`` (anything with ``name``
    and ``num_samples``; PositionError names the first one out of range); then
    ``fill(d, rows, sample_ids_of_d, out)`` writes dataset ``d``'s samples into ``out[rows]``.
    ``concurrently``: the datasets' fills run on a thread pool (for stores on object storage, whose
    reads wait on the network; the rows of different datasets never overlap).
    """
    dataset_ids = np.asarray(dataset_ids, dtype=np.int64)
    sample_ids = np.asarray(sample_ids, dtype=np.int64)
    out = np.empty((dataset_ids.shape[0], width), dtype=dtype)  # (B, seq_length + extra)
    tasks = []
    for d in np.unique(dataset_ids):
        if not 0 <= d < len(datasets):
            raise PositionError(f"dataset id {int(d)}; the blend has {len(datasets)} datasets")
        rows = np.flatnonzero(dataset_ids == d)
        wanted = sample_ids[rows]
        available = datasets[d].num_samples
        if wanted.min() < 0 or wanted.max() >= available:
            bad = int(wanted.min()) if wanted.min() < 0 else int(wanted.max())
            raise PositionError(f"dataset {int(d)} ({datasets[d].name}) asked for sample {bad} but its index "
                                f"holds {available}; build it with more samples")
        tasks.append((int(d), rows, wanted))
    pool = _fill_pool() if concurrently and len(tasks) > 1 else None
    if pool is not None:
        for done in [pool.submit(fill, d, rows, wanted, out) for d, rows, wanted in tasks]:
            done.result()
    else:
        for d, rows, wanted in tasks:
            fill(d, rows, wanted, out)
    return out


_fill_pools: dict[tuple, ThreadPoolExecutor] = {}


def _fill_pool() -> ThreadPoolExecutor | None:
    """This process's pool for concurrent fills, ``TOKENLOOM_S3_CONCURRENCY`` threads (None for 1:
    one dataset after another); a forked child makes its own."""
    threads = settings().concurrency
    if threads < 2:
        return None
    key = (os.getpid(), threads)
    pool = _fill_pools.get(key)
    if pool is None:
        _fill_pools.clear()
        pool = _fill_pools[key] = ThreadPoolExecutor(threads, "tokenloom-fill")
    return pool


class BlendedSource:
    """One split: a blend of datasets, readable by position (a :class:`SampleSource`)."""

    def __init__(self, *, readers: Sequence[DatasetReader], weights: Sequence[float], locator: Locator,
                 seq_length: int, add_extra_token: bool, build_key: str, pad_id: int = PAD_TOKEN_ID,
                 name: str = "train", eod_ids: Sequence[int | None] | None = None,
                 budgets: Sequence[int | None] | None = None, schedule: ScheduleLocator | None = None,
                 seq_lengths: Sequence[int] | None = None, fim: FimSettings | None = None) -> None:
        """``weights`` are the datasets' target shares (summing to 1); ``eod_ids`` give each
        dataset's end-of-document id where its store has no tokenizer record (None: the records');
        ``budgets`` each dataset's token budget, where the build config gave budgets; ``schedule``
        the mixture schedule the split was built from (its targets change by phase), in either
        mode; ``seq_lengths`` each dataset's tokens per sample where a schedule changes it (its
        datasets are then length runs; None: ``seq_length`` for every dataset); ``fim`` the
        fill-in-the-middle of the build's config, which serving applies unless told otherwise."""
        if len(weights) != len(readers) or (eod_ids is not None and len(eod_ids) != len(readers)):
            raise ConfigError(f"{len(weights)} weights and {None if eod_ids is None else len(eod_ids)} EOD ids "
                              f"for {len(readers)} datasets; expected one of each per dataset")
        eod_ids = [None] * len(readers) if eod_ids is None else list(eod_ids)
        self.name = name
        """``train``, ``valid`` or ``test``."""
        self.readers = tuple(readers)
        """One reader per dataset, in blend order (dataset id ``d`` is ``readers[d]``)."""
        self.locator = locator
        """Where each global position comes from."""
        self.schedule = schedule
        """The split's mixture schedule (a plan of several phases), or None: ``weights`` hold
        throughout."""
        self.fim = fim
        """The build config's fill-in-the-middle for this split (``BatchPipeline`` applies it
        when its ``SampleOptions`` set none), or None."""
        self.backend: str | None = None
        """Gather kernel (a key of ``tokenloom.source.gather.GATHER_BACKENDS``); None: the default."""
        self._seq_length = int(seq_length)
        self._seq_lengths = np.full(len(readers), self._seq_length, dtype=np.int64) if seq_lengths is None \
            else np.asarray(seq_lengths, dtype=np.int64)
        if self._seq_lengths.shape != (len(readers),) or (self._seq_lengths < 1).any():
            raise ConfigError(f"seq_lengths={list(seq_lengths)!r} for {len(readers)} datasets; expected one "
                              "positive sequence length per dataset")
        self._one_width = bool((self._seq_lengths == self._seq_length).all())
        self._add_extra_token = bool(add_extra_token)
        self._build_key = build_key
        self._pad_id = int(pad_id)
        self._weights = tuple(float(w) for w in weights)
        self._eod_ids = eod_ids
        self._budgets = [None] * len(readers) if budgets is None else list(budgets)
        if len(self._budgets) != len(readers):
            raise ConfigError(f"{len(self._budgets)} budgets for {len(readers)} datasets; expected one per dataset")
        self._datasets: tuple[DatasetInfo, ...] | None = None
        self._remote = any(getattr(reader, "is_remote", False) for reader in self.readers)
        """Some store is on object storage: a batch reads its datasets concurrently."""

    # -- SampleSource ---------------------------------------------------------------------------
    @property
    def build_key(self) -> str:
        return self._build_key

    @property
    def num_samples(self) -> int:
        return self.locator.num_samples

    @property
    def seq_length(self) -> int:
        return self._seq_length

    @property
    def seq_lengths(self) -> np.ndarray:
        """``(datasets,)`` int64: tokens per sample of each dataset (all ``seq_length`` unless a
        schedule changes it: FORMAT.md "Length runs")."""
        return self._seq_lengths

    def width_of(self, dataset_ids) -> int:
        """The row width ``seq_length + add_extra_token`` of a batch of samples of ``dataset_ids``
        (every dataset of a schedule's phase has the phase's sequence length); ConfigError for a
        batch whose datasets have two (a micro-batch is one array: its rows share a width)."""
        extra = int(self._add_extra_token)
        if self._one_width:
            return self._seq_length + extra
        ids = np.unique(np.asarray(dataset_ids, dtype=np.int64))
        ids = ids[(ids >= 0) & (ids < len(self.readers))]  # read_by_dataset names any other id
        widths = np.unique(self._seq_lengths[ids])
        if widths.shape[0] > 1:
            first = [int(ids[np.flatnonzero(self._seq_lengths[ids] == w)[0]]) for w in widths[:2]]
            raise ConfigError(
                f"one batch of the {self.name} split holds samples of sequence lengths {int(widths[0])} (dataset "
                f"{first[0]}, {self.readers[first[0]].name}) and {int(widths[1])} (dataset {first[1]}, "
                f"{self.readers[first[1]].name}); a batch is one array, so its samples must come from one phase's "
                "sequence length: serve whole optimizer steps (a phase ends at a step's end)")
        return (int(widths[0]) if widths.shape[0] else self._seq_length) + extra

    @property
    def add_extra_token(self) -> bool:
        return self._add_extra_token

    @property
    def pad_id(self) -> int:
        return self._pad_id

    @property
    def datasets(self) -> tuple[DatasetInfo, ...]:
        """Every dataset's name, weight, samples and end-of-document id. The ids come from the
        stores' tokenizer records, read when first asked for (a blend of 10,000 stores opens none
        of them until then)."""
        if self._datasets is None:
            self._datasets = tuple(
                DatasetInfo(name=reader.name, weight=w, num_samples=reader.num_samples,
                            eod_id=resolve_eod(reader.store, eod), budget_tokens=budget)
                for reader, w, eod, budget in zip(self.readers, self._weights, self._eod_ids, self._budgets)
            )
        return self._datasets

    def __len__(self) -> int:
        return self.num_samples

    def locate(self, positions) -> tuple[np.ndarray, np.ndarray]:
        """``(dataset_ids, sample_ids)`` (int64, shaped like ``positions``) of blend positions."""
        positions = np.asarray(positions, dtype=np.int64)
        check_positions(positions, self.num_samples, what=f"the {self.name} split holds {self.num_samples} samples",
                        hint="build with more samples to serve further")
        return self.locator.locate(positions)

    def read_samples(self, dataset_ids, sample_ids) -> np.ndarray:
        """``(B, seq_length + add_extra_token)`` int64 tokens of (dataset, sample) pairs (the
        ``seq_length`` of their datasets: :meth:`width_of`)."""
        def fill(d: int, rows: np.ndarray, wanted: np.ndarray, out: np.ndarray) -> None:
            self.readers[d].read_into(wanted, out, rows, backend=self.backend)

        return read_by_dataset(dataset_ids, sample_ids, datasets=self.readers, width=self.width_of(dataset_ids),
                               fill=fill, concurrently=self._remote)

    def read_pieces(self, dataset_ids, sample_ids) -> PieceRows:
        """The rows of :meth:`read_samples` and the document pieces of each, recorded by the same
        gather (:class:`~tokenloom.source.protocol.PieceRows`)."""
        width = self.width_of(dataset_ids)
        count = np.asarray(dataset_ids).shape[0]
        ends = np.empty((count, width + 1), dtype=np.int32)  # (B, width + 1)
        counts = np.empty(count, dtype=np.int32)  # (B,)

        def fill(d: int, rows: np.ndarray, wanted: np.ndarray, out: np.ndarray) -> None:
            self.readers[d].read_into(wanted, out, rows, backend=self.backend, ends=ends, counts=counts)

        tokens = read_by_dataset(dataset_ids, sample_ids, datasets=self.readers, width=width, fill=fill,
                                 concurrently=self._remote)
        return PieceRows(tokens, ends, counts)

    def has_loss_mask(self, dataset_id: int) -> bool:
        """Whether dataset ``dataset_id``'s store carries a loss mask (opens the store)."""
        return bool(self.readers[int(dataset_id)].store.has_loss_mask)

    def read_loss_masks(self, dataset_ids, sample_ids) -> np.ndarray | None:
        """``(B, width)`` uint8: the stores' loss masks of the rows :meth:`read_samples` returns,
        column for column (1 on padding, and on every row of a store without a mask); None when
        no store of the batch has a mask, so that a blend without masks pays nothing.
        FORMAT.md, "The loss-mask sidecar"."""
        ids = np.unique(np.asarray(dataset_ids, dtype=np.int64))
        ids = ids[(ids >= 0) & (ids < len(self.readers))]  # read_by_dataset names any other id
        if not any(self.has_loss_mask(d) for d in ids.tolist()):
            return None

        def fill(d: int, rows: np.ndarray, wanted: np.ndarray, out: np.ndarray) -> None:
            self.readers[d].loss_masks_into(wanted, out, rows, backend=self.backend)

        return read_by_dataset(dataset_ids, sample_ids, datasets=self.readers, width=self.width_of(dataset_ids),
                               fill=fill, concurrently=self._remote, dtype=np.uint8)

    def __getitem__(self, position: int) -> np.ndarray:
        """Tokens of one blend position (megatron-core's ``BlendedDataset[i]["text"]``)."""
        return self.read_samples(*self.locate(np.array([position])))[0]

    # -- provenance (tokenloom.source.provenance) -----------------------------------------------
    def where(self, positions) -> list[SampleOrigin]:
        """The dataset, store and document pieces of the sample at each global position
        (:func:`tokenloom.source.provenance.where`)."""
        return where(self, positions)

    def find(self, prefix: str, document: int) -> np.ndarray:
        """Ascending global positions whose sample holds tokens of ``prefix``'s document
        ``document`` (:func:`tokenloom.source.provenance.find`)."""
        return find(self, prefix, document)

    # -- views of the locator -------------------------------------------------------------------
    @property
    def dataset_index(self) -> np.ndarray | None:
        """Exact blends: (num_samples,) the dataset of each position (megatron-core's array); else None."""
        return self.locator.dataset_index if isinstance(self.locator, ArrayLocator) else None

    @property
    def dataset_sample_index(self) -> np.ndarray | None:
        """Exact blends: (num_samples,) int64, the sample of that dataset at each position; else None."""
        return self.locator.dataset_sample_index if isinstance(self.locator, ArrayLocator) else None

    @property
    def blend(self) -> Blend | None:
        """Stateless blends: the closed-form :class:`Blend` that locates positions; else None."""
        return self.locator.blend if isinstance(self.locator, BlendLocator) else None

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.name!r}, datasets={len(self.readers)}, "
                f"num_samples={self.num_samples}, seq_length={self._seq_length}, build_key={self._build_key[:12]})")


__all__ = ["ArrayLocator", "BlendLocator", "BlendedSource", "DirectLocator", "ScheduleLocator", "read_by_dataset"]
