"""Serving from an S3 endpoint against serving the same stores from local files, in one run.

    flock /tmp/tokenloom-bench.lock python benchmarks/bench_s3.py

The endpoint is moto's S3 server in its own process on 127.0.0.1 (the only S3 this machine can
reach): no network between, but every request costs its Python request handling, and moto reads
a whole object to answer a ranged GET of it, so a GET here costs time in proportion to the object
(hence many stores of 6 MB rather than a few large ones). Its latency is not S3's: what carries
over to a real endpoint are the GETs per micro-batch and the bytes fetched per token served, from
which the time per micro-batch on S3 is about ``GETs / concurrency x first-byte latency + bytes /
bandwidth``. Both sides serve the same exact-mode split of a ``tokenloom.build`` over ``--stores``
stores (uploaded with boto3's ``upload_file``), through ``RankLoader`` micro-batches of shuffled
seq-2048 samples, after one warm-up micro-batch; S3 starts each timed run with an empty block cache
of ``--cache-mib`` (8 MiB against 180 MiB of tokens: a real corpus is thousands of times larger than
any cache, and a cache that holds the whole corpus would hide the cost being measured).

Tables: serving throughput (tokens/s) and the S3/local ratio for several block sizes, with the
bytes fetched per token served (the cost of reading whole blocks for shuffled samples), GETs per
micro-batch and block-cache hit rate; the same behind an added first-byte latency, with GETs in
flight together and one at a time; a sequential read of a whole .bin (``copy_bin_to``, 64 MiB
GETs) against a local copy; opening a store cold (its .idx downloaded once per node) and warm.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_serve import write_store


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto(port: int) -> subprocess.Popen:
    import urllib.request

    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/moto-api/data.json", timeout=1).read()
            return server
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                server.kill()
                raise SystemExit("moto's server did not start; pip install 'moto[server]'") from None
            time.sleep(0.2)


def upload_stores(prefixes, bucket: str) -> list[str]:
    import boto3

    client = boto3.client("s3")
    if bucket not in [b["Name"] for b in client.list_buckets().get("Buckets", [])]:
        client.create_bucket(Bucket=bucket)
    urls = []
    for prefix in prefixes:
        name = os.path.basename(prefix)
        for suffix in (".idx", ".bin", ".meta.json"):
            client.upload_file(prefix + suffix, bucket, f"stores/{name}{suffix}")
        urls.append(f"s3://{bucket}/stores/{name}")
    return urls


def serve(split, args) -> float:
    """Seconds to serve ``args.steps`` micro-batches after one warm-up micro-batch."""
    from tokenloom.serve import BatchGeometry, RankLoader

    geometry = BatchGeometry(global_batch_size=args.micro_batch, micro_batch_size=args.micro_batch, dp=1)
    loader = RankLoader(split, geometry, max_steps=args.steps + 1)
    loader.next_batch()
    start = time.perf_counter()
    for _ in range(args.steps):
        loader.next_batch()
    return time.perf_counter() - start


def bench_serving(args, local_split, remote_config) -> list[dict]:
    import tokenloom
    from tokenloom.io import remote, s3

    rows = []
    best_local = min(serve(local_split, args) for _ in range(args.repeat))
    tokens = args.steps * args.micro_batch * args.seq_length
    rows.append({"reader": "local files (memory map)", "block_kib": None, "tokens_per_s": tokens / best_local,
                 "ratio": 1.0, "fetched_per_token": None, "gets_per_batch": None, "hit_rate": None})
    for block_kib in args.block_kib:
        os.environ["TOKENLOOM_S3_BLOCK_KIB"] = str(block_kib)
        split = tokenloom.build(remote_config).split("train")
        best, stats = float("inf"), None
        for _ in range(args.repeat):
            remote.block_cache().clear()
            cache = remote.block_cache()
            hits, misses = cache.hits, cache.misses
            requests, nbytes = s3.STATS.requests, s3.STATS.bytes
            seconds = serve(split, args)
            if seconds < best:
                best = seconds
                stats = (s3.STATS.requests - requests, s3.STATS.bytes - nbytes, cache.hits - hits,
                         cache.misses - misses)
        gets, fetched, hits, misses = stats
        rows.append({"reader": "s3:// (moto on 127.0.0.1)", "block_kib": block_kib, "tokens_per_s": tokens / best,
                     "ratio": best_local / best, "fetched_per_token": fetched / (tokens + args.micro_batch *
                                                                                 args.seq_length),
                     "gets_per_batch": gets / (args.steps + 1), "hit_rate": hits / max(1, hits + misses)})
    os.environ.pop("TOKENLOOM_S3_BLOCK_KIB", None)
    return rows


_PROXY = """
import sys, time
sys.path.insert(0, sys.argv[3])
from s3support import FaultProxy
proxy = FaultProxy(sys.argv[1])
proxy.latency_s = float(sys.argv[2])
proxy.start()
print(proxy.url, flush=True)
sys.stdin.read()
"""


def bench_latency(args, remote_config, endpoint: str) -> list[dict]:
    """The same serving through a proxy (its own process) that holds every object GET for
    ``--latency-ms`` before answering, as S3's first-byte latency does: GETs in flight together
    (the default) against one at a time (``TOKENLOOM_S3_CONCURRENCY=1``)."""
    import tokenloom
    from tokenloom.io import remote

    helpers = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "io")
    proxy = subprocess.Popen([sys.executable, "-c", _PROXY, endpoint, str(args.latency_ms / 1000), helpers],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    rows = []
    try:
        os.environ["AWS_ENDPOINT_URL"] = proxy.stdout.readline().strip()
        steps = args.steps
        args.steps = args.latency_steps
        tokens = args.steps * args.micro_batch * args.seq_length
        for concurrency in (16, 1):
            os.environ["TOKENLOOM_S3_CONCURRENCY"] = str(concurrency)
            split = tokenloom.build(remote_config).split("train")
            remote.block_cache().clear()
            seconds = serve(split, args)
            rows.append({"latency_ms": args.latency_ms, "concurrency": concurrency, "seconds_per_batch":
                         seconds / args.steps, "tokens_per_s": tokens / seconds})
        args.steps = steps
    finally:
        os.environ["AWS_ENDPOINT_URL"] = endpoint
        os.environ.pop("TOKENLOOM_S3_CONCURRENCY", None)
        proxy.stdin.close()
        proxy.terminate()
        proxy.wait()
    return rows


def bench_sequential(args, prefix: str, url: str) -> list[dict]:
    """A whole .bin read in order: copied (64 MiB GETs) and sliced through the block cache (runs of
    consecutive blocks coalesced into GETs of up to 8 MiB)."""
    from tokenloom.io import IndexedDataset, remote

    rows = []
    for label, source, how in (("local file, copy_bin_to", prefix, "copy"), ("s3://, copy_bin_to", url, "copy"),
                               ("local file, tokens[:]", prefix, "slice"), ("s3://, tokens[:]", url, "slice")):
        store = IndexedDataset(source)
        best = float("inf")
        for _ in range(args.repeat):
            if store.is_remote:
                remote.block_cache().clear()
            start = time.perf_counter()
            if how == "copy":
                with tempfile.TemporaryFile() as out:
                    store.copy_bin_to(out)
            else:
                np.array(store.tokens[:], copy=True)
            best = min(best, time.perf_counter() - start)
        rows.append({"reader": label, "bytes": store.bin_size, "seconds": best,
                     "mb_per_s": store.bin_size / best / 1e6})
    return rows


def bench_open(args, url: str, cache_dir: str) -> list[dict]:
    from tokenloom.io import IndexedDataset

    rows = []
    shutil.rmtree(cache_dir, ignore_errors=True)
    start = time.perf_counter()
    store = IndexedDataset(url)
    rows.append({"open": "cold (.idx downloaded to the node cache)", "seconds": time.perf_counter() - start,
                 "idx_bytes": store.idx_info.size})
    best = float("inf")
    for _ in range(args.repeat):
        start = time.perf_counter()
        IndexedDataset(url)
        best = min(best, time.perf_counter() - start)
    rows.append({"open": "warm (2 HEADs, the node's copy mapped)", "seconds": best, "idx_bytes": store.idx_info.size})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stores", type=int, default=32)
    parser.add_argument("--tokens-per-store", type=float, default=3e6)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--cache-mib", type=float, default=8,
                        help="block cache per process; keep it well below the corpus, as a real corpus is")
    parser.add_argument("--block-kib", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--sequential-tokens", type=float, default=1e8, help="size of the store read whole")
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--latency-steps", type=int, default=10)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()

    import tokenloom

    work = tempfile.mkdtemp(prefix="tl_s3_bench_")
    port = free_port()
    server = start_moto(port)
    os.environ.update({"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "bench",
                       "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
                       "TOKENLOOM_S3_CACHE_DIR": os.path.join(work, "node-cache"),
                       "TOKENLOOM_S3_CACHE_MIB": str(args.cache_mib)})
    try:
        mean_length = 1500.0
        documents = int(args.tokens_per_store / mean_length)
        prefixes = [write_store(os.path.join(work, f"store{k:03d}"), documents, mean_length, seed=k)
                    for k in range(args.stores)]
        started = time.perf_counter()
        urls = upload_stores(prefixes, "bench")
        print(f"uploaded {sum(os.path.getsize(p + '.bin') for p in prefixes) / 2**20:.0f} MiB in "
              f"{time.perf_counter() - started:.1f} s")

        def config(stores, cache):
            return {"blend": {"prefixes": stores, "weights": [1.0 + k % 3 for k in range(len(stores))]},
                    "split": "100,0,0",
                    "seq_length": args.seq_length, "train_samples": 20000, "valid_samples": 0, "test_samples": 0,
                    "seed": 1234, "cache_dir": os.path.join(work, cache)}

        local_split = tokenloom.build(config(prefixes, "cache-local")).split("train")
        serving = bench_serving(args, local_split, config(urls, "cache-s3"))
        latency = bench_latency(args, config(urls, "cache-s3"), f"http://127.0.0.1:{port}")
        big = write_store(os.path.join(work, "big"), int(args.sequential_tokens / mean_length), mean_length, seed=99)
        big_url = upload_stores([big], "bench")[0]
        sequential = bench_sequential(args, big, big_url)
        opening = bench_open(args, big_url, os.path.join(work, "node-cache"))
    finally:
        server.terminate()
        server.wait()
        shutil.rmtree(work, ignore_errors=True)

    print(f"\nserving {args.steps} micro-batches of {args.micro_batch} x seq {args.seq_length} "
          f"(exact mode, shuffled) from {args.stores} stores of {args.tokens_per_store:.0e} tokens, block cache "
          f"{args.cache_mib:g} MiB, best of {args.repeat}:")
    print(f"{'reader':<28} {'block':>8} {'tokens/s':>12} {'vs local':>9} {'fetched/token':>14} "
          f"{'GETs/batch':>11} {'hit rate':>9}")
    for row in serving:
        block = "" if row["block_kib"] is None else f"{row['block_kib']} KiB"
        extra = ("" if row["fetched_per_token"] is None else
                 f"{row['fetched_per_token']:>12.1f} B {row['gets_per_batch']:>11.1f} {row['hit_rate']:>9.2f}")
        print(f"{row['reader']:<28} {block:>8} {row['tokens_per_s']:>12,.0f} {row['ratio']:>9.3f} {extra}")
    print(f"\nthe same through a proxy holding each object GET {args.latency_ms:g} ms (S3's first-byte latency), "
          f"{args.latency_steps} micro-batches, 64 KiB blocks:")
    for row in latency:
        print(f"GETs in flight up to {row['concurrency']:>2}: {row['seconds_per_batch'] * 1000:>8.1f} ms per "
              f"micro-batch {row['tokens_per_s']:>12,.0f} tokens/s")
    print("\nsequential read of a whole .bin:")
    for row in sequential:
        print(f"{row['reader']:<24} {row['bytes'] / 2**20:>8.0f} MiB {row['seconds']:>8.2f} s "
              f"{row['mb_per_s']:>9.0f} MB/s")
    print("\nopening a store:")
    for row in opening:
        print(f"{row['open']:<44} {row['seconds'] * 1000:>9.1f} ms  (.idx {row['idx_bytes'] / 2**20:.1f} MiB)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"serving": serving, "latency": latency, "sequential": sequential, "open": opening,
                       "args": vars(args)}, f, indent=1)


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
