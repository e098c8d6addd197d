"""Stateless packed-sample index against megatron-core's GPTDataset index build, same run.

    flock /tmp/tokenloom-bench.lock python benchmarks/bench_stateless.py --num-documents 1e6 1e7 1e8

Inputs are bench_index.py's: lognormal document lengths with mean ~1000 tokens, one split of every
document (handed over as megatron-core's int32 id array), ``--epochs`` (1.5) epochs' worth of
``--seq-length`` (2048) samples, so two epochs with a separate final epoch. Each (size, mode) runs
in a fresh child process, after a warm-up on a tiny input (imports, numba's on-disk cache):

* build: wall seconds and CPU seconds of the build (CPU time is the steadier figure on a shared
  machine); "peak RSS" is the child's high-water mark (inputs included); "build RSS" what the
  build added over the inputs (VmHWM after minus VmRSS before, VmHWM reset just before).
* random access (stateless only, one thread): ``spans()`` and ``sample_bounds()`` of 1e6 uniformly
  random sample ids, samples per CPU second. megatron-core's lookup is two array reads once built.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_index import _reset_peak_rss, _status_kib, build_megatron_core, synthetic_lengths

RANDOM_ACCESS_QUERIES = 1_000_000


def build_stateless(lengths, document_ids, num_samples, seq_length, seed, backend="numba", block_size=None,
                    threads=1):
    from tokenloom.index.stateless import DEFAULT_BLOCK_SIZE, build_stateless_gpt_index

    return build_stateless_gpt_index(lengths, document_ids, num_samples=num_samples, seq_length=seq_length,
                                     seed=seed, backend=backend, block_size=block_size or DEFAULT_BLOCK_SIZE,
                                     threads=threads)


def build_stateless_numpy(lengths, document_ids, num_samples, seq_length, seed, block_size=None, threads=1):
    return build_stateless(lengths, document_ids, num_samples, seq_length, seed, "numpy", block_size)


MODES: dict[str, Callable] = {
    "megatron-core": build_megatron_core,
    "stateless": build_stateless,
    "stateless-numpy": build_stateless_numpy,
}
"""name -> build(lengths, document_ids, num_samples, seq_length, seed)."""


def run_child(mode: str, num_documents: int, epochs: float, seq_length: int, seed: int, block_size: int | None,
              threads: int) -> dict:
    build = MODES[mode]
    kwargs = {} if mode == "megatron-core" else dict(block_size=block_size, threads=threads)
    warm = synthetic_lengths(64, seed=1)
    warmed = build(warm, np.arange(64, dtype=np.int32), 40, 8, seed, **kwargs)
    if hasattr(warmed, "spans"):
        warmed.spans(np.arange(10))
        warmed.sample_bounds(np.arange(10))
    lengths = synthetic_lengths(num_documents)
    document_ids = np.arange(num_documents, dtype=np.int32)
    num_tokens = int(lengths.sum(dtype=np.int64))
    num_samples = int(epochs * num_tokens / seq_length)
    before_kib = _status_kib("VmRSS")
    _reset_peak_rss()
    wall, cpu = time.perf_counter(), time.process_time()
    built = build(lengths, document_ids, num_samples, seq_length, seed, **kwargs)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    high_kib = _status_kib("VmHWM")
    result = dict(mode=mode, num_documents=num_documents, num_tokens=num_tokens, num_samples=num_samples,
                  wall_s=wall, cpu_s=cpu, peak_rss_kib=high_kib, build_rss_kib=high_kib - before_kib)
    if hasattr(built, "spans"):
        rng = np.random.default_rng(0)
        queries = rng.integers(0, built.num_samples, RANDOM_ACCESS_QUERIES, dtype=np.int64)
        start = time.process_time()
        spans = built.spans(queries)
        result["spans_per_s"] = RANDOM_ACCESS_QUERIES / (time.process_time() - start)
        start = time.process_time()
        built.sample_bounds(queries)
        result["bounds_per_s"] = RANDOM_ACCESS_QUERIES / (time.process_time() - start)
        result["index_bytes"] = built.nbytes
        result["block_size"] = built.block_size
        result["rows"] = built.num_samples
        assert np.all(np.add.reduceat(spans.lengths, spans.bounds[:-1]) == seq_length + 1)
    else:
        result["rows"] = int(built["sample_index"].shape[0]) - 1
    return result


def _gib(kib: float) -> str:
    return f"{kib / 2**20:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-documents", nargs="+", type=float, default=[1e6, 1e7, 1e8])
    parser.add_argument("--modes", nargs="+", default=["megatron-core", "stateless"], choices=sorted(MODES))
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--epochs", type=float, default=1.5, help="samples requested, in epochs")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--block-size", type=int, default=None, help="stateless K (default: the library's)")
    parser.add_argument("--threads", type=int, default=1, help="stateless build threads (numba)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:
        print(json.dumps(run_child(args.child, int(args.num_documents[0]), args.epochs, args.seq_length,
                                   args.seed, args.block_size, args.threads)))
        return 0

    results: dict[tuple[int, str], dict] = {}
    for size in (int(n) for n in args.num_documents):
        for mode in args.modes:
            command = [sys.executable, __file__, "--child", mode, "--num-documents", str(size),
                       "--seq-length", str(args.seq_length), "--epochs", str(args.epochs), "--seed", str(args.seed)]
            if args.block_size:
                command += ["--block-size", str(args.block_size)]
            command += ["--threads", str(args.threads)]
            done = subprocess.run(command, capture_output=True, text=True, env=os.environ.copy())
            if done.returncode != 0:
                print(f"{mode} at {size} documents failed:\n{done.stderr[-2000:]}", file=sys.stderr)
                continue
            results[size, mode] = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"measured {mode} at {size:.0e}: {results[size, mode]['cpu_s']:.2f} CPU s", file=sys.stderr)

    peer = "megatron-core"
    print(f"seq_length {args.seq_length}, {args.epochs} epochs requested, stateless threads {args.threads}; "
          "times in seconds, memory in GiB\n")
    print("| documents | mode | samples | build wall | build CPU | CPU speedup | peak RSS | build RSS | "
          "build RSS / peer's | index bytes | spans/s (1 core) | bounds/s (1 core) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (size, mode), r in results.items():
        base = results.get((size, peer))
        speedup = f"{base['cpu_s'] / r['cpu_s']:.1f}x" if base else "n/a"
        has_base = base and base["build_rss_kib"] > 0
        memory = f"{100 * r['build_rss_kib'] / base['build_rss_kib']:.1f}%" if has_base else "n/a"
        index_bytes = f"{r['index_bytes'] / 2**20:.1f} MiB" if "index_bytes" in r else "-"
        spans = f"{r['spans_per_s']:.3g}" if "spans_per_s" in r else "-"
        bounds = f"{r['bounds_per_s']:.3g}" if "bounds_per_s" in r else "-"
        print(f"| {size:.0e} | {mode} | {r['rows']} | {r['wall_s']:.2f} | {r['cpu_s']:.2f} | {speedup} | "
              f"{_gib(r['peak_rss_kib'])} | {_gib(r['build_rss_kib'])} | {memory} | {index_bytes} | {spans} | "
              f"{bounds} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
