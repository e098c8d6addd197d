"""The cost model: estimated seconds of a build's work items, on one core.

The planner (:mod:`tokenloom.builder.items`) gives every item its estimate from these, and
assigns items to ranks by them; the dry run reports them. It lives apart from the items so that
its constants and formulas, which benchmarks calibrate (BENCHMARKS.md), are read and tuned in one
place. Best-fit chunks have their own constants (:mod:`tokenloom.builder.best_fit`).
"""

from __future__ import annotations

#: Seconds per unit of work on one core, measured on the benchmark machine (BENCHMARKS.md); only
#: ratios matter for the assignment, the absolute values feed the dry-run estimate.
COST_PER_DOCUMENT_POSITION_S = 25e-9
"""RandomState shuffle of the document index plus the sample walk, per document position."""
COST_PER_SAMPLE_S = 30e-9
"""Sample-index row and shuffle-index draw, per sample."""
COST_PER_BLEND_SAMPLE_S = 150e-9
"""megatron-core's greedy blend, per blended sample."""
COST_PER_BYTE_S = 0.5e-9
"""Writing and hashing output, per byte."""
COST_PER_ITEM_S = 2e-3
"""Fixed cost of an item: opening files, the record, renames."""
COST_PER_STATELESS_DOCUMENT_S = 4e-9
"""Stateless mode: block prefix sums, per document."""
COST_PER_STATELESS_ITEM_S = 0.25e-3
"""Fixed cost of a stateless ``gpt`` item: its record and two small arrays, apart from the
per-document sums that :data:`COST_PER_STATELESS_DOCUMENT_S` counts. Much below
:data:`COST_PER_ITEM_S`, since a stateless item writes no per-sample arrays."""
COST_PER_MANIFEST_ITEM_S = 80e-6
"""A writer rank's manifest and warm-start record, per item of the build: reading the item's
record from the pack indexes, writing its entry, pickling the plan. A writer also builds items,
so this fixed load decides how many fewer it is given. The value errs high, toward what finalize
costs a writer on a crowded host rather than one alone: an estimate at its usual cost still left
the writer the slowest rank (BENCHMARKS.md, "Cluster scale")."""


def gpt_cost(num_positions: int, num_samples: int, output_bytes: int) -> float:
    """Seconds of an exact-mode ``gpt`` item: its document positions, samples and output."""
    return (COST_PER_ITEM_S + COST_PER_DOCUMENT_POSITION_S * num_positions
            + COST_PER_SAMPLE_S * num_samples + COST_PER_BYTE_S * output_bytes)


def stateless_gpt_cost(num_positions: int) -> float:
    """Seconds of a stateless ``gpt`` item: its document positions' block sums."""
    return COST_PER_STATELESS_ITEM_S + COST_PER_STATELESS_DOCUMENT_S * num_positions


def blend_cost(num_samples: int, output_bytes: int) -> float:
    """Seconds of an exact-mode blend: its blended samples and output."""
    return COST_PER_ITEM_S + COST_PER_BLEND_SAMPLE_S * num_samples + COST_PER_BYTE_S * output_bytes


def stateless_blend_cost(num_datasets: int) -> float:
    """Seconds of a stateless blend: a record and a few small arrays, whatever its size."""
    return COST_PER_ITEM_S + 1e-6 * num_datasets


def range_cost(positions: int, *, cost_s: float, num_samples: int) -> float:
    """Seconds on one core to compute and write ``positions`` positions of a divided blend whose
    item is estimated at ``cost_s`` for all its ``num_samples`` positions (the item's numbers, not
    the item: :mod:`tokenloom.builder.items` imports this module)."""
    if positions <= 0:
        return 0.0
    return COST_PER_ITEM_S + (cost_s - COST_PER_ITEM_S) * positions / max(1, num_samples)


__all__ = [
    "COST_PER_BLEND_SAMPLE_S", "COST_PER_BYTE_S", "COST_PER_DOCUMENT_POSITION_S", "COST_PER_ITEM_S",
    "COST_PER_MANIFEST_ITEM_S", "COST_PER_SAMPLE_S", "COST_PER_STATELESS_DOCUMENT_S", "COST_PER_STATELESS_ITEM_S",
    "blend_cost", "gpt_cost", "range_cost", "stateless_blend_cost", "stateless_gpt_cost",
]
