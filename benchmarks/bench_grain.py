"""grain's path against HostLoader: host batches per second, in one run.

    flock /tmp/tokenloom-bench.lock python benchmarks/bench_grain.py --tokens-per-store 20000000

Three stores of lognormal documents (real tokens, EOD-terminated; ``bench_serve.write_store``) are
built into one split (exact mode), and every reader below serves the same host batches of
``--global-batch`` samples of ``--seq-length`` tokens with MaxText's packed-input fields
(``inter_document_masking``, ``boundary_format="segments"``, EOD loss mask), one host:

* ``HostLoader`` -- the peer: tokenloom's JAX loader in the calling process;
* ``GrainStream`` -- the same stream as a grain IterDataset, in the calling process and under
  grain's ``mp_prefetch`` with ``--workers`` worker processes (each reads every W-th step);
* ``GrainSource`` -- the split as grain's RandomAccessDataSource, ``MapDataset.source(...).batch``
  in stream order, in the calling process and under ``mp_prefetch``.

Each reader serves ``--steps`` host batches after ``--warmup`` (worker start-up and the first
maps are left out: a training run pays them once); the readers take turns over ``--rounds`` rounds
and the table keeps each one's median rate, as a ratio to HostLoader's in the same round. Every
reader's batches are checked equal to HostLoader's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def _readers(split, args):
    import grain

    from tokenloom.serve import SampleOptions
    from tokenloom.serve.grain_adapter import GrainSource, GrainStream
    from tokenloom.serve.jax_adapter import HostLoader, ShardOptions

    options = SampleOptions(eod_mask_loss=True, inter_document_masking=True, boundary_format="segments")
    shard = ShardOptions(shard_index=0, shard_count=1)
    steps = args.warmup + args.steps

    def host_loader():
        return iter(HostLoader(split, global_batch_size=args.global_batch, shard=shard, options=options,
                               max_steps=steps))

    def stream(workers):
        def make():
            dataset = GrainStream(split, global_batch_size=args.global_batch, shard=shard, options=options,
                                  max_steps=steps)
            if workers:
                dataset = dataset.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
            return iter(dataset)
        return make

    def source(workers):
        def make():
            dataset = grain.MapDataset.source(GrainSource(split, options=options))[:steps * args.global_batch]
            dataset = dataset.batch(args.global_batch, drop_remainder=True).to_iter_dataset()
            if workers:
                dataset = dataset.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
            return iter(dataset)
        return make

    out = {"HostLoader": host_loader, "GrainStream": stream(0)}
    out.update({f"GrainStream, {w} worker{'s' * (w > 1)}": stream(w) for w in args.workers})
    out["GrainSource batched"] = source(0)
    out.update({f"GrainSource batched, {w} worker{'s' * (w > 1)}": source(w) for w in args.workers})
    return out


def _time(make, args, reference=None) -> tuple[float, list]:
    it = make()
    first = [next(it) for _ in range(args.warmup)]
    start = time.perf_counter()
    batches = [next(it) for _ in range(args.steps)]
    seconds = time.perf_counter() - start
    del it
    if reference is not None:  # the same host batches as HostLoader
        for got, want in zip(first + batches, reference):
            for name in want:
                if not np.array_equal(np.asarray(got[name]), want[name]):
                    raise SystemExit(f"a reader's field {name} differs from HostLoader's")
    return args.steps * args.global_batch / seconds, first + batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens-per-store", type=int, default=20_000_000)
    parser.add_argument("--mean-length", type=float, default=800.0)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--directory", default=None)
    parser.add_argument("--json")
    args = parser.parse_args()

    from absl import flags

    flags.FLAGS.mark_as_parsed()  # grain's worker processes read absl flags; a program's main parses them
    import tokenloom
    from bench_serve import write_store

    directory = args.directory or tempfile.mkdtemp(prefix="tl_grain_")
    os.makedirs(directory, exist_ok=True)
    prefixes = []
    for i in range(3):
        prefix = os.path.join(directory, f"store{i}")
        if not os.path.exists(prefix + ".idx"):
            write_store(prefix, int(args.tokens_per_store / args.mean_length), args.mean_length, seed=i)
        prefixes.append(prefix)
    config = {"blend": {"prefixes": prefixes, "weights": [0.5, 0.3, 0.2]}, "split": "100,0,0",
              "seq_length": args.seq_length, "train_samples": (args.warmup + args.steps) * args.global_batch * 2,
              "valid_samples": 0, "test_samples": 0, "seed": 7, "cache_dir": os.path.join(directory, "cache")}
    split = tokenloom.build(config).split("train")
    readers = _readers(split, args)
    _, reference = _time(readers["HostLoader"], args)
    rates: dict[str, list[float]] = {name: [] for name in readers}
    ratios: dict[str, list[float]] = {name: [] for name in readers}
    for round_ in range(args.rounds):
        names = list(readers)
        names = names[round_ % len(names):] + names[:round_ % len(names)]  # each reader first in turn
        this = {}
        for name in names:
            this[name], _ = _time(readers[name], args, reference)
        for name in readers:
            rates[name].append(this[name])
            ratios[name].append(this[name] / this["HostLoader"])
        print(f"round {round_ + 1}: " + ", ".join(f"{n} {r:,.0f}" for n, r in this.items()), file=sys.stderr,
              flush=True)
    print(f"| reader | samples/s (median of {args.rounds}) | vs HostLoader (median, range) |")
    print("|---|---:|---:|")
    rows = []
    for name in readers:
        ratio = statistics.median(ratios[name])
        rows.append({"reader": name, "samples_per_s": statistics.median(rates[name]), "ratio": ratio,
                     "ratio_range": [min(ratios[name]), max(ratios[name])]})
        print(f"| {name} | {statistics.median(rates[name]):,.0f} | {ratio:.2f}x "
              f"({min(ratios[name]):.2f}-{max(ratios[name]):.2f}) |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
