"""The planner: published numbers, the formulas' reductions, the search, the geometry file, the CLI,
and differential checks against megatron-core itself (parameter counts, micro-batch arithmetic)."""

from __future__ import annotations

import json
import math
import socket
from dataclasses import replace

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

import tokenloom
import tokenloom.planning as tp
from tokenloom.errors import ConfigError, FormatError
from tokenloom.planning import formulas
from tokenloom.planning.layout import GIB

GPT_DEFAULTS = dict(vocab_size=51200, seq_length=2048)


def gpt(num_layers: int, hidden_size: int, heads: int, **kw: object) -> tp.ModelSpec:
    return tp.ModelSpec(num_layers=num_layers, hidden_size=hidden_size, num_attention_heads=heads,
                        **{**GPT_DEFAULTS, **kw})


# ------------------------------------------------------------------ published numbers


@pytest.mark.parametrize("params, gigabytes", [(1e9, 16), (7e9, 112), (70e9, 1120), (405e9, 6480)])
def test_sixteen_bytes_per_parameter(params: float, gigabytes: float) -> None:
    # ZeRO section 3.1: mixed-precision Adam keeps 2 + 2 + 12 bytes per parameter.
    assert formulas.model_state_bytes(params) / 1e9 == pytest.approx(gigabytes, rel=1e-12)
    assert formulas.model_state_bytes_per_parameter() == 16


@pytest.mark.parametrize("stage, gigabytes", [(0, 120), (1, 31.4), (2, 16.6), (3, 1.88)])
def test_zero_figure_one(stage: int, gigabytes: float) -> None:
    # ZeRO Figure 1: 7.5B parameters over 64 data-parallel GPUs.
    got = formulas.model_state_bytes(7.5e9, zero_stage=stage, data_parallel=64) / 1e9
    assert got == pytest.approx(gigabytes, rel=0.01)


def test_gpt3_training_days() -> None:
    # Narayanan 2021 section 5.1: GPT-3 175B, 300B tokens, 1024 A100s at 140 TFLOP/s -> about 34 days.
    days = formulas.training_days_estimate(num_parameters=175e9, train_tokens=300e9, num_gpus=1024, achieved_tflops=140)
    assert days == pytest.approx(34, abs=0.5)
    plan = tokenloom.plan("gpt3-175b", "a100-80gb", num_gpus=1024, global_batch_size=1536,
                          train_tokens=300_000_000_000, recompute="full")
    assert plan.training_days_estimate == pytest.approx(34, abs=0.5)
    # The exact FLOP count (eq. 3) adds the s/6h and V/16lh corrections: a few percent more.
    assert plan.training_days == pytest.approx(34.7, abs=0.3)


def test_trillion_parameter_training_days() -> None:
    # Narayanan 2021 section 5.1: the 1T model on 450B tokens, 3072 GPUs at 163 TFLOP/s -> about 84 days.
    plan = tokenloom.plan("gpt-1t", "a100-80gb", num_gpus=3072, global_batch_size=3072,
                          train_tokens=450_000_000_000, recompute="full", achieved_tflops=163)
    assert plan.training_days_estimate == pytest.approx(84, abs=1)


# Narayanan 2021, Table 1: (parameters in billions, heads, hidden, layers, t, p, GPUs, batch).
TABLE_1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512), (3.6, 32, 3072, 30, 2, 1, 64, 512),
    (7.5, 32, 4096, 36, 4, 1, 128, 512), (18.4, 48, 6144, 40, 8, 1, 256, 1024),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536), (76.1, 80, 10240, 60, 8, 4, 1024, 1792),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304), (310.1, 128, 16384, 96, 8, 16, 1920, 2160),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520), (1008.0, 160, 25600, 128, 8, 64, 3072, 3072),
]


@pytest.mark.parametrize("billions, heads, hidden, layers, t, p, n, batch", TABLE_1)
def test_table_one_parameter_counts(billions: float, heads: int, hidden: int, layers: int,
                                    t: int, p: int, n: int, batch: int) -> None:
    model = gpt(layers, hidden, heads)
    assert formulas.gpt_parameter_count(num_layers=layers, hidden_size=hidden, **GPT_DEFAULTS) / 1e9 == \
        pytest.approx(billions, abs=0.051)
    assert formulas.parameter_count(model) / 1e9 == pytest.approx(billions, abs=0.051)


@pytest.mark.parametrize("billions, heads, hidden, layers, t, p, n, batch", TABLE_1)
def test_table_one_layouts_fit(billions: float, heads: int, hidden: int, layers: int,
                               t: int, p: int, n: int, batch: int) -> None:
    # Every layout Megatron-LM trained (with activation recomputation) fits an 80 GB A100.
    model = gpt(layers, hidden, heads)
    plan = tokenloom.plan(model, tp.ClusterSpec(num_gpus=n), global_batch_size=batch, train_iters=1, recompute="full")
    published = [lay for lay in plan.layouts if (lay.tensor_parallel, lay.pipeline_parallel,
                                                  lay.virtual_pipeline, lay.micro_batch_size) == (t, p, 1, 1)]
    assert len(published) == 1 and published[0].fits


def test_trillion_parameters_fit_with_t8_p64() -> None:
    # Narayanan 2021: the 1T model trained on 3072 GPUs with t = 8 and p = 64.
    plan = tokenloom.plan("gpt-1t", "a100-80gb", num_gpus=3072, global_batch_size=3072, train_iters=1,
                          recompute="full", tensor_parallel=8, pipeline_parallel=64, virtual_pipeline=1,
                          micro_batch_size=1)
    best = plan.best
    assert (best.tensor_parallel, best.pipeline_parallel, best.data_parallel) == (8, 64, 6)
    assert best.num_microbatches == 512
    assert best.bubble_fraction == pytest.approx(63 / 512)
    assert best.memory.total_gib < 80
    # ...and without recomputation it does not fit: that is why they recomputed.
    no_recompute = tokenloom.plan("gpt-1t", "a100-80gb", num_gpus=3072, global_batch_size=3072, train_iters=1,
                                  recompute="none", tensor_parallel=8, pipeline_parallel=64, virtual_pipeline=1,
                                  micro_batch_size=1)
    assert not no_recompute.feasible
    # Fewer stages cannot hold the weights: 1T x 16 bytes over 8 x 16 GPUs is over 100 GiB.
    too_few = tokenloom.plan("gpt-1t", "a100-80gb", num_gpus=3072, global_batch_size=3072, train_iters=1,
                             recompute="full", tensor_parallel=8, pipeline_parallel=16)
    assert not too_few.feasible and too_few.closest.memory.total_gib > 100


@pytest.mark.parametrize("name, count", [("llama-7b", 6_738_415_616), ("llama2-70b", 68_976_648_192),
                                         ("llama3-405b", 405_853_388_800)])
def test_llama_parameter_counts(name: str, count: int) -> None:
    # The released checkpoints' exact sizes (GQA, SwiGLU, RMSNorm, untied output).
    assert formulas.parameter_count(tp.model_preset(name)) == count


@pytest.mark.parametrize("heads, hidden, reduction", [(96, 12288, 0.70), (128, 20480, 0.65)])
def test_selective_recompute_saving(heads: int, hidden: int, reduction: float) -> None:
    # Korthikanti 2022: selective recomputation cuts activation memory by 70% for GPT-3 and 65% for MT-NLG.
    model = gpt(8, hidden, heads)
    none = formulas.activation_bytes_per_layer(model, micro_batch_size=1, tensor_parallel=8, recompute="none")
    selective = formulas.activation_bytes_per_layer(model, micro_batch_size=1, tensor_parallel=8, recompute="selective")
    assert 1 - selective / none == pytest.approx(reduction, abs=0.01)


@pytest.mark.parametrize("p, m, v, expected", [(4, 8, 1, 3 / 8), (8, 32, 1, 7 / 32), (8, 32, 2, 7 / 64),
                                               (64, 512, 1, 63 / 512), (1, 5, 1, 0.0), (16, 96, 6, 15 / 576)])
def test_bubble_fraction(p: int, m: int, v: int, expected: float) -> None:
    # Narayanan 2021 sections 2.2.1-2.2.2: (p - 1)/m, interleaved (p - 1)/(v m).
    assert formulas.pipeline_bubble_fraction(pipeline_parallel=p, num_microbatches=m, virtual_pipeline=v) == \
        pytest.approx(expected)


# ------------------------------------------------------------------ formulas reduce to the papers'

gpt_shapes = st.builds(
    lambda l, a, d, V, s: gpt(l, a * d, a, vocab_size=V, seq_length=s),
    st.integers(1, 160), st.integers(1, 128), st.integers(1, 256), st.integers(1, 300_000), st.integers(1, 32768))


@settings(max_examples=200, deadline=None)
@given(gpt_shapes)
def test_general_count_is_eq2_plus_final_norm(model: tp.ModelSpec) -> None:
    eq2 = formulas.gpt_parameter_count(num_layers=model.num_layers, hidden_size=model.hidden_size,
                                 vocab_size=model.vocab_size, seq_length=model.seq_length)
    assert formulas.parameter_count(model) == pytest.approx(eq2 + 2 * model.hidden_size, rel=1e-12)
    assert formulas.layer_parameter_count(model) == 12 * model.hidden_size**2 + 13 * model.hidden_size


@settings(max_examples=200, deadline=None)
@given(gpt_shapes, st.integers(1, 4096))
def test_flops_reduce_to_eq3(model: tp.ModelSpec, batch: int) -> None:
    B, s, l, h, V = batch, model.seq_length, model.num_layers, model.hidden_size, model.vocab_size
    eq3 = formulas.gpt_flops_per_iteration(batch_size=B, seq_length=s, num_layers=l, hidden_size=h, vocab_size=V)
    assert eq3 == pytest.approx(96 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h)), rel=1e-12)
    assert formulas.flops_per_iteration(model, batch_size=B, recompute="full") == pytest.approx(eq3, rel=1e-12)
    model_flops = 72 * B * s * l * h**2 * (1 + s / (6 * h) + V / (12 * l * h))
    assert formulas.flops_per_iteration(model, batch_size=B, recompute="none") == pytest.approx(model_flops, rel=1e-12)
    selective = formulas.flops_per_iteration(model, batch_size=B, recompute="selective")
    assert selective == pytest.approx(model_flops + 4 * B * s * s * h * l, rel=1e-12)


@settings(max_examples=200, deadline=None)
@given(gpt_shapes, st.integers(1, 8), st.sampled_from([1, 2, 4, 8]))
def test_activations_reduce_to_korthikanti_table2(model: tp.ModelSpec, b: int, t: int) -> None:
    s, h, a = model.seq_length, model.hidden_size, model.num_attention_heads
    act = lambda **kw: formulas.activation_bytes_per_layer(model, micro_batch_size=b, tensor_parallel=t, **kw)  # noqa: E731
    rel = dict(rel=1e-12)
    assert formulas.activation_bytes_per_layer(model, micro_batch_size=b, tensor_parallel=1, recompute="none") == \
        pytest.approx(s * b * h * (34 + 5 * a * s / h), **rel)
    assert act(sequence_parallel=False, recompute="none") == \
        pytest.approx(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)), **rel)
    assert act(sequence_parallel=True, recompute="none") == pytest.approx(s * b * h / t * (34 + 5 * a * s / h), **rel)
    assert act(sequence_parallel=False, recompute="selective") == pytest.approx(s * b * h * (10 + 24 / t), **rel)
    assert act(sequence_parallel=True, recompute="selective") == pytest.approx(34 * s * b * h / t, **rel)
    assert act(sequence_parallel=True, recompute="full") == pytest.approx(2 * s * b * h / t, **rel)
    assert act(sequence_parallel=False, recompute="full") == pytest.approx(2 * s * b * h, **rel)


def test_first_stage_activation_memory() -> None:
    # Korthikanti 2022 section 4.2.3: the first stage holds p micro-batches of l/p layers (= l layers),
    # interleaving multiplies that by 1 + (p - 1)/(p v); with fewer micro-batches than stages, m of them.
    model = gpt(48, 8192, 64)
    per_layer = formulas.activation_bytes_per_layer(model, micro_batch_size=1, tensor_parallel=8, recompute="selective")
    embed = 2048 * 8192 / 8
    common = dict(micro_batch_size=1, tensor_parallel=8, sequence_parallel=True, recompute="selective")
    plain = formulas.activation_bytes(model, pipeline_parallel=4, virtual_pipeline=1, num_microbatches=64, **common)
    assert plain == pytest.approx(48 * per_layer + 4 * embed)
    interleaved = formulas.activation_bytes(model, pipeline_parallel=4, virtual_pipeline=3, num_microbatches=64,
                                            **common)
    assert interleaved == pytest.approx((48 * per_layer + 4 * embed) * (1 + 3 / 12))
    starved = formulas.activation_bytes(model, pipeline_parallel=4, virtual_pipeline=1, num_microbatches=2, **common)
    assert starved == pytest.approx(48 / 4 * 2 * per_layer + 2 * embed)
    single = formulas.activation_bytes(model, pipeline_parallel=1, virtual_pipeline=1, num_microbatches=8, **common)
    assert single == pytest.approx(48 * per_layer + embed + 4 * 2048 * 8192 * (1 + 51200 / 8192) / 8)


def test_most_loaded_stage_parameters() -> None:
    # First stage: l/p layers + word embedding + position table; last: l/p layers + final norm + output.
    # Under TP the norms, the projection and fc2 biases and the position table stay whole.
    one_t = tp.model_preset("gpt-1t")
    h, V, s, t, p = 25600, 51200, 2048, 8, 64
    per_gpu_layer = (12 * h * h + 7 * h) / t + 4 * h + 2 * h  # QKV/fc1 biases split; norms, 2 biases whole
    first = 128 / p * per_gpu_layer + V * h / t + s * h
    last = 128 / p * per_gpu_layer + 2 * h + V * h / t
    assert formulas.stage_parameter_counts(one_t, tensor_parallel=t, pipeline_parallel=p) == \
        pytest.approx((first, last), rel=1e-12)
    assert formulas.stage_parameter_count(one_t, tensor_parallel=t, pipeline_parallel=p) == pytest.approx(first)
    llama = tp.model_preset("llama-7b")  # no biases, RMSNorm, untied
    total = formulas.parameter_count(llama)
    norms = 32 * 2 * 4096 + 4096
    assert formulas.stage_parameter_count(llama, tensor_parallel=1, pipeline_parallel=1) == total
    assert formulas.stage_parameter_count(llama, tensor_parallel=2, pipeline_parallel=1) == \
        pytest.approx((total - norms) / 2 + norms)
    lay = tp.evaluate_layout(one_t, tp.ClusterSpec(num_gpus=3072), tp.PlanOptions(), global_batch_size=3072,
                             tensor_parallel=t, pipeline_parallel=p, virtual_pipeline=1, micro_batch_size=1)
    assert lay.memory.weights_bytes == pytest.approx(2 * first)
    assert lay.memory.optimizer_bytes == pytest.approx(12 * first)


def test_zero_stages_shard_in_order() -> None:
    w, g, o = formulas.model_state_breakdown(1e9, zero_stage=0, data_parallel=8)
    assert (w, g, o) == (2e9, 2e9, 12e9)
    assert formulas.model_state_breakdown(1e9, zero_stage=1, data_parallel=8) == (2e9, 2e9, 1.5e9)
    assert formulas.model_state_breakdown(1e9, zero_stage=2, data_parallel=8) == (2e9, 0.25e9, 1.5e9)
    assert formulas.model_state_breakdown(1e9, zero_stage=3, data_parallel=8) == (0.25e9, 0.25e9, 1.5e9)
    # Megatron's default fp32 main gradients: 18 bytes, 6 + 12/d with the distributed optimizer.
    assert formulas.model_state_bytes_per_parameter(gradient_bytes=4) == 18
    assert formulas.model_state_bytes_per_parameter(gradient_bytes=4, zero_stage=1, data_parallel=4) == 9


# ------------------------------------------------------------------ the search


def _reference_layouts(model: tp.ModelSpec, cluster: tp.ClusterSpec, batch: int, options: tp.PlanOptions) -> set:
    """Brute force over every (t, p, v, b), keeping what the rules admit."""
    out = set()
    n, l = cluster.num_gpus, model.num_layers
    node = min(n, cluster.gpus_per_node)
    for t in range(1, node + 1):
        # A TP group is t consecutive ranks: it stays in one node only when t divides the node.
        if node % t or n % t or model.num_attention_heads % t or model.query_groups % t:
            continue
        for p in range(1, l + 1):
            if l % p or n % (t * p) or batch % (n // (t * p)):
                continue
            d = n // (t * p)
            for b in range(1, options.max_micro_batch_size + 1):
                if (batch // d) % b:
                    continue
                m = batch // (d * b)
                for v in range(1, options.max_virtual_pipeline + 1):
                    if v == 1 or (p > 1 and (l // p) % v == 0 and m >= p):
                        out.add((t, p, v, b))
    return out


small_models = st.builds(
    lambda l, a, g, d, ffn, V, s, gated: tp.ModelSpec(
        num_layers=l, hidden_size=a * d, num_attention_heads=a, num_query_groups=g if a % g == 0 else a,
        ffn_hidden_size=ffn, vocab_size=V, seq_length=s, gated_linear_unit=gated),
    st.integers(1, 24), st.sampled_from([1, 2, 4, 6, 8, 12, 16]), st.sampled_from([1, 2, 4, 8]),
    st.sampled_from([16, 64, 128]), st.sampled_from([None, 512, 3000]), st.integers(100, 100_000),
    st.sampled_from([128, 1024, 4096]), st.booleans())


@settings(max_examples=60, deadline=None)
@given(small_models, st.sampled_from([1, 2, 4, 8, 16, 24, 32]), st.sampled_from([4, 8]),
       st.sampled_from([8, 16, 48, 64, 96]), st.sampled_from([0.5, 2.0, 16.0, 80.0]),
       st.sampled_from(["none", "selective", "full"]), st.integers(0, 3))
def test_search_is_exhaustive_and_ranked(model: tp.ModelSpec, n: int, per_node: int, batch: int, mem: float,
                                         recompute: str, zero: int) -> None:
    if n > per_node and n % per_node:
        n = per_node * (n // per_node + 1)
    cluster = tp.ClusterSpec(num_gpus=n, gpus_per_node=per_node, memory_per_gpu_gib=mem)
    options = tp.PlanOptions(recompute=recompute, zero_stage=zero, memory_reserve_gib=0.25)
    expected = _reference_layouts(model, cluster, batch, options)
    if not {(t, p) for t, p, _, _ in expected}:
        with pytest.raises(ConfigError):
            tokenloom.plan(model, cluster, global_batch_size=batch, train_iters=10, options=options)
        return
    plan = tokenloom.plan(model, cluster, global_batch_size=batch, train_iters=10, options=options)
    assert plan.candidates_considered == len(expected)
    got = {(x.tensor_parallel, x.pipeline_parallel, x.virtual_pipeline, x.micro_batch_size) for x in plan.layouts}
    assert got <= expected
    keys = [x.rank_key() for x in plan.layouts]
    assert keys == sorted(keys)
    for lay in plan.layouts:
        assert lay.fits and lay.memory.total_bytes <= mem * GIB
        assert lay.tensor_parallel * lay.pipeline_parallel * lay.data_parallel == n
        assert lay.micro_batch_size * lay.data_parallel * lay.num_microbatches == batch
        assert lay.iteration_s == pytest.approx(lay.compute_s + lay.bubble_s + lay.tp_comm_s + lay.pp_comm_s
                                                + lay.dp_comm_s)
        assert lay.bubble_fraction == pytest.approx(
            (lay.pipeline_parallel - 1) / (lay.virtual_pipeline * lay.num_microbatches))
    if plan.feasible:
        geometry = plan.geometry()
        assert geometry.global_batch_size == batch and geometry.data_parallel_size == plan.best.data_parallel
    else:
        # The closest layout is the least memory over every candidate, and the message says by how much.
        every = [tp.evaluate_layout(model, cluster, options, global_batch_size=batch, tensor_parallel=t,
                                    pipeline_parallel=p, virtual_pipeline=v, micro_batch_size=b)
                 for t, p, v, b in expected]
        least = min(x.memory.total_bytes for x in every)
        assert plan.closest.memory.total_bytes == pytest.approx(least)
        with pytest.raises(ConfigError, match=f"short by {(least / GIB - mem):.1f} GiB"):
            _ = plan.best


def test_more_memory_never_loses_layouts() -> None:
    model = tp.model_preset("llama-7b")
    sizes = [len(tokenloom.plan(model, tp.ClusterSpec(num_gpus=16, memory_per_gpu_gib=g), global_batch_size=256,
                                train_iters=1).layouts) for g in (16, 24, 40, 80, 141)]
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1]


def test_recompute_and_zero_only_lower_memory() -> None:
    model = tp.model_preset("llama2-70b")
    cluster = tp.ClusterSpec(num_gpus=64)
    kw = dict(global_batch_size=512, tensor_parallel=8, pipeline_parallel=2, virtual_pipeline=1, micro_batch_size=1)
    mems = []
    for recompute in ("none", "selective", "full"):
        lay = tp.evaluate_layout(model, cluster, tp.PlanOptions(recompute=recompute), **kw)
        mems.append(lay.memory.activations_bytes)
    assert mems[0] > mems[1] > mems[2]
    states = [tp.evaluate_layout(model, cluster, tp.PlanOptions(zero_stage=z), **kw).memory.total_bytes
              for z in range(4)]
    assert states == sorted(states, reverse=True) and len(set(states)) == 4


def test_ranking_follows_practice_and_explains() -> None:
    # A small model goes pure data parallel; a large one takes TP = a whole node and only as many
    # stages as memory needs.
    small = tokenloom.plan(gpt(24, 2304, 24), tp.ClusterSpec(num_gpus=32), global_batch_size=512, train_iters=1)
    assert (small.best.tensor_parallel, small.best.pipeline_parallel) == (1, 1)
    big = tokenloom.plan("gpt-1t", "a100-80gb", num_gpus=3072, global_batch_size=3072, train_iters=1, recompute="full")
    assert big.best.tensor_parallel == 8
    fitting_mp = {x.model_parallel for x in big.layouts}
    assert big.best.model_parallel == min(fitting_mp)
    lines = big.explain(top=3)
    assert lines[0].startswith("#1 " + big.best.label()) and "#1 over #2" in lines[3]
    # Equal times go to less model parallelism, then fewer stages.
    base = dict(memory=big.best.memory, memory_per_gpu_bytes=80 * GIB, bubble_fraction=0.0, compute_s=1.0,
                bubble_s=0.0, tp_comm_s=0.0, pp_comm_s=0.0, dp_comm_s=0.0, virtual_pipeline=1, micro_batch_size=1,
                num_microbatches=1)
    a = tp.Layout(tensor_parallel=2, pipeline_parallel=1, data_parallel=4, **base)
    b = tp.Layout(tensor_parallel=1, pipeline_parallel=4, data_parallel=2, **base)
    c = tp.Layout(tensor_parallel=4, pipeline_parallel=1, data_parallel=2, **base)
    assert sorted([b, c, a], key=tp.Layout.rank_key) == [a, c, b]


def test_impossible_request_says_by_how_much() -> None:
    plan = tokenloom.plan("llama2-70b", "a100-80gb", num_gpus=8, global_batch_size=1024, train_tokens=2 * 10**12)
    assert not plan.feasible and plan.layouts == ()
    need = plan.closest.memory.total_gib
    assert need > 80
    message = plan.shortfall_message()
    assert f"needs {need:.1f} GiB" in message and "GPU has 80 GiB" in message and "tp=8" in message
    assert "--" not in message  # library errors never mention flags
    with pytest.raises(ConfigError, match="short by"):
        _ = plan.best
    # The same request on 64 GPUs fits.
    assert tokenloom.plan("llama2-70b", "a100-80gb", num_gpus=64, global_batch_size=1024, train_iters=1).feasible


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize("build, needle", [
    (lambda: tp.ModelSpec(num_layers=2, hidden_size=100, num_attention_heads=3, vocab_size=10, seq_length=8),
     "hidden_size=100 is not divisible by num_attention_heads=3"),
    (lambda: tp.ModelSpec(num_layers=2, hidden_size=96, num_attention_heads=12, num_query_groups=5,
                          vocab_size=10, seq_length=8), "num_query_groups=5"),
    (lambda: tp.ModelSpec(num_layers=0, hidden_size=96, num_attention_heads=12, vocab_size=10, seq_length=8),
     "num_layers must be a positive integer, got 0"),
    (lambda: tp.ModelSpec(num_layers=2, hidden_size=96, num_attention_heads=12, vocab_size=10, seq_length=8,
                          normalization="BatchNorm"), "'BatchNorm'"),
    (lambda: tp.ClusterSpec(num_gpus=12, gpus_per_node=8), "num_gpus=12 is not a multiple of gpus_per_node=8"),
    (lambda: tp.ClusterSpec(num_gpus=8, achieved_tflops=400), "exceeds peak_tflops"),
    (lambda: tp.TrainingSpec(global_batch_size=8, global_batch_tokens=8, train_iters=1), "exactly one of"),
    (lambda: tp.TrainingSpec(global_batch_size=8), "train_tokens or train_iters"),
    (lambda: tp.PlanOptions(recompute="some"), "'some'"),
    (lambda: tp.PlanOptions(zero_stage=4), "zero_stage must be 0, 1, 2 or 3, got 4"),
    (lambda: tokenloom.plan("gpt3-175b", "a100-80gb", num_gpus=64, global_batch_tokens=1000, train_iters=1),
     "global_batch_tokens=1000 is not a multiple of the sequence length 2048"),
    (lambda: tokenloom.plan("gpt3-175b", "a100-80gb", num_gpus=64, global_batch_size=64, train_iters=1,
                            tensor_parallel=5), "tensor-parallel size 5 does not divide the 64 GPUs"),
    (lambda: tokenloom.plan("llama2-70b", "a100-80gb", num_gpus=64, global_batch_size=64, train_iters=1,
                            tensor_parallel=16), "exceeds the 8 GPUs of a node"),
    (lambda: tokenloom.plan("gpt3-175b", "a100-80gb", num_gpus=64, global_batch_size=64, train_iters=1,
                            pipeline_parallel=7), "pipeline-parallel size 7 does not divide num_layers=96"),
    (lambda: tokenloom.plan("gpt3-175b", "a100-80gb", num_gpus=64, global_batch_size=63, train_iters=1,
                            tensor_parallel=8, pipeline_parallel=1), "global batch size 63 is not divisible"),
    (lambda: tokenloom.plan("gpt3-175b", "a100-80gb", num_gpus=64, global_batch_size=64, train_iters=1,
                            tensor_parallel=8, pipeline_parallel=1, micro_batch_size=3), "micro-batch"),
    (lambda: tokenloom.plan("gpt3-175b", "a100-80gb", global_batch_size=64, train_iters=1), "needs num_gpus"),
    (lambda: tokenloom.plan("gpt-5", "a100-80gb", num_gpus=8, global_batch_size=64, train_iters=1),
     "unknown model preset"),
    (lambda: tokenloom.plan("gpt3-175b", "a100-80gb", num_gpus=8, global_batch_size=64, train_iters=1, batch=3),
     "unknown plan arguments ['batch']"),
    (lambda: tp.evaluate_layout(tp.model_preset("gpt3-175b"), tp.ClusterSpec(num_gpus=64), tp.PlanOptions(),
                                global_batch_size=64, tensor_parallel=8, pipeline_parallel=5, virtual_pipeline=1,
                                micro_batch_size=1), "8 x 5 must be positive and divide the 64 GPUs"),
    (lambda: tp.evaluate_layout(tp.model_preset("gpt3-175b"), tp.ClusterSpec(num_gpus=64), tp.PlanOptions(),
                                global_batch_size=64, tensor_parallel=8, pipeline_parallel=4, virtual_pipeline=5,
                                micro_batch_size=1), "num_layers=96 is not divisible by pipeline x virtual = 4 x 5"),
    (lambda: tp.DataGeometry(seq_length=8, global_batch_size=10, micro_batch_size=2, data_parallel_size=2,
                             gradient_accumulation_steps=2, train_iters=1), "must equal micro_batch_size"),
])
def test_config_errors_name_the_value(build, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        build()
    assert needle in str(info.value)
    assert "--" not in str(info.value)


def test_batch_in_tokens_and_iterations_from_tokens() -> None:
    training = tp.TrainingSpec(global_batch_tokens=4 * 2**20, train_tokens=10**12)
    assert training.batch_samples(2048) == 2048
    assert training.iterations(2048) == math.ceil(10**12 / 2**22)


# ------------------------------------------------------------------ data geometry


def test_geometry_split_sizes_follow_megatron() -> None:
    geometry = tp.DataGeometry(seq_length=2048, global_batch_size=1536, micro_batch_size=1, data_parallel_size=16,
                               gradient_accumulation_steps=96, train_iters=95368, eval_interval=1000, eval_iters=100)
    assert geometry.train_samples == 95368 * 1536
    assert geometry.valid_samples == (95368 // 1000 + 1) * 100 * 1536
    assert geometry.test_samples == 100 * 1536
    assert geometry.samples_per_split == (geometry.train_samples, geometry.valid_samples, geometry.test_samples)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 8), st.integers(1, 64), st.integers(1, 64), st.integers(1, 10**6), st.integers(1, 5000),
       st.integers(0, 500), st.sampled_from(["g.json", "g.yaml", "g.yml"]))
def test_geometry_roundtrip(tmp_path_factory: pytest.TempPathFactory, micro: int, dp: int, accum: int, iters: int,
                            interval: int, eval_iters: int, name: str) -> None:
    geometry = tp.DataGeometry(seq_length=4096, global_batch_size=micro * dp * accum, micro_batch_size=micro,
                               data_parallel_size=dp, gradient_accumulation_steps=accum, train_iters=iters,
                               eval_interval=interval, eval_iters=eval_iters, tensor_model_parallel_size=2)
    path = geometry.write(tmp_path_factory.mktemp("geo") / name)
    text = path.read_text()
    parsed = yaml.safe_load(text) if name.endswith(("yaml", "yml")) else json.loads(text)
    assert parsed["valid_samples"] == geometry.valid_samples and parsed["format"] == "tokenloom-data-geometry"
    assert tp.DataGeometry.load(path) == geometry
    assert tp.DataGeometry.from_dict(geometry.to_dict()) == geometry


def test_geometry_file_errors(tmp_path) -> None:
    good = tp.DataGeometry(seq_length=8, global_batch_size=4, micro_batch_size=1, data_parallel_size=2,
                           gradient_accumulation_steps=2, train_iters=10).to_dict()
    for bad, needle in [({**good, "train_samples": 41}, "train_samples=41 disagrees"),
                        ({**good, "seq_len": 8}, "unknown keys ['seq_len']"),
                        ({k: v for k, v in good.items() if k != "train_iters"}, "missing keys ['train_iters']"),
                        ({**good, "format": "other"}, "format is 'other'"),
                        ({**good, "version": 2}, "version 2"),
                        ({**good, "micro_batch_size": 3}, "must equal micro_batch_size")]:
        with pytest.raises(FormatError, match=needle.replace("[", r"\[").replace("]", r"\]")):
            tp.DataGeometry.from_dict(bad)
    broken = tmp_path / "g.json"
    broken.write_text("{not json")
    with pytest.raises(FormatError, match=r"g\.json: not valid JSON"):
        tp.DataGeometry.load(broken)
    with pytest.raises(FormatError, match="cannot read"):
        tp.DataGeometry.load(tmp_path / "missing.yaml")


def test_plan_geometry_matches_best_layout() -> None:
    plan = tokenloom.plan("gpt3-175b", "a100-80gb", num_gpus=1024, global_batch_size=1536, train_tokens=300 * 10**9)
    geometry, best = plan.geometry(), plan.best
    assert (geometry.data_parallel_size, geometry.micro_batch_size, geometry.gradient_accumulation_steps) == \
        (best.data_parallel, best.micro_batch_size, best.num_microbatches)
    assert geometry.train_iters == math.ceil(300 * 10**9 / (1536 * 2048))
    assert plan.to_dict()["data_geometry"] == geometry.to_dict()


# ------------------------------------------------------------------ module, CLI


def test_plan_is_a_function_of_the_package() -> None:
    import tokenloom

    # tokenloom.plan(...) is a plain function; tokenloom.planning holds ModelSpec and friends.
    assert callable(tokenloom.plan) and not isinstance(tokenloom.plan, type(tp))
    result = tokenloom.plan("llama-7b", "h100-80gb", num_gpus=8, global_batch_size=64, train_iters=1)
    assert isinstance(result, tp.Plan) and result.feasible
    assert result == tokenloom.plan("llama-7b", "h100-80gb", num_gpus=8, global_batch_size=64, train_iters=1)


def _cli(argv: list[str]) -> int:
    from tokenloom.cli import main

    return main(argv)


def test_cli_json_and_geometry(tmp_path, capsys) -> None:
    out = tmp_path / "geometry.yaml"
    code = _cli(["plan", "--model", "gpt3-175b", "--num-gpus", "1024", "--global-batch-size", "1536",
                 "--train-tokens", "300e9", "--recompute", "full", "--json", "--top", "3",
                 "--write-geometry", str(out)])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert data["training_days_estimate"] == pytest.approx(33.8, abs=0.1) and len(data["layouts"]) == 3
    assert tp.DataGeometry.load(out).to_dict() == data["data_geometry"]


def test_cli_table_custom_model_and_infeasible(capsys) -> None:
    code = _cli(["plan", "--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32",
                 "--ffn-hidden-size", "11008", "--vocab-size", "32000", "--seq-length", "2048", "--swiglu",
                 "--no-bias", "--rmsnorm", "--rope", "--untie-embeddings", "--num-gpus", "8",
                 "--global-batch-size", "64", "--train-iters", "100"])
    text = capsys.readouterr().out
    assert code == 0 and "parameters 6,738,415,616" in text and "rank" in text and "#1 over #2" in text
    code = _cli(["plan", "--model", "llama3-405b", "--num-gpus", "8", "--global-batch-size", "64",
                 "--train-iters", "1"])
    assert code == 1 and "no layout fits: needs" in capsys.readouterr().out
    code = _cli(["plan", "--num-gpus", "8", "--global-batch-size", "8", "--train-iters", "1"])
    assert code == 2 and "give --model or all of --num-layers" in capsys.readouterr().err


# ------------------------------------------------------------------ differential: megatron-core itself


def test_microbatch_arithmetic_matches_megatron_core() -> None:
    calc = pytest.importorskip("megatron.core.num_microbatches_calculator")

    @settings(max_examples=150, deadline=None)
    @given(st.integers(1, 4096), st.integers(1, 16), st.integers(1, 64))
    def check(global_batch: int, micro: int, dp: int) -> None:
        try:
            expected = calc.ConstantNumMicroBatchesCalculator(global_batch, micro, dp, False, 1).get()
        except AssertionError:
            expected = None
        if expected is None:
            with pytest.raises(ConfigError):
                tp.DataGeometry(seq_length=8, global_batch_size=global_batch, micro_batch_size=micro,
                                data_parallel_size=dp, gradient_accumulation_steps=max(1, global_batch // (micro * dp)),
                                train_iters=1)
        else:
            geometry = tp.DataGeometry(seq_length=8, global_batch_size=global_batch, micro_batch_size=micro,
                                       data_parallel_size=dp, gradient_accumulation_steps=expected, train_iters=1)
            assert geometry.gradient_accumulation_steps == expected

    check()


@pytest.fixture(scope="module")
def megatron_gpt():
    """A one-rank gloo group and megatron-core's GPTModel builder, torn down after the module."""
    pytest.importorskip("megatron.core")
    import torch.distributed as dist
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    if dist.is_initialized():
        pytest.fail("a process group is already initialized; the planner test needs its own one-rank group")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel(1, 1)

        def build(spec: tp.ModelSpec) -> int:
            config = TransformerConfig(
                num_layers=spec.num_layers, hidden_size=spec.hidden_size, num_attention_heads=spec.num_attention_heads,
                num_query_groups=spec.num_query_groups, ffn_hidden_size=spec.ffn_size, kv_channels=spec.kv_channels,
                gated_linear_unit=spec.gated_linear_unit, activation_func=F.silu if spec.gated_linear_unit else F.gelu,
                add_bias_linear=spec.add_bias_linear, normalization=spec.normalization, use_cpu_initialization=True)
            layer_spec = get_gpt_layer_local_spec(normalization=spec.normalization)
            model = GPTModel(config=config, transformer_layer_spec=layer_spec,
                             vocab_size=spec.vocab_size, max_sequence_length=spec.seq_length,
                             position_embedding_type=spec.position_embedding_type,
                             share_embeddings_and_output_weights=not spec.untie_embeddings_and_output_weights)
            return sum(p.numel() for p in model.parameters())

        yield build
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


megatron_shapes = st.builds(
    lambda l, a, groups, head_dim, kv_channels, ffn, V, s, gated, bias, norm, pos, untie: tp.ModelSpec(
        num_layers=l, hidden_size=a * head_dim, num_attention_heads=a,
        num_query_groups=groups if a % groups == 0 else None,
        kv_channels=kv_channels, ffn_hidden_size=ffn, vocab_size=V, seq_length=s, gated_linear_unit=gated,
        add_bias_linear=bias, normalization=norm, position_embedding_type=pos,
        untie_embeddings_and_output_weights=untie),
    st.integers(1, 3), st.sampled_from([1, 2, 4, 6]), st.sampled_from([1, 2, 3]), st.sampled_from([4, 8, 16]),
    st.sampled_from([None, 4, 12]), st.sampled_from([None, 24, 100]), st.integers(8, 300), st.integers(4, 64),
    st.booleans(), st.booleans(), st.sampled_from(["LayerNorm", "RMSNorm"]),
    st.sampled_from(["learned_absolute", "rope"]), st.booleans())


def test_parameter_count_matches_megatron_core(megatron_gpt) -> None:
    @settings(max_examples=40, deadline=None)
    @given(megatron_shapes)
    def check(spec: tp.ModelSpec) -> None:
        assert formulas.parameter_count(spec) == megatron_gpt(spec)

    check()
    # ...and a preset's exact shape scaled down to a few layers.
    small_llama = replace(tp.model_preset("llama2-70b"), num_layers=1, hidden_size=256, num_attention_heads=8,
                          num_query_groups=2, ffn_hidden_size=640, vocab_size=1000, seq_length=64)
    assert formulas.parameter_count(small_llama) == megatron_gpt(small_llama)


def test_geometry_configures_build_and_serve(tmp_path) -> None:
    # The plan's file is what the next stages read: build takes the split sizes, serve the batch shape.
    from tokenloom.builder.config import build_config_from_dict
    from tokenloom.serve.geometry import BatchGeometry

    plan = tokenloom.plan("llama-7b", "a100-80gb", num_gpus=16, global_batch_size=256, train_iters=2500,
                          eval_interval=500, eval_iters=10)
    geometry = plan.geometry()
    geometry.write(tmp_path / "geometry.yaml")
    config = build_config_from_dict({"geometry": "geometry.yaml", "blend": [["corpus"], None], "split": "969,30,1"},
                                    base_dir=str(tmp_path))
    assert config.samples_per_split == (2500 * 256, (2500 // 500 + 1) * 10 * 256, 10 * 256)
    assert config.seq_length == 2048
    batches = BatchGeometry.from_data_geometry(geometry)
    assert (batches.dp, batches.micro_batch_size, batches.num_micro_batches) == \
        (plan.best.data_parallel, plan.best.micro_batch_size, plan.best.num_microbatches)


# Runs on each of two real gloo ranks: builds megatron-core GPTModels with (t, p) = (2, 1) and (1, 2)
# and prints every rank's parameter count. A separate process keeps torch.distributed out of pytest's.
_SHARD_WORKER = r"""
import json, sys, warnings
warnings.filterwarnings("ignore")
rank, world, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
configs = json.loads(sys.stdin.read())
import torch
import torch.distributed as dist
import torch.nn.functional as F
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
from megatron.core import parallel_state as ps
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig
out = []
try:
    for tp_size, pp_size in ((world, 1), (1, world)):
        ps.initialize_model_parallel(tp_size, pp_size)
        try:
            for c in configs:
                config = TransformerConfig(
                    num_layers=c["num_layers"], hidden_size=c["hidden_size"],
                    num_attention_heads=c["num_attention_heads"], num_query_groups=c["num_query_groups"],
                    ffn_hidden_size=c["ffn_hidden_size"], kv_channels=c["kv_channels"],
                    gated_linear_unit=c["gated_linear_unit"],
                    activation_func=F.silu if c["gated_linear_unit"] else F.gelu,
                    add_bias_linear=c["add_bias_linear"], normalization=c["normalization"],
                    use_cpu_initialization=True, init_model_with_meta_device=True,
                    tensor_model_parallel_size=tp_size, pipeline_model_parallel_size=pp_size,
                    pipeline_dtype=torch.float32)
                model = GPTModel(
                    config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization=c["normalization"]),
                    vocab_size=c["vocab_size"], max_sequence_length=c["seq_length"],
                    position_embedding_type=c["position_embedding_type"],
                    share_embeddings_and_output_weights=not c["untie_embeddings_and_output_weights"],
                    pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())
                out.append([tp_size, pp_size, sum(p.numel() for p in model.parameters())])
        finally:
            ps.destroy_model_parallel()
finally:
    dist.destroy_process_group()
print("RESULT " + json.dumps(out))
"""

shard_shapes = st.builds(
    lambda l, a, grouped, head_dim, ffn, half_vocab, s, gated, bias, norm, pos, untie: tp.ModelSpec(
        num_layers=l, hidden_size=a * head_dim, num_attention_heads=a, num_query_groups=2 if grouped else None,
        ffn_hidden_size=ffn, vocab_size=2 * half_vocab, seq_length=s, gated_linear_unit=gated, add_bias_linear=bias,
        normalization=norm, position_embedding_type=pos, untie_embeddings_and_output_weights=untie),
    st.sampled_from([2, 4, 6]), st.sampled_from([2, 4, 8]), st.booleans(), st.sampled_from([4, 8]),
    st.sampled_from([None, 24, 100]), st.integers(4, 200), st.integers(4, 64), st.booleans(), st.booleans(),
    st.sampled_from(["LayerNorm", "RMSNorm"]), st.sampled_from(["learned_absolute", "rope"]), st.booleans())


def test_stage_shards_match_megatron_core_ranks() -> None:
    pytest.importorskip("megatron.core")
    import dataclasses
    import pathlib
    import shutil
    import subprocess
    import sys
    import tempfile

    from hypothesis import Phase

    @settings(max_examples=1, phases=[Phase.generate], deadline=None)
    @given(st.lists(shard_shapes, min_size=10, max_size=10))
    def check(specs: list[tp.ModelSpec]) -> None:
        specs = [*specs, tp.model_preset("gpt3-175b", num_layers=2, hidden_size=96, num_attention_heads=8,
                                         vocab_size=512, seq_length=64)]
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        workdir = pathlib.Path(tempfile.mkdtemp(prefix="plan-shards-"))
        (workdir / "configs.json").write_text(json.dumps([dataclasses.asdict(spec) for spec in specs]))
        procs, logs = [], []
        try:
            for rank in range(2):
                out, err = open(workdir / f"{rank}.out", "w"), open(workdir / f"{rank}.err", "w")
                logs += [out, err]
                procs.append(subprocess.Popen([sys.executable, "-c", _SHARD_WORKER, str(rank), "2", str(port)],
                                              stdin=open(workdir / "configs.json"), stdout=out, stderr=err))
            for proc in procs:
                proc.wait(timeout=240)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
            for log in logs:
                log.close()
        results = []
        for rank, proc in enumerate(procs):
            lines = [x for x in (workdir / f"{rank}.out").read_text().splitlines() if x.startswith("RESULT ")]
            assert proc.returncode == 0 and lines, (workdir / f"{rank}.err").read_text()[-3000:]
            results.append(json.loads(lines[-1][len("RESULT "):]))
        shutil.rmtree(workdir)
        n = len(specs)
        for i, spec in enumerate(specs):
            tp2 = formulas.stage_parameter_counts(spec, tensor_parallel=2, pipeline_parallel=1)
            pp2 = formulas.stage_parameter_counts(spec, tensor_parallel=1, pipeline_parallel=2)
            assert [results[0][i][2], results[1][i][2]] == [tp2[0], tp2[1]], spec
            assert [results[0][n + i][2], results[1][n + i][2]] == [pp2[0], pp2[1]], spec

    check()


def test_token_counts_may_be_written_as_floats() -> None:
    # the README writes train_tokens=300e9; an integral float is the same count, a fraction is refused
    as_float = tokenloom.plan("gpt3-175b", "a100-80gb", num_gpus=1024, global_batch_size=1536, train_tokens=300e9)
    as_int = tokenloom.plan("gpt3-175b", "a100-80gb", num_gpus=1024, global_batch_size=1536,
                            train_tokens=300_000_000_000)
    assert as_float == as_int
    with pytest.raises(ConfigError, match="train_tokens must be a positive integer"):
        tp.TrainingSpec(global_batch_size=8, train_tokens=1.5)
