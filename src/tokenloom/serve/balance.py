"""Balanced ranks in serving: each step's samples placed by their cost, decided from the index.

A step serves the global batch ``[step_start, step_start + G)`` of the stream whatever the
layout. With ``BatchGeometry(balance=...)`` every rank reads the document pieces of all ``G``
samples from the index (the readers' ``spans``: index arrays and document lengths, no tokens;
on megatron-core's arrays one compiled pass sums them without building the spans,
:func:`~tokenloom.index.balance.megatron_sample_costs`), costs them
(:mod:`tokenloom.index.balance`) and places them on the ``(micro-batch, rank)`` slots with
:func:`~tokenloom.index.balance.assign_slots`; then it reads the tokens of its own slots only.
Every rank costs ``G`` samples but reads ``G / dp``, so the fixed cost of those calls, paid per
step, came to about a rank's reading time: the sampler places the steps ahead in one go
(:func:`steps_placement`, the same placements as one step at a time). No rank talks to another:
the placement is a pure function of the batch and the layout, the same on each. What stays as
without balancing: the step's set of samples (its audit fingerprint is taken in stream order),
each sample's fields (Megatron-exact samples stay bit-identical), the layout-free state (a run
resumes on another layout, where the placement is recomputed for it), weight changes, skips and
quarantines (they change the stream, and the placement is taken of the stream's step), and a
schedule's steps (one phase per step).

This module is what the sampler, ``where``/``find`` and the report of :func:`balance_report`
share: the costs of a batch of positions, the placement of one step (or of several), and the
slot of a position.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tokenloom.errors import ConfigError
from tokenloom.index.balance import (
    assign_slots,
    megatron_sample_costs,
    served_document_pairs,
    served_real_tokens,
    slot_costs,
)
from tokenloom.serve.geometry import BatchGeometry
from tokenloom.serve.samples import SampleOptions
from tokenloom.serve.stream import SampleStream
from tokenloom.source import SampleSource
from tokenloom.source.readers import MegatronReader


def check_balance(geometry: BatchGeometry, options: SampleOptions) -> None:
    """ConfigError for ``balance="attention"`` without document boundaries: the cost counts the
    documents' attention, which a sample served without ``inter_document_masking`` does not have
    (every sample attends over its whole window: balance by ``"tokens"`` there)."""
    if geometry.balance == "attention" and not options.inter_document_masking:
        raise ConfigError(
            "BatchGeometry(balance='attention') with SampleOptions(inter_document_masking=False); the attention "
            "cost is counted per document and these samples carry no document boundaries (their attention covers "
            "the whole window, the same for every sample): serve with inter_document_masking=True, or balance by "
            "real tokens, balance='tokens'")


def check_balance_source(source: SampleSource, geometry: BatchGeometry) -> None:
    """ConfigError when ``geometry`` balances and ``source`` cannot list its samples' document
    pieces (a split of a build and the in-memory blends can; any other SampleSource cannot)."""
    if geometry.balance is not None and getattr(source, "readers", None) is None:
        raise ConfigError(f"BatchGeometry(balance={geometry.balance!r}) on a {type(source).__name__}, which does "
                          "not list its samples' document pieces (no readers with spans); balance a build's split "
                          "or a StoreBlendSource / StatelessBlendSource")


def batch_costs(stream: SampleStream, positions, geometry: BatchGeometry) -> np.ndarray:
    """(B,) int64: the cost of the samples at ``positions`` of ``stream`` under
    ``geometry.balance``: the cost model over their documents as served with document
    boundaries (``"attention"``), or their real tokens (``"tokens"``)."""
    source = stream.source
    check_balance_source(source, geometry)
    positions = np.asarray(positions, dtype=np.int64).reshape(-1)  # (B,)
    dataset_ids, sample_ids = stream.locate(positions)  # (B,) int64 each
    widths = getattr(source, "seq_lengths", None)  # (datasets,) per dataset where a schedule varies them
    costs = np.empty(positions.shape[0], dtype=np.int64)
    for d in np.unique(dataset_ids):
        rows = np.flatnonzero(dataset_ids == d)
        reader = source.readers[int(d)]
        seq = int(source.seq_length if widths is None else widths[int(d)])
        if isinstance(reader, MegatronReader):  # the same sums, straight from the index arrays
            measured = megatron_sample_costs(reader.indices, reader.store.sequence_lengths, sample_ids[rows], seq,
                                             bool(source.add_extra_token), tokens=geometry.balance == "tokens")
            costs[rows] = (measured if geometry.balance == "tokens" else
                           geometry.cost_model.sample_costs(measured, np.full(rows.shape[0], seq)))
            continue
        spans = reader.spans(sample_ids[rows])
        if geometry.balance == "tokens":
            costs[rows] = served_real_tokens(spans.lengths, spans.bounds, seq)
        else:
            pairs = served_document_pairs(spans.lengths, spans.bounds, seq, bool(source.add_extra_token))
            costs[rows] = geometry.cost_model.sample_costs(pairs, np.full(rows.shape[0], seq))
    return costs


def step_placement(stream: SampleStream, geometry: BatchGeometry, step_start: int, global_batch_size: int
                   ) -> np.ndarray:
    """(G,) int64: the stream positions of the step starting at ``step_start``, in slot order
    (slot ``m * micro * dp + r * micro + j``: rank ``r``'s micro-batch ``m``; see
    :func:`~tokenloom.index.balance.assign_slots`). Without balance, the positions in order."""
    positions = np.arange(step_start, step_start + global_batch_size, dtype=np.int64)
    if geometry.balance is None:
        return positions
    costs = batch_costs(stream, positions, geometry)
    return step_start + assign_slots(costs, dp=geometry.dp, micro_batch_size=geometry.micro_batch_size)


def steps_placement(stream: SampleStream, geometry: BatchGeometry, step_starts, sizes) -> list[np.ndarray]:
    """``[step_placement(stream, geometry, s, g) for s, g in zip(step_starts, sizes)]``, computed
    at once: one :func:`batch_costs` over all the steps' positions (locate, ``spans`` and the
    pairs as a few array passes over the lot, not a dozen numpy calls per step) and one
    :func:`~tokenloom.index.balance.assign_slots` kernel call per distinct step size. A step's
    placement depends on its own samples only, so the result is exactly the per-step one; the
    sampler places the steps ahead of the one it serves this way (every rank costs all ``G``
    samples of a step but reads ``G / dp``: per step, the calls' fixed cost was most of it)."""
    starts = np.asarray(step_starts, dtype=np.int64).reshape(-1)  # (K,)
    sizes = np.broadcast_to(np.asarray(sizes, dtype=np.int64), starts.shape)  # (K,)
    if geometry.balance is None or not starts.size:
        return [np.arange(a, a + g, dtype=np.int64) for a, g in zip(starts.tolist(), sizes.tolist())]
    firsts = np.concatenate([[0], np.cumsum(sizes)])  # (K + 1,) where each step's costs begin
    positions = np.repeat(starts - firsts[:-1], sizes) + np.arange(int(firsts[-1]), dtype=np.int64)
    costs = batch_costs(stream, positions, geometry)  # (sum G,)
    out: list[np.ndarray] = [np.empty(0, dtype=np.int64)] * starts.shape[0]
    for size in np.unique(sizes).tolist():
        steps = np.flatnonzero(sizes == size)  # (k,)
        rows = costs[(firsts[steps][:, None] + np.arange(size)).reshape(-1)].reshape(-1, size)  # (k, G)
        placed = assign_slots(rows, dp=geometry.dp, micro_batch_size=geometry.micro_batch_size)  # (k, G)
        placed += starts[steps][:, None]
        for k, step in enumerate(steps.tolist()):
            out[step] = placed[k]
    return out


@dataclass(frozen=True, kw_only=True)
class Slot:
    """Where one position is served."""

    step: int
    """The 0-based optimizer step."""
    dp_rank: int
    """The data-parallel rank that reads it."""
    micro_batch: int
    """The micro-batch of that rank's step it is in."""


def slots_of(stream: SampleSource | SampleStream, geometry: BatchGeometry, positions) -> list[Slot]:
    """The step, data-parallel rank and micro-batch serving each of ``positions`` (served, logical
    positions of ``stream``: a split, or a run's stream from its state), under ``geometry``'s
    balance (``where``/``find`` report them). Steps of one size only (a batch-size ramp is
    refused: give its steps' global batch size)."""
    stream = stream if isinstance(stream, SampleStream) else SampleStream(stream)
    if geometry.schedule is not None:
        raise ConfigError("slots_of: a geometry with a batch-size schedule; expected one global_batch_size")
    size, per = geometry.global_batch_size, geometry.samples_per_micro_step
    positions = np.asarray(positions, dtype=np.int64).reshape(-1)
    out = []
    placed: dict[int, np.ndarray] = {}
    for p in positions.tolist():
        step = p // size
        if step not in placed:
            order = step_placement(stream, geometry, step * size, size)  # (G,) slot -> position
            inverse = np.empty(size, dtype=np.int64)
            inverse[order - step * size] = np.arange(size)
            placed[step] = inverse
        slot = int(placed[step][p - step * size])
        out.append(Slot(step=step, dp_rank=slot % per // geometry.micro_batch_size, micro_batch=slot // per))
    return out


@dataclass(frozen=True, kw_only=True, eq=False)
class BalanceReport:
    """Each rank's cost per step, with and without balancing (:func:`balance_report`)."""

    balanced: np.ndarray
    """(steps, M, dp) int64: each micro-batch's cost, placed by balancing."""
    unbalanced: np.ndarray
    """(steps, M, dp) int64: the same in Megatron's order."""
    largest_sample: np.ndarray
    """(steps,) int64: the costliest sample of each step."""

    @staticmethod
    def _ratio(costs: np.ndarray) -> np.ndarray:
        ranks = costs.sum(axis=1)  # (steps, dp)
        return ranks.max(axis=1) / np.maximum(ranks.mean(axis=1), 1e-300)

    @property
    def imbalance(self) -> np.ndarray:
        """(steps,) float: largest rank cost over the mean, balanced."""
        return self._ratio(self.balanced)

    @property
    def unbalanced_imbalance(self) -> np.ndarray:
        """(steps,) float: the same in Megatron's order."""
        return self._ratio(self.unbalanced)

    @property
    def bound(self) -> np.ndarray:
        """(steps,) float: the lower bound on the imbalance, the costliest sample over the mean
        rank cost (or 1)."""
        mean = self.balanced.sum(axis=(1, 2)) / self.balanced.shape[2]
        return np.maximum(1.0, self.largest_sample / np.maximum(mean, 1e-300))

    def summary(self) -> dict:
        """Mean and worst of each ratio over the steps (JSON-ready)."""
        out = {"steps": int(self.balanced.shape[0])}
        for name, values in (("balanced", self.imbalance), ("unbalanced", self.unbalanced_imbalance),
                             ("bound", self.bound)):
            out[name] = {"mean": float(values.mean()), "max": float(values.max())} if values.size else None
        return out


def balance_report(stream: SampleSource | SampleStream, geometry: BatchGeometry, *, num_steps: int,
                   first_step: int = 0) -> BalanceReport:
    """The cost of every micro-batch of ``num_steps`` steps from ``first_step`` (steps of one
    size; fewer where the stream ends), balanced by ``geometry.balance`` and in Megatron's order:
    what the imbalance (largest rank cost over the mean) will be before a run starts."""
    if geometry.balance is None:
        raise ConfigError("balance_report: BatchGeometry(balance=None); expected 'attention' or 'tokens' (the cost "
                          "to compare)")
    if geometry.schedule is not None:
        raise ConfigError("balance_report: a geometry with a batch-size schedule; expected one global_batch_size")
    stream = stream if isinstance(stream, SampleStream) else SampleStream(stream)
    size, dp, micro = geometry.global_batch_size, geometry.dp, geometry.micro_batch_size
    steps = max(0, min(int(num_steps), stream.num_samples // size - int(first_step)))
    balanced, unbalanced, largest = [], [], []
    for step in range(first_step, first_step + steps):
        costs = batch_costs(stream, np.arange(step * size, (step + 1) * size), geometry)
        order = assign_slots(costs, dp=dp, micro_batch_size=micro)
        balanced.append(slot_costs(costs, order, dp=dp, micro_batch_size=micro))
        unbalanced.append(slot_costs(costs, np.arange(size), dp=dp, micro_batch_size=micro))
        largest.append(int(costs.max()))
    shape = (0, geometry.num_micro_batches, dp)
    return BalanceReport(balanced=np.array(balanced, dtype=np.int64).reshape(-1, *shape[1:]) if steps else
                         np.zeros(shape, dtype=np.int64),
                         unbalanced=np.array(unbalanced, dtype=np.int64).reshape(-1, *shape[1:]) if steps else
                         np.zeros(shape, dtype=np.int64),
                         largest_sample=np.array(largest, dtype=np.int64))


__all__ = ["BalanceReport", "Slot", "balance_report", "batch_costs", "check_balance", "check_balance_source",
           "slots_of", "step_placement", "steps_placement"]
