"""The one global sample stream of a build: its weight changes, and positions taken out of it.

The *underlying* stream is the build's source with the blend weights changed at run time
(:mod:`tokenloom.serve.weight_changes`: segments, and on a mixture schedule their phases).

**Skips.** Positions can be taken out of the stream from some point on: the samples of a range of
future steps (after a loss spike, as PaLM did) or every sample holding a piece of a quarantined
document. The stream then serves the remaining positions in the same order: logical position
``L`` (what the sampler counts) is the ``L``-th position of the underlying stream not taken out,
so later steps get the samples that followed, and batches stay full. The taken-out positions are
kept as underlying positions (ranges for steps, single positions for quarantined documents) in
the serving state, so a resume on any layout skips the same samples. A quarantine applies to
positions not yet served when it is given, and to the segments of weight changes that come after
it.
"""

from __future__ import annotations

import numpy as np

from tokenloom.errors import ConfigError
from tokenloom.serve.weight_changes import BlendSegment, WeightChanges, count_samples
from tokenloom.source import SampleSource


class SampleStream:
    """Global positions -> (dataset, sample) -> tokens, over a source, its weight changes and the
    positions taken out of it (see the module's docstring)."""

    def __init__(self, source: SampleSource, segments: tuple[BlendSegment, ...] = (), *,
                 skips: tuple[tuple[int, int], ...] = (), quarantine: tuple[tuple[str, int], ...] = (),
                 quarantined: np.ndarray | None = None, changes: WeightChanges | None = None) -> None:
        """``changes``: the underlying stream already made for ``segments`` (or sharing their
        leading segments), whose work is then taken over."""
        self.source = source
        segments = tuple(segments)
        if changes is None or (changes.segments is not segments and (
                len(changes.segments) != len(segments) or any(a is not b for a, b in zip(changes.segments, segments)))):
            changes = WeightChanges(source, segments, reuse=changes)
        self.changes = changes
        """The underlying stream: the source and its weight changes."""
        self.underlying_samples = self.changes.num_samples
        """Positions of the underlying stream (the source and its segments): fewer than the
        source's after a weight change on a single blend when a dataset's index runs out."""
        self.skips = _merge(skips)
        """Underlying position ranges ``[begin, end)`` taken out for skipped steps."""
        self.quarantine = tuple((str(p), int(d)) for p, d in quarantine)
        """Quarantined ``(store prefix, document)`` pairs, in the order given."""
        self.quarantined = (np.zeros(0, dtype=np.int64) if quarantined is None
                            else np.unique(np.asarray(quarantined, dtype=np.int64)))
        """Underlying positions taken out because their sample holds a quarantined document."""
        gaps = _merge([*self.skips, *((int(p), int(p) + 1) for p in self.quarantined)])
        gaps = [(a, min(b, self.underlying_samples)) for a, b in gaps if a < self.underlying_samples]
        self._gap_begins = np.array([a for a, _ in gaps], dtype=np.int64)
        lengths = np.array([b - a for a, b in gaps], dtype=np.int64)
        self._gap_before = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)  # (G + 1,)
        self._gap_logical = self._gap_begins - self._gap_before[:-1]  # logical position each gap follows
        self.num_samples = self.underlying_samples - int(self._gap_before[-1])
        """Positions the stream serves (the underlying ones not taken out)."""

    # -- logical and underlying positions -------------------------------------------------------
    def underlying(self, positions) -> np.ndarray:
        """Underlying positions of logical ``positions`` (int64, same shape): the ``L``-th
        position not taken out. ``L == num_samples`` maps past the last served position."""
        positions = np.asarray(positions, dtype=np.int64)
        if not self._gap_begins.shape[0]:
            return positions.copy()
        passed = np.searchsorted(self._gap_logical, positions, side="right")
        return positions + self._gap_before[passed]

    def logical(self, underlying: int) -> int:
        """The logical position of underlying position ``underlying`` (of the first served
        position at or after it, when it is taken out)."""
        return int(self._logical_of(int(underlying)))

    def skipped_between(self, begin: int, end: int) -> list[tuple[int, int]]:
        """The taken-out underlying ranges inside ``[begin, end)`` (merged, clipped)."""
        ends = self._gap_begins + np.diff(self._gap_before)
        first = int(np.searchsorted(ends, begin, side="right"))  # gaps ending after `begin`
        last = int(np.searchsorted(self._gap_begins, end, side="left"))  # gaps starting before `end`
        out = []
        for a, b in zip(self._gap_begins[first:last].tolist(), ends[first:last].tolist()):
            lo, hi = max(a, begin), min(b, end)
            if lo < hi:
                out.append((lo, hi))
        return out

    # -- lookups --------------------------------------------------------------------------------
    @property
    def segments(self) -> tuple[BlendSegment, ...]:
        """The weight changes, in the order of their positions."""
        return self.changes.segments

    @property
    def schedule(self):
        """The source's mixture schedule (a ``ScheduleLocator``), or None."""
        return self.changes.schedule

    def locate(self, positions) -> tuple[np.ndarray, np.ndarray]:
        """``(dataset_ids, sample_ids)`` int64 for the stream's (logical) global positions."""
        positions = np.asarray(positions, dtype=np.int64)
        if not self.segments and not self._gap_begins.shape[0]:
            return self.source.locate(positions)
        if positions.size and (positions.min() < 0 or positions.max() >= self.num_samples):
            raise ConfigError(f"positions span [{int(positions.min())}, {int(positions.max())}]; "
                              f"the stream serves [0, {self.num_samples})")
        return self.changes.locate(self.underlying(positions))

    def read(self, positions) -> tuple[np.ndarray, np.ndarray]:
        """``(rows, dataset_ids)``: tokens ``(B, seq_length + extra)`` at global positions."""
        dataset_ids, sample_ids = self.locate(positions)
        return self.source.read_samples(dataset_ids, sample_ids), dataset_ids

    def samples_reached(self, position: int) -> np.ndarray:
        """(num_datasets,) int64: samples each dataset served in logical positions ``[0, position)``:
        the underlying stream's count (closed form on a stateless schedule) less the positions
        taken out before there."""
        if self.schedule is None:
            return count_samples(position, self.locate, len(self.source.datasets))
        end = int(self.underlying(np.array([position]))[0]) if position < self.num_samples else self.underlying_samples
        counts = self.changes.reached(end)
        for a, b in self.skipped_between(0, end):  # taken out: as long as the skips, not the run
            for begin in range(a, b, 1 << 20):
                dataset_ids, _ = self.changes.locate(np.arange(begin, min(b, begin + (1 << 20)), dtype=np.int64))
                counts -= np.bincount(dataset_ids, minlength=counts.shape[0])
        return counts

    def target_weights(self, position: int) -> tuple[float, ...]:
        """Weights in force at logical ``position``."""
        return self.changes.target_at(int(self.underlying(np.array([position]))[0]))

    def served_between(self, begin, end):
        """Logical positions (served, not taken out) among underlying ``[begin, end)``; arrays or ints."""
        return self._logical_of(end) - self._logical_of(begin)

    def _logical_of(self, underlying):
        """:meth:`logical` of an array of underlying positions (each less the gaps before it)."""
        u = np.asarray(underlying, dtype=np.int64)
        if not self._gap_begins.shape[0]:
            return u
        lengths = np.diff(self._gap_before)
        k = np.searchsorted(self._gap_begins, u, side="right") - 1  # the last gap beginning at or before u
        inside = np.where(k >= 0, np.minimum(u - self._gap_begins[np.maximum(k, 0)], lengths[np.maximum(k, 0)]), 0)
        return u - (np.where(k >= 0, self._gap_before[np.maximum(k, 0)], 0) + inside)

    def phase_of(self, position: int) -> int | None:
        """The 0-based phase of the schedule holding logical ``position``, or None without one."""
        if self.schedule is None:
            return None
        underlying = min(int(self.underlying(np.array([position]))[0]), self.schedule.plan.num_samples - 1)
        return int(self.schedule.plan.phase_of(underlying))

    # -- skips ----------------------------------------------------------------------------------
    def skipped(self, begin: int, end: int) -> SampleStream:
        """This stream without logical positions ``[begin, end)`` (``begin`` at or after the
        positions already served, which the caller knows): what follows moves up."""
        if not 0 <= begin <= end <= self.num_samples:
            raise ConfigError(f"skip [{begin}, {end}); expected a range inside the stream's [0, {self.num_samples})")
        if begin == end:
            return self
        # the range, in underlying positions, minus what is already out
        low, high = (int(u) for u in self.underlying(np.array([begin, end - 1])))
        ranges, cursor = [], low
        for a, b in self.skipped_between(low, high + 1):
            if a > cursor:
                ranges.append((cursor, a))
            cursor = b
        if cursor <= high:
            ranges.append((cursor, high + 1))
        return self._with(skips=(*self.skips, *ranges))

    def quarantined_from(self, position: int, items: list[tuple[str, int]]) -> SampleStream:
        """This stream without the positions at or after logical ``position`` whose sample holds
        a piece of one of the ``(store prefix, document)`` ``items`` (in every segment)."""
        start = int(self.underlying(np.array([position]))[0])
        new = tuple(item for item in items if item not in self.quarantine)
        return self._with(quarantine=(*self.quarantine, *new),
                          quarantined=np.concatenate([self.quarantined, self._holding(items, start)]))

    def where(self, positions) -> list:
        """The origin of the sample at each logical position, as this stream serves it (after its
        weight changes, skips and quarantines): :func:`tokenloom.source.provenance.where` through
        the stream's ``locate``."""
        from tokenloom.source.provenance import where

        return where(_Served(self), positions)

    def positions_holding(self, prefix: str, document: int) -> np.ndarray:
        """Ascending logical positions of this stream whose sample holds tokens of store
        ``prefix``'s document ``document``: ``find`` after the run's weight changes, skips and
        quarantines (a position taken out holds nothing here)."""
        found = np.unique(self._holding([(prefix, int(document))], 0))  # underlying positions
        found = found[found < self.underlying_samples]
        logical = self._logical_of(found)
        kept = self.underlying(logical) == found  # a taken-out position maps onto the next served one
        return logical[kept & (logical < self.num_samples)]

    def _holding(self, items, start: int) -> np.ndarray:
        """Underlying positions at or after ``start`` whose sample holds tokens of one of the
        ``(prefix, document)`` ``items``: their samples first, then one lookup per dataset."""
        from tokenloom.source import BlendedSource
        from tokenloom.source.provenance import positions_of, samples_holding

        if not isinstance(self.source, BlendedSource):
            raise ConfigError(f"quarantining a document needs the split of a build (a BlendedSource), not "
                              f"{type(self.source).__name__}")
        by_dataset: dict[int, list[np.ndarray]] = {}
        for prefix, document in items:
            for d, sample_ids in samples_holding(self.source, prefix, document).items():
                by_dataset.setdefault(d, []).append(sample_ids)
        out = [np.zeros(0, dtype=np.int64)]
        for d, parts in by_dataset.items():
            sample_ids = np.unique(np.concatenate(parts))
            for begin, end, k in self.changes.source_regions():
                if end <= start:
                    continue
                shifted = sample_ids if k is None else sample_ids - self.changes.shift(k)[d]
                base = positions_of(self.source, d, shifted[shifted >= 0])  # exact mode: one pass over the blend
                out.append(base[(base >= begin) & (base < end)])
            for k in self.changes.segments_ending_after(start):  # those before `start` hold nothing to take out
                segment = self.segments[k]
                blend, offsets = self.changes.segment_blend(k)
                local = sample_ids - offsets[d]
                local = local[(local >= 0) & (local < int(blend.counts[d]))]
                positions = segment.start + blend.positions_of(np.full(local.shape[0], d, dtype=np.int64), local)
                out.append(positions[positions < self.changes.segment_end(k)])
        found = np.concatenate(out)
        return found[found >= start]

    def _with(self, **changes) -> SampleStream:
        fields = {"segments": self.segments, "skips": self.skips, "quarantine": self.quarantine,
                  "quarantined": self.quarantined}
        fields.update(changes)
        return SampleStream(self.source, fields.pop("segments"), changes=self.changes, **fields)

    # -- weight changes -------------------------------------------------------------------------
    def reweighted(self, position: int, weights) -> SampleStream:
        """A stream equal to this one before ``position`` that blends with ``weights`` from there,
        each dataset continuing from the sample it had reached (on a mixture schedule: to the end
        of the phase holding ``position``)."""
        if not 0 <= position <= self.num_samples:
            raise ConfigError(f"position={position}; expected one in [0, {self.num_samples}]")
        start = int(self.underlying(np.array([position]))[0])
        changes = self.changes.changed(start, weights)
        stream = SampleStream(self.source, changes.segments, skips=self.skips, quarantine=self.quarantine,
                              quarantined=self.quarantined[self.quarantined < start], changes=changes)
        if not self.quarantine:
            return stream
        return stream._with(quarantined=np.concatenate([stream.quarantined, stream._holding(self.quarantine, start)]))


class _Served:
    """A split read at a stream's logical positions: what provenance reads of a source."""

    def __init__(self, stream: SampleStream) -> None:
        self.stream = stream
        self.name, self.readers, self.locator = stream.source.name, stream.source.readers, stream.source.locator

    def locate(self, positions) -> tuple[np.ndarray, np.ndarray]:
        return self.stream.locate(np.asarray(positions, dtype=np.int64))


def _merge(ranges) -> tuple[tuple[int, int], ...]:
    """Sorted, disjoint, non-adjacent ``[begin, end)`` ranges covering the same positions."""
    out: list[list[int]] = []
    for a, b in sorted((int(a), int(b)) for a, b in ranges if int(b) > int(a)):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return tuple((a, b) for a, b in out)


__all__ = ["SampleStream"]
