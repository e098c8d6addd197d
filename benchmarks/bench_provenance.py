"""Provenance at 1e8 documents: ``where`` (cost per sample at any position) and ``find`` (every
position holding one document), exact mode's one pass over memory-mapped arrays against stateless
mode's inverted permutations, and against the naive answer (``where`` over every position).

    python benchmarks/make_corpus.py --out /tmp/tl_corpus_prov --stores 2 --tokens 1e10 --documents 1e8
    flock /tmp/tokenloom-bench.lock python benchmarks/bench_provenance.py --corpus /tmp/tl_corpus_prov \\
        --work /tmp/tl_prov

Builds the blend of the corpus's stores (seq_length 2048, 1.2 epochs, split 100,0,0) in both modes
once (not timed), then, in the same process: ``where`` of 1024 consecutive positions at the start
and at the end of the split (ms per 1024 samples, best of 5); ``find`` of 20 documents picked at
random from the first store (mean and max per document; the first call, which maps the arrays,
is timed apart); and ``where`` over the first 1% of positions to estimate the naive scan.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", required=True)
    parser.add_argument("--work", default="/tmp/tl_prov")
    parser.add_argument("--documents", type=int, default=20, help="documents to find")
    parser.add_argument("--json")
    args = parser.parse_args()
    import tokenloom
    from bench_build import bench_config
    from bench_store import timed

    config = bench_config(args.corpus, 2048, 1.2, "100,0,0")
    num_documents = config.pop("num_documents")
    config.pop("num_tokens")
    rows = []
    for mode in ("exact", "stateless"):
        started = time.perf_counter()
        result = tokenloom.build({**config, "mode": mode, "cache_dir": os.path.join(args.work, mode)})
        built_s = time.perf_counter() - started
        source = result.split("train")
        store = source.readers[0].store
        first = np.arange(1024, dtype=np.int64)
        last = np.arange(source.num_samples - 1024, source.num_samples, dtype=np.int64)
        source.where(first)  # warm: maps the arrays, loads the kernels
        where_first = timed(lambda source=source, first=first: source.where(first), repeat=5)
        where_last = timed(lambda source=source, last=last: source.where(last), repeat=5)
        rng = np.random.default_rng(0)
        documents = rng.integers(0, store.num_sequences, size=args.documents)
        started = time.perf_counter()
        source.find(source.readers[0].prefix, int(documents[0]))
        first_find = time.perf_counter() - started
        times, hits = [], []
        for document in documents[1:]:
            started = time.perf_counter()
            found = source.find(source.readers[0].prefix, int(document))
            times.append(time.perf_counter() - started)
            hits.append(len(found))
        probe = np.arange(source.num_samples // 100, dtype=np.int64)
        started = time.perf_counter()
        for begin in range(0, probe.shape[0], 65536):
            source.where(probe[begin:begin + 65536])
        naive = (time.perf_counter() - started) * 100  # the whole split at the probe's rate
        row = {"mode": mode, "documents": num_documents, "samples": source.num_samples, "build_s": built_s,
               "where_first_ms": where_first * 1e3, "where_last_ms": where_last * 1e3,
               "find_first_s": first_find, "find_mean_s": float(np.mean(times)), "find_max_s": float(np.max(times)),
               "positions_per_document": float(np.mean(hits)), "naive_scan_s": naive}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print()
    print("| mode | documents | samples | where, 1024 samples at the start / end, ms | find per document: first "
          "/ mean / max s | positions found per document | where over every position (naive find) s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['mode']} | {r['documents']:,} | {r['samples']:,} | {r['where_first_ms']:.1f} / "
              f"{r['where_last_ms']:.1f} | {r['find_first_s']:.3f} / {r['find_mean_s']:.4f} / {r['find_max_s']:.4f} | "
              f"{r['positions_per_document']:.2f} | {r['naive_scan_s']:.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
