"""The layout search: enumerate, cost, discard what does not fit, rank.

Candidates follow the practice of Narayanan 2021 (section 3.3, takeaways 1-3): tensor parallelism
only inside a node and only in sizes that divide the attention heads and key/value heads; pipeline
stages that divide the layers; the rest data parallel; micro-batches that divide each replica's
share of the global batch; interleaving factors that divide each stage's layers. Every candidate is
costed by :func:`~tokenloom.planning.layout.evaluate_layout`; those that fit in memory are ranked by
estimated time per iteration, ties going to the smaller model-parallel size (use pipelining only as
far as memory needs).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from tokenloom.errors import ConfigError
from tokenloom.planning import formulas
from tokenloom.planning.data_geometry import DataGeometry
from tokenloom.planning.layout import Layout, evaluate_layout
from tokenloom.planning.specs import ClusterSpec, ModelSpec, PlanOptions, TrainingSpec


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


@dataclass(frozen=True, kw_only=True)
class Plan:
    """The answer: model size, cost, and the ranked layouts that fit."""

    model: ModelSpec
    """The model planned for."""
    cluster: ClusterSpec
    """The GPUs planned on."""
    training: TrainingSpec
    """The run as requested."""
    options: PlanOptions
    """Options in force."""
    global_batch_size: int
    """Sequences per iteration ``B``."""
    train_iters: int
    """Iterations; ``ceil(T / (B s))`` when tokens were given."""
    num_parameters: int
    """Parameters counted matrix by matrix (:func:`~tokenloom.planning.formulas.parameter_count`)."""
    num_parameters_gpt_formula: float | None
    """Narayanan 2021 eq. 2 for GPT-shaped models; ``None`` for others (GQA, gated MLP, ...)."""
    flops_per_iteration: float
    """FLOPs executed per iteration, recomputation included (eq. 3 for GPT under full recomputation)."""
    model_flops_per_iteration: float
    """FLOPs of the model itself (no recomputation), the basis of model FLOPs utilisation."""
    layouts: tuple[Layout, ...]
    """Layouts that fit, best first."""
    closest: Layout | None
    """When nothing fits, the layout needing the least memory; ``None`` otherwise."""
    candidates_considered: int
    """Layouts enumerated and costed."""

    @property
    def feasible(self) -> bool:
        """Whether at least one layout fits."""
        return bool(self.layouts)

    @property
    def train_tokens(self) -> int:
        """Tokens actually consumed: ``train_iters x B x s``."""
        return self.train_iters * self.global_batch_size * self.model.seq_length

    @property
    def iteration_time_s(self) -> float:
        """``F / (n X)``: one iteration at the achieved rate (no bubble, no communication)."""
        return self.flops_per_iteration / (self.cluster.num_gpus * self.cluster.achieved_tflops * 1e12)

    @property
    def training_days(self) -> float:
        """``train_iters x F / (n X)`` in days."""
        return self.train_iters * self.iteration_time_s / formulas.SECONDS_PER_DAY

    @property
    def training_days_estimate(self) -> float:
        """Narayanan 2021, eq. 4: ``8 T P / (n X)`` in days."""
        return formulas.training_days_estimate(num_parameters=self.num_parameters, train_tokens=self.train_tokens,
                                               num_gpus=self.cluster.num_gpus,
                                               achieved_tflops=self.cluster.achieved_tflops)

    @property
    def estimated_training_days(self) -> float:
        """Days at the best layout's estimated iteration time (bubble and communication included)."""
        return self.train_iters * self.best.iteration_s / formulas.SECONDS_PER_DAY

    @property
    def best(self) -> Layout:
        """The top-ranked layout; raises :class:`ConfigError` saying by how much memory falls short."""
        if self.layouts:
            return self.layouts[0]
        raise ConfigError(self.shortfall_message())

    def shortfall_message(self) -> str:
        """Why nothing fits: the least memory any layout needs against what a GPU has."""
        if self.closest is None:
            return "a layout fits"
        c = self.closest
        gpu = self.cluster.memory_per_gpu_gib
        return (f"no layout fits: needs {c.memory.total_gib:.1f} GiB per GPU at best ({c.label()}), "
                f"GPU has {gpu:g} GiB, short by {c.memory.total_gib - gpu:.1f} GiB; add GPUs, use GPUs with "
                "more memory, shard the optimizer over data parallel (ZeRO), or recompute activations")

    def geometry(self, layout: Layout | None = None) -> DataGeometry:
        """The data geometry of ``layout`` (the best one by default) for build and serve."""
        chosen = layout if layout is not None else self.best
        return DataGeometry(
            seq_length=self.model.seq_length, global_batch_size=self.global_batch_size,
            micro_batch_size=chosen.micro_batch_size, data_parallel_size=chosen.data_parallel,
            gradient_accumulation_steps=chosen.num_microbatches, train_iters=self.train_iters,
            eval_interval=self.training.eval_interval, eval_iters=self.training.eval_iters,
            tensor_model_parallel_size=chosen.tensor_parallel,
            pipeline_model_parallel_size=chosen.pipeline_parallel,
            virtual_pipeline_model_parallel_size=chosen.virtual_pipeline,
        )

    def explain(self, top: int = 3) -> list[str]:
        """Plain-language reasons for the ranking: each of the ``top`` layouts' time split, and what
        separates each from the next."""
        if not self.layouts:
            return [self.shortfall_message()]
        lines = []
        ranked = self.layouts[:top]
        for i, lay in enumerate(ranked, start=1):
            lines.append(
                f"#{i} {lay.label()}: {lay.iteration_s:.3g} s/iter = compute {lay.compute_s:.3g} + bubble "
                f"{lay.bubble_s:.3g} + TP {lay.tp_comm_s:.3g} + PP {lay.pp_comm_s:.3g} + DP {lay.dp_comm_s:.3g}; "
                f"{lay.memory.total_gib:.1f} GiB")
        for i in range(len(ranked) - 1):
            a, b = ranked[i], ranked[i + 1]
            terms = {"bubble": b.bubble_s - a.bubble_s, "TP traffic": b.tp_comm_s - a.tp_comm_s,
                     "PP traffic": b.pp_comm_s - a.pp_comm_s, "DP traffic": b.dp_comm_s - a.dp_comm_s}
            biggest = max(terms, key=lambda k: abs(terms[k]))
            if abs(b.iteration_s - a.iteration_s) < 1e-9:
                why = f"same time; #{i + 1} uses fewer model-parallel GPUs or a larger micro-batch"
            else:
                why = (f"{b.iteration_s - a.iteration_s:.3g} s faster, mostly {biggest} "
                       f"({terms[biggest]:+.3g} s for #{i + 2})")
            lines.append(f"#{i + 1} over #{i + 2}: {why}")
        return lines

    def to_dict(self, top: int | None = None) -> dict[str, Any]:
        """JSON-ready summary; ``top`` limits the layouts listed."""
        shown = self.layouts if top is None else self.layouts[:top]
        return {
            "inputs": {"model": asdict(self.model), "cluster": asdict(self.cluster),
                       "training": asdict(self.training), "options": asdict(self.options)},
            "num_parameters": self.num_parameters,
            "num_parameters_gpt_formula": self.num_parameters_gpt_formula,
            "global_batch_size": self.global_batch_size,
            "train_iters": self.train_iters,
            "train_tokens": self.train_tokens,
            "flops_per_iteration": self.flops_per_iteration,
            "model_flops_per_iteration": self.model_flops_per_iteration,
            "iteration_time_s": self.iteration_time_s,
            "training_days": self.training_days,
            "training_days_estimate": self.training_days_estimate,
            "estimated_training_days": self.estimated_training_days if self.feasible else None,
            "feasible": self.feasible,
            "candidates_considered": self.candidates_considered,
            "layouts_that_fit": len(self.layouts),
            "layouts": [lay.to_dict() for lay in shown],
            "closest": None if self.closest is None else self.closest.to_dict(),
            "shortfall": None if self.feasible else self.shortfall_message(),
            "data_geometry": self.geometry().to_dict() if self.feasible else None,
        }


def _tensor_candidates(model: ModelSpec, cluster: ClusterSpec, options: PlanOptions) -> list[int]:
    heads, groups, n = model.num_attention_heads, model.query_groups, cluster.num_gpus
    if options.tensor_parallel is not None:
        t = options.tensor_parallel
        if n % t:
            raise ConfigError(f"tensor-parallel size {t} does not divide the {n} GPUs")
        if t > cluster.gpus_per_node:
            raise ConfigError(f"tensor-parallel size {t} exceeds the {cluster.gpus_per_node} GPUs of a node; "
                              "tensor parallelism needs the intra-node link, use pipeline stages across nodes")
        if heads % t or groups % t:
            raise ConfigError(f"tensor-parallel size {t} does not divide num_attention_heads={heads} "
                              f"and num_query_groups={groups}")
        return [t]
    return [t for t in _divisors(cluster.gpus_in_a_node) if n % t == 0 and heads % t == 0 and groups % t == 0]


def _pipeline_candidates(model: ModelSpec, cluster: ClusterSpec, options: PlanOptions, t: int) -> list[int]:
    if options.pipeline_parallel is not None:
        p = options.pipeline_parallel
        if model.num_layers % p:
            raise ConfigError(f"pipeline-parallel size {p} does not divide num_layers={model.num_layers}")
        if cluster.num_gpus % (t * p):
            raise ConfigError(f"tensor x pipeline = {t} x {p} = {t * p} does not divide the {cluster.num_gpus} GPUs")
        return [p]
    return [p for p in _divisors(model.num_layers) if cluster.num_gpus % (t * p) == 0]


def _micro_candidates(options: PlanOptions, per_replica: int) -> list[int]:
    if options.micro_batch_size is not None:
        return [options.micro_batch_size] if per_replica % options.micro_batch_size == 0 else []
    return [b for b in _divisors(per_replica) if b <= options.max_micro_batch_size]


def _virtual_candidates(model: ModelSpec, options: PlanOptions, p: int, m: int) -> list[int]:
    per_stage = model.num_layers // p
    if options.virtual_pipeline is not None:
        v = options.virtual_pipeline
        ok = v == 1 or (p > 1 and per_stage % v == 0 and m >= p)
        return [v] if ok else []
    if p == 1:
        return [1]
    # Interleaving needs each stage's layers to split into v chunks and at least p micro-batches.
    return [v for v in _divisors(per_stage) if v <= options.max_virtual_pipeline and (v == 1 or m >= p)]


def plan_layout(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec,
                options: PlanOptions | None = None) -> Plan:
    """Search every admissible layout and return the ranked :class:`Plan`."""
    options = options if options is not None else PlanOptions()
    batch = training.batch_samples(model.seq_length)
    iters = training.iterations(model.seq_length)
    tensor_sizes = _tensor_candidates(model, cluster, options)
    if not tensor_sizes:
        raise ConfigError(f"no tensor-parallel size within a node of {cluster.gpus_in_a_node} GPUs divides "
                          f"num_attention_heads={model.num_attention_heads}, "
                          f"num_query_groups={model.query_groups} and the {cluster.num_gpus} GPUs")
    candidates: list[Layout] = []
    batch_fits_some_dp = False
    for t in tensor_sizes:
        for p in _pipeline_candidates(model, cluster, options, t):
            d = cluster.num_gpus // (t * p)
            if batch % d:
                continue
            batch_fits_some_dp = True
            for b in _micro_candidates(options, batch // d):
                m = batch // (b * d)
                for v in _virtual_candidates(model, options, p, m):
                    candidates.append(evaluate_layout(
                        model, cluster, options, global_batch_size=batch, tensor_parallel=t,
                        pipeline_parallel=p, virtual_pipeline=v, micro_batch_size=b))
    if not batch_fits_some_dp:
        raise ConfigError(
            f"global batch size {batch} is not divisible by any data-parallel size these GPUs allow "
            f"(n / (tensor x pipeline) for n = {cluster.num_gpus}); choose a batch that is a multiple of "
            "the data-parallel size you intend")
    if not candidates:
        raise ConfigError(
            f"no layout satisfies the pinned sizes (tensor_parallel={options.tensor_parallel}, "
            f"pipeline_parallel={options.pipeline_parallel}, virtual_pipeline={options.virtual_pipeline}, "
            f"micro_batch_size={options.micro_batch_size}) with global batch size {batch}: the global batch "
            "must be divisible by micro-batch x data-parallel size, interleaving needs p > 1, a layer count "
            "per stage divisible by v and at least p micro-batches")
    fitting = sorted((c for c in candidates if c.fits), key=Layout.rank_key)
    closest = None if fitting else min(candidates, key=lambda c: (c.memory.total_bytes, c.rank_key()))
    return Plan(
        model=model, cluster=cluster, training=training, options=options, global_batch_size=batch,
        train_iters=iters, num_parameters=formulas.parameter_count(model),
        num_parameters_gpt_formula=formulas.gpt_parameter_count(
            num_layers=model.num_layers, hidden_size=model.hidden_size, vocab_size=model.vocab_size,
            seq_length=model.seq_length) if model.is_gpt_shaped else None,
        flops_per_iteration=formulas.flops_per_iteration(model, batch_size=batch, recompute=options.recompute),
        model_flops_per_iteration=formulas.flops_per_iteration(model, batch_size=batch, recompute="none"),
        layouts=tuple(fitting), closest=closest, candidates_considered=len(candidates),
    )


__all__ = ["Plan", "plan_layout"]
