"""Mixture schedules (issue 40): a 5-phase schedule against the single blend of the same run, and
against Megatron-LM's relaunch at each phase, in one run.

    python benchmarks/make_corpus.py --out /tmp/tl_corpus_build --stores 1000 --tokens 1e11 --documents 1e8
    flock /tmp/tokenloom-bench.lock python benchmarks/bench_schedules.py --corpus /tmp/tl_corpus_build \\
        --work /tmp/tl_schedules --json /tmp/tl_schedules.json

Every part uses one schedule shape (:data:`PHASES`) over the corpus's stores in their order: a
main phase on every store, a linear ramp that boosts the first fifth, then the first half, a ramp
to the first fifth, an anneal on the first tenth; each phase weighs its stores by their tokens
and ends at a share of the run's optimizer steps (``until: {steps: N}``). The peer is the single
blend of the same stores by their tokens over the same samples (``train_samples`` = the
schedule's steps x ``global_batch_size``).

Three parts (``--parts``):

1. **build**: ``tokenloom.build`` from an empty cache on 1, 4 and 16 gloo ranks, exact and
   stateless, the schedule and the single blend taking turns; each rank records the CPU seconds
   of its own build call (``benchmarks/scale/ranks.py``'s child, whose docstring gives the
   method: on a machine with fewer cores than ranks the CPU seconds show how the work divides, the
   wall time does not). The goal is the largest rank's CPU of the schedule at most 1.25x the single
   blend's at 16 ranks. Every rank count must write the one-rank build's bytes.
2. **serve**: samples/s of ``RankLoader`` (micro-batches of 8 at seq 2048, one process) over the
   train split of each build, real tokens from stores this script writes (random tokens,
   lognormal documents ending in EOD, as ``bench_serve.py``), the whole run from its first
   step to its last, so every phase and both ramps are read. The two builds take turns micro-batch
   by micro-batch (a noisy machine slows both alike), the whole run once per round; each round's
   ratio is kept and the median reported. ``locate alone`` times only the position ->
   (dataset, sample) lookup, where the two differ.
3. **reread**: samples served again at each phase change. tokenloom builds the schedule once
   (exact and stateless) and serves every step. Megatron-LM's ``--phase-transition-iterations``
   (PR #2938; read at commit d98e8a64ddf34856e74b24714e3bedb2f5a39553 of NVIDIA/Megatron-LM,
   ``megatron/training/training.py``) saves and exits at each listed iteration; the relaunch
   with the next ``--data-path`` calls ``get_train_valid_test_num_samples``, which sizes the train
   split to *this phase's* samples (``next_transition_sample - last_transition_sample``), and
   ``build_train_valid_test_data_loaders`` starts the data loader at the samples consumed *in
   this phase* (``(iteration - last_transition) * global_batch_size``: 0 at a phase's start).
   So each phase is a fresh ``BlendedMegatronDatasetBuilder(GPTDataset, [S_k, ...])`` over the
   phase's blend, with the run's ``--seed``, read from position 0: this part does exactly that with
   megatron-core itself. Its per-store ``GPTDataset`` depends on the samples asked only through
   the number of epochs, so a store used in two phases serves its first samples again.

   Identity: a sample is the tokens it trains on as inputs (its ``seq_length`` tokens, not the
   label-only last one), each token a (store, document, offset) place in the store; a token is
   *re-read* when an earlier phase of the run already served it as an input. A sample is re-read
   when all its input tokens are. Within one epoch of a store the input tokens of different
   samples are disjoint in both systems, so the run is sized (``--reread-epochs``) for no store
   to need more than one epoch of its train documents (checked): every re-read is a repeat
   before the store's epoch ends. Before counting, :func:`check_identity` checks the token places
   against both systems' reads on small stores of real tokens. The schedule is the same 5 phases
   without their ramps (Megatron-LM's phases are constant blends). Valid and test ask
   megatron-core for one sample each; they do not touch the train split's arrays.

Every figure goes with the machine: the script prints its core count and load average.
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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # bench_build, bench_serve and scale/ as modules

#: The schedule every part measures: (name, share of the stores it reads (the first ones), boost
#: of the first fifth of the stores, end as a share of the run's steps, ramp).
PHASES = (
    ("main", 1.0, 1.0, 0.50, None),
    ("shift", 1.0, 4.0, 0.65, "linear"),
    ("mid", 0.5, 1.0, 0.80, None),
    ("quality", 0.2, 1.0, 0.90, "linear"),
    ("anneal", 0.1, 1.0, 1.00, None),
)


def schedule_phases(prefixes, tokens, steps: int, *, ramps: bool = True) -> list[dict]:
    """:data:`PHASES` over ``prefixes`` (weighed by ``tokens``) for a run of ``steps`` steps, as a
    build config's ``phases``."""
    phases = []
    for _name, share, boost, end, ramp in PHASES:
        count = max(1, round(share * len(prefixes)))
        fifth = max(1, round(0.2 * len(prefixes)))
        weights = [float(tokens[d]) * (boost if d < fifth else 1.0) for d in range(count)]
        phase = {"blend": {"prefixes": list(prefixes[:count]), "weights": weights},
                 "until": {"steps": max(1, round(end * steps))}}
        if ramp and ramps:
            phase["ramp"] = ramp
        phases.append(phase)
    return phases


def run_configs(prefixes, tokens, *, steps: int, global_batch_size: int, base: dict, ramps: bool = True):
    """(single blend, schedule) config mappings of one run: the same stores, split, seed, valid and
    test sizes, and ``steps * global_batch_size`` train samples."""
    single = {**base, "blend": {"prefixes": list(prefixes), "weights": [float(t) for t in tokens]},
              "train_samples": steps * global_batch_size}
    schedule = {**base, "phases": schedule_phases(prefixes, tokens, steps, ramps=ramps),
                "global_batch_size": global_batch_size}
    return single, schedule


def _corpus(path: str) -> tuple[list[str], list[int], dict]:
    with open(os.path.join(path, "corpus.json")) as f:
        manifest = json.load(f)
    return ([s["prefix"] for s in manifest["stores"]], [s["num_tokens"] for s in manifest["stores"]], manifest)


def _machine() -> str:
    return f"{os.cpu_count()} cores, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"


# ------------------------------------------------------------------------------------ 1. build


def bench_build(args) -> dict:
    """Each (mode, ranks, kind) built ``--repeats`` times from an empty cache, kinds and rank counts
    taking turns; the try whose largest rank spent the least CPU is kept."""
    from scale.ranks import PHASES as BUILD_PHASES
    from scale.ranks import array_digests, collective_costs, launch, summarize

    prefixes, tokens, manifest = _corpus(args.corpus)
    split = "969,30,1"
    fractions = [float(x) for x in split.split(",")]
    samples = [int(args.epochs * manifest["num_tokens"] * f / sum(fractions) / args.seq_length) for f in fractions]
    steps = samples[0] // args.global_batch_size
    base = {"split": split, "seq_length": args.seq_length, "valid_samples": samples[1], "test_samples": samples[2],
            "seed": 1234}
    single, schedule = run_configs(prefixes, tokens, steps=steps, global_batch_size=args.global_batch_size, base=base)
    configs = {"single": single, "schedule": schedule}
    costs = {n: collective_costs(n) for n in args.ranks}
    out: dict = {"steps": steps, "global_batch_size": args.global_batch_size, "train_samples": steps *
                 args.global_batch_size, "valid_samples": samples[1], "test_samples": samples[2],
                 "machine": _machine(), "rows": [], "collective_costs": costs}
    for mode in args.modes:
        tries: dict[tuple[str, int], list] = {(k, n): [] for n in args.ranks for k in configs}
        for attempt in range(args.repeats):
            for n in args.ranks:
                for kind, config in configs.items():
                    cache = os.path.join(args.work, f"build-{mode}-{kind}-{n}")
                    subprocess.run(["rm", "-rf", cache], check=True)
                    outs = launch(n, config, cache, mode)
                    tries[(kind, n)].append((outs, array_digests(outs[0]["manifest"])))
                    phases = ", ".join(f"{name[:-2]} {max(o['timings'].get(name, 0.0) for o in outs):.2f}"
                                       for name in BUILD_PHASES)
                    print(f"{mode:9} {kind:8} {n:>2} ranks, try {attempt + 1}: largest rank "
                          f"{max(o['cpu_s'] for o in outs):.2f} CPU-s, total {sum(o['cpu_s'] for o in outs):.2f}; "
                          f"wall {max(o['wall_s'] for o in outs):.2f} s (longest rank per phase: {phases}); "
                          f"{_machine()}", file=sys.stderr, flush=True)
                    subprocess.run(["rm", "-rf", cache], check=True)
        for n in args.ranks:
            row = {"mode": mode, "ranks": n}
            for kind in configs:
                done = tries[(kind, n)]
                outs, _ = min(done, key=lambda t: max(o["cpu_s"] for o in t[0]))
                one = min(tries[(kind, 1)], key=lambda t: max(o["cpu_s"] for o in t[0])) if 1 in args.ranks else None
                summary = summarize(outs, one[0][0]["cpu_s"] if one else float("nan"), costs[n])
                summary["tries_largest_cpu_s"] = [max(o["cpu_s"] for o in t[0]) for t in done]
                summary["same_arrays_as_one_rank"] = None if one is None else all(a == one[1] for _, a in done)
                summary["build_phase_s"] = [o["timings"].get("build_s", 0.0) for o in outs]
                row[kind] = summary
                row[f"{kind}_raw"] = outs
            row["largest_ratio"] = row["schedule"]["largest_cpu_s"] / row["single"]["largest_cpu_s"]
            row["total_ratio"] = row["schedule"]["total_cpu_s"] / row["single"]["total_cpu_s"]
            out["rows"].append(row)
    return out


def format_build(result: dict) -> str:
    lines = [f"train: {result['steps']:,} steps of {result['global_batch_size']} = {result['train_samples']:,} samples "
             f"(valid {result['valid_samples']:,}, test {result['test_samples']:,}); {result['machine']}\n",
             "| mode | ranks | single blend: largest rank CPU s | schedule: largest rank CPU s | **schedule / single "
             "(largest rank)** | total CPU s, single / schedule | total ratio | peak RSS GiB, single / schedule "
             "| arrays = 1 rank's | tries (largest rank), single / schedule |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in result["rows"]:
        s, p = r["single"], r["schedule"]
        same = {True: "yes", False: "**no**", None: "-"}
        lines.append(
            f"| {r['mode']} | {r['ranks']} | {s['largest_cpu_s']:.2f} | {p['largest_cpu_s']:.2f} | "
            f"**{r['largest_ratio']:.2f}x** | {s['total_cpu_s']:.2f} / {p['total_cpu_s']:.2f} | "
            f"{r['total_ratio']:.2f}x | {s['peak_rss'] / 2**30:.2f} / {p['peak_rss'] / 2**30:.2f} | "
            f"{same[s['same_arrays_as_one_rank']]} / {same[p['same_arrays_as_one_rank']]} | "
            f"{' '.join(f'{t:.2f}' for t in s['tries_largest_cpu_s'])} / "
            f"{' '.join(f'{t:.2f}' for t in p['tries_largest_cpu_s'])} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ 2. serve


def bench_serve(args) -> dict:
    """Both builds of one run over stores of real tokens, served whole by ``RankLoader``, taking turns."""
    import tokenloom
    from bench_serve import write_store
    from tokenloom.io import IndexedDataset
    from tokenloom.serve import BatchGeometry, RankLoader, SampleOptions

    directory = tempfile.mkdtemp(prefix="tl-schedules-serve-", dir=args.work)
    try:
        started = time.perf_counter()
        prefixes = [write_store(os.path.join(directory, f"store{k}"), int(args.serve_tokens_per_store / 800), 800.0,
                                seed=k) for k in range(args.serve_stores)]
        tokens = [int(IndexedDataset(p).sequence_lengths.sum()) for p in prefixes]
        print(f"serve: wrote {len(prefixes)} stores, {sum(tokens):,} tokens in {time.perf_counter() - started:.0f} s",
              file=sys.stderr, flush=True)
        gbs, micro, seq = args.serve_global_batch_size, args.micro_batch, args.seq_length
        base = {"split": "100,0,0", "seq_length": seq, "valid_samples": 0, "test_samples": 0, "seed": 1234,
                "rng_workers": 0}
        single, schedule = run_configs(prefixes, tokens, steps=args.serve_steps, global_batch_size=gbs, base=base)
        geometry = BatchGeometry(global_batch_size=gbs, micro_batch_size=micro, dp=1)
        cases = {"plain fields": SampleOptions(),
                 "eod resets + loss mask": SampleOptions(reset_position_ids=True, eod_mask_loss=True)}
        out: dict = {"stores": len(prefixes), "tokens": sum(tokens), "steps": args.serve_steps,
                     "global_batch_size": gbs, "micro_batch": micro, "rows": []}
        for mode in args.modes:
            splits = {}
            for kind, config in (("single", single), ("schedule", schedule)):
                cache = os.path.join(directory, f"{mode}-{kind}")
                splits[kind] = tokenloom.build({**config, "mode": mode, "cache_dir": cache}).split("train")
            steps = args.serve_steps
            served = steps * gbs
            # stores a micro-batch reads from (the gather copies once per store per micro-batch)
            spread = {}
            for kind, split in splits.items():
                dataset_ids = np.sort(split.locate(np.arange(served, dtype=np.int64))[0].reshape(-1, micro), axis=1)
                spread[kind] = float((1 + (np.diff(dataset_ids, axis=1) != 0).sum(axis=1)).mean())
            for split in splits.values():  # first use (numba's cache, the stores' pages) outside the timing
                for _ in RankLoader(split, geometry, max_steps=steps):
                    pass
            timings: dict[str, dict[str, list[float]]] = {}
            for case, options in (*cases.items(), ("locate alone", None)):
                times = timings[case] = {"single": [], "schedule": []}
                for _ in range(args.rounds):
                    # the two take turns micro-batch by micro-batch, in an order that alternates,
                    # so that the other jobs on the machine slow both alike
                    steps_of = {kind: _micro_batches(split, geometry, options, steps) for kind, split in splits.items()}
                    spent = dict.fromkeys(splits, 0.0)
                    for k in range(served // micro):
                        for kind in (("single", "schedule") if k % 2 == 0 else ("schedule", "single")):
                            start = time.perf_counter()
                            next(steps_of[kind])
                            spent[kind] += time.perf_counter() - start
                    for kind, seconds in spent.items():
                        times[kind].append(seconds)
                single_s, schedule_s = (np.asarray(times[k]) for k in ("single", "schedule"))
                ratios = single_s / schedule_s  # each round's schedule rate against the single blend's
                row = {"mode": mode, "case": case, "samples": served,
                       "single_samples_per_s": served / float(np.median(single_s)),
                       "schedule_samples_per_s": served / float(np.median(schedule_s)),
                       "ratio": float(np.median(ratios)), "ratio_range": [float(ratios.min()), float(ratios.max())],
                       "stores_per_micro_batch": spread, "rounds": times}
                out["rows"].append(row)
                print(f"serve {mode} {case}: single {row['single_samples_per_s']:,.0f}/s, schedule "
                      f"{row['schedule_samples_per_s']:,.0f}/s, ratio {row['ratio']:.3f} "
                      f"({row['ratio_range'][0]:.3f}..{row['ratio_range'][1]:.3f}); {_machine()}",
                      file=sys.stderr, flush=True)
        out["machine"] = _machine()
        return out
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _micro_batches(split, geometry, options, steps: int):
    """An iterator over the run's micro-batches: ``RankLoader``'s with ``options``, or with None
    only each micro-batch's lookup of its (dataset, sample) pairs."""
    from tokenloom.serve import RankLoader

    if options is not None:
        return iter(RankLoader(split, geometry, options=options, max_steps=steps))
    micro = geometry.micro_batch_size
    return (split.locate(np.arange(begin, begin + micro, dtype=np.int64))
            for begin in range(0, steps * geometry.global_batch_size, micro))


def format_serve(result: dict) -> str:
    lines = [f"{result['stores']} stores, {result['tokens']:,} tokens; {result['steps']} steps of "
             f"{result['global_batch_size']} (micro-batch {result['micro_batch']}); {result['machine']}\n",
             "| mode | fields | single blend samples/s | 5-phase schedule samples/s | **schedule / single** "
             "(median of rounds) | range over rounds | stores a micro-batch reads, single / schedule |",
             "|---|---|---:|---:|---:|---|---:|"]
    for r in result["rows"]:
        spread = r["stores_per_micro_batch"]
        lines.append(f"| {r['mode']} | {r['case']} | {r['single_samples_per_s']:,.0f} | "
                     f"{r['schedule_samples_per_s']:,.0f} | **{r['ratio']:.3f}x** | "
                     f"{r['ratio_range'][0]:.3f}-{r['ratio_range'][1]:.3f} | "
                     f"{spread['single']:.2f} / {spread['schedule']:.2f} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ 3. reread


def input_intervals(bounds, document_ids, offsets, lengths, seq_length: int, document_starts):
    """The input tokens of a batch of samples given by their document pieces (a
    :class:`~tokenloom.index.stateless.SampleSpans`' arrays: ``lengths`` including the label-only
    last token), as half-open intervals of token places in the store: ``(sample_of_piece, lo, hi)``
    with ``lo = document_starts[document] + offset``. The last ``sum - seq_length`` tokens of each
    sample (the extra label token) are cut off its last pieces."""
    bounds = np.asarray(bounds, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64).copy()
    count = bounds.shape[0] - 1
    sample_of_piece = np.repeat(np.arange(count, dtype=np.int64), np.diff(bounds))  # (P,)
    totals = np.bincount(sample_of_piece, weights=lengths, minlength=count).astype(np.int64)  # (B,)
    # where each piece ends within its sample; what lies past the sample's first seq_length tokens goes
    ends_within = np.cumsum(lengths) - np.repeat(np.concatenate(([0], np.cumsum(totals)[:-1])), np.diff(bounds))
    lengths -= np.clip(ends_within - seq_length, 0, lengths)
    lo = np.asarray(document_starts)[np.asarray(document_ids, dtype=np.int64)] + np.asarray(offsets, dtype=np.int64)
    keep = lengths > 0
    return sample_of_piece[keep], lo[keep], (lo + lengths)[keep]


def _merge(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted disjoint intervals covering the union of ``[lo, hi)``."""
    if lo.size == 0:
        return lo, hi
    order = np.argsort(lo, kind="stable")
    lo, hi = lo[order], hi[order]
    reach = np.maximum.accumulate(hi)
    starts = np.ones(lo.shape[0], dtype=bool)
    starts[1:] = lo[1:] > reach[:-1]
    first = np.flatnonzero(starts)
    return lo[first], np.maximum.reduceat(hi, first)


def _covered(merged_lo: np.ndarray, merged_hi: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Tokens of the merged intervals below each place ``x``."""
    if merged_lo.size == 0:
        return np.zeros_like(x)
    before = np.concatenate(([0], np.cumsum(merged_hi - merged_lo)))
    i = np.searchsorted(merged_hi, x, side="right")  # intervals ending at or before x
    inside = np.clip(x - merged_lo[np.minimum(i, merged_lo.shape[0] - 1)], 0, None)
    return before[i] + np.where(i < merged_lo.shape[0], inside, 0)


class RereadCounter:
    """Per store, the input tokens served so far; each phase's samples counted against them."""

    def __init__(self, seq_length: int) -> None:
        self.seq_length = seq_length
        self.seen: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self.pending: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}

    def count(self, prefix: str, spans, document_starts) -> tuple[int, int, int, int]:
        """(samples, samples re-read whole, samples re-read in part, tokens re-read) of one store's
        samples of the current phase, given by their pieces; their tokens join the seen ones at
        :meth:`end_phase`."""
        piece_sample, lo, hi = input_intervals(spans.bounds, spans.document_ids, spans.offsets, spans.lengths,
                                               self.seq_length, document_starts)
        count = spans.bounds.shape[0] - 1
        inputs = np.bincount(piece_sample, weights=hi - lo, minlength=count)
        if not np.all(inputs == self.seq_length):  # the identity below counts whole samples by their tokens
            raise SystemExit(f"{prefix}: a sample's pieces hold {inputs.min():.0f}..{inputs.max():.0f} input tokens, "
                             f"expected {self.seq_length}")
        seen_lo, seen_hi = self.seen.get(prefix, (np.zeros(0, np.int64), np.zeros(0, np.int64)))
        again = _covered(seen_lo, seen_hi, hi) - _covered(seen_lo, seen_hi, lo)  # (P,)
        per_sample = np.bincount(piece_sample, weights=again, minlength=count).astype(np.int64)
        self.pending.setdefault(prefix, []).append((lo, hi))
        return count, int((per_sample == self.seq_length).sum()), int((per_sample > 0).sum()), int(per_sample.sum())

    def end_phase(self) -> None:
        for prefix, parts in self.pending.items():
            seen = self.seen.get(prefix, (np.zeros(0, np.int64), np.zeros(0, np.int64)))
            self.seen[prefix] = _merge(np.concatenate([seen[0], *(p[0] for p in parts)]),
                                       np.concatenate([seen[1], *(p[1] for p in parts)]))
        self.pending = {}


def _document_starts(prefix: str, cache: dict) -> np.ndarray:
    if prefix not in cache:
        from tokenloom.io import IndexedDataset

        lengths = IndexedDataset(prefix).sequence_lengths
        starts = np.zeros(lengths.shape[0] + 1, dtype=np.int64)
        np.cumsum(lengths, out=starts[1:])
        cache[prefix] = starts
    return cache[prefix]


class _Spans:
    def __init__(self, bounds, document_ids, offsets, lengths):
        self.bounds, self.document_ids, self.offsets, self.lengths = bounds, document_ids, offsets, lengths


def megatron_spans(gpt_dataset, sample_ids: np.ndarray) -> _Spans:
    """The document pieces megatron-core's ``GPTDataset[i]`` reads for each of ``sample_ids``, as
    its ``_query_document_sample_shuffle_indices`` walks them: ``shuffle_index`` -> two rows of
    ``sample_index`` -> the documents of ``document_index`` between them, the first from its
    offset, the last to its offset plus the extra token."""
    extra = int(gpt_dataset.config.add_extra_token_to_sequence)
    rows = gpt_dataset.shuffle_index[sample_ids].astype(np.int64)
    begin = gpt_dataset.sample_index[rows].astype(np.int64)  # (B, 2): document_index position, offset
    end = gpt_dataset.sample_index[rows + 1].astype(np.int64)  # (B, 2)
    parts = end[:, 0] - begin[:, 0] + 1
    bounds = np.concatenate(([0], np.cumsum(parts)))
    sample = np.repeat(np.arange(sample_ids.shape[0]), parts)
    position = begin[sample, 0] + np.arange(sample.shape[0]) - bounds[sample]
    documents = gpt_dataset.document_index[position].astype(np.int64)
    offsets = np.where(position == begin[sample, 0], begin[sample, 1], 0)
    stops = np.where(position == end[sample, 0], end[sample, 1] + extra,
                     gpt_dataset.dataset.sequence_lengths[documents].astype(np.int64))
    return _Spans(bounds, documents, offsets, stops - offsets)


def _by_dataset(datasets: np.ndarray, samples: np.ndarray):
    """(dataset, its samples in served order) for each dataset present."""
    order = np.argsort(datasets, kind="stable")
    datasets, samples = datasets[order], samples[order]
    cuts = np.flatnonzero(np.diff(datasets)) + 1
    for part_d, part_s in zip(np.split(datasets, cuts), np.split(samples, cuts)):
        if part_d.size:
            yield int(part_d[0]), part_s


def tokenloom_rereads(config: dict, boundaries, seq_length: int, starts_cache: dict) -> list[dict]:
    """Build the schedule and count each phase's re-reads, reading every position of the run."""
    import tokenloom

    split = tokenloom.build(config).split("train")
    counter = RereadCounter(seq_length)
    rows = []
    for k in range(len(boundaries) - 1):
        positions = np.arange(boundaries[k], boundaries[k + 1], dtype=np.int64)
        datasets, samples = split.locate(positions)
        row = dict.fromkeys(("samples", "whole", "part", "tokens"), 0)
        for d, ids in _by_dataset(datasets, samples):
            reader = split.readers[d]
            got = counter.count(reader.prefix, reader.spans(ids), _document_starts(reader.prefix, starts_cache))
            for key, value in zip(row, got):
                row[key] += value
        counter.end_phase()
        rows.append(row)
    rows.append({"distinct_tokens": int(sum(int((h - lo).sum()) for lo, h in counter.seen.values()))})
    return rows


def megatron_rereads(phases, boundaries, *, split: str, seq_length: int, seed: int, cache: str,
                     starts_cache: dict) -> list[dict]:
    """Megatron-LM's relaunch at every phase: a new blend over the phase's stores sized to the
    phase's samples, read from position 0, with megatron-core's own builder."""
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("megatron").setLevel(logging.ERROR)
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    counter = RereadCounter(seq_length)
    rows = []
    for k, phase in enumerate(phases):
        size = boundaries[k + 1] - boundaries[k]
        started = time.perf_counter()
        mcfg = GPTDatasetConfig(random_seed=seed, sequence_length=seq_length,
                                blend=(list(phase["blend"]["prefixes"]), list(phase["blend"]["weights"])),
                                split=split, path_to_cache=cache, tokenizer=NullTokenizer(32000),
                                reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False)
        train = BlendedMegatronDatasetBuilder(GPTDataset, [size, 1, 1], lambda: True, mcfg).build()[0]
        built = time.perf_counter() - started
        datasets = np.asarray(train.dataset_index[:size], dtype=np.int64)  # the phase reads positions 0..size-1
        samples = np.asarray(train.dataset_sample_index[:size], dtype=np.int64)
        row = dict.fromkeys(("samples", "whole", "part", "tokens"), 0)
        for d, ids in _by_dataset(datasets, samples):
            gpt = train.datasets[d]
            prefix = gpt.dataset.path_prefix
            got = counter.count(prefix, megatron_spans(gpt, ids), _document_starts(prefix, starts_cache))
            for key, value in zip(row, got):
                row[key] += value
        counter.end_phase()
        row["build_s"] = built
        rows.append(row)
        print(f"megatron-core relaunch {k + 1}: {size:,} samples over {len(phase['blend']['prefixes'])} stores "
              f"built in {built:.1f} s; re-read {row['whole']:,} whole samples", file=sys.stderr, flush=True)
    rows.append({"distinct_tokens": int(sum(int((h - lo).sum()) for lo, h in counter.seen.values()))})
    return rows


def check_identity(directory: str, seq_length: int = 256) -> int:
    """The token places :func:`input_intervals` gives, checked against the tokens each system
    reads, on three small stores of real tokens: every position of a small tokenloom schedule
    (both modes, ``reader.read``) and megatron-core's ``GPTDataset[i]["tokens"]``. Returns the
    samples checked; SystemExit on a difference."""
    import logging
    import warnings

    import tokenloom
    from bench_serve import write_store
    from tokenloom.io import IndexedDataset

    warnings.filterwarnings("ignore")
    logging.getLogger("megatron").setLevel(logging.ERROR)
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    prefixes = [write_store(os.path.join(directory, f"check{k}"), 3000, 300.0, seed=k) for k in range(3)]
    flat = {p: np.fromfile(p + ".bin", dtype=np.uint16).astype(np.int64) for p in prefixes}
    starts: dict = {}
    checked = 0

    def check(prefix, spans, rows) -> None:
        nonlocal checked
        sample, lo, hi = input_intervals(spans.bounds, spans.document_ids, spans.offsets, spans.lengths, seq_length,
                                         _document_starts(prefix, starts))
        for i, row in enumerate(rows):
            tokens = np.concatenate([flat[prefix][a:b] for a, b in zip(lo[sample == i], hi[sample == i])])
            if not np.array_equal(tokens, np.asarray(row)[:seq_length]):
                raise SystemExit(f"{prefix}: the input tokens of sample {i} are not where input_intervals puts them")
            checked += 1

    tokens = [int(IndexedDataset(p).sequence_lengths.sum()) for p in prefixes]
    base = {"split": "969,30,1", "seq_length": seq_length, "valid_samples": 16, "test_samples": 16, "seed": 3}
    _, schedule = run_configs(prefixes, tokens, steps=20, global_batch_size=16, base=base)
    for mode in ("exact", "stateless"):
        split = tokenloom.build({**schedule, "mode": mode, "cache_dir": os.path.join(directory, f"check-{mode}")})
        split = split.split("train")
        for d, ids in _by_dataset(*split.locate(np.arange(320, dtype=np.int64))):
            reader = split.readers[d]
            check(reader.prefix, reader.spans(ids), reader.read(ids))
    mcfg = GPTDatasetConfig(random_seed=3, sequence_length=seq_length, blend=(prefixes, [1.0, 2.0, 3.0]),
                            split="969,30,1", path_to_cache=os.path.join(directory, "check-megatron"),
                            tokenizer=NullTokenizer(32000), reset_position_ids=False, reset_attention_mask=False,
                            eod_mask_loss=False)
    train = BlendedMegatronDatasetBuilder(GPTDataset, [320, 1, 1], lambda: True, mcfg).build()[0]
    for gpt in train.datasets:
        ids = np.arange(100)
        check(gpt.dataset.path_prefix, megatron_spans(gpt, ids), [gpt[int(i)]["tokens"].numpy() for i in ids])
    return checked


def bench_reread(args) -> dict:
    """tokenloom's schedule (exact, stateless) and megatron-core's relaunches over one corpus."""
    from tokenloom.builder.config import build_config_from_dict

    prefixes, tokens, manifest = _corpus(args.reread_corpus or args.corpus)
    split = "969,30,1"
    samples = int(args.reread_epochs * manifest["num_tokens"] * 0.969 / args.seq_length)
    steps = samples // args.global_batch_size
    base = {"split": split, "seq_length": args.seq_length, "valid_samples": args.global_batch_size,
            "test_samples": args.global_batch_size, "seed": 1234}
    _, schedule = run_configs(prefixes, tokens, steps=steps, global_batch_size=args.global_batch_size, base=base,
                              ramps=False)
    work = tempfile.mkdtemp(prefix="tl-schedules-reread-", dir=args.work)
    try:
        checked = check_identity(work)
        print(f"identity: {checked} samples' input tokens found where their pieces say", file=sys.stderr, flush=True)
        config = build_config_from_dict({**schedule, "cache_dir": os.path.join(work, "plan")})
        plan = config.schedule_plan()
        boundaries = [int(b) for b in plan.boundaries]
        # no store may need more than one epoch of its train documents: then every re-read is a
        # repeat before the store's epoch ends (in tokenloom's exact mode a store's index holds
        # megatron's buffer over the phases, a little more than the plan's count)
        union = list(config.schedule_stores.prefixes)
        starts_cache: dict = {}
        from tokenloom.io import IndexedDataset

        worst = 0.0
        for d, prefix in enumerate(union):
            lengths = IndexedDataset(prefix).sequence_lengths
            train_tokens = int(lengths[: int(lengths.shape[0] * 969 / 1000)].sum())
            worst = max(worst, float(plan.totals[d]) * 1.01 * args.seq_length / train_tokens)
        if worst > 1.0:
            raise SystemExit(f"--reread-epochs {args.reread_epochs}: a store needs {worst:.2f} epochs of its train "
                             "documents; lower it so that no store needs more than one")
        out: dict = {"identity_checked_samples": checked, "stores": len(prefixes), "tokens": manifest["num_tokens"],
                     "steps": steps,
                     "global_batch_size": args.global_batch_size, "boundaries": boundaries,
                     "phase_stores": [len(p["blend"]["prefixes"]) for p in schedule["phases"]],
                     "most_epochs_of_a_store": worst, "seq_length": args.seq_length, "systems": {}}
        for mode in args.modes:
            started = time.perf_counter()
            out["systems"][f"tokenloom {mode}"] = tokenloom_rereads(
                {**schedule, "mode": mode, "cache_dir": os.path.join(work, f"tl-{mode}")}, boundaries, args.seq_length,
                starts_cache)
            print(f"tokenloom {mode}: built and counted in {time.perf_counter() - started:.1f} s; {_machine()}",
                  file=sys.stderr, flush=True)
        out["systems"]["megatron-core relaunch"] = megatron_rereads(
            schedule["phases"], boundaries, split=split, seq_length=args.seq_length, seed=1234,
            cache=os.path.join(work, "megatron"), starts_cache=starts_cache)
        out["machine"] = _machine()
        return out
    finally:
        shutil.rmtree(work, ignore_errors=True)


def format_reread(result: dict) -> str:
    systems = result["systems"]
    names = list(systems)
    lines = [f"{result['stores']} stores, {result['tokens']:.3g} tokens; {result['steps']:,} steps of "
             f"{result['global_batch_size']} at seq {result['seq_length']}; phases read "
             f"{', '.join(str(n) for n in result['phase_stores'])} stores; the most any store needs: "
             f"{result['most_epochs_of_a_store']:.2f} epoch; identity checked on "
             f"{result['identity_checked_samples']:,} samples of both systems; {result['machine']}\n",
             "| phase | samples | " + " | ".join(f"{n}: samples re-read (share)" for n in names) + " | "
             + " | ".join(f"{n}: tokens re-read" for n in names) + " |",
             "|---:|---:|" + "---:|" * (2 * len(names))]
    count = len(result["boundaries"]) - 1
    for k in range(count):
        size = result["boundaries"][k + 1] - result["boundaries"][k]
        whole = [systems[n][k]["whole"] for n in names]
        tokens = [systems[n][k]["tokens"] for n in names]
        lines.append(f"| {k + 1} | {size:,} | " + " | ".join(f"{w:,} ({100 * w / size:.1f}%)" for w in whole) + " | "
                     + " | ".join(f"{t:,}" for t in tokens) + " |")
    total = result["boundaries"][-1] - result["boundaries"][0]
    whole = [sum(systems[n][k]["whole"] for k in range(count)) for n in names]
    tokens = [sum(systems[n][k]["tokens"] for k in range(count)) for n in names]
    lines.append(f"| **run** | {total:,} | " + " | ".join(f"**{w:,}** ({100 * w / total:.1f}%)" for w in whole)
                 + " | " + " | ".join(f"{t:,}" for t in tokens) + " |")
    part = [sum(systems[n][k]["part"] for k in range(count)) for n in names]
    distinct = [systems[n][-1]["distinct_tokens"] for n in names]
    lines.append("\nsamples re-read in part (some input token served before): "
                 + ", ".join(f"{n} {p:,}" for n, p in zip(names, part))
                 + ".\ndistinct input tokens served over the run, of "
                 + f"{total * result['seq_length']:,}: " + ", ".join(f"{n} {d:,}" for n, d in zip(names, distinct)))
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", help="directory written by make_corpus.py (build, and reread by default)")
    parser.add_argument("--work", default="/tmp/tl_schedules")
    parser.add_argument("--parts", nargs="+", default=["build", "serve", "reread"],
                        choices=["build", "serve", "reread"])
    parser.add_argument("--modes", nargs="+", default=["exact", "stateless"])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--repeats", type=int, default=2, help="tries of each build; the best is kept")
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--global-batch-size", type=int, default=1024)
    parser.add_argument("--epochs", type=float, default=1.5,
                        help="build: each split's samples as passes over its tokens")
    parser.add_argument("--serve-stores", type=int, default=10)
    parser.add_argument("--serve-tokens-per-store", type=float, default=2e7)
    parser.add_argument("--serve-steps", type=int, default=500)
    parser.add_argument("--serve-global-batch-size", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=9, help="serve: rounds of each case, the median kept")
    parser.add_argument("--reread-corpus", help="reread on another corpus than --corpus")
    parser.add_argument("--reread-epochs", type=float, default=0.35,
                        help="reread: the run's train samples as passes over the corpus's tokens")
    parser.add_argument("--json", help="also write every measurement here")
    args = parser.parse_args()
    os.makedirs(args.work, exist_ok=True)
    print(f"machine: {_machine()}\n")
    report: dict = {}

    def save() -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1, default=str)

    for part in args.parts:
        if part == "build":
            report["build"] = bench_build(args)
            save()
            print("## build\n\n" + format_build(report["build"]) + "\n", flush=True)
        elif part == "serve":
            report["serve"] = bench_serve(args)
            save()
            print("## serve\n\n" + format_serve(report["serve"]) + "\n", flush=True)
        else:
            report["reread"] = bench_reread(args)
            save()
            print("## reread\n\n" + format_reread(report["reread"]) + "\n", flush=True)


if __name__ == "__main__":
    main()
