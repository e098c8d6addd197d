"""Benchmark: best-fit packing of whole documents. tokenloom's kernel vs OLMo-core's and grain's
packers, and against concatenate-and-chunk, on the same document lengths.

Rows, for each sample length (`--seq-lengths`, 2048 and 8192 by default):

* concatenate-and-chunk (Megatron's packing, and tokenloom's exact and stateless kinds): the
  documents laid end to end and cut every L tokens. It needs no padding, and a document is cut
  when a sample edge falls inside it.
* tokenloom `pack_best_fit` (`tokenloom.index.best_fit`), best fit decreasing within windows of
  `--windows` documents (and over all of them).
* OLMo-core's `InstancePacker` (ai2-olmo-core; `olmo_core/data/utils.py`), its "optimized best-fit
  decreasing" over all the documents at once (what its packed dataset does per source file).
  Long documents are handled as its `LongDocStrategy.fragment` does: pieces of L tokens, which
  are packed like documents.
* grain's `experimental.BestFitPackIterDataset`: online best fit over `--grain-bins` open rows,
  in stream order; long documents cut into L-token pieces first (grain refuses them).

All pack into samples of exactly L tokens (tokenloom's own samples hold `seq_length + 1`; here
`capacity = L` so that the three hold the same). On each set of lengths every row reports the
padding fraction, the share of documents cut (a document over L tokens is always cut), the
packing seconds, and the peak memory the packing added (VmHWM after resetting it through
/proc/self/clear_refs, less the resident size before). The anchors run on fewer documents
(`--olmo-documents`, `--grain-documents`) than tokenloom (`--documents`) because their packers
run in Python. tokenloom also runs at the anchors' sizes, so the per-core ratios compare equal
sizes.

Sets of lengths:

* real: the document lengths of a token store (`--real-store`, e.g. the one
  `bench_tokenize.py` writes: this Python installation's sources and documents through a 32k BPE);
* web-like: lognormal lengths (median e^6.3 = 545 tokens, sigma 1.1, mean ~1,000), at least one
  token each, seed 0.

The anchors need none of their heavy dependencies to pack. Without touching the environment:

    pip install --no-deps --target /tmp/packers/site ai2-olmo-core==3.0.0 grain==0.2.18 \\
        cached_path bettermap dataclass_extensions absl-py etils array_record dill protobuf
    PYTHONPATH=/tmp/packers/site python benchmarks/bench_packing.py --real-store /tmp/tlbench200/store_w0
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time

import numpy as np


def web_lengths(count: int, seed: int = 0) -> np.ndarray:
    """(count,) int64 lognormal document lengths, at least 1."""
    rng = np.random.default_rng(seed)
    return np.maximum(1, np.round(rng.lognormal(mean=6.3, sigma=1.1, size=count))).astype(np.int64)


def _rss_kib(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _measure(pack) -> dict:
    """Run ``pack()`` -> (samples, padding tokens, documents cut); add seconds and the peak memory
    it added in MiB."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")  # resets VmHWM to the current resident size
        before = _rss_kib("VmRSS")
    except OSError:
        before = None
    cpu, wall = time.process_time(), time.perf_counter()
    samples, padding, cut = pack()
    seconds, cpu = time.perf_counter() - wall, time.process_time() - cpu
    peak = (_rss_kib("VmHWM") - before) / 1024 if before is not None else float("nan")
    return {"samples": samples, "padding": padding, "cut": cut, "seconds": seconds, "cpu_s": cpu, "peak_mib": peak}


def concat_chunk(lengths: np.ndarray, length: int):
    ends = np.cumsum(lengths)
    starts = ends - lengths
    nonempty = lengths > 0
    cut = int((starts[nonempty] // length != (ends[nonempty] - 1) // length).sum())
    samples = int(-(-int(ends[-1]) // length)) if lengths.size else 0
    return samples, samples * length - int(lengths.sum()), cut


def tokenloom_pack(lengths: np.ndarray, length: int, window: int):
    from tokenloom.index.best_fit import pack_best_fit

    packing = pack_best_fit(lengths, length, window=window)
    return packing.num_samples, packing.num_samples * length - packing.num_tokens, packing.cut_documents


def _fragments(lengths: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
    """(pieces' starts, pieces' ends) of the documents laid end to end, each cut into L-token pieces."""
    ends = np.cumsum(lengths)
    starts = ends - lengths
    count = -(-lengths // length)
    doc = np.repeat(np.arange(lengths.size), count)
    index = np.arange(doc.size) - (np.cumsum(count) - count)[doc]
    piece_starts = starts[doc] + index * length
    return piece_starts, np.minimum(ends[doc], piece_starts + length)


def olmo_pack(lengths: np.ndarray, length: int):
    from olmo_core.data.utils import InstancePacker

    lengths = lengths[lengths > 0]  # an empty document makes InstancePacker pop an empty deque
    starts, ends = _fragments(lengths, length)
    instances, _, tokens = InstancePacker(length).pack_documents(np.stack([starts, ends], 1).astype(np.uint64))
    return len(instances), len(instances) * length - int(tokens), int((lengths > length).sum())


def grain_pack(lengths: np.ndarray, length: int, bins: int):
    import grain
    from grain import experimental

    lengths = lengths[lengths > 0]
    starts, ends = _fragments(lengths, length)
    source = (grain.MapDataset.source(ends - starts)
              .map(lambda n: {"inputs": np.zeros(int(n), dtype=np.int32)})
              .to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)))
    samples = padding = 0
    for row in experimental.BestFitPackIterDataset(source, length_struct={"inputs": length}, num_packing_bins=bins):
        samples += 1
        padding += int(np.count_nonzero(row["inputs_segment_ids"] == 0))
    return samples, padding, int((lengths > length).sum())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--documents", type=int, default=100_000_000, help="web-like documents tokenloom packs")
    parser.add_argument("--olmo-documents", type=int, default=1_000_000)
    parser.add_argument("--grain-documents", type=int, default=100_000)
    parser.add_argument("--grain-bins", type=int, default=1024)
    parser.add_argument("--seq-lengths", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--windows", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--real-store", default=None, help="a token store whose document lengths are the real set")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    sets = {}
    if args.real_store:
        from tokenloom.io import IndexedDataset

        sets["real"] = np.asarray(IndexedDataset(args.real_store).sequence_lengths, dtype=np.int64)
    sizes = sorted({args.grain_documents, args.olmo_documents, args.documents})
    web = web_lengths(max(sizes))
    for size in sizes:
        sets[f"web-like {size:.0e}"] = web[:size]
    # import and compile outside the timings
    tokenloom_pack(web[:100], 2048, 10)
    for anchor in (olmo_pack, lambda lengths, length: grain_pack(lengths, length, 4)):
        try:
            anchor(web[:100], 2048)
        except ImportError as exc:
            print(f"an anchor is not installed ({exc}); see this script's docstring", file=sys.stderr)
            return 2
    rows = []
    for length in args.seq_lengths:
        for name, lengths in sets.items():
            n = lengths.size
            runs = {"concatenate-and-chunk": lambda x=lengths, L=length: concat_chunk(x, L)}
            # over all documents only where its scratch (eight arrays of n) stays small
            for window in [w for w in args.windows if w < n] + ([n] if n <= 10_000_000 else []):
                label = "all documents" if window == n else f"{window:,} documents"
                runs[f"tokenloom best fit, window {label}"] = (
                    lambda x=lengths, L=length, w=window: tokenloom_pack(x, L, w))
            if (name == "real" or n == args.olmo_documents) and length & (length - 1) == 0:
                runs["OLMo-core InstancePacker, all documents"] = lambda x=lengths, L=length: olmo_pack(x, L)
            if name == "real" or n == args.grain_documents:
                runs[f"grain BestFitPackIterDataset, {args.grain_bins} bins"] = (
                    lambda x=lengths, L=length: grain_pack(x, L, args.grain_bins))
            for label, pack in runs.items():
                result = _measure(pack)
                result.update(set=name, documents=n, seq_length=length, run=label)
                rows.append(result)
                print(f"L={length} {name}: {label}: {result['seconds']:.2f} s, padding "
                      f"{result['padding'] / (result['samples'] * length):.5f}", file=sys.stderr, flush=True)

    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, python "
          f"{platform.python_version()}, peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
    print()
    print("| L | lengths | documents | run | samples | padding | documents cut | seconds | documents/s "
          "| vs OLMo-core per CPU-s | memory added MiB |")
    print("|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        olmo = [r for r in rows if r["set"] == row["set"] and r["seq_length"] == row["seq_length"]
                and r["run"].startswith("OLMo-core")]
        ratio = (f"{(row['documents'] / row['cpu_s']) / (olmo[0]['documents'] / olmo[0]['cpu_s']):.1f}x"
                 if olmo and row["cpu_s"] > 0 and not row["run"].startswith("concatenate") else "")
        print(f"| {row['seq_length']} | {row['set']} | {row['documents']:,} | {row['run']} | {row['samples']:,} | "
              f"{row['padding'] / (row['samples'] * row['seq_length']):.4%} | "
              f"{row['cut'] / row['documents']:.2%} | {row['seconds']:.2f} | "
              f"{row['documents'] / row['seconds']:,.0f} | {ratio} | {row['peak_mib']:.0f} |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
