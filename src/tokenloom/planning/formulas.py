"""The published formulas the planner is built on, one pure function each.

Sources, cited by short name in every docstring:

* **Narayanan 2021** - Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
  Clusters Using Megatron-LM", SC'21: parameter count (eq. 2), FLOPs per iteration (eq. 3),
  training time ~ 8TP/(nX) (eq. 4), pipeline bubble (p-1)/m and (p-1)/(vm) (sections 2.2.1-2.2.2).
* **Korthikanti 2022** - Korthikanti et al., "Reducing Activation Recomputation in Large
  Transformer Models": activation bytes per layer s b h (34 + 5 a s/h), their split under tensor and
  sequence parallelism, selective and full recomputation (Table 2), and the memory of the first
  pipeline stage (section 4.2.3, including the interleaving factor 1 + (p-1)/(pv)).
* **ZeRO** - Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
  Models", SC'20: mixed-precision Adam holds 2 + 2 + 12 bytes per parameter; stages 1/2/3 shard
  optimizer states / gradients / weights over data parallel (section 5, Figure 1).

Sizes are in bytes, FLOPs are floating-point operations (a multiply-add counts as two).
"""

from __future__ import annotations

from tokenloom.errors import ConfigError
from tokenloom.planning.specs import RECOMPUTE_CHOICES, ModelSpec

SECONDS_PER_DAY = 86400.0
#: Bytes per parameter of the half-precision weights and of Adam's fp32 master weights, momentum
#: and variance (ZeRO, section 3.1: "2 + 2 + 12").
WEIGHT_BYTES = 2
OPTIMIZER_BYTES = 12


# ---------------------------------------------------------------------------------- parameters

def gpt_parameter_count(*, num_layers: int, hidden_size: int, vocab_size: int, seq_length: int) -> float:
    """Narayanan 2021, eq. 2: ``P = 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h))``.

    Exact for a GPT with biases, LayerNorm, learned positions and tied embeddings, except that it
    leaves out the final LayerNorm (``2h``); :func:`parameter_count` includes it.
    """
    l, h, V, s = num_layers, hidden_size, vocab_size, seq_length
    return 12 * l * h**2 * (1 + 13 / (12 * h) + (V + s) / (12 * l * h))


def layer_parameter_count(model: ModelSpec) -> int:
    """Parameters of one transformer layer, counted matrix by matrix as Megatron-core builds it.

    Attention: QKV ``h x (q + 2 kv)`` and output ``q x h`` with ``q = a d``, ``kv = g d`` for ``g``
    key/value heads of width ``d``; MLP: ``h x f`` up (twice when gated) and ``f x h`` down;
    two norms of ``h`` (RMSNorm) or ``2h`` (LayerNorm). With GPT's shape this is ``12h^2 + 13h``.
    """
    h, f = model.hidden_size, model.ffn_size
    q = model.num_attention_heads * model.head_dim  # query projection width
    kv = model.query_groups * model.head_dim  # key (and value) projection width
    up = 2 * f if model.gated_linear_unit else f
    weights = h * (q + 2 * kv) + q * h + h * up + f * h
    biases = (q + 2 * kv) + h + up + h if model.add_bias_linear else 0
    norms = 2 * _norm_size(model)
    return weights + biases + norms


def parameter_count(model: ModelSpec) -> int:
    """All parameters: layers, final norm, word (and learned position) embeddings, untied output."""
    h = model.hidden_size
    embeddings = model.vocab_size * h
    if model.position_embedding_type == "learned_absolute":
        embeddings += model.seq_length * h
    output = model.vocab_size * h if model.untie_embeddings_and_output_weights else 0
    return model.num_layers * layer_parameter_count(model) + _norm_size(model) + embeddings + output


def stage_parameter_counts(model: ModelSpec, *, tensor_parallel: int, pipeline_parallel: int) -> tuple[float, float]:
    """Parameters one GPU holds on the (first, last) pipeline stage, sharded as Megatron-core shards them.

    Split ``t`` ways: QKV and fc1 weights and biases, the projection and fc2 weights, the word
    embedding and the output layer. Replicated: norms, the projection and fc2 biases, the position
    table. The first stage holds ``l/p`` layers, the word embedding and the position table; the last
    holds ``l/p`` layers, the final norm and an output matrix (a copy of the embedding when weights
    are tied and ``p > 1``). With ``p = 1`` both are the single stage holding everything. Checked
    against megatron-core's ``GPTModel`` on real tensor- and pipeline-parallel ranks in the tests.
    """
    t, p, h = tensor_parallel, pipeline_parallel, model.hidden_size
    f = model.ffn_size
    q = model.num_attention_heads * model.head_dim
    kv = model.query_groups * model.head_dim
    up = 2 * f if model.gated_linear_unit else f
    split = h * (q + 2 * kv) + q * h + h * up + f * h
    replicated = 2 * _norm_size(model)
    if model.add_bias_linear:
        split += (q + 2 * kv) + up
        replicated += 2 * h
    layers = model.num_layers / p * (split / t + replicated)
    word = model.vocab_size * h / t
    position = model.seq_length * h if model.position_embedding_type == "learned_absolute" else 0
    first = layers + word + position
    last = layers + _norm_size(model) + word
    if p == 1:
        single = first + _norm_size(model) + (word if model.untie_embeddings_and_output_weights else 0)
        return single, single
    return first, last


def stage_parameter_count(model: ModelSpec, *, tensor_parallel: int, pipeline_parallel: int) -> float:
    """Parameters on one GPU of the most loaded pipeline stage (see :func:`stage_parameter_counts`)."""
    return max(stage_parameter_counts(model, tensor_parallel=tensor_parallel, pipeline_parallel=pipeline_parallel))


def _norm_size(model: ModelSpec) -> int:
    return model.hidden_size * (2 if model.normalization == "LayerNorm" else 1)


# ---------------------------------------------------------------------------------- model state

def model_state_bytes_per_parameter(*, zero_stage: int = 0, data_parallel: int = 1, gradient_bytes: int = 2) -> float:
    """ZeRO, section 5: bytes each parameter costs one GPU under mixed-precision Adam.

    Unsharded ``2 + 2 + 12 = 16``; stage 1 (Megatron's distributed optimizer) ``2 + 2 + 12/d``;
    stage 2 ``2 + (2 + 12)/d``; stage 3 ``(2 + 2 + 12)/d``.
    """
    weights, grads, optim = model_state_breakdown(1.0, zero_stage=zero_stage, data_parallel=data_parallel,
                                                  gradient_bytes=gradient_bytes)
    return weights + grads + optim


def model_state_breakdown(
    num_parameters: float, *, zero_stage: int = 0, data_parallel: int = 1, gradient_bytes: int = 2
) -> tuple[float, float, float]:
    """(weight, gradient, optimizer) bytes for ``num_parameters`` on one GPU (ZeRO, section 5)."""
    d = data_parallel
    weights = num_parameters * WEIGHT_BYTES / (d if zero_stage >= 3 else 1)
    grads = num_parameters * gradient_bytes / (d if zero_stage >= 2 else 1)
    optim = num_parameters * OPTIMIZER_BYTES / (d if zero_stage >= 1 else 1)
    return weights, grads, optim


def model_state_bytes(num_parameters: float, **kwargs: int) -> float:
    """Total weight + gradient + optimizer bytes; ``16 P`` without sharding (ZeRO, section 3.1)."""
    return sum(model_state_breakdown(num_parameters, **kwargs))


# ---------------------------------------------------------------------------------- activations

def activation_bytes_per_layer(
    model: ModelSpec, *, micro_batch_size: int, tensor_parallel: int = 1,
    sequence_parallel: bool = True, recompute: str = "none",
) -> float:
    """Korthikanti 2022, Table 2: activation bytes one layer keeps for one micro-batch, per GPU.

    For GPT's shape: ``s b h (34 + 5 a s/h)`` without parallelism; ``s b h (10 + 24/t + 5as/(ht))``
    with tensor parallelism; ``s b h (34 + 5as/h) / t`` with sequence parallelism too; selective
    recomputation drops the ``5 a s^2 b`` attention-score term; full recomputation keeps only the
    layer input, ``2 s b h`` (``/ t`` with sequence parallelism).

    The ``34`` is generalised term by term (section 4.1): LayerNorms ``4``, attention ``3 + 4q/h + 4kv/h``
    (input, Q, K, V, projection input, dropout mask), MLP ``3 + 4f/h`` (``3 + 6f/h`` gated). Of these,
    ``10`` (norm inputs, dropout masks, inputs to QKV and fc1) stay replicated under plain TP.
    """
    s, b, h, t = model.seq_length, micro_batch_size, model.hidden_size, tensor_parallel
    q = model.num_attention_heads * model.head_dim
    kv = model.query_groups * model.head_dim
    f = model.ffn_size
    mlp = 3 + (6 if model.gated_linear_unit else 4) * f / h
    linear_coeff = 4 + (3 + 4 * q / h + 4 * kv / h) + mlp  # 34 for GPT
    scores = 5 * model.num_attention_heads * s / h  # 5as/h: softmax output, its dropout mask and output
    if recompute == "full":
        return 2 * s * b * h / (t if sequence_parallel else 1)
    if recompute == "selective":
        scores = 0.0
    elif recompute != "none":
        raise ConfigError(f"recompute must be one of {list(RECOMPUTE_CHOICES)}, got {recompute!r}")
    if sequence_parallel:
        return s * b * h * (linear_coeff + scores) / t
    return s * b * h * (10 + (linear_coeff - 10) / t + scores / t)


def pipeline_in_flight_factor(*, pipeline_parallel: int, virtual_pipeline: int, num_microbatches: int) -> float:
    """Micro-batches whose activations the first stage holds at once (Korthikanti 2022, section 4.2.3).

    1F1B: ``min(p, m)``. Interleaved: ``p (1 + (p - 1)/(p v))``.
    """
    p, v, m = pipeline_parallel, virtual_pipeline, num_microbatches
    if v > 1:
        return p * (1 + (p - 1) / (p * v))
    return float(min(p, m))


def activation_bytes(
    model: ModelSpec, *, micro_batch_size: int, tensor_parallel: int, pipeline_parallel: int,
    virtual_pipeline: int, num_microbatches: int, sequence_parallel: bool, recompute: str,
) -> float:
    """Peak activation bytes on a GPU of the first pipeline stage (Korthikanti 2022, section 4.2.3).

    ``l/p`` layers times the micro-batches in flight, plus the embedding's dropout mask for each of
    them, plus with ``p = 1`` the output layer and loss, ``4 s b h (1 + V/h)``, all split ``t`` ways.
    Under full recomputation one layer is rebuilt at a time during the backward pass, so one layer's
    unrecomputed activations are added once.
    """
    s, b, h, t = model.seq_length, micro_batch_size, model.hidden_size, tensor_parallel
    in_flight = pipeline_in_flight_factor(pipeline_parallel=pipeline_parallel, virtual_pipeline=virtual_pipeline,
                                          num_microbatches=num_microbatches)
    per_layer = activation_bytes_per_layer(model, micro_batch_size=b, tensor_parallel=t,
                                           sequence_parallel=sequence_parallel, recompute=recompute)
    total = per_layer * model.num_layers / pipeline_parallel * in_flight
    total += s * b * h * in_flight / t  # embedding dropout mask, one byte per element
    if pipeline_parallel == 1:
        total += 4 * s * b * h * (1 + model.vocab_size / h) / t  # output layer input, logits, loss
    if recompute == "full":
        total += activation_bytes_per_layer(model, micro_batch_size=b, tensor_parallel=t,
                                            sequence_parallel=sequence_parallel, recompute="none")
    return total


# ---------------------------------------------------------------------------------- FLOPs and time

def gpt_flops_per_iteration(*, batch_size: int, seq_length: int, num_layers: int, hidden_size: int,
                            vocab_size: int) -> float:
    """Narayanan 2021, eq. 3: ``F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h))``.

    Counts forward, backward and the full-recomputation forward of every layer (4 passes) and the
    logit layer's forward and backward (3 passes).
    """
    B, s, l, h, V = batch_size, seq_length, num_layers, hidden_size, vocab_size
    return 96 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))


def forward_flops_per_sequence(model: ModelSpec) -> tuple[float, float, float]:
    """(one layer, its attention core, the logit layer) forward FLOPs for one sequence.

    A layer is ``2 s`` times its matrix parameters plus ``4 s^2 q`` for ``QK^T`` and scores x V;
    the logit layer is ``2 s h V`` (Narayanan 2021, section 5.1, generalised to GQA and gated MLPs).
    """
    s, h, f = model.seq_length, model.hidden_size, model.ffn_size
    q = model.num_attention_heads * model.head_dim
    kv = model.query_groups * model.head_dim
    matrix_params = h * (q + 2 * kv) + q * h + h * f * (3 if model.gated_linear_unit else 2)
    attention_core = 4 * s * s * q
    return 2 * s * matrix_params + attention_core, attention_core, 2 * s * h * model.vocab_size


def flops_per_iteration(model: ModelSpec, *, batch_size: int, recompute: str = "full") -> float:
    """FLOPs the GPUs execute for one optimizer step of ``batch_size`` sequences.

    Forward + backward is 3 forward passes. Full recomputation adds a 4th for the layers (not the
    logit layer) and reduces to :func:`gpt_flops_per_iteration` for GPT; selective adds only the
    attention core again; ``"none"`` is the model FLOPs ``72 B s l h^2 (1 + s/(6h) + V/(12 l h))``.
    """
    layer, core, logits = forward_flops_per_sequence(model)
    extras = {"none": 0.0, "selective": core, "full": layer}
    if recompute not in extras:
        raise ConfigError(f"recompute must be one of {list(RECOMPUTE_CHOICES)}, got {recompute!r}")
    extra = extras[recompute]
    return batch_size * (model.num_layers * (3 * layer + extra) + 3 * logits)


def training_days_estimate(*, num_parameters: float, train_tokens: float, num_gpus: int,
                           achieved_tflops: float) -> float:
    """Narayanan 2021, eq. 4: end-to-end training time ``~ 8 T P / (n X)``, in days."""
    return 8 * train_tokens * num_parameters / (num_gpus * achieved_tflops * 1e12) / SECONDS_PER_DAY


def pipeline_bubble_fraction(*, pipeline_parallel: int, num_microbatches: int, virtual_pipeline: int = 1) -> float:
    """Narayanan 2021, sections 2.2.1-2.2.2: idle time over ideal time, ``(p - 1)/m`` or ``(p - 1)/(v m)``."""
    return (pipeline_parallel - 1) / (virtual_pipeline * num_microbatches)


__all__ = [
    "activation_bytes",
    "activation_bytes_per_layer",
    "flops_per_iteration",
    "forward_flops_per_sequence",
    "gpt_flops_per_iteration",
    "gpt_parameter_count",
    "layer_parameter_count",
    "model_state_breakdown",
    "model_state_bytes",
    "model_state_bytes_per_parameter",
    "parameter_count",
    "pipeline_bubble_fraction",
    "pipeline_in_flight_factor",
    "stage_parameter_count",
    "stage_parameter_counts",
    "training_days_estimate",
]
