"""Every rank of a DP x TP x PP x CP job, served in one process: for demos, checks and tests.

    report = simulate_job(source, BatchGeometry(global_batch_size=32, micro_batch_size=2, dp=2),
                          Topology(dp=2, tp=2, pp=2), num_steps=10, audit=MixtureAudit("audit.jsonl"))
    report.global_batches[3]["tokens"]   # (32, seq_length): step 3 as the first stage saw it

Each rank gets its own :class:`~tokenloom.serve.loader.RankLoader` (``LoadMode.EVERY_RANK``, so
every tensor peer reads for itself); after each micro-step the simulation checks that tensor
peers hold identical tensors and that the context-parallel ranks' chunks tile the sequence, then
reassembles the global batch in stream order from the first and last pipeline stages (with
``BatchGeometry(balance=...)`` the ranks read the step's positions in another placement; the
reassembled batch is the same). ``rank_costs`` is each micro-batch's cost as each rank served it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from tokenloom.errors import ConfigError, TokenloomError
from tokenloom.serve.audit import MixtureAudit
from tokenloom.serve.balance import batch_costs
from tokenloom.serve.geometry import BatchGeometry
from tokenloom.serve.loader import RankLoader
from tokenloom.serve.samples import SAMPLE_WIDE_FIELDS, SampleOptions
from tokenloom.serve.topology import LoadMode, Topology, context_parallel_positions
from tokenloom.source import SampleSource


@dataclass(frozen=True, kw_only=True, eq=False)
class JobReport:
    """What a simulated job served."""

    global_batches: list[dict[str, np.ndarray]]
    """Per step: every field over the whole global batch, rows in stream order, full sequences."""
    state: dict
    """The serving state after the last step (identical on every rank)."""
    rank_costs: list[np.ndarray]
    """Per step: ``(M, dp)`` int64, the cost of each data-parallel rank's micro-batch ``m`` as
    served, by the geometry's ``balance`` (without one: ``"attention"`` where the options carry
    document boundaries, else ``"tokens"``; :mod:`tokenloom.index.balance`). A rank's step costs
    the sum over ``m``; the step waits for the costliest rank."""


def simulate_job(source: SampleSource, geometry: BatchGeometry, topology: Topology, *, num_steps: int,
                 options: SampleOptions = SampleOptions(), audit: MixtureAudit | None = None,
                 state: dict | None = None) -> JobReport:
    """Serve ``num_steps`` steps to every rank of ``topology``; see the module docstring."""
    if options.boundary_format == "thd":
        raise ConfigError("simulate_job reassembles global batches from per-sample fields, and "
                          "boundary_format='thd' packs each micro-batch's boundaries into one sequence: simulate "
                          "with boundary_format='megatron' (the packed form is made from it per micro-batch)")
    loaders = [RankLoader(source, geometry, topology=topology, rank=r, options=options, mode=LoadMode.EVERY_RANK,
                          audit=audit if r == 0 else None) for r in range(topology.world_size)]
    if state is not None:
        for loader in loaders:
            loader.load_state_dict(state)
    costed = geometry if geometry.balance is not None else dataclasses.replace(
        geometry, balance="attention" if options.inter_document_masking else "tokens")
    firsts = [loaders[topology.rank_of(dp_rank=r, tp_rank=0, pp_rank=0, cp_rank=0)] for r in range(topology.dp)]
    steps, rank_costs = [], []
    for _ in range(num_steps):
        micro_steps, served = [], []
        for _ in range(loaders[0].sampler.num_micro_batches):
            served.append(np.stack([first.sampler.positions() for first in firsts]))  # (dp, micro)
            outputs = [loader.next_batch() for loader in loaders]
            per_dp = []
            for dp_rank in range(topology.dp):
                merged: dict[str, np.ndarray] = {}
                for pp_rank in sorted({0, topology.pp - 1}):
                    for cp_rank in range(topology.cp):
                        group = [outputs[topology.rank_of(dp_rank=dp_rank, tp_rank=t, pp_rank=pp_rank,
                                                          cp_rank=cp_rank)] for t in range(topology.tp)]
                        for peer in group[1:]:
                            for name, value in group[0].items():
                                if not np.array_equal(value, peer[name]):
                                    raise TokenloomError(
                                        f"tensor peers disagree on {name} (dp {dp_rank}, pp {pp_rank})")
                        for name, value in group[0].items():
                            if name == "dataset_id" or name in SAMPLE_WIDE_FIELDS:  # whole on every cp rank
                                merged[name] = value
                                continue
                            axis = 2 if name == "attention_mask" else 1
                            # the step's own sequence length (a schedule's phase may have its own)
                            seq = value.shape[axis] * topology.cp
                            positions = context_parallel_positions(seq, topology.cp, cp_rank)
                            if name not in merged:
                                shape = list(value.shape)
                                shape[axis] = seq
                                merged[name] = np.empty(shape, dtype=value.dtype)
                            index = [slice(None)] * value.ndim
                            index[axis] = positions
                            merged[name][tuple(index)] = value
                per_dp.append(merged)
            micro_steps.append({k: np.concatenate([m[k] for m in per_dp]) for k in per_dp[0]})
        positions = np.stack(served)  # (M, dp, micro) the step's positions as the ranks read them
        rank_costs.append(batch_costs(loaders[0].sampler.stream, positions.reshape(-1), costed)
                          .reshape(positions.shape).sum(axis=2))
        in_stream_order = np.argsort(positions.reshape(-1), kind="stable")
        steps.append({k: np.concatenate([m[k] for m in micro_steps])[in_stream_order] for k in micro_steps[0]})
    states = [loader.state_dict() for loader in loaders]
    if any(s != states[0] for s in states):
        raise TokenloomError("ranks disagree on the serving state")
    return JobReport(global_batches=steps, state=states[0], rank_costs=rank_costs)


__all__ = ["JobReport", "simulate_job"]
