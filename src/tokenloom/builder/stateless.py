"""Stateless-mode items: tokenloom's Feistel index and closed-form blend, no per-sample arrays.

A ``gpt`` item stores what :func:`tokenloom.index.stateless.build_stateless_gpt_index` computes
from the store: the block prefix sums (``block_token_starts``, 8 bytes per 16 documents per
epoch) and the round keys of each epoch's document permutation; the record holds the epoch plan
and the block size. Opening it rebuilds the :class:`StatelessGPTIndex` around memory maps of
those two arrays and the store's lengths.

A ``blend`` item is :class:`tokenloom.index.blend.Blend` (largest-remainder counts, closed-form
order): it stores only its per-dataset counts; positions are located on demand. The train split
of a schedule of several phases has a schedule ``blend`` item instead (its params carry
``schedule``): the kernel's :class:`~tokenloom.index.schedule.SchedulePlan`, planned again from
the params on opening, storing its counts per phase ``(P, D)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from tokenloom.builder.exact import plan_from_dict, plan_to_dict
from tokenloom.builder.schedule import schedule_plan_of
from tokenloom.errors import BuildError
from tokenloom.index.blend import Blend
from tokenloom.index.kernels import resolve_backend
from tokenloom.index.schedule import SchedulePlan
from tokenloom.index.split import DocumentRange, document_ids
from tokenloom.index.stateless import BACKENDS, StatelessGPTIndex, build_stateless_gpt_index
from tokenloom.io import IndexedDataset

#: Documents below which a build runs the numpy kernels (identical results; numba's compile costs
#: more). Serving takes the compiled kernels at any size (see open_stateless_gpt_index).
SMALL_SPLIT_DOCUMENTS = 1 << 18


def _backend(num_documents: int) -> str:
    return "numpy" if num_documents < SMALL_SPLIT_DOCUMENTS else resolve_backend("auto", BACKENDS, fallback="numpy")


def build_stateless_gpt_arrays(prefix: str, params: Mapping[str, Any], *,
                               compiled: bool | None = None) -> tuple[dict[str, np.ndarray], dict]:
    """The arrays and record fields of a stateless ``gpt`` item (``compiled``: use the numba
    kernels; None decides by the item's size)."""
    store = IndexedDataset(prefix)
    index = build_stateless_gpt_index(
        store.sequence_lengths, document_ids(DocumentRange(params["begin"], params["end"])),
        num_samples=params["num_samples"], seq_length=params["seq_length"], seed=params["seed"],
        add_extra_token=params["add_extra_token"], first_token=params.get("first_token"),
        backend="auto" if compiled else _backend(params["end"] - params["begin"]))
    if index.document_ids is not None:  # a split is always a contiguous range of documents
        raise BuildError(f"{prefix}: documents {params['begin']}..{params['end']} did not form one range")
    arrays = {"block_token_starts": index.block_token_starts, "document_keys": index.document_keys}
    record = {"plan": plan_to_dict(index.plan), "block_size": index.block_size, "rounds": index.rounds,
              "first_document_id": index.first_document_id}
    if index.first_token is not None:  # a schedule's length run (recorded only there: records stay as they were)
        record["first_token"] = index.first_token
    return arrays, record


def open_stateless_gpt_index(store: IndexedDataset, record: Mapping[str, Any], block_token_starts: np.ndarray,
                             document_keys: np.ndarray) -> StatelessGPTIndex:
    """Rebuild the index of a stateless ``gpt`` item around its memory-mapped arrays.

    It serves with the compiled kernels wherever numba is installed, whatever the split's size:
    a reader calls ``spans`` on every micro-batch for the whole run, and the numpy kernels take
    orders of magnitude longer a call than the compiled ones, while loading those costs once per
    process (from numba's disk cache, no compile).
    """
    return StatelessGPTIndex(
        plan=plan_from_dict(record["plan"]), seed=int(record["params"]["seed"]),
        block_size=int(record["block_size"]), rounds=record["rounds"],
        backend=resolve_backend("auto", BACKENDS, fallback="numpy"),
        sequence_lengths=store.sequence_lengths, document_ids=None,
        first_document_id=int(record["first_document_id"]), block_token_starts=block_token_starts,
        document_keys=np.asarray(document_keys), first_token=record.get("first_token"))


def stateless_blend(params: Mapping[str, Any]) -> Blend:
    """The closed-form blend of a stateless ``blend`` item."""
    return Blend(np.asarray(params["weights"], dtype=np.float64), int(params["size"]))


def schedule_plan(params: Mapping[str, Any]) -> tuple[SchedulePlan, list[int]]:
    """The plan of a schedule ``blend`` item and the union's datasets its split reads, in order."""
    return schedule_plan_of(params["schedule"]), list(params["schedule"]["served"])


def build_stateless_blend_arrays(params: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """A stateless blend stores its counts (for reports and checks; a schedule's per phase,
    ``(P, D)`` over the union); lookups are closed-form."""
    if "schedule" in params:
        plan, served = schedule_plan(params)
        counts, asked = plan.counts, plan.totals[served]
        if "columns" in params["schedule"]:  # the split's datasets are length runs
            asked = np.array([column[-1] for column in params["schedule"]["columns"]], dtype=np.int64)
    else:
        counts = asked = stateless_blend(params).counts
    over = np.flatnonzero(asked > np.asarray(params["dataset_lengths"], dtype=np.int64))
    if over.size:
        d = int(over[0])
        raise BuildError(f"the blend asks {int(asked[d])} samples of dataset {d}, whose index holds "
                         f"only {params['dataset_lengths'][d]}")
    return {"counts": counts}


__all__ = ["build_stateless_blend_arrays", "build_stateless_gpt_arrays", "open_stateless_gpt_index",
           "schedule_plan", "stateless_blend"]
