"""First use: imports, and the first build and the first served micro-batch on an empty and on a warm numba cache.

    flock /tmp/tokenloom-bench.lock python benchmarks/scale/first_use.py --work /tmp/first-use

Every number comes from a fresh process (this file, run as a child), timed inside it with the
interpreter's own start-up left out, and with bytecode caches present (the tree is compiled first
and the children run without PYTHONDONTWRITEBYTECODE):

* ``import tokenloom``, ``import tokenloom.index``, ``import tokenloom.serve`` (and ``import numba``
  for scale): the import statement alone.
* ``tokenloom build`` of a small blend (``make_corpus.py``: ``--stores`` stores, ``--tokens`` tokens,
  ``--documents`` documents, so mean documents of 100 tokens: over 2**20 document positions, the
  size from which the builder takes its compiled kernels, as every real-size build does), exact and
  stateless: *import* is ``import tokenloom.cli, tokenloom.builder``; *first call* is
  ``tokenloom.cli.main(["build", ...])`` into an empty tokenloom cache; *steady* is the same call in
  the same process into another empty tokenloom cache (numba loaded, kernels compiled).
* Serving: the first micro-batch (8 x 2048) of a ``RankLoader`` over the train split of a build
  made beforehand, exact and stateless: *import* is ``import tokenloom.serve, tokenloom.builder``;
  opening the split (``tokenloom.build`` on the built cache, ``open_s`` in the rows) is timed
  apart; *first call* is ``RankLoader(split, geometry).next_batch()``; *steady* is the same on a
  new loader in the same process.

Each is run with an empty numba cache (a new ``NUMBA_CACHE_DIR``) and then with the warm one that
run left (a new process). *Added by first use* = first - steady. Beside each wall time, the CPU
seconds of the same call (user + system, every thread, and the build's reaped shuffle worker): on
a shared machine these move less than wall time. Rows give the median of ``--repeats`` processes.
``kernels`` counts the compiled kernels' signatures the parent process compiled / loaded from
numba's cache (the build's shuffle worker process is not counted).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SRC = os.path.join(ROOT, "src")
IMPORTS = ("tokenloom", "tokenloom.index", "tokenloom.serve", "numba")
MODES = ("exact", "stateless")


# ------------------------------------------------------------------------------------ children


def _cpu_seconds() -> float:
    """User + system seconds of this process (every thread) and of its reaped children."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _kernel_counts() -> tuple[int, int]:
    """(signatures compiled, signatures loaded from the disk cache) over this process's kernels."""
    if "numba" not in sys.modules:
        return 0, 0
    from tokenloom.index import kernels

    dispatchers = list(kernels._DISPATCHERS.values())
    return (sum(sum(d.stats.cache_misses.values()) for d in dispatchers),
            sum(sum(d.stats.cache_hits.values()) for d in dispatchers))


def child_import(module: str) -> dict:
    started = time.perf_counter()
    __import__(module)
    return {"import_s": time.perf_counter() - started}


def child_build(config_path: str, work: str, mode: str) -> dict:
    import contextlib
    import io

    started = time.perf_counter()
    import tokenloom.builder  # what `tokenloom build` imports on its call, imported here
    import tokenloom.cli

    imported = time.perf_counter()
    seconds, cpu = [], []
    for name in ("first", "steady"):
        argv = ["build", config_path, "--cache", os.path.join(work, name), "--mode", mode, "--no-progress"]
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            begin, begin_cpu = time.perf_counter(), _cpu_seconds()
            status = tokenloom.cli.main(argv)
            seconds.append(time.perf_counter() - begin)
            cpu.append(_cpu_seconds() - begin_cpu)
        if status != 0:
            raise SystemExit(f"tokenloom build exited with {status}")
        if name == "first":
            numba_loaded, counts = "numba" in sys.modules, _kernel_counts()
    return {"import_s": imported - started, "first_s": seconds[0], "steady_s": seconds[1], "first_cpu_s": cpu[0],
            "steady_cpu_s": cpu[1], "numba_loaded": numba_loaded, "compiled": counts[0], "loaded": counts[1]}


def child_serve(config_path: str, cache: str, mode: str, micro_batch: int) -> dict:
    started = time.perf_counter()
    import tokenloom
    import tokenloom.builder as tb
    import tokenloom.serve as ts

    imported = time.perf_counter()
    split = tokenloom.build(tb.load_build_config(config_path, cache_dir=cache, mode=mode)).split("train")
    opened = time.perf_counter()
    geometry = ts.BatchGeometry(global_batch_size=micro_batch, micro_batch_size=micro_batch, dp=1)
    seconds, cpu = [], []
    for _ in range(2):
        begin, begin_cpu = time.perf_counter(), _cpu_seconds()
        ts.RankLoader(split, geometry).next_batch()
        seconds.append(time.perf_counter() - begin)
        cpu.append(_cpu_seconds() - begin_cpu)
        if len(seconds) == 1:
            numba_loaded, counts = "numba" in sys.modules, _kernel_counts()
    return {"import_s": imported - started, "open_s": opened - imported, "first_s": seconds[0],
            "steady_s": seconds[1], "first_cpu_s": cpu[0], "steady_cpu_s": cpu[1], "numba_loaded": numba_loaded,
            "compiled": counts[0], "loaded": counts[1]}


# ------------------------------------------------------------------------------------ the parent


def _env(numba_cache: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "NUMBA_CACHE_DIR")}
    env["PYTHONPATH"] = SRC + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if numba_cache is not None:
        env["NUMBA_CACHE_DIR"] = numba_cache
    return env


def _child(python: str, args: list[str], numba_cache: str | None = None) -> dict:
    done = subprocess.run([python, os.path.abspath(__file__), "--_child", *args], env=_env(numba_cache),
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"child {args} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def make_config(work_dir: str, python: str, *, stores: int, tokens: float, documents: float,
                seq_length: int = 2048, epochs: float = 1.5, split: str = "969,30,1") -> str:
    """Writes the corpus (``make_corpus.py``) and a build config for it; returns the config's path."""
    import yaml

    corpus = os.path.join(work_dir, "corpus")
    if not os.path.exists(os.path.join(corpus, "corpus.json")):
        subprocess.run([python, os.path.join(ROOT, "benchmarks", "make_corpus.py"), "--out", corpus, "--stores",
                        str(stores), "--tokens", str(tokens), "--documents", str(documents)], env=_env(),
                       check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(corpus, "corpus.json")) as f:
        manifest = json.load(f)
    fractions = [float(x) for x in split.split(",")]
    samples = [max(1, int(epochs * manifest["num_tokens"] * f / sum(fractions) / seq_length)) for f in fractions]
    config = {"blend": {"prefixes": [s["prefix"] for s in manifest["stores"]],
                        "weights": [float(s["num_tokens"]) for s in manifest["stores"]]},
              "split": split, "seq_length": seq_length, "train_samples": samples[0], "valid_samples": samples[1],
              "test_samples": samples[2], "seed": 1234}
    path = os.path.join(work_dir, "build.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(config, f)
    return path


def _median_row(what: str, cache: str, outs: list[dict]) -> dict:
    row = {"what": what, "numba_cache": cache, "runs": len(outs)}
    for key in ("import_s", "open_s", "first_s", "steady_s", "first_cpu_s", "steady_cpu_s", "compiled", "loaded"):
        if key in outs[0]:
            row[key] = statistics.median(o[key] for o in outs)
    if "first_s" in row:
        row["added_s"] = statistics.median(o["first_s"] - o["steady_s"] for o in outs)
        row["added_cpu_s"] = statistics.median(o["first_cpu_s"] - o["steady_cpu_s"] for o in outs)
        row["numba_loaded"] = any(o["numba_loaded"] for o in outs)
    return row


def first_use_table(work_dir: str, *, repeats: int = 3, python: str = sys.executable, stores: int = 10,
                    tokens: float = 1e8, documents: float = 1e6, micro_batch: int = 8) -> list[dict]:
    """Rows of the first-use table (see the module docstring): imports, then ``tokenloom build`` and
    serving, exact and stateless, each with an empty and a warm numba cache."""
    os.makedirs(work_dir, exist_ok=True)
    subprocess.run([python, "-m", "compileall", "-q", os.path.join(SRC, "tokenloom")], env=_env(), check=True)
    config = make_config(work_dir, python, stores=stores, tokens=tokens, documents=documents)
    rows = []
    for module in IMPORTS:
        _child(python, ["import", module])  # page cache and bytecode of this module warm
        rows.append(_median_row(f"import {module}", "-", [_child(python, ["import", module])
                                                         for _ in range(repeats)]))

    def numba_dir(name: str) -> str:
        path = os.path.join(work_dir, "numba", name)
        shutil.rmtree(path, ignore_errors=True)
        return path

    def scratch(name: str) -> str:
        path = os.path.join(work_dir, "scratch", name)
        shutil.rmtree(path, ignore_errors=True)
        return path

    for mode in MODES:
        empty, warm = [], []
        for r in range(repeats):
            cache = numba_dir(f"build-{mode}-{r}")
            empty.append(_child(python, ["build", config, scratch(f"build-{mode}-empty"), mode], cache))
            warm.append(_child(python, ["build", config, scratch(f"build-{mode}-warm"), mode], cache))
        rows.append(_median_row(f"tokenloom build, {mode}", "empty", empty))
        rows.append(_median_row(f"tokenloom build, {mode}", "warm", warm))
    for mode in MODES:
        built = os.path.join(work_dir, "served", mode)
        if not os.path.isdir(built):
            _child(python, ["build", config, built, mode], numba_dir("setup"))
        built = os.path.join(built, "first")  # the first of the child's two builds
        empty, warm = [], []
        for r in range(repeats):
            cache = numba_dir(f"serve-{mode}-{r}")
            empty.append(_child(python, ["serve", config, built, mode, str(micro_batch)], cache))
            warm.append(_child(python, ["serve", config, built, mode, str(micro_batch)], cache))
        rows.append(_median_row(f"first micro-batch, {mode}", "empty", empty))
        rows.append(_median_row(f"first micro-batch, {mode}", "warm", warm))
    return rows


def format_table(rows: list[dict]) -> str:
    lines = ["| what | numba cache | import s | first call s (CPU s) | steady call s (CPU s) | "
             "added by first use s (CPU s) | kernels compiled / loaded |", "|---|---|---:|---:|---:|---:|---:|"]
    for row in rows:
        if "first_s" not in row:
            lines.append(f"| {row['what']} | - | {row['import_s']:.3f} | | | | |")
            continue
        kernels = f"{row['compiled']:.0f} / {row['loaded']:.0f}" if row["numba_loaded"] else "numba not loaded"
        lines.append(f"| {row['what']} | {row['numba_cache']} | {row['import_s']:.3f} | "
                     f"{row['first_s']:.3f} ({row['first_cpu_s']:.2f}) | {row['steady_s']:.3f} "
                     f"({row['steady_cpu_s']:.2f}) | {row['added_s']:.3f} ({row['added_cpu_s']:.2f}) | {kernels} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default="/tmp/tokenloom-first-use", help="scratch directory (corpus, caches)")
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per row (median)")
    parser.add_argument("--python", default=sys.executable, help="interpreter of the children (e.g. a fresh venv)")
    parser.add_argument("--stores", type=int, default=10)
    parser.add_argument("--tokens", type=float, default=1e8)
    parser.add_argument("--documents", type=float, default=1e6)
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--_child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._child:
        kind, *rest = args._child
        if kind == "import":
            out = child_import(*rest)
        elif kind == "build":
            out = child_build(*rest)
        else:
            out = child_serve(rest[0], rest[1], rest[2], int(rest[3]))
        print(json.dumps(out))
        return 0
    rows = first_use_table(args.work, repeats=args.repeats, python=args.python, stores=args.stores,
                           tokens=args.tokens, documents=args.documents)
    print(f"{args.stores} stores, {args.tokens:.3g} tokens, {args.documents:.3g} documents; python {args.python}; "
          f"{os.cpu_count()} cores; median of {args.repeats} fresh processes per row")
    print()
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
