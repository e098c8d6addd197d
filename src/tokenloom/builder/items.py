"""The work of a build: items, what each costs, and which rank does which.

A build config and the fingerprints of its stores resolve into **work items**, following
megatron-core's ``BlendedMegatronDatasetBuilder`` exactly (same sample counts per dataset, same
blend sizes and weights):

* a ``gpt`` item: one (store, split) packed-sample index;
* a ``blend`` item: the blend of one split over its datasets (absent when a split reads one store);
  the train split of a schedule of several phases has the schedule's (each dataset then sized by
  what the whole schedule takes of it: ``SchedulePlan.totals`` when stateless, megatron's buffer
  over every phase's greedy targets, ``exact_buffers``, when exact; an exact one is divided over
  the ranks like any exact blend);
* with ``packing: best_fit``, ``pack`` items: the chunks of a split's documents packed best fit
  (:mod:`tokenloom.builder.best_fit`), which its ``gpt`` item serves from. They are built before
  the plan, whose sample counts they decide.

Every item is self-contained (the planner already knows each dataset's length from its token
count), so all items, blends included, run in parallel. The cost model
(:mod:`tokenloom.builder.cost_model`) estimates seconds from document positions, samples and
blend size; items go to ranks by longest-processing-time-first (each item, costliest first, to
the least-loaded rank).
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tokenloom.builder.config import BuildConfig
from tokenloom.builder.cost_model import (
    COST_PER_ITEM_S,
    COST_PER_MANIFEST_ITEM_S,
    blend_cost,
    gpt_cost,
    range_cost,
    stateless_blend_cost,
    stateless_gpt_cost,
)
from tokenloom.builder.megatron_names import MegatronName, blend_name, gpt_identifiers, gpt_name
from tokenloom.builder.packs import CACHE_FORMAT_VERSION
from tokenloom.builder.schedule import epoch_room, has_length_runs, run_counts, schedule_blend_params, schedule_columns
from tokenloom.builder.stores import StoreInfo
from tokenloom.errors import BuildError, ConfigError
from tokenloom.index.blend_spec import megatron_normalize
from tokenloom.index.epochs import EpochPlan, plan_epochs, plan_run_epochs
from tokenloom.index.megatron_runs import stream_epochs_for
from tokenloom.index.schedule_exact import exact_buffers, plan_exact_phases
from tokenloom.index.split import SPLIT_NAMES, split_document_ranges
from tokenloom.source.keys import hash_key
from tokenloom.validate import check_positive_int


@dataclass(frozen=True, kw_only=True)
class WorkItem:
    """One unit of work: build the arrays of one (dataset, split) index or one split's blend."""

    kind: str
    """``"gpt"`` (a packed-sample index), ``"blend"`` or ``"pack"`` (a best-fit chunk)."""
    key: str
    """Cache key: hash of :attr:`params`."""
    split: str
    """``train``, ``valid`` or ``test``."""
    label: str
    """Human-readable name for messages, e.g. ``gpt train data/wiki``."""
    params: Mapping[str, Any]
    """Everything that determines the arrays (JSON values); the key hashes exactly this."""
    num_samples: int
    """Samples of the finished index (its length)."""
    output_bytes: int
    """Bytes of the arrays it writes."""
    cost_s: float
    """Estimated seconds to build on one core."""
    megatron: MegatronName | None = None
    """megatron-core's name for these arrays (exact mode), or None."""
    prefix: str | None = None
    """The store a ``gpt`` item reads (as the config names it); None for a blend."""
    epoch_plan: EpochPlan | None = None
    """A ``gpt`` item's epoch arithmetic (megatron-core's), known before any array is built
    (None for best-fit packing, whose epochs the packed chunks decide)."""
    packs: tuple[WorkItem, ...] = ()
    """A best-fit ``gpt`` item's ``pack`` items (its chunks, in order); empty otherwise."""


@dataclass(frozen=True, kw_only=True)
class SplitPlan:
    """What one split of the result is made of."""

    name: str
    """``train``, ``valid`` or ``test``."""
    prefixes: tuple[str, ...]
    """The stores of the blend, in blend order."""
    dataset_keys: tuple[str, ...]
    """Key of each store's ``gpt`` item, in blend order."""
    blend_key: str | None
    """Key of the ``blend`` item, or None when the split reads one store directly."""
    num_samples: int
    """Samples the split serves."""


@dataclass(frozen=True, kw_only=True)
class BuildPlan:
    """Every item of a build, the splits they make, and the assignment of items to ranks."""

    items: tuple[WorkItem, ...]
    """Distinct items, in a fixed order (the same on every rank)."""
    splits: tuple[SplitPlan, ...]
    """The splits that have data."""
    world_size: int
    """Ranks the items are spread over."""
    assignment: Mapping[str, int] = field(default_factory=dict)
    """Item key -> rank that builds it (only items that need building and one rank builds)."""
    divided: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    """Item key -> ``world_size + 1`` position bounds: rank ``r`` computes and writes positions
    ``[bounds[r], bounds[r + 1])`` of the blend (exact-mode blends that need building; ranks may
    get an empty range)."""
    fixed_s: tuple[float, ...] = ()
    """Estimated seconds each rank spends beyond its items (the writer ranks' manifest); empty: none."""

    def item(self, key: str) -> WorkItem:
        for item in self.items:
            if item.key == key:
                return item
        raise KeyError(key)

    def items_of_rank(self, rank: int) -> list[WorkItem]:
        """Items ``rank`` builds alone, costliest first (divided blends not included)."""
        mine = [item for item in self.items if self.assignment.get(item.key) == rank]
        return sorted(mine, key=lambda item: (-item.cost_s, item.key))

    def divided_items(self) -> list[WorkItem]:
        """The blends every rank builds a range of, in plan order."""
        return [item for item in self.items if item.key in self.divided]

    def seconds_per_rank(self) -> list[float]:
        """Estimated seconds of work on one core, by rank: its items and its ranges of blends."""
        loads = list(self.fixed_s) if self.fixed_s else [0.0] * self.world_size
        by_key = {item.key: item for item in self.items}
        for key, rank in self.assignment.items():
            loads[rank] += by_key[key].cost_s
        for key, bounds in self.divided.items():
            item = by_key[key]
            for rank in range(self.world_size):
                loads[rank] += range_cost(bounds[rank + 1] - bounds[rank], cost_s=item.cost_s,
                                          num_samples=item.num_samples)
        return loads

    @property
    def cache_bytes(self) -> int:
        return sum(item.output_bytes for item in self.items)

    def samples_per_epoch(self, split: str = "train") -> dict[str, int]:
        """Samples one epoch of each store's documents of ``split`` holds, by store, where the plan
        knows it (concat packing: each dataset item's epoch plan)."""
        return {item.prefix: item.epoch_plan.num_samples_per_epoch for item in self.items
                if item.kind == "gpt" and item.split == split and item.epoch_plan is not None}

    def describe(self, *, done: frozenset[str] = frozenset(), cache_dir: str | None = None) -> str:
        """The dry-run report (:func:`format_plan`): items per rank, estimated seconds, memory and
        cache size, against the space free in ``cache_dir``'s filesystem when given; ``done`` holds
        the keys already cached."""
        return format_plan(self, done=done, cache_dir=cache_dir)


# ------------------------------------------------------------------------------------ resolution


@functools.lru_cache(maxsize=1 << 16)
def _split_bounds(split: str, num_sequences: int) -> tuple[tuple[int, int] | None, ...]:
    """:func:`split_document_ranges` as plain tuples, once per (split string, store size): a plan
    asks it several times for each of thousands of stores."""
    return tuple(None if r is None else (r.begin, r.end) for r in split_document_ranges(split, num_sequences))


def split_ranges(config: BuildConfig, num_sequences: int, prefix: str) -> list[tuple[int, int] | None]:
    """The sequence range of ``prefix`` each split uses (None: the split does not read it)."""
    if config.blend_per_split is None:  # one set of stores (blend or phases), cut by split
        return list(_split_bounds(config.split, int(num_sequences)))
    out: list[tuple[int, int] | None] = []
    for index in range(len(SPLIT_NAMES)):
        blend = config.blend_per_split[index]
        out.append((0, num_sequences) if blend is not None and blend.has_prefix(prefix) else None)
    return out


def ranges_for(config: BuildConfig, prefix: str):
    """The function :func:`tokenloom.builder.stores.fingerprint_store` needs for ``prefix``."""
    def ranges(num_sequences: int) -> list[tuple[int, int]]:
        return sorted({r for r in split_ranges(config, num_sequences, prefix) if r is not None})
    return ranges


PackSamples = Mapping[str, int]
"""``pack`` item key -> the samples its chunk packed (the pack phase's result)."""


def _gpt_item(config: BuildConfig, info: StoreInfo, split_index: int, begin: int, end: int,
              num_samples: int | None, pack_samples: PackSamples | None = None, *,
              run: Run = None) -> WorkItem:
    """The index of one store's split: ``run`` ``(seq_length, first_token, stream_tokens)`` makes it
    one length run of a schedule (concatenated samples; FORMAT.md "Length runs"), else the build's."""
    split = SPLIT_NAMES[split_index]
    if config.packing == "best_fit":
        return _best_fit_gpt_item(config, info, split, begin, end, num_samples, pack_samples)
    drop_last = True if split != "valid" else config.drop_last_partial_validation_sequence
    if config.mode == "stateless":
        drop_last = True  # the stateless index always drops a trailing partial sample
    tokens = info.tokens_in(begin, end)
    num_documents = end - begin
    if tokens <= 0:
        raise ConfigError(
            f"{info.prefix}: the {split} split (sequences {begin}..{end} of {info.num_sequences}) holds "
            f"no tokens; expected at least one; check the split string and the store"
        )
    seq_length = config.seq_length if run is None else run[0]
    if run is not None and run[1] is not None:  # a run of a store whose sequence length changes
        epoch_plan = plan_run_epochs(tokens, num_documents, first_token=run[1], num_samples=num_samples,
                                     seq_length=seq_length, add_extra_token=config.add_extra_token)
    else:  # the plan's rules depend on the token count only: plan one document holding every token
        epoch_plan = plan_epochs(np.array([tokens], dtype=np.int64), np.zeros(1, dtype=np.int64),
                                 num_samples=num_samples, seq_length=seq_length,
                                 add_extra_token=config.add_extra_token, drop_last_partial=drop_last)
        epoch_plan = dataclasses.replace(epoch_plan, num_documents=num_documents)
    num_epochs = epoch_plan.num_epochs
    samples = epoch_plan.num_samples_in_index
    positions = num_epochs * num_documents
    params: dict[str, Any] = {
        "format": CACHE_FORMAT_VERSION, "kind": "gpt", "mode": config.mode,
        "split": split, "store": info.fingerprint.to_dict(), "begin": begin, "end": end,
        "num_samples": num_samples,
        "seq_length": seq_length, "seed": config.seed, "add_extra_token": config.add_extra_token,
        "drop_last_partial": drop_last,
    }
    if run is not None and run[1] is not None:  # keyed only on a run: every other key stays as it was
        params["first_token"] = run[1]
    megatron = None
    if config.mode == "exact" and "first_token" in params:  # megatron's rules on a cut of one stream
        params["stream_epochs"] = stream_epochs_for(tokens, run[2])
        positions = min(params["stream_epochs"] * num_documents,
                        (samples * seq_length + 1) * num_documents // tokens + 2)  # the run's slice, about
        sample_row_bytes = 4 if positions <= np.iinfo(np.int32).max else 8
        shuffle_bytes = 4 if samples < np.iinfo(np.uint32).max - 1 else 8
        output_bytes = 4 * positions + 2 * sample_row_bytes * (samples + 1) + shuffle_bytes * samples
        # the stream's shuffle is every epoch's documents, as a whole index's is
        cost = gpt_cost(params["stream_epochs"] * num_documents, samples, output_bytes)
    elif config.mode == "exact":
        sample_row_bytes = 4 if positions <= np.iinfo(np.int32).max else 8
        shuffle_bytes = 4 if samples < np.iinfo(np.uint32).max - 1 else 8
        output_bytes = 4 * positions + 2 * sample_row_bytes * (samples + 1) + shuffle_bytes * samples
        cost = gpt_cost(positions, samples, output_bytes)
        identifiers = gpt_identifiers(
            dataset_path=config.spelling(info.prefix), num_samples=num_samples, split=split, random_seed=config.seed,
            sequence_length=seq_length, split_string=config.split,
            tokenizer=config.megatron_tokenizer)
        megatron = gpt_name(identifiers)
    else:
        output_bytes = 8 * (positions // 16 + 2) + 4096
        cost = stateless_gpt_cost(positions)
    label = f"gpt {split} {info.prefix}"
    if run is not None:
        label += f" (seq_length {seq_length}" + ("" if run[1] is None else f", run from token {run[1]:,}") + ")"
    return WorkItem(kind="gpt", key=hash_key(params), split=split, label=label,
                    params=params, num_samples=samples, output_bytes=output_bytes, cost_s=cost,
                    megatron=megatron, prefix=info.prefix, epoch_plan=epoch_plan)


def _best_fit_gpt_item(config: BuildConfig, info: StoreInfo, split: str, begin: int, end: int,
                       num_samples: int | None, pack_samples: PackSamples | None) -> WorkItem:
    from tokenloom.builder import best_fit

    if info.tokens_in(begin, end) <= 0:
        raise ConfigError(
            f"{info.prefix}: the {split} split (sequences {begin}..{end} of {info.num_sequences}) holds "
            f"no tokens; expected at least one; check the split string and the store")
    packs = best_fit.pack_items(config, info, begin, end, WorkItem)
    try:
        counts = [int(pack_samples[item.key]) for item in packs] if pack_samples is not None else None
    except KeyError:
        counts = None
    if counts is None:
        raise BuildError(f"{info.prefix}: the {split} split's best-fit chunks were not packed before planning "
                         "(a best-fit plan needs their sample counts)")
    params = best_fit.gpt_params(config, info, split, begin, end, num_samples, packs)
    plan = best_fit.plan_of(params, counts)
    return WorkItem(kind="gpt", key=hash_key(params), split=split, label=f"gpt {split} {info.prefix}",
                    params=params, num_samples=plan.num_samples, output_bytes=8 * len(packs) + 4096,
                    cost_s=COST_PER_ITEM_S, prefix=info.prefix, packs=tuple(packs))


def all_pack_items(config: BuildConfig, infos: Mapping[str, StoreInfo]) -> list[WorkItem]:
    """Every ``pack`` item of a best-fit build, each once, in a fixed order (the same on every rank)."""
    from tokenloom.builder import best_fit

    out: dict[str, WorkItem] = {}
    for prefix in config.prefixes:
        info = infos[prefix]
        for bounds in ranges_for(config, prefix)(info.num_sequences):
            if info.tokens_in(*bounds) <= 0:
                continue  # the split's gpt item reports it
            for item in best_fit.pack_items(config, info, *bounds, WorkItem):
                out.setdefault(item.key, item)
    return list(out.values())


def _blend_item(config: BuildConfig, split_index: int, datasets: list[WorkItem], weights: list,
                size: int | None) -> WorkItem:
    split = SPLIT_NAMES[split_index]
    exhaustive = size is None
    total = int(sum(weights)) if exhaustive else int(size)
    params: dict[str, Any] = {
        "format": CACHE_FORMAT_VERSION, "kind": "blend", "mode": config.mode,
        "weights": list(weights), "size": size, "seed": config.seed,
        "datasets": [d.key for d in datasets],
        "dataset_lengths": [d.num_samples for d in datasets],
    }
    megatron = None
    if config.mode == "exact":
        output_bytes = total * (np.dtype(np.int16).itemsize + 8)
        cost = blend_cost(total, output_bytes)
        if config.packing == "concat":  # megatron-core has no best-fit datasets to name
            megatron = blend_name(
                datasets=[_identifiers_of(d) for d in datasets], split=split, weights=list(weights), size=size)
    else:
        output_bytes = 4096
        cost = stateless_blend_cost(len(datasets))
    return WorkItem(kind="blend", key=hash_key(params), split=split,
                    label=f"blend {split} of {len(datasets)} datasets", params=params,
                    num_samples=total, output_bytes=output_bytes, cost_s=cost, megatron=megatron)


def _is_schedule(config: BuildConfig, split_index: int) -> bool:
    """Whether split ``split_index`` is served by the schedule's own blend: the train split of a
    config of several phases (either mode)."""
    return config.phases is not None and split_index == 0


def _schedule_item(config: BuildConfig, prefixes, datasets: list[WorkItem]) -> WorkItem:
    """The train split's blend of a schedule build, keyed by everything that places and counts
    its samples. Stateless: the kernel's closed-form plan, storing the counts per phase. Exact:
    megatron-core's greedy per phase laid end to end (one item, divided over the ranks as a single
    exact blend is), so its size is the phases' exact sizes (the last phase's megatron size
    included) and it costs what a single blend of that size costs."""
    plan = config.schedule_plan()
    column = {prefix: d for d, prefix in enumerate(config.schedule_stores.prefixes)}
    served = [column[prefix] for prefix in prefixes]
    schedule = schedule_blend_params(plan, served, int(config.seq_length), run_counts(plan, config.mode))
    # the split's datasets are its stores, or their length runs (schedule["columns"])
    weights = [float(plan.totals[d]) for d in served] if "columns" not in schedule else \
        [float(column[-1]) for column in schedule["columns"]]
    params: dict[str, Any] = {
        "format": CACHE_FORMAT_VERSION, "kind": "blend", "mode": config.mode,
        "weights": weights, "size": plan.num_samples, "seed": config.seed,
        "datasets": [d.key for d in datasets],
        "dataset_lengths": [d.num_samples for d in datasets],
        "schedule": schedule,
    }
    label = f"schedule train of {plan.num_phases} phases over {len(datasets)} datasets"
    if config.mode == "exact":
        last = plan_exact_phases(plan)[-1]
        total = last.start + last.size
        output_bytes = total * (np.dtype(np.int16).itemsize + 8)
        return WorkItem(kind="blend", key=hash_key(params), split="train", label=label, params=params,
                        num_samples=total, output_bytes=output_bytes, cost_s=blend_cost(total, output_bytes))
    return WorkItem(kind="blend", key=hash_key(params), split="train", label=label,
                    params=params, num_samples=plan.num_samples, output_bytes=4096 + 8 * plan.counts.size,
                    cost_s=stateless_blend_cost(len(datasets)))


def _identifiers_of(item: WorkItem):
    return item.megatron.identifiers


Run = tuple[int, int | None, int | None] | None
"""A dataset of a split that is a schedule's length run: ``(seq_length, first_token,
stream_tokens)`` (``stream_tokens``: exact mode, a store of several runs, the tokens its runs read
in all); None for the build's index of the store."""


def _split_datasets(config: BuildConfig, blend, split_index: int, size: int | None,
                    infos: Mapping[str, StoreInfo]) -> list[tuple[str, int | None, Run]]:
    """A split's datasets as ``(prefix, num_samples, run)``: one per store of ``blend``
    (:func:`_dataset_sizes`), except the train split of a schedule that changes the sequence
    length, whose datasets are its stores' length runs (:func:`~tokenloom.builder.schedule.schedule_columns`).
    In exact mode a run holds megatron's targets of its phases and a store's last run megatron's
    buffer over them (so a store of one run is sized as without runs); every run of a store of
    several cuts one stream of the epochs they reach in all (``stream_tokens``)."""
    plan = config.schedule_plan() if _is_schedule(config, split_index) else None
    if not has_length_runs(plan, int(config.seq_length)):
        sizes = _dataset_sizes(config, blend, split_index, size, infos)
        return [(prefix, n, None) for prefix, n in zip(blend.prefixes, sizes)]
    union = {prefix: d for d, prefix in enumerate(config.schedule_stores.prefixes)}
    columns = schedule_columns(plan, [union[prefix] for prefix in blend.prefixes], run_counts(plan, config.mode))
    prefixes = config.schedule_stores.prefixes
    sizes = [c.samples for c in columns]
    if config.mode == "exact":  # a store's last run: megatron's buffer over its targets
        for c, column in enumerate(columns):
            if c + 1 == len(columns) or columns[c + 1].store != column.store:
                sizes[c] = math.ceil(column.samples * (1 + config.mid_level_dataset_surplus))
    reach: dict[int, int] = {}  # store -> the stream tokens its runs read in all (exact mode)
    for column, n in zip(columns, sizes):
        if config.mode == "exact" and column.first_token is not None:
            reach[column.store] = column.first_token + n * column.seq_length + int(config.add_extra_token)
    return [(prefixes[c.store], n, (c.seq_length, c.first_token, reach.get(c.store)))
            for c, n in zip(columns, sizes)]


def _dataset_sizes(config: BuildConfig, blend, split_index: int, size: int | None,
                   infos: Mapping[str, StoreInfo]) -> list[int | None]:
    """The ``num_samples`` each store's ``gpt`` item of a split is built for: megatron-core's
    buffers, tokenloom's stateless counts, a schedule's totals (plus its headroom), the split's
    size for a store read directly, or None (every sample of an epoch: unweighted blends)."""
    split = SPLIT_NAMES[split_index]
    if _is_schedule(config, split_index):  # each store holds what the whole schedule takes of it
        totals = config.schedule_plan().totals
        if config.mode == "exact":  # megatron's buffer over the greedy's targets of every phase
            totals = exact_buffers(plan_exact_phases(config.schedule_plan()),
                                   surplus=config.mid_level_dataset_surplus)
        column = {prefix: d for d, prefix in enumerate(config.schedule_stores.prefixes)}
        sizes = [int(totals[column[prefix]]) for prefix in blend.prefixes]
        if config.headroom:
            sizes = _with_headroom(config, blend.prefixes, sizes, infos)
        return sizes
    if len(blend.prefixes) == 1 and (blend.weights is None or config.blend_per_split is not None):
        return [size]  # one store read directly
    if blend.weights is None:
        return [None] * len(blend.prefixes)
    if size is None:
        raise ConfigError(
            f"{split}_samples is None but the {split} blend has weights; megatron-core needs a "
            f"sample count to blend by weight: set {split}_samples or drop the weights")
    if config.mode == "stateless":
        from tokenloom.index.blend import largest_remainder_counts

        weights = megatron_normalize(blend.weights).tolist()
        return [int(n) for n in largest_remainder_counts(np.asarray(weights), size).tolist()]
    return list(blend.megatron_sizes(size, surplus=config.mid_level_dataset_surplus).buffers)


def _with_headroom(config: BuildConfig, prefixes, sizes: list[int], infos: Mapping[str, StoreInfo]) -> list[int]:
    """``sizes`` grown by the config's headroom, each never past its store's ``max_epochs`` (nor
    below what the schedule itself takes). The epoch is read from the store's info where this
    rank has it; a store without one here is sized by another rank, which has it."""
    grown = [math.ceil(n * (1.0 + config.headroom)) for n in sizes]
    if config.max_epochs is None:
        return grown
    present = {p: infos[p] for p in prefixes if p in infos}
    room = epoch_room(config.max_epochs, list(prefixes), train_samples_per_epoch(config, present))
    return [max(n, min(g, int(r))) for n, g, r in zip(sizes, grown, room.tolist())]


GptItems = dict[tuple[str, int, int, int, int | None, Run], WorkItem]
"""``(prefix, split_index, begin, end, num_samples, run) -> WorkItem``: dataset items already made."""


def train_samples_per_epoch(config: BuildConfig, infos: Mapping[str, StoreInfo],
                            pack_samples: PackSamples | None = None) -> dict[str, int]:
    """Samples one epoch of each train store's train documents holds, by store, from the
    fingerprints alone: megatron-core's ``(tokens - add_extra_token) // seq_length`` (concat, in
    either mode), or the samples of its best-fit chunks where ``pack_samples`` has them all."""
    blend = config.blend_for_split(0)
    out: dict[str, int] = {}
    for prefix in () if blend is None else blend.prefixes:
        info = infos.get(prefix)
        bounds = None if info is None else split_ranges(config, info.num_sequences, prefix)[0]
        if bounds is None:
            continue
        if config.packing == "best_fit":
            from tokenloom.builder import best_fit

            keys = [item.key for item in best_fit.pack_items(config, info, *bounds, WorkItem)]
            if pack_samples is not None and all(key in pack_samples for key in keys):
                out[prefix] = sum(int(pack_samples[key]) for key in keys)
        else:
            out[prefix] = max(0, (info.tokens_in(*bounds) - int(config.add_extra_token)) // config.seq_length)
    return out


def dataset_items(config: BuildConfig, infos: Mapping[str, StoreInfo],
                  pack_samples: PackSamples | None = None) -> GptItems:
    """The ``gpt`` items of the stores in ``infos`` (any subset of the config's stores): the part
    of planning that grows with the stores, which ranks divide and then share with
    :func:`resolve_items`."""
    made: GptItems = {}
    sizes = config.samples_per_split
    for split_index in range(len(SPLIT_NAMES)):
        blend = config.blend_for_split(split_index)
        if blend is None:
            continue
        if not any(p in infos and split_ranges(config, infos[p].num_sequences, p)[split_index] is not None
                   for p in blend.prefixes):
            continue  # none of these stores is read by this split
        for prefix, n, run in _split_datasets(config, blend, split_index, sizes[split_index], infos):
            if prefix in infos:
                _make_gpt(config, infos, made, prefix, split_index, n, pack_samples, run=run)
    return made


def _make_gpt(config: BuildConfig, infos, made: GptItems, prefix: str, split_index: int, n,
              pack_samples: PackSamples | None = None, *, run: Run = None) -> WorkItem | None:
    info = infos[prefix]
    bounds = split_ranges(config, info.num_sequences, prefix)[split_index]
    if bounds is None:
        return None
    key = (prefix, split_index, *bounds, n, run)
    item = made.get(key)
    if item is None:
        item = made[key] = _gpt_item(config, info, split_index, *bounds, n, pack_samples, run=run)
    return item


def resolve_items(config: BuildConfig, infos: Mapping[str, StoreInfo], made: GptItems | None = None,
                  pack_samples: PackSamples | None = None) -> tuple[list[WorkItem], list[SplitPlan]]:
    """Items and splits of ``config`` given every store's info, megatron-core's builder semantics.

    ``made``: dataset items already made (:func:`dataset_items`, by this rank or gathered from
    others); the rest are made here. ``pack_samples``: a best-fit build's chunk sample counts.
    ``config`` must be resolved (:meth:`BuildConfig.resolve`, which ``tokenloom.build`` calls).
    """
    if not config.resolved:  # an epoch budget left unresolved would read as an unweighted blend
        raise ConfigError("the config's epoch budgets are not resolved yet: call config.resolve() (it reads "
                          "the stores' .idx) before planning, as tokenloom.build does")
    made = {} if made is None else made
    items: dict[str, WorkItem] = {}
    splits: list[SplitPlan] = []
    sizes = config.samples_per_split
    for split_index, split in enumerate(SPLIT_NAMES):
        blend = config.blend_for_split(split_index)
        if blend is None:
            continue
        ranges = [split_ranges(config, infos[p].num_sequences, p)[split_index] for p in blend.prefixes]
        if any(r is None for r in ranges):
            continue  # the split string gives this split no weight
        size = sizes[split_index]
        columns = _split_datasets(config, blend, split_index, size, infos)
        datasets = [_make_gpt(config, infos, made, p, split_index, n, pack_samples, run=run)
                    for p, n, run in columns]
        for item in datasets:  # a best-fit dataset's chunks come before it
            for pack in item.packs:
                items.setdefault(pack.key, pack)
        if len(datasets) == 1 and (blend.weights is None or config.blend_per_split is not None):
            item = datasets[0]
            items.setdefault(item.key, item)
            splits.append(SplitPlan(name=split, prefixes=blend.prefixes, dataset_keys=(item.key,),
                                    blend_key=None, num_samples=item.num_samples))
            continue
        if _is_schedule(config, split_index):
            blend_item = _schedule_item(config, blend.prefixes, datasets)
        else:
            blend_item = _blend_item(config, split_index, datasets, *_blend_sizes(config, blend, datasets, size))
        for item in datasets:
            items.setdefault(item.key, item)
        items.setdefault(blend_item.key, blend_item)
        splits.append(SplitPlan(name=split, prefixes=tuple(p for p, _, _ in columns),
                                dataset_keys=tuple(d.key for d in datasets),
                                blend_key=blend_item.key, num_samples=blend_item.num_samples))
    return list(items.values()), splits


def _blend_sizes(config: BuildConfig, blend, datasets: list[WorkItem], size: int | None) -> tuple[list, int | None]:
    """The weights and size of a split's blend item: tokenloom's (stateless) or megatron-core's."""
    if config.mode == "stateless":
        return _stateless_sizes(blend, datasets, size)
    if blend.weights is not None:
        megatron = blend.megatron_sizes(size, surplus=config.mid_level_dataset_surplus)
        return list(megatron.blend_weights), megatron.blended_size
    blend_weights = [d.num_samples for d in datasets]
    if size is None:
        return blend_weights, None
    return megatron_normalize(blend_weights).tolist(), min(size, sum(blend_weights))


def _stateless_sizes(blend, datasets: list[WorkItem], size: int | None) -> tuple[list[float], int]:
    """tokenloom's sizing: exactly ``size`` samples from largest-remainder counts (each dataset
    built with exactly its count, no surplus), or every sample of the datasets."""
    if blend.weights is not None:
        return megatron_normalize(blend.weights).tolist(), int(size)
    lengths = [d.num_samples for d in datasets]
    total = sum(lengths) if size is None else min(size, sum(lengths))
    return megatron_normalize(lengths).tolist(), int(total)


def divide_blends(blends: list[WorkItem], loads: list[float], block: int) -> dict[str, tuple[int, ...]]:
    """Cut every blend into one range of positions per rank so that, with the ``loads`` the
    ranks already carry, the ranks' total estimated seconds are as equal as the cuts allow.

    The blends are laid end to end on one line of positions and the line is cut where each
    rank's share ends; a rank's share is what lifts its load to the common level (water
    filling), so a rank with many dataset items gets fewer positions. Cuts fall on multiples
    of ``block`` positions (the unit of the array hashes) within each blend, so each rank's
    range of a blend is whole blocks but the last. Deterministic: every rank computes the same
    bounds.
    """
    world = len(loads)
    if not blends:
        return {}
    per_position = [(item.cost_s - COST_PER_ITEM_S) / max(1, item.num_samples) for item in blends]
    total = sum(p * item.num_samples for p, item in zip(per_position, blends))
    # the level L with sum(max(0, L - load)) == total
    order = sorted(loads)
    level, filled = order[0], 0.0
    for k in range(world):
        nxt = order[k + 1] if k + 1 < world else float("inf")
        room = (nxt - order[k]) * (k + 1)
        if filled + room >= total:
            level = order[k] + (total - filled) / (k + 1)
            break
        filled += room
    shares = [max(0.0, level - load) for load in loads]  # seconds of blend work per rank
    # cut the line of blend seconds at the ranks' cumulative shares
    ends, running = [], 0.0
    for share in shares:
        running += share
        ends.append(running)
    out: dict[str, tuple[int, ...]] = {}
    offset_s = 0.0
    for item, p in zip(blends, per_position):
        size = item.num_samples
        bounds = [0]
        for rank in range(world - 1):
            seconds_into = min(max(ends[rank] - offset_s, 0.0), p * size)
            position = round(seconds_into / p) if p > 0 else size
            position = min(size, max(bounds[-1], (position // block) * block if position < size else size))
            bounds.append(position)
        bounds.append(size)
        out[item.key] = tuple(bounds)
        offset_s += p * size
    return out


def assign_lpt(items: list[WorkItem], world_size: int, initial: list[float] | None = None) -> dict[str, int]:
    """Longest processing time first: each item, costliest first, to the least-loaded rank
    (ties to the lowest rank), the ranks starting from the ``initial`` loads (default none);
    deterministic, so every rank computes the same assignment."""
    heap = [(0.0 if initial is None else initial[rank], rank) for rank in range(world_size)]
    heapq.heapify(heap)
    assignment: dict[str, int] = {}
    for item in sorted(items, key=lambda item: (-item.cost_s, item.key)):
        load, rank = heapq.heappop(heap)
        assignment[item.key] = rank
        heapq.heappush(heap, (load + item.cost_s, rank))
    return assignment


def plan_build(config: BuildConfig, infos: Mapping[str, StoreInfo], world_size: int,
               done: frozenset[str] = frozenset(), made: GptItems | None = None) -> BuildPlan:
    """The plan: every item, the splits, and the ranks that build the items not in ``done``
    (``made``: dataset items already made, see :func:`resolve_items`)."""
    check_positive_int("world_size", world_size)
    items, splits = resolve_items(config, infos, made)
    return assign_work(config, items, splits, world_size, [item for item in items if item.key not in done])


def is_divided(config: BuildConfig, item: WorkItem) -> bool:
    """Whether ``item`` is built by every rank, a range each: exact-mode blends, a schedule's
    included (its phases' greedies laid end to end run as one greedy does: ``ScheduleGreedy``)."""
    return config.mode == "exact" and item.kind == "blend"


def assign_work(config: BuildConfig, items, splits, world_size: int, todo: list[WorkItem],
                writers: tuple[int, ...] = (0,)) -> BuildPlan:
    """The plan with ``todo`` spread over the ranks: single-rank items by longest processing time
    first, then every exact blend cut into ranges that even out the ranks' loads. The ``writers``
    (rank 0, or each node's first rank without a shared filesystem) start with the manifest they
    write when anything is built.

    The cuts fall on whole blocks, so two ranks' shares of a blend may differ by a block (2**20
    positions by default, as much work as many small dataset items). So the single items are
    then assigned again, starting from each rank's manifest and blend ranges: a rank with an extra
    block takes fewer items. Of the two plans, the one whose slowest rank is estimated faster
    stands (the first on a tie)."""
    fixed = [0.0] * world_size
    if todo:
        for rank in writers:
            fixed[rank] = COST_PER_MANIFEST_ITEM_S * len(items)
    single = [item for item in todo if not is_divided(config, item)]
    assignment = assign_lpt(single, world_size, fixed)
    loads = list(fixed)
    by_key = {item.key: item for item in single}
    for key, rank in assignment.items():
        loads[rank] += by_key[key].cost_s
    divided = divide_blends([item for item in todo if is_divided(config, item)], loads,
                            config.blend_block_samples)
    plan = BuildPlan(items=tuple(items), splits=tuple(splits), world_size=world_size, assignment=assignment,
                     divided=divided, fixed_s=tuple(fixed))
    if not divided or not single:
        return plan
    blend_loads = BuildPlan(items=tuple(items), splits=tuple(splits), world_size=world_size, assignment={},
                            divided=divided, fixed_s=tuple(fixed)).seconds_per_rank()
    again = dataclasses.replace(plan, assignment=assign_lpt(single, world_size, blend_loads))
    return again if max(again.seconds_per_rank()) < max(plan.seconds_per_rank()) else plan


def format_plan(plan: BuildPlan, *, done: frozenset[str] = frozenset(), cache_dir: str | None = None) -> str:
    """The dry-run report: items per rank, estimated seconds, memory and cache size (against the
    space free in ``cache_dir``'s filesystem, when given)."""
    loads = plan.seconds_per_rank()
    by_rank: dict[int, list[WorkItem]] = {r: plan.items_of_rank(r) for r in range(plan.world_size)}
    cached = sum(1 for item in plan.items if item.key in done)
    chunks = sum(item.kind == "pack" for item in plan.items)
    lines = [
        f"{len(plan.items)} items ({sum(i.kind == 'gpt' for i in plan.items)} dataset indices, "
        f"{sum(i.kind == 'blend' for i in plan.items)} blends"
        + (f", {chunks} packed chunks" if chunks else "") + f"), {cached} already in the cache, "
        f"{len(plan.assignment) + len(plan.divided)} to build on {plan.world_size} rank(s)",
    ]
    for item in plan.divided_items():
        bounds = plan.divided[item.key]
        working = sum(1 for r in range(plan.world_size) if bounds[r + 1] > bounds[r])
        lines.append(f"  {item.label}: {item.num_samples:,} positions divided over {working} rank(s)")
    for split in plan.splits:
        lines.append(f"  {split.name}: {split.num_samples:,} samples from {len(split.prefixes)} store(s)"
                     + ("" if split.blend_key is None else " (blended)"))
    lines.append(f"  {'rank':>6} {'items':>7} {'est. s':>9} {'peak MiB':>9}")
    shown = plan.world_size if plan.world_size <= 16 else 8
    for rank in range(shown):
        mine = by_rank[rank]
        ranges = [i.output_bytes * (plan.divided[i.key][rank + 1] - plan.divided[i.key][rank]) // max(1, i.num_samples)
                  for i in plan.divided_items()]
        peak = max([i.output_bytes * 2 for i in mine] + ranges + [0])
        lines.append(f"  {rank:>6} {len(mine):>7} {loads[rank]:>9.2f} {peak / 2**20:>9.1f}")
    if shown < plan.world_size:
        lines.append(f"  ... {plan.world_size - shown} more ranks")
    total = sum(loads)
    lines.append(f"  total {total:.2f} s of work; slowest rank {max(loads, default=0.0):.2f} s "
                 f"(set the job's timeout above this)")
    lines.append(f"  cache size {plan.cache_bytes / 2**20:,.1f} MiB")
    if cache_dir is not None:
        from tokenloom.io.space import format_bytes, free_bytes

        to_write = sum(item.output_bytes for item in plan.items if item.key not in done)
        free = free_bytes(cache_dir)
        verdict = "" if free is None else (f"; {format_bytes(free)} free there: enough" if to_write <= free else
                                           f"; only {format_bytes(free)} free there: the build would stop before "
                                           "writing")
        lines.append(f"  to write {format_bytes(to_write)} into {cache_dir}{verdict}")
    return "\n".join(lines)


__all__ = [
    "BuildPlan", "PackSamples", "SplitPlan", "WorkItem", "all_pack_items", "assign_lpt", "assign_work",
    "dataset_items", "divide_blends", "format_plan", "is_divided", "plan_build", "ranges_for",
    "resolve_items", "split_ranges", "train_samples_per_epoch",
]
