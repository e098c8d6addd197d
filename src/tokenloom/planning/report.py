"""Human-readable rendering of a :class:`~tokenloom.planning.search.Plan`."""

from __future__ import annotations

from tokenloom.planning.layout import Layout
from tokenloom.planning.search import Plan


def _si(value: float, unit: str = "") -> str:
    for scale, prefix in ((1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}".rstrip()


def _row(rank: str, lay: Layout) -> list[str]:
    mem = lay.memory
    gib = 2**30
    return [rank, str(lay.tensor_parallel), str(lay.pipeline_parallel), str(lay.data_parallel),
            str(lay.virtual_pipeline), str(lay.micro_batch_size), str(lay.num_microbatches),
            f"{lay.bubble_fraction:.1%}",
            f"{(mem.weights_bytes + mem.gradients_bytes + mem.optimizer_bytes) / gib:.1f}",
            f"{mem.activations_bytes / gib:.1f}", f"{mem.total_gib:.1f}", f"{lay.iteration_s:.2f}"]


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    fmt = lambda r: "  ".join(c.rjust(w) for c, w in zip(r, widths))  # noqa: E731
    return [fmt(header), fmt(["-" * w for w in widths]), *(fmt(r) for r in rows)]


def format_plan(plan: Plan, top: int = 5) -> str:
    """A summary, the ``top`` layouts as a table, and why they rank as they do."""
    m, c = plan.model, plan.cluster
    lines = [
        f"model      l={m.num_layers} h={m.hidden_size} a={m.num_attention_heads} kv={m.query_groups} "
        f"ffn={m.ffn_size} V={m.vocab_size} s={m.seq_length}",
        f"parameters {plan.num_parameters:,} ({_si(plan.num_parameters)})"
        + ("" if plan.num_parameters_gpt_formula is None
           else f"; 12lh^2(1 + 13/12h + (V+s)/12lh) = {_si(plan.num_parameters_gpt_formula)}"),
        f"cluster    {c.num_gpus} GPUs, {c.gpus_per_node}/node, {c.memory_per_gpu_gib:g} GiB, "
        f"{c.achieved_tflops:g} of {c.peak_tflops:g} TFLOP/s",
        f"training   batch {plan.global_batch_size} x {m.seq_length} tokens, {plan.train_iters:,} iterations, "
        f"{_si(plan.train_tokens)} tokens",
        f"compute    {_si(plan.flops_per_iteration, 'FLOP')}/iteration (recompute={plan.options.recompute}), "
        f"{plan.iteration_time_s:.2f} s at {c.achieved_tflops:g} TFLOP/s, {plan.training_days:.1f} days "
        f"(8TP/nX: {plan.training_days_estimate:.1f} days)",
        "",
    ]
    header = ["rank", "tp", "pp", "dp", "vpp", "mbs", "accum", "bubble", "state GiB", "act GiB", "total GiB",
              "s/iter"]
    if plan.feasible:
        rows = [_row(str(i), lay) for i, lay in enumerate(plan.layouts[:top], start=1)]
        lines += _table(header, rows)
        best = plan.best
        lines += ["", f"{len(plan.layouts)} of {plan.candidates_considered} layouts fit in "
                      f"{c.memory_per_gpu_gib:g} GiB; best: {best.label()}, {plan.estimated_training_days:.1f} "
                      "days with bubble and communication", *plan.explain(top=min(top, 3))]
    elif plan.closest is not None:
        lines += _table(header, [_row("closest", plan.closest)])
        lines += ["", plan.shortfall_message()]
    return "\n".join(lines)


__all__ = ["format_plan"]
