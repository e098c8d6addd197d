"""What the planner is asked about: the model, the cluster, the training run, and the options.

Field names follow Megatron-LM's argument names where one exists (``num_layers``,
``hidden_size``, ``num_query_groups``, ``ffn_hidden_size``, ``seq_length``,
``global_batch_size``, ``train_iters``), so a plan reads like the launch script it produces.
Every dataclass is frozen and keyword-only and validates itself in ``__post_init__``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tokenloom.errors import ConfigError
from tokenloom.validate import is_integer, is_number

#: Activation recomputation choices (Korthikanti et al. 2022): keep everything, recompute only
#: the attention core (softmax and its dropout), or keep only each layer's input.
RECOMPUTE_CHOICES = ("none", "selective", "full")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
POSITION_EMBEDDINGS = ("learned_absolute", "rope")


def _positive_int(owner: str, name: str, value: object) -> None:
    if not is_integer(value) or value < 1:
        raise ConfigError(f"{owner}.{name} must be a positive integer, got {value!r}")


def _positive_number(owner: str, name: str, value: object) -> None:
    if not is_number(value) or not value > 0:
        raise ConfigError(f"{owner}.{name} must be a positive number, got {value!r}")


def _choice(owner: str, name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{owner}.{name} must be one of {list(choices)}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A decoder-only transformer, described the way Megatron-LM describes it."""

    num_layers: int
    """Transformer layers, ``l`` in the papers."""
    hidden_size: int
    """Model width, ``h``."""
    num_attention_heads: int
    """Query heads, ``a``."""
    vocab_size: int
    """Vocabulary size, ``V`` (unpadded; the formulas use it as given)."""
    seq_length: int
    """Training sequence length in tokens, ``s``."""
    num_query_groups: int | None = None
    """Key/value heads for grouped-query attention; ``None`` means one per query head (MHA)."""
    ffn_hidden_size: int | None = None
    """MLP inner width; ``None`` means ``4 * hidden_size`` as in GPT."""
    kv_channels: int | None = None
    """Width of one attention head; ``None`` means ``hidden_size // num_attention_heads``."""
    gated_linear_unit: bool = False
    """True for SwiGLU-style MLPs (three weight matrices instead of two)."""
    add_bias_linear: bool = True
    """Whether the linear layers carry biases (GPT: yes, LLaMA: no)."""
    normalization: str = "LayerNorm"
    """``"LayerNorm"`` (weight and bias) or ``"RMSNorm"`` (weight only)."""
    position_embedding_type: str = "learned_absolute"
    """``"learned_absolute"`` (an ``s x h`` table) or ``"rope"`` (no parameters)."""
    untie_embeddings_and_output_weights: bool = False
    """True when the output layer has its own ``V x h`` matrix (LLaMA); GPT ties them."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length"):
            _positive_int("ModelSpec", name, getattr(self, name))
        for name in ("num_query_groups", "ffn_hidden_size", "kv_channels"):
            if getattr(self, name) is not None:
                _positive_int("ModelSpec", name, getattr(self, name))
        _choice("ModelSpec", "normalization", self.normalization, NORMALIZATIONS)
        _choice("ModelSpec", "position_embedding_type", self.position_embedding_type, POSITION_EMBEDDINGS)
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"ModelSpec.hidden_size={self.hidden_size} is not divisible by "
                f"num_attention_heads={self.num_attention_heads}; pick a head count that divides "
                "the width, or give kv_channels explicitly"
            )
        if self.num_attention_heads % self.query_groups:
            raise ConfigError(
                f"ModelSpec.num_attention_heads={self.num_attention_heads} is not divisible by "
                f"num_query_groups={self.query_groups}; each key/value head must serve a whole "
                "number of query heads"
            )

    @property
    def head_dim(self) -> int:
        """Width of one attention head (``kv_channels``)."""
        return self.kv_channels if self.kv_channels is not None else self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        """Number of key/value heads (equals the query heads without grouped-query attention)."""
        return self.num_query_groups if self.num_query_groups is not None else self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        """MLP inner width with the GPT default filled in."""
        return self.ffn_hidden_size if self.ffn_hidden_size is not None else 4 * self.hidden_size

    @property
    def is_gpt_shaped(self) -> bool:
        """True when the closed-form GPT formulas of Narayanan et al. apply exactly."""
        return (
            self.num_query_groups in (None, self.num_attention_heads)
            and self.ffn_size == 4 * self.hidden_size
            and self.head_dim * self.num_attention_heads == self.hidden_size
            and not self.gated_linear_unit
            and self.add_bias_linear
            and self.normalization == "LayerNorm"
            and self.position_embedding_type == "learned_absolute"
            and not self.untie_embeddings_and_output_weights
        )


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    """The GPUs a run gets. Defaults describe a DGX A100 80 GB node with InfiniBand HDR."""

    num_gpus: int
    """GPUs in the job, ``n``."""
    gpus_per_node: int = 8
    """GPUs that share a fast intra-node interconnect (NVLink); tensor parallelism stays inside."""
    memory_per_gpu_gib: float = 80.0
    """Device memory of one GPU in GiB (2**30 bytes)."""
    peak_tflops: float = 312.0
    """Dense half-precision peak per GPU in TFLOP/s (A100: 312, H100 SXM: 989)."""
    achieved_tflops: float = 140.0
    """Sustained per-GPU throughput in TFLOP/s, ``X`` in 8TP/(nX); Megatron-LM reached 138-163 on A100."""
    intra_node_bandwidth_gbps: float = 300.0
    """Per-GPU one-way bandwidth inside a node in GB/s (A100 NVLink: 300), used for TP traffic."""
    inter_node_bandwidth_gbps: float = 25.0
    """Per-GPU one-way network bandwidth across nodes in GB/s (one 200 Gb/s HCA per GPU: 25)."""

    def __post_init__(self) -> None:
        _positive_int("ClusterSpec", "num_gpus", self.num_gpus)
        _positive_int("ClusterSpec", "gpus_per_node", self.gpus_per_node)
        for name in ("memory_per_gpu_gib", "peak_tflops", "achieved_tflops",
                     "intra_node_bandwidth_gbps", "inter_node_bandwidth_gbps"):
            _positive_number("ClusterSpec", name, getattr(self, name))
        if self.num_gpus > self.gpus_per_node and self.num_gpus % self.gpus_per_node:
            raise ConfigError(
                f"ClusterSpec.num_gpus={self.num_gpus} is not a multiple of gpus_per_node="
                f"{self.gpus_per_node}; a multi-node job uses whole nodes"
            )
        if self.achieved_tflops > self.peak_tflops:
            raise ConfigError(
                f"ClusterSpec.achieved_tflops={self.achieved_tflops} exceeds peak_tflops="
                f"{self.peak_tflops}; the sustained rate cannot beat the hardware peak"
            )

    @property
    def gpus_in_a_node(self) -> int:
        """GPUs reachable over the intra-node link (fewer than a node for a small job)."""
        return min(self.num_gpus, self.gpus_per_node)


@dataclass(frozen=True, kw_only=True)
class TrainingSpec:
    """How much data a run consumes. Give the batch in samples or tokens, the length in tokens or iterations."""

    global_batch_size: int | None = None
    """Sequences per optimizer step (Megatron's ``global_batch_size``)."""
    global_batch_tokens: int | None = None
    """Alternatively, tokens per optimizer step; must be a multiple of the sequence length."""
    train_tokens: int | None = None
    """Total training tokens ``T``; iterations are rounded up to whole steps."""
    train_iters: int | None = None
    """Alternatively, the number of optimizer steps."""
    eval_interval: int = 1000
    """Steps between validation runs (Megatron's default, 1000)."""
    eval_iters: int = 100
    """Batches per validation run and for the final test run (Megatron's default, 100)."""

    def __post_init__(self) -> None:
        if (self.global_batch_size is None) == (self.global_batch_tokens is None):
            raise ConfigError(
                "TrainingSpec needs exactly one of global_batch_size (sequences) or "
                f"global_batch_tokens, got global_batch_size={self.global_batch_size!r} and "
                f"global_batch_tokens={self.global_batch_tokens!r}"
            )
        if (self.train_tokens is None) == (self.train_iters is None):
            raise ConfigError(
                "TrainingSpec needs exactly one of train_tokens or train_iters, got "
                f"train_tokens={self.train_tokens!r} and train_iters={self.train_iters!r}"
            )
        for name in ("global_batch_size", "global_batch_tokens", "train_tokens", "train_iters"):
            value = getattr(self, name)
            if isinstance(value, float) and value.is_integer() and name.endswith("tokens"):
                value = int(value)  # token counts are written 300e9 as often as 300_000_000_000
            if value is not None:
                _positive_int("TrainingSpec", name, value)
                object.__setattr__(self, name, int(value))
        _positive_int("TrainingSpec", "eval_interval", self.eval_interval)
        if not is_integer(self.eval_iters) or self.eval_iters < 0:
            raise ConfigError(f"TrainingSpec.eval_iters must be a non-negative integer, got {self.eval_iters!r}")

    def batch_samples(self, seq_length: int) -> int:
        """The global batch in sequences of ``seq_length`` tokens."""
        if self.global_batch_tokens is None:
            return int(self.global_batch_size)  # type: ignore[arg-type]  # one of the two is set
        if self.global_batch_tokens % seq_length:
            raise ConfigError(
                f"TrainingSpec.global_batch_tokens={self.global_batch_tokens} is not a multiple of "
                f"the sequence length {seq_length}; use {self.global_batch_tokens // seq_length * seq_length} "
                f"or {(self.global_batch_tokens // seq_length + 1) * seq_length}"
            )
        return self.global_batch_tokens // seq_length

    def iterations(self, seq_length: int) -> int:
        """Optimizer steps: given, or ``ceil(T / (B s))``."""
        if self.train_tokens is None:
            return int(self.train_iters)  # type: ignore[arg-type]  # one of the two is set
        tokens_per_step = self.batch_samples(seq_length) * seq_length
        return -(-self.train_tokens // tokens_per_step)


@dataclass(frozen=True, kw_only=True)
class PlanOptions:
    """Choices that shape memory and the search. ``None`` on a parallel size means "search it"."""

    recompute_choices: ClassVar[tuple[str, ...]] = RECOMPUTE_CHOICES
    """The values ``recompute`` takes (the CLI's ``--recompute`` choices)."""

    recompute: str = "selective"
    """Activation recomputation: ``"none"``, ``"selective"`` (attention core) or ``"full"`` (layer input only)."""
    sequence_parallel: bool = True
    """Shard the activations TP leaves replicated (Korthikanti et al.); Megatron's recommended setting."""
    zero_stage: int = 0
    """Shard over data parallel: 1 optimizer states (= Megatron's distributed optimizer), 2 + gradients, 3 + weights."""
    gradient_bytes: int = 2
    """Bytes per gradient: 2 as in the 2 + 2 + 12 accounting; Megatron keeps fp32 main grads (4, i.e. 18 bytes)."""
    tensor_parallel: int | None = None
    """Pin the tensor-parallel size ``t``; ``None`` searches divisors within a node."""
    pipeline_parallel: int | None = None
    """Pin the pipeline-parallel size ``p``; ``None`` searches divisors of the layer count."""
    virtual_pipeline: int | None = None
    """Pin the interleaving factor ``v`` (1 = plain 1F1B); ``None`` searches it."""
    micro_batch_size: int | None = None
    """Pin the micro-batch size ``b``; ``None`` searches divisors of the per-replica batch."""
    max_micro_batch_size: int = 16
    """Largest micro-batch the search tries."""
    max_virtual_pipeline: int = 8
    """Largest interleaving factor the search tries."""
    overlap_grad_reduce: bool = False
    """Count data-parallel gradient traffic as hidden behind the backward pass (Megatron opt-in flag)."""
    memory_reserve_gib: float = 2.0
    """Memory per GPU kept free for the CUDA context, NCCL buffers and allocator fragmentation."""

    def __post_init__(self) -> None:
        _choice("PlanOptions", "recompute", self.recompute, RECOMPUTE_CHOICES)
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"PlanOptions.zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        if self.gradient_bytes not in (2, 4):
            raise ConfigError(f"PlanOptions.gradient_bytes must be 2 or 4, got {self.gradient_bytes!r}")
        for name in ("tensor_parallel", "pipeline_parallel", "virtual_pipeline", "micro_batch_size"):
            if getattr(self, name) is not None:
                _positive_int("PlanOptions", name, getattr(self, name))
        _positive_int("PlanOptions", "max_micro_batch_size", self.max_micro_batch_size)
        _positive_int("PlanOptions", "max_virtual_pipeline", self.max_virtual_pipeline)
        if (
            isinstance(self.memory_reserve_gib, bool)
            or not isinstance(self.memory_reserve_gib, (int, float))
            or self.memory_reserve_gib < 0
        ):
            raise ConfigError(f"PlanOptions.memory_reserve_gib must be >= 0, got {self.memory_reserve_gib!r}")


__all__ = ["RECOMPUTE_CHOICES", "ClusterSpec", "ModelSpec", "PlanOptions", "TrainingSpec"]
