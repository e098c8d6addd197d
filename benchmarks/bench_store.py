"""Token store speed: .idx writing and reading, against megatron-core and a bare np.memmap.

    python benchmarks/bench_store.py --documents 100000000 --read-documents 1000000

Prints two markdown tables. Writing: the .idx of N documents (lognormal lengths, mean ~1000
tokens) by tokenloom's writer vs megatron-core's _IndexWriter (which computes pointers in a
Python loop over Python lists). Reading: a store of --read-documents documents with real
tokens; random document reads/s and sequential GB/s through tokenloom's IndexedDataset,
megatron-core's IndexedDataset and a bare np.memmap (the floor). Run it alone: timings on a
shared machine are noisy, ratios less so.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np

from tokenloom.io import IndexedDataset, IndexedDatasetWriter
from tokenloom.io.writer import write_index_file


def lognormal_lengths(n: int, mean: float, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    sigma = 1.0
    mu = np.log(mean) - sigma**2 / 2
    return np.maximum(1, rng.lognormal(mu, sigma, n)).astype(np.int32)


def timed(fn, repeat: int = 1) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def bench_write(n: int, directory: str, megatron: bool) -> list[tuple[str, float]]:
    lengths = lognormal_lengths(n, 1000)
    docs = np.arange(n + 1, dtype=np.int64)
    rows = []
    ours = timed(lambda: write_index_file(os.path.join(directory, "ours.idx"), np.dtype(np.uint16), lengths, docs))
    rows.append(("tokenloom write_index_file", ours))
    if megatron:
        from megatron.core.datasets.indexed_dataset import _IndexWriter

        as_lists = (lengths.tolist(), docs.tolist())  # megatron's builder keeps Python lists

        def theirs():
            with _IndexWriter(os.path.join(directory, "theirs.idx"), np.uint16) as w:
                w.write(as_lists[0], None, as_lists[1])

        rows.append(("megatron-core _IndexWriter", timed(theirs)))
        with open(os.path.join(directory, "ours.idx"), "rb") as ours, \
                open(os.path.join(directory, "theirs.idx"), "rb") as theirs:
            same = ours.read() == theirs.read()
        rows.append(("identical bytes", float(same)))
    return rows


def make_read_corpus(n: int, directory: str) -> str:
    prefix = os.path.join(directory, "read")
    lengths = lognormal_lengths(n, 1000, seed=1)
    rng = np.random.default_rng(2)
    with IndexedDatasetWriter(prefix, dtype=np.uint16) as w:
        for begin in range(0, n, 100_000):
            part = lengths[begin : begin + 100_000]
            w.add_documents(rng.integers(0, 50000, int(part.sum()), dtype=np.uint16), part)
        w.finalize()
    return prefix


def bench_read(prefix: str, reads: int) -> list[tuple[str, float, float]]:
    ours = IndexedDataset(prefix)
    n = len(ours)
    ids = np.random.default_rng(3).integers(0, n, reads)
    pointers = np.asarray(ours.sequence_pointers) // 2
    lengths = np.asarray(ours.sequence_lengths)
    bare = np.memmap(prefix + ".bin", dtype=np.uint16, mode="r")
    readers = {
        "bare np.memmap": lambda i: bare[pointers[i] : pointers[i] + lengths[i]],
        "tokenloom IndexedDataset.get": ours.get,
    }
    try:
        from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronIndexedDataset

        theirs = MegatronIndexedDataset(prefix)
        readers["megatron-core IndexedDataset.get"] = theirs.get
    except ImportError:
        pass
    rows = []
    for name, get in readers.items():
        def random_reads(get=get):
            total = 0
            for i in ids.tolist():
                total += int(get(i)[0])
            return total

        seconds = timed(random_reads, repeat=3)
        rows.append((name, reads / seconds, 0.0))
    # Sequential: sum every token, 64 MiB at a time (all reads from the page cache after warm-up).
    chunk = 32 << 20
    def sequential(tokens):
        total = 0
        for begin in range(0, tokens.size, chunk):
            total += int(tokens[begin : begin + chunk].sum(dtype=np.uint64))
        return total

    sequential(ours.tokens)  # warm the page cache
    nbytes = ours.tokens.nbytes
    rows.append(("bare np.memmap (sequential)", 0.0, nbytes / timed(lambda: sequential(bare), 3) / 1e9))
    rows.append(("tokenloom .tokens (sequential)", 0.0, nbytes / timed(lambda: sequential(ours.tokens), 3) / 1e9))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--documents", type=int, default=100_000_000, help="documents in the .idx write test")
    parser.add_argument("--read-documents", type=int, default=1_000_000, help="documents in the read test store")
    parser.add_argument("--reads", type=int, default=200_000, help="random document reads per reader")
    parser.add_argument("--no-megatron", action="store_true", help="skip megatron-core's writer")
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        rows = bench_write(args.documents, directory, not args.no_megatron)
        print(f"\n### .idx write, {args.documents:,} documents\n")
        print("| writer | seconds |")
        print("|---|---:|")
        for name, value in rows:
            cell = ("yes" if value else "NO") if name == "identical bytes" else f"{value:.2f}"
            print(f"| {name} | {cell} |")
        timings = dict(rows)
        if "megatron-core _IndexWriter" in timings:
            print(f"\nspeed-up: {timings['megatron-core _IndexWriter'] / timings['tokenloom write_index_file']:.1f}x")
        prefix = make_read_corpus(args.read_documents, directory)
        rows = bench_read(prefix, args.reads)
        size = os.path.getsize(prefix + ".bin") / 1e9
        print(f"\n### reads, {args.read_documents:,} documents, {size:.2f} GB .bin (page cache warm)\n")
        print("| reader | random documents/s | ratio to bare | sequential GB/s |")
        print("|---|---:|---:|---:|")
        floor = rows[0][1]
        for name, per_second, gbps in rows:
            if per_second:
                print(f"| {name} | {per_second:,.0f} | {per_second / floor:.2f} | |")
            else:
                print(f"| {name} | | | {gbps:.2f} |")


if __name__ == "__main__":
    main()
