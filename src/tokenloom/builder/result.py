"""What a build hands the serving stage: every split as a sample source, opened by mmap.

``BuildResult.split("train")`` returns a :class:`~tokenloom.source.blended.BlendedSource` (a
:class:`~tokenloom.source.protocol.SampleSource`): ``locate(positions)`` gives ``(dataset_ids,
sample_ids)`` and ``read_samples`` their tokens, exactly as megatron-core's ``BlendedDataset``
(exact mode) would serve them. The build makes one reader per dataset (megatron-core's arrays,
the stateless index or the best-fit chunks) and one locator per split (megatron-core's blend arrays, the closed-form
blend or schedule, or a single dataset read directly). Nothing is copied into memory: the arrays are
read-only memory maps of the cache files, so every rank of a job can open the same build cheaply,
and a dataset's store and arrays are opened on its first read (a blend of 10,000 stores holds no
store open until it serves from it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from tokenloom.builder.best_fit import open_index as open_best_fit_index
from tokenloom.builder.cache import Cache
from tokenloom.builder.fim import fim_settings
from tokenloom.builder.items import BuildPlan, SplitPlan, WorkItem
from tokenloom.builder.schedule import run_counts
from tokenloom.builder.stateless import open_stateless_gpt_index, schedule_plan, stateless_blend
from tokenloom.errors import ConfigError
from tokenloom.index.best_fit_index import BestFitIndex, BestFitPlan
from tokenloom.index.megatron_gpt import GPTIndices
from tokenloom.index.stateless import StatelessGPTIndex
from tokenloom.source.blended import ArrayLocator, BlendedSource, BlendLocator, DirectLocator, ScheduleLocator
from tokenloom.source.fim_options import FimConfig
from tokenloom.source.protocol import Locator
from tokenloom.source.readers import BestFitReader, DatasetReader, MegatronReader, StatelessReader, StoreOpener


class _IndexOpener:
    """Opens the index of one ``gpt`` item around its memory-mapped cache arrays, on a reader's
    first read (picklable: a DataLoader worker started by spawn maps the arrays itself)."""

    def __init__(self, cache: Cache, item: WorkItem, mode: str, store: StoreOpener) -> None:
        self.cache, self.key, self.mode, self.store = cache, item.key, mode, store
        self.epoch_plan, self.seed = item.epoch_plan, int(item.params["seed"])
        self.best_fit = item.params.get("packing") == "best_fit"
        self.name = item.label

    def __call__(self) -> GPTIndices | StatelessGPTIndex | BestFitIndex:
        cache, key = self.cache, self.key
        if self.best_fit:
            return open_best_fit_index(cache, key, self.name)
        if self.mode == "stateless":
            return open_stateless_gpt_index(self.store(), cache.read_record(key),
                                            cache.open_array(key, "block_token_starts"),
                                            cache.open_array(key, "document_keys"))
        return GPTIndices(document_index=cache.open_array(key, "document_index"),
                          sample_index=cache.open_array(key, "sample_index"),
                          shuffle_index=cache.open_array(key, "shuffle_index"),
                          plan=self.epoch_plan, seed=self.seed)


class _ArrayOpener:
    """Maps one array of a cache item when called (picklable: a copy maps it in its own process)."""

    def __init__(self, cache: Cache, key: str, name: str) -> None:
        self.cache, self.key, self.name = cache, key, name

    def __call__(self):
        return self.cache.open_array(self.key, self.name)


@dataclasses.dataclass(frozen=True)
class PackingReport:
    """One split's best-fit packing, over one epoch of each of its datasets."""

    documents: int
    """Documents packed."""
    cut_documents: int
    """Documents longer than a sample, cut into sample-length pieces (they span several samples)."""
    tokens: int
    """Document tokens in the samples."""
    samples_per_epoch: int
    """Samples that hold them."""
    padding_fraction: float
    """The share of those samples' tokens that is padding."""


class BuildResult:
    """A finished build: the splits, the plan, the cache files, timings. Opened by mmap."""

    def __init__(self, *, cache: Cache, plan: BuildPlan, build_key: str, mode: str, manifest_path: str | None,
                 seq_length: int, add_extra_token: bool, weights: Mapping[str, tuple[float, ...]],
                 timings: Mapping[str, float], built_keys: frozenset[str], rank: int,
                 budgets: Mapping[str, Mapping[str, int]] | None = None, fim: FimConfig | None = None,
                 seed: int = 0) -> None:
        self.cache = cache
        self.plan = plan
        self.build_key = build_key
        """Hash of the array-affecting config and every item key."""
        self.manifest_path = manifest_path
        """This build's manifest in the cache (as seen from this rank)."""
        self.timings = dict(timings)
        """Seconds spent in each phase on this rank."""
        self.built_keys = built_keys
        """Items built by this run (all ranks); the rest came from the cache."""
        self.rank = rank
        """This process's rank in the build's group."""
        self.mode = mode
        """``exact`` or ``stateless``."""
        self.traffic = None
        """This rank's collectives (a ``tokenloom.builder.collective.Traffic``: calls, bytes it
        sent, seconds inside them) over the whole build."""
        self.warm_start = False
        """True when this start took its plan from the warm-start record (nothing fingerprinted or
        planned: :mod:`tokenloom.builder.starts`)."""
        self.rank_seconds: list[dict[str, float]] = []
        """Per rank of the build: ``predicted_s`` (the plan's estimate of its work on one core),
        ``wall_s`` and ``cpu_s`` (measured in the build phase; CPU of every thread and of the
        shuffle workers)."""
        stores: dict[str, StoreOpener] = {}
        self._items = {item.key: item for item in plan.items}
        self._splits: dict[str, BlendedSource] = {}
        self.fim = None if fim is None else fim_settings(
            fim, seed=seed, prefixes=[p for split in plan.splits for p in split.prefixes],
            metadata_of=lambda prefix: stores.setdefault(prefix, StoreOpener(prefix))().metadata)
        """The config's fill-in-the-middle as every split serves it (None: no ``fim``)."""
        for split in plan.splits:
            self._splits[split.name] = self._open_split(split, stores, seq_length, add_extra_token,
                                                        weights[split.name], (budgets or {}).get(split.name))

    def _open_split(self, split: SplitPlan, stores, seq_length, add_extra_token, weights,
                    budgets: Mapping[str, int] | None = None) -> BlendedSource:
        readers: list[DatasetReader] = []
        for prefix, key in zip(split.prefixes, split.dataset_keys):
            item = self._items[key]
            if item.params.get("packing") == "best_fit":
                reader_class: type[DatasetReader] = BestFitReader
            else:
                reader_class = StatelessReader if self.mode == "stateless" else MegatronReader
            if prefix not in stores:
                stores[prefix] = StoreOpener(prefix)
            # nothing is opened here: a reader opens its store and its arrays on its first read
            opener = _IndexOpener(self.cache, item, self.mode, stores[prefix])
            readers.append(reader_class(name=prefix, store=stores[prefix], key=key, prefix=prefix, indices=opener,
                                        num_samples=item.num_samples))
        locator: Locator
        schedule = None
        if split.blend_key is not None and "schedule" in self._items[split.blend_key].params:
            params = self._items[split.blend_key].params
            plan, served = schedule_plan(params)
            counts = None if "columns" not in params["schedule"] else run_counts(plan, self.mode)
            schedule = ScheduleLocator(plan, served, columns=params["schedule"].get("columns"), counts=counts)
        if split.blend_key is None:
            locator = DirectLocator(split.num_samples)
        elif self.mode == "stateless" and schedule is not None:
            locator = schedule
        elif self.mode == "stateless":
            locator = BlendLocator(stateless_blend(self._items[split.blend_key].params))
        else:
            locator = ArrayLocator(_ArrayOpener(self.cache, split.blend_key, "dataset_index"),
                                   _ArrayOpener(self.cache, split.blend_key, "dataset_sample_index"),
                                   num_samples=split.num_samples)
        return BlendedSource(readers=readers, weights=weights, locator=locator, seq_length=seq_length,
                             add_extra_token=add_extra_token, build_key=self.build_key, name=split.name,
                             budgets=None if budgets is None else [budgets.get(p) for p in split.prefixes],
                             schedule=schedule, seq_lengths=None if schedule is None else schedule.seq_lengths,
                             fim=self.fim)

    def packing_report(self) -> dict[str, PackingReport]:
        """What best-fit packing reached, by split (empty for concatenated samples): one epoch of
        every dataset of the split, from the records the build wrote."""
        out = {}
        for split in self.plan.splits:
            records = [self.cache.read_record(key) for key in split.dataset_keys
                       if self._items[key].params.get("packing") == "best_fit"]
            if not records:
                continue
            capacity = BestFitPlan.from_dict(records[0]["plan"]).sample_num_tokens
            samples = sum(BestFitPlan.from_dict(r["plan"]).samples_per_epoch for r in records)
            tokens = sum(int(r["num_tokens"]) for r in records)
            out[split.name] = PackingReport(
                documents=sum(int(r["num_documents"]) for r in records),
                cut_documents=sum(int(r["cut_documents"]) for r in records), tokens=tokens,
                samples_per_epoch=samples, padding_fraction=1.0 - tokens / (samples * capacity))
        return out

    @property
    def splits(self) -> dict[str, BlendedSource]:
        """The splits that have data, by name."""
        return dict(self._splits)

    def split(self, name: str) -> BlendedSource:
        """One split (``train``, ``valid``, ``test``) as a ``SampleSource``."""
        if name not in self._splits:
            raise ConfigError(f"split {name!r} has no data in this build; it has {sorted(self._splits)}")
        return self._splits[name]

    def __repr__(self) -> str:
        parts = ", ".join(f"{n}={len(s)}" for n, s in self._splits.items())
        return f"BuildResult({self.cache.root!r}, {parts}, build_key={self.build_key[:12]})"


__all__ = ["BuildResult", "PackingReport"]

