"""The weight changes as they were before changes took over each other's work in O(datasets) and a
resume stopped rebuilding every blend (tokenloom commit 8e65ee8, ``serve/weight_changes.py``):
the slow, plain reference that ``test_serve_weight_changes.py`` checks the fast one against. Kept
verbatim below this note (only this docstring differs); not imported by tokenloom.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tokenloom.errors import ConfigError
from tokenloom.index.blend import Blend, largest_remainder_counts
from tokenloom.source import SampleSource

_COUNT_CHUNK = 1 << 22


@dataclass(frozen=True, kw_only=True)
class BlendSegment:
    """Weights that take over the stream from one position on."""

    start: int
    """First global position served with these weights."""
    weights: tuple[float, ...]
    """Normalised weights, one per dataset of the source (zero leaves a dataset out)."""
    dataset_offsets: tuple[int, ...]
    """Samples each dataset had given before ``start``; the segment continues from there."""

    def to_dict(self) -> dict:
        """JSON-ready form (stored in the serving state)."""
        return {"start": self.start, "weights": list(self.weights), "dataset_offsets": list(self.dataset_offsets)}

    @classmethod
    def from_dict(cls, data: dict) -> BlendSegment:
        """Inverse of :meth:`to_dict`."""
        return cls(start=int(data["start"]), weights=tuple(float(w) for w in data["weights"]),
                   dataset_offsets=tuple(int(o) for o in data["dataset_offsets"]))


def count_samples(position: int, locate, num_datasets: int) -> np.ndarray:
    """(num_datasets,) int64: samples of each dataset ``locate`` gives in positions ``[0, position)``,
    one chunk of positions at a time."""
    counts = np.zeros(num_datasets, dtype=np.int64)
    for begin in range(0, position, _COUNT_CHUNK):
        dataset_ids, _ = locate(np.arange(begin, min(position, begin + _COUNT_CHUNK)))
        counts += np.bincount(dataset_ids, minlength=num_datasets)
    return counts


class WeightChanges:
    """The underlying stream: a source and the segments that changed its weights (see the
    module's docstring). Positions here are *underlying* ones."""

    def __init__(self, source: SampleSource, segments: tuple[BlendSegment, ...] = (), *,
                 reuse: WeightChanges | None = None) -> None:
        """``reuse``: changes of the same source whose leading segments these share (the same
        objects): their blends, shifts and room checks are taken over, not redone, so a series
        of changes costs O(datasets) each, not O(changes x datasets)."""
        self.source = source
        self.segments = tuple(segments)
        self.schedule = getattr(source, "schedule", None)
        """The source's mixture schedule (a ``ScheduleLocator``), or None: one blend throughout."""
        self.num_samples = source.num_samples
        """Positions of the underlying stream: fewer than the source's after a weight change on a
        single blend when a dataset's index runs out."""
        num_datasets = len(source.datasets)
        for k, segment in enumerate(self.segments):
            if len(segment.weights) != num_datasets:
                raise ConfigError(f"a blend segment has {len(segment.weights)} weights; the source has "
                                  f"{num_datasets} datasets")
            if k and segment.start <= self.segments[k - 1].start:
                raise ConfigError("blend segments must start at increasing positions")
        self._starts = np.array([s.start for s in self.segments], dtype=np.int64)
        self._blends: dict[int, tuple[Blend, np.ndarray]] = {}
        self._ends = np.append(self._starts[1:], source.num_samples)  # where each segment stops serving
        self._phase_ends = self._ends
        self._shifts = np.zeros((len(self.segments), num_datasets), dtype=np.int64)
        shared = 0  # leading segments taken over from `reuse`
        if reuse is not None and reuse.source is source:
            while shared < min(len(reuse.segments), len(self.segments)) and \
                    reuse.segments[shared] is self.segments[shared]:
                shared += 1
            self._blends = {k: blend for k, blend in reuse._blends.items() if k < shared}
            # the last shared segment may end elsewhere now (a later change came or went)
            self._shifts[:max(shared - 1, 0)] = reuse._shifts[:max(shared - 1, 0)]
        if self.segments and self.schedule is not None:
            self._plan_phase_segments(first=max(shared - 1, 0))
        elif self.segments:
            self.num_samples = self._usable_length()

    # -- lookups --------------------------------------------------------------------------------
    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(dataset_ids, sample_ids)`` int64 of underlying ``positions`` (not range-checked)."""
        if not self.segments:
            return self.source.locate(positions)
        which = np.searchsorted(self._starts, positions, side="right") - 1  # -1: before any change
        dataset_ids = np.empty(positions.shape, dtype=np.int64)
        sample_ids = np.empty(positions.shape, dtype=np.int64)
        # the source serves what no segment covers: before the first, and between a segment's
        # phase end and the next (schedules only), numbered on by the last segment's shift
        base = (which < 0) | (positions >= self._ends[np.maximum(which, 0)])
        if base.any():
            dataset_ids[base], sample_ids[base] = self.source.locate(positions[base])
            after = base & (which >= 0)
            if after.any():
                sample_ids[after] += self._shifts[which[after], dataset_ids[after]]
        for k in np.unique(which[~base]):
            mask = (which == k) & ~base
            blend, offsets = self.segment_blend(int(k))
            ids, local_samples = blend.lookup(positions[mask] - self.segments[k].start)
            dataset_ids[mask], sample_ids[mask] = ids, local_samples + offsets[ids]
        return dataset_ids, sample_ids

    def segment_blend(self, k: int) -> tuple[Blend, np.ndarray]:
        """Segment ``k``'s blend and each dataset's sample offset in it."""
        if k not in self._blends:
            segment = self.segments[k]
            offsets = np.asarray(segment.dataset_offsets, dtype=np.int64)
            if self.schedule is not None:  # to the phase's end, even where a later change cuts it first
                length = int(self._phase_ends[k]) - segment.start
            else:
                room = np.array([d.num_samples for d in self.source.datasets], dtype=np.int64) - offsets
                length = segment_length(segment.weights, room, self.source.num_samples - segment.start)
            self._blends[k] = (Blend(np.asarray(segment.weights), length), offsets)
        return self._blends[k]

    def segment_end(self, k: int) -> int:
        """Where segment ``k`` stops serving: the next change, or on a schedule the end of its
        phase if that comes first; else the end of the source."""
        return int(self._ends[k])

    def change_holding(self, position: int) -> int | None:
        """The segment serving ``position``, or None (the source serves it)."""
        k = int(np.searchsorted(self._starts, position, side="right")) - 1
        return k if k >= 0 and position < self._ends[k] else None

    def target_at(self, position: int) -> tuple[float, ...]:
        """Weights in force at ``position``."""
        k = self.change_holding(position)
        if k is not None:
            return self.segments[k].weights
        return self.declared_at(position)  # exact mode's few samples past the schedule's end: the last phase's

    def declared_at(self, position: int) -> tuple[float, ...]:
        """The weights the build declared at ``position``: the schedule's phase (a ramp's step) or
        the blend's, whatever changed them at run time."""
        if self.schedule is not None:
            return self.schedule.target_weights(min(position, self.schedule.plan.num_samples - 1))
        return tuple(d.weight for d in self.source.datasets)

    def source_regions(self) -> list[tuple[int, int, int | None]]:
        """``(begin, end, k)``: the stretches the source serves, before the first change (``k``
        None) and, on a schedule, after segment ``k``'s phase end up to the next change (its
        sample numbers moved by that segment's :meth:`shift`)."""
        starts = self._starts.tolist()
        regions = [(0, starts[0] if starts else self.num_samples, None)]
        if self.schedule is not None:
            regions += [(int(self._ends[k]), starts[k + 1] if k + 1 < len(starts) else self.num_samples, k)
                        for k in range(len(starts))]
        return [(a, b, k) for a, b, k in regions if a < b]

    def shift(self, k: int) -> np.ndarray:
        """(num_datasets,) int64: what the source's sample numbers move by after segment ``k``."""
        return self._shifts[k]

    # -- counts ---------------------------------------------------------------------------------
    def reached(self, position: int) -> np.ndarray:
        """(num_datasets,) int64: samples of each dataset in positions ``[0, position)``: from the
        segment holding it (its offsets and its blend's closed-form prefix count), or from the
        source (closed form where it has one, its array in exact mode, else one pass), so a series
        of changes costs no pass over the stream each."""
        k = int(np.searchsorted(self._starts, position, side="right")) - 1
        if k < 0:
            return self._source_reached(position)
        if position <= self._ends[k]:  # inside segment k (or at its end)
            return self._segment_reached(k, position)
        return self._source_reached(position) + self._shifts[k]

    def _segment_reached(self, k: int, position: int) -> np.ndarray:
        blend, offsets = self.segment_blend(k)
        ids = np.arange(len(self.source.datasets), dtype=np.int64)
        return offsets + blend.samples_before(ids, np.full(ids.shape, position - self.segments[k].start))

    def _source_reached(self, position: int) -> np.ndarray:
        """(num_datasets,) int64: samples of each dataset the *source* serves in ``[0, position)``:
        closed form where the split's locator is its schedule (stateless), else one counting pass."""
        num_datasets = len(self.source.datasets)
        if self.schedule is not None and getattr(self.source, "locator", None) is self.schedule:
            return self.schedule.samples_reached(position)
        blend = getattr(self.source, "blend", None)  # a stateless single blend: its closed-form prefix count
        if isinstance(blend, Blend) and position <= len(blend):
            return _blend_prefix_counts(blend, position)
        dataset_index = getattr(self.source, "dataset_index", None)  # exact mode: count the array itself
        if isinstance(dataset_index, np.ndarray):
            counts = np.zeros(num_datasets, dtype=np.int64)
            for begin in range(0, position, _COUNT_CHUNK):
                counts += np.bincount(dataset_index[begin:min(position, begin + _COUNT_CHUNK)], minlength=num_datasets)
            return counts
        return count_samples(position, self.source.locate, num_datasets)

    # -- changes --------------------------------------------------------------------------------
    def changed(self, start: int, weights) -> WeightChanges:
        """These changes before ``start``, then ``weights`` from ``start`` on (a change at or after
        ``start`` is replaced), each dataset continuing from the sample it had reached."""
        w = np.asarray(weights, dtype=np.float64).reshape(-1)
        if w.shape[0] != len(self.source.datasets):
            raise ConfigError(f"{w.shape[0]} weights for a blend of {len(self.source.datasets)} datasets; "
                              "expected one weight per dataset, in the build's order")
        if not np.all(np.isfinite(w)) or (w < 0).any() or w.sum() <= 0:
            raise ConfigError(f"weights={w.tolist()}; expected finite non-negative numbers, not all zero")
        kept = tuple(s for s in self.segments if s.start < start)
        # every dataset continues after its samples before `start`, served or taken out
        segment = BlendSegment(start=start, weights=tuple((w / w.sum()).tolist()),
                               dataset_offsets=tuple(int(o) for o in self.reached(start)))
        return WeightChanges(self.source, (*kept, segment), reuse=self)

    def _plan_phase_segments(self, first: int = 0) -> None:
        """Segment ends, and the shifts and room of segments ``first`` on, on a mixture schedule
        (see the module's docstring; those before ``first`` were taken over, unchanged)."""
        total = self.source.num_samples  # exact mode: megatron-core sizes the last phase a little past its end
        boundaries = np.asarray(self.schedule.plan.boundaries, dtype=np.int64)
        boundaries[-1] = max(int(boundaries[-1]), total)
        starts = self._starts
        if starts[-1] >= total:
            raise ConfigError(f"a weight change at position {int(starts[-1])}; the split serves [0, {total}), so "
                              "expected a position before its end")
        self._phase_ends = boundaries[np.searchsorted(boundaries, starts, side="right")]
        self._ends = np.minimum(self._phase_ends, self._ends)
        room = np.array([d.num_samples for d in self.source.datasets], dtype=np.int64)
        names = [d.name for d in self.source.datasets]
        for k in range(first, len(self.segments)):
            segment = self.segments[k]
            end = int(self._ends[k])
            reached = self._segment_reached(k, end)  # by the segment's end (a later change may cut it short)
            # up to the next segment (or the run's end) the source serves, numbered on by the shift
            stop = int(starts[k + 1]) if k + 1 < len(self.segments) else total
            self._shifts[k] = reached - self._source_reached(end)
            needed = self._source_reached(stop) + self._shifts[k] if stop > end else reached
            over = np.flatnonzero(needed > room)
            if over.size:
                d = int(over[0])
                phase = int(np.searchsorted(boundaries, max(stop - 1, 0), side="right"))
                raise ConfigError(
                    f"dataset {d} ({names[d]!r}): the weight change at position {segment.start} (phase "
                    f"{int(np.searchsorted(boundaries, segment.start, side='right'))}) would have it serve "
                    f"{int(needed[d])} samples by the end of phase {phase}, more than the {int(room[d])} its index "
                    f"holds (the build sized it for the schedule's own counts and its headroom; "
                    f"{int(reached[d])} by the end of the changed phase): give it less weight, build with more "
                    "headroom, or put the new weights in the schedule's phases and build again")

    def _usable_length(self) -> int:
        """Positions served before some dataset would need a sample its index does not hold."""
        for k, segment in enumerate(self.segments):
            blend, _ = self.segment_blend(k)
            if segment.start + len(blend) < self._ends[k]:
                return segment.start + len(blend)
        return self.source.num_samples


def _blend_prefix_counts(blend: Blend, position: int) -> np.ndarray:
    """``(D,)`` samples of each dataset among a blend's first ``position`` positions, closed form: a
    seeded blend permutes within windows only, so its whole windows count as the unseeded order's
    (:meth:`Blend.samples_before`) and only the partial window is located."""
    ids = np.arange(blend.num_datasets, dtype=np.int64)
    whole = position if blend.seed is None else position - position % blend.window
    plain = blend if blend.seed is None else Blend(blend.weights, len(blend))
    counts = plain.samples_before(ids, np.full(ids.shape, whole, dtype=np.int64))
    if whole < position:
        located, _ = blend.lookup(np.arange(whole, position, dtype=np.int64))
        counts += np.bincount(located, minlength=blend.num_datasets)
    return counts


def segment_length(weights, room: np.ndarray, limit: int) -> int:
    """The most positions (at most ``limit``) a blend with ``weights`` can have without giving
    any dataset more samples than its ``room``."""
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    if (room < 0).any():
        raise ConfigError(f"a blend segment starts past the end of a dataset (room {room.tolist()})")
    length = int(limit)
    for d in np.flatnonzero(w > 0):
        length = min(length, int(np.floor(room[d] / w[d])) + 1)
    while length > 0 and (largest_remainder_counts(w, length) > room).any():
        length -= 1
    return max(length, 0)


__all__ = ["BlendSegment", "WeightChanges", "count_samples", "segment_length"]
