"""Online data mixing (issue 41) at 1000 sources: weight changes against the fixed blend, in one run.

    flock /tmp/tokenloom-bench.lock python benchmarks/bench_online.py --work /tmp/tl_online \\
        --json /tmp/tl_online.json

One stateless build serves every part: ``--stores`` uint16 stores of real tokens (random tokens,
lognormal documents of mean 800 tokens ending in EOD, as ``bench_serve.py``) under a two-phase
schedule over all of them (the first weighs them by their tokens, the second boosts the first
fifth x4) with ``headroom`` 1.0, seq_length 2048, global batches of 64, sized for the longest part.
The controller is DoReMi's ``ExponentiatedGradient`` (learning rate 0.02, ``min_weight`` 1e-5,
``lag`` 2, a decision every ``--every`` steps, K); the training loop's report is each dataset's
tokens in the step (from the batches' ``dataset_id``) and a loss of 3.0 per token plus seeded
noise (sd 0.1) per dataset and step, so the weights wander as a real signal makes them, within
the build's room.

Four parts, one run:

1. **serve**: samples/s of ``RankLoader`` (micro-batches of 8, one process) with online mixing,
   ``--changes`` decisions spread over ``changes x K`` steps, against the same loader without it
   (the fixed blend: the build's schedule), over the same steps. The mixing loader's time includes
   its ``report()`` after every step (where the decisions and the weight changes happen); the
   per-dataset token count the training loop would make is outside the timing. The two take turns
   step by step (the order alternating), the whole run once per round, ``--rounds`` rounds after
   a warm-up; the ratio is the median of the rounds' ratios.
2. **state**: the serving state's JSON bytes per weight change after part 1 (state with the
   changes less the fixed loader's state, over the changes), against the same segments and
   history written as the schema-2 decimal lists (what the state held before).
3. **scale**: ``--scale-changes`` decisions, every K steps, with the sampler moved step by step
   (its positions located for the report, no tokens read): the time of all the ``report()`` calls,
   as a share of the serving time of those ``scale-changes x K`` steps at part 1's fixed-blend
   samples/s (measured in this run); the cost of the first and the last thousand changes (a
   quadratic cost shows as growth); then the restore of that state: ``json.loads``, a fresh
   ``RankLoader``, ``load_state_dict`` and the first micro-batch, against the same for the fixed
   loader's state at the same step.
4. **controller**: ``ExponentiatedGradient.decide`` at ``--stores`` sources, per call, against one
   fixed-blend serving step.

Every figure goes with the machine: the script prints its core count and load average.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
import warnings

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # bench_serve as a module

SEQ, GBS, MICRO = 2048, 64, 8
LEARNING_RATE, MIN_WEIGHT, LAG = 0.02, 1e-5, 2


def _machine() -> str:
    return f"{os.cpu_count()} cores, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"


def _rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def build_split(args, steps: int):
    """The stores and the stateless two-phase build over them (see the module's docstring)."""
    import tokenloom
    from bench_serve import write_store
    from tokenloom.io import IndexedDataset

    stores = os.path.join(args.work, f"stores-{args.stores}")
    os.makedirs(stores, exist_ok=True)
    started = time.perf_counter()
    prefixes = []
    for k in range(args.stores):
        prefix = os.path.join(stores, f"store{k}")
        if not os.path.exists(prefix + ".meta.json"):
            write_store(prefix, args.documents_per_store, 800.0, seed=k)
        prefixes.append(prefix)
    tokens = [int(IndexedDataset(p).sequence_lengths.sum()) for p in prefixes]
    fifth = max(1, len(prefixes) // 5)
    boosted = [t * (4.0 if d < fifth else 1.0) for d, t in enumerate(tokens)]
    config = {"phases": [{"blend": {"prefixes": prefixes, "weights": [float(t) for t in tokens]},
                          "until": {"steps": steps // 2}},
                         {"blend": {"prefixes": prefixes, "weights": boosted}, "until": {"steps": steps}}],
              "split": "100,0,0", "seq_length": SEQ, "global_batch_size": GBS, "valid_samples": 0,
              "test_samples": 0, "seed": 1234, "mode": "stateless", "headroom": 1.0, "rng_workers": 0,
              "cache_dir": tempfile.mkdtemp(prefix="cache-", dir=args.work)}
    split = tokenloom.build(config).split("train")
    print(f"build: {len(prefixes)} stores, {sum(tokens):,} tokens, {split.num_samples:,} train samples in "
          f"{time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    return split, sum(tokens)


def _mixing(num_datasets: int, every: int):
    from tokenloom.serve import ExponentiatedGradient, OnlineMixing

    return OnlineMixing(ExponentiatedGradient(num_datasets, learning_rate=LEARNING_RATE), every=every, lag=LAG,
                        min_weight=MIN_WEIGHT)


class Signal:
    """The training loop's report: tokens per dataset in a step, a noisy loss of 3.0 per token."""

    def __init__(self, num_datasets: int, seed: int = 0) -> None:
        self.num_datasets = num_datasets
        self.rng = np.random.default_rng(seed)

    def __call__(self, dataset_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        tokens = np.bincount(dataset_ids, minlength=self.num_datasets).astype(np.float64) * SEQ
        return tokens, tokens * (3.0 + 0.1 * self.rng.standard_normal(self.num_datasets))


def _loaders(split, steps: int, every: int):
    from tokenloom.serve import BatchGeometry, RankLoader

    geometry = BatchGeometry(global_batch_size=GBS, micro_batch_size=MICRO, dp=1)
    return {"fixed": RankLoader(split, geometry, max_steps=steps),
            "mixing": RankLoader(split, geometry, max_steps=steps, mixing=_mixing(len(split.datasets), every))}


# ------------------------------------------------------------------------------------ 1. serve


def bench_serve(args, split) -> dict:
    steps = args.changes * args.every + LAG
    micro_batches = GBS // MICRO
    for loader in _loaders(split, 50, args.every).values():  # first use (numba's cache, the pages) untimed
        for _ in loader:
            pass
    times: dict[str, list[float]] = {"fixed": [], "mixing": []}
    reports: list[float] = []
    for round_ in range(args.rounds):
        loaders = _loaders(split, steps, args.every)
        signal = Signal(len(split.datasets))
        spent = dict.fromkeys(loaders, 0.0)
        report_s = 0.0
        for step in range(steps):
            for kind in (("fixed", "mixing") if step % 2 == 0 else ("mixing", "fixed")):
                loader = loaders[kind]
                start = time.perf_counter()
                batches = [loader.next_batch() for _ in range(micro_batches)]
                spent[kind] += time.perf_counter() - start
                if kind == "mixing":
                    tokens, loss_sums = signal(np.concatenate([b["dataset_id"] for b in batches]))
                    start = time.perf_counter()
                    loader.report(tokens, loss_sums)
                    seconds = time.perf_counter() - start
                    spent[kind] += seconds
                    report_s += seconds
        changes = len(loaders["mixing"].mixing.history)
        for kind, seconds in spent.items():
            times[kind].append(seconds)
        reports.append(report_s)
        print(f"serve round {round_}: fixed {steps * GBS / spent['fixed']:,.0f}/s, mixing "
              f"{steps * GBS / spent['mixing']:,.0f}/s ({changes} changes, reports {report_s:.2f} s); {_machine()}",
              file=sys.stderr, flush=True)
    fixed, mixing = np.asarray(times["fixed"]), np.asarray(times["mixing"])
    ratios = fixed / mixing
    return {"steps": steps, "samples": steps * GBS, "every": args.every, "changes": changes, "rounds": times,
            "report_s": reports, "fixed_samples_per_s": steps * GBS / float(np.median(fixed)),
            "mixing_samples_per_s": steps * GBS / float(np.median(mixing)), "ratio": float(np.median(ratios)),
            "ratio_range": [float(ratios.min()), float(ratios.max())], "loaders": loaders}


# ------------------------------------------------------------------------------------ 2. state


def _schema2(state: dict) -> dict:
    """The same state as the schema-2 decimal lists wrote it (segments and history with weights)."""
    from tokenloom.serve.weight_changes import BlendSegment

    segments = [BlendSegment.from_dict(s) for s in state["blend_segments"]]
    by_start = {s.start: s.weights for s in segments}
    out = {**state, "blend_segments": [{"start": s.start, "weights": list(s.weights),
                                        "dataset_offsets": list(s.dataset_offsets)} for s in segments]}
    if "online_mixing" in state:
        out["online_mixing"] = {**state["online_mixing"], "history": [
            [step, list(by_start[at])] for step, at in state["online_mixing"]["history"]]}
    return out


def bench_state(loaders) -> dict:
    fixed, mixing = (json.loads(json.dumps(loaders[k].state_dict())) for k in ("fixed", "mixing"))
    changes = len(loaders["mixing"].mixing.history)
    size = {name: len(json.dumps(state)) for name, state in (("fixed", fixed), ("mixing", mixing))}
    old = len(json.dumps(_schema2(mixing)))
    parts = {key: len(json.dumps(mixing[key])) for key in ("blend_segments",)}
    parts.update({f"online_mixing.{key}": len(json.dumps(value)) for key, value in mixing["online_mixing"].items()})
    return {"changes": changes, "fixed_bytes": size["fixed"], "mixing_bytes": size["mixing"],
            "bytes_per_change": (size["mixing"] - size["fixed"]) / changes,
            "schema2_bytes_per_change": (old - size["fixed"]) / changes, "parts": parts}


# ------------------------------------------------------------------------------------ 3. scale


def bench_scale(args, split, fixed_samples_per_s: float) -> dict:
    from tokenloom.serve import BatchGeometry, RankLoader

    steps = args.scale_changes * args.every + LAG
    loader = _loaders(split, steps, args.every)["mixing"]
    sampler = loader.sampler
    signal = Signal(len(split.datasets), seed=1)
    per_change: list[float] = []
    total = 0.0
    for _ in range(steps):
        dataset_ids, _ = loader.stream.locate(sampler.global_batch_positions())
        sampler.next_step()  # the step served, its tokens not read
        tokens, loss_sums = signal(dataset_ids)
        start = time.perf_counter()
        changed = loader.report(tokens, loss_sums)
        seconds = time.perf_counter() - start
        total += seconds
        if changed:
            per_change.append(seconds)
    changes = len(loader.mixing.history)
    serving_s = steps * GBS / fixed_samples_per_s
    print(f"scale: {changes} changes over {steps} steps, reports {total:.1f} s; {_machine()}", file=sys.stderr,
          flush=True)
    state = loader.state_dict()
    text = json.dumps(state)
    geometry = BatchGeometry(global_batch_size=GBS, micro_batch_size=MICRO, dp=1)
    fixed_state = dict(state, blend_segments=[])
    fixed_state.pop("online_mixing")
    fixed_text = json.dumps(fixed_state)
    restores: dict[str, list[float]] = {"mixing": [], "fixed": []}
    for _ in range(args.restores):
        for kind, saved in (("fixed", fixed_text), ("mixing", text)):
            start = time.perf_counter()
            loaded = json.loads(saved)
            again = RankLoader(split, geometry, mixing=_mixing(len(split.datasets), args.every) if kind == "mixing"
                               else None)
            again.load_state_dict(loaded)
            again.next_batch()
            restores[kind].append(time.perf_counter() - start)
    first = np.asarray(per_change[:1000])
    last = np.asarray(per_change[-1000:])
    return {"steps": steps, "changes": changes, "reports_s": total, "changes_s": float(np.sum(per_change)),
            "serving_s": serving_s, "share": total / serving_s, "first_1000_ms": 1e3 * float(first.mean()),
            "last_1000_ms": 1e3 * float(last.mean()), "state_bytes": len(text),
            "restore_s": float(np.median(restores["mixing"])), "restore_fixed_s": float(np.median(restores["fixed"])),
            "restores": restores, "peak_rss_gib": _rss_gib()}


# ------------------------------------------------------------------------------------ 4. controller


def bench_controller(args, num_datasets: int, fixed_samples_per_s: float) -> dict:
    from tokenloom.serve import ExponentiatedGradient

    controller = ExponentiatedGradient(num_datasets, learning_rate=LEARNING_RATE)
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, 4, (args.controller_calls, num_datasets)).astype(np.float64) * SEQ
    losses = tokens * (3.0 + 0.1 * rng.standard_normal((args.controller_calls, num_datasets)))
    for k in range(10):
        controller.decide(k, tokens[k], losses[k])
    start = time.perf_counter()
    for k in range(args.controller_calls):
        controller.decide(k, tokens[k], losses[k])
    per_call = (time.perf_counter() - start) / args.controller_calls
    step_s = GBS / fixed_samples_per_s
    return {"datasets": num_datasets, "calls": args.controller_calls, "decide_us": 1e6 * per_call,
            "step_ms": 1e3 * step_s, "share_of_step": per_call / step_s}


# ------------------------------------------------------------------------------------ main


def format_table(report: dict) -> str:
    serve, state, scale, ctl = (report[k] for k in ("serve", "state", "scale", "controller"))
    k = serve["every"]
    rows = [
        "| what | online mixing | peer, same run | **ratio** | goal |",
        "|---|---:|---:|---:|---|",
        f"| serving samples/s, {serve['changes']:,} changes over {serve['steps']:,} steps (K={k}), median of "
        f"{len(serve['rounds']['fixed'])} rounds | {serve['mixing_samples_per_s']:,.0f} | fixed blend "
        f"{serve['fixed_samples_per_s']:,.0f} | **{serve['ratio']:.3f}x** ({serve['ratio_range'][0]:.3f}-"
        f"{serve['ratio_range'][1]:.3f}) | >= 0.9x |",
        f"| serving-state bytes per weight change ({state['changes']:,} changes) | {state['bytes_per_change']:,.0f} | "
        f"schema-2 decimal lists {state['schema2_bytes_per_change']:,.0f} | "
        f"**{state['bytes_per_change'] / state['schema2_bytes_per_change']:.3f}x** | O(changes) |",
        f"| {scale['changes']:,} changes (K={k}): all `report()` calls, s | {scale['reports_s']:.1f} | serving "
        f"{scale['steps']:,} steps at the fixed blend's rate {scale['serving_s']:.0f} | "
        f"**{100 * scale['share']:.1f}%** | a few percent |",
        f"| ms per change, first / last 1,000 of {scale['changes']:,} | {scale['first_1000_ms']:.2f} / "
        f"{scale['last_1000_ms']:.2f} | | {scale['last_1000_ms'] / scale['first_1000_ms']:.2f}x | no growth |",
        f"| restore a state of {scale['changes']:,} changes ({scale['state_bytes'] / 2**20:.0f} MiB JSON): "
        f"`json.loads` + `RankLoader` + `load_state_dict` + first micro-batch, s | {scale['restore_s']:.2f} | "
        f"the fixed loader's state {scale['restore_fixed_s']:.2f} | "
        f"{scale['restore_s'] / scale['restore_fixed_s']:.1f}x | |",
        f"| `ExponentiatedGradient.decide` at {ctl['datasets']:,} sources, us per call | {ctl['decide_us']:.0f} | "
        f"one fixed-blend step {1e3 * ctl['step_ms']:.0f} us | **{100 * ctl['share_of_step']:.2f}%** of a step | |",
    ]
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default="/tmp/tl_online")
    parser.add_argument("--stores", type=int, default=1000)
    parser.add_argument("--documents-per-store", type=int, default=100)
    parser.add_argument("--every", type=int, default=10, help="K: steps between decisions")
    parser.add_argument("--changes", type=int, default=1000, help="serve: decisions in the served run")
    parser.add_argument("--rounds", type=int, default=3, help="serve: rounds, the median kept")
    parser.add_argument("--scale-changes", type=int, default=10000)
    parser.add_argument("--restores", type=int, default=3, help="scale: restores of each state, the median kept")
    parser.add_argument("--controller-calls", type=int, default=2000)
    parser.add_argument("--json", help="also write every measurement here")
    args = parser.parse_args()
    os.makedirs(args.work, exist_ok=True)
    warnings.filterwarnings("ignore", message=r".*get 0 of")  # tiny weights in a short segment: no sample
    print(f"machine: {_machine()}\n")
    report: dict = {"args": vars(args)}
    steps = max(args.changes, args.scale_changes) * args.every + 4 * LAG
    split, tokens = build_split(args, steps)
    report["corpus"] = {"stores": args.stores, "tokens": tokens, "train_samples": split.num_samples}
    serve = bench_serve(args, split)
    loaders = serve.pop("loaders")
    report["serve"] = serve
    report["state"] = bench_state(loaders)
    del loaders
    report["scale"] = bench_scale(args, split, serve["fixed_samples_per_s"])
    report["controller"] = bench_controller(args, len(split.datasets), serve["fixed_samples_per_s"])
    report["machine"] = _machine()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    print(f"{args.stores} stores, {tokens:,} tokens; seq {SEQ}, global batch {GBS}, micro-batch {MICRO}; "
          f"{report['machine']}\n")
    print(format_table(report))
    shutil.rmtree(os.path.join(args.work, "cache"), ignore_errors=True)


if __name__ == "__main__":
    main()
