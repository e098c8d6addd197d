"""What a build makes: the blend, the split, the sample counts, and how the indices are built.

A build config speaks Megatron-LM's vocabulary (``blend`` or ``blend_per_split``, ``split``,
``seq_length``, ``seed``, samples per split or ``train_iters`` x ``global_batch_size``,
``add_extra_token``) so a Megatron job's data arguments carry over unchanged. Instead of ``blend``
and a train length it may give a mixture schedule, ``phases`` (:mod:`tokenloom.builder.schedule`).
It is a frozen dataclass; :func:`load_build_config` reads one from a YAML or JSON file.

Only some fields change the arrays (:data:`ARRAY_FIELDS`); the cache key hashes exactly those (see
:mod:`tokenloom.builder.cache`). The rest say where and how to build (cache directory, timeouts).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from tokenloom.builder.schedule import (
    PhaseSpec,
    batch_size_steps,
    epoch_room,
    format_length_runs,
    format_schedule,
    has_length_runs,
    plan_phases,
    read_max_epochs,
    read_phases,
    run_counts,
    train_steps,
    union_stores,
)
from tokenloom.errors import ConfigError
from tokenloom.index.blend_spec import DEFAULT_SURPLUS, BlendSpec
from tokenloom.index.schedule import SchedulePlan
from tokenloom.index.split import SPLIT_NAMES, parse_split
from tokenloom.source.fim_options import FimConfig
from tokenloom.validate import check_non_negative_int, check_number, check_positive_int, is_number

#: Index-building modes: Megatron-exact arrays, or tokenloom's stateless (Feistel) index.
MODES = ("exact", "stateless")
#: How documents become samples: concatenated and chunked (Megatron's), or packed whole, best fit.
PACKINGS = ("concat", "best_fit")


# long: one field per Megatron-LM data argument, each documented where it is declared, and the
# checks of their values beside them; what reads files is resolve(), what resolves paths is four
# small helpers. Splitting would scatter one user-facing contract over several places.
@dataclass(frozen=True, kw_only=True)
class BuildConfig:
    """A blend turned into ready indices for every split. Fields follow Megatron-LM's names."""

    seq_length: int
    """Tokens per sample (Megatron's ``--seq-length``), not counting the extra label token."""

    blend: BlendSpec | None = None
    """Megatron's ``--data-path``: every split is cut from these stores by ``split``."""

    blend_per_split: tuple[BlendSpec | None, BlendSpec | None, BlendSpec | None] | None = None
    """Megatron's ``--train/valid/test-data-path``: one blend per split (train, valid, test)."""

    phases: tuple[PhaseSpec, ...] | None = None
    """A mixture schedule instead of ``blend`` and a train length: phases in training order, each
    ``{blend, until: {tokens|steps|samples: N}, ramp: linear, seq_length}`` (mappings are read
    into :class:`~tokenloom.builder.schedule.PhaseSpec`). One phase is rewritten into ``blend`` and
    ``train_samples`` (today's build, key for key); several are planned (:meth:`schedule_plan`)
    and built in either mode, with either packing."""

    split: str | None = None
    """Megatron's split string such as ``"969,30,1"``; required with ``blend`` or ``phases``,
    unused otherwise."""

    train_samples: int | None = None
    """Samples the train split must provide (``train_iters x global_batch_size``); None: one epoch."""

    valid_samples: int | None = None
    """Samples the validation split must provide; None: one epoch."""

    test_samples: int | None = None
    """Samples the test split must provide; None: one epoch."""

    global_batch_size: int | None = None
    """Megatron's ``--global-batch-size``: samples per optimizer step (the final size under a ramp).
    Required with ``phases`` (a phase ends at a step's end, ``until: {steps: N}`` counts steps);
    with ``train_iters`` it gives ``train_samples``."""

    rampup_batch_size: tuple[int, int, int] | None = None
    """Megatron-LM's ``--rampup-batch-size``: ``[start, increment, ramp_samples]``, the batch
    growing to ``global_batch_size`` (:func:`tokenloom.index.batch_sizes.rampup_steps`)."""

    step_batch_size_schedule: str | None = None
    """Megatron-LM's ``--step-batch-size-schedule`` such as ``"0:768 250B:1536"``: thresholds in
    tokens (K/M/B/T suffixes), divided by ``seq_length`` as Megatron-LM does; its last size is the
    global batch size."""

    max_epochs: float | Mapping[str, float] | None = None
    """The most epochs of its train documents a store may serve (like OLMo-core's
    ``max_repetition_ratio``): one number for every store, or ``{store: epochs}``. A build whose
    train split needs more is a ConfigError naming the store and the phase. None: no cap."""

    headroom: float = 0.0
    """With several ``phases``: the extra fraction of samples each train store's index holds beyond
    what the schedule takes of it (never past ``max_epochs``), for weight changes at run time
    (``reweight``): a change that takes more of a store than its index holds is refused with the
    store, phase and numbers. 0: exactly the schedule's counts (exact mode: megatron-core's buffer
    over them)."""

    seed: int = 1234
    """Megatron's ``--seed``: the RandomState seed of every shuffle (exact) or the Feistel keys."""

    fim: FimConfig | Mapping[str, Any] | None = None
    """Fill-in-the-middle when samples are served, in Megatron-LM's keys (``fim_rate``,
    ``fim_spm_rate``, ``fim_extra_tokens``, ``fim_split_sample``, ``fim_fragment_rate``,
    ``fim_no_prefix``) plus ``stores`` (those permuted; absent: every store), read as a
    :class:`~tokenloom.source.fim_options.FimConfig`. Not in the build key: the indices do not
    change, and ``BatchPipeline`` permutes each sample of those stores with the stores' tokenizer
    and a generator of its own (FORMAT.md, "Fill in the middle")."""

    add_extra_token: bool = True
    """Whether each sample carries one more token for the shifted labels (Megatron's default)."""

    drop_last_partial_validation_sequence: bool = True
    """Whether the validation split drops its trailing partial sample (Megatron's default)."""

    mid_level_dataset_surplus: float = DEFAULT_SURPLUS
    """Extra fraction of samples each blended dataset builds (Megatron's default 0.005)."""

    mode: str = "exact"
    """``"exact"``: megatron-core's arrays bit for bit; ``"stateless"``: tokenloom's Feistel index
    and closed-form blend, with no per-sample arrays."""

    packing: str = "concat"
    """``"concat"``: documents concatenated and cut into samples (megatron-core's samples, in either
    mode); ``"best_fit"``: whole documents packed best fit decreasing into padded samples, long
    ones cut into sample-length pieces (:mod:`tokenloom.index.best_fit_index`). ``mode`` still
    chooses the blend: megatron-core's greedy arrays (exact) or the closed form (stateless)."""

    best_fit_window: int | None = None
    """Documents packed together with ``packing: best_fit`` (consecutive in a seeded order); None:
    100,000, or the tokens of a sample if more. Larger windows pad a little less and hold more
    memory while packing."""

    megatron_tokenizer: Mapping[str, Any] | None = None
    """The ``unique_identifiers`` of the tokenizer the Megatron job uses, in order; only needed to
    name files in a Megatron cache (megatron-core puts them into its cache keys)."""

    cache_dir: str = "tokenloom_cache"
    """Directory of the cache (shared by all ranks, or node-local without a shared filesystem)."""

    base_dir: str | None = None
    """The folder relative store, cache and export paths resolve against: a config file's own
    folder when it is read from a file (:func:`load_build_config`); None: the current directory
    (paths given in Python or on the command line)."""

    megatron_cache_dir: str | None = None
    """Also write every exact index under megatron-core's file names and md5 keys here."""

    shared_fs: bool = True
    """Whether every rank sees the same ``cache_dir``; if not, files travel over the process group."""

    timeout_s: float = 1800.0
    """Seconds a rank waits for the others at a collective before the build fails; must exceed the
    longest rank's build time (``plan_build`` estimates it)."""

    rng_workers: int = 1
    """Background processes that draw the RandomState shuffles ahead of the sample walks (exact),
    started only where the rank has a core to spare (its share of the host's cores is 2 or more)
    and enough dataset items to repay a process; otherwise the rank draws inline."""

    blend_threads: int = 0
    """Threads of each exact blend (megatron's greedy in chunks, identical arrays); 0: this rank's
    share of its host's cores (the cores it may use / the build's ranks on the host)."""

    verify_stores: str = "stat"
    """How a build knows a store it fingerprinted before is unchanged: ``stat`` compares size,
    mtime, ctime, inode and device of both files with what ``CACHE/stores.json`` recorded (see
    ``tokenloom.builder.stores``); ``hash`` hashes every store on every build."""

    blend_block_samples: int = 1 << 20
    """Positions per block of an exact blend's arrays: every rank computes and writes whole
    blocks of the blend, and each block is hashed on its own (the cache records the blocks'
    SHA-256). Changes no array; smaller blocks divide small blends over more ranks."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "seq_length", check_positive_int("seq_length", self.seq_length))
        if self.phases is None and (self.blend is None) == (self.blend_per_split is None):
            raise ConfigError(
                "BuildConfig needs exactly one of blend and blend_per_split, got "
                f"{'both' if self.blend is not None else 'neither (nor phases)'}; blend cuts every split "
                "from one set of stores by `split`, blend_per_split gives each split its own stores, phases "
                "gives a schedule of blends"
            )
        if self.base_dir is not None and (not isinstance(self.base_dir, (str, os.PathLike)) or not str(self.base_dir)):
            raise ConfigError(f"base_dir={self.base_dir!r}; expected a directory path or None")
        self._check_batch_sizes()
        if self.phases is not None:
            self._read_schedule()
        if self.phases is not None:  # several phases: the stores are the union of theirs
            if self.split is None:
                raise ConfigError("BuildConfig.split is required with phases, e.g. split='969,30,1'")
            parse_split(self.split)
        elif self.blend is not None:
            blend, budget = _parse_blend(self.blend, "blend")
            blend = self._paths_resolved(blend)
            if self.split is None:
                raise ConfigError("BuildConfig.split is required with blend, e.g. split='969,30,1'")
            parse_split(self.split)
            if budget is not None:
                blend = self._budgeted(blend, budget, "blend")
            object.__setattr__(self, "blend", blend)
        else:
            per_split = self.blend_per_split
            if isinstance(per_split, Mapping):
                unknown = sorted(set(per_split) - set(SPLIT_NAMES))
                if unknown:
                    raise ConfigError(f"blend_per_split has keys {unknown}; expected {list(SPLIT_NAMES)}")
                per_split = tuple(per_split.get(name) for name in SPLIT_NAMES)
            if not isinstance(per_split, (tuple, list)) or len(per_split) != len(SPLIT_NAMES):
                raise ConfigError(
                    f"blend_per_split={self.blend_per_split!r}; expected three blends (train, valid, "
                    "test), None where a split has no data"
                )
            blends = []
            for b, name in zip(per_split, SPLIT_NAMES):
                blend, budget = (None, None) if b is None else _parse_blend(b, f"blend_per_split[{name}]")
                blend = None if blend is None else self._paths_resolved(blend)
                if budget is not None:
                    if name != "train":
                        raise ConfigError(f"blend_per_split[{name}] has a {budget[0]} budget; budgets count "
                                          "training data: give the train blend budgets and the others weights")
                    blend = self._budgeted(blend, budget, f"blend_per_split[{name}]")
                blends.append(blend)
            blends = tuple(blends)
            if all(b is None for b in blends):
                raise ConfigError("blend_per_split gives no blend for any split; expected at least one")
            object.__setattr__(self, "blend_per_split", blends)
            if self.split is not None:
                raise ConfigError(
                    f"split={self.split!r} given with blend_per_split; Megatron rejects the pair "
                    "(each split already has its own stores): remove split"
                )
        for name in ("train_samples", "valid_samples", "test_samples"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, check_non_negative_int(name, value))
        object.__setattr__(self, "seed", check_non_negative_int("seed", self.seed))
        if self.seed >= 2**32:
            raise ConfigError(f"seed={self.seed}; expected an integer below 2**32 (a RandomState seed)")
        for name in ("add_extra_token", "drop_last_partial_validation_sequence", "shared_fs"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r}; expected true or false")
        surplus = self.mid_level_dataset_surplus
        if not is_number(surplus) or not 0 <= surplus < 10:
            raise ConfigError(f"mid_level_dataset_surplus={surplus!r}; expected a number in [0, 10)")
        object.__setattr__(self, "mid_level_dataset_surplus", float(surplus))
        if self.mode not in MODES:
            raise ConfigError(f"mode={self.mode!r}; expected one of {list(MODES)}")
        if self.packing not in PACKINGS:
            raise ConfigError(f"packing={self.packing!r}; expected one of {list(PACKINGS)}")
        if self.best_fit_window is not None:
            if self.packing != "best_fit":
                raise ConfigError(f"best_fit_window={self.best_fit_window!r} with packing={self.packing!r}; "
                                  "the window only applies to packing: best_fit")
            from tokenloom.index.best_fit_index import resolve_window

            resolve_window(self.best_fit_window, self.seq_length + int(bool(self.add_extra_token)))
        if self.packing == "best_fit" and self.megatron_cache_dir is not None:
            raise ConfigError(
                f"megatron_cache_dir={self.megatron_cache_dir!r} with packing='best_fit'; megatron-core has no "
                "best-fit index to load, so there is nothing to export: drop megatron_cache_dir (serve the "
                "split with tokenloom) or use packing: concat")
        if self.packing == "best_fit" and not self.drop_last_partial_validation_sequence:
            raise ConfigError(
                "drop_last_partial_validation_sequence=False with packing='best_fit'; best-fit samples are "
                "whole documents and padding, so there is no partial sample to keep: set it to True")
        if self.megatron_tokenizer is not None and not isinstance(self.megatron_tokenizer, Mapping):
            raise ConfigError(
                f"megatron_tokenizer={self.megatron_tokenizer!r}; expected the mapping a Megatron "
                "tokenizer's unique_identifiers returns, e.g. {'class': ..., 'vocab_size': ...}"
            )
        if self.mode == "stateless" and not self.drop_last_partial_validation_sequence:
            raise ConfigError(
                "drop_last_partial_validation_sequence=False with mode='stateless'; the stateless index "
                "always drops a trailing partial sample: set it to True or use mode='exact'"
            )
        if self.megatron_cache_dir is not None and self.phases is not None:
            raise ConfigError(
                f"megatron_cache_dir={self.megatron_cache_dir!r} with a schedule of {len(self.phases)} phases; "
                "megatron-core loads one blend per split and a schedule's train split is one blend per phase, "
                "so there is nothing megatron-core could load: drop megatron_cache_dir (serve the split with "
                "tokenloom) or build one phase")
        if self.megatron_cache_dir is not None and self.mode != "exact":
            raise ConfigError(
                f"megatron_cache_dir={self.megatron_cache_dir!r} with mode={self.mode!r}; megatron-core "
                "can only load exact-mode indices"
            )
        if not isinstance(self.cache_dir, (str, os.PathLike)) or not str(self.cache_dir):
            raise ConfigError(f"cache_dir={self.cache_dir!r}; expected a directory path")
        object.__setattr__(self, "cache_dir", self.resolve_path(str(self.cache_dir)))
        if self.megatron_cache_dir is not None:
            object.__setattr__(self, "megatron_cache_dir", self.resolve_path(str(self.megatron_cache_dir)))
        check_number("timeout_s", self.timeout_s, positive=True, expected="a positive number of seconds")
        object.__setattr__(self, "rng_workers", check_non_negative_int("rng_workers", self.rng_workers))
        object.__setattr__(self, "blend_threads", check_non_negative_int("blend_threads", self.blend_threads))
        if self.verify_stores not in ("stat", "hash"):
            raise ConfigError(f"verify_stores={self.verify_stores!r}; expected 'stat' (trust unchanged file "
                              "metadata) or 'hash' (hash every store on every build)")
        object.__setattr__(self, "blend_block_samples", check_positive_int("blend_block_samples",
                                                                            self.blend_block_samples))
        for index, name in enumerate(SPLIT_NAMES):
            blend = self.blend_for_split(index)
            if blend is not None and blend.weights is not None and len(blend.prefixes) > 1 \
                    and self.samples_per_split[index] is None:
                raise ConfigError(
                    f"{name}_samples is None but the {name} blend has weights; Megatron needs a "
                    f"sample count to blend by weight: set {name}_samples or drop the weights"
                )
        if self.max_epochs is not None:
            self._read_max_epochs()
        if self.fim is not None:
            self._read_fim()
        headroom = self.headroom
        if not is_number(headroom) or not 0 <= headroom <= 100:
            raise ConfigError(f"headroom={headroom!r}; expected a fraction of extra samples in [0, 100]")
        object.__setattr__(self, "headroom", float(headroom))
        if self.headroom and self.max_epochs is not None and self.packing == "best_fit":
            raise ConfigError(
                f"headroom={self.headroom!r} with max_epochs and packing: best_fit; a best-fit store's epoch is "
                "known only once its documents are packed, after its index is sized, so max_epochs cannot cap "
                "the headroom: drop one of them")
        if self.headroom and self.phases is None:
            raise ConfigError(
                f"headroom={self.headroom!r} without a schedule of several phases; headroom sizes a schedule's "
                "stores for weight changes at run time (a single blend's weight change ends the stream where a "
                "store runs out): drop headroom or give phases")

    # -- the schedule ---------------------------------------------------------------------------
    def _read_max_epochs(self) -> None:
        if self.phases is not None:
            stores, names = self.schedule_stores.prefixes, self.schedule_stores.spelt()
        else:
            stores = self.prefixes
            names = tuple(self.spelling(p) for p in stores)
        max_epochs = self.max_epochs
        if isinstance(max_epochs, Mapping):  # stores named as the blends name them, resolved alike
            max_epochs = {self.resolve_path(str(store)): epochs for store, epochs in max_epochs.items()}
        object.__setattr__(self, "max_epochs", read_max_epochs(max_epochs, stores=stores, names=names))

    def _read_fim(self) -> None:
        fim = FimConfig.from_mapping(self.fim)
        if fim.stores is not None:
            known = set(self.prefixes) | (set(self.schedule_stores.prefixes) if self.phases is not None else set())
            resolved = tuple(self.resolve_path(store) for store in fim.stores)
            for written, prefix in zip(fim.stores, resolved):
                if prefix not in known:
                    names = sorted(self.spelling(p) for p in known)
                    raise ConfigError(f"fim.stores names {written!r}, which is not a store of this config; its stores "
                                      f"are {names[:10]}{' ...' if len(names) > 10 else ''}")
            fim = FimConfig(options=fim.options, stores=tuple(dict.fromkeys(resolved)))
        object.__setattr__(self, "fim", fim)

    def _check_batch_sizes(self) -> None:
        """global_batch_size, rampup_batch_size, step_batch_size_schedule checked (a step schedule
        without global_batch_size gives it: its last size)."""
        if self.global_batch_size is not None:
            object.__setattr__(self, "global_batch_size",
                               check_positive_int("global_batch_size", _integral(self.global_batch_size, "", "")))
        rampup = self.rampup_batch_size
        if isinstance(rampup, (list, tuple)):  # [256, 128, 5e6] as a file writes it
            object.__setattr__(self, "rampup_batch_size", tuple(_integral(v, "", "") for v in rampup))
        steps = self.batch_size_steps
        if steps is not None and self.global_batch_size is None:
            object.__setattr__(self, "global_batch_size", steps[-1][1])

    @property
    def batch_size_steps(self) -> tuple[tuple[int, int], ...] | None:
        """The run's global batch sizes as ``(threshold_samples, size)`` steps (one pair without a
        ramp or step schedule); None without a global batch size."""
        return batch_size_steps(global_batch_size=self.global_batch_size, rampup_batch_size=self.rampup_batch_size,
                                step_batch_size_schedule=self.step_batch_size_schedule,
                                seq_length=int(self.seq_length))

    def _read_schedule(self) -> None:
        """``phases`` read and planned: one phase becomes ``blend`` + ``train_samples`` (its end in
        samples), so every key is the one today's spelling of that config has; several stay."""
        for key in ("blend", "blend_per_split", "train_samples"):
            if getattr(self, key) is not None:
                raise ConfigError(_WITH_PHASES[key])
        phases = read_phases(self.phases, _as_blend)
        for k, phase in enumerate(phases, 1):
            if phase.seq_length is None or phase.seq_length == self.seq_length:
                continue
            if self.packing != "concat":
                raise ConfigError(
                    f"phase {k}: seq_length: {phase.seq_length} differs from the build's seq_length "
                    f"{self.seq_length}; a phase of another sequence length is built with concatenated "
                    f"samples (FORMAT.md 'Length runs'), not yet with packing: {self.packing}: drop seq_length "
                    f"from phase {k} or use packing: concat")
            if self.headroom:
                raise ConfigError(
                    f"phase {k}: seq_length: {phase.seq_length} with headroom; a store whose sequence length "
                    "changes reads its runs end to end from one token stream (FORMAT.md 'Length runs'), so no "
                    f"run has room to grow into: drop headroom or seq_length from phase {k}")
        steps = self.batch_size_steps
        if steps is None:
            raise ConfigError("phases without global_batch_size; a phase ends at an optimizer step's end and "
                              "`until: {steps: N}` counts steps: give global_batch_size (samples per step)")
        if len(phases) == 1:  # today's config: the keys must not see the schedule
            plan = plan_phases(phases, union_stores(phases), seq_length=int(self.seq_length), steps=steps)
            object.__setattr__(self, "blend", phases[0].blend)
            object.__setattr__(self, "train_samples", plan.num_samples)
            object.__setattr__(self, "phases", None)
            return
        phases = tuple(PhaseSpec(blend=self._paths_resolved(p.blend), until=p.until, ramp=p.ramp,
                                 seq_length=p.seq_length) for p in phases)
        union = union_stores(phases)
        plan = plan_phases(phases, union, seq_length=int(self.seq_length), steps=steps)
        # every split reads the stores the schedule takes samples from, weighted by those samples
        # (valid and test: each store's share of the whole schedule); the train split's blend
        # item is the schedule's (tokenloom.builder.items), each store sized by its total
        served = [d for d, total in enumerate(plan.totals.tolist()) if total > 0]
        blend = BlendSpec(prefixes=tuple(union.prefixes[d] for d in served),
                          weights=tuple(float(plan.totals[d]) for d in served),
                          written_prefixes=tuple(union.spelt()[d] for d in served))
        object.__setattr__(self, "phases", phases)
        object.__setattr__(self, "_schedule", (union, plan, blend))

    @property
    def schedule_stores(self) -> BlendSpec:
        """The union of the phases' stores in first-seen order (weightless); a config without
        phases has none (ConfigError)."""
        return self._schedule_parts()[0]

    def schedule_plan(self) -> SchedulePlan | None:
        """The schedule of a config with several phases placed on the run's samples (the kernel's
        :class:`~tokenloom.index.schedule.SchedulePlan`, over :attr:`schedule_stores`); None for a
        config without phases (one phase is ``blend`` and ``train_samples``)."""
        return None if self.phases is None else self._schedule_parts()[1]

    def _schedule_parts(self) -> tuple[BlendSpec, SchedulePlan, BlendSpec]:
        if self.phases is None:
            raise ConfigError("this config has no phases (a one-phase schedule is its blend and train_samples)")
        return self.__dict__["_schedule"]

    @property
    def num_train_steps(self) -> int | None:
        """Megatron-LM's ``train_iters`` of this run (from its train samples and batch sizes, as
        ``update_train_iters`` counts them); None without a global batch size or train length."""
        steps, samples = self.batch_size_steps, self.samples_per_split[0]
        return None if steps is None or samples is None else train_steps(steps, samples)

    def describe_schedule(self, samples_per_epoch: Mapping[str, int] | None = None) -> str:
        """The dry run's report of a config with several phases (see
        :func:`tokenloom.builder.schedule.format_schedule`); ``samples_per_epoch`` by store adds
        each store's epochs."""
        union, plan, _ = self._schedule_parts()
        text = format_schedule(plan, union.spelt(), prefixes=union.prefixes, samples_per_epoch=samples_per_epoch,
                               seq_length=int(self.seq_length))
        if has_length_runs(plan, int(self.seq_length)):
            text += "\n" + format_length_runs(plan, union.spelt(), run_counts(plan, self.mode))
        if self.headroom:
            cap = "" if self.max_epochs is None else ", never past max_epochs"
            buffer = " (exact mode: megatron-core's buffer over it)" if self.mode == "exact" else ""
            text += (f"\n  headroom {self.headroom:g}: each store's index holds {1 + self.headroom:g} x its total"
                     f"{buffer}{cap}: room for weight changes at run time")
        return text

    def check_max_epochs(self, samples_per_epoch: Mapping[str, int],
                         tokens_per_epoch: Mapping[str, int] | None = None) -> None:
        """ConfigError naming the store and the phase where the train split needs more samples
        of a store than ``max_epochs`` epochs of its train documents hold (``samples_per_epoch``:
        by store, those the caller knows). The train split's need is the schedule's, or a
        weighted blend's largest-remainder counts over train_samples (one phase). A schedule that
        changes the sequence length counts in tokens (``tokens_per_epoch``: the input tokens of
        an epoch, its tokens less the extra one), as its length runs read them."""
        if self.max_epochs is None:
            return
        if self.phases is not None:
            union, plan, _ = self._schedule_parts()
            if has_length_runs(plan, int(self.seq_length)):
                room = epoch_room(self.max_epochs, union.prefixes, tokens_per_epoch or {})
                plan.check_room(room, names=union.spelt(), tokens=True)
                return
        else:
            blend, size = self.blend_for_split(0), self.train_samples
            if blend is None or blend.weights is None or not size:
                return  # an unweighted blend serves each store's epoch once
            union = BlendSpec(prefixes=blend.prefixes, written_prefixes=blend.written_prefixes)
            phase = PhaseSpec(blend=blend, until={"samples": size})
            plan = plan_phases((phase,), union, seq_length=int(self.seq_length), steps=((0, 1),))
        room = epoch_room(self.max_epochs, union.prefixes, samples_per_epoch)
        plan.check_room(room, names=union.spelt())

    def _budgeted(self, blend: BlendSpec, budget: tuple[str, tuple[float, ...]], what: str) -> BlendSpec:
        """``blend`` weighted by the sample counts its token budgets ask for (setting or checking
        train_samples), or, for epoch budgets, ``blend`` carrying them unresolved.

        A token budget ``T`` is ``T // seq_length`` samples, known from the config alone. An epoch
        budget needs each store's .idx (megatron-core's epoch of its train documents), so
        constructing a config leaves it to :meth:`resolve`, the build's first step: a config only
        checks values, it reads no files. The weights are the counts, so megatron-core's greedy
        blend (and tokenloom's closed-form one) give every dataset exactly its count over
        ``train_samples = sum(counts)`` samples.
        """
        kind, values = budget
        if kind == "epochs":
            if self.packing == "best_fit":
                raise ConfigError(f"{what}: epoch budgets with packing='best_fit'; an epoch of a best-fit split is "
                                  "only known once its documents are packed: give token budgets or weights")
            return replace(blend, budget_epochs=tuple(values))
        seq = int(self.seq_length)
        weighted, total = self._counted(blend, [int(v) // seq for v in values], kind, values, what)
        object.__setattr__(self, "train_samples", total)
        return weighted

    def _counted(self, blend: BlendSpec, counts: list[int], kind: str, values, what: str) -> tuple[BlendSpec, int]:
        """``blend`` weighted by ``counts`` (its budgets in samples) and the train_samples they add
        up to, checked against a train_samples the config gives."""
        seq = int(self.seq_length)
        for prefix, count, value in zip(blend.prefixes, counts, values):
            if count < 1:
                raise ConfigError(f"{what}: the {kind} budget {value!r} of {prefix} is less than one sample of "
                                  f"seq_length={seq} tokens; raise it or leave the dataset out")
        total = sum(counts)
        if self.train_samples is not None:
            check_non_negative_int("train_samples", self.train_samples)
            if int(self.train_samples) != total:
                raise ConfigError(f"train_samples={self.train_samples} but the {kind} budgets of {what} add up to "
                                  f"{total} samples of {seq} tokens; drop train_samples (the budgets set it) or "
                                  "make them agree")
        tokens = tuple(int(v) for v in values) if kind == "tokens" else tuple(c * seq for c in counts)
        return BlendSpec(prefixes=blend.prefixes, weights=tuple(float(c) for c in counts), budget_tokens=tokens,
                         written_prefixes=blend.written_prefixes), total

    @property
    def resolved(self) -> bool:
        """Whether nothing is left for :meth:`resolve` to read (no unresolved epoch budget)."""
        return all(b is None or b.budget_epochs is None for b in map(self.blend_for_split, range(len(SPLIT_NAMES))))

    def resolve(self) -> BuildConfig:
        """This config with its epoch budgets turned into sample counts: the build's first step,
        the one that reads files (each budgeted store's .idx, for megatron-core's samples in one
        epoch of its train documents: ``(tokens - add_extra_token) // seq_length``). The errors
        are those a budget that cannot be met gets; a config with nothing to read is returned as
        it is."""
        if self.resolved:
            return self
        train, what = (self.blend, "blend") if self.blend is not None else (self.blend_per_split[0],
                                                                          "blend_per_split[train]")
        epochs = train.budget_epochs
        per_epoch = [self._train_samples_per_epoch(prefix, what) for prefix in train.prefixes]
        counts = [math.floor(e * n) for e, n in zip(epochs, per_epoch)]
        weighted, total = self._counted(train, counts, "epochs", epochs, what)
        if self.blend is not None:
            return replace(self, blend=weighted, train_samples=total)
        return replace(self, blend_per_split=(weighted, *self.blend_per_split[1:]), train_samples=total)

    def _train_samples_per_epoch(self, prefix: str, what: str) -> int:
        """megatron-core's samples in one epoch of ``prefix``'s train documents (reads its .idx)."""
        from tokenloom.index.split import split_document_ranges
        from tokenloom.io import IndexedDataset

        store = IndexedDataset(prefix)
        begin, end = 0, store.num_sequences
        if self.split is not None:
            train = split_document_ranges(self.split, store.num_sequences).train
            if train is None:
                raise ConfigError(f"{what}: an epoch budget for {prefix}, but split={self.split!r} gives the "
                                  "train split no documents")
            begin, end = train.begin, train.end
        tokens = int(np.asarray(store.sequence_lengths[begin:end], dtype=np.int64).sum())
        return max(0, (tokens - int(self.add_extra_token)) // int(self.seq_length))

    # -- views ----------------------------------------------------------------------------------
    @property
    def samples_per_split(self) -> tuple[int | None, int | None, int | None]:
        """(train, valid, test) sample counts, Megatron's ``sizes`` (with several phases the
        train split's is the schedule's end)."""
        train = self._schedule_parts()[1].num_samples if self.phases is not None else self.train_samples
        return (train, self.valid_samples, self.test_samples)

    def blend_for_split(self, split_index: int) -> BlendSpec | None:
        """The blend split ``split_index`` (0 train, 1 valid, 2 test) draws from (with several
        phases: the stores the schedule serves, weighted by its samples of each)."""
        if self.phases is not None:
            return self._schedule_parts()[2]
        if self.blend is not None:
            return self.blend
        return self.blend_per_split[split_index]

    def resolve_path(self, path: str) -> str:
        """``path`` against :attr:`base_dir` when it is relative and local (an object-store URL or
        an absolute path is itself; without a base_dir every path is itself)."""
        if self.base_dir is None or "://" in path or os.path.isabs(path):
            return path
        return os.path.normpath(os.path.join(str(self.base_dir), path))

    def _paths_resolved(self, blend: BlendSpec) -> BlendSpec:
        """``blend`` with its prefixes resolved against base_dir, keeping the spelling."""
        resolved = tuple(self.resolve_path(p) for p in blend.prefixes)
        if resolved == blend.prefixes:
            return blend
        return replace(blend, prefixes=resolved, written_prefixes=blend.spelt())

    def spelling(self, prefix: str) -> str:
        """How the config spelt the store it resolved to ``prefix`` (``prefix`` when unchanged);
        megatron-core's file names are made from it, as its own job spells the path."""
        spellings = self.__dict__.get("_spellings")
        if spellings is None:  # one map for all blends, made on first use (O(1) a store after)
            spellings = {}
            for index in range(len(SPLIT_NAMES)):
                blend = self.blend_for_split(index)
                if blend is not None and blend.written_prefixes is not None:
                    spellings.update(zip(blend.prefixes, blend.written_prefixes))
            object.__setattr__(self, "_spellings", spellings)
        return spellings.get(prefix, prefix)

    def describe_store(self, prefix: str) -> str:
        """``store 'PREFIX'``, with how a relative spelling was resolved (for messages)."""
        written = self.spelling(prefix)
        if written == prefix:
            return f"store {prefix!r}"
        return f"store {written!r} (relative to the config file's folder {self.base_dir}: {prefix})"

    @property
    def prefixes(self) -> tuple[str, ...]:
        """Every distinct store prefix, in first-seen order."""
        seen: dict[str, None] = {}
        for index in range(len(SPLIT_NAMES)):
            blend = self.blend_for_split(index)
            if blend is not None:
                seen.update(dict.fromkeys(blend.prefixes))
        return tuple(seen)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict (blends as ``{"prefixes": [...], "weights": [...]}``)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}  # scalars; the blends follow
        out["blend"] = _blend_dict(self.blend)
        out["blend_per_split"] = (
            None if self.blend_per_split is None
            else {name: _blend_dict(b) for name, b in zip(SPLIT_NAMES, self.blend_per_split)}
        )
        out["megatron_tokenizer"] = None if self.megatron_tokenizer is None else dict(self.megatron_tokenizer)
        out["phases"] = None if self.phases is None else [phase.to_dict() for phase in self.phases]
        out["rampup_batch_size"] = None if self.rampup_batch_size is None else list(self.rampup_batch_size)
        out["max_epochs"] = dict(self.max_epochs) if isinstance(self.max_epochs, Mapping) else self.max_epochs
        out["fim"] = None if self.fim is None else self.fim.to_dict()
        return out

    def replace(self, **changes: Any) -> BuildConfig:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)


#: Fields that change some array of some item; the cache key covers each of them (the key of one
#: item holds the values derived from these that its arrays depend on).
ARRAY_FIELDS = (
    "seq_length", "blend", "blend_per_split", "split", "train_samples", "valid_samples",
    "test_samples", "seed", "add_extra_token", "drop_last_partial_validation_sequence",
    "mid_level_dataset_surplus", "mode", "packing", "best_fit_window", "phases", "headroom",
)

#: Array fields added after the first builds: left out of :func:`array_config` at their default, so
#: that a build key (which a checkpoint's serving state names) stays what it was before them.
_LATER_ARRAY_DEFAULTS = {"packing": "concat", "best_fit_window": None, "phases": None, "headroom": 0.0}


def array_config(config: BuildConfig) -> dict[str, Any]:
    """The values of :data:`ARRAY_FIELDS` that a build key hashes, with the stores as the config
    spelt them (a config's key does not depend on where it is run from)."""
    out = {name: value for name, value in config.to_dict().items() if name in ARRAY_FIELDS
           and not (name in _LATER_ARRAY_DEFAULTS and value == _LATER_ARRAY_DEFAULTS[name])}
    out["blend"] = _blend_dict(config.blend, spelt=True)
    per_split = config.blend_per_split
    out["blend_per_split"] = (None if per_split is None else
                              {name: _blend_dict(b, spelt=True) for name, b in zip(SPLIT_NAMES, per_split)})
    if config.phases is not None:  # the phases as spelt, and the batch sizes that place their ends
        out["phases"] = {"phases": [phase.to_dict(spelt=True) for phase in config.phases],
                         "batch_size_steps": [list(step) for step in config.batch_size_steps]}
    return out


#: What a config giving ``phases`` with one of these keys is told.
_WITH_PHASES = {
    "blend": "phases and blend both given; phases replaces blend (each phase names its own blend): drop blend",
    "blend_per_split": "phases and blend_per_split both given; a schedule cuts every split from the union of its "
                       "phases' stores by `split`: drop blend_per_split",
    "train_samples": "phases and train_samples both given; the last phase's until is the run's length: drop "
                     "train_samples (or end the last phase with until: {samples: N})",
}


# ------------------------------------------------------------------------------------ validation


def _parse_blend(value: Any, what: str) -> tuple[BlendSpec, tuple[str, tuple[float, ...]] | None]:
    """:func:`_as_blend`, or a mapping with budgets instead of weights: ``{"prefixes": [...],
    "tokens": [...]}`` (training tokens per dataset) or ``{"prefixes": [...], "epochs": [...]}``.
    Returns the blend (weightless when budgeted) and ``(kind, values)`` or None."""
    if not isinstance(value, Mapping) or not ({"tokens", "epochs"} & set(value)):
        return _as_blend(value, what), None
    unknown = sorted(set(value) - {"prefixes", "tokens", "epochs"})
    kinds = [k for k in ("tokens", "epochs") if k in value]
    if unknown or "prefixes" not in value or len(kinds) != 1:
        raise ConfigError(f"{what}={dict(value)!r}; expected 'prefixes' and one of 'weights', 'tokens' (a token "
                          "budget per dataset) or 'epochs' (epochs of each dataset's train documents)")
    kind = kinds[0]
    blend = _as_blend({"prefixes": value["prefixes"]}, what)
    values = value[kind]
    if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple)) or len(values) != len(blend.prefixes):
        raise ConfigError(f"{what}: {kind}={values!r}; expected one number per prefix ({len(blend.prefixes)})")
    checked = []
    for prefix, v in zip(blend.prefixes, values):
        if not is_number(v) or not math.isfinite(v) or v <= 0 or (kind == "tokens" and float(v) != int(v)):
            raise ConfigError(f"{what}: {kind} budget {v!r} of {prefix}; expected a positive "
                              f"{'whole number of tokens' if kind == 'tokens' else 'number of epochs'}")
        checked.append(int(v) if kind == "tokens" else float(v))
    return blend, (kind, tuple(checked))


def _as_blend(value: Any, what: str) -> BlendSpec:
    """Accept a BlendSpec, ``{"prefixes": [...], "weights": [...]}``, ``[[prefixes], [weights]]``
    (megatron-core's tuple) or Megatron-LM's ``--data-path`` list (``["30", "a", "70", "b"]``)."""
    budget_tokens = None
    if isinstance(value, BlendSpec):
        prefixes, weights, budget_tokens = value.prefixes, value.weights, value.budget_tokens
        if value.written_prefixes is not None or value.budget_epochs is not None:
            # a replaced config's blend: keep its spelling and any budget left for resolve()
            checked = _as_blend({"prefixes": prefixes, "weights": weights, "budget_tokens": budget_tokens}, what)
            return replace(checked, written_prefixes=value.written_prefixes, budget_epochs=value.budget_epochs)
    elif isinstance(value, Mapping):
        unknown = sorted(set(value) - {"prefixes", "weights", "budget_tokens"})
        if unknown or "prefixes" not in value:
            raise ConfigError(f"{what}={dict(value)!r}; expected keys 'prefixes' and optional 'weights'")
        prefixes, weights = value["prefixes"], value.get("weights")
        budget_tokens = value.get("budget_tokens")
    elif isinstance(value, str):
        prefixes, weights = _parse_data_path(value.split(), what)
    elif isinstance(value, (list, tuple)) and len(value) == 2 and isinstance(value[0], (list, tuple)):
        prefixes, weights = value
    elif isinstance(value, (list, tuple)):
        prefixes, weights = _parse_data_path([str(v) for v in value], what)
    else:
        raise ConfigError(
            f"{what}={value!r}; expected a list like Megatron's --data-path ['30', 'path/a', '70', "
            "'path/b'] or a mapping {'prefixes': [...], 'weights': [...]}"
        )
    if isinstance(prefixes, (str, bytes)) or not isinstance(prefixes, (list, tuple)) or not prefixes:
        raise ConfigError(f"{what}: prefixes={prefixes!r}; expected a non-empty list of store prefixes")
    prefixes = tuple(str(p) for p in prefixes)
    if weights is not None:
        if not isinstance(weights, (list, tuple)) or len(weights) != len(prefixes):
            raise ConfigError(
                f"{what}: {len(prefixes)} prefixes but weights={weights!r}; expected one weight per prefix"
            )
        checked = []
        for prefix, weight in zip(prefixes, weights):
            if not is_number(weight) or not math.isfinite(weight) or weight <= 0:
                raise ConfigError(f"{what}: weight {weight!r} of {prefix}; expected a positive number")
            checked.append(float(weight))
        weights = tuple(checked)
    return BlendSpec(prefixes=prefixes, weights=weights, budget_tokens=budget_tokens)


def _parse_data_path(tokens: list[str], what: str) -> tuple[list[str], list[float] | None]:
    """Megatron-LM's ``--data-path`` list: prefixes alone, or weight/prefix pairs."""
    if len(tokens) % 2 == 0 and tokens:
        try:
            weights = [float(tokens[i]) for i in range(0, len(tokens), 2)]
        except ValueError:
            weights = None
        if weights is not None:
            return [tokens[i].strip() for i in range(1, len(tokens), 2)], weights
    for token in tokens:
        try:
            float(token)
        except ValueError:
            continue
        raise ConfigError(
            f"{what}={tokens!r} mixes numbers and prefixes; expected prefixes alone or weight/prefix pairs"
        )
    return [t.strip() for t in tokens], None


def _blend_dict(blend: BlendSpec | None, *, spelt: bool = False) -> dict | None:
    if blend is None:
        return None
    out = {"prefixes": list(blend.spelt() if spelt else blend.prefixes),
           "weights": None if blend.weights is None else list(blend.weights)}
    if blend.budget_epochs is not None:  # not yet resolved: the form a config file gives it in
        return {"prefixes": out["prefixes"], "epochs": list(blend.budget_epochs)}
    if blend.budget_tokens is not None:  # what the weights were made from (they are the sample counts)
        out["budget_tokens"] = list(blend.budget_tokens)
    return out


# ------------------------------------------------------------------------------------ loading

#: Keys a config file may hold besides BuildConfig's fields, and the aliases it accepts.
_ALIASES = {
    "data_path": "blend",
    "sequence_length": "seq_length",
    "random_seed": "seed",
    "add_extra_token_to_sequence": "add_extra_token",
    "cache": "cache_dir",
    "data_cache_path": "cache_dir",
    "megatron_cache": "megatron_cache_dir",
}
_SAMPLE_SOURCES = ("samples", "train_iters", "eval_interval", "eval_iters", "geometry")


def build_config_from_dict(data: Mapping[str, Any], *, source: str = "build config",
                           base_dir: str | None = None) -> BuildConfig:
    """A BuildConfig from a mapping in Megatron's vocabulary.

    Sample counts come from ``train_samples``/``valid_samples``/``test_samples``, from
    ``samples: [train, valid, test]``, from ``train_iters`` x ``global_batch_size`` (with
    ``eval_interval`` and ``eval_iters`` for the other splits, Megatron-LM's formulas), or from a
    ``geometry`` file written by ``tokenloom plan`` (relative to ``base_dir``). With ``phases`` the
    last phase's ``until`` is the train length, and ``eval_interval``/``eval_iters`` count the
    schedule's optimizer steps.
    """
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: expected a mapping of keys to values, got {type(data).__name__}")
    names = {f.name for f in fields(BuildConfig)}
    values: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for key, value in data.items():
        name = _ALIASES.get(key, key)
        if name in names:
            if name in values:
                raise ConfigError(f"{source}: {key!r} and another alias both set {name!r}")
            values[name] = value
        elif key in _SAMPLE_SOURCES:
            extra[key] = value
        else:
            raise ConfigError(f"{source}: unknown key {key!r}{_did_you_mean(key, names)}")
    for name in ("train_samples", "valid_samples", "test_samples", "seq_length", "seed", "global_batch_size"):
        if name in values:
            values[name] = _integral(values[name], name, source)
    if base_dir is not None:  # a file's relative paths name files beside it
        written = values.get("base_dir")
        values["base_dir"] = os.path.abspath(os.path.join(base_dir, str(written)) if written else base_dir)
    evals = _schedule_sample_sources(extra, source) if "phases" in values else {}
    counts = _samples_from_extra(extra, values, source, base_dir)
    for name, count in zip(("train_samples", "valid_samples", "test_samples"), counts):
        if count is not None:
            if name in values and values[name] != count:
                raise ConfigError(f"{source}: {name}={values[name]} disagrees with {count} from the iterations")
            values[name] = count
    missing = [f.name for f in fields(BuildConfig) if f.default is MISSING and f.name not in values]
    if missing:
        raise ConfigError(f"{source}: missing {missing}")
    try:
        if not evals:
            return BuildConfig(**values)
        # the schedule's steps decide valid and test: plan it first, with the counts to come
        config = BuildConfig(**{"valid_samples": 0, "test_samples": 0, **values})
        _, valid, test = _iteration_counts(config.num_train_steps, config.global_batch_size, evals, source)
        for name, count in (("valid_samples", valid), ("test_samples", test)):
            if name in values and values[name] != count:
                raise ConfigError(f"{name}={values[name]} disagrees with {count} from the schedule's "
                                  f"{config.num_train_steps} steps (eval_interval, eval_iters)")
        return config.replace(valid_samples=valid, test_samples=test)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def _schedule_sample_sources(extra: dict, source: str) -> dict:
    """With ``phases``: the sources of sample counts a schedule takes (``samples: [null, valid,
    test]``, or ``eval_interval``/``eval_iters``, taken out of ``extra`` and returned: they need the
    schedule's steps); the train length comes from the last phase only."""
    for key in ("train_iters", "geometry"):
        if key in extra:
            raise ConfigError(f"{source}: phases and {key} both given; the last phase's until is the run's length: "
                              f"drop {key} (end the last phase with until: {{steps: N}} for a length in steps)")
    samples = extra.get("samples")
    if isinstance(samples, (list, tuple)) and len(samples) == 3 and samples[0] is not None:
        raise ConfigError(f"{source}: phases and samples[0]={samples[0]!r} (train) both given; the last phase's "
                          "until is the run's length: write samples: [null, VALID, TEST]")
    evals = {key: extra.pop(key) for key in ("eval_interval", "eval_iters") if key in extra}
    if evals and extra:
        raise ConfigError(f"{source}: {sorted(evals)} given with {sorted(extra)}; give one source of counts")
    return evals


def _did_you_mean(key: Any, names: set[str]) -> str:
    """``; did you mean 'seq_length'?`` and the keys a config file takes, aliases by their field."""
    import difflib

    aliases: dict[str, list[str]] = {}
    for alias, name in _ALIASES.items():
        aliases.setdefault(name, []).append(alias)
    spellings = sorted(names | set(_SAMPLE_SOURCES) | set(_ALIASES))
    close = difflib.get_close_matches(str(key), spellings, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    known = [f"{n} (or {', '.join(aliases[n])})" if n in aliases else n
             for n in sorted(names | set(_SAMPLE_SOURCES))]
    return f"{hint} The keys are: {', '.join(known)}"


def _integral(value: Any, name: str, source: str) -> Any:
    """Accept 1e6 written as a float (YAML, JSON) where an integer is meant."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return value
        if number.is_integer():
            return int(number)
    return value


def _samples_from_extra(extra: dict, values: dict, source: str, base_dir: str | None) -> tuple:
    if not extra:
        return (None, None, None)
    if "samples" in extra:
        samples = extra.pop("samples")
        if not isinstance(samples, (list, tuple)) or len(samples) != 3:
            raise ConfigError(f"{source}: samples={samples!r}; expected [train, valid, test]")
        if extra:
            raise ConfigError(f"{source}: samples given with {sorted(extra)}; give one source of counts")
        return tuple(None if s is None else _integral(s, "samples", source) for s in samples)
    if "geometry" in extra:
        from tokenloom.planning.data_geometry import DataGeometry

        path = Path(extra.pop("geometry"))
        if base_dir is not None and not path.is_absolute():
            path = Path(base_dir) / path
        geometry = DataGeometry.load(path)
        if extra:
            raise ConfigError(f"{source}: geometry given with {sorted(extra)}; give one source of counts")
        if "seq_length" in values and values["seq_length"] != geometry.seq_length:
            raise ConfigError(
                f"{source}: seq_length={values['seq_length']} but {path} has {geometry.seq_length}"
            )
        if values.get("global_batch_size") not in (None, geometry.global_batch_size):
            raise ConfigError(f"{source}: global_batch_size={values['global_batch_size']} but {path} has "
                              f"{geometry.global_batch_size}")
        values.setdefault("seq_length", geometry.seq_length)
        return geometry.samples_per_split
    if "train_iters" not in extra or values.get("global_batch_size") is None:
        raise ConfigError(
            f"{source}: {sorted(extra)} without both train_iters and global_batch_size; Megatron "
            "needs both to count samples"
        )
    iters = check_positive_int("train_iters", _integral(extra["train_iters"], "train_iters", source))
    return _iteration_counts(iters, values["global_batch_size"], extra, source)


def _iteration_counts(iters: int, batch: int, extra: Mapping[str, Any], source: str) -> tuple[int, int, int]:
    """(train, valid, test) samples of ``iters`` steps of ``batch`` samples, with ``extra``'s
    ``eval_interval`` and ``eval_iters`` (Megatron-LM's defaults 1000 and 100)."""
    batch = check_positive_int("global_batch_size", _integral(batch, "global_batch_size", source))
    interval = check_positive_int("eval_interval", _integral(extra.get("eval_interval", 1000), "eval_interval", source))
    eval_iters = check_non_negative_int("eval_iters", _integral(extra.get("eval_iters", 100), "eval_iters", source))
    # Megatron-LM's training loop: train, then eval_iters batches every eval_interval steps and
    # once at the end, then eval_iters batches of test.
    return (iters * batch, (iters // interval + 1) * eval_iters * batch, eval_iters * batch)


def load_build_config(path: str | os.PathLike, **overrides: Any) -> BuildConfig:
    """Read a BuildConfig from a YAML (``.yaml``/``.yml``) or JSON file; ``overrides`` replace
    fields after loading (``cache_dir=...``, ``mode=...``)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read build config: {exc.strerror or exc}") from None
    is_yaml = path.suffix.lower() in (".yaml", ".yml")
    try:
        data = yaml.safe_load(text) if is_yaml else json.loads(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: not valid {'YAML' if is_yaml else 'JSON'}: {exc}") from None
    config = build_config_from_dict(data, source=str(path), base_dir=str(path.parent))
    overrides = {k: v for k, v in overrides.items() if v is not None}
    for name in ("cache_dir", "megatron_cache_dir"):  # given outside the file: the current directory's
        if name in overrides and "://" not in str(overrides[name]):
            overrides[name] = os.path.abspath(str(overrides[name]))
    return replace(config, **overrides) if overrides else config


def as_build_config(config: Any) -> BuildConfig:
    """A BuildConfig from a BuildConfig, a mapping, or a path to a config file."""
    if isinstance(config, BuildConfig):
        return config
    if isinstance(config, Mapping):
        return build_config_from_dict(config)
    if isinstance(config, (str, os.PathLike)):
        return load_build_config(config)
    raise ConfigError(f"config={config!r}; expected a BuildConfig, a mapping, or a config file path")


__all__ = [
    "ARRAY_FIELDS",
    "MODES",
    "PACKINGS",
    "BuildConfig",
    "array_config",
    "as_build_config",
    "build_config_from_dict",
    "load_build_config",
]
