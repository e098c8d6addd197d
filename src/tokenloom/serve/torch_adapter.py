"""PyTorch: a Dataset, a stateful batch sampler, a DataLoader factory, and distributed batches.

    from tokenloom.serve.torch_adapter import build_dataloader
    loader = build_dataloader(source, geometry, topology=topology, rank=rank,
                              num_workers=4, pin_memory=True, prefetch_factor=4)
    for batch in loader:            # dict of tensors: tokens, labels, loss_mask, ...
        ...
    torch.save(loader.state_dict(), "loader.pt")   # StatefulDataLoader's state (torchdata)

The batch sampler runs in the main process and turns positions into ``(dataset_id, sample_id)``
pairs (so blend weight changes live in its state); workers read a whole micro-batch with one
vectorised call (``Dataset.__getitems__``) through serve's one batch pipeline
(:class:`tokenloom.serve.batch.BatchPipeline`) and only turn its numpy fields into tensors.
:class:`DistributedBatches` follows the schedule every rank loader shares
(:class:`tokenloom.serve.loader.RankSchedule`) and adds the tensor-parallel broadcast: tensor
rank 0 of the first and last pipeline stages loads, its peers receive.

Importing this module imports torch; ``import tokenloom.serve`` does not.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from tokenloom.errors import ConfigError
from tokenloom.serve.audit import MixtureAudit
from tokenloom.serve.balance import check_balance
from tokenloom.serve.batch import BatchPipeline, check_eod, field_schema, finish_micro_batch
from tokenloom.serve.geometry import BatchGeometry
from tokenloom.serve.loader import RankSchedule
from tokenloom.serve.online import OnlineMixing
from tokenloom.serve.sampler import MicroBatchSampler
from tokenloom.serve.samples import SampleOptions
from tokenloom.serve.stream import SampleStream
from tokenloom.serve.topology import LoadMode, Topology
from tokenloom.source import SampleSource


def _unpack(buffer: torch.Tensor, layout: tuple) -> PackedBatch:
    batch = PackedBatch()
    for name, dtype, shape, offset, nbytes in layout:
        batch[name] = buffer[offset:offset + nbytes].view(dtype).view(shape)
    return batch


class PackedBatch(dict):
    """A dict of tensors that crosses a process boundary as one shared-memory buffer.

    A DataLoader worker hands each tensor of a batch to the main process through its own
    shared-memory segment, which costs more than reading the batch; pickling packs every field
    into one buffer and unpickling gives views of it. In one process it is a plain dict.
    """

    def __reduce__(self):
        layout, total = [], 0
        for name, value in self.items():
            nbytes = value.numel() * value.element_size()
            layout.append((name, value.dtype, tuple(value.shape), total, nbytes))
            total += -(-nbytes // 64) * 64  # 64-byte aligned fields
        buffer = torch.empty(total, dtype=torch.uint8)
        for name, dtype, shape, offset, nbytes in layout:
            buffer[offset:offset + nbytes].view(dtype).view(shape).copy_(self[name])
        return (_unpack, (buffer, tuple(layout)))


class ServeDataset(torch.utils.data.Dataset):
    """Reads micro-batches given as ``(B, 2)`` int64 arrays of ``(dataset_id, sample_id)`` rows.

    ``fields`` keeps only the named fields (a pipeline stage's), ``cp`` cuts context-parallel
    chunks (see :class:`~tokenloom.serve.batch.BatchPipeline`). ``dataset[pairs]`` and
    ``dataset.__getitems__(pairs)`` return one batch as a :class:`PackedBatch` of tensors: one
    micro-batch, or with ``per_sample=True`` the per-sample fields of any number of micro-batches
    (a whole step), which the consumer cuts and finishes (``finish_micro_batch``) itself.
    """

    def __init__(self, source: SampleSource, *, options: SampleOptions = SampleOptions(),
                 fields: tuple[str, ...] | None = None, cp_size: int = 1, cp_rank: int = 0,
                 per_sample: bool = False) -> None:
        check_eod(source, options)
        self.source = source
        self.options = options
        self.fields = fields
        self.cp_size, self.cp_rank = cp_size, cp_rank
        self.pipeline = BatchPipeline(source, options=options, fields=fields, cp_size=cp_size, cp_rank=cp_rank)
        self.per_sample = per_sample

    def __len__(self) -> int:
        return self.source.num_samples

    def __getitems__(self, pairs) -> dict[str, torch.Tensor]:
        pairs = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)  # (B, 2) (dataset_id, sample_id)
        read = self.pipeline.read_samples_fields if self.per_sample else self.pipeline.read
        fields = read(pairs[:, 0], pairs[:, 1])
        return PackedBatch({k: torch.from_numpy(np.require(v, requirements="C")) for k, v in fields.items()})

    __getitem__ = __getitems__


def passthrough_collate(batch):
    """The dataset already returns a collated batch."""
    return batch


class _PairsIterator:
    """Iterates a copy of a :class:`MicroBatchSampler`; its state is the copy's (torchdata's
    ``Stateful`` protocol)."""

    def __init__(self, owner: StatefulBatchSampler) -> None:
        self._sampler = owner._start.copy()
        self._whole_steps = owner.whole_steps

    def __iter__(self) -> _PairsIterator:
        return self

    def __next__(self) -> np.ndarray:
        sampler = self._sampler
        if sampler.exhausted():
            raise StopIteration
        parts = [sampler.positions()]
        sampler.advance()
        if self._whole_steps:  # the rest of this step's micro-batches in one item
            while sampler.micro_batch != 0:
                parts.append(sampler.positions())
                sampler.advance()
        positions = np.concatenate(parts)
        return np.stack(sampler.stream.locate(positions), axis=1)  # (micro x count, 2) int64

    def state_dict(self) -> dict[str, Any]:
        return self._sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._sampler.load_state_dict(state)


class StatefulBatchSampler(torch.utils.data.Sampler):
    """One data-parallel rank's micro-batches as ``(dataset_id, sample_id)`` arrays; resumable.

    ``state_dict()``/``load_state_dict()`` follow torchdata's Stateful protocol, on the sampler
    (where the next ``iter()`` starts) and on its iterators (what they have yielded).
    ``whole_steps=True`` yields the rest of the current step's micro-batches as one item (one
    read and one inter-process transfer per optimizer step instead of per micro-batch).
    """

    def __init__(self, source: SampleSource | SampleStream, geometry: BatchGeometry, *, dp_rank: int = 0,
                 max_steps: int | None = None, whole_steps: bool = False) -> None:
        self._start = MicroBatchSampler(source, geometry, dp_rank=dp_rank, max_steps=max_steps)
        self.whole_steps = whole_steps

    def __iter__(self) -> Iterator[np.ndarray]:
        return _PairsIterator(self)

    def __len__(self) -> int:
        if not self.whole_steps:
            return len(self._start)
        probe = self._start.copy()
        count = 0
        while not probe.exhausted():  # one item per step, the current one counted whole
            count += 1
            probe.next_step()
        return count

    def start(self) -> MicroBatchSampler:
        """A copy of the sampler where the next ``iter()`` starts (to count what a consumer was
        given while workers read ahead)."""
        return self._start.copy()

    def state_dict(self) -> dict[str, Any]:
        return self._start.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._start.load_state_dict(state)

    def reweight(self, weights) -> None:
        """Change blend weights from the start position on (call before iterating)."""
        self._start.reweight(weights)

    def skip_steps(self, first: int, stop: int) -> None:
        """Skip the samples of steps ``[first, stop)`` (call before iterating; see
        :meth:`~tokenloom.serve.sampler.MicroBatchSampler.skip_steps`)."""
        self._start.skip_steps(first, stop)

    def quarantine(self, items) -> None:
        """Quarantine ``(store prefix, document id)`` pairs from the start position on (call
        before iterating; see :meth:`~tokenloom.serve.sampler.MicroBatchSampler.quarantine`)."""
        self._start.quarantine(items)


def build_dataloader(source: SampleSource, geometry: BatchGeometry, *, topology: Topology | None = None,
                     rank: int = 0, options: SampleOptions = SampleOptions(), num_workers: int = 0,
                     pin_memory: bool = False, prefetch_factor: int | None = None,
                     persistent_workers: bool = False, max_steps: int | None = None,
                     stateful: bool | None = None, mode: LoadMode | str = LoadMode.EVERY_RANK,
                     whole_steps: bool = False):
    """A DataLoader of this rank's micro-batches (dicts of tensors, only its stage's fields).

    ``stateful=None`` uses torchdata's ``StatefulDataLoader`` when installed (True requires it,
    False gives a plain ``torch.utils.data.DataLoader``; its sampler, ``loader.batch_sampler``,
    still has a state). ``mode`` is EVERY_RANK here: every rank that needs data gets a loader;
    use :class:`DistributedBatches` for tensor rank 0 loading and broadcasting.
    ``whole_steps=True`` makes each item the rest of an optimizer step (``micro x accumulation``
    rows of per-sample fields; :class:`DistributedBatches` slices them back into micro-batches and
    finishes each, ``finish_micro_batch``).
    """
    topology = topology or Topology(dp=geometry.dp)
    check_balance(geometry, options)
    plan = topology.plan(rank, mode, boundaries=options.boundary_fields)
    if not plan.loads:
        raise ConfigError(f"rank {rank} ({plan.coordinates}) loads no data in mode {LoadMode(mode).value}; "
                          "middle pipeline stages and broadcast receivers need no DataLoader")
    dataset = ServeDataset(source, options=options, fields=plan.fields, cp_size=topology.cp,
                           cp_rank=plan.coordinates.cp_rank, per_sample=whole_steps)
    sampler = StatefulBatchSampler(source, geometry, dp_rank=plan.coordinates.dp_rank, max_steps=max_steps,
                                   whole_steps=whole_steps)
    kwargs: dict[str, Any] = dict(batch_sampler=sampler, collate_fn=passthrough_collate, num_workers=num_workers,
                                  pin_memory=pin_memory, persistent_workers=persistent_workers and num_workers > 0)
    if num_workers > 0 and prefetch_factor is not None:
        kwargs["prefetch_factor"] = prefetch_factor
    if stateful is None or stateful:
        try:
            from torchdata.stateful_dataloader import StatefulDataLoader
        except ImportError as exc:
            if stateful:
                raise ConfigError("stateful=True needs torchdata's StatefulDataLoader; install torchdata") from exc
        else:
            return StatefulDataLoader(dataset, **kwargs)
    return torch.utils.data.DataLoader(dataset, **kwargs)


# --------------------------------------------------------------------------- tensor-parallel broadcast


def tensor_parallel_group(topology: Topology, rank: int):
    """Create every tensor-parallel group (collectively: all ranks must call this) and return
    this rank's."""
    mine = None
    for group in topology.tensor_groups():
        created = dist.new_group(list(group))
        if rank in group:
            mine = created
    return mine


def batch_shapes(source: SampleSource, micro_batch_size: int, fields: tuple[str, ...], cp_size: int,
                 options: SampleOptions,
                 seq_length: int | None = None) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shape and torch dtype of every field a rank receives (what a broadcast receiver
    allocates), in the order the pipeline returns them: :func:`~tokenloom.serve.batch.field_schema`
    (``seq_length``: of the micro-batch's samples, where a schedule's phase has its own)."""
    schema = field_schema(source, micro_batch_size, options=options, fields=fields, cp_size=cp_size,
                          seq_length=seq_length)
    return {name: (spec.shape, _torch_dtype(spec.dtype)) for name, spec in schema.items()}


def _torch_dtype(dtype) -> torch.dtype:
    """The torch dtype ``torch.from_numpy`` gives an array of numpy ``dtype``."""
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


class DistributedBatches(RankSchedule):
    """This rank's micro-batches in a torch.distributed job, Megatron style.

    In ``LoadMode.BROADCAST`` tensor rank 0 of the first and last pipeline stages reads (through
    a DataLoader with workers, one item per optimizer step) and broadcasts to its tensor peers
    (``next_batch`` is a collective inside each tensor group); in ``EVERY_RANK`` each reads.
    Middle stages get None. Every rank keeps the same layout-free state. Give a
    :class:`~tokenloom.serve.audit.MixtureAudit` to one rank to log every step.
    """

    def __init__(self, source: SampleSource, geometry: BatchGeometry, topology: Topology, rank: int, *,
                 options: SampleOptions = SampleOptions(), mode: LoadMode | str = LoadMode.BROADCAST,
                 tp_group=None, num_workers: int = 0, pin_memory: bool = False, prefetch_factor: int | None = None,
                 max_steps: int | None = None, device: str | torch.device = "cpu",
                 audit: MixtureAudit | None = None, mixing: OnlineMixing | None = None) -> None:
        super().__init__(source, geometry, topology, rank, options=options, mode=mode, max_steps=max_steps,
                         audit=audit, mixing=mixing)
        self.source, self.geometry = source, geometry
        self.tp_group = tp_group
        self.device = torch.device(device)
        self._loader_kwargs = dict(num_workers=num_workers, pin_memory=pin_memory, prefetch_factor=prefetch_factor)
        self._iterator = None
        self._schema: dict[int, dict[str, tuple[tuple[int, ...], torch.dtype]]] = {}
        """By sequence length: what a broadcast receiver allocates."""
        if self.mode is LoadMode.BROADCAST and topology.tp > 1 and self.plan.fields and tp_group is None:
            raise ConfigError("LoadMode.BROADCAST with tp > 1 needs tp_group (see tensor_parallel_group)")

    def _start_loader(self) -> None:
        loader = build_dataloader(self.source, self.geometry, topology=self.topology, rank=self.plan.coordinates.rank,
                                  options=self.options, stateful=False, mode=LoadMode.EVERY_RANK,
                                  max_steps=self.sampler.max_steps, whole_steps=True, **self._loader_kwargs)
        loader.batch_sampler.load_state_dict(self.sampler.state_dict())
        self._iterator = iter(loader)
        self._pending: list = []

    def _next_loaded(self) -> dict[str, torch.Tensor]:
        """The next micro-batch from the step-sized items the DataLoader delivers."""
        if not self._pending:
            item = next(self._iterator)
            micro = self.geometry.micro_batch_size
            count = item["dataset_id"].shape[0] // micro
            self._pending = [{k: v[m * micro:(m + 1) * micro] for k, v in item.items()} for m in range(count)]
            self._pending.reverse()
        return self._pending.pop()

    def _micro_batch(self, positions: np.ndarray) -> dict[str, torch.Tensor] | None:
        batch = None
        if self.plan.loads:
            if self._iterator is None:
                self._start_loader()  # from the state before this micro-batch
            batch = {k: v.to(self.device, non_blocking=True) for k, v in self._next_loaded().items()}
        if self.mode is LoadMode.BROADCAST and self.topology.tp > 1:
            batch = self._broadcast(batch, positions)
        if batch is None:
            return None
        return finish_micro_batch(batch, self.options, cp_size=self.topology.cp,
                                  cp_rank=self.plan.coordinates.cp_rank)

    def _broadcast(self, batch, positions: np.ndarray):
        # a receiver allocates the micro-batch's shape: its samples' width, known from their
        # positions alone (a schedule's phase may have its own sequence length)
        source = self.sampler.source
        widths = getattr(source, "width_of", None)
        seq_length = source.seq_length if widths is None else \
            widths(self.sampler.stream.locate(positions)[0]) - int(source.add_extra_token)
        schema = self._schema.get(seq_length)
        if schema is None:
            schema = self._schema[seq_length] = batch_shapes(
                self.source, self.geometry.micro_batch_size, self.plan.fields, self.topology.cp, self.options,
                seq_length=seq_length)
        source_rank = self.plan.tensor_group[0]
        out = {}
        for name, (shape, dtype) in schema.items():
            # gloo has no bool or int16 broadcast: send those as int64 / uint8
            wire = (torch.uint8 if dtype == torch.bool
                    else torch.int64 if dtype in (torch.int16, torch.int32) else dtype)
            if batch is not None:
                tensor = batch[name].to(wire).contiguous()
            else:
                tensor = torch.empty(shape, dtype=wire, device=self.device)
            dist.broadcast(tensor, src=source_rank, group=self.tp_group)
            out[name] = tensor.to(dtype)
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume (on any layout, between steps); the DataLoader restarts from there."""
        self._iterator = None
        super().load_state_dict(state)

    def report(self, tokens, loss_sums) -> bool:
        """As :meth:`RankSchedule.report`; when the weights change, the DataLoader restarts after
        what it read ahead (its workers read the old stream)."""
        changed = super().report(tokens, loss_sums)
        if changed:
            self._iterator = None
        return changed

    def skip_steps(self, first: int, stop: int) -> None:
        """As :meth:`RankSchedule.skip_steps`; the DataLoader restarts after what it read ahead."""
        super().skip_steps(first, stop)
        self._iterator = None

    def quarantine(self, items) -> None:
        """As :meth:`RankSchedule.quarantine`; the DataLoader restarts after what it read ahead."""
        super().quarantine(items)
        self._iterator = None


__all__ = ["DistributedBatches", "PackedBatch", "ServeDataset", "StatefulBatchSampler", "build_dataloader",
           "passthrough_collate", "tensor_parallel_group"]
