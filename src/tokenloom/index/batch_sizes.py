"""Global batch size as a step function of consumed samples, and the optimizer steps it makes.

megatron-core 0.19.2 sizes each optimizer step by the samples consumed before it: the step that
starts after ``consumed`` samples takes the batch size of the last threshold at or below
``consumed`` (``StepBatchsizeNumMicroBatchesCalculator``, ``--step-batch-size-schedule
"0:768 250B:1536"``). A schedule is written here as its ``steps``: ``(threshold_samples,
global_batch_size)`` pairs, thresholds strictly increasing from 0 (:func:`check_steps`).

The classic ``--rampup-batch-size start increment ramp_samples`` (Megatron-LM's
``RampupBatchsizeNumMicroBatchesCalculator``; megatron-core 0.19.2 still accepts the argument of
``init_num_microbatches_calculator`` but ignores it) is such a step function:
:func:`rampup_steps` writes it as one.

Between two thresholds every step has one size, so a schedule's steps form a few *runs* of equal
steps (:class:`StepRuns`). A step that starts below a threshold keeps its size even when it ends
past it, so a run ends at the first step start at or after the next threshold. Step ``k``'s first
sample, and the step holding sample ``x``, are then a binary search over the runs and a division.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass

import numpy as np

from tokenloom.errors import ConfigError
from tokenloom.validate import is_integer

__all__ = ["StepRuns", "check_steps", "parse_step_schedule", "rampup_steps"]


def _positive(name: str, value) -> int:
    if not is_integer(value) or value < 1:
        raise ConfigError(f"{name}={value!r}; expected a positive integer")
    return int(value)


def check_steps(steps) -> tuple[tuple[int, int], ...]:
    """``steps`` as a tuple of ``(threshold_samples, global_batch_size)`` integer pairs, or
    ConfigError: thresholds must start at 0 and increase strictly, batch sizes be positive."""
    try:
        pairs = tuple((int(t), int(s)) for t, s in steps)
    except (TypeError, ValueError):
        raise ConfigError(f"batch size steps {steps!r}; expected (threshold_samples, global_batch_size) "
                          "pairs such as ((0, 768), (61035156, 1536))") from None
    if not pairs or pairs[0][0] != 0:
        raise ConfigError(f"batch size steps {steps!r}; expected a first entry at threshold 0")
    for (a, _), (b, _) in itertools.pairwise(pairs):
        if b <= a:
            raise ConfigError(f"batch size thresholds {a} then {b}; expected strictly increasing")
    for _, size in pairs:
        _positive("global batch size", size)
    return pairs


def parse_step_schedule(text: str, *, seq_length: int | None = None) -> tuple[tuple[int, int], ...]:
    """Megatron's ``--step-batch-size-schedule`` text, ``"THRESHOLD:BS THRESHOLD:BS ..."`` (K/M/B/T
    suffixes), as checked ``steps``: thresholds in tokens when ``seq_length`` is given (divided by
    it, rounding down, as megatron-core converts them), else in samples."""
    if not isinstance(text, str):
        raise ConfigError(f"batch size schedule {text!r}; expected Megatron's text such as '0:768 250B:1536'")
    entries = []
    for entry in text.replace(",", " ").split():
        if ":" not in entry:
            raise ConfigError(f"schedule entry {entry!r}; expected THRESHOLD:BATCH_SIZE, e.g. '250B:1536'")
        threshold, size = (_parse_count(part, entry) for part in entry.split(":", 1))
        if seq_length is not None:
            threshold //= seq_length
        entries.append((threshold, size))
    return check_steps(sorted(entries))


def _parse_count(text: str, entry: str) -> int:
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMBT]?)\s*", text.upper())
    if match is None:
        raise ConfigError(f"schedule entry {entry!r}: {text!r} is not a number with an optional K/M/B/T suffix")
    scale = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}[match.group(2)]
    return int(float(match.group(1)) * scale)


def rampup_steps(*, start: int, increment: int, ramp_samples: int,
                 global_batch_size: int) -> tuple[tuple[int, int], ...]:
    """Megatron-LM's ``--rampup-batch-size start increment ramp_samples`` as step-schedule
    ``steps``: the batch grows from ``start`` by ``increment`` every
    ``ramp_samples / num_increments`` consumed samples (``start + int(consumed / per_increment) *
    increment``), and is ``global_batch_size`` once more than ``ramp_samples`` are consumed."""
    start, increment = _positive("start", start), _positive("increment", increment)
    global_batch_size = _positive("global_batch_size", global_batch_size)
    ramp_samples = _positive("ramp_samples", ramp_samples)
    difference = global_batch_size - start
    if difference < 0 or difference % increment:
        raise ConfigError(
            f"rampup from {start} to global_batch_size {global_batch_size} in increments of "
            f"{increment}: the difference {difference} must be a non-negative multiple of it")
    num_increments = difference // increment
    if num_increments == 0:
        return ((0, global_batch_size),)
    per_increment = ramp_samples / num_increments
    steps = [(0, start)]
    for k in range(1, num_increments + 1):
        # the first consumed count c with int(c / per_increment) >= k (and c <= ramp_samples);
        # below one sample per increment, several increments land on the same count
        c = max(math.ceil(k * per_increment) - 2, steps[-1][0])
        while int(c / per_increment) < k:
            c += 1
        if c > ramp_samples:
            break
        if c == steps[-1][0]:
            steps[-1] = (c, start + k * increment)
        else:
            steps.append((c, start + k * increment))
    if steps[-1][1] != global_batch_size:
        steps.append((ramp_samples + 1, global_batch_size))
    return tuple(steps)


@dataclass(frozen=True, kw_only=True, eq=False)
class StepRuns:
    """The optimizer steps of a batch-size schedule, as runs of equal steps (the last run never
    ends). Build one with :meth:`of`."""

    first_step: np.ndarray
    """``(R,)`` int64: the index of each run's first step."""
    first_sample: np.ndarray
    """``(R,)`` int64: the samples consumed before each run's first step."""
    size: np.ndarray
    """``(R,)`` int64: the global batch size of every step of the run."""

    @classmethod
    def of(cls, steps) -> StepRuns:
        """The runs of the schedule ``steps`` (``(threshold_samples, global_batch_size)`` pairs)."""
        pairs = check_steps(steps)
        thresholds = [t for t, _ in pairs]
        first_step, first_sample, size = [], [], []
        step, consumed, i = 0, 0, 0
        while True:
            while i + 1 < len(pairs) and thresholds[i + 1] <= consumed:
                i += 1  # the last threshold at or below `consumed` sizes the next step
            batch = pairs[i][1]
            if not size or size[-1] != batch:
                first_step.append(step)
                first_sample.append(consumed)
                size.append(batch)
            if i + 1 == len(pairs):
                break
            count = -(-(thresholds[i + 1] - consumed) // batch)  # steps that start below the next threshold
            step, consumed = step + count, consumed + count * batch
        as_array = lambda values: np.array(values, dtype=np.int64)  # noqa: E731
        return cls(first_step=as_array(first_step), first_sample=as_array(first_sample), size=as_array(size))

    @classmethod
    def constant(cls, global_batch_size: int) -> StepRuns:
        """Every step takes ``global_batch_size`` samples."""
        return cls.of(((0, _positive("global_batch_size", global_batch_size)),))

    def step_start(self, steps) -> np.ndarray:
        """Samples consumed before each of the (0-based) optimizer ``steps`` (int64, their shape)."""
        k = np.asarray(steps, dtype=np.int64)
        if k.size and k.min() < 0:
            raise ConfigError(f"step {int(k.min())}; expected a non-negative step index")
        run = np.searchsorted(self.first_step, k, side="right") - 1
        return self.first_sample[run] + (k - self.first_step[run]) * self.size[run]

    def step_at(self, samples) -> np.ndarray:
        """The step holding each sample position of ``samples`` (the last step starting at or before
        it; int64, their shape): a step boundary ``x`` gives the step that starts at ``x``."""
        x = np.asarray(samples, dtype=np.int64)
        if x.size and x.min() < 0:
            raise ConfigError(f"sample position {int(x.min())}; expected a non-negative position")
        run = np.searchsorted(self.first_sample, x, side="right") - 1
        return self.first_step[run] + (x - self.first_sample[run]) // self.size[run]

    def size_of(self, steps) -> np.ndarray:
        """The global batch size of each of the optimizer ``steps`` (int64, their shape)."""
        k = np.asarray(steps, dtype=np.int64)
        return self.size[np.searchsorted(self.first_step, k, side="right") - 1]

    def runs_between(self, first: int, stop: int) -> list[tuple[int, int, int]]:
        """``(first_step, stop_step, size)`` of the runs' parts inside steps ``[first, stop)``."""
        out = []
        bounds = [*self.first_step.tolist()[1:], None]
        for begin, end, size in zip(self.first_step.tolist(), bounds, self.size.tolist()):
            lo, hi = max(begin, first), stop if end is None else min(end, stop)
            if lo < hi:
                out.append((lo, hi, size))
        return out
