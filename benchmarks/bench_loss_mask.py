"""Loss masks: the sidecar's bytes per token, writing it, and serving with it, in one run.

    flock /tmp/tokenloom-bench.lock python benchmarks/bench_loss_mask.py --tokens 100000000

Three tables:

1. **Disk.** A chat-like uint16 store of ``--tokens`` tokens (lognormal documents, each a prompt
   outside the loss then an answer in it, the end-of-document token last) written with
   ``IndexedDatasetWriter.add_documents(..., loss_mask=...)``: the bytes of each file per token,
   beside a byte-per-token mask (OLMo-core's bool ``label_mask``, the other design considered).
2. **Writing.** The same tokens written with and without the mask, in ``--rounds`` alternating
   rounds: the median seconds and the ratio (the peer is the writer without masks).
3. **Serving.** ``BatchPipeline.read`` micro-batches of ``--micro`` samples at each of
   ``--seq-lengths``, exact and stateless mode, ``eod_mask_loss`` on, from three copies of the same
   tokens: without a mask (the peer: what the pipeline costs with no masked store), with the
   bit-packed sidecar, and with the same mask as a byte per token (the reader's mask gather swapped
   for the same compiled loop reading a uint8 memory map: the read cost of the design not taken). The three read
   the same positions one after the other in a rotating order, so a noisy machine slows each
   alike; the table gives the median time per micro-batch over ``--rounds`` rounds and each
   masked form's median (range) of per-round ratios to the unmasked one. Before timing, the run
   checks that the served ``loss_mask`` is the stored mask of each label times the EOD mask.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import numpy as np

VOCAB = 50257
EOD = VOCAB - 1
META = {"tokenizer": {"kind": "bytes", "name": "bench", "path": None, "sha256": None, "vocab_size": VOCAB,
                      "eod_id": EOD, "append_eod": True}}


def chat_corpus(num_tokens: int, seed: int):
    """``(tokens, lengths, mask)``: lognormal documents (mean ~600 tokens), each a prompt of a
    random share outside the loss and an answer in it, ending in EOD."""
    rng = np.random.default_rng(seed)
    sigma = 1.0
    lengths = np.maximum(2, rng.lognormal(np.log(600) - sigma**2 / 2, sigma, num_tokens // 300)).astype(np.int64)
    ends = np.cumsum(lengths)
    keep = int(np.searchsorted(ends, num_tokens))
    lengths, ends = lengths[:keep], ends[:keep]
    total = int(ends[-1])
    tokens = rng.integers(0, EOD, total, dtype=np.uint16)
    tokens[ends - 1] = EOD
    starts = ends - lengths
    prompts = (lengths * rng.uniform(0.1, 0.7, lengths.shape[0])).astype(np.int64)  # (documents,)
    # mask: 0 on [start, start + prompt), 1 after: a step per document from the cumulative sum
    steps = np.zeros(total + 1, dtype=np.int64)
    np.add.at(steps, starts, -1)
    np.add.at(steps, starts + prompts, 1)
    mask = (np.cumsum(steps[:-1]) + 1).astype(np.uint8)
    return tokens, lengths, mask


def write(prefix: str, tokens, lengths, mask) -> float:
    from tokenloom.io import IndexedDatasetWriter

    start = time.perf_counter()
    with IndexedDatasetWriter(prefix, dtype=np.uint16) as writer:
        chunk = 1 << 16  # documents per call, as a tokenizer hands them over
        ends = np.concatenate([[0], np.cumsum(lengths)])
        for begin in range(0, lengths.shape[0], chunk):
            stop = min(lengths.shape[0], begin + chunk)
            a, b = int(ends[begin]), int(ends[stop])
            writer.add_documents(tokens[a:b], lengths[begin:stop], loss_mask=None if mask is None else mask[a:b])
        writer.finalize(META)
    return time.perf_counter() - start


def bench_disk_and_write(args, work: str, tokens, lengths, mask) -> tuple[list[dict], list[dict], str, str]:
    masked, plain = os.path.join(work, "chat"), os.path.join(work, "plain")
    seconds = {"with mask": [], "without": []}
    for r in range(args.rounds):
        order = [("with mask", masked, mask), ("without", plain, None)]
        for name, prefix, m in order if r % 2 == 0 else order[::-1]:
            seconds[name].append(write(prefix, tokens, lengths, m))
    num_tokens = int(tokens.shape[0])
    files = {"PREFIX.bin (uint16 tokens)": os.path.getsize(masked + ".bin"),
             "PREFIX.idx": os.path.getsize(masked + ".idx"),
             "PREFIX.mask (bits, tokenloom)": os.path.getsize(masked + ".mask"),
             "a byte per token (OLMo-core's bool label_mask)": num_tokens}
    disk = [{"file": name, "bytes": size, "bytes_per_token": size / num_tokens} for name, size in files.items()]
    base = statistics.median(seconds["without"])
    writing = [{"writer": name, "seconds": statistics.median(s), "tokens_per_s": num_tokens / statistics.median(s),
                "ratio": statistics.median(s) / base} for name, s in seconds.items()]
    return disk, writing, masked, plain


def _byte_rows(byte_mask, sequence_pointers, itemsize, bounds, document_ids, offsets, lengths, out, out_rows):
    """The gather of a byte-per-token mask: the loop of ``source.gather._mask_rows_kernel`` with a
    byte read where it reads a bit."""
    width = out.shape[1]
    for k in range(bounds.shape[0] - 1):
        r = out_rows[k]
        column = 0
        for piece in range(bounds[k], bounds[k + 1]):
            base = np.int64(sequence_pointers[document_ids[piece]]) // itemsize + offsets[piece]
            for t in range(lengths[piece]):
                out[r, column + t] = byte_mask[base + t]
            column += lengths[piece]
        for c in range(column, width):
            out[r, c] = 1


def use_byte_mask(source, mask: np.ndarray, work: str) -> None:
    """Serve ``source``'s (one) dataset's mask from a byte per token (a uint8 memory map) through
    the same compiled loop as the bits, instead of its sidecar."""
    import numba

    path = os.path.join(work, "mask.u8")
    if not os.path.exists(path):
        mask.tofile(path)
    byte_mask = np.asarray(np.memmap(path, dtype=np.uint8, mode="r"))
    kernel = numba.njit(nogil=True)(_byte_rows)
    reader = source.readers[0]
    store = reader.store

    def loss_masks_into(sample_ids, out, out_rows, *, backend=None):
        spans = reader.spans(sample_ids)
        kernel(byte_mask, np.asarray(store.sequence_pointers), np.int64(store.itemsize), spans.bounds,
               spans.document_ids, spans.offsets, spans.lengths, out, np.ascontiguousarray(out_rows, dtype=np.int64))

    reader.loss_masks_into = loss_masks_into


def sources(mode: str, prefixes, seq: int, num_samples: int):
    from tokenloom.source import StatelessBlendSource, StoreBlendSource

    kind = StoreBlendSource if mode == "exact" else StatelessBlendSource
    return [kind.from_prefixes([prefix], num_samples=num_samples, seq_length=seq, seed=1234) for prefix in prefixes]


def check(source, pipeline, mask, positions) -> None:
    """The served loss mask is the stored mask of each label times the EOD mask."""
    dataset_ids, sample_ids = source.locate(positions)
    out = pipeline.read(dataset_ids, sample_ids)
    spans = source.readers[0].spans(sample_ids)
    store = source.readers[0].store
    for k in range(positions.shape[0]):
        part = slice(spans.bounds[k], spans.bounds[k + 1])
        starts = store.sequence_pointers[spans.document_ids[part]] // 2 + spans.offsets[part]
        row_mask = np.concatenate([mask[s:s + n] for s, n in zip(starts, spans.lengths[part])])
        row = np.concatenate([np.asarray(store.tokens[s:s + n]) for s, n in zip(starts, spans.lengths[part])])
        want = row_mask[1:] * (row[:-1] != EOD)
        if not np.array_equal(out["loss_mask"][k], want.astype(np.float32)):
            raise SystemExit(f"served loss_mask differs from the stored mask at sample {k}")


def bench_serving(args, work: str, masked: str, plain: str, mask: np.ndarray) -> list[dict]:
    from tokenloom.serve import SampleOptions
    from tokenloom.serve.batch import BatchPipeline

    options = SampleOptions(eod_mask_loss=True)
    names = ["without a mask", "bit-packed sidecar", "byte per token"]
    rows = []
    for seq in args.seq_lengths:
        for mode in ("exact", "stateless"):
            made = sources(mode, [plain, masked, masked], seq, args.samples)
            use_byte_mask(made[2], mask, work)
            pipelines = [BatchPipeline(s, options=options) for s in made]
            for source, pipeline in zip(made[1:], pipelines[1:]):
                check(source, pipeline, mask, np.arange(args.micro))
                for r in range(3):  # warm: compiled kernels, maps
                    pipeline.read(*source.locate(np.arange(r * args.micro, (r + 1) * args.micro)))
            rng = np.random.default_rng(seq)
            times = {name: [] for name in names}
            for r in range(args.rounds):
                spent = dict.fromkeys(names, 0.0)
                batches = rng.integers(0, args.samples - args.micro, size=args.batches)
                for b, first in enumerate(batches.tolist()):
                    positions = np.arange(first, first + args.micro)
                    for j in range(3):
                        i = (j + b + r) % 3
                        source, pipeline = made[i], pipelines[i]
                        start = time.perf_counter()
                        pipeline.read(*source.locate(positions))
                        spent[names[i]] += time.perf_counter() - start
                for name in names:
                    times[name].append(spent[name] / args.batches)
            base = times[names[0]]
            for name in names:
                ratios = [t / b for t, b in zip(times[name], base)]
                per_batch = statistics.median(times[name])
                rows.append({"seq": seq, "mode": mode, "reader": name, "ms_per_micro_batch": 1e3 * per_batch,
                             "samples_per_s": args.micro / per_batch, "ratio_median": statistics.median(ratios),
                             "ratio_min": min(ratios), "ratio_max": max(ratios)})
                print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=100_000_000)
    parser.add_argument("--seq-lengths", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--samples", type=int, default=20000, help="samples of each serving source")
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--batches", type=int, default=200, help="micro-batches per serving round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--work", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    work = args.work or tempfile.mkdtemp(prefix="tl_loss_mask_")
    os.makedirs(work, exist_ok=True)
    try:
        tokens, lengths, mask = chat_corpus(args.tokens, seed=7)
        disk, writing, masked, plain = bench_disk_and_write(args, work, tokens, lengths, mask)
        for row in disk + writing:
            print(json.dumps(row), flush=True)
        serving = bench_serving(args, work, masked, plain, mask)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    result = {"tokens": int(tokens.shape[0]), "outside_loss": float(1 - mask.mean()), "disk": disk,
              "writing": writing, "serving": serving}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    print(f"\n{result['tokens']:,} tokens, {100 * result['outside_loss']:.1f}% outside the loss\n")
    print("| file | bytes | bytes per token |\n|---|---:|---:|")
    for row in disk:
        print(f"| {row['file']} | {row['bytes']:,} | {row['bytes_per_token']:.4f} |")
    print("\n| writer | seconds | tokens/s | vs without |\n|---|---:|---:|---:|")
    for row in writing:
        print(f"| {row['writer']} | {row['seconds']:.2f} | {row['tokens_per_s']:,.0f} | {row['ratio']:.2f}x |")
    print("\n| seq | mode | reader | samples/s | ms per micro-batch | time vs without a mask |\n"
          "|---:|---|---|---:|---:|---:|")
    for row in serving:
        print(f"| {row['seq']} | {row['mode']} | {row['reader']} | {row['samples_per_s']:,.0f} | "
              f"{row['ms_per_micro_batch']:.3f} | {row['ratio_median']:.3f}x ({row['ratio_min']:.2f}.."
              f"{row['ratio_max']:.2f}) |")


if __name__ == "__main__":
    main()
