"""Blend weights changed at run time: the *underlying* stream of a build, its source and the
segments that changed its weights.

Position ``p`` is the source's position ``p`` until the weights change. A change at position ``S``
starts a *segment*: from ``S`` on, a :class:`tokenloom.index.blend.Blend` with the new weights
picks the dataset (read by lookup, never materialised: O(datasets) memory), and each dataset
continues from the sample it had reached at ``S`` (the number of its samples in positions
``[0, S)``). No sample of any dataset is repeated or skipped. Megatron-LM cannot do this: its
blend is one array fixed at build time.

On a single blend a segment runs to the next change or the end: its blend has the most positions
that fit both the source's remaining positions and every dataset's remaining samples (``Blend``
counts are exact, so no prefix of the segment asks a dataset for more than it has), and the stream
ends where the last segment's blend ends.

**On a mixture schedule** (a build with ``phases``) a change replaces the weights of the phase
holding it, from its position to the phase's end (a ramp's remainder becomes constant); later
phases keep their declared weights (a ramp after it still starts from the declared weights of the
phase before it). The segment's blend is sized to the phase's end, and every dataset continues in
the later phases from the count it really reached: positions the source serves after a segment
get their sample numbers moved by the segment's *shift*, the samples it really served minus those
the build planned for that stretch. The build sized every dataset's index for the schedule's own
counts (plus its ``headroom``), so a change that would take samples a later phase needs is
refused, naming the dataset, the phase and the numbers, rather than ending the run before its
last phase.

Segments live in the serving state, so a run resumed later, on any layout, sees the same stream.
Skips and quarantines sit on top of this stream (:mod:`tokenloom.serve.stream`).
"""

from __future__ import annotations

import base64
import binascii
import zlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from tokenloom.errors import ConfigError
from tokenloom.index.blend import Blend, largest_remainder_counts
from tokenloom.source import SampleSource

_COUNT_CHUNK = 1 << 22
_LOOKUP_COUNT = 1 << 16
"""Up to this many positions a prefix of a segment's blend is counted by looking its positions up
(a segment cut short by the next change holds the few steps between two decisions); longer
prefixes walk each dataset's path (:meth:`Blend.samples_before`), whose one-off set-up costs as
much as looking up about this many positions."""

_BLENDS_KEPT = 64
"""Blends of segments kept built (each holds its tree, O(datasets)); a series of changes reads
only the last few, so thousands of changes do not hold thousands of trees."""

PACKING = "le-shuffled-zlib-base64"
"""How :meth:`BlendSegment.to_dict` writes its arrays: little-endian float64 weights and int64
offsets, byte ``k`` of every value together (the high bytes of like numbers then compress),
deflated (zlib) and in base64: exact, JSON-safe, a third of the decimal lists' size."""


def pack_array(values, dtype: str) -> str:
    """``values`` as :data:`PACKING` text (``dtype``: ``"<f8"`` or ``"<i8"``)."""
    raw = np.ascontiguousarray(values, dtype=np.dtype(dtype))  # (n,)
    columns = raw.view(np.uint8).reshape(-1, raw.itemsize).T  # (itemsize, n): byte k of every value
    return base64.b64encode(zlib.compress(columns.tobytes(), 6)).decode("ascii")


def unpack_array(text: str, dtype: str) -> np.ndarray:
    """Inverse of :func:`pack_array`: ``(n,)`` of ``dtype``; ConfigError on text it did not write."""
    itemsize = np.dtype(dtype).itemsize
    try:
        raw = zlib.decompress(base64.b64decode(text, validate=True))
    except (TypeError, ValueError, binascii.Error, zlib.error) as exc:
        raise ConfigError(f"a packed array {str(text)[:40]!r}...: {exc}; expected {PACKING} text") from None
    if len(raw) % itemsize:
        raise ConfigError(f"a packed array of {len(raw)} bytes; expected whole {dtype} values")
    columns = np.frombuffer(raw, dtype=np.uint8).reshape(itemsize, -1)  # (itemsize, n)
    return np.ascontiguousarray(columns.T).view(np.dtype(dtype)).reshape(-1)


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
        """JSON-ready form (stored in the serving state), its arrays packed (:data:`PACKING`)."""
        return {"start": self.start, "packed": PACKING, "weights": pack_array(self.weights, "<f8"),
                "dataset_offsets": pack_array(self.dataset_offsets, "<i8")}

    @classmethod
    def from_dict(cls, data: dict) -> BlendSegment:
        """Inverse of :meth:`to_dict`; also reads the plain lists of serving-state schema 2."""
        try:
            packing = data.get("packed")
            if packing is None:  # schema 2: decimal lists
                weights = tuple(float(w) for w in data["weights"])
                offsets = tuple(int(o) for o in data["dataset_offsets"])
            elif packing == PACKING:
                weights = tuple(unpack_array(data["weights"], "<f8").tolist())
                offsets = tuple(unpack_array(data["dataset_offsets"], "<i8").tolist())
            else:
                raise ConfigError(f"a blend segment packed as {packing!r}; this tokenloom reads {PACKING!r} "
                                  "(serving-state schema 3) or plain lists (schema 2)")
            return cls(start=int(data["start"]), weights=weights, dataset_offsets=offsets)
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"serving state: malformed blend segment ({exc!r}); expected {{start, packed, "
                              "weights, dataset_offsets}") from None


def count_samples(position: int, locate, num_datasets: int) -> np.ndarray:
    """(num_datasets,) int64: samples of each dataset ``locate`` gives in positions ``[0, position)``,
    one chunk of positions at a time."""
    counts = np.zeros(num_datasets, dtype=np.int64)
    for begin in range(0, position, _COUNT_CHUNK):
        dataset_ids, _ = locate(np.arange(begin, min(position, begin + _COUNT_CHUNK)))
        counts += np.bincount(dataset_ids, minlength=num_datasets)
    return counts


class _Segment:
    """What segment ``k`` of a stream derives from the segment alone: its offsets as an array, its
    blend's length and counts, the blend once read. Kept while index ``k`` holds the same segment
    object, so every later change (each a new :class:`WeightChanges`) takes it over."""

    __slots__ = ("blend", "counts", "length", "offsets", "segment")

    def __init__(self, segment: BlendSegment, length: int) -> None:
        self.segment = segment
        self.offsets = np.asarray(segment.dataset_offsets, dtype=np.int64)  # (D,)
        self.length = int(length)
        self.counts: np.ndarray | None = None
        self.blend: Blend | None = None


class _Shared:
    """The work every :class:`WeightChanges` of one source shares with the changes made from it:
    per segment index a :class:`_Segment`, and the source's counts at phase ends."""

    def __init__(self, source: SampleSource, schedule) -> None:
        self.segments: dict[int, _Segment] = {}
        self.built: OrderedDict[int, _Segment] = OrderedDict()
        """The segments whose blend is built, the most recently read last: at most
        :data:`_BLENDS_KEPT` (serving reads the last few; an older one is built again if read)."""
        self.source_counts: dict[int, np.ndarray] = {}
        self.room = np.array([d.num_samples for d in source.datasets], dtype=np.int64)  # (D,)
        self.boundaries = None
        if schedule is not None:  # exact mode: megatron-core sizes the last phase a little past its end
            self.boundaries = np.asarray(schedule.plan.boundaries, dtype=np.int64).copy()
            self.boundaries[-1] = max(int(self.boundaries[-1]), source.num_samples)


# long: one rule (a change replaces its phase's weights and every store reads on from its real
# count), whose lookups, counts at a change, room checks and resume checks all read the same
# per-segment state shared along a series of changes; split apart they would pass it around.
class WeightChanges:
    """The underlying stream: a source and the segments that changed its weights (see the
    module's docstring). Positions here are *underlying* ones.

    A change costs O(datasets) whatever came before (and a copy of the segments' start positions):
    :meth:`changed` takes over the work of the segments it keeps, counts the prefix of the segment
    it cuts short, and checks the new segment's room from its blend's counts (no walk of its
    tree). Built from stored segments (a resume), the cost is linear in the changes: a segment cut
    short by the next change continues into it, so its counts at the cut are the next segment's
    offsets, checked against its blend when that is first read (:meth:`segment_blend`); no blend
    is built before it is read.
    """

    def __init__(self, source: SampleSource, segments: tuple[BlendSegment, ...] = (), *,
                 reuse: WeightChanges | None = None, shared: int | None = None) -> None:
        """``reuse``: changes of the same source whose leading segments these share (the same
        objects): their blends, shifts and room checks are taken over, not redone. ``shared``:
        how many lead (known to the caller, so not compared)."""
        self.source = source
        self.segments = tuple(segments)
        self.schedule = getattr(source, "schedule", None)
        """The source's mixture schedule (a ``ScheduleLocator``), or None: one blend throughout."""
        self.num_samples = source.num_samples
        """Positions of the underlying stream: fewer than the source's after a weight change on a
        single blend when a dataset's index runs out."""
        if reuse is None or reuse.source is not source:
            reuse, shared = None, 0
        elif shared is None:
            shared = 0
            while shared < min(len(reuse.segments), len(self.segments)) and \
                    reuse.segments[shared] is self.segments[shared]:
                shared += 1
        self._work = reuse._work if reuse is not None else _Shared(source, self.schedule)
        num_datasets = len(source.datasets)
        for segment in self.segments[shared:]:
            if len(segment.weights) != num_datasets or len(segment.dataset_offsets) != num_datasets:
                raise ConfigError(f"a blend segment has {len(segment.weights)} weights and "
                                  f"{len(segment.dataset_offsets)} dataset offsets; the source has {num_datasets} "
                                  "datasets")
        total = source.num_samples
        new_starts = np.array([s.start for s in self.segments[shared:]], dtype=np.int64)
        self._starts = new_starts if reuse is None else np.concatenate([reuse._starts[:shared], new_starts])  # (n,)
        if (np.diff(self._starts[max(shared - 1, 0):]) <= 0).any():
            raise ConfigError("blend segments must start at increasing positions")
        following = np.append(self._starts[1:], total)  # where each segment stops serving without a phase end
        self._gap_shifts: dict[int, np.ndarray] = {}
        """Segment ``k`` -> what the source's sample numbers move by after its phase end, for the
        segments the source follows before the next change (schedules only)."""
        self._ended_in: int | None = None
        """Single blend: the segment whose blend runs out before its end (the stream ends there)."""
        first = 0 if reuse is None else max(shared - 1, 0)  # the first segment whose end may have moved
        if self.schedule is None:
            self._phase_ends = self._ends = following
            self._check_offsets(shared)
            if reuse is not None and reuse._ended_in is not None and reuse._ended_in < first:
                self._ended_in, self.num_samples = reuse._ended_in, reuse.num_samples
            else:
                self._find_end(first)
            return
        if self.segments and self._starts[-1] >= total:
            raise ConfigError(f"a weight change at position {int(self._starts[-1])}; the split serves [0, {total}), so "
                              "expected a position before its end")
        boundaries = self._work.boundaries
        new_ends = boundaries[np.searchsorted(boundaries, new_starts, side="right")]
        self._phase_ends = new_ends if reuse is None else np.concatenate([reuse._phase_ends[:shared], new_ends])
        self._ends = np.minimum(self._phase_ends, following)
        self._check_offsets(shared)
        if reuse is not None:  # the segments before `first` end where they ended
            self._gap_shifts = {k: shift for k, shift in reuse._gap_shifts.items() if k < first}
        self._plan_phase_segments(first)

    def _check_offsets(self, first: int) -> None:
        """Segments ``first`` on continue from the one before: offsets that count one sample per
        position before the start, none fewer than the segment before's (a state of another
        stream fails here)."""
        previous = self._segment(first - 1).offsets if first else None
        for k in range(first, len(self.segments)):
            entry = self._segment(k)
            offsets, start = entry.offsets, entry.segment.start
            if int(offsets.sum()) != start or (offsets < (0 if previous is None else previous)).any():
                raise ConfigError(f"the blend segment at position {start} continues the datasets from samples "
                                  f"summing to {int(offsets.sum())}, or from fewer than the segment before; expected "
                                  "one sample per position before it, and no count lower than the last one's: "
                                  "the segments do not belong to this stream")
            previous = offsets

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
            for k in np.unique(which[after]):
                mask = after & (which == k)
                sample_ids[mask] += self.shift(int(k))[dataset_ids[mask]]
        for k in np.unique(which[~base]):
            mask = (which == k) & ~base
            blend, offsets = self.segment_blend(int(k))
            ids, local_samples = blend.lookup(positions[mask] - self.segments[k].start)
            dataset_ids[mask], sample_ids[mask] = ids, local_samples + offsets[ids]
        return dataset_ids, sample_ids

    def _segment(self, k: int) -> _Segment:
        """Segment ``k``'s derived numbers (made once per segment object, shared by later changes)."""
        entry = self._work.segments.get(k)
        segment = self.segments[k]
        if entry is None or entry.segment is not segment:
            if self.schedule is not None:  # to the phase's end, even where a later change cuts it first
                length = int(self._phase_ends[k]) - segment.start
            else:
                offsets = np.asarray(segment.dataset_offsets, dtype=np.int64)
                length = segment_length(segment.weights, self._work.room - offsets,
                                        self.source.num_samples - segment.start)
            entry = self._work.segments[k] = _Segment(segment, length)
        return entry

    def _counts(self, entry: _Segment) -> np.ndarray:
        """(D,) int64: the samples of each dataset in segment ``entry``'s whole blend
        (:attr:`Blend.counts`, without building its tree)."""
        if entry.counts is None:
            if entry.blend is not None:
                entry.counts = entry.blend.counts
            else:  # as Blend does: normalised, then largest remainder
                w = np.asarray(entry.segment.weights, dtype=np.float64)
                entry.counts = largest_remainder_counts(w / w.sum(), entry.length)
        return entry.counts

    def segment_blend(self, k: int) -> tuple[Blend, np.ndarray]:
        """Segment ``k``'s blend and each dataset's sample offset in it. Built on first read; where
        the next segment starts inside it, its offsets are checked there against the blend."""
        entry = self._segment(k)
        if entry.blend is None:
            blend = Blend(np.asarray(entry.segment.weights), entry.length)
            if k + 1 < len(self.segments) and self.segments[k + 1].start <= int(self._ends[k]):
                cut = self.segments[k + 1].start - entry.segment.start
                reached = entry.offsets + _prefix_counts(blend, cut)
                if not np.array_equal(reached, self._segment(k + 1).offsets):
                    d = int(np.flatnonzero(reached != self._segment(k + 1).offsets)[0])
                    raise ConfigError(
                        f"the blend segment at position {self.segments[k + 1].start} continues dataset {d} from "
                        f"sample {int(self._segment(k + 1).offsets[d])}, but the segment before it reaches sample "
                        f"{int(reached[d])} there; the segments do not belong to this stream")
            entry.blend = blend
        built = self._work.built
        built[k] = entry
        built.move_to_end(k)
        while len(built) > _BLENDS_KEPT:
            _, oldest = built.popitem(last=False)
            oldest.blend = None
        return entry.blend, entry.offsets

    def segment_end(self, k: int) -> int:
        """Where segment ``k`` stops serving: the next change, or on a schedule the end of its
        phase if that comes first; else the end of the source."""
        return int(self._ends[k])

    def segments_ending_after(self, position: int) -> range:
        """Indices of the segments that serve some position at or after ``position``."""
        return range(int(np.searchsorted(self._ends, position, side="right")), len(self.segments))

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
        starts = self._starts
        regions = [(0, int(starts[0]) if starts.shape[0] else self.num_samples, None)]
        regions += [(int(self._ends[k]), int(starts[k + 1]) if k + 1 < len(starts) else self.num_samples, k)
                    for k in sorted(self._gap_shifts)]
        return [(a, b, k) for a, b, k in regions if a < b]

    def shift(self, k: int) -> np.ndarray:
        """(num_datasets,) int64: what the source's sample numbers move by after segment ``k``."""
        if k in self._gap_shifts:
            return self._gap_shifts[k]
        end = int(self._ends[k])
        return self._segment_reached(k, end) - self._source_reached(end)

    # -- counts ---------------------------------------------------------------------------------
    def reached(self, position: int) -> np.ndarray:
        """(num_datasets,) int64: samples of each dataset in positions ``[0, position)``: from the
        segment holding it (its offsets and a count of its blend's prefix), or from the source
        (closed form where it has one, its array in exact mode, else one pass), so a series of
        changes costs no pass over the stream each."""
        k = int(np.searchsorted(self._starts, position, side="right")) - 1
        if k < 0:
            return self._source_reached(position)
        if position <= self._ends[k]:  # inside segment k (or at its end)
            return self._segment_reached(k, position)
        return self._source_reached(position) + self.shift(k)

    def _segment_reached(self, k: int, position: int) -> np.ndarray:
        entry = self._segment(k)
        length = position - entry.segment.start
        if length == entry.length:
            return entry.offsets + self._counts(entry)
        blend, offsets = self.segment_blend(k)
        return offsets + _prefix_counts(blend, length)

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

    def _source_reached_at_boundary(self, position: int) -> np.ndarray:
        """:meth:`_source_reached` at a phase end or the source's end, kept (every change asks)."""
        counts = self._work.source_counts.get(position)
        if counts is None:
            counts = self._work.source_counts[position] = self._source_reached(position)
        return counts

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
        kept = int(np.searchsorted(self._starts, start, side="left"))  # the segments starting before `start`
        # every dataset continues after its samples before `start`, served or taken out
        segment = BlendSegment(start=start, weights=tuple((w / w.sum()).tolist()),
                               dataset_offsets=tuple(self.reached(start).tolist()))
        return WeightChanges(self.source, (*self.segments[:kept], segment), reuse=self, shared=kept)

    def _plan_phase_segments(self, first: int = 0) -> None:
        """Segment ends, and the shifts and room of segments ``first`` on, on a mixture schedule
        (see the module's docstring; those before ``first`` were taken over, unchanged)."""
        total = self.source.num_samples
        boundaries = self._work.boundaries
        starts, room = self._starts, self._work.room
        names = None
        for k in range(first, len(self.segments)):
            entry = self._segment(k)
            end = int(self._ends[k])
            stop = int(starts[k + 1]) if k + 1 < len(self.segments) else total
            # what the segment served by its end (a later change may cut it short)
            if end == int(self._phase_ends[k]):  # the whole blend
                reached = entry.offsets + self._counts(entry)
            elif end == stop and k + 1 < len(self.segments):  # the next one continues from there (checked
                reached = self._segment(k + 1).offsets      # against this blend when it is read)
            else:
                reached = self._segment_reached(k, end)
            if stop > end:  # up to the next segment (or the run's end) the source serves, numbered on by the shift
                self._gap_shifts[k] = reached - self._source_reached_at_boundary(end)
                following = self._source_reached_at_boundary(stop) if stop == total else self._source_reached(stop)
                needed = following + self._gap_shifts[k]
            else:
                needed = reached
            over = np.flatnonzero(needed > room)
            if over.size:
                d = int(over[0])
                names = [ds.name for ds in self.source.datasets]
                phase = int(np.searchsorted(boundaries, max(stop - 1, 0), side="right"))
                raise ConfigError(
                    f"dataset {d} ({names[d]!r}): the weight change at position {entry.segment.start} (phase "
                    f"{int(np.searchsorted(boundaries, entry.segment.start, side='right'))}) would have it serve "
                    f"{int(needed[d])} samples by the end of phase {phase}, more than the {int(room[d])} its index "
                    f"holds (the build sized it for the schedule's own counts and its headroom; "
                    f"{int(reached[d])} by the end of the changed phase): give it less weight, build with more "
                    "headroom, or put the new weights in the schedule's phases and build again")

    def _find_end(self, first: int) -> None:
        """Single blend: the stream ends in the first segment from ``first`` on whose blend runs out
        before the next change (a dataset's index would be asked for a sample it lacks)."""
        for k in range(first, len(self.segments)):
            entry = self._segment(k)
            if entry.segment.start + entry.length < self._ends[k]:
                self._ended_in, self.num_samples = k, entry.segment.start + entry.length
                return


def _prefix_counts(blend: Blend, length: int) -> np.ndarray:
    """``(D,)`` samples of each dataset among the unseeded ``blend``'s first ``length`` positions:
    the positions looked up when there are few of them, else the closed form."""
    if length == len(blend):
        return blend.counts.copy()
    if length <= _LOOKUP_COUNT:
        dataset_ids, _ = blend.lookup(np.arange(length, dtype=np.int64))
        return np.bincount(dataset_ids, minlength=blend.num_datasets).astype(np.int64)
    ids = np.arange(blend.num_datasets, dtype=np.int64)
    return blend.samples_before(ids, np.full(ids.shape, length, dtype=np.int64))


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


__all__ = ["PACKING", "BlendSegment", "WeightChanges", "count_samples", "pack_array", "segment_length",
           "unpack_array"]
