"""Build every split's indices of a big blend: megatron-core's builder vs ``tokenloom.build``.

Both read the same stores (``benchmarks/make_corpus.py``) in the same run. Every contender runs
in a fresh process with an empty cache directory (cold), then again on its filled cache (warm).
Seconds are wall-clock of the build call; memory is the process's peak RSS and the part of it the
build added (peak minus the RSS just before the build started, which excludes torch and numba).

    python benchmarks/make_corpus.py --out /tmp/corpus --stores 1000 --tokens 1e11 --documents 1e8
    flock /tmp/tokenloom-bench.lock python benchmarks/bench_build.py --corpus /tmp/corpus --work /tmp/bb

The blend weighs every store by its tokens and asks each split for ``--epochs`` passes over its
tokens (1.5 by default), with ``--seq-length`` 2048 and split ``969,30,1``. A projection to
larger corpora and more ranks from the measured per-item costs closes the report.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import time

# ------------------------------------------------------------------------------------ the config


def bench_config(corpus: str, seq_length: int, epochs: float, split: str) -> dict:
    with open(os.path.join(corpus, "corpus.json")) as f:
        manifest = json.load(f)
    prefixes = [s["prefix"] for s in manifest["stores"]]
    weights = [float(s["num_tokens"]) for s in manifest["stores"]]
    fractions = [float(x) for x in split.split(",")]
    total = sum(fractions)
    samples = [int(epochs * manifest["num_tokens"] * f / total / seq_length) for f in fractions]
    return {"blend": {"prefixes": prefixes, "weights": weights}, "split": split, "seq_length": seq_length,
            "train_samples": samples[0], "valid_samples": samples[1], "test_samples": samples[2],
            "seed": 1234, "num_tokens": manifest["num_tokens"], "num_documents": manifest["num_documents"]}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ------------------------------------------------------------------------------------ children


def child_megatron(args) -> dict:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    from megatron.core.datasets import helpers
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    config = json.loads(args.config)
    blend_seconds = [0.0]
    original = helpers.build_blending_indices

    def timed(*a, **k):
        started = time.perf_counter()
        try:
            return original(*a, **k)
        finally:
            blend_seconds[0] += time.perf_counter() - started

    helpers.build_blending_indices = timed
    mcfg = GPTDatasetConfig(
        random_seed=config["seed"], sequence_length=config["seq_length"],
        blend=(config["blend"]["prefixes"], config["blend"]["weights"]), split=config["split"],
        path_to_cache=args.cache, tokenizer=NullTokenizer(32000), reset_position_ids=False,
        reset_attention_mask=False, eod_mask_loss=False)
    sizes = [config["train_samples"], config["valid_samples"], config["test_samples"]]
    baseline = _rss_bytes()
    started = time.perf_counter()
    datasets = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, mcfg).build()
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "peak": _peak_bytes(), "baseline": baseline,
            "blend_seconds": blend_seconds[0], "num_samples": [len(d) for d in datasets]}


def child_tokenloom(args) -> dict:
    config = json.loads(args.config)
    for key in ("num_tokens", "num_documents"):
        config.pop(key)
    config.update(cache_dir=args.cache, mode=args.mode, rng_workers=args.rng_workers, timeout_s=3600.0)
    if args.world > 1:
        from datetime import timedelta

        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                                world_size=args.world, timeout=timedelta(seconds=3600))
    import tokenloom

    # numba is imported outside the timed region, as a long-running job has it (tokenloom imports
    # it on a kernel's first call; the compiled kernels themselves load from numba's disk cache)
    from tokenloom.index.kernels import import_numba, numba_available

    if numba_available():
        import_numba()
    baseline = _rss_bytes()
    started = time.perf_counter()
    result = tokenloom.build(config)
    seconds = time.perf_counter() - started
    out = {"seconds": seconds, "peak": _peak_bytes(), "baseline": baseline, "timings": result.timings,
           "num_samples": [s.num_samples for s in result.splits.values()], "built": len(result.built_keys),
           "manifest": result.manifest_path}
    if args.world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    return out


# ------------------------------------------------------------------------------------ launching


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_children(kind: str, config: dict, cache: str, *, world: int = 1, mode: str = "exact",
                 rng_workers: int = 1) -> list[dict]:
    port = _free_port()
    procs = []
    for rank in range(world):
        cmd = [sys.executable, os.path.abspath(__file__), "--_child", kind, "--config", json.dumps(config),
               "--cache", cache, "--mode", mode, "--rank", str(rank), "--world", str(world), "--port", str(port),
               "--rng-workers", str(rng_workers)]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE))
    outs = []
    for proc in procs:
        stdout, _ = proc.communicate()
        if proc.returncode != 0:
            raise SystemExit(f"{kind} child failed with status {proc.returncode}")
        outs.append(json.loads(stdout.decode().strip().splitlines()[-1]))
    return outs


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def _row(name: str, outs: list[dict]) -> dict:
    return {"name": name, "seconds": max(o["seconds"] for o in outs),
            "peak": max(o["peak"] for o in outs), "added": max(o["peak"] - o["baseline"] for o in outs),
            "outs": outs}


# ------------------------------------------------------------------------------------ projection


def per_item_costs(manifest_path: str, cache_dir: str) -> dict:
    """Seconds per document position (dataset items) and per blended sample (blend items), from
    the item records (compute time of each item, publication excluded)."""
    from tokenloom.builder.cache import Cache

    with open(manifest_path) as f:
        manifest = json.load(f)
    cache = Cache(cache_dir)
    gpt_seconds = gpt_positions = 0.0
    blend_seconds = blend_samples = 0.0
    blend_threads = 1
    for entry in manifest["items"]:
        record = cache.read_record(entry["key"])
        if entry["kind"] == "gpt":
            plan = record["plan"]
            gpt_seconds += record["seconds"]
            gpt_positions += plan["num_epochs"] * plan["num_documents"]
        else:
            blend_seconds += record["seconds"]
            blend_samples += record["num_samples"]
            blend_threads = max(blend_threads, int(record.get("threads", 1)))
    return {"per_position_s": gpt_seconds / max(gpt_positions, 1),
            "per_blend_sample_s": blend_seconds / max(blend_samples, 1) if blend_samples else 0.0,
            "gpt_seconds": gpt_seconds, "blend_seconds": blend_seconds, "blend_threads": blend_threads}


def projection(costs: dict, stateless_costs: dict | None, megatron: dict | None, measured: dict, *,
               tokens: float, datasets: int, ranks: int, seq_length: int, epochs: float,
               mean_document_tokens: float) -> list[str]:
    documents = tokens / mean_document_tokens
    positions = documents * max(2, int(epochs) + 1)  # every split, epochs rounded up
    train_samples = epochs * tokens * 0.969 / seq_length
    items = 3 * datasets
    per_item = positions / datasets * costs["per_position_s"]
    item_rounds = -(-items // ranks)
    blend = costs["per_blend_sample_s"] * train_samples
    exact = max(blend, item_rounds * per_item / 3)  # three splits' items per dataset, spread
    lines = [
        f"Projection to {tokens:.0e} tokens, {datasets} datasets, {ranks} ranks ({documents:.2e} documents, "
        f"{train_samples:.2e} train samples), from the per-item costs measured above:",
        "",
        "| | per item | critical path | bound by |",
        "|---|---:|---:|---|",
        f"| tokenloom exact | {per_item:.2f} s per dataset index | {exact:,.0f} s | "
        f"the train blend: one item of {train_samples:.2e} samples ({blend:,.0f} s on the "
        f"{costs.get('blend_threads', 1)} blend thread(s) measured here, "
        f"{train_samples * 10 / 2**30:,.0f} GiB written by one rank) |",
    ]
    if stateless_costs is not None:
        per_item_stateless = positions / datasets * stateless_costs["per_position_s"]
        lines.append(f"| tokenloom stateless | {per_item_stateless:.2f} s per dataset index | "
                     f"{item_rounds * per_item_stateless / 3:,.1f} s | fingerprinting and block sums, "
                     "spread over ranks; no per-sample arrays |")
    if megatron is not None:
        d_measured = measured["datasets"]
        blend_per_sample_dataset = megatron["blend_seconds"] / (measured["train_samples"] * d_measured)
        m_blend = blend_per_sample_dataset * train_samples * datasets
        m_items = (megatron["seconds"] - megatron["blend_seconds"]) / measured["positions"] * positions
        lines.append(f"| megatron-core | {m_items / items:.2f} s per dataset index | {m_blend + m_items:,.0f} s | "
                     f"rank 0 alone: O(samples x datasets) blend ({m_blend:,.0f} s) + every index serially "
                     f"({m_items:,.0f} s) |")
    return lines


# ------------------------------------------------------------------------------------ main


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", help="directory written by make_corpus.py")
    parser.add_argument("--work", default="/tmp/tokenloom-bench-build", help="scratch directory for caches")
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--epochs", type=float, default=1.5)
    parser.add_argument("--split", default="969,30,1")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rng-workers", type=int, default=1, help="shuffle workers per rank, one rank")
    parser.add_argument("--rng-workers-multi", type=int, default=0,
                        help="shuffle workers per rank with several ranks (0: the ranks already fill the cores)")
    parser.add_argument("--skip-megatron", action="store_true")
    parser.add_argument("--_child", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--cache", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="exact", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._child:
        out = child_megatron(args) if args._child == "megatron" else child_tokenloom(args)
        print(json.dumps(out))
        return 0
    if not args.corpus:
        parser.error("--corpus is required")
    config = bench_config(args.corpus, args.seq_length, args.epochs, args.split)
    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    rows: list[dict] = []
    megatron = None

    def cache(name: str) -> str:
        return os.path.join(args.work, name)

    if not args.skip_megatron:
        megatron = _row("megatron-core, cold", run_children("megatron", config, cache("megatron")))
        rows.append(megatron)
        rows.append(_row("megatron-core, warm (cache hit)", run_children("megatron", config, cache("megatron"))))
    exact_rows = {}
    for world in args.ranks:
        name = f"tokenloom exact, {world} rank{'s' if world > 1 else ''}, cold"
        workers = args.rng_workers if world == 1 else args.rng_workers_multi
        exact_rows[world] = _row(name, run_children("tokenloom", config, cache(f"exact{world}"), world=world,
                                                    rng_workers=workers))
        rows.append(exact_rows[world])
    first = args.ranks[0]
    rows.append(_row("tokenloom exact, warm (cache hit)",
                     run_children("tokenloom", config, cache(f"exact{first}"), rng_workers=args.rng_workers)))
    stateless = _row("tokenloom stateless, 1 rank, cold", run_children("tokenloom", config, cache("stateless"),
                                                                       mode="stateless"))
    rows.append(stateless)
    rows.append(_row("tokenloom stateless, warm", run_children("tokenloom", config, cache("stateless"),
                                                               mode="stateless")))

    print(f"Corpus: {len(config['blend']['prefixes'])} stores, {config['num_tokens']:.3g} tokens, "
          f"{config['num_documents']:,} documents; seq_length {args.seq_length}, {args.epochs} epochs, "
          f"split {args.split}; samples {config['train_samples']:,} / {config['valid_samples']:,} / "
          f"{config['test_samples']:,}. Machine: {os.cpu_count()} cores.")
    print()
    print("| build | seconds | peak RSS GiB | added by the build GiB | vs megatron-core cold |")
    print("|---|---:|---:|---:|---:|")
    for row in rows:
        ratio = "" if megatron is None else f"{megatron['seconds'] / row['seconds']:.1f}x faster"
        print(f"| {row['name']} | {row['seconds']:.2f} | {_gib(row['peak'])} | {_gib(row['added'])} | {ratio} |")
    if megatron is not None:
        print()
        print(f"megatron-core's blend (build_blending_indices) took {megatron['outs'][0]['blend_seconds']:.1f} s "
              f"of its {megatron['seconds']:.1f} s. Stateless peak added memory is "
              f"{100 * stateless['added'] / megatron['added']:.1f}% of megatron-core's "
              f"({100 * stateless['peak'] / megatron['peak']:.1f}% of total peak RSS).")
    one = exact_rows[first]
    print()
    print("tokenloom phase seconds (rank 0, exact, cold): " + ", ".join(
        f"{k[:-2]} {v:.2f}" for k, v in one["outs"][0]["timings"].items() if not k.endswith("_cpu_s")))
    costs = per_item_costs(one["outs"][0]["manifest"], cache(f"exact{first}"))
    stateless_costs = per_item_costs(stateless["outs"][0]["manifest"], cache("stateless"))
    mean_document_tokens = config["num_tokens"] / config["num_documents"]
    measured = {"datasets": len(config["blend"]["prefixes"]), "train_samples": config["train_samples"],
                "positions": config["num_documents"] * max(2, int(args.epochs) + 1)}
    print()
    for line in projection(costs, stateless_costs, None if megatron is None else megatron["outs"][0], measured,
                           tokens=5e12, datasets=1000, ranks=1024, seq_length=args.seq_length,
                           epochs=args.epochs, mean_document_tokens=mean_document_tokens):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
