"""Which global positions each data-parallel rank reads, step after step, and the state to resume.

The state is the global count of consumed samples (plus where inside a step the run stopped),
the build key, the schema version, any blend weight changes, and the positions taken out of the
stream (skipped steps, quarantined documents). Nothing in it depends on the layout, so a run
saved at dp=4 resumes at dp=2 or dp=8 on the identical global stream.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from tokenloom.errors import ConfigError
from tokenloom.serve.balance import check_balance_source, steps_placement
from tokenloom.serve.geometry import BatchGeometry, check_planned_steps
from tokenloom.serve.stream import SampleStream
from tokenloom.serve.weight_changes import BlendSegment
from tokenloom.source import SampleSource
from tokenloom.validate import is_integer

PLACE_AHEAD_SAMPLES = 2048
"""Samples a balanced sampler places at once, the current step's and the next steps' (at least
one step): enough that the per-call cost of locating, costing and placing spreads thin, few
enough that the index arrays they touch stay in cache and the first step waits little."""
PLACE_AHEAD_STEPS = 256
"""Most steps placed at once (small global batches)."""

STATE_FORMAT = "tokenloom-serve-state"
SCHEMA_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
"""Version 1 (before skips and quarantines) reads as a state with neither; version 2 (blend
segments as decimal lists, online-mixing history with its weights) reads as written."""


class MicroBatchSampler:
    """Positions of every micro-batch of one data-parallel rank, in training order.

    Step ``k`` starts after ``consumed`` samples and serves ``[consumed, consumed + G)``; its
    micro-step ``m`` gives rank ``r`` positions ``consumed + m x micro x dp + r x micro + [0, micro)``.
    Iteration stops before the first step the stream cannot fill (or after ``max_steps`` steps).
    With ``geometry.balance`` the step's positions are the same, placed on the (micro-step, rank)
    slots by their cost (:meth:`placement`, :mod:`tokenloom.serve.balance`). A source with a
    mixture schedule needs the geometry's steps to be the ones its phase boundaries were planned on
    (ConfigError otherwise; :func:`check_planned_steps`).
    """

    def __init__(self, source: SampleSource | SampleStream, geometry: BatchGeometry, *, dp_rank: int = 0,
                 max_steps: int | None = None) -> None:
        self.stream = source if isinstance(source, SampleStream) else SampleStream(source)
        self.geometry = geometry
        schedule = getattr(self.stream.source, "schedule", None)
        if schedule is not None:  # every loader and adapter builds its sampler here
            check_planned_steps(geometry, schedule.plan)
        if not 0 <= dp_rank < geometry.dp:
            raise ConfigError(f"dp_rank={dp_rank!r}; expected an integer in [0, {geometry.dp})")
        self.dp_rank = int(dp_rank)
        check_balance_source(self.stream.source, geometry)
        self.max_steps = max_steps
        self._placed: tuple[SampleStream, dict[int, np.ndarray]] | None = None
        """The stream and the :meth:`placement` of the steps placed ahead on it, by step start."""
        self.step = 0
        """Optimizer steps completed."""
        self.step_start = 0
        """Samples consumed before the current step."""
        self.micro_batch = 0
        """Micro-steps of the current step already served."""

    # -- the schedule ---------------------------------------------------------------------------
    @property
    def source(self) -> SampleSource:
        return self.stream.source

    @property
    def consumed_samples(self) -> int:
        """Global samples consumed so far (Megatron's ``consumed_samples``)."""
        return self.step_start + self.micro_batch * self.geometry.samples_per_micro_step

    @property
    def global_batch_size(self) -> int:
        """Global batch size of the current step."""
        return self.size_at(self.step_start)

    def size_at(self, consumed: int) -> int:
        """Samples of the step that starts after ``consumed`` served samples. On a mixture schedule
        the build placed the steps and the phases on the stream's underlying positions, and steps
        taken out by ``skip_steps`` still count, as Megatron-LM counts a skipped iteration's
        samples as consumed; so a batch-size ramp is read there and every later step stays on the
        build's grid. Other builds keep the served count (their states were saved that way)."""
        if self.geometry.schedule is None or self.stream.schedule is None:
            return self.geometry.global_batch_size_at(consumed)
        return self.geometry.global_batch_size_at(int(self.stream.underlying(np.array([consumed]))[0]))

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches in the current step."""
        return self.geometry.num_micro_batches_for(self.global_batch_size)

    def global_batch_positions(self) -> np.ndarray:
        """(G,) int64: the current step's positions over all ranks, in stream order."""
        return np.arange(self.step_start, self.step_start + self.global_batch_size, dtype=np.int64)

    def exhausted(self) -> bool:
        """True when no further step can be served."""
        if self.max_steps is not None and self.step >= self.max_steps and self.micro_batch == 0:
            return True
        return self.step_start + self.global_batch_size > self.stream.num_samples

    def positions(self) -> np.ndarray:
        """(micro,) int64: this rank's positions of the next micro-batch (no advance)."""
        micro = self.geometry.micro_batch_size
        if self.geometry.balance is not None:
            first = self.micro_batch * self.geometry.samples_per_micro_step + self.dp_rank * micro
            return self.placement()[first:first + micro].copy()
        first = self.consumed_samples + self.dp_rank * micro
        return np.arange(first, first + micro, dtype=np.int64)

    def placement(self) -> np.ndarray:
        """(G,) int64: the current step's positions in slot order, slot ``m x micro x dp + r x micro
        + j`` being rank ``r``'s micro-batch ``m`` (Megatron's order: the positions ascending,
        unless the geometry balances). Computed from the index, the same on every rank, for this
        step and the ones after it at once (:func:`~tokenloom.serve.balance.steps_placement`:
        about :data:`PLACE_AHEAD_SAMPLES` samples, as many steps as the stream fills), and kept
        for the stream they were placed on: a weight change, skip, quarantine or resume makes a
        new stream, whose steps are placed anew as it now is."""
        placed = self._placed
        if placed is None or placed[0] is not self.stream or self.step_start not in placed[1]:
            placed = self._placed = (self.stream, _place_ahead(self))
        return placed[1][self.step_start]

    def advance(self) -> None:
        """Move past one micro-step (and to the next step after the last one)."""
        self.micro_batch += 1
        if self.micro_batch == self.num_micro_batches:
            self.next_step()

    def next_step(self) -> None:
        """Move to the start of the next step, past the current step's remaining micro-batches."""
        self.step_start += self.global_batch_size
        self.step += 1
        self.micro_batch = 0

    def __iter__(self) -> Iterator[np.ndarray]:
        while not self.exhausted():
            positions = self.positions()
            self.advance()
            yield positions

    def __len__(self) -> int:
        """Micro-batches left for this rank."""
        probe = self.copy()
        count = 0
        while not probe.exhausted():
            count += probe.num_micro_batches - probe.micro_batch
            probe.next_step()
        return count

    # -- copy and seek --------------------------------------------------------------------------
    def copy(self) -> MicroBatchSampler:
        """An independent sampler of the same stream, rank and limit, at the same place (what an
        iterator or a probe advances without moving this one)."""
        twin = MicroBatchSampler(self.stream, self.geometry, dp_rank=self.dp_rank, max_steps=self.max_steps)
        twin.seek(self.step, self.step_start, self.micro_batch)
        twin._placed = self._placed  # read-only: a new step computes its own
        return twin

    def seek(self, step: int, step_start: int, micro_batch: int = 0) -> None:
        """Continue ``micro_batch`` micro-steps into optimizer step ``step`` (0-based), which
        starts after ``step_start`` global samples. The caller keeps ``step_start`` on the
        geometry's schedule (it is the sum of the global batch sizes of steps ``[0, step)``)."""
        for name, value in (("step", step), ("step_start", step_start), ("micro_batch", micro_batch)):
            if not is_integer(value) or value < 0:
                raise ConfigError(f"{name}={value!r}; expected a non-negative integer")
        if micro_batch:  # 0 is in every step
            micro_batches = self.geometry.num_micro_batches_for(self.size_at(int(step_start)))
            if micro_batch >= micro_batches:
                raise ConfigError(f"micro_batch={micro_batch}; the step starting after {step_start} samples has "
                                  f"{micro_batches} micro-batches, so expected an integer in [0, {micro_batches})")
        self.step, self.step_start, self.micro_batch = int(step), int(step_start), int(micro_batch)

    # -- weights --------------------------------------------------------------------------------
    def reweight(self, weights) -> None:
        """Blend with ``weights`` from the current position on; every dataset continues from the
        sample it had reached. Only between steps."""
        if self.micro_batch:
            raise ConfigError(f"blend weights can change between steps only; {self.micro_batch} "
                              f"micro-batches of step {self.step} are already served")
        refuse_on_length_runs(self.stream, "a weight change at run time")
        self.stream = self.stream.reweighted(self.step_start, weights)

    # -- skips ----------------------------------------------------------------------------------
    def skip_steps(self, first: int, stop: int) -> None:
        """Never serve the samples steps ``[first, stop)`` (0-based, global) would serve now:
        step ``first`` gets the samples that would have come after them, and so on (after a loss
        spike: resume from a checkpoint before it and skip the steps around it). ``first`` is
        this step or a later one; between steps only. The skip is part of the state."""
        if self.micro_batch:
            raise ConfigError(f"steps can be skipped between steps only; {self.micro_batch} micro-batches of "
                              f"step {self.step} are already served")
        if not (is_integer(first) and is_integer(stop)) or not self.step <= first <= stop:
            raise ConfigError(f"skip steps [{first}, {stop}); expected {self.step} <= first <= stop (step "
                              f"{self.step} is the next to serve; load an earlier state to skip earlier steps)")
        begin = self.step_start
        for _ in range(self.step, first):  # the logical positions of those steps, batch ramp included
            begin += self.size_at(begin)
        end = begin
        for _ in range(first, stop):
            end += self.size_at(end)
        end = min(end, self.stream.num_samples)
        self.stream = self.stream.skipped(min(begin, end), end)

    def quarantine(self, items) -> None:
        """Never serve, from the next step on, a sample holding a piece of any of ``items``:
        ``(store prefix, document id)`` pairs (the build's split must be the source). Later steps
        get the samples that follow; weight changes after this keep the quarantine. Between steps
        only; part of the state."""
        if self.micro_batch:
            raise ConfigError(f"documents can be quarantined between steps only; {self.micro_batch} "
                              f"micro-batches of step {self.step} are already served")
        pairs = []
        for item in items:
            try:
                prefix, document = item
            except (TypeError, ValueError):
                raise ConfigError(f"quarantine item {item!r}; expected a (store prefix, document id) pair") from None
            if not isinstance(prefix, str) or not is_integer(document) or document < 0:
                raise ConfigError(f"quarantine item {item!r}; expected a (store prefix, document id) pair")
            pairs.append((prefix, int(document)))
        self.stream = self.stream.quarantined_from(self.step_start, pairs)
        self._align_length_changes()

    def _align_length_changes(self) -> None:
        """After a quarantine (it removes single samples, so later steps start elsewhere), put
        every later change of sequence length back at a step's start: a step is one array, so
        its rows share one width. The old phase's samples in the step that would straddle the
        change are dropped (skipped, so the audit counts them), which is fewer than one step each."""
        schedule = self.stream.schedule
        if getattr(schedule, "columns", None) is None:  # no length runs: every step has one width
            return
        plan = schedule.plan
        changes = [int(b) for k, b in enumerate(plan.boundaries[1:-1], 1)
                   if plan.seq_lengths[k] != plan.seq_lengths[k - 1]]
        begin = self.step_start  # a logical step start
        for change in changes:
            if change <= int(self.stream.underlying(np.array([begin]))[0]):
                continue
            at = self.stream.logical(change)  # where the new length's first sample is served
            if self.geometry.schedule is None:  # steps of one size: no walk
                size = self.geometry.global_batch_size
                begin += (at - begin) // size * size
            else:
                while begin + self.size_at(begin) <= at:
                    begin += self.size_at(begin)
            if begin < at:
                self.stream = self.stream.skipped(begin, at)

    # -- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """JSON-ready, layout-free state (see FORMAT.md, "Serving state")."""
        return {
            "format": STATE_FORMAT,
            "schema_version": SCHEMA_VERSION,
            "build_key": self.source.build_key,
            "consumed_samples": self.consumed_samples,
            "step": self.step,
            "step_start_samples": self.step_start,
            "micro_batch": self.micro_batch,
            "samples_per_micro_step": self.geometry.samples_per_micro_step,
            "blend_segments": [s.to_dict() for s in self.stream.segments],
            "skipped_ranges": [list(r) for r in self.stream.skips],
            "quarantine": [{"prefix": p, "document": d} for p, d in self.stream.quarantine],
            "quarantined_positions": [int(p) for p in self.stream.quarantined],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved state; ConfigError when it belongs to another build or schema."""
        check_state(state, self.source.build_key)
        micro_batch = int(state["micro_batch"])
        if micro_batch and int(state["samples_per_micro_step"]) != self.geometry.samples_per_micro_step:
            raise ConfigError(
                f"the state was saved {micro_batch} micro-batches into step {state['step']} with "
                f"{state['samples_per_micro_step']} samples per micro-step; this geometry takes "
                f"{self.geometry.samples_per_micro_step}. Resume on another layout from a state "
                "saved between steps")
        self.stream = stream_from_state(self.source, state)
        self.seek(int(state["step"]), int(state["step_start_samples"]), micro_batch)


def _place_ahead(sampler: MicroBatchSampler) -> dict[int, np.ndarray]:
    """The placements of ``sampler``'s current step and the next ones, by step start: about
    :data:`PLACE_AHEAD_SAMPLES` samples' steps, those the stream fills (at least the current one)."""
    starts, sizes = [], []
    start, total = sampler.step_start, 0
    while not starts or (total < PLACE_AHEAD_SAMPLES and len(starts) < PLACE_AHEAD_STEPS):
        size = sampler.size_at(start)
        if starts and start + size > sampler.stream.num_samples:  # the stream cannot fill it
            break
        starts.append(start)
        sizes.append(size)
        start, total = start + size, total + size
    try:
        placements = steps_placement(sampler.stream, sampler.geometry, starts, sizes)
    except ConfigError:  # CostModel.sample_costs' overflow guard counts the batch: per step, as ever
        if len(starts) == 1:
            raise
        starts, sizes = starts[:1], sizes[:1]
        placements = steps_placement(sampler.stream, sampler.geometry, starts, sizes)
    return dict(zip(starts, placements))


def stream_from_state(source: SampleSource, state: dict[str, Any]) -> SampleStream:
    """The stream a serving state serves on ``source``: its weight changes, skipped steps and
    quarantined documents (what ``tokenloom where`` and ``find`` read with ``--state``).
    ConfigError for a state of another build or schema, or a malformed one."""
    check_state(state, source.build_key)
    segments = tuple(BlendSegment.from_dict(s) for s in state.get("blend_segments", []))
    try:
        skips = tuple((int(a), int(b)) for a, b in state.get("skipped_ranges", []))
        quarantine = tuple((str(q["prefix"]), int(q["document"])) for q in state.get("quarantine", []))
        quarantined = np.asarray([int(p) for p in state.get("quarantined_positions", [])], dtype=np.int64)
    except (TypeError, ValueError, KeyError) as exc:
        raise ConfigError(f"serving state: malformed skipped_ranges / quarantine / quarantined_positions "
                          f"({exc}); expected [[begin, end], ...], [{{prefix, document}}, ...], "
                          "[positions]") from None
    return SampleStream(source, segments, skips=skips, quarantine=quarantine, quarantined=quarantined)


def refuse_on_length_runs(stream: SampleStream, what: str) -> None:
    """ConfigError for ``what`` (a change of weights) on a split of length runs: a store's runs are
    cut end to end from its token stream, each sized for the schedule's own counts, so no run has
    room to serve more (FORMAT.md "Length runs")."""
    if getattr(stream.schedule, "columns", None) is not None:
        raise ConfigError(f"{what} on this build: its schedule has phases at a seq_length other than the "
                          "build's, so the train split reads stores as length runs cut end to end from their "
                          "token streams, sized for the schedule's own counts, and no run has room for more; not "
                          "supported yet: serve it with the declared weights, or build phases at the build's "
                          "seq_length")


def check_state(state: dict[str, Any], build_key: str) -> None:
    """Raise ConfigError unless ``state`` is a serving state of this build and schema."""
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise ConfigError(f"not a tokenloom serving state (format {found!r}, expected {STATE_FORMAT!r})")
    if state.get("schema_version") not in READABLE_VERSIONS:
        raise ConfigError(f"serving state schema version {state.get('schema_version')!r}; this tokenloom "
                          f"reads versions {list(READABLE_VERSIONS)}")
    if state.get("build_key") != build_key:
        raise ConfigError(
            f"the serving state belongs to build {str(state.get('build_key'))[:16]}..., but this source is "
            f"build {build_key[:16]}...; resuming would serve a different stream. Load the state "
            "with the build it was saved from")
    for name in ("consumed_samples", "step", "step_start_samples", "micro_batch", "samples_per_micro_step"):
        value = state.get(name)
        if not is_integer(value) or value < 0:
            raise ConfigError(f"serving state field {name}={value!r}; expected a non-negative integer")


__all__ = ["READABLE_VERSIONS", "SCHEMA_VERSION", "STATE_FORMAT", "MicroBatchSampler", "check_state",
           "refuse_on_length_runs", "stream_from_state"]
