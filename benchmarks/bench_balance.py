"""Balanced ranks (issue 43): the step imbalance with and without balancing, and what placing a
step costs against reading it.

    flock /tmp/tokenloom-bench.lock python benchmarks/bench_balance.py --work /tmp/tl_balance \
        --json /tmp/tl_balance.json

* **Lengths:** *real*, every module of this Python's standard library (``*.py`` under its
  directory, tests included, one document each) tokenized by a byte-level BPE of ``--vocab`` ids
  trained here on 400 of them (no download); *web*, lognormal lengths (median e^6.3 = 545 tokens,
  sigma 1.1, mean ~1,000: ``bench_packing.py``'s), at least one token each.
* **Samples:** a pool per (lengths, packing, seq_length): *concat* lays the documents end to end
  in a seeded order and cuts a sample every ``S`` tokens (``S + 1`` with the extra token, as
  megatron-core and the stateless index do); *best fit* packs whole documents into ``S + 1``
  tokens with ``tokenloom.index.best_fit.pack_best_fit`` (windows of ``--window`` documents).
  Each sample's cost is ``tokenloom.index.balance``'s: the documents as ``cu_seqlens`` serves them,
  under ``CostModel.for_width(--hidden-size)`` (default 4096: a = 4d, b = 24d^2).
* **Steps:** ``--steps`` global batches of ``G = dp x micro x M`` samples drawn uniformly from
  the pool (a shuffled index draws them so; the real pool at 32k is smaller than a batch at dp
  64, so draws repeat samples, which leaves the cost distribution as it is), for dp 8 and 64,
  ``M`` = 1 and 4 micro-batches per rank, ``micro = --micro``. Per step: the imbalance (largest
  rank cost / mean rank cost) in Megatron's order and placed by ``assign_slots``, the issue's
  lower bound (the costliest sample over the mean rank cost, or 1) and a tighter one
  (:func:`tight_bound`: with two samples per rank the optimum itself). The table gives the mean
  and the worst step of each, and the milliseconds ``assign_slots`` took per step.
* **Cost of placing:** on a store of the real documents, ``StoreBlendSource`` (exact mode) with
  ``inter_document_masking``: the seconds one rank spends per step costing all ``G`` samples
  from the index (``tokenloom.serve.balance.batch_costs``: locate, ``spans``, the cost) and
  placing them (``assign_slots``), against the seconds it spends reading its own ``G / dp``
  samples' fields (``RankLoader``, the step's ``M`` micro-batches). The placement is the
  balanced sampler's (``MicroBatchSampler.placement``: it places ``PLACE_AHEAD_SAMPLES`` samples'
  steps at once), timed over whole windows after a warm-up window, so the mean per step is the
  amortized cost; beside it, the median of ``--rounds`` steps each placed alone
  (``step_placement``, what the sampler did before). ``--parts serving`` runs this part only.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

SEQ_LENGTHS = (8192, 32768)
DPS = (8, 64)
MICRO_BATCHES = (1, 4)


def stdlib_files() -> list[str]:
    root = os.path.dirname(os.__file__)
    return sorted(f for f in glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
                  if "site-packages" not in f)


def real_store(work: str, vocab: int) -> str:
    """The standard library's modules through a BPE trained here, one document each (cached)."""
    prefix = os.path.join(work, f"stdlib-{vocab}")
    if os.path.exists(prefix + ".idx"):
        return prefix
    import tokenizers

    from tokenloom.io import IndexedDatasetWriter

    files = stdlib_files()
    model = tokenizers.Tokenizer(tokenizers.models.BPE())
    model.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = tokenizers.decoders.ByteLevel()
    model.train(files[:400], tokenizers.trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    eod = model.token_to_id("<|endoftext|>")
    texts = []
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            texts.append(f.read())
    record = {"tokenizer": {"kind": "bytes", "name": f"bpe-{vocab}", "path": None, "sha256": None,
                            "vocab_size": vocab, "eod_id": eod, "append_eod": True}}
    with IndexedDatasetWriter(prefix, dtype=np.uint16 if vocab < 65536 else np.int32) as writer:
        for start in range(0, len(texts), 256):
            for encoding in model.encode_batch(texts[start:start + 256]):
                writer.add_document(np.asarray([*encoding.ids, eod], dtype=np.int64))
        writer.finalize(record)
    return prefix


def web_lengths(count: int, seed: int = 0) -> np.ndarray:
    """(count,) int64 lognormal document lengths, at least 1 (``bench_packing.py``'s)."""
    rng = np.random.default_rng(seed)
    return np.maximum(1, np.round(rng.lognormal(mean=6.3, sigma=1.1, size=count))).astype(np.int64)


def concat_pool(lengths: np.ndarray, seq: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Pieces ``(lengths (P,), bounds (B + 1,))`` of the samples of ``seq + 1`` tokens cut every
    ``seq`` tokens from the documents in a seeded order (the megatron-core / stateless rule)."""
    order = np.random.default_rng(seed).permutation(lengths.shape[0])
    docs = lengths[order]
    docs = docs[docs > 0]
    ends = np.cumsum(docs)  # (D,)
    starts = ends - docs
    count = (int(ends[-1]) - 1) // seq  # samples with seq + 1 tokens
    lo = np.arange(count, dtype=np.int64) * seq  # (B,) first token of each sample
    hi = lo + seq + 1
    first = np.searchsorted(ends, lo, side="right")  # the document holding token lo
    last = np.searchsorted(ends, hi - 1, side="right")  # ... and token hi - 1
    counts = last - first + 1
    bounds = np.concatenate([[0], np.cumsum(counts)])
    sample = np.repeat(np.arange(count), counts)
    doc = first[sample] + (np.arange(int(bounds[-1])) - bounds[sample])
    piece = np.minimum(ends[doc], hi[sample]) - np.maximum(starts[doc], lo[sample])
    return piece.astype(np.int64), bounds


def best_fit_pool(lengths: np.ndarray, seq: int, window: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    from tokenloom.index.best_fit import pack_best_fit

    order = np.random.default_rng(seed).permutation(lengths.shape[0])
    packing = pack_best_fit(lengths[order], seq + 1, window=window)
    return np.asarray(packing.lengths, dtype=np.int64), np.asarray(packing.offsets, dtype=np.int64)


def tight_bound(costs: np.ndarray, dp: int) -> float:
    """A lower bound on the largest rank cost of any placement of ``costs`` on ``dp`` ranks of
    ``n = G / dp`` samples each: the mean; and the rank holding the costliest sample holds
    ``n - 1`` others, at best the cheapest; with ``n = 2`` the optimum itself (pairing the
    costliest with the cheapest, the next with the next: an exchange argument shows no pairing
    has a smaller largest pair)."""
    per = costs.shape[0] // dp
    ordered = np.sort(costs)[::-1]  # descending
    mean = costs.sum() / dp
    if per == 2:
        return float((ordered[:dp] + ordered[::-1][:dp]).max())
    return float(max(mean, ordered[0] + ordered[::-1][:per - 1].sum()))


def imbalance_rows(pools: dict, args) -> list[dict]:
    from tokenloom.index.balance import CostModel, assign_slots, served_document_pairs, slot_costs

    model = CostModel.for_width(args.hidden_size)
    rows = []
    for (kind, packing, seq), (pieces, bounds) in pools.items():
        pairs = served_document_pairs(pieces, bounds, seq, True)
        costs = model.sample_costs(pairs, np.full(pairs.shape[0], seq))  # (pool,)
        attention_share = float((pairs * model.attention).sum() / costs.sum())
        for dp in DPS:
            for num_micro in MICRO_BATCHES:
                size = dp * args.micro * num_micro
                rng = np.random.default_rng(args.seed)
                assign_slots(costs[:size] if costs.shape[0] >= size else np.resize(costs, size), dp=dp,
                             micro_batch_size=args.micro)  # warm-up: the kernel loads from numba's cache once
                plain, balanced, bound, tight = [], [], [], []
                seconds = 0.0
                for _ in range(args.steps):
                    step = costs[rng.integers(0, costs.shape[0], size=size)]  # (G,)
                    start = time.perf_counter()
                    order = assign_slots(step, dp=dp, micro_batch_size=args.micro)
                    seconds += time.perf_counter() - start
                    mean = step.sum() / dp
                    plain.append(slot_costs(step, np.arange(size), dp=dp, micro_batch_size=args.micro)
                                 .sum(axis=0).max() / mean)
                    balanced.append(slot_costs(step, order, dp=dp, micro_batch_size=args.micro).sum(axis=0).max()
                                    / mean)
                    bound.append(max(1.0, step.max() / mean))
                    tight.append(tight_bound(step, dp) / mean)
                row = {"lengths": kind, "packing": packing, "seq_length": seq, "dp": dp, "micro": args.micro,
                       "micro_batches": num_micro, "global_batch": size, "pool": int(costs.shape[0]),
                       "attention_share": attention_share, "assign_ms": 1e3 * seconds / args.steps}
                for name, values in (("unbalanced", plain), ("balanced", balanced), ("bound", bound),
                                     ("tight", tight)):
                    row[name] = {"mean": float(np.mean(values)), "max": float(np.max(values))}
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def serving_rows(prefix: str, args) -> list[dict]:
    """Seconds per step placing the batch against reading this rank's share, on the real store."""
    from tokenloom.serve import BatchGeometry, RankLoader, SampleOptions
    from tokenloom.serve.balance import step_placement
    from tokenloom.serve.sampler import PLACE_AHEAD_SAMPLES, MicroBatchSampler
    from tokenloom.source import StoreBlendSource

    options = SampleOptions(inter_document_masking=True)
    rows = []
    for seq in SEQ_LENGTHS:
        for dp in DPS:
            for num_micro in MICRO_BATCHES:
                size = dp * args.micro * num_micro
                ahead = max(1, -(-PLACE_AHEAD_SAMPLES // size))  # steps the sampler places at once
                steps = max(args.rounds, 3 * ahead)  # whole windows: the mean is the amortized cost
                steps -= steps % ahead
                source = StoreBlendSource.from_prefixes([prefix], num_samples=size * (steps + 2 * ahead + 1),
                                                        seq_length=seq, seed=args.seed)
                geometry = BatchGeometry(global_batch_size=size, micro_batch_size=args.micro, dp=dp,
                                         balance="attention")
                loader = RankLoader(source, dataclass_replace(geometry, balance=None), rank=dp - 1,
                                    options=options)
                stream = loader.stream
                sampler = MicroBatchSampler(stream, geometry, dp_rank=dp - 1)
                for _ in range(ahead):  # warm-up: one window placed and read
                    sampler.placement()
                    sampler.next_step()
                    for _ in range(num_micro):
                        loader.next_batch()
                per_step, placed, read = [], 0.0, 0.0
                for step in range(steps):
                    start = time.perf_counter()
                    sampler.placement()
                    placed += time.perf_counter() - start
                    first = sampler.step_start
                    sampler.next_step()
                    start = time.perf_counter()
                    for _ in range(num_micro):
                        loader.next_batch()
                    read += time.perf_counter() - start
                    if step < args.rounds:  # as before: every step placed on its own
                        start = time.perf_counter()
                        step_placement(stream, geometry, first, size)
                        per_step.append(time.perf_counter() - start)
                row = {"seq_length": seq, "dp": dp, "micro": args.micro, "micro_batches": num_micro,
                       "global_batch": size, "steps_ahead": ahead, "steps": steps,
                       "per_step_ms": 1e3 * statistics.median(per_step), "place_ms": 1e3 * placed / steps,
                       "read_ms": 1e3 * read / steps}
                row["ratio"] = row["place_ms"] / row["read_ms"]
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def dataclass_replace(value, **changes):
    import dataclasses

    return dataclasses.replace(value, **changes)


def table(rows: list[dict], serving: list[dict]) -> str:
    out = ["| lengths | packing | seq | dp | micro-batches/rank | attention share | Megatron's order mean (worst) "
           "| balanced mean (worst) | bound: costliest / mean, mean (worst) | tight bound mean (worst) "
           "| balanced / tight (mean) | place ms |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    def cell(r, name):
        return f"{r[name]['mean']:.3f} ({r[name]['max']:.3f})"

    for r in rows:
        out.append(f"| {r['lengths']} | {r['packing']} | {r['seq_length']} | {r['dp']} | {r['micro_batches']} | "
                   f"{r['attention_share']:.2f} | {cell(r, 'unbalanced')} | {cell(r, 'balanced')} | "
                   f"{cell(r, 'bound')} | {cell(r, 'tight')} | "
                   f"{r['balanced']['mean'] / r['tight']['mean']:.3f} | {r['assign_ms']:.3f} |")
    out += ["", "| seq | dp | micro-batches/rank | G | steps placed at once | one step alone ms (median) "
            "| placed ahead ms per step (mean) | read ms (this rank's G/dp, mean) | ratio |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in serving:
        out.append(f"| {r['seq_length']} | {r['dp']} | {r['micro_batches']} | {r['global_batch']} | "
                   f"{r['steps_ahead']} | {r['per_step_ms']:.3f} | {r['place_ms']:.4f} | {r['read_ms']:.3f} | "
                   f"{100 * r['ratio']:.1f}% |")
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", required=True, help="directory for the tokenizer and the store (cached)")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--hidden-size", type=int, default=4096)
    parser.add_argument("--micro", type=int, default=2, help="samples per micro-batch (default 2)")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=9, help="steps timed per serving row (default 9)")
    parser.add_argument("--window", type=int, default=4096, help="best-fit window in documents")
    parser.add_argument("--web-documents", type=int, default=2_000_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--parts", default="imbalance,serving", help="comma-separated: imbalance, serving")
    args = parser.parse_args()
    os.makedirs(args.work, exist_ok=True)

    from tokenloom.io import IndexedDataset

    prefix = real_store(args.work, args.vocab)
    real = np.asarray(IndexedDataset(prefix).sequence_lengths, dtype=np.int64)
    web = web_lengths(args.web_documents, args.seed)
    print(f"real: {real.shape[0]} documents, {int(real.sum())} tokens (median {int(np.median(real))}); "
          f"web: {web.shape[0]} documents, {int(web.sum())} tokens", flush=True)
    pools = {}
    for kind, lengths in (("real", real), ("web", web)) if "imbalance" in args.parts.split(",") else ():
        for seq in SEQ_LENGTHS:
            pools[(kind, "concat", seq)] = concat_pool(lengths, seq, args.seed)
            pools[(kind, "best fit", seq)] = best_fit_pool(lengths, seq, args.window, args.seed)
    parts = set(args.parts.split(","))
    rows = imbalance_rows(pools, args) if "imbalance" in parts else []
    serving = serving_rows(prefix, args) if "serving" in parts else []
    print(table(rows, serving))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"machine": platform.platform(), "cpus": os.cpu_count(), "python": sys.version.split()[0],
                       "args": vars(args), "imbalance": rows, "serving": serving}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
