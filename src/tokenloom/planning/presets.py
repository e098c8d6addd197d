"""Well-known models and GPUs, by name. The formulas never special-case them.

Model shapes are taken from the papers and released configs named in each comment; the tests
check the parameter counts these shapes give against the published totals.
"""

from __future__ import annotations

from dataclasses import replace

from tokenloom.errors import ConfigError
from tokenloom.planning.specs import ClusterSpec, ModelSpec

_GPT = dict(vocab_size=51200, seq_length=2048)  # Narayanan 2021, Table 1: V = 51,200, s = 2,048
_LLAMA = dict(gated_linear_unit=True, add_bias_linear=False, normalization="RMSNorm",
              position_embedding_type="rope", untie_embeddings_and_output_weights=True)

MODEL_PRESETS: dict[str, ModelSpec] = {
    # GPT-3 175B as trained by Megatron-LM (Narayanan 2021, Table 1: l=96, h=12288, a=96).
    "gpt3-175b": ModelSpec(num_layers=96, hidden_size=12288, num_attention_heads=96, **_GPT),
    # The 1T model of Narayanan 2021, Table 1 (l=128, h=25600, a=160; trained with t=8, p=64 on 3072 GPUs).
    "gpt-1t": ModelSpec(num_layers=128, hidden_size=25600, num_attention_heads=160, **_GPT),
    # LLaMA 7B (Touvron et al. 2023): 6,738,415,616 parameters.
    "llama-7b": ModelSpec(num_layers=32, hidden_size=4096, num_attention_heads=32, ffn_hidden_size=11008,
                          vocab_size=32000, seq_length=2048, **_LLAMA),
    # Llama 2 70B (Touvron et al. 2023b), grouped-query attention with 8 KV heads: 68,976,648,192 parameters.
    "llama2-70b": ModelSpec(num_layers=80, hidden_size=8192, num_attention_heads=64, num_query_groups=8,
                            ffn_hidden_size=28672, vocab_size=32000, seq_length=4096, **_LLAMA),
    # Llama 3.1 405B (Llama Team 2024), 8 KV heads, 128K vocabulary: 405,853,388,800 parameters.
    "llama3-405b": ModelSpec(num_layers=126, hidden_size=16384, num_attention_heads=128, num_query_groups=8,
                             ffn_hidden_size=53248, vocab_size=128256, seq_length=8192, **_LLAMA),
}

#: Per-GPU figures. achieved_tflops is a typical sustained rate for large dense models, not a promise.
GPU_PRESETS: dict[str, dict[str, float]] = {
    # A100 SXM 80 GB: 312 TFLOP/s bf16; Megatron-LM sustained 138-163 (Narayanan 2021).
    "a100-80gb": dict(memory_per_gpu_gib=80.0, peak_tflops=312.0, achieved_tflops=140.0,
                      intra_node_bandwidth_gbps=300.0, inter_node_bandwidth_gbps=25.0),
    # H100 SXM 80 GB: 989 TFLOP/s dense bf16; Llama 3 405B sustained 380-430 (Llama Team 2024).
    "h100-80gb": dict(memory_per_gpu_gib=80.0, peak_tflops=989.0, achieved_tflops=400.0,
                      intra_node_bandwidth_gbps=450.0, inter_node_bandwidth_gbps=50.0),
    # H200 SXM 141 GB: same compute as H100, more memory.
    "h200-141gb": dict(memory_per_gpu_gib=141.0, peak_tflops=989.0, achieved_tflops=400.0,
                       intra_node_bandwidth_gbps=450.0, inter_node_bandwidth_gbps=50.0),
}


def model_preset(name: str, **overrides: object) -> ModelSpec:
    """The named model, with any field replaced (e.g. ``seq_length=4096``)."""
    try:
        spec = MODEL_PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown model preset {name!r}; known presets: {sorted(MODEL_PRESETS)}") from None
    return replace(spec, **overrides) if overrides else spec


def cluster_preset(name: str, *, num_gpus: int, **overrides: object) -> ClusterSpec:
    """A cluster of ``num_gpus`` of the named GPU, with any field replaced."""
    try:
        gpu = GPU_PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown GPU preset {name!r}; known presets: {sorted(GPU_PRESETS)}") from None
    return ClusterSpec(num_gpus=num_gpus, **{**gpu, **overrides})


def model_preset_names() -> tuple[str, ...]:
    """The names :func:`model_preset` knows, sorted (the CLI's ``--model`` choices)."""
    return tuple(sorted(MODEL_PRESETS))


def gpu_preset_names() -> tuple[str, ...]:
    """The GPU names :func:`cluster_preset` knows, sorted (the CLI's ``--gpu`` choices)."""
    return tuple(sorted(GPU_PRESETS))


__all__ = ["GPU_PRESETS", "MODEL_PRESETS", "cluster_preset", "gpu_preset_names", "model_preset", "model_preset_names"]
