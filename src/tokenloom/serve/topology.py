"""Where a rank sits in a DP x TP x PP x CP job, and what data it needs.

Megatron-LM numbers ranks with tensor parallel fastest, then context, data, and pipeline
parallel slowest (its default order ``"tp-cp-ep-dp-pp"``, here without expert parallelism).
For ``Topology(dp=2, tp=2, pp=2)`` global rank 5 is ``tp=1, dp=0, pp=1``::

    rank  0 1 2 3 | 4 5 6 7
    tp    0 1 0 1 | 0 1 0 1
    dp    0 0 1 1 | 0 0 1 1
    pp    0 0 0 0 | 1 1 1 1

Only the first pipeline stage consumes inputs (tokens, position ids, attention mask) and only
the last consumes targets (labels, loss mask). Inside a tensor-parallel group every rank gets
the same tensors: by default tensor rank 0 loads and broadcasts (``LoadMode.BROADCAST``), or
every tensor rank loads for itself (``LoadMode.EVERY_RANK``). Context-parallel ranks each get
two of ``2 x cp`` sequence chunks, ``r`` and ``2cp - 1 - r``, which balances causal attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np

from tokenloom.errors import ConfigError
from tokenloom.serve.samples import SAMPLE_WIDE_FIELDS
from tokenloom.validate import is_integer

AXES = ("tp", "cp", "dp", "pp")
"""Megatron's default order, fastest-varying first."""

INPUT_FIELDS = ("tokens", "position_ids", "attention_mask")
TARGET_FIELDS = ("labels", "loss_mask")

_MESH_AXIS_ALIASES = {
    "tp": "tp", "tensor": "tp", "tensor_parallel": "tp",
    "cp": "cp", "context": "cp", "context_parallel": "cp",
    "dp": "dp", "data": "dp", "data_parallel": "dp", "dp_replicate": "dp",
    "pp": "pp", "pipeline": "pp", "pipeline_parallel": "pp",
}


class LoadMode(str, Enum):
    """Who reads from storage inside a tensor-parallel group."""

    BROADCAST = "broadcast"
    """Tensor rank 0 loads, its peers receive a broadcast (Megatron's ``get_batch``)."""
    EVERY_RANK = "every_rank"
    """Every tensor rank loads the same micro-batch itself (no communication)."""


@dataclass(frozen=True, kw_only=True)
class RankCoordinates:
    """One global rank's place in the grid."""

    rank: int
    """Global rank."""
    dp_rank: int
    """Data-parallel rank: which slice of every global batch it trains on."""
    tp_rank: int
    """Tensor-parallel rank."""
    pp_rank: int
    """Pipeline stage."""
    cp_rank: int
    """Context-parallel rank: which two sequence chunks it holds."""


@dataclass(frozen=True, kw_only=True)
class RankPlan:
    """What one rank does with data."""

    coordinates: RankCoordinates
    """Where the rank sits."""
    fields: tuple[str, ...]
    """Fields its pipeline stage consumes (empty for middle stages, unless they take the
    document boundaries)."""
    loads: bool
    """Whether it reads samples from storage itself."""
    broadcast_source: int | None
    """Global rank it receives its batch from (its tensor rank 0), or None when it loads or
    needs nothing."""
    tensor_group: tuple[int, ...]
    """Global ranks of its tensor-parallel group, tensor rank 0 first."""


@dataclass(frozen=True, kw_only=True)
class Topology:
    """Sizes of a DP x TP x PP x CP job and its rank order."""

    dp: int
    """Data-parallel size: model replicas reading different samples."""
    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size."""
    cp: int = 1
    """Context-parallel size: ranks splitting one sequence."""
    order: tuple[str, ...] = AXES
    """Axes from fastest- to slowest-varying global rank (Megatron's default)."""

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "cp"):
            value = getattr(self, name)
            if not is_integer(value) or value < 1:
                raise ConfigError(f"Topology.{name}={value!r}; expected a positive integer")
        if sorted(self.order) != sorted(AXES):
            raise ConfigError(f"Topology.order={self.order!r}; expected a permutation of {AXES}")

    @property
    def world_size(self) -> int:
        """Ranks in the job: ``dp x tp x pp x cp``."""
        return self.dp * self.tp * self.pp * self.cp

    def _size(self, axis: str) -> int:
        return getattr(self, axis)

    def coordinates(self, rank: int) -> RankCoordinates:
        """The dp/tp/pp/cp coordinates of a global rank."""
        if not is_integer(rank) or not 0 <= rank < self.world_size:
            raise ConfigError(f"rank={rank!r}; expected an integer in [0, {self.world_size}) for {self}")
        rest = int(rank)
        coords = {}
        for axis in self.order:
            rest, coords[axis] = divmod(rest, self._size(axis))
        return RankCoordinates(rank=int(rank), dp_rank=coords["dp"], tp_rank=coords["tp"],
                               pp_rank=coords["pp"], cp_rank=coords["cp"])

    def rank_of(self, *, dp_rank: int = 0, tp_rank: int = 0, pp_rank: int = 0, cp_rank: int = 0) -> int:
        """The global rank at the given coordinates (inverse of :meth:`coordinates`)."""
        coords = {"dp": dp_rank, "tp": tp_rank, "pp": pp_rank, "cp": cp_rank}
        rank, stride = 0, 1
        for axis in self.order:
            size = self._size(axis)
            if not 0 <= coords[axis] < size:
                raise ConfigError(f"{axis}_rank={coords[axis]!r}; expected an integer in [0, {size})")
            rank += coords[axis] * stride
            stride *= size
        return rank

    def stage_fields(self, pp_rank: int, *, boundaries: tuple[str, ...] = ()) -> tuple[str, ...]:
        """Fields pipeline stage ``pp_rank`` consumes: inputs on the first, targets on the last,
        and the document-boundary fields ``boundaries`` (``SampleOptions.boundary_fields``) on
        every stage, since each stage's attention keeps to the documents (as Megatron-LM
        broadcasts them to middle stages)."""
        out: tuple[str, ...] = ()
        if pp_rank == 0:
            out += INPUT_FIELDS
        if pp_rank == self.pp - 1:
            out += TARGET_FIELDS
        return out + tuple(boundaries)

    def plan(self, rank: int, mode: LoadMode | str = LoadMode.BROADCAST, *,
             boundaries: tuple[str, ...] = ()) -> RankPlan:
        """What ``rank`` loads, receives, and keeps (``boundaries``: see :meth:`stage_fields`)."""
        mode = LoadMode(mode)
        c = self.coordinates(rank)
        fields = self.stage_fields(c.pp_rank, boundaries=boundaries)
        group = tuple(self.rank_of(dp_rank=c.dp_rank, tp_rank=t, pp_rank=c.pp_rank, cp_rank=c.cp_rank)
                      for t in range(self.tp))
        loads = bool(fields) and (mode is LoadMode.EVERY_RANK or c.tp_rank == 0)
        source = group[0] if fields and not loads else None
        return RankPlan(coordinates=c, fields=fields, loads=loads, broadcast_source=source, tensor_group=group)

    def tensor_groups(self) -> list[tuple[int, ...]]:
        """Every tensor-parallel group (tensor rank 0 first), in the order of their first rank."""
        groups = {self.plan(r).tensor_group for r in range(self.world_size)}
        return sorted(groups)

    @classmethod
    def from_device_mesh(cls, mesh) -> Topology:
        """Sizes and order from a ``torch.distributed.device_mesh.DeviceMesh`` with named
        dimensions (``"dp"``/``"data"``, ``"tp"``/``"tensor"``, ``"pp"``, ``"cp"``; missing
        axes have size 1). Its rank layout must be the row-major one ``init_device_mesh`` makes."""
        names = getattr(mesh, "mesh_dim_names", None)
        if not names:
            raise ConfigError("the DeviceMesh has no mesh_dim_names; create it with names such as ('dp', 'tp')")
        axes = []
        for name in names:
            axis = _MESH_AXIS_ALIASES.get(str(name).lower())
            if axis is None:
                raise ConfigError(f"DeviceMesh dimension {name!r}; expected one of {sorted(_MESH_AXIS_ALIASES)}")
            if axis in axes:
                raise ConfigError(f"DeviceMesh dimensions {tuple(names)} name the {axis} axis twice")
            axes.append(axis)
        grid = np.asarray(mesh.mesh.cpu().numpy() if hasattr(mesh.mesh, "cpu") else mesh.mesh)
        if not np.array_equal(grid.reshape(-1), np.arange(grid.size)):
            raise ConfigError(
                f"the DeviceMesh's ranks are laid out as {grid.tolist()}; expected consecutive ranks "
                "in row-major order (as init_device_mesh makes them)")
        sizes = dict(zip(axes, grid.shape))
        missing = [a for a in AXES if a not in sizes]
        # the mesh's last dimension varies fastest; absent axes (size 1) go anywhere
        order = tuple(reversed(axes)) + tuple(missing)
        return cls(dp=int(sizes.get("dp", 1)), tp=int(sizes.get("tp", 1)), pp=int(sizes.get("pp", 1)),
                   cp=int(sizes.get("cp", 1)), order=order)


# --------------------------------------------------------------------------- context parallel


def context_parallel_positions(seq_length: int, cp_size: int, cp_rank: int) -> np.ndarray:
    """Sequence positions context-parallel rank ``cp_rank`` holds: chunks ``r`` and
    ``2cp - 1 - r`` of ``2 x cp`` equal chunks, in that order."""
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ConfigError(f"cp_rank={cp_rank!r}; expected an integer in [0, {cp_size})")
    if seq_length % (2 * cp_size):
        raise ConfigError(
            f"seq_length={seq_length} is not divisible by 2 x cp = {2 * cp_size}; context parallelism "
            f"splits each sequence into {2 * cp_size} equal chunks")
    chunk = seq_length // (2 * cp_size)
    first = np.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    second = np.arange((2 * cp_size - 1 - cp_rank) * chunk, (2 * cp_size - cp_rank) * chunk)
    return np.concatenate([first, second])  # (seq_length // cp_size,)


def context_parallel_slice(fields: dict, cp_size: int, cp_rank: int) -> dict:
    """Every field cut to one context-parallel rank's positions along its sequence axis.

    tokens, labels, loss_mask, position_ids: ``(B, S) -> (B, S / cp)``; attention_mask
    ``(B, 1, S, S) -> (B, 1, S / cp, S)`` (the rank's queries against every key); the
    document boundaries (``cu_seqlens``, ``max_seqlen``) stay whole, as Megatron-LM's per-sequence
    split leaves them. Numpy arrays or torch tensors.
    """
    if cp_size == 1:
        return dict(fields)
    out = {}
    for name, value in fields.items():
        if name in SAMPLE_WIDE_FIELDS:  # they describe the whole sample
            out[name] = value
            continue
        seq_axis = 2 if name == "attention_mask" else 1
        positions = context_parallel_positions(value.shape[seq_axis], cp_size, cp_rank)
        if hasattr(value, "index_select"):  # torch
            import torch

            out[name] = value.index_select(seq_axis, torch.as_tensor(positions, device=value.device))
        else:
            out[name] = np.take(value, positions, axis=seq_axis)
    return out


__all__ = [
    "AXES",
    "INPUT_FIELDS",
    "TARGET_FIELDS",
    "LoadMode",
    "RankCoordinates",
    "RankPlan",
    "Topology",
    "context_parallel_positions",
    "context_parallel_slice",
]
