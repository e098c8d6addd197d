"""A build config's mixture schedule: the ``phases`` a user writes, over the union of their stores.

A config's ``phases`` (issue 40) is a list of ``{blend, until, ramp, seq_length}``: each phase's
``blend`` in any form ``blend`` takes (the config reads it and passes the reader in), ``until``
``{tokens|steps|samples: N}`` counted from the run's start, ``ramp: linear`` to move from the
previous phase's weights, ``seq_length`` if the phase has its own. Here they become what the
kernel (:mod:`tokenloom.index.schedule`) plans, which never sees a store:

* the **union** of the phases' stores, in first-seen order (:func:`union_stores`);
* each phase's weights **scattered** onto the union, zero where the phase does not name a store,
  normalised as a Blend normalises them (:func:`mixture_schedule`);
* the **batch-size schedule** from ``global_batch_size`` and ``rampup_batch_size`` or
  ``step_batch_size_schedule`` (:func:`batch_size_steps`), which turns ``steps`` into samples
  and puts each phase's end on an optimizer step's end.

Worked example: phase 1 ``["3", a, "1", b]`` until ``{samples: 8}``, phase 2 ``["1", c]`` until
``{samples: 12}``: the union is ``(a, b, c)``, phase 1's weights ``(0.75, 0.25, 0)``, phase 2's
``(0, 0, 1)``; with ``global_batch_size: 4`` the plan's counts are ``[[6, 2, 0], [0, 0, 4]]``.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from tokenloom.errors import BuildError, ConfigError
from tokenloom.index.batch_sizes import StepRuns, parse_step_schedule, rampup_steps
from tokenloom.index.blend_spec import BlendSpec, megatron_normalize
from tokenloom.index.length_runs import length_runs
from tokenloom.index.schedule import (
    RAMPS,
    MixtureSchedule,
    SchedulePhase,
    SchedulePlan,
    Until,
    parse_schedule,
    plan_schedule,
)
from tokenloom.index.schedule_exact import plan_exact_phases
from tokenloom.validate import check_positive_int, is_number

#: The keys a phase of a config's ``phases`` takes.
PHASE_KEYS = ("blend", "until", "ramp", "seq_length")

_EXAMPLE = "{blend: ['0.6', stores/web, '0.4', stores/code], until: {tokens: 8.0e+12}}"


def _whole_number(value: Any) -> Any:
    """``8e12`` as YAML reads it (a string) or ``8.0e+12`` (a float) as an int; else unchanged
    (the kernel's check names what is wrong)."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return value


@dataclass(frozen=True, kw_only=True)
class PhaseSpec:
    """One phase of a config's schedule, as the config wrote it (its stores, not the union's)."""

    blend: BlendSpec
    """The phase's stores and weights (a lone store may go without a weight)."""
    until: Until
    """Where the phase ends, counted from the start of the run; a mapping such as
    ``{"tokens": 8.0e+12}`` is read with :meth:`Until.parse`."""
    ramp: str | None = None
    """``"linear"``: the weights move step by step from the previous phase's to this one's."""
    seq_length: int | None = None
    """Tokens per sample in this phase; None: the build's ``seq_length``."""

    def __post_init__(self) -> None:
        if not isinstance(self.blend, BlendSpec):
            raise ConfigError(f"blend: {self.blend!r}; expected a BlendSpec (a config reads every form of blend)")
        until = self.until
        if isinstance(until, Mapping):
            until = {kind: _whole_number(amount) for kind, amount in until.items()}
        object.__setattr__(self, "until", Until.parse(until))
        if self.ramp is not None and self.ramp not in RAMPS:
            raise ConfigError(f"ramp: {self.ramp!r}; expected {' or '.join(repr(r) for r in RAMPS)}, or no ramp")
        if self.seq_length is not None:
            object.__setattr__(self, "seq_length", check_positive_int("seq_length", _whole_number(self.seq_length)))

    @property
    def weights(self) -> tuple[float, ...]:
        """The phase's weights, one per store of its blend (a lone store without one weighs 1)."""
        return self.blend.weights if self.blend.weights is not None else (1.0,)

    def to_dict(self, *, spelt: bool = False) -> dict[str, Any]:
        """Plain JSON-ready dict, the blend as ``{"prefixes": [...], "weights": [...]}`` (the
        stores as the config spelt them with ``spelt``)."""
        blend = self.blend
        return {"blend": {"prefixes": list(blend.spelt() if spelt else blend.prefixes),
                          "weights": None if blend.weights is None else list(blend.weights)},
                "until": {self.until.kind: self.until.amount}, "ramp": self.ramp, "seq_length": self.seq_length}


def read_phases(value: Any, read_blend: Callable[[Any, str], BlendSpec]) -> tuple[PhaseSpec, ...]:
    """A config's ``phases`` as PhaseSpecs: each entry a mapping (or a PhaseSpec) whose ``blend``
    ``read_blend(value, what)`` reads. Every error names the phase, counted from 1, and the key."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence) or not value:
        raise ConfigError(f"phases={value!r}; expected a list of phases such as [{_EXAMPLE}]")
    out = []
    for k, entry in enumerate(value, 1):
        if isinstance(entry, PhaseSpec):
            entry = {f.name: getattr(entry, f.name) for f in fields(entry)}
        if not isinstance(entry, Mapping):
            raise ConfigError(f"phase {k}: {entry!r}; expected a mapping such as {_EXAMPLE}")
        for key in entry:
            if key not in PHASE_KEYS:
                raise ConfigError(f"phase {k}: unknown key {key!r}{_did_you_mean(key)}; a phase takes "
                                  f"{', '.join(PHASE_KEYS)}")
        for key in ("blend", "until"):
            if key not in entry:
                raise ConfigError(f"phase {k}: no {key}; every phase needs blend and until, e.g. {_EXAMPLE}")
        what = f"phase {k}: blend"
        written = entry["blend"]
        if isinstance(written, Mapping) and {"tokens", "epochs", "budget_tokens"} & set(written):
            raise ConfigError(f"{what}: token and epoch budgets are not read in a phase; give each store a "
                              "weight and end the phase with until")
        blend = read_blend(written, what)
        if blend.weights is None and len(blend.prefixes) > 1:
            raise ConfigError(f"{what}: {len(blend.prefixes)} stores without weights; a phase's blend gives "
                              "every store a weight, e.g. ['0.6', stores/web, '0.4', stores/code]")
        try:
            out.append(PhaseSpec(blend=blend, until=entry["until"], ramp=entry.get("ramp"),
                                 seq_length=entry.get("seq_length")))
        except ConfigError as exc:
            raise ConfigError(f"phase {k}: {exc}") from None
    return tuple(out)


def _did_you_mean(key: Any) -> str:
    if key == "weights":
        return "; a phase's blend carries its weights (blend: ['0.6', stores/web, ...])"
    close = difflib.get_close_matches(str(key), PHASE_KEYS, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def union_stores(phases: Sequence[PhaseSpec]) -> BlendSpec:
    """The stores of every phase, each once, in first-seen order (weightless), spelt as the
    config first spelt them; ConfigError when a phase names a store twice."""
    prefixes: dict[str, str] = {}
    for k, phase in enumerate(phases, 1):
        seen = set()
        for prefix, written in zip(phase.blend.prefixes, phase.blend.spelt()):
            if prefix in seen:
                raise ConfigError(f"phase {k}: blend: names store {written!r} twice; give each store once, "
                                  "with its whole weight")
            seen.add(prefix)
            prefixes.setdefault(prefix, written)
    return BlendSpec(prefixes=tuple(prefixes), written_prefixes=tuple(prefixes.values()))


def mixture_schedule(phases: Sequence[PhaseSpec], union: BlendSpec) -> MixtureSchedule:
    """The kernel's schedule: each phase's weights scattered onto ``union`` (zero where the phase
    does not name a store), normalised as :class:`~tokenloom.index.blend.Blend` is handed them."""
    column = {prefix: d for d, prefix in enumerate(union.prefixes)}
    entries = []
    for phase in phases:
        weights = np.zeros(len(union.prefixes), dtype=np.float64)  # (D,) over the union
        for prefix, weight in zip(phase.blend.prefixes, phase.weights):
            weights[column[prefix]] = weight
        entries.append({"weights": megatron_normalize(weights).tolist(), "until": phase.until,
                        "ramp": phase.ramp, "seq_length": phase.seq_length})
    return parse_schedule(entries)


def batch_size_steps(*, global_batch_size: int | None, rampup_batch_size: Sequence[int] | None,
                     step_batch_size_schedule: str | None, seq_length: int) -> tuple[tuple[int, int], ...] | None:
    """The run's batch sizes as ``(threshold_samples, global_batch_size)`` steps: Megatron-LM's
    ``rampup_batch_size`` or ``step_batch_size_schedule`` (thresholds in tokens, as Megatron-LM
    reads them with its ``seq_length``), else ``global_batch_size`` throughout; None without a
    global batch size."""
    if rampup_batch_size is not None and step_batch_size_schedule is not None:
        raise ConfigError("rampup_batch_size and step_batch_size_schedule both given; give one batch-size "
                          "schedule (Megatron-LM refuses the pair too)")
    if step_batch_size_schedule is not None:
        steps = parse_step_schedule(step_batch_size_schedule, seq_length=seq_length)
        if global_batch_size is not None and steps[-1][1] != global_batch_size:
            raise ConfigError(f"step_batch_size_schedule={step_batch_size_schedule!r} ends at batch size "
                              f"{steps[-1][1]} but global_batch_size={global_batch_size}; expected them to agree "
                              "(or drop global_batch_size: the schedule's last size is the global batch)")
        return steps
    if global_batch_size is None:
        if rampup_batch_size is not None:
            raise ConfigError(f"rampup_batch_size={rampup_batch_size!r} without global_batch_size; the ramp "
                              "grows the batch to global_batch_size: give it")
        return None
    if rampup_batch_size is None:
        return ((0, global_batch_size),)
    if isinstance(rampup_batch_size, (str, bytes)) or not isinstance(rampup_batch_size, Sequence) \
            or len(rampup_batch_size) != 3:
        written = list(rampup_batch_size) if isinstance(rampup_batch_size, tuple) else rampup_batch_size
        raise ConfigError(f"rampup_batch_size={written!r}; expected Megatron-LM's "
                          "[start, increment, ramp_samples], e.g. [256, 128, 5000000]")
    start, increment, ramp_samples = (_whole_number(v) for v in rampup_batch_size)
    try:
        return rampup_steps(start=start, increment=increment, ramp_samples=ramp_samples,
                            global_batch_size=global_batch_size)
    except ConfigError as exc:
        raise ConfigError(f"rampup_batch_size={list(rampup_batch_size)!r}: {exc}") from None


def plan_phases(phases: Sequence[PhaseSpec], union: BlendSpec, *, seq_length: int,
                steps: Sequence[tuple[int, int]]) -> SchedulePlan:
    """The kernel's plan of ``phases`` over ``union`` on the batch-size ``steps``."""
    return plan_schedule(mixture_schedule(phases, union), seq_length=seq_length, global_batch_size=steps[-1][1],
                         batch_size_steps=steps)


def train_steps(steps: Sequence[tuple[int, int]], num_samples: int) -> int:
    """Megatron-LM's ``train_iters`` for a run of ``num_samples`` (``update_train_iters``): with a
    constant batch ``num_samples // global_batch_size``, else the steps until the samples are
    consumed (the last may be partial)."""
    if num_samples < 1:
        return 0
    if len(steps) == 1:
        return num_samples // steps[0][1]
    return int(StepRuns.of(steps).step_at(num_samples - 1)) + 1


def read_max_epochs(max_epochs: Any, *, stores: Sequence[str], names: Sequence[str]) -> Any:
    """``max_epochs`` checked: None, one number > 0 for every store, or ``{store: number > 0}``
    whose keys (already resolved as the config resolves stores) are among ``stores`` (spelt
    ``names``). Returns a float or a dict of floats."""
    if max_epochs is None:
        return None
    if isinstance(max_epochs, Mapping):
        out = {}
        for store, epochs in max_epochs.items():
            if store not in stores:
                close = difflib.get_close_matches(str(store), list(names) + list(stores), n=1, cutoff=0.6)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ConfigError(f"max_epochs: {store!r} is not a store of the build{hint} The stores are: "
                                  f"{', '.join(names[:10])}{' ...' if len(names) > 10 else ''}")
            out[store] = _epochs(epochs, f"max_epochs[{store!r}]")
        return out
    return _epochs(max_epochs, "max_epochs")


def _epochs(value: Any, what: str) -> float:
    value = _whole_number(value) if isinstance(value, str) else value
    if not is_number(value) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{what}={value!r}; expected a number of epochs > 0 (such as 1 or 2.5)")
    return float(value)


def epoch_room(max_epochs: Any, prefixes: Sequence[str], samples_per_epoch: Mapping[str, int]) -> np.ndarray:
    """``(D,)`` int64: samples each store of ``prefixes`` may serve, ``floor(max_epochs x samples
    an epoch)``; unlimited where it has no cap or its epoch is not known."""
    unlimited = np.iinfo(np.int64).max
    room = np.full(len(prefixes), unlimited, dtype=np.int64)
    for d, prefix in enumerate(prefixes):
        cap = max_epochs.get(prefix) if isinstance(max_epochs, Mapping) else max_epochs
        if cap is not None and prefix in samples_per_epoch:
            room[d] = math.floor(cap * int(samples_per_epoch[prefix]))
    return room


def format_schedule(plan: SchedulePlan, names: Sequence[str], *, prefixes: Sequence[str] | None = None,
                    samples_per_epoch: Mapping[str, int] | None = None, seq_length: int | None = None) -> str:
    """The dry run's schedule: per phase what its ``until`` asked, where the phase ended (the
    sample, and the optimizer steps begun by then), its samples and tokens; then each store's share of each phase (its
    samples in brackets) and its total, with the epochs of its train documents where known
    (``samples_per_epoch`` counted at ``seq_length``, the build's; epochs are counted in tokens,
    as a schedule that changes the sequence length takes them)."""
    steps = plan.boundary_steps
    tokens = [plan.phase_length(k) * plan.seq_lengths[k] for k in range(plan.num_phases)]
    lines = [f"schedule: {plan.num_phases} phases over {len(names)} store(s): {plan.num_samples:,} samples, "
             f"{steps[-1]:,} steps, {sum(tokens):,} tokens",
             f"  {'phase':>5}  {'until (asked)':<22} {'asked sample':>12} {'ends at sample':>14} {'steps':>8} "
             f"{'samples':>11} {'tokens':>15}  ramp"]
    for k, phase in enumerate(plan.schedule.phases):
        lines.append(f"  {k + 1:>5}  {phase.until!s:<22} {plan.requested[k]:>12,} {plan.boundaries[k + 1]:>14,} "
                     f"{steps[k + 1]:>8,} {plan.phase_length(k):>11,} {tokens[k]:>15,}  {phase.ramp or '-'}")
    width = max(12, *(len(n) for n in names))
    header = "".join(f"{'phase ' + str(k + 1):>18}" for k in range(plan.num_phases))
    lines.append(f"  {'store':<{width}}{header}{'total':>12}{'epochs':>9}")
    for d, name in enumerate(names):
        cells = "".join(f"{plan.counts[k, d] / plan.phase_length(k):>9.4f} ({int(plan.counts[k, d]):>6,})"
                        for k in range(plan.num_phases))
        total = int(plan.totals[d])
        prefix = None if prefixes is None else prefixes[d]
        per_epoch = None if samples_per_epoch is None or prefix is None else samples_per_epoch.get(prefix)
        taken = sum(int(plan.counts[k, d]) * plan.seq_lengths[k] for k in range(plan.num_phases))  # tokens
        epoch_tokens = None if not per_epoch else per_epoch * (seq_length or plan.seq_lengths[0])
        epochs = "-" if not epoch_tokens else f"{taken / epoch_tokens:.3f}"
        lines.append(f"  {name:<{width}}{cells}{total:>12,}{epochs:>9}")
    return "\n".join(lines)


@dataclass(frozen=True)
class ScheduleColumn:
    """One dataset of a schedule's train split: a store's length run (FORMAT.md "Length runs").

    A store whose sequence length never changes is one column holding every sample the schedule
    takes of it, indexed exactly as without a schedule (``first_token`` None). A store whose
    phases change it has one column per run, each an index of its own cut from the store's one
    token stream from ``first_token`` on."""

    store: int
    """The store's id in the union of the phases' stores."""
    seq_length: int
    """Tokens per sample of the run."""
    first_token: int | None
    """The stream token the run starts at (its earlier runs' samples x their sequence lengths);
    None for a store of one run (today's index)."""
    begin: int
    """The store's first sample (numbered on across phases, as the plan numbers it) in the run."""
    samples: int
    """Samples the run serves."""
    phases: tuple[int, ...] = ()
    """The 0-based phases the run serves samples in."""

    def to_list(self) -> list:
        """As a build key records it (the phases follow from the plan)."""
        return [self.store, self.seq_length, self.first_token, self.begin, self.samples]


def run_counts(plan: SchedulePlan, mode: str = "stateless") -> np.ndarray:
    """``(P, D)`` int64: the samples each phase takes of each store of the union, as a store's
    length runs are cut and numbered: the plan's exact counts (stateless), or megatron's targets
    of each phase's greedy, ``ceil(S_k w_kd)`` (exact: its greedy draws at most these, so every
    phase where a store has weight belongs to one of its runs, and a run holds its phases' targets)."""
    if mode == "exact":
        return np.stack([phase.targets for phase in plan_exact_phases(plan)]).astype(np.int64)
    return plan.counts


def schedule_columns(plan: SchedulePlan, served: Sequence[int],
                     counts: np.ndarray | None = None) -> list[ScheduleColumn]:
    """The train split's datasets of a schedule: each store of ``served`` (union ids, in the
    split's order) as its length runs, in order, cut by ``counts`` (:func:`run_counts`; default the
    plan's). With one sequence length throughout, one column per store."""
    runs = length_runs(plan.counts if counts is None else counts, plan.seq_lengths)
    out = []
    for d in served:
        begin = token = 0
        several = len(runs[d]) > 1
        for run in runs[d]:
            out.append(ScheduleColumn(store=int(d), seq_length=run.seq_length, first_token=token if several else None,
                                      begin=begin, samples=run.samples, phases=run.phases))
            begin += run.samples
            token += run.samples * run.seq_length  # the next run reads on from the first token not read
    return out


def has_length_runs(plan: SchedulePlan | None, seq_length: int) -> bool:
    """Whether a schedule's phases have a sequence length other than the build's ``seq_length``,
    so its train split's datasets are :func:`schedule_columns` (each at its run's length; a store
    of one run keeps today's index at that length) rather than the build's indices."""
    return plan is not None and any(int(s) != int(seq_length) for s in plan.seq_lengths)


def format_length_runs(plan: SchedulePlan, names: Sequence[str], counts: np.ndarray | None = None) -> str:
    """The dry run's length runs: for each store whose sequence length changes, each run's phases,
    sequence length, samples and the stream token it starts at (FORMAT.md "Length runs"; ``counts``:
    :func:`run_counts` of the build's mode)."""
    columns = schedule_columns(plan, range(plan.num_datasets), counts)
    several = [c for c in columns if c.first_token is not None]
    if not several:
        return (f"length runs: none (every store keeps one seq_length; the train split's samples have "
                f"{', '.join(str(s) for s in sorted(set(plan.seq_lengths)))} tokens)")
    lines = [f"length runs: the sequence length changes, so {len({c.store for c in several})} store(s) are read "
             "as runs, each from the token the one before stopped at"]
    for column in several:
        phases = ", ".join(str(k + 1) for k in column.phases)
        lines.append(f"  {names[column.store]}: phases {phases}: seq_length {column.seq_length:,}, "
                     f"{column.samples:,} samples from stream token {column.first_token:,}")
    return "\n".join(lines)


def schedule_blend_params(plan: SchedulePlan, served: Sequence[int], seq_length: int,
                          counts: np.ndarray | None = None) -> dict[str, Any]:
    """What the train split's blend item of a stateless schedule build hashes and rebuilds its
    plan from (:func:`schedule_plan_of`): each phase's weights over the union, its ramp and
    sequence length, the boundaries, the batch-size steps, the exact counts ``(P, D)``, and
    ``served``, the union's datasets the split reads (those with samples), in the split's order;
    with phases of several sequence lengths also ``columns``, the split's datasets as
    :func:`schedule_columns` gives them, cut by ``counts`` (:func:`run_counts` of the build's mode)."""
    phases = [{"weights": list(phase.weights), "ramp": phase.ramp, "seq_length": seq}
              for phase, seq in zip(plan.schedule.phases, plan.seq_lengths)]
    params = {"phases": phases, "boundaries": list(plan.boundaries),
              "batch_steps": [list(step) for step in plan.batch_steps],
              "counts": plan.counts.tolist(), "served": [int(d) for d in served]}
    if has_length_runs(plan, seq_length):  # keyed only where it says more than served (keys stay as they were)
        params["columns"] = [column.to_list() for column in schedule_columns(plan, served, counts)]
    return params


def schedule_plan_of(schedule: Mapping[str, Any]) -> SchedulePlan:
    """The plan :func:`schedule_blend_params` recorded, planned again: each phase ends where the
    first planning put it (``until: {samples: boundary}``, already a step's end), so the order and
    the counts are the same; BuildError if they differ from those recorded."""
    ends = schedule["boundaries"][1:]
    phases = tuple(SchedulePhase(weights=tuple(p["weights"]), until={"samples": int(end)}, ramp=p["ramp"],
                                 seq_length=p["seq_length"]) for p, end in zip(schedule["phases"], ends))
    steps = tuple((int(t), int(size)) for t, size in schedule["batch_steps"])
    plan = plan_schedule(MixtureSchedule(phases=phases), seq_length=int(phases[0].seq_length),
                         global_batch_size=steps[-1][1], batch_size_steps=steps)
    if list(plan.boundaries) != list(schedule["boundaries"]) or plan.counts.tolist() != schedule["counts"]:
        raise BuildError(f"a schedule planned again ends its phases at {list(plan.boundaries)} with counts "
                          f"{plan.counts.tolist()}, not the recorded {schedule['boundaries']} and "
                          f"{schedule['counts']}; the cache entry was made by another version: build again")
    return plan


__all__ = [
    "PHASE_KEYS",
    "PhaseSpec",
    "ScheduleColumn",
    "batch_size_steps",
    "epoch_room",
    "format_length_runs",
    "format_schedule",
    "has_length_runs",
    "mixture_schedule",
    "plan_phases",
    "read_max_epochs",
    "read_phases",
    "run_counts",
    "schedule_blend_params",
    "schedule_columns",
    "schedule_plan_of",
    "train_steps",
    "union_stores",
]
