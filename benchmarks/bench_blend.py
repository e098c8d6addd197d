"""Blend index builders: megatron-core's C++ greedy vs tokenloom, measured in one run.

    flock /tmp/tokenloom-bench.lock python benchmarks/bench_blend.py
    flock /tmp/tokenloom-bench.lock python benchmarks/bench_blend.py --datasets 1000 --sizes 10000000

Columns: megatron-core ``build_blending_indices`` (C++), ``megatron_blend`` (identical arrays,
checked every row) and ``Blend.materialize``, each on one thread and on ``--threads`` threads,
and ``Blend.lookup`` of every position in a random order (per-position random access), with
their speed-ups over megatron-core. Weights are
uniform random in (0, 1], normalised like megatron-core's BlendedDataset does. Each cell is the
best of ``--repeat`` runs; kernels are compiled before timing.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import time

import numpy as np

from tokenloom.index.blend import Blend
from tokenloom.index.megatron_blend import megatron_blend


def megatron_core_blend(weights: np.ndarray, size: int):
    from megatron.core.datasets import helpers_cpp

    dataset_index = np.zeros(size, dtype=np.int16)
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    helpers_cpp.build_blending_indices(dataset_index, dataset_sample_index, weights, len(weights), size, False)
    return dataset_index, dataset_sample_index


def best_of(repeat: int, function, *args):
    best, result = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        result = function(*args)
        best = min(best, time.perf_counter() - start)
    return best, result


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datasets", type=int, nargs="+", default=[10, 100, 1000, 10000])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 10_000_000, 50_000_000])
    parser.add_argument("--repeat", type=int, default=1, help="runs per cell; the best is kept")
    parser.add_argument("--skip-megatron-above", type=float, default=float("inf"),
                        help="skip megatron-core (and the ratio) where datasets x size exceeds this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2,
                        help="also run megatron_blend on this many threads (chunks; identical arrays); 1: skip")
    args = parser.parse_args(argv)

    rng = np.random.default_rng(args.seed)
    # compile the kernels outside the timings
    warm = Blend([1.0, 2.0, 3.0], 1000)
    warm.materialize()
    warm.materialize(threads=2)
    warm.lookup(np.arange(10))
    megatron_blend(np.full(40, 1 / 40), 5000)
    if args.threads > 1:  # the threaded path's repair kernel too
        warm_weights = np.random.default_rng(12345).random(300) + 1e-3
        megatron_blend(warm_weights / warm_weights.sum(), 600_000, threads=args.threads)
    megatron_core_blend(np.array([0.5, 0.5]), 10)  # imports megatron-core (and torch) untimed

    threaded = args.threads > 1
    print(f"machine: {cpu_name()}, {os.cpu_count()} logical CPUs; numpy {np.__version__}; one thread each"
          + (f" except the columns on {args.threads} threads" if threaded else ""))
    print()
    extra_head = f" megatron_blend, {args.threads} threads (s) | x |" if threaded else ""
    materialize_head = f" Blend.materialize, {args.threads} threads (s) | x |" if threaded else ""
    print("| datasets | size | megatron-core (s) | megatron_blend (s) | x |" + extra_head
          + " Blend.materialize (s) | x |" + materialize_head + " Blend.lookup (s) | x | lookups/s |")
    print("|---:|---:|---:|---:|---:|" + ("---:|---:|" if threaded else "") + "---:|---:|"
          + ("---:|---:|" if threaded else "") + "---:|---:|---:|")
    for num_datasets in args.datasets:
        weights = rng.random(num_datasets) + 1e-3
        weights = weights / weights.sum()
        for size in args.sizes:
            run_megatron = num_datasets * size <= args.skip_megatron_above
            if run_megatron:
                t_core, core = best_of(args.repeat, megatron_core_blend, weights, size)
            t_ours, ours = best_of(args.repeat, megatron_blend, weights, size)
            if run_megatron:
                same = np.array_equal(core[0], ours[0]) and np.array_equal(core[1], ours[1])
                if not same:
                    raise SystemExit(f"megatron_blend differs from megatron-core at D={num_datasets}, size={size}")
                del core
            if threaded:
                t_threads, theirs = best_of(args.repeat,
                                            functools.partial(megatron_blend, weights, size, threads=args.threads))
                if not (np.array_equal(theirs[0], ours[0]) and np.array_equal(theirs[1], ours[1])):
                    raise SystemExit(f"megatron_blend on {args.threads} threads differs at D={num_datasets}, "
                                     f"size={size}")
                del theirs
            del ours
            blend = Blend(weights, size)
            t_mat, plain = best_of(args.repeat, blend.materialize)
            if threaded:
                t_mat_threads, split = best_of(args.repeat, functools.partial(blend.materialize, threads=args.threads))
                if not (np.array_equal(split[0], plain[0]) and np.array_equal(split[1], plain[1])):
                    raise SystemExit(f"Blend.materialize on {args.threads} threads differs at D={num_datasets}, "
                                     f"size={size}")
                del split
            del plain
            positions = rng.permutation(size)
            t_look, _ = best_of(args.repeat, blend.lookup, positions)
            del positions

            def ratio(t, t_core=t_core, run_megatron=run_megatron):
                return f"{t_core / t:.1f}" if run_megatron else "-"

            core_cell = f"{t_core:.3f}" if run_megatron else "skipped"
            extra_cells = f" {t_threads:.3f} | {ratio(t_threads)} |" if threaded else ""
            materialize_cells = f" {t_mat_threads:.3f} | {ratio(t_mat_threads)} |" if threaded else ""
            print(f"| {num_datasets} | {size:.0e} | {core_cell} | {t_ours:.3f} | {ratio(t_ours)} |{extra_cells} "
                  f"{t_mat:.3f} | {ratio(t_mat)} |{materialize_cells} {t_look:.3f} | {ratio(t_look)} | "
                  f"{size / t_look / 1e6:.1f} M |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
