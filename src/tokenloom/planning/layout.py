"""One candidate layout: its memory per GPU and its estimated time per iteration.

The time model is deliberately simple and every term is reported, so a ranking can be checked:

* ``compute_s = F / (n X)`` - the FLOPs of one iteration (:func:`~tokenloom.planning.formulas.flops_per_iteration`)
  at the achieved rate ``X`` on all ``n`` GPUs (Narayanan 2021, eq. 4, per iteration);
* ``bubble_s = compute_s x (p - 1)/(v m)`` - pipeline idle time (Narayanan 2021, section 2.2);
* ``tp_comm_s`` - per layer and micro-batch, 4 all-reduces (6 with full recomputation) of the
  ``2 s b h``-byte activation, ring cost ``2 (t - 1)/t x bytes / bandwidth`` (Narayanan 2021,
  section 3.2; sequence parallelism moves the same bytes as reduce-scatter + all-gather);
* ``pp_comm_s`` - per micro-batch and virtual stage, one ``2 s b h / t``-byte send each way
  (scatter/gather optimisation, Narayanan 2021, section 4.1);
* ``dp_comm_s`` - the gradient all-reduce (or reduce-scatter + all-gather under ZeRO-1/2, the same
  bytes; 1.5x under ZeRO-3) of this GPU's parameters, ``2 (d - 1)/d x bytes / bandwidth``; zero when
  ``overlap_grad_reduce`` hides it behind the backward pass.

Ranks are placed in Megatron-core's default order ``tp-cp-ep-dp-pp`` (TP fastest): a TP group is
``t`` consecutive ranks, a DP group spans ``t d`` ranks, a pipeline spans all ``n``. A group uses
the intra-node bandwidth when it fits in one node, the network otherwise; a DP group spanning nodes
has ``node / t`` members per node whose network cards work in parallel (NCCL reduces inside the node
first), so it gets ``min(intra, node / t x inter)``. Communication is counted
as exposed (not overlapped with compute), so absolute times are pessimistic; the ranking is the point.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenloom.errors import ConfigError
from tokenloom.planning import formulas
from tokenloom.planning.specs import ClusterSpec, ModelSpec, PlanOptions

GIB = 2**30
_ACTIVATION_BYTES = 2  # half-precision activations exchanged between GPUs


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Bytes one GPU of the most loaded pipeline stage needs."""

    weights_bytes: float
    """Half-precision weights of this GPU's shard (ZeRO-3 divides by ``d``)."""
    gradients_bytes: float
    """Gradients of the shard (ZeRO-2 and up divide by ``d``)."""
    optimizer_bytes: float
    """fp32 master weights, momentum and variance (ZeRO-1 / distributed optimizer and up divide by ``d``)."""
    activations_bytes: float
    """Peak activations of the first pipeline stage (Korthikanti 2022)."""
    reserve_bytes: float
    """Memory kept free for the CUDA context, communication buffers and fragmentation."""

    @property
    def total_bytes(self) -> float:
        """Everything above: what must fit in one GPU."""
        return (self.weights_bytes + self.gradients_bytes + self.optimizer_bytes
                + self.activations_bytes + self.reserve_bytes)

    @property
    def total_gib(self) -> float:
        """:attr:`total_bytes` in GiB."""
        return self.total_bytes / GIB


@dataclass(frozen=True, kw_only=True)
class Layout:
    """A 3D-parallel layout and what it costs. ``t x p x d`` equals the GPU count."""

    tensor_parallel: int
    """Tensor-parallel size ``t`` (inside a node)."""
    pipeline_parallel: int
    """Pipeline stages ``p``."""
    data_parallel: int
    """Model replicas ``d = n / (t p)``."""
    virtual_pipeline: int
    """Model chunks per pipeline stage ``v`` (1 = plain 1F1B, more = interleaved schedule)."""
    micro_batch_size: int
    """Sequences per micro-batch ``b``."""
    num_microbatches: int
    """Micro-batches per replica per iteration ``m = B / (b d)``, i.e. gradient accumulation steps."""
    memory: MemoryEstimate
    """Bytes per GPU."""
    memory_per_gpu_bytes: float
    """The GPU's memory, to compare against."""
    bubble_fraction: float
    """Pipeline idle time over compute time, ``(p - 1)/(v m)``."""
    compute_s: float
    """Seconds of computation per iteration at the achieved rate, ``F / (n X)``."""
    bubble_s: float
    """Seconds idle in the pipeline bubble."""
    tp_comm_s: float
    """Seconds of tensor-parallel collectives."""
    pp_comm_s: float
    """Seconds of pipeline sends and receives."""
    dp_comm_s: float
    """Seconds of exposed data-parallel gradient traffic."""

    @property
    def fits(self) -> bool:
        """Whether the memory estimate fits in one GPU."""
        return self.memory.total_bytes <= self.memory_per_gpu_bytes

    @property
    def model_parallel(self) -> int:
        """GPUs that hold one copy of the model, ``t p``."""
        return self.tensor_parallel * self.pipeline_parallel

    @property
    def iteration_s(self) -> float:
        """Estimated seconds per iteration: compute + bubble + exposed communication."""
        return self.compute_s + self.bubble_s + self.tp_comm_s + self.pp_comm_s + self.dp_comm_s

    @property
    def overheads(self) -> dict[str, float]:
        """Each non-compute term as a fraction of compute time, for explaining a ranking."""
        return {
            "bubble": self.bubble_s / self.compute_s,
            "tp_comm": self.tp_comm_s / self.compute_s,
            "pp_comm": self.pp_comm_s / self.compute_s,
            "dp_comm": self.dp_comm_s / self.compute_s,
        }

    def rank_key(self) -> tuple[float, int, int, int, int]:
        """Sort key: fastest first; ties go to less model parallelism (Narayanan 2021, takeaway 2),
        fewer stages, fewer chunks, larger micro-batches."""
        return (round(self.iteration_s, 9), self.model_parallel, self.pipeline_parallel,
                self.virtual_pipeline, -self.micro_batch_size)

    def label(self) -> str:
        """``tp=8 pp=64 dp=6 vpp=1 mbs=1 accum=512``."""
        return (f"tp={self.tensor_parallel} pp={self.pipeline_parallel} dp={self.data_parallel} "
                f"vpp={self.virtual_pipeline} mbs={self.micro_batch_size} accum={self.num_microbatches}")

    def to_dict(self) -> dict[str, object]:
        """JSON-ready view, with derived totals included."""
        return {
            "tensor_model_parallel_size": self.tensor_parallel,
            "pipeline_model_parallel_size": self.pipeline_parallel,
            "data_parallel_size": self.data_parallel,
            "virtual_pipeline_model_parallel_size": self.virtual_pipeline,
            "micro_batch_size": self.micro_batch_size,
            "num_microbatches": self.num_microbatches,
            "fits": self.fits,
            "memory_gib": {
                "weights": self.memory.weights_bytes / GIB,
                "gradients": self.memory.gradients_bytes / GIB,
                "optimizer": self.memory.optimizer_bytes / GIB,
                "activations": self.memory.activations_bytes / GIB,
                "reserve": self.memory.reserve_bytes / GIB,
                "total": self.memory.total_gib,
                "gpu": self.memory_per_gpu_bytes / GIB,
            },
            "bubble_fraction": self.bubble_fraction,
            "time_s": {
                "compute": self.compute_s, "bubble": self.bubble_s, "tp_comm": self.tp_comm_s,
                "pp_comm": self.pp_comm_s, "dp_comm": self.dp_comm_s, "iteration": self.iteration_s,
            },
        }


def _ring_seconds(num_bytes: float, group: int, bandwidth_gbps: float) -> float:
    """Ring all-reduce cost per GPU: ``2 (g - 1)/g x bytes / bandwidth``."""
    if group == 1:
        return 0.0
    return 2 * (group - 1) / group * num_bytes / (bandwidth_gbps * 1e9)


def evaluate_layout(
    model: ModelSpec, cluster: ClusterSpec, options: PlanOptions, *, global_batch_size: int,
    tensor_parallel: int, pipeline_parallel: int, virtual_pipeline: int, micro_batch_size: int,
) -> Layout:
    """Cost of one layout; raises :class:`ConfigError` when the sizes do not divide as Megatron needs."""
    t, p, v, b = tensor_parallel, pipeline_parallel, virtual_pipeline, micro_batch_size
    n = cluster.num_gpus
    if min(t, p, v, b) < 1 or n % (t * p):
        raise ConfigError(f"tensor x pipeline = {t} x {p} must be positive and divide the {n} GPUs")
    if cluster.gpus_in_a_node % t:
        raise ConfigError(f"tensor-parallel size {t} must divide the {cluster.gpus_in_a_node} GPUs of a node")
    if model.num_layers % (p * v):
        raise ConfigError(f"num_layers={model.num_layers} is not divisible by pipeline x virtual = {p} x {v}")
    d = n // (t * p)
    if global_batch_size % (b * d):
        raise ConfigError(f"global batch size {global_batch_size} is not divisible by micro-batch {b} x "
                          f"data-parallel size {d} = {b * d}")
    m = global_batch_size // (b * d)

    stage_params = formulas.stage_parameter_count(model, tensor_parallel=t, pipeline_parallel=p)
    weights, grads, optim = formulas.model_state_breakdown(
        stage_params, zero_stage=options.zero_stage, data_parallel=d, gradient_bytes=options.gradient_bytes)
    activations = formulas.activation_bytes(
        model, micro_batch_size=b, tensor_parallel=t, pipeline_parallel=p, virtual_pipeline=v,
        num_microbatches=m, sequence_parallel=options.sequence_parallel, recompute=options.recompute)
    memory = MemoryEstimate(weights_bytes=weights, gradients_bytes=grads, optimizer_bytes=optim,
                            activations_bytes=activations, reserve_bytes=options.memory_reserve_gib * GIB)

    flops = formulas.flops_per_iteration(model, batch_size=global_batch_size, recompute=options.recompute)
    compute_s = flops / (cluster.num_gpus * cluster.achieved_tflops * 1e12)
    bubble = formulas.pipeline_bubble_fraction(pipeline_parallel=p, num_microbatches=m, virtual_pipeline=v)

    node = cluster.gpus_per_node
    intra, inter = cluster.intra_node_bandwidth_gbps, cluster.inter_node_bandwidth_gbps
    activation_msg = _ACTIVATION_BYTES * model.seq_length * b * model.hidden_size  # one micro-batch, full h
    collectives_per_layer = 6 if options.recompute == "full" else 4
    # The search keeps TP inside a node, so TP traffic always rides the intra-node link.
    tp_comm_s = (model.num_layers / p) * m * collectives_per_layer * _ring_seconds(activation_msg, t, intra)
    pp_bw = intra if cluster.num_gpus <= node else inter
    pp_comm_s = 0.0 if p == 1 else v * m * 2 * (activation_msg / t) / (pp_bw * 1e9)
    # A DP group spanning nodes has node/t members on each; NCCL reduces inside the node first and
    # drives those members' network cards in parallel.
    dp_bw = intra if t * d <= node else min(intra, inter * max(1, node // t))
    zero3 = 1.5 if options.zero_stage >= 3 else 1.0
    dp_comm_s = 0.0 if options.overlap_grad_reduce else (
        zero3 * _ring_seconds(stage_params * options.gradient_bytes, d, dp_bw))

    return Layout(
        tensor_parallel=t, pipeline_parallel=p, data_parallel=d, virtual_pipeline=v, micro_batch_size=b,
        num_microbatches=m, memory=memory, memory_per_gpu_bytes=cluster.memory_per_gpu_gib * GIB,
        bubble_fraction=bubble, compute_s=compute_s, bubble_s=compute_s * bubble, tp_comm_s=tp_comm_s,
        pp_comm_s=pp_comm_s, dp_comm_s=dp_comm_s,
    )


__all__ = ["GIB", "Layout", "MemoryEstimate", "evaluate_layout"]
