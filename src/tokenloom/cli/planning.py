"""The ``tokenloom plan`` subcommand: flags in, :func:`tokenloom.planning.plan_layout` out.

``register(subparsers)`` adds it; the parsed namespace carries ``run=run_plan``. This is the only
place that knows the flag names. Library errors
(:class:`~tokenloom.errors.ConfigError`) propagate to ``cli.main``, which prints them and exits 2;
a plan where no layout fits prints what it would take and returns 1.
"""

from __future__ import annotations

import argparse
import json
import sys

from tokenloom import ConfigError
from tokenloom.planning import (
    ModelSpec,
    PlanOptions,
    TrainingSpec,
    cluster_preset,
    format_plan,
    gpu_preset_names,
    model_preset,
    model_preset_names,
    plan_layout,
)

# flag dest -> ModelSpec field, for building or overriding a model from the command line
_MODEL_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                "kv_channels", "vocab_size", "seq_length")
_MODEL_REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length")
_CLUSTER_FLAGS = ("gpus_per_node", "memory_per_gpu_gib", "peak_tflops", "achieved_tflops",
                  "intra_node_bandwidth_gbps", "inter_node_bandwidth_gbps")


def add_plan_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``plan`` on ``subparsers`` and return its parser."""
    p = subparsers.add_parser(
        "plan", help="choose tensor/pipeline/data parallel sizes and batch geometry for a training run",
        description="Rank 3D-parallel layouts by estimated time per iteration using the published formulas "
                    "(Narayanan et al. 2021, Korthikanti et al. 2022, ZeRO), and write the data geometry "
                    "that tokenloom build and the loader read.")
    p.set_defaults(run=run_plan)

    m = p.add_argument_group("model (a preset, or every shape flag; flags override a preset)")
    m.add_argument("--model", choices=model_preset_names(), help="a well-known model shape")
    m.add_argument("--num-layers", type=int, help="transformer layers l")
    m.add_argument("--hidden-size", type=int, help="model width h")
    m.add_argument("--num-attention-heads", type=int, help="query heads a")
    m.add_argument("--num-query-groups", type=int, help="key/value heads (grouped-query attention)")
    m.add_argument("--ffn-hidden-size", type=int, help="MLP inner width (default 4h)")
    m.add_argument("--kv-channels", type=int, help="width of one head (default h/a)")
    m.add_argument("--vocab-size", type=int, help="vocabulary size V")
    m.add_argument("--seq-length", type=int, help="sequence length s")
    m.add_argument("--swiglu", action="store_true", default=None, help="gated MLP (three matrices)")
    m.add_argument("--no-bias", action="store_true", default=None, help="linear layers without biases")
    m.add_argument("--rmsnorm", action="store_true", default=None, help="RMSNorm instead of LayerNorm")
    m.add_argument("--rope", action="store_true", default=None, help="rotary positions (no position table)")
    m.add_argument("--untie-embeddings", action="store_true", default=None, help="separate output layer")

    c = p.add_argument_group("cluster")
    c.add_argument("--num-gpus", type=int, required=True, help="GPUs in the job n")
    c.add_argument("--gpu", choices=gpu_preset_names(), default="a100-80gb", help="GPU preset (default a100-80gb)")
    c.add_argument("--gpus-per-node", type=int, help="GPUs per node (default 8)")
    c.add_argument("--memory-per-gpu-gib", type=float, help="GPU memory in GiB")
    c.add_argument("--peak-tflops", type=float, help="peak TFLOP/s per GPU")
    c.add_argument("--achieved-tflops", type=float, help="sustained TFLOP/s per GPU, X in 8TP/(nX)")
    c.add_argument("--intra-node-bandwidth-gbps", type=float, help="NVLink GB/s per GPU, one way")
    c.add_argument("--inter-node-bandwidth-gbps", type=float, help="network GB/s per GPU, one way")

    t = p.add_argument_group("training")
    batch = t.add_mutually_exclusive_group(required=True)
    batch.add_argument("--global-batch-size", type=int, help="sequences per iteration")
    batch.add_argument("--global-batch-tokens", type=_count, help="tokens per iteration")
    length = t.add_mutually_exclusive_group(required=True)
    length.add_argument("--train-tokens", type=_count, help="total training tokens T (1e12 accepted)")
    length.add_argument("--train-iters", type=int, help="optimizer steps")
    t.add_argument("--eval-interval", type=int, default=1000, help="steps between validations (default 1000)")
    t.add_argument("--eval-iters", type=int, default=100, help="batches per validation (default 100)")

    o = p.add_argument_group("options")
    o.add_argument("--recompute", choices=PlanOptions.recompute_choices, default="selective",
                   help="activation recomputation (default selective)")
    o.add_argument("--no-sequence-parallel", action="store_true", help="turn sequence parallelism off")
    o.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=0,
                   help="shard optimizer (1), + gradients (2), + weights (3) over data parallel")
    o.add_argument("--use-distributed-optimizer", action="store_true", help="Megatron's name for --zero-stage 1")
    o.add_argument("--gradient-bytes", type=int, choices=(2, 4), default=2,
                   help="bytes per gradient (2: 16 bytes/param; 4: Megatron's fp32 main grads)")
    o.add_argument("--tensor-parallel", type=int, help="pin t")
    o.add_argument("--pipeline-parallel", type=int, help="pin p")
    o.add_argument("--virtual-pipeline", type=int, help="pin v (1 = no interleaving)")
    o.add_argument("--micro-batch-size", type=int, help="pin b")
    o.add_argument("--max-micro-batch-size", type=int, default=16, help="largest b searched (default 16)")
    o.add_argument("--max-virtual-pipeline", type=int, default=8, help="largest v searched (default 8)")
    o.add_argument("--overlap-grad-reduce", action="store_true", help="treat DP traffic as hidden")
    o.add_argument("--memory-reserve-gib", type=float, default=2.0, help="GiB kept free per GPU (default 2)")

    r = p.add_argument_group("output")
    r.add_argument("--top", type=int, default=5, help="layouts to show (default 5)")
    r.add_argument("--json", action="store_true", help="print JSON instead of a table")
    r.add_argument("--plot", metavar="PNG", help="also draw the best layouts' memory per GPU (weights, gradients, "
                   "optimizer, activations) against the GPU's memory (needs matplotlib: tokenloom[plot])")
    r.add_argument("--write-geometry", metavar="PATH",
                   help="write the best layout's data geometry (YAML for .yaml/.yml, JSON otherwise)")
    return p


def _model_from_args(args: argparse.Namespace) -> ModelSpec:
    shape = {name: getattr(args, name) for name in _MODEL_FLAGS if getattr(args, name) is not None}
    switches = {
        "gated_linear_unit": args.swiglu, "add_bias_linear": None if args.no_bias is None else False,
        "normalization": "RMSNorm" if args.rmsnorm else None,
        "position_embedding_type": "rope" if args.rope else None,
        "untie_embeddings_and_output_weights": args.untie_embeddings,
    }
    shape.update({k: v for k, v in switches.items() if v is not None})
    if args.model is not None:
        return model_preset(args.model, **shape)
    missing = [f"--{name.replace('_', '-')}" for name in _MODEL_REQUIRED if name not in shape]
    if missing:
        raise ConfigError(f"give --model or all of {', '.join(missing)}")
    return ModelSpec(**shape)


def _count(text: str) -> int:
    """A whole number written as ``300000000000``, ``300e9`` or ``3e11``."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number such as 300e9, got {text!r}") from None
    if not value.is_integer():
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}")
    return int(value)


def run_plan(args: argparse.Namespace) -> int:
    """Plan, print a table (or JSON), optionally write the geometry. 0 if a layout fits, else 1."""
    model = _model_from_args(args)
    cluster_overrides = {k: getattr(args, k) for k in _CLUSTER_FLAGS if getattr(args, k) is not None}
    cluster = cluster_preset(args.gpu, num_gpus=args.num_gpus, **cluster_overrides)
    training = TrainingSpec(
        global_batch_size=args.global_batch_size, global_batch_tokens=args.global_batch_tokens,
        train_tokens=args.train_tokens, train_iters=args.train_iters,
        eval_interval=args.eval_interval, eval_iters=args.eval_iters)
    zero_stage = args.zero_stage
    if args.use_distributed_optimizer:
        zero_stage = max(zero_stage, 1)
    options = PlanOptions(
        recompute=args.recompute, sequence_parallel=not args.no_sequence_parallel, zero_stage=zero_stage,
        gradient_bytes=args.gradient_bytes, tensor_parallel=args.tensor_parallel,
        pipeline_parallel=args.pipeline_parallel, virtual_pipeline=args.virtual_pipeline,
        micro_batch_size=args.micro_batch_size, max_micro_batch_size=args.max_micro_batch_size,
        max_virtual_pipeline=args.max_virtual_pipeline, overlap_grad_reduce=args.overlap_grad_reduce,
        memory_reserve_gib=args.memory_reserve_gib)
    result = plan_layout(model, cluster, training, options)
    if args.plot:
        from tokenloom.plots import plot_memory

        path = plot_memory(result, args.plot, top=args.top, model_name=args.model, gpu_name=args.gpu)
        print(f"wrote the memory plot to {path}", file=sys.stderr)
    if args.json:
        print(json.dumps(result.to_dict(top=args.top), indent=2))
    else:
        print(format_plan(result, top=args.top))
    if not result.feasible:
        if args.json:
            print(result.shortfall_message(), file=sys.stderr)
        return 1
    if args.write_geometry:
        path = result.geometry().write(args.write_geometry)
        print(f"wrote data geometry to {path}", file=sys.stderr)
    return 0


def register(subparsers) -> None:
    """Add this group's subcommands."""
    add_plan_parser(subparsers)


__all__ = ["add_plan_parser", "register", "run_plan"]
