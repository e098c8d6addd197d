"""How a build's work divides over 1, 2, 4, 8 and 16 ranks, measured per rank.

A machine with fewer cores than ranks cannot show the wall time of a build on N free cores, but
it can show how the work divides: every rank of an oversubscribed run records the CPU seconds of
its own ``build()`` call (user + system of every thread, plus reaped shuffle workers; the
interpreter's start and imports are not part of it, as a training job has paid them already),
the bytes it read and wrote, what it sent over the build's groups, and its peak RSS during the
call. numba is imported and its compiler set up (one trivial kernel) before the call, as in a
process that used numba before; the build's own kernels load from numba's disk cache inside the
call (scale/first_use.py measures those costs). On N free cores the wall time is about the
largest rank's CPU seconds plus the cost of the collectives themselves (measured separately
here: ``collective_costs``, an upper bound on an oversubscribed machine); that estimate is a
floor, as 16 free cores showed (BENCHMARKS.md): the ranks also wait on each other at the end of
every phase and on ``fsync``, 1.2-1.4 s more at 16 ranks there. Where the cores are at least
the ranks, the ``wall s`` column is the build's real wall time (the ranks meet at a barrier
before the call). Each build runs
``--repeats`` times (default 3), the rank counts taking turns, and the try whose largest rank
spent the least is kept: on this shared VM the same build moves by a quarter between minutes.

    python benchmarks/scale/ranks.py --corpus /tmp/tl_corpus_build --work /tmp/tl_scale --ranks 1 2 4 8 16
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # benchmarks/: bench_build's corpus config


# the build's phases (BuildResult.timings), each ended by a collective: a rank's wall time is about
# the sum over the phases of the longest rank in each
PHASES = ("fingerprint_s", "pack_s", "plan_s", "build_s", "transfer_s", "finalize_s", "open_s")


def _io() -> dict[str, int]:
    """This process's I/O counters: rchar/wchar (bytes through read/write calls, page cache
    included) and read_bytes/write_bytes (bytes the storage layer fetched and was sent)."""
    out = dict.fromkeys(("rchar", "wchar", "read_bytes", "write_bytes"), 0)
    try:
        with open("/proc/self/io") as f:
            for line in f:
                name, value = line.split(":")
                out[name] = int(value)
    except OSError:  # a sandboxed kernel (gVisor) may not keep these counters: the bytes read as 0
        pass
    return out


def _cpu_split() -> tuple[float, float]:
    """(user, system) CPU seconds of this process and its reaped children."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + children.ru_utime, own.ru_stime + children.ru_stime


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def child(args) -> dict:
    """One rank: join the group, then measure the build call alone."""
    from datetime import timedelta

    if args.config.startswith("@"):  # a config too long for a command line, in a file
        with open(args.config[1:]) as f:
            config = json.load(f)
    else:
        config = json.loads(args.config)
    mode = args.mode
    if mode == "best_fit":  # whole documents packed best fit, blended in exact mode
        config.update(packing="best_fit")
        mode = "exact"
    config.update(cache_dir=args.cache, mode=mode, timeout_s=3600.0)
    if args.world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                                world_size=args.world, timeout=timedelta(seconds=3600))
    # imports are not part of the call (the method); without .pyc files (PYTHONDONTWRITEBYTECODE)
    # the builder's cost 0.1 s inside it
    import tokenloom
    import tokenloom.builder.runner
    import tokenloom.source
    from tokenloom.index.kernels import import_numba, numba_available

    if numba_available():  # paid once per process, before the build, by any job that uses numba
        numba = import_numba()
        numba.njit(lambda x: x + 1)(1)  # numba's compiler and type registries, set up on first use
    if args.world > 1:  # every rank enters the call together: its wall time is the build's, not the
        dist.barrier()  # wait for the slowest rank's imports
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak RSS to the current RSS: the peak below is the build call's
    except OSError:  # a sandboxed kernel (gVisor) may refuse: the peak then includes the imports'
        pass
    rss_before = _peak_rss()
    io0, split0, wall0 = _io(), _cpu_split(), time.perf_counter()
    # cProfile of the build call, to see where a rank's fixed work goes: TOKENLOOM_PROFILE_RANK0
    # profiles rank 0, TOKENLOOM_PROFILE every rank (to the path plus ".<rank>")
    profile = os.environ.get("TOKENLOOM_PROFILE_RANK0") if args.rank == 0 else None
    if os.environ.get("TOKENLOOM_PROFILE"):
        profile = f"{os.environ['TOKENLOOM_PROFILE']}.{args.rank}"
    if profile:
        import cProfile

        # the main thread's CPU: not wall (ranks share the cores), not the process's (the blend
        # thread's CPU would land on whatever frame the main thread is in)
        profiler = cProfile.Profile(time.thread_time)
        result = profiler.runcall(tokenloom.build, config)
        profiler.dump_stats(profile)
    else:
        result = tokenloom.build(config)
    wall, split1, io1 = time.perf_counter() - wall0, _cpu_split(), _io()
    user, kernel = split1[0] - split0[0], split1[1] - split0[1]
    traffic = result.traffic
    out = {"rank": args.rank, "world": args.world, "mode": args.mode, "wall_s": wall, "cpu_s": user + kernel,
           "user_s": user, "sys_s": kernel,
           "peak_rss": _peak_rss(), "rss_before": rss_before,
           "rchar": io1["rchar"] - io0["rchar"], "wchar": io1["wchar"] - io0["wchar"],
           "read_bytes": io1["read_bytes"] - io0["read_bytes"], "write_bytes": io1["write_bytes"] - io0["write_bytes"],
           "calls": traffic.calls, "bytes_sent": traffic.bytes_sent, "collective_s": traffic.seconds,
           "predicted_s": result.rank_seconds[args.rank]["predicted_s"], "timings": result.timings,
           "built": len(result.built_keys), "manifest": result.manifest_path}
    if args.world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    return out


def launch(world: int, config: dict, cache: str, mode: str) -> list[dict]:
    """``world`` rank processes on 127.0.0.1, each printing its measurement as a JSON line."""
    from bench_build import _free_port

    port = _free_port()
    text = json.dumps(config)
    if len(text) > 64_000:  # past what a command line holds: hand the ranks a file
        os.makedirs(cache + ".config", exist_ok=True)
        path = os.path.join(cache + ".config", "config.json")
        with open(path, "w") as f:
            f.write(text)
        text = "@" + path
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--_child", "--config", text,
                               "--cache", cache, "--mode", mode, "--rank", str(rank), "--world", str(world),
                               "--port", str(port)], stdout=subprocess.PIPE)
             for rank in range(world)]
    outs = []
    for proc in procs:
        stdout, _ = proc.communicate()
        if proc.returncode != 0:
            raise SystemExit(f"a rank of the {world}-rank {mode} build failed with status {proc.returncode}")
        outs.append(json.loads(stdout.decode().strip().splitlines()[-1]))
    return outs


def collective_costs(world: int) -> dict:
    """Latency of a small gather (the build's own: a gather on one rank, the root taking turns, and
    a binomial broadcast from it; and torch's ``all_gather_object``, gloo's ring, for comparison)
    and bandwidth of a 64 MiB broadcast over gloo on 127.0.0.1 with ``world`` idle ranks (the cost
    of the build's collectives, apart from waiting)."""
    if world == 1:
        return {"gather_s": 0.0, "ring_gather_s": 0.0, "broadcast_bytes_per_s": float("inf")}
    code = r'''
import sys, time, json
from datetime import timedelta
import torch, torch.distributed as dist
from tokenloom.builder.collective import TorchGroup
rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                        timeout=timedelta(seconds=600))
group = TorchGroup(timeout_s=600)
out = [None] * world
payload = {"counts": list(range(1000))}  # about what a divided blend's ranks agree on
ways = {"gather_s": lambda: group.all_gather_object(payload),
        "ring_gather_s": lambda: dist.all_gather_object(out, payload)}
result = {}
for name, gather in ways.items():
    for _ in range(5):
        gather()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(20):
            gather()
        best = min(best, (time.perf_counter() - t) / 20)
    result[name] = best
data = torch.zeros(64 << 20, dtype=torch.uint8)
dist.broadcast(data, src=0)
t = time.perf_counter(); dist.broadcast(data, src=0); seconds = time.perf_counter() - t
if rank == 0:
    print(json.dumps({**result, "broadcast_bytes_per_s": (64 << 20) / seconds}))
group.close()
dist.destroy_process_group()
'''
    from bench_build import _free_port

    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r), str(world), str(port)], stdout=subprocess.PIPE)
             for r in range(world)]
    outs = [p.communicate()[0].decode() for p in procs]
    return json.loads(outs[0].strip().splitlines()[-1])


def summarize(outs: list[dict], one_rank_cpu: float, costs: dict, inline_cpu: float | None = None) -> dict:
    """One row of the table: the ranks' CPU seconds, against ``one_rank_cpu`` (the one-rank build
    as it runs by default) and ``inline_cpu`` (exact mode: the one-rank build with its shuffle
    draws inline, the smaller denominator; see :func:`ranks_table`)."""
    cpus = [o["cpu_s"] for o in outs]
    largest = max(range(len(outs)), key=lambda r: cpus[r])
    calls = max(o["calls"] for o in outs)
    sent = max(o["bytes_sent"] for o in outs)
    own_collectives = calls * costs["gather_s"] + sent / costs["broadcast_bytes_per_s"]
    return {
        "ranks": len(outs), "largest_cpu_s": cpus[largest], "largest_rank": largest,
        "mean_cpu_s": sum(cpus) / len(cpus), "total_cpu_s": sum(cpus),
        "total_vs_one": sum(cpus) / one_rank_cpu if one_rank_cpu else float("nan"),
        "largest_vs_one": cpus[largest] / one_rank_cpu if one_rank_cpu else float("nan"),
        "largest_vs_inline": cpus[largest] / inline_cpu if inline_cpu else None,
        "largest_sys_s": outs[largest]["sys_s"], "mean_sys_s": sum(o["sys_s"] for o in outs) / len(outs),
        "predicted_largest_s": max(o["predicted_s"] for o in outs),
        # the build's wall time: the longest call over the ranks (they enter it together, after the
        # group is up); with at least as many free cores as ranks, the real wall time of the build
        "wall_s": max(o["wall_s"] for o in outs), "cores": os.cpu_count(),
        "peak_rss": max(o["peak_rss"] for o in outs),
        "rchar": max(o["rchar"] for o in outs), "wchar": max(o["wchar"] for o in outs),
        "write_bytes": max(o["write_bytes"] for o in outs),
        "calls": calls, "bytes_sent": sent, "collectives_own_s": own_collectives,
        "estimated_wall_s": cpus[largest] + own_collectives,
        "phases_rank0": outs[0]["timings"],
    }


def array_digests(manifest_path: str) -> dict[str, dict]:
    """Item key -> each array's digest (SHA-256, or the block digests of a divided blend), from a
    build's manifest: two builds with equal digests wrote the same bytes."""
    with open(manifest_path) as f:
        manifest = json.load(f)
    return {item["key"]: {name: meta.get("sha256", meta.get("blocks")) for name, meta in item["files"].items()}
            for item in manifest["items"]}


def ranks_table(corpus: str, work: str, *, ranks=(1, 2, 4, 8, 16), modes=("exact", "stateless"),
                seq_length: int = 2048, epochs: float = 1.5, split: str = "969,30,1", repeats: int = 3,
                progress_json: str | None = None) -> dict:
    """Every (mode, ranks) build from an empty cache, ``repeats`` times; returns the summaries of
    the best try of each (the one whose largest rank spent the least CPU) and its raw rank rows.

    The tries go round the rank counts in turn (1, 16, 1, 16, ...), so that the best of each
    samples the same stretch of the box's time: on this shared VM the same build moves by a
    quarter between minutes, mostly in its system CPU. Every try must write the one-rank build's
    bytes; each row lists the largest rank's CPU of every try (``tries_largest_cpu_s``).

    Exact mode also builds one rank with its shuffle draws inline (``rng_workers=0``; mode
    ``exact-inline`` in the rows). By default one rank with two cores draws in a background
    process, whose start, numba import and pipe copies cost CPU the inline build does not spend
    (0.6-7.8 CPU-s more in four of five paired runs on the benchmark box); the division is also given
    against the inline build's total (``largest_vs_inline``).

    After the widest exact build, two probes without the build around it: writing its bytes to
    the page cache from one process and from as many as the ranks (:func:`page_cache_probe`),
    and a rank's plan from one process and from as many at once (:func:`plan_probe`)."""
    from bench_build import bench_config

    config = bench_config(corpus, seq_length, epochs, split)
    for key in ("num_tokens", "num_documents"):
        config.pop(key)
    out: dict = {"config": {k: config[k] for k in ("split", "seq_length", "train_samples", "valid_samples",
                                                     "test_samples")}, "repeats": repeats, "rows": [], "raw": []}
    costs = {n: collective_costs(n) for n in ranks}
    out["collective_costs"] = costs
    for mode in modes:
        runs = [(mode, n, config) for n in ranks]
        if mode == "exact" and 1 in ranks:
            runs.insert(ranks.index(1) + 1, ("exact-inline", 1, {**config, "rng_workers": 0}))
        tries: dict[str, list[tuple[list[dict], dict]]] = {f"{label}-{n}": [] for label, n, _ in runs}
        for attempt in range(repeats):
            for label, n, run_config in runs:
                cache = os.path.join(work, f"{label}-{n}")
                subprocess.run(["rm", "-rf", cache], check=True)
                outs = launch(n, run_config, cache, mode)
                tries[f"{label}-{n}"].append((outs, array_digests(outs[0]["manifest"])))
                phases = ", ".join(f"{name[:-2]} {max(o['timings'].get(name, 0.0) for o in outs):.2f}"
                                   for name in PHASES)
                print(f"{label:12} {n:>3} ranks, try {attempt + 1} of {repeats}: largest rank "
                      f"{max(o['cpu_s'] for o in outs):.2f} CPU-s, of it system "
                      f"{max(outs, key=lambda o: o['cpu_s'])['sys_s']:.2f}; wall "
                      f"{max(o['wall_s'] for o in outs):.2f} s (phases, longest rank: {phases})",
                      file=sys.stderr, flush=True)
                if progress_json:  # what a run stopped part-way has measured so far
                    with open(progress_json, "w") as f:
                        json.dump({"tries": {k: [t[0] for t in v] for k, v in tries.items() if v}}, f, default=str)
        one_rank_cpu = one_rank_arrays = inline_cpu = None
        for label, n, _ in runs:
            done = tries[f"{label}-{n}"]
            outs, arrays = min(done, key=lambda t: max(o["cpu_s"] for o in t[0]))
            if one_rank_cpu is None:
                one_rank_cpu = outs[0]["cpu_s"] if n == 1 else float("nan")
                one_rank_arrays = arrays if n == 1 else None
            if label == "exact-inline":
                inline_cpu = outs[0]["cpu_s"]
            row = summarize(outs, one_rank_cpu, costs[n], inline_cpu)
            row["mode"] = label
            row["tries_largest_cpu_s"] = [max(o["cpu_s"] for o in t[0]) for t in done]
            row["tries_wall_s"] = [max(o["wall_s"] for o in t[0]) for t in done]
            # every try at every rank count must write the one-rank build's bytes (None: no one-rank build ran)
            row["same_arrays_as_one_rank"] = (None if one_rank_arrays is None
                                              else all(a == one_rank_arrays for _, a in done))
            out["rows"].append(row)
            out["raw"].append(outs)
            print(f"{label:12} {n:>3} ranks, best of {len(done)}: largest rank {row['largest_cpu_s']:.2f} CPU-s "
                  f"(rank {row['largest_rank']}), "
                  f"mean {row['mean_cpu_s']:.2f}, total {row['total_cpu_s']:.2f} "
                  f"({row['total_vs_one']:.2f}x one rank), of it system {row['mean_sys_s']:.2f} a rank, "
                  f"peak RSS {row['peak_rss'] / 2**30:.2f} GiB", file=sys.stderr, flush=True)
    widest = [outs for outs in out["raw"] if outs[0]["mode"] == "exact" and len(outs) == max(ranks) > 1]
    if widest:  # the same bytes written with one process resident and with as many as the ranks
        outs = widest[0]
        out["page_cache"] = page_cache_probe(sum(o["wchar"] for o in outs), len(outs),
                                             int(statistics.mean(o["rss_before"] for o in outs)))
        probe = out["page_cache"]
        print(f"page cache: writing {probe['bytes'] / 2**30:.2f} GiB cost {probe['one_sys_s']:.2f} system CPU-s "
              f"from 1 process and {probe['many_sys_s']:.2f} from {probe['processes']} holding "
              f"{probe['hold_bytes'] / 2**30:.2f} GiB each", file=sys.stderr, flush=True)
        out["plan_probe"] = plan_probe(config, len(outs))
        probe = out["plan_probe"]
        print(f"plan probe: a rank's plan cost {probe['one_s']:.3f} CPU-s alone and {probe['many_s']:.3f} a "
              f"process with {probe['processes']} at once", file=sys.stderr, flush=True)
    return out


PROBE_CHILD = r'''
import os, resource, sys
path, nbytes, hold = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ballast = bytearray(hold)
ballast[::4096] = b"x" * len(range(0, hold, 4096))  # resident, as a rank's interpreter and imports are
chunk = os.urandom(1 << 20)
before = resource.getrusage(resource.RUSAGE_SELF).ru_stime
with open(path, "wb") as f:
    for start in range(0, nbytes, len(chunk)):
        f.write(chunk[:min(len(chunk), nbytes - start)])
print(resource.getrusage(resource.RUSAGE_SELF).ru_stime - before)
'''


PLAN_CHILD = r'''
import os, pickle, sys, time
path, me, count, ranks, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
from tokenloom.builder.config import as_build_config
from tokenloom.builder.items import assign_work, resolve_items
with open(path, "rb") as f:
    config, infos, made = pickle.load(f)
config = as_build_config(config)
items, splits = resolve_items(config, infos, dict(made))  # once before the clock: code and caches warm
assign_work(config, items, splits, ranks, items)
open(f"{path}.ready{me}", "w").close()
deadline = time.monotonic() + 300
while sum(os.path.exists(f"{path}.ready{k}") for k in range(count)) < count:
    if time.monotonic() > deadline:  # another process died before it was ready: do not wait forever
        sys.exit(f"plan probe: process {me} waited 300 s for the other {count - 1} to be ready")
    time.sleep(0.005)  # every process starts the measured work together
started = time.process_time()
for _ in range(reps):
    items, splits = resolve_items(config, infos, dict(made))
    assign_work(config, items, splits, ranks, items)
print((time.process_time() - started) / reps)
'''


def plan_probe(config: dict, processes: int, reps: int = 5) -> dict:
    """CPU seconds of a rank's plan (resolving every item of ``config`` from the gathered
    dataset items and assigning them to ``processes`` ranks: the same Python work on every rank)
    in one process alone, and per process with ``processes`` of them at once. Where the two
    agree, a rank's fixed Python work costs what it costs, not more for sharing the cores."""
    import pickle

    from tokenloom.builder.config import as_build_config
    from tokenloom.builder.items import dataset_items, ranges_for
    from tokenloom.builder.stores import fingerprint_store

    out = {"processes": processes}
    with tempfile.TemporaryDirectory(prefix="tl-plan-probe-") as tmp:
        config = {**config, "cache_dir": os.path.join(tmp, "cache"), "mode": "exact"}
        built = as_build_config(config)
        infos = {p: fingerprint_store(p, ranges_for(built, p), None) for p in built.prefixes}
        path = os.path.join(tmp, "plan.pkl")
        with open(path, "wb") as f:
            pickle.dump((config, infos, dataset_items(built, infos)), f)
        for key, count in (("one_s", 1), ("many_s", processes)):
            for name in os.listdir(tmp):
                if ".ready" in name:
                    os.remove(os.path.join(tmp, name))
            procs = [subprocess.Popen([sys.executable, "-c", PLAN_CHILD, path, str(k), str(count), str(processes),
                                       str(reps)], stdout=subprocess.PIPE) for k in range(count)]
            seconds = []
            for proc in procs:
                stdout = proc.communicate()[0].decode().split()
                if proc.returncode != 0 or not stdout:
                    raise SystemExit(f"plan probe: a process of {count} failed with status {proc.returncode}")
                seconds.append(float(stdout[-1]))
            out[key] = statistics.mean(seconds)
    return out


def page_cache_probe(nbytes: int, processes: int, hold_bytes: int) -> dict:
    """System CPU seconds to write ``nbytes`` into the page cache, without tokenloom: from one
    process holding ``hold_bytes`` resident, then from ``processes`` processes holding as much
    each and writing a share each (the build's ranks hold their interpreter, torch and numba,
    0.3-0.4 GiB, before they write). On this 2-core VM the kernel's cost per byte written
    depends on how much memory the resident processes hold, which the per-rank CPU of a
    16-rank build includes and a build on 16 machines' worth of memory would not."""
    out = {"bytes": nbytes, "processes": processes, "hold_bytes": hold_bytes}
    with tempfile.TemporaryDirectory(prefix="tl-probe-") as tmp:
        for key, count in (("one_sys_s", 1), ("many_sys_s", processes)):
            share = nbytes // count
            procs = [subprocess.Popen([sys.executable, "-c", PROBE_CHILD, os.path.join(tmp, f"{key}-{k}"), str(share),
                                       str(hold_bytes)], stdout=subprocess.PIPE) for k in range(count)]
            out[key] = sum(float(p.communicate()[0].decode().split()[-1]) for p in procs)
            for name in os.listdir(tmp):
                os.remove(os.path.join(tmp, name))
    return out


def format_table(result: dict) -> str:
    lines = [f"Best of {result.get('repeats', 1)} tries of each build (the largest rank of every try in the "
             "last column).\n",
             "| mode | ranks | largest rank CPU s (of it system) | mean CPU s | total CPU s | total / 1 rank "
             "| largest / 1-rank total (draws inline) | predicted largest s | collectives: calls, MiB sent "
             "| est. wall on free cores s | wall s | peak RSS GiB | MiB written (largest rank) | arrays = 1 rank's "
             "| tries |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in result["rows"]:
        same = {True: "yes", False: "**no**", None: "-"}[r.get("same_arrays_as_one_rank")]
        inline = f" ({r['largest_vs_inline']:.3f})" if r.get("largest_vs_inline") else ""
        lines.append(f"| {r['mode']} | {r['ranks']} | {r['largest_cpu_s']:.2f} ({r['largest_sys_s']:.2f}) | "
                     f"{r['mean_cpu_s']:.2f} | {r['total_cpu_s']:.2f} | {r['total_vs_one']:.2f}x | "
                     f"{r['largest_vs_one']:.3f}{inline} | "
                     f"{r['predicted_largest_s']:.2f} | {r['calls']}, {r['bytes_sent'] / 2**20:.1f} | "
                     f"{r['estimated_wall_s']:.2f} | {r['wall_s']:.2f} | "
                     f"{r['peak_rss'] / 2**30:.2f} | {r['wchar'] / 2**20:,.0f} | "
                     f"{same} | {' / '.join(f'{t:.2f}' for t in r.get('tries_largest_cpu_s', []))} |")
    cores = max((r.get("cores") or 0 for r in result["rows"]), default=0)
    lines.append(f"\nwall s: the longest build call over the ranks of the kept try, on {cores} cores; "
                 "where the ranks outnumber the cores it is oversubscribed and says nothing of a cluster.")
    probe = result.get("page_cache")
    if probe:
        lines.append(f"\nPage cache, without tokenloom: writing the {probe['bytes'] / 2**30:.2f} GiB the "
                     f"{probe['processes']} ranks wrote cost {probe['one_sys_s']:.2f} system CPU-s from one "
                     f"process and {probe['many_sys_s']:.2f} from {probe['processes']} processes holding "
                     f"{probe['hold_bytes'] / 2**30:.2f} GiB each (what a rank held before its build call).")
    probe = result.get("plan_probe")
    if probe:
        lines.append(f"\nA rank's plan, without the build around it (resolving all items and assigning them to "
                     f"{probe['processes']} ranks, the same Python work on every rank): {probe['one_s']:.3f} CPU-s "
                     f"in one process alone, {probe['many_s']:.3f} a process with {probe['processes']} at once.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--corpus", help="directory written by make_corpus.py")
    parser.add_argument("--work", default="/tmp/tl_scale")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--modes", nargs="+", default=["exact", "stateless"],
                        help="exact, stateless, best_fit (packing: best_fit, exact blends)")
    parser.add_argument("--repeats", type=int, default=3, help="tries of each build; the best is kept")
    parser.add_argument("--json", help="also write every measurement here")
    parser.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--cache", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._child:
        print(json.dumps(child(args)))
        return
    result = ranks_table(args.corpus, args.work, ranks=tuple(args.ranks), modes=tuple(args.modes),
                         repeats=args.repeats, progress_json=args.json and args.json + ".progress")
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
