"""JAX: one shard of every global batch per process, assembled into global ``jax.Array``s.

    from tokenloom.serve.jax_adapter import HostLoader, ShardOptions, make_global_batch
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    loader = HostLoader(source, global_batch_size=256, shard=ShardOptions.from_jax())
    for host_batch in loader:                       # dict of numpy, 256 / process_count rows
        batch = make_global_batch(host_batch, mesh)  # dict of jax.Array, 256 rows, sharded on "data"

Process ``p`` of ``P`` reads rows ``[p x G / P, (p + 1) x G / P)`` of every global batch of ``G``
samples -- the data-parallel cut of :class:`~tokenloom.serve.geometry.BatchGeometry` with one
"rank" per process -- so the state is the same layout-free state as everywhere else, and a run
resumes on another process count. ``make_global_batch`` splits the host rows across the
process's local devices with ``jax.make_array_from_process_local_data``.

Importing this module does not import jax; the functions that need it do.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from tokenloom.errors import ConfigError
from tokenloom.serve.audit import MixtureAudit
from tokenloom.serve.geometry import BatchGeometry
from tokenloom.serve.loader import RankLoader
from tokenloom.serve.online import OnlineMixing
from tokenloom.serve.samples import SampleOptions
from tokenloom.serve.topology import Topology
from tokenloom.source import SampleSource
from tokenloom.validate import is_integer


@dataclass(frozen=True, kw_only=True)
class ShardOptions:
    """Which shard of every global batch this process reads (grain's ``ShardOptions`` fields)."""

    shard_index: int
    """This process's shard, in ``[0, shard_count)``; its rows come ``shard_index``-th in every batch."""
    shard_count: int
    """Processes sharing each global batch."""

    def __post_init__(self) -> None:
        if not (is_integer(self.shard_count) and self.shard_count >= 1):
            raise ConfigError(f"ShardOptions.shard_count={self.shard_count!r}; expected a positive integer")
        if not (is_integer(self.shard_index) and 0 <= self.shard_index < self.shard_count):
            raise ConfigError(f"ShardOptions.shard_index={self.shard_index!r}; expected an integer in "
                              f"[0, {self.shard_count})")

    @classmethod
    def from_jax(cls) -> ShardOptions:
        """``shard_index = jax.process_index()``, ``shard_count = jax.process_count()``."""
        import jax

        return cls(shard_index=jax.process_index(), shard_count=jax.process_count())

    @classmethod
    def of(cls, options) -> ShardOptions:
        """From anything with ``shard_index`` and ``shard_count`` (grain's ShardOptions too)."""
        if isinstance(options, cls):
            return options
        if not all(hasattr(options, name) for name in ("shard_index", "shard_count")):
            raise ConfigError(f"shard={options!r}; expected ShardOptions(shard_index=..., shard_count=...) "
                              "(tokenloom's or grain's)")
        return cls(shard_index=int(options.shard_index), shard_count=int(options.shard_count))


class HostLoader:
    """This process's rows of every global batch, as dicts of numpy arrays: a
    :class:`~tokenloom.serve.loader.RankLoader` with one data-parallel rank per process, so the
    fields come from serve's one batch pipeline (:class:`~tokenloom.serve.batch.BatchPipeline`).
    For attention inside documents, MaxText's packed-input fields:
    ``SampleOptions(inter_document_masking=True, boundary_format="segments")``."""

    def __init__(self, source: SampleSource, *, global_batch_size: int, shard, options: SampleOptions = SampleOptions(),
                 max_steps: int | None = None, audit: MixtureAudit | None = None,
                 mixing: OnlineMixing | None = None, balance: str | None = None) -> None:
        """``mixing``: online mixing (:class:`~tokenloom.serve.online.OnlineMixing`): every
        process reports the same all-reduced statistics after every step (:meth:`report`).
        ``balance``: ``"attention"`` or ``"tokens"`` places each global batch's rows on the
        processes by their cost (:attr:`BatchGeometry.balance
        <tokenloom.serve.geometry.BatchGeometry.balance>`); the global batch holds the same rows."""
        self.shard = ShardOptions.of(shard)
        if options.boundary_format == "thd":
            raise ConfigError("SampleOptions(boundary_format='thd') packs a micro-batch into one sequence whose "
                              "length varies, which no global jax.Array of rows can hold; expected "
                              "boundary_format='segments' (MaxText's inputs_segmentation and inputs_position) or "
                              "'megatron'")
        count = self.shard.shard_count
        if not is_integer(global_batch_size) or global_batch_size % count:
            raise ConfigError(f"global_batch_size={global_batch_size!r} is not a multiple of shard_count={count}; "
                              "each process needs the same number of rows")
        self.geometry = BatchGeometry(global_batch_size=global_batch_size, micro_batch_size=global_batch_size // count,
                                      dp=count, balance=balance)
        self._loader = RankLoader(source, self.geometry, topology=Topology(dp=count), rank=self.shard.shard_index,
                                  options=options, max_steps=max_steps, audit=audit, mixing=mixing)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return iter(self._loader)

    def __next__(self) -> dict[str, np.ndarray]:
        return self._loader.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """The layout-free serving state (the same on every process)."""
        return self._loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume, on any process count, between steps."""
        self._loader.load_state_dict(state)

    def skip_steps(self, first: int, stop: int) -> None:
        """Skip the samples of steps ``[first, stop)`` (every process, between steps)."""
        self._loader.skip_steps(first, stop)

    def quarantine(self, items) -> None:
        """Quarantine ``(store prefix, document id)`` pairs from the next step on (every process)."""
        self._loader.quarantine(items)

    def reweight(self, weights) -> None:
        """Change the blend weights from the next step on (every process, between steps)."""
        self._loader.reweight(weights)

    @property
    def mixing(self) -> OnlineMixing | None:
        """The online mixing this host serves (its ``history`` of decisions), or None."""
        return self._loader.mixing

    def report(self, tokens, loss_sums) -> bool:
        """After every step, on every process: each dataset's tokens and summed loss in the global
        batch (summed over processes, e.g. with ``jax.lax.psum`` in the step), as
        :meth:`RankLoader.report <tokenloom.serve.loader.RankSchedule.report>`; True when it changed
        the weights of a later step."""
        return self._loader.report(tokens, loss_sums)

    def pass_steps(self, count: int) -> None:
        """Move past the next ``count`` steps without reading them (another reader serves them:
        grain's worker processes each serve every W-th step). Not stopped by ``max_steps``: the
        state then names the step this reader serves next, which a run resumed with more steps
        must start from."""
        sampler = self._loader.sampler
        for _ in range(int(count)):
            sampler.next_step()


def make_global_batch(host_batch: dict[str, np.ndarray], mesh, data_axis: str | tuple[str, ...] = "data") -> dict:
    """Assemble every process's rows into global ``jax.Array``s sharded along ``data_axis``.

    Each field's first axis is the batch; the global batch has ``process_count`` times the rows
    (``jax.make_array_from_process_local_data`` splits this host's rows across its devices).
    """
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    out = {}
    for name, value in host_batch.items():
        spec = PartitionSpec(data_axis, *([None] * (value.ndim - 1)))
        sharding = NamedSharding(mesh, spec)
        global_shape = (value.shape[0] * jax.process_count(), *value.shape[1:])
        out[name] = jax.make_array_from_process_local_data(sharding, np.ascontiguousarray(value), global_shape)
    return out


__all__ = ["HostLoader", "ShardOptions", "make_global_batch"]
