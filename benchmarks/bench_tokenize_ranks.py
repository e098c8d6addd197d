"""Tokenization divided over ranks: each rank's CPU seconds at 1, 2, 4 and 8 ranks.

    flock /tmp/tokenloom-bench.lock python benchmarks/bench_tokenize_ranks.py --work /tmp/tl_tok_ranks

Writes a JSONL corpus once (``--megabytes`` of synthetic text in one large file that the ranks
split at line starts, plus 40 small files), then for each rank count launches that many gloo ranks
on 127.0.0.1 (oversubscribed on a small machine, as bench_scale does) running
``tokenize_on_ranks`` with the byte tokenizer and no worker processes (the ranks are the
parallelism). Each rank reports the CPU seconds of the call (user + system), the bytes it read
and wrote (``/proc/self/io``); rank 0's include merging the parts. The store is checked
byte-identical to the one-rank run's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def child(rank: int, world: int, port: int, inputs: str, output: str) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from scale.ranks import _io
    from tokenloom.builder.tokenize import tokenize_on_ranks
    from tokenloom.tokenization import TokenizeConfig

    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=600))
    usage0, io0, wall0 = resource.getrusage(resource.RUSAGE_SELF), _io(), time.perf_counter()
    summary = tokenize_on_ranks([inputs], output, TokenizeConfig(workers=0))
    usage1, io1 = resource.getrusage(resource.RUSAGE_SELF), _io()
    cpu = (usage1.ru_utime - usage0.ru_utime) + (usage1.ru_stime - usage0.ru_stime)
    print(json.dumps({"rank": rank, "cpu_s": cpu, "wall_s": time.perf_counter() - wall0,
                      "read_bytes": io1["rchar"] - io0["rchar"], "written_bytes": io1["wchar"] - io0["wchar"],
                      "tokens": summary.num_tokens}), flush=True)
    if world > 1:
        dist.destroy_process_group()


def make_corpus(directory: str, megabytes: int) -> None:
    import numpy as np

    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(0)
    words = np.array(["the", "data", "layer", "of", "pretraining", "tokens", "blend", "rank", "step", "sample",
                      "über", "naïve", "数据"])
    target = megabytes * 2**20
    with open(os.path.join(directory, "big.jsonl"), "w", encoding="utf-8") as f:
        written = 0
        while written < target:
            lines = [json.dumps({"text": " ".join(rng.choice(words, size=int(n)))}, ensure_ascii=False) + "\n"
                     for n in rng.integers(20, 400, size=2000)]
            block = "".join(lines)
            f.write(block)
            written += len(block.encode("utf-8"))
    for k in range(40):
        with open(os.path.join(directory, f"small{k:02d}.jsonl"), "w", encoding="utf-8") as f:
            f.write("".join(json.dumps({"text": f"file {k} line {j} " + "word " * j}) + "\n" for j in range(200)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default="/tmp/tl_tok_ranks")
    parser.add_argument("--megabytes", type=int, default=200)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--json")
    parser.add_argument("--_child", nargs=5, metavar=("RANK", "WORLD", "PORT", "INPUTS", "OUTPUT"))
    args = parser.parse_args()
    if args._child:
        rank, world, port, inputs, output = args._child
        child(int(rank), int(world), int(port), inputs, output)
        return
    from bench_build import _free_port

    corpus = os.path.join(args.work, "corpus")
    if not os.path.exists(os.path.join(corpus, "big.jsonl")):
        make_corpus(corpus, args.megabytes)
    rows, reference = [], None
    for world in args.ranks:
        output = os.path.join(args.work, f"out-{world}")
        for suffix in (".bin", ".idx", ".meta.json"):
            if os.path.exists(output + suffix):
                os.remove(output + suffix)
        port = _free_port()
        procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--_child", str(r), str(world), str(port),
                                   corpus, output], stdout=subprocess.PIPE) for r in range(world)]
        outs = []
        for proc in procs:
            stdout, _ = proc.communicate()
            if proc.returncode:
                raise SystemExit(f"a rank of the {world}-rank run failed")
            outs.append(json.loads(stdout.decode().strip().splitlines()[-1]))
        digest = hashlib.sha256()
        for suffix in (".bin", ".idx", ".meta.json"):
            with open(output + suffix, "rb") as f:
                digest.update(f.read())
        reference = reference or digest.hexdigest()
        cpus = [o["cpu_s"] for o in outs]
        row = {"ranks": world, "largest_cpu_s": max(cpus), "mean_cpu_s": sum(cpus) / world, "total_cpu_s": sum(cpus),
               "rank0_cpu_s": cpus[0], "max_read_mib": max(o["read_bytes"] for o in outs) / 2**20,
               "rank0_written_mib": outs[0]["written_bytes"] / 2**20, "tokens": outs[0]["tokens"],
               "identical": digest.hexdigest() == reference}
        rows.append(row)
        print(json.dumps(row), flush=True)
    one = rows[0]["total_cpu_s"]
    print()
    print("| ranks | largest rank CPU s | mean CPU s | total / 1 rank | rank 0 CPU s | most MiB read by a "
          "rank | MiB written by rank 0 | store identical to 1 rank |")
    print("|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['ranks']} | {r['largest_cpu_s']:.2f} | {r['mean_cpu_s']:.2f} | {r['total_cpu_s'] / one:.2f}x | "
              f"{r['rank0_cpu_s']:.2f} | {r['max_read_mib']:.0f} | {r['rank0_written_mib']:.0f} | "
              f"{'yes' if r['identical'] else 'NO'} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
