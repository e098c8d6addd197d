#!/usr/bin/env bash
# Install tokenloom with everything its test suite needs, on a fresh machine.
#   bash scripts/dev-setup.sh
# torch is pinned to the CPU wheel this workplace keeps on disk (a plain `torch` would pull a
# multi-GB CUDA build). megatron-core 0.19.2 declares Python >= 3.12 but its cp311 wheel works;
# it is installed without its dependency resolution, plus the two packages it imports.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -m pip install --quiet --upgrade pip
$PY -m pip install --quiet "torch==2.13.0"
$PY -m pip install --quiet -e ".[dev]" "packaging>=24.2"
if ! $PY -c "import megatron.core" >/dev/null 2>&1; then
  wheel_dir=$(mktemp -d)
  $PY -m pip download --quiet megatron-core==0.19.2 --no-deps --ignore-requires-python -d "$wheel_dir"
  $PY -m pip install --quiet --no-deps --ignore-requires-python "$wheel_dir"/megatron_core-*.whl
  rm -rf "$wheel_dir"
fi
$PY -m pip install --quiet triton
# torchdata's StatefulDataLoader; --no-deps so its bare `torch` requirement cannot pull a CUDA build.
$PY -m pip install --quiet --no-deps "torchdata==0.11.0" && $PY -m pip install --quiet requests urllib3
# torchtitan 0.3.0's dataloader and attention modules, for examples/torchtitan_source.py: --no-deps
# (its declared needs include datasets, wandb and tensorboard, which those modules never import).
$PY -m pip install --quiet --no-deps "torchtitan==0.3.0" "spmd_types==0.2.3" "tyro>=0.9" "docstring-parser>=0.16" \
  "typeguard>=4.0"
# JAX on the CPU, for the JAX adapter's multi-process tests.
$PY -m pip install --quiet "jax[cpu]>=0.4.30"
# jinja2 and transformers come with .[dev] (chat templates; Megatron-LM's SFTTokenizer goes through
# transformers): checked here with the rest, since the chat differential test needs both.
$PY -c "import tokenloom, torch, jax, torchdata, torchtitan.components.dataloader, megatron.core.datasets.helpers_cpp, jinja2, transformers; print('tokenloom', tokenloom.__version__, '| torch', torch.__version__, '| jax', jax.__version__, '| transformers', transformers.__version__, '| megatron-core ready')"
