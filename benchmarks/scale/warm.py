"""Warm start at 10,000 stores: opening a finished build on every rank, against megatron-core.

    flock /tmp/tokenloom-bench.lock python benchmarks/scale/warm.py --work /tmp/tl_warm

The corpus (made here unless ``--corpus`` names one): 10,000 stores, 1e10 tokens, 1e7 documents
(``make_corpus.py``; real .idx files, sparse .bin files). The config blends all 10,000 stores by
token count for train (``blend_per_split`` with train only, the form megatron-core's
``fast_cache_load`` requires; a valid blend of the same stores would double megatron-core's open
files past this machine's limit of 20,000), 2048-token samples, 1.5 epochs, exact mode. One cold
tokenloom build (not timed here) fills tokenloom's cache and, through
``megatron_cache_dir``, megatron-core's, so both sides load the same indices as cache hits.

Rows, each the build call of every rank of a fresh launch (``scale/ranks.py``'s harness: CPU
seconds of the call, threads included; interpreter start and imports excluded):

* tokenloom, 1/4/16 ranks, ``verify_stores="stat"`` (the default): every rank ``stat``s its share
  of the stores against the warm-start record the previous start kept, and takes its plan
  (``tokenloom.builder.starts``);
* the same with ``verify_stores="hash"``: no record; every store opened and its lengths hashed
  again, and the plan made again;
* the same with ``megatron_cache_dir`` set (each rank also checks its share of megatron-core's
  cache files).

Before a variant's timed launches one untimed launch of it keeps its record, as the job's
previous start would have.

megatron-core's warm load (one process: each rank of a megatron-core job loads the whole blend
itself, so one process's time is every rank's time): its builder with the default options, then
with ``mmap_bin_files=False, defer_npy_index_mmap=True`` (fewer open files), then also with
``fast_cache_load=True`` (0.19.2: trusts the cache without checking the files). Each is CPU and wall
seconds of ``BlendedMegatronDatasetBuilder(...).build()``; a variant that cannot open the blend (too
many open files: the default keeps several maps open per store) is reported with its error.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from ranks import launch  # noqa: E402


def warm_config(corpus: str, seq_length: int = 2048, epochs: float = 1.5) -> dict:
    with open(os.path.join(corpus, "corpus.json")) as f:
        manifest = json.load(f)
    blend = {"prefixes": [s["prefix"] for s in manifest["stores"]],
             "weights": [float(s["num_tokens"]) for s in manifest["stores"]]}
    train = int(epochs * manifest["num_tokens"] / seq_length)
    return {"blend_per_split": [blend, None, None], "seq_length": seq_length, "train_samples": train,
            "valid_samples": None, "test_samples": None, "seed": 1234}


def child_megatron(config: dict, cache: str, options: dict) -> dict:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    per_split = [None if b is None else (b["prefixes"], b["weights"]) for b in config["blend_per_split"]]
    mcfg = GPTDatasetConfig(random_seed=config["seed"], sequence_length=config["seq_length"],
                            blend_per_split=per_split, path_to_cache=cache, tokenizer=NullTokenizer(32000),
                            reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False, **options)
    sizes = [config["train_samples"], config["valid_samples"], config["test_samples"]]
    own0 = resource.getrusage(resource.RUSAGE_SELF)
    wall0 = time.perf_counter()
    try:
        datasets = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, mcfg).build()
    except OSError as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "wall_s": time.perf_counter() - wall0}
    wall = time.perf_counter() - wall0
    own1 = resource.getrusage(resource.RUSAGE_SELF)
    return {"wall_s": wall, "cpu_s": own1.ru_utime + own1.ru_stime - own0.ru_utime - own0.ru_stime,
            "open_files": len(os.listdir("/proc/self/fd")),
            "num_samples": [None if d is None else len(d) for d in datasets]}


def megatron_warm(config: dict, cache: str, options: dict) -> dict:
    path = cache + ".config.json"
    with open(path, "w") as f:
        json.dump(config, f)
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--_megatron", path, cache,
                           json.dumps(options)], capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"error": f"exit status {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}"}
    return json.loads(lines[-1])


def _row(what: str, outs: list[dict]) -> dict:
    cpus = [o["cpu_s"] for o in outs]
    return {"what": what, "ranks": len(outs), "largest_cpu_s": max(cpus), "mean_cpu_s": sum(cpus) / len(cpus),
            "oversubscribed_wall_s": max(o["wall_s"] for o in outs), "peak_rss": max(o["peak_rss"] for o in outs),
            "rchar": max(o["rchar"] for o in outs), "bytes_sent": max(o["bytes_sent"] for o in outs),
            "phases_rank0": {k: v for k, v in outs[0]["timings"].items() if k.endswith("_cpu_s")}}


def warm_start_table(work: str, *, corpus: str | None = None, ranks=(1, 4, 16), stores: int = 10_000,
                     tokens: float = 1e10, documents: float = 1e7) -> dict:
    os.makedirs(work, exist_ok=True)
    if corpus is None:
        corpus = os.path.join(work, "corpus")
        if not os.path.isfile(os.path.join(corpus, "corpus.json")):
            subprocess.run([sys.executable, os.path.join(os.path.dirname(HERE), "make_corpus.py"), "--out", corpus,
                            "--stores", str(stores), "--tokens", str(tokens), "--documents", str(documents)],
                           check=True)
    config = warm_config(corpus)
    cache, megatron_cache = os.path.join(work, "tokenloom"), os.path.join(work, "megatron")
    subprocess.run(["rm", "-rf", cache, megatron_cache], check=True)
    cold = dict(config, megatron_cache_dir=megatron_cache)
    started = time.perf_counter()
    launch(1, cold, cache, "exact")  # fills both caches (untimed here; the cold rows are bench_scale's)
    cold_s = time.perf_counter() - started
    time.sleep(2.1)  # stores written just before the cold build are racy there; settle them once
    launch(1, config, cache, "exact")
    out: dict = {"config": {"stores": len(config["blend_per_split"][0]["prefixes"]),
                            "train_samples": config["train_samples"]},
                 "cold_build_s": cold_s, "rows": [], "megatron": {}}
    variants = [("tokenloom, verify_stores=stat", config),
                ("tokenloom, verify_stores=hash", dict(config, verify_stores="hash")),
                ("tokenloom, stat, megatron_cache_dir checked", dict(config, megatron_cache_dir=megatron_cache))]
    for what, cfg in variants:
        launch(1, cfg, cache, "exact")  # untimed: keeps this config's warm-start record, as any earlier start would
        for n in ranks:
            row = _row(what, launch(n, cfg, cache, "exact"))
            out["rows"].append(row)
            print(f"{what:45} {n:>3} ranks: largest rank {row['largest_cpu_s']:.2f} CPU-s", file=sys.stderr, flush=True)
    for name, options in (("default", {}),
                          ("mmap_bin_files=False, defer_npy_index_mmap=True",
                           {"mmap_bin_files": False, "defer_npy_index_mmap": True}),
                          ("... and fast_cache_load=True",
                           {"mmap_bin_files": False, "defer_npy_index_mmap": True, "fast_cache_load": True})):
        best = None
        for _ in range(2):
            got = megatron_warm(config, megatron_cache, options)
            if "error" in got or best is None or got["cpu_s"] < best["cpu_s"]:
                best = got
            if "error" in got:
                break
        out["megatron"][name] = best
        print(f"megatron-core warm, {name}: {best}", file=sys.stderr, flush=True)
    out["open_files_limit"] = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return out


def format_table(result: dict) -> str:
    lines = [f"{result['config']['stores']:,} stores; megatron-core's warm load, one process (= every rank):", "",
             "| megatron-core options | wall s | CPU s | open files after |", "|---|---:|---:|---:|"]
    peers = []
    for name, got in result["megatron"].items():
        if "error" in got:
            lines.append(f"| {name} | failed: {got['error'][:80]} | | |")
        else:
            peers.append(got["cpu_s"])
            lines.append(f"| {name} | {got['wall_s']:.2f} | {got['cpu_s']:.2f} | {got['open_files']:,} |")
    best_peer = min(peers) if peers else float("nan")
    lines += ["", "| tokenloom | ranks | largest rank CPU s | mean CPU s | vs megatron-core's best (CPU) "
              "| peak RSS MiB | rank 0 phases (CPU s) |", "|---|---:|---:|---:|---:|---:|---|"]
    for r in result["rows"]:
        phases = ", ".join(f"{k[:-6]} {v:.2f}" for k, v in r["phases_rank0"].items() if v >= 0.01)
        lines.append(f"| {r['what']} | {r['ranks']} | {r['largest_cpu_s']:.2f} | {r['mean_cpu_s']:.2f} | "
                     f"{r['largest_cpu_s'] / best_peer:.2f} | {r['peak_rss'] / 2**20:,.0f} | {phases} |")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--_megatron":
        with open(sys.argv[2]) as f:
            config = json.load(f)
        print(json.dumps(child_megatron(config, sys.argv[3], json.loads(sys.argv[4]))))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", default="/tmp/tl_warm")
    parser.add_argument("--corpus", help="a make_corpus.py directory (default: 10,000 stores made under --work)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--json", help="also write every measurement here")
    args = parser.parse_args()
    result = warm_start_table(args.work, corpus=args.corpus, ranks=tuple(args.ranks))
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
