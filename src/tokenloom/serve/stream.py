"""The one global sample stream of a build, and blend weights changed at a resume.

Position ``p`` of the stream is the source's position ``p`` until the weights change. A change at
position ``S`` starts a *segment*: from ``S`` on, a :class:`tokenloom.index.blend.Blend` with the
new weights picks the dataset (read by lookup, never materialised: O(datasets) memory), and each
dataset continues from the sample it had reached at ``S`` (the number of its samples in positions
``[0, S)``). No sample of any dataset is repeated or skipped. Megatron-LM cannot do this: its
blend is one array fixed at build time.

A segment's blend has the most positions that fit both the source's remaining positions and
every dataset's remaining samples (``Blend`` counts are exact, so no prefix of the segment asks
a dataset for more than it has); the stream ends where the last segment's blend ends.

A segment lives in the serving state, so a run resumed later, on any layout, sees the same stream.

**Skips.** Positions can be taken out of the stream from some point on: the samples of a range of
future steps (after a loss spike, as PaLM did) or every sample holding a piece of a quarantined
document. The stream then serves the remaining positions in the same order: logical position
``L`` (what the sampler counts) is the ``L``-th position of the *underlying* stream (the source and
its segments) not taken out, so later steps get the samples that followed, and batches stay full.
The taken-out positions are kept as underlying positions (ranges for steps, single positions for
quarantined documents) in the serving state, so a resume on any layout skips the same samples. A
quarantine applies to positions not yet served when it is given, and to the segments of weight
changes that come after it.
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


class SampleStream:
    """Global positions -> (dataset, sample) -> tokens, over a source, its weight changes and the
    positions taken out of it (see the module's docstring)."""

    def __init__(self, source: SampleSource, segments: tuple[BlendSegment, ...] = (), *,
                 skips: tuple[tuple[int, int], ...] = (), quarantine: tuple[tuple[str, int], ...] = (),
                 quarantined: np.ndarray | None = None) -> None:
        self.source = source
        self.segments = tuple(segments)
        self._blends: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.underlying_samples = source.num_samples
        """Positions of the underlying stream (the source and its segments): fewer than the
        source's after a weight change when a dataset's index runs out."""
        if self.segments and getattr(source, "schedule", None) is not None:
            raise ConfigError(
                f"a weight change at position {self.segments[0].start} on a build with a mixture schedule "
                "(phases); a weight change there is not served in this release (it will replace the current "
                "phase's weights up to the phase's end): change the schedule's phases and build again")
        for k, segment in enumerate(self.segments):
            if len(segment.weights) != len(source.datasets):
                raise ConfigError(f"a blend segment has {len(segment.weights)} weights; the source has "
                                  f"{len(source.datasets)} datasets")
            if k and segment.start <= self.segments[k - 1].start:
                raise ConfigError("blend segments must start at increasing positions")
        if self.segments:
            self.underlying_samples = self._usable_length()
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
        taken = sum(b - a for a, b in self.skipped_between(0, int(underlying)))
        return int(underlying) - taken

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
    def _segment_blend(self, k: int) -> tuple[Blend, np.ndarray]:
        if k not in self._blends:
            segment = self.segments[k]
            offsets = np.asarray(segment.dataset_offsets, dtype=np.int64)
            room = np.array([d.num_samples for d in self.source.datasets], dtype=np.int64) - offsets
            length = segment_length(segment.weights, room, self.source.num_samples - segment.start)
            self._blends[k] = (Blend(np.asarray(segment.weights), length), offsets)
        return self._blends[k]

    def locate(self, positions) -> tuple[np.ndarray, np.ndarray]:
        """``(dataset_ids, sample_ids)`` int64 for the stream's (logical) global positions."""
        positions = np.asarray(positions, dtype=np.int64)
        if not self.segments and not self._gap_begins.shape[0]:
            return self.source.locate(positions)
        if positions.size and (positions.min() < 0 or positions.max() >= self.num_samples):
            raise ConfigError(f"positions span [{int(positions.min())}, {int(positions.max())}]; "
                              f"the stream serves [0, {self.num_samples})")
        return self._locate_underlying(self.underlying(positions))

    def _locate_underlying(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if not self.segments:
            return self.source.locate(positions)
        starts = np.array([s.start for s in self.segments], dtype=np.int64)
        which = np.searchsorted(starts, positions, side="right") - 1  # -1: before any change
        dataset_ids = np.empty(positions.shape, dtype=np.int64)
        sample_ids = np.empty(positions.shape, dtype=np.int64)
        base = which < 0
        if base.any():
            dataset_ids[base], sample_ids[base] = self.source.locate(positions[base])
        for k in np.unique(which[~base]):
            mask = which == k
            blend, offsets = self._segment_blend(int(k))
            ids, local_samples = blend.lookup(positions[mask] - self.segments[k].start)
            dataset_ids[mask], sample_ids[mask] = ids, local_samples + offsets[ids]
        return dataset_ids, sample_ids

    def read(self, positions) -> tuple[np.ndarray, np.ndarray]:
        """``(rows, dataset_ids)``: tokens ``(B, seq_length + extra)`` at global positions."""
        dataset_ids, sample_ids = self.locate(positions)
        return self.source.read_samples(dataset_ids, sample_ids), dataset_ids

    def samples_reached(self, position: int) -> np.ndarray:
        """(num_datasets,) int64: samples each dataset served in logical positions ``[0, position)``."""
        return self._count(position, self.locate)

    def _count(self, position: int, locate) -> np.ndarray:
        counts = np.zeros(len(self.source.datasets), dtype=np.int64)
        for begin in range(0, position, _COUNT_CHUNK):
            dataset_ids, _ = locate(np.arange(begin, min(position, begin + _COUNT_CHUNK)))
            counts += np.bincount(dataset_ids, minlength=counts.shape[0])
        return counts

    def target_weights(self, position: int) -> tuple[float, ...]:
        """Weights in force at logical ``position``."""
        underlying = int(self.underlying(np.array([position]))[0])
        for segment in reversed(self.segments):
            if underlying >= segment.start:
                return segment.weights
        schedule = getattr(self.source, "schedule", None)
        if schedule is not None:  # the phase's weights, not the whole run's shares
            return schedule.target_weights(underlying)
        return tuple(d.weight for d in self.source.datasets)

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
        bounds = [s.start for s in self.segments] + [self.underlying_samples]
        out = [np.zeros(0, dtype=np.int64)]
        for d, parts in by_dataset.items():
            sample_ids = np.unique(np.concatenate(parts))
            base = positions_of(self.source, d, sample_ids)  # exact mode: one pass over the blend
            out.append(base[base < bounds[0]])
            for k, segment in enumerate(self.segments):
                blend, offsets = self._segment_blend(k)
                local = sample_ids - offsets[d]
                local = local[(local >= 0) & (local < int(blend.counts[d]))]
                positions = segment.start + blend.positions_of(np.full(local.shape[0], d, dtype=np.int64), local)
                out.append(positions[positions < bounds[k + 1]])
        found = np.concatenate(out)
        return found[found >= start]

    def _with(self, **changes) -> SampleStream:
        fields = {"segments": self.segments, "skips": self.skips, "quarantine": self.quarantine,
                  "quarantined": self.quarantined}
        fields.update(changes)
        return SampleStream(self.source, fields.pop("segments"), **fields)

    # -- weight changes -------------------------------------------------------------------------
    def reweighted(self, position: int, weights) -> SampleStream:
        """A stream equal to this one before ``position`` that blends with ``weights`` from there,
        each dataset continuing from the sample it had reached."""
        w = np.asarray(weights, dtype=np.float64).reshape(-1)
        if w.shape[0] != len(self.source.datasets):
            raise ConfigError(f"{w.shape[0]} weights for a blend of {len(self.source.datasets)} datasets; "
                              "expected one weight per dataset, in the build's order")
        if not np.all(np.isfinite(w)) or (w < 0).any() or w.sum() <= 0:
            raise ConfigError(f"weights={w.tolist()}; expected finite non-negative numbers, not all zero")
        if not 0 <= position <= self.num_samples:
            raise ConfigError(f"position={position}; expected one in [0, {self.num_samples}]")
        start = int(self.underlying(np.array([position]))[0])
        kept = tuple(s for s in self.segments if s.start < start)
        # every dataset continues after its samples before `start`, served or taken out
        offsets = self._count(start, self._locate_underlying)
        segment = BlendSegment(start=start, weights=tuple((w / w.sum()).tolist()),
                               dataset_offsets=tuple(int(o) for o in offsets))
        stream = SampleStream(self.source, (*kept, segment), skips=self.skips, quarantine=self.quarantine,
                              quarantined=self.quarantined[self.quarantined < start])
        if not self.quarantine:
            return stream
        return stream._with(quarantined=np.concatenate([stream.quarantined, stream._holding(self.quarantine, start)]))

    def _usable_length(self) -> int:
        """Positions served before some dataset would need a sample its index does not hold."""
        for k, segment in enumerate(self.segments):
            end = self.segments[k + 1].start if k + 1 < len(self.segments) else self.source.num_samples
            blend, _ = self._segment_blend(k)
            if segment.start + len(blend) < end:
                return segment.start + len(blend)
        return self.source.num_samples


def _merge(ranges) -> tuple[tuple[int, int], ...]:
    """Sorted, disjoint, non-adjacent ``[begin, end)`` ranges covering the same positions."""
    out: list[list[int]] = []
    for a, b in sorted((int(a), int(b)) for a, b in ranges if int(b) > int(a)):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return tuple((a, b) for a, b in out)


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


__all__ = ["BlendSegment", "SampleStream"]
