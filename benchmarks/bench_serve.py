"""Serving speed and memory, against megatron-core's BlendedDataset, in one run.

    flock /tmp/tokenloom-bench.lock python benchmarks/bench_serve.py \
        --tokens-per-store 20000000 --samples 2000 --rss-documents 100000000

Four tables:

1. Throughput at seq 2048, one process, real tokens read through the mmap: megatron-core's
   ``BlendedDataset[i]`` loop against tokenloom's micro-batches (``RankLoader``: one vectorised
   ``read_spans`` per dataset per micro-batch) over the same stores, exact mode (sample for sample
   identical, checked) and stateless mode; with plain fields and with EOD resets.
2. Resident memory of a serving process (fresh subprocess: open or build the split, serve 100
   micro-batches) on corpora of 1e6 and ``--rss-documents`` documents: the stateless source, the
   exact source built in memory, and the exact indices of a ``tokenloom.build`` cache (built by an
   earlier process, memory-mapped here). Anonymous memory (RssAnon) is the process's own;
   file-backed pages (RssFile) are the page cache of memory-mapped files, reclaimable by the kernel.
3. DataLoader workers (EOD resets and loss mask on) feeding a consumer that takes
   ``--consumer-rate`` tokens/s (it sleeps ``tokens / rate`` per micro-batch, as a host waits on
   an accelerator): achieved rate and the share of wall time spent waiting for data, for
   ``build_dataloader`` (one DataLoader item per micro-batch) and ``DistributedBatches`` (one item
   per optimizer step of ``--accumulation`` micro-batches, sliced in the main process).
4. Document boundaries (``inter_document_masking``) at ``--boundary-seq-lengths`` (2048 and 8192):
   tokenloom's micro-batches (locate + the batch pipeline) with megatron-core's
   ``cu_seqlens``/``max_seqlen`` and with the packed THD form, against the same pipeline without
   them and against megatron-core's ``BlendedDataset[i]`` with ``inter_document_masking=True`` (its
   per-document Python loop). The three tokenloom pipelines read the same micro-batch one after
   the other, in a rotating order, so that a noisy machine slows each alike; over ``--rounds``
   rounds (each with megatron-core's loop) the table gives the median time and what the fields add
   as the median (and range) of each round's ratio to the plain pipeline. The boundaries are
   checked field for field against megatron-core in the same run.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings

import numpy as np

VOCAB = 50257
EOD = VOCAB - 1


def write_store(prefix: str, num_documents: int, mean_length: float, seed: int, chunk: int = 1 << 22) -> str:
    """A uint16 store of lognormal document lengths and random tokens, each document ending in EOD,
    written in chunks (constant memory apart from the .idx arrays)."""
    from tokenloom.io.writer import write_index_file, write_json_atomic

    rng = np.random.default_rng(seed)
    sigma = 1.0
    mu = np.log(mean_length) - sigma**2 / 2
    lengths = np.maximum(1, rng.lognormal(mu, sigma, num_documents)).astype(np.int32)
    with open(prefix + ".bin", "wb") as f:
        for begin in range(0, num_documents, chunk):
            part = lengths[begin:begin + chunk]
            tokens = rng.integers(0, EOD, int(part.sum()), dtype=np.uint16)
            tokens[np.cumsum(part, dtype=np.int64) - 1] = EOD  # (documents,) last token of each
            tokens.tofile(f)
    write_index_file(prefix + ".idx", np.dtype(np.uint16), lengths, np.arange(num_documents + 1, dtype=np.int64))
    write_json_atomic(prefix + ".meta.json", {"tokenizer": {"kind": "bytes", "name": "bench", "path": None,
                                                            "sha256": None, "vocab_size": VOCAB, "eod_id": EOD,
                                                            "append_eod": True}})
    return prefix


# ------------------------------------------------------------------------------------ throughput


def megatron_dataset(prefixes, weights, num_samples, seq_length, seed, cache, resets, documents=False):
    warnings.filterwarnings("ignore")
    logging.getLogger("megatron").setLevel(logging.ERROR)
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.tokenizers import MegatronTokenizer

    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length, blend=(list(prefixes), list(weights)), split="1,0,0",
        path_to_cache=cache,
        tokenizer=MegatronTokenizer.from_pretrained(metadata_path={"library": "null-text"}, vocab_size=VOCAB),
        reset_position_ids=resets, reset_attention_mask=False, eod_mask_loss=resets, create_attention_mask=False,
        inter_document_masking=documents)
    return BlendedMegatronDatasetBuilder(GPTDataset, [num_samples, 0, 0], lambda: True, config).build()[0]


def bench_throughput(args, prefixes, directory) -> list[dict]:
    from tokenloom.serve import BatchGeometry, RankLoader, SampleOptions
    from tokenloom.source import StatelessBlendSource, StoreBlendSource

    weights = [0.5, 0.3, 0.2][: len(prefixes)]
    n, seq = args.samples, args.seq_length
    rows = []
    for resets in (False, True):
        label = "eod resets + loss mask" if resets else "plain fields"
        options = SampleOptions(reset_position_ids=resets, eod_mask_loss=resets)
        theirs = megatron_dataset(prefixes, weights, n, seq, 1234, os.path.join(directory, "cache"), resets)
        start = time.perf_counter()
        for i in range(n):
            theirs[i]
        megatron_seconds = time.perf_counter() - start
        rows.append({"case": label, "reader": "megatron-core BlendedDataset[i] loop", "seconds": megatron_seconds})

        exact = StoreBlendSource.from_prefixes(prefixes, weights, num_samples=n, seq_length=seq, seed=1234)
        geometry = BatchGeometry(global_batch_size=args.micro_batch, micro_batch_size=args.micro_batch, dp=1)
        loader = RankLoader(exact, geometry, options=options, max_steps=n // args.micro_batch)
        first = loader.next_batch()
        for j in range(args.micro_batch):  # exact mode serves megatron's samples
            for key in ("tokens", "labels", "loss_mask", "position_ids"):
                if not np.array_equal(first[key][j], theirs[j][key].numpy()):
                    raise SystemExit(f"exact mode differs from megatron-core at sample {j} field {key}")
        loader = RankLoader(exact, geometry, options=options, max_steps=n // args.micro_batch)
        start = time.perf_counter()
        for _ in loader:
            pass
        rows.append({"case": label, "reader": f"tokenloom RankLoader, exact (micro-batch {args.micro_batch})",
                     "seconds": time.perf_counter() - start})

        stateless = StatelessBlendSource.from_prefixes(prefixes, weights, num_samples=n, seq_length=seq, seed=1234)
        loader = RankLoader(stateless, geometry, options=options, max_steps=n // args.micro_batch)
        loader.next_batch()  # numba compilation outside the timing
        loader = RankLoader(stateless, geometry, options=options, max_steps=n // args.micro_batch)
        start = time.perf_counter()
        for _ in loader:
            pass
        rows.append({"case": label, "reader": f"tokenloom RankLoader, stateless (micro-batch {args.micro_batch})",
                     "seconds": time.perf_counter() - start})
        for row in rows[-3:]:
            row["samples_per_s"] = n / row["seconds"]
            row["tokens_per_s"] = n * seq / row["seconds"]
            row["ratio"] = megatron_seconds / row["seconds"]
    return rows


# ------------------------------------------------------------------------------------ document boundaries


def bench_boundaries(args, prefixes, directory) -> list[dict]:
    """Table 4: the cost of the boundary fields, per micro-batch, and megatron-core's loop with them."""
    from tokenloom.serve import BatchGeometry, BatchPipeline, RankLoader, SampleOptions
    from tokenloom.serve.stream import SampleStream
    from tokenloom.source import StoreBlendSource

    weights = [0.5, 0.3, 0.2][: len(prefixes)]
    n, micro = args.samples, args.micro_batch
    kinds = {"without boundaries": SampleOptions(),
             "cu_seqlens, max_seqlen (megatron)": SampleOptions(inter_document_masking=True),
             "packed THD + document_ids": SampleOptions(inter_document_masking=True, boundary_format="thd")}
    rows = []
    for seq in args.boundary_seq_lengths:
        exact = StoreBlendSource.from_prefixes(prefixes, weights, num_samples=n, seq_length=seq, seed=1234)
        theirs = megatron_dataset(prefixes, weights, n, seq, 1234, os.path.join(directory, "cache"), False,
                                  documents=True)
        geometry = BatchGeometry(global_batch_size=micro, micro_batch_size=micro, dp=1)
        first = RankLoader(exact, geometry, options=kinds["cu_seqlens, max_seqlen (megatron)"], max_steps=1)
        first = first.next_batch()
        for j in range(micro):  # the same samples, field for field
            for key, value in theirs[j].items():
                if not np.array_equal(first[key][j], np.asarray(value)):
                    raise SystemExit(f"seq {seq}: tokenloom differs from megatron-core at sample {j} field {key}")
        times: dict[str, list[float]] = {name: [] for name in ("megatron-core", *kinds)}
        stream = SampleStream(exact)
        pipelines = {name: BatchPipeline(exact, options=options) for name, options in kinds.items()}
        for pipeline in pipelines.values():  # first use (numba's cache, the stores' pages) outside the timing
            pipeline.read(*stream.locate(np.arange(micro)))
        names = list(kinds)
        for _ in range(args.rounds):
            start = time.perf_counter()
            for i in range(n):
                theirs[i]
            times["megatron-core"].append(time.perf_counter() - start)
            # the kinds take turns micro-batch by micro-batch (in a rotating order), so that a
            # noisy machine slows each alike; each reads the same positions
            spent = dict.fromkeys(names, 0.0)
            for k, begin in enumerate(range(0, n - micro + 1, micro)):
                positions = np.arange(begin, begin + micro)
                for name in names[k % len(names):] + names[:k % len(names)]:
                    start = time.perf_counter()
                    pipelines[name].read(*stream.locate(positions))
                    spent[name] += time.perf_counter() - start
            for name in names:
                times[name].append(spent[name] * n / (n - n % micro))
        megatron_seconds = float(np.median(times["megatron-core"]))
        plain = np.asarray(times["without boundaries"])
        for name, seconds in times.items():
            paired = np.asarray(seconds) / plain - 1  # each round against the plain run of that round
            seconds = float(np.median(seconds))
            reader = ("megatron-core BlendedDataset[i] loop, inter_document_masking" if name == "megatron-core"
                      else f"tokenloom, exact, {name} (micro-batch {micro})")
            rows.append({"seq_length": seq, "reader": reader, "seconds": seconds, "samples_per_s": n / seconds,
                         "per_micro_batch_ms": 1e3 * seconds / (n / micro),
                         "vs_megatron": megatron_seconds / seconds,
                         "added": None if name in ("megatron-core", "without boundaries") else float(np.median(paired)),
                         "added_range": None if name in ("megatron-core", "without boundaries")
                         else [float(paired.min()), float(paired.max())], "rounds": times[name]})
    return rows


# ------------------------------------------------------------------------------------ memory


def _memory() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) / 1024  # MiB
    return out


def rss_child(kind: str, prefix: str, seq_length: int, micro_batch: int) -> None:
    """Run in a fresh process: build one split in memory, serve 100 micro-batches, print memory."""
    from tokenloom.serve import BatchGeometry, RankLoader
    from tokenloom.source import StatelessBlendSource, StoreBlendSource

    num_samples = 100 * micro_batch
    start = time.perf_counter()
    if kind == "megatron":
        dataset = megatron_dataset([prefix], [1.0], num_samples, seq_length, 1, tempfile.mkdtemp(), False)
        built = time.perf_counter() - start
        for i in range(num_samples):
            dataset[i]
    else:
        if kind == "exact-build":  # the exact indices of a tokenloom build, memory-mapped from its cache
            import tokenloom
            import tokenloom.builder as tb
            from tokenloom.index.blend_spec import BlendSpec

            config = tb.BuildConfig(seq_length=seq_length, blend=BlendSpec(prefixes=(prefix,), weights=(1.0,)),
                                    split="1,0,0",
                                    train_samples=num_samples, valid_samples=0, test_samples=0, seed=1,
                                    cache_dir=prefix + ".cache")
            source = tokenloom.build(config).split("train")
        else:
            cls = StoreBlendSource if kind == "exact" else StatelessBlendSource
            source = cls.from_prefixes([prefix], [1.0], num_samples=num_samples, seq_length=seq_length, seed=1)
        built = time.perf_counter() - start
        geometry = BatchGeometry(global_batch_size=micro_batch, micro_batch_size=micro_batch, dp=1)
        for _ in RankLoader(source, geometry):
            pass
    print(json.dumps({**_memory(), "build_seconds": built}))


def bench_memory(args, directory) -> list[dict]:
    rows = []
    for num_documents in (1_000_000, args.rss_documents):
        prefix = os.path.join(directory, f"rss{num_documents}")
        start = time.perf_counter()
        write_store(prefix, num_documents, args.rss_mean_length, seed=7)
        print(f"# wrote {num_documents:,} documents in {time.perf_counter() - start:.0f} s", file=sys.stderr)
        kinds = ["stateless", "exact", "exact-build"] + (["megatron"] if args.rss_megatron else [])
        for kind in kinds:
            if kind == "exact-build":  # build the cache first; measure a process that only opens it
                subprocess.run([sys.executable, __file__, "--rss-child", kind, prefix, "--seq-length",
                                str(args.seq_length), "--micro-batch", str(args.micro_batch)],
                               capture_output=True, text=True, check=True)
            result = subprocess.run([sys.executable, __file__, "--rss-child", kind, prefix, "--seq-length",
                                     str(args.seq_length), "--micro-batch", str(args.micro_batch)],
                                    capture_output=True, text=True, check=True)
            measured = json.loads(result.stdout.strip().splitlines()[-1])
            rows.append({"documents": num_documents, "kind": kind, **measured})
        for suffix in (".bin", ".idx", ".meta.json"):
            os.remove(prefix + suffix)
        shutil.rmtree(prefix + ".cache", ignore_errors=True)
    return rows


# ------------------------------------------------------------------------------------ data loader


def _consume(iterator, rate, warmup: int) -> tuple[float, float]:
    """Pull batches (after ``warmup`` untimed ones and a pause that lets the prefetch queue fill);
    a consumer with ``rate`` sleeps tokens / rate seconds per batch. Returns (tokens/s, waiting share)."""
    for _ in range(warmup):
        next(iterator)
    time.sleep(1.0)
    waited, tokens = 0.0, 0
    start = time.perf_counter()
    while True:
        t0 = time.perf_counter()
        try:
            batch = next(iterator)
        except StopIteration:
            break
        waited += time.perf_counter() - t0
        tokens += batch["tokens"].numel()
        if rate is not None:  # the consumer (an accelerator): off the CPU for tokens / rate seconds
            time.sleep(batch["tokens"].numel() / rate)
    total = time.perf_counter() - start
    return tokens / total, waited / total


def bench_loader(args, prefixes) -> list[dict]:
    from tokenloom.serve import BatchGeometry, SampleOptions, Topology
    from tokenloom.serve.torch_adapter import DistributedBatches, build_dataloader
    from tokenloom.source import StoreBlendSource

    seq, micro, accumulation = args.seq_length, args.micro_batch, args.accumulation
    warmup_steps = 2 + args.workers * 4
    steps = max(1, int(args.loader_seconds * args.consumer_rate / (seq * micro * accumulation))) + warmup_steps
    source = StoreBlendSource.from_prefixes(prefixes, [0.5, 0.3, 0.2][: len(prefixes)],
                                            num_samples=steps * micro * accumulation, seq_length=seq, seed=3)
    geometry = BatchGeometry(global_batch_size=micro * accumulation, micro_batch_size=micro, dp=1)
    options = SampleOptions(reset_position_ids=True, eod_mask_loss=True)
    rows = []
    for workers in (0, args.workers):
        for rate in (None, args.consumer_rate):
            loader = build_dataloader(source, geometry, options=options, num_workers=workers,
                                      prefetch_factor=4 if workers else None, max_steps=steps, stateful=False)
            # warm-up: every worker has loaded the compiled gather kernel (numba's disk cache)
            delivered, waiting = _consume(iter(loader), rate, warmup=warmup_steps * accumulation)
            rows.append({"loader": "build_dataloader (item = micro-batch)", "workers": workers,
                         "consumer": "none" if rate is None else f"{rate:,.0f} tokens/s",
                         "tokens_per_s": delivered, "waiting_share": waiting})
    for rate in (None, args.consumer_rate):
        batches = DistributedBatches(source, geometry, Topology(dp=1), 0, options=options, num_workers=args.workers,
                                     prefetch_factor=2, max_steps=steps)
        delivered, waiting = _consume(iter(batches), rate, warmup=warmup_steps * accumulation)
        rows.append({"loader": f"DistributedBatches (item = step of {accumulation} micro-batches)",
                     "workers": args.workers, "consumer": "none" if rate is None else f"{rate:,.0f} tokens/s",
                     "tokens_per_s": delivered, "waiting_share": waiting})
    return rows


# ------------------------------------------------------------------------------------ main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stores", type=int, default=3, help="datasets in the blend (default 3)")
    parser.add_argument("--tokens-per-store", type=int, default=20_000_000, help="tokens in each store")
    parser.add_argument("--mean-length", type=float, default=800.0, help="mean document length (lognormal)")
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--samples", type=int, default=2000, help="samples read by each reader")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--accumulation", type=int, default=8, help="micro-batches per step (loader table)")
    parser.add_argument("--rss-documents", type=int, default=100_000_000, help="documents of the large RSS corpus")
    parser.add_argument("--rss-mean-length", type=float, default=8.0, help="mean document length of the RSS corpora")
    parser.add_argument("--rss-megatron", action="store_true", help="also measure megatron-core's RSS (slow build)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--consumer-rate", type=float, default=1e6, help="consumer speed in tokens/s")
    parser.add_argument("--loader-seconds", type=float, default=10.0, help="how long the consumer runs")
    parser.add_argument("--boundary-seq-lengths", type=int, nargs="+", default=[2048, 8192],
                        help="sequence lengths of the boundary table")
    parser.add_argument("--rounds", type=int, default=9, help="rounds of the boundary table (median kept)")
    parser.add_argument("--json", help="also write every table's rows here")
    parser.add_argument("--skip", nargs="*", default=[], choices=["throughput", "memory", "loader", "boundaries"])
    parser.add_argument("--directory", default=None, help="where to write the stores (default: a temp dir)")
    parser.add_argument("--rss-child", nargs=2, metavar=("KIND", "PREFIX"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rss_child:
        rss_child(args.rss_child[0], args.rss_child[1], args.seq_length, args.micro_batch)
        return

    with tempfile.TemporaryDirectory(dir=args.directory) as directory:
        prefixes = [write_store(os.path.join(directory, f"store{k}"), int(args.tokens_per_store / args.mean_length),
                                args.mean_length, seed=k) for k in range(args.stores)]
        print(f"machine: {os.cpu_count()} cores; {args.stores} stores of ~{args.tokens_per_store:,} tokens; "
              f"seq_length {args.seq_length}\n")
        if "throughput" not in args.skip:
            rows = bench_throughput(args, prefixes, directory)
            print("| fields | reader | samples/s | tokens/s | vs megatron-core |")
            print("|---|---|---:|---:|---:|")
            for r in rows:
                print(f"| {r['case']} | {r['reader']} | {r['samples_per_s']:,.0f} | {r['tokens_per_s']:,.0f} | "
                      f"{r['ratio']:.1f}x |")
            print()
        report: dict = {}
        if "boundaries" not in args.skip:
            rows = report["boundaries"] = bench_boundaries(args, prefixes, directory)
            print("| seq | reader | samples/s | ms per micro-batch | vs megatron-core | added by the fields |")
            print("|---:|---|---:|---:|---:|---:|")
            for r in rows:
                added = ("-" if r["added"] is None else f"{100 * r['added']:+.1f}% "
                         f"({100 * r['added_range'][0]:+.0f}..{100 * r['added_range'][1]:+.0f}%)")
                print(f"| {r['seq_length']} | {r['reader']} | {r['samples_per_s']:,.0f} | "
                      f"{r['per_micro_batch_ms']:.3f} | {r['vs_megatron']:.1f}x | {added} |")
            print()
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(report, f, indent=1)
        if "loader" not in args.skip:
            rows = bench_loader(args, prefixes)
            print("| loader | workers | consumer | tokens/s delivered | consumer waiting |")
            print("|---|---:|---|---:|---:|")
            for r in rows:
                waiting = "-" if r["consumer"] == "none" else f"{100 * r['waiting_share']:.1f}%"
                print(f"| {r['loader']} | {r['workers']} | {r['consumer']} | {r['tokens_per_s']:,.0f} | {waiting} |")
            print()
        if "memory" not in args.skip:
            rows = bench_memory(args, directory)
            print("| documents | serving process | RssAnon MiB | RssFile MiB | peak RSS MiB | build s |")
            print("|---:|---|---:|---:|---:|---:|")
            for r in rows:
                print(f"| {r['documents']:,} | {r['kind']} | {r['RssAnon']:,.0f} | {r['RssFile']:,.0f} | "
                      f"{r['VmHWM']:,.0f} | {r['build_seconds']:.1f} |")


if __name__ == "__main__":
    main()
