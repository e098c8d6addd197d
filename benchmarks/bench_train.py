"""The loader's cost inside a training step: examples/pretrain_gpt.py on the demo's build.

    flock /tmp/tokenloom-bench.lock python benchmarks/bench_train.py --work /tmp/tl_train

Tokenizes the demo corpora (the Python standard library, byte tokenizer) and writes the demo's
build config once under ``--work``, then runs ``examples/pretrain_gpt.py`` under torchrun for each
configuration (ranks x model size x DataLoader workers) and reads its metrics: per optimizer step
the wall time of the step and the time rank 0 waited for its micro-batches (``data_wait_s``: from
asking ``DistributedBatches`` for the step's first micro-batch to holding its last). The first
``--skip`` steps (worker start-up, allocator warm-up) are left out; the table gives the share of
step time spent waiting (sum of waits / sum of step times), the median step, and tokens/s. On a
machine with CUDA the same command trains on the GPUs (NCCL).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(os.path.dirname(HERE), "examples", "pretrain_gpt.py")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def demo_build(work: str) -> str:
    """The demo's stores and build config under ``work`` (made once)."""
    path = os.path.join(work, "build.yaml")
    if not os.path.exists(path):
        from tokenloom.examples.demo import tokenize_corpora, write_build_config

        stores = tokenize_corpora(work)
        path = write_build_config(work, stores)
    return path


def run(build: str, work: str, *, ranks: int, steps: int, global_batch: int, micro_batch: int, workers: int,
        layers: int, hidden: int, heads: int) -> list[dict]:
    name = f"r{ranks}-l{layers}-h{hidden}-w{workers}"
    checkpoint = os.path.join(work, "ckpt", name)
    metrics = os.path.join(work, f"{name}.jsonl")
    if os.path.exists(os.path.join(checkpoint, "checkpoint.pt")):
        os.remove(os.path.join(checkpoint, "checkpoint.pt"))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr",
               "127.0.0.1", "--master-port", str(_free_port()), EXAMPLE, "--build", build, "--steps", str(steps),
               "--global-batch-size", str(global_batch), "--micro-batch-size", str(micro_batch),
               "--checkpoint", checkpoint, "--metrics", metrics, "--num-workers", str(workers),
               "--layers", str(layers), "--hidden", str(hidden), "--heads", str(heads),
               "--save-interval", str(steps + 1)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{name} failed:\n{result.stderr[-3000:]}")
    with open(metrics, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default="/tmp/tl_train")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--skip", type=int, default=5, help="first steps left out (start-up)")
    parser.add_argument("--global-batch-size", type=int, default=32)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--only", type=int, help="run only the first N configurations")
    args = parser.parse_args()
    os.makedirs(args.work, exist_ok=True)
    build = demo_build(args.work)
    configs = [  # (ranks, layers, hidden, heads, workers)
        (2, 2, 64, 4, 1), (2, 2, 64, 4, 0), (1, 2, 64, 4, 1), (2, 4, 128, 4, 1), (2, 4, 128, 4, 0),
    ]
    if args.only:
        configs = configs[:args.only]
    rows = []
    print("| ranks | model (layers x width) | workers | median step s | data wait / step time | tokens/s "
          "| final loss |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for ranks, layers, hidden, heads, workers in configs:
        records = run(build, args.work, ranks=ranks, steps=args.steps, global_batch=args.global_batch_size,
                      micro_batch=args.micro_batch_size, workers=workers, layers=layers, hidden=hidden,
                      heads=heads)[args.skip:]
        step_s = sum(r["step_s"] for r in records)
        wait_s = sum(r["data_wait_s"] for r in records)
        tokens = sum(r["tokens"] for r in records)
        row = {"ranks": ranks, "layers": layers, "hidden": hidden, "workers": workers,
               "median_step_s": statistics.median(r["step_s"] for r in records), "wait_share": wait_s / step_s,
               "tokens_per_s": tokens / step_s, "final_loss": records[-1]["loss"], "steps": len(records)}
        rows.append(row)
        print(f"| {ranks} | {layers} x {hidden} | {workers} | {row['median_step_s']:.3f} | "
              f"{100 * row['wait_share']:.2f}% | {row['tokens_per_s']:,.0f} | {row['final_loss']:.3f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
