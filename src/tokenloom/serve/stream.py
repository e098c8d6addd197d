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
    """Global positions -> (dataset, sample) -> tokens, over a source and its weight changes."""

    def __init__(self, source: SampleSource, segments: tuple[BlendSegment, ...] = ()) -> None:
        self.source = source
        self.segments = tuple(segments)
        self._blends: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.num_samples = source.num_samples
        """Positions the stream can serve (fewer than the source's after a weight change when a
        dataset's index runs out)."""
        for k, segment in enumerate(self.segments):
            if len(segment.weights) != len(source.datasets):
                raise ConfigError(f"a blend segment has {len(segment.weights)} weights; the source has "
                                  f"{len(source.datasets)} datasets")
            if k and segment.start <= self.segments[k - 1].start:
                raise ConfigError("blend segments must start at increasing positions")
        if self.segments:
            self.num_samples = self._usable_length()

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
        """``(dataset_ids, sample_ids)`` int64 for global positions."""
        positions = np.asarray(positions, dtype=np.int64)
        if not self.segments:
            return self.source.locate(positions)
        if positions.size and (positions.min() < 0 or positions.max() >= self.num_samples):
            raise ConfigError(f"positions span [{int(positions.min())}, {int(positions.max())}]; "
                              f"the stream serves [0, {self.num_samples})")
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
        """(num_datasets,) int64: samples each dataset gave in positions ``[0, position)``."""
        counts = np.zeros(len(self.source.datasets), dtype=np.int64)
        for begin in range(0, position, _COUNT_CHUNK):
            dataset_ids, _ = self.locate(np.arange(begin, min(position, begin + _COUNT_CHUNK)))
            counts += np.bincount(dataset_ids, minlength=counts.shape[0])
        return counts

    def target_weights(self, position: int) -> tuple[float, ...]:
        """Weights in force at ``position``."""
        for segment in reversed(self.segments):
            if position >= segment.start:
                return segment.weights
        return tuple(d.weight for d in self.source.datasets)

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
        kept = tuple(s for s in self.segments if s.start < position)
        offsets = self.samples_reached(position)
        segment = BlendSegment(start=int(position), weights=tuple((w / w.sum()).tolist()),
                               dataset_offsets=tuple(int(o) for o in offsets))
        return SampleStream(self.source, (*kept, segment))

    def _usable_length(self) -> int:
        """Positions served before some dataset would need a sample its index does not hold."""
        for k, segment in enumerate(self.segments):
            end = self.segments[k + 1].start if k + 1 < len(self.segments) else self.source.num_samples
            blend, _ = self._segment_blend(k)
            if segment.start + len(blend) < end:
                return segment.start + len(blend)
        return self.source.num_samples


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
