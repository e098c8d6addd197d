"""Cluster scale, measured: every table of issue 12 from one command.

    python benchmarks/make_corpus.py --out /tmp/tl_corpus_build --stores 1000 --tokens 1e11 --documents 1e8
    flock /tmp/tokenloom-bench.lock python benchmarks/bench_scale.py --corpus /tmp/tl_corpus_build \\
        --work /tmp/tl_scale --json /tmp/tl_scale.json

1. megatron-core's cold build of the corpus (its builder, one process: its wall time is the peer;
   built once before section 2 and ``--repeats - 1`` times after it, the best of them);
2. the division of tokenloom's build over 1, 2, 4, 8, 16 ranks, exact and stateless, per rank
   (``scale/ranks.py``: CPU seconds of the build call, bytes, collectives, peak RSS; each build
   ``--repeats`` times, taking turns, the try with the smallest largest rank kept);
3. the projection to 5e12 tokens x 1000 datasets x 1024 ranks and to 10,000 datasets
   (``scale/projection.py``, formula in its docstring);
4. warm start at 10,000 stores against megatron-core's warm load (``scale/warm.py``);
5. first use: compile and cache costs (``scale/first_use.py``).

``--skip`` leaves sections out (``--skip warm first_use``). The box's own speed is read at the
start and the end of the run (:func:`box_speed`), to compare runs made on different days.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench_build import bench_config, run_children  # noqa: E402
from scale.projection import format_projection, project  # noqa: E402
from scale.ranks import format_table, ranks_table  # noqa: E402


def warm_page_cache(corpus: str) -> dict:
    """Read every .idx of the corpus once, so that neither side's first reads wait for the disk
    (megatron-core is timed by its wall clock, tokenloom's ranks by CPU seconds, which leave the
    wait out)."""
    started, total = time.perf_counter(), 0
    for name in sorted(os.listdir(corpus)):
        if name.endswith(".idx"):
            with open(os.path.join(corpus, name), "rb") as f:
                while chunk := f.read(1 << 22):
                    total += len(chunk)
    return {"bytes": total, "seconds": time.perf_counter() - started}


BOX_SPEED_CODE = r'''
import json, time
import numpy as np
best_loop = best_copy = float("inf")
a = np.ones(1 << 27)  # 1 GiB of float64
b = np.empty_like(a)
for _ in range(3):
    started = time.perf_counter()
    total = 0
    for i in range(10_000_000):
        total += i
    best_loop = min(best_loop, time.perf_counter() - started)
    started = time.perf_counter()
    np.copyto(b, a)
    best_copy = min(best_copy, time.perf_counter() - started)
print(json.dumps({"python_loop_s": best_loop, "copy_gb_per_s": 2 * a.nbytes / best_copy / 1e9}))
'''


def box_speed() -> dict:
    """How fast this shared VM is right now, in a fresh process: seconds of a 1e7-step Python
    loop and GB/s of a 1 GiB numpy copy (best of three each). Runs on other days compare by
    ratios to a peer measured in the same run; this says how the box itself moved between them
    (the same build has taken 1.5-2.3x as long on one day as on another)."""
    out = subprocess.run([sys.executable, "-c", BOX_SPEED_CODE], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def megatron_cold(corpus: str, work: str) -> dict:
    config = bench_config(corpus, 2048, 1.5, "969,30,1")
    cache = os.path.join(work, "megatron")
    os.system(f"rm -rf {cache}")
    out = run_children("megatron", config, cache)[0]
    return {"seconds": out["seconds"], "blend_seconds": out["blend_seconds"], "peak": out["peak"]}


def largest_item_seconds(manifest_path: str) -> dict:
    """The costliest dataset index of a one-rank build (it cannot be divided), from its size.

    An item's recorded seconds are the wall time of one call among the build's threads: a single
    stall (page faults on a cold .idx, the scheduler) makes one of a thousand items look 100x
    slower than its size says. So: the largest train item's array bytes x the median seconds per
    byte over the train items (the raw largest is reported beside it)."""
    with open(manifest_path) as f:
        manifest = json.load(f)
    train = [(entry["seconds"], sum(a["bytes"] for a in entry["files"].values()))
             for entry in manifest["items"] if entry["kind"] == "gpt" and entry["split"] == "train"]
    if not train:
        return {"seconds": 0.0, "raw_max_s": 0.0, "bytes": 0, "s_per_byte": 0.0}
    per_byte = statistics.median(seconds / size for seconds, size in train if size)
    size = max(size for _, size in train)
    return {"seconds": size * per_byte, "raw_max_s": max(s for s, _ in train), "bytes": size, "s_per_byte": per_byte}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--corpus", required=True, help="directory written by make_corpus.py (1000 stores x 1e11)")
    parser.add_argument("--work", default="/tmp/tl_scale")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--skip", nargs="*", default=[], choices=["megatron", "ranks", "warm", "first_use"])
    parser.add_argument("--repeats", type=int, default=3,
                        help="tries of each build, tokenloom's and megatron-core's; the best of each is kept")
    parser.add_argument("--json", help="write every measurement here")
    args = parser.parse_args()
    os.makedirs(args.work, exist_ok=True)
    with open(os.path.join(args.corpus, "corpus.json")) as f:
        corpus = json.load(f)
    report: dict = {"corpus": {"stores": len(corpus["stores"]), "tokens": corpus["num_tokens"],
                               "documents": corpus["num_documents"]}, "cores": os.cpu_count()}

    def save() -> None:  # after each section, so that a run stopped part-way keeps what it measured
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1, default=str)

    report["box"] = [box_speed()]
    print(f"box: a 1e7-step Python loop {report['box'][0]['python_loop_s']:.2f} s, a numpy copy "
          f"{report['box'][0]['copy_gb_per_s']:.1f} GB/s", flush=True)
    report["page_cache"] = warm_page_cache(args.corpus)
    print(f"read every .idx once ({report['page_cache']['bytes'] / 2**30:.2f} GiB, "
          f"{report['page_cache']['seconds']:.1f} s) so neither side waits for the disk", flush=True)
    if "megatron" not in args.skip:
        report["megatron"] = megatron_cold(args.corpus, args.work)
        print(f"megatron-core cold build: {report['megatron']['seconds']:.1f} s wall", file=sys.stderr)
        save()
    if "ranks" not in args.skip:
        result = ranks_table(args.corpus, os.path.join(args.work, "ranks"), ranks=tuple(args.ranks),
                             repeats=args.repeats, progress_json=args.json and args.json + ".progress")
        report["ranks"] = result
        save()
        shared = "oversubscribed on" if max(args.ranks) > (os.cpu_count() or 1) else "a core per rank or more, on"
        print(f"\n## Work per rank (CPU seconds of the build call; {shared} {os.cpu_count()} cores)\n\n"
              + format_table(result))
        if "megatron" in report:  # again after the ranks, the best of the tries is the peer (the
            # box's speed drifts over a run; a slow first build would flatter the ratios)
            runs = [report["megatron"]["seconds"]]
            for _ in range(max(1, args.repeats - 1)):
                again = megatron_cold(args.corpus, args.work)
                runs.append(again["seconds"])
                if again["seconds"] < report["megatron"]["seconds"]:
                    report["megatron"].update(seconds=again["seconds"], blend_seconds=again["blend_seconds"])
            report["megatron"]["runs_s"] = runs
            print(f"megatron-core cold build after the ranks: {', '.join(f'{r:.1f}' for r in runs[1:])} s wall; "
                  f"the peer is the best: {report['megatron']['seconds']:.1f} s", file=sys.stderr)
        megatron_s = report.get("megatron", {}).get("seconds")
        if megatron_s:
            print("\n| mode | ranks | megatron-core wall s / largest rank CPU s | megatron-core wall s / build wall s "
                  "(only where the cores are at least the ranks) |\n|---|---:|---:|---:|")
            for row in result["rows"]:
                wall = (f"{megatron_s / row['wall_s']:.1f}x"
                        if row["ranks"] <= (os.cpu_count() or 1) else "-")
                print(f"| {row['mode']} | {row['ranks']} | {megatron_s / row['largest_cpu_s']:.1f}x | {wall} |")
        one_rank = next((outs for outs in result["raw"] if outs[0]["world"] == 1 and outs[0]["mode"] == "exact"), None)
        item = largest_item_seconds(one_rank[0]["manifest"]) if one_rank else {"seconds": 0.0}
        report["largest_item"], item_s = item, item["seconds"]
        projections = [project(result["rows"], mode=mode, corpus_tokens=corpus["num_tokens"],
                               corpus_datasets=len(corpus["stores"]), tokens=5e12, datasets=datasets, ranks=1024,
                               largest_item_s=item_s if mode == "exact" else 0.0)
                       for mode in ("exact", "stateless") for datasets in (1000, 10_000)]
        report["projection"] = projections
        print("\n## Projection (formula: benchmarks/scale/projection.py)\n\n" + format_projection(projections))
    for section in ("warm", "first_use"):
        if section in args.skip:
            continue
        try:
            module = importlib.import_module(f"scale.{section}")
        except ImportError:
            print(f"(section {section}: benchmarks/scale/{section}.py is not here)", file=sys.stderr)
            continue
        table = getattr(module, f"{section}_table" if section == "first_use" else "warm_start_table")
        report[section] = table(os.path.join(args.work, section))
        print(f"\n## {section}\n\n" + (module.format_table(report[section]) if hasattr(module, "format_table")
                                      else json.dumps(report[section], indent=1)))
        save()
    # the general path's fixed work at 10,000 stores: a start that hashes every store and makes,
    # gathers and plans every item (verify_stores=hash keeps no warm-start record), as a cold build does
    warm_rows = [r for r in report.get("warm", {}).get("rows", ())
                 if r["what"] == "tokenloom, verify_stores=hash" and r["ranks"] == 16]
    if "projection" in report and warm_rows:  # 10,000 datasets: the fixed work measured, not scaled
        rows, stores = report["ranks"]["rows"], report["warm"]["config"]["stores"]
        measured = [project(rows, mode=mode, corpus_tokens=corpus["num_tokens"], corpus_datasets=len(corpus["stores"]),
                            tokens=5e12, datasets=stores, ranks=1024, fixed_s=warm_rows[0]["largest_cpu_s"],
                            largest_item_s=p["largest_item_s"] * corpus["num_tokens"] / 5e12)
                    for mode, p in (("exact", report["projection"][0]), ("stateless", report["projection"][2]))]
        report["projection"] += measured
        print("\n## Projection at 10,000 datasets with the fixed work of a 16-rank general-path start at "
              f"{stores:,} stores\n\n" + format_projection(measured))
    report["box"].append(box_speed())
    print(f"\nbox at the end: a 1e7-step Python loop {report['box'][1]['python_loop_s']:.2f} s, a numpy copy "
          f"{report['box'][1]['copy_gb_per_s']:.1f} GB/s (at the start: {report['box'][0]['python_loop_s']:.2f} s, "
          f"{report['box'][0]['copy_gb_per_s']:.1f} GB/s)")
    save()


if __name__ == "__main__":
    main()
