"""Packed-sample index builds: megatron-core's GPTDataset against tokenloom, same inputs, same run.

    flock /tmp/tokenloom-bench.lock python benchmarks/bench_index.py --num-documents 1e6 1e7 1e8

Synthetic store: document lengths drawn lognormal with mean ~1000 tokens; one split holding every
document; ``num_samples`` = ``--epochs`` (1.5) epochs' worth of ``--seq-length`` (2048) samples.
Each (size, mode) runs in a fresh child process, so its peak RSS is its own: "peak RSS" is the
process high-water mark during the build (inputs included), "build RSS" is what the build added
over the inputs. Each mode warms up once on a tiny input first (imports, numba's on-disk cache).
The "same arrays" column compares each mode's arrays with megatron-core's by digest; modes that
build different arrays by design (stateless) say "n/a".

Modes live in MODES (name -> build function); a mode whose module is missing is skipped.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np

LENGTH_SEED = 20260101
MEAN_DOCUMENT_TOKENS = 1000.0
LOGNORMAL_SIGMA = 1.0


# ----------------------------------------------------------------------------- inputs


def synthetic_lengths(num_documents: int, seed: int = LENGTH_SEED) -> np.ndarray:
    """Lognormal document lengths with mean ~1000 tokens, in chunks to keep memory flat."""
    rng = np.random.default_rng(seed)
    lengths = np.empty(num_documents, dtype=np.int32)  # (num_documents,) int32
    mu = np.log(MEAN_DOCUMENT_TOKENS) - LOGNORMAL_SIGMA**2 / 2
    chunk = 1 << 22
    for begin in range(0, num_documents, chunk):
        draw = rng.lognormal(mu, LOGNORMAL_SIGMA, min(chunk, num_documents - begin))
        lengths[begin:begin + draw.shape[0]] = np.clip(draw, 1, 2**31 - 1)
    return lengths


# ----------------------------------------------------------------------------- modes


def build_megatron_core(lengths, document_ids, num_samples, seq_length, seed) -> dict:
    """megatron-core's own GPTDataset index build (no cache directory: nothing is written)."""
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.utils import Split
    from megatron.core.tokenizers import MegatronTokenizer

    class Lengths:  # all of the low-level dataset that the index build reads
        sequence_lengths = lengths

    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length,
        tokenizer=MegatronTokenizer.from_pretrained(metadata_path={"library": "null-text"}, vocab_size=32000),
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
    )
    dataset = GPTDataset(Lengths(), None, document_ids, num_samples, Split.train, config)
    return dict(document_index=dataset.document_index, sample_index=dataset.sample_index,
                shuffle_index=dataset.shuffle_index)


def build_exact(lengths, document_ids, num_samples, seq_length, seed) -> dict:
    """tokenloom's Megatron-exact build (numba walk when installed)."""
    from tokenloom.index.megatron_gpt import build_megatron_gpt_indices

    indices = build_megatron_gpt_indices(lengths, document_ids, num_samples=num_samples,
                                         seq_length=seq_length, seed=seed)
    return dict(document_index=indices.document_index, sample_index=indices.sample_index,
                shuffle_index=indices.shuffle_index)


def build_exact_numpy(lengths, document_ids, num_samples, seq_length, seed) -> dict:
    """The same build with the pure-numpy sample walk (no numba)."""
    from tokenloom.index.megatron_gpt import build_megatron_gpt_indices

    indices = build_megatron_gpt_indices(lengths, document_ids, num_samples=num_samples,
                                         seq_length=seq_length, seed=seed, kernel="numpy")
    return dict(document_index=indices.document_index, sample_index=indices.sample_index,
                shuffle_index=indices.shuffle_index)


def build_stateless(lengths, document_ids, num_samples, seq_length, seed) -> dict:
    """tokenloom's stateless index: block prefix sums only (different order by design)."""
    from tokenloom.index.stateless import build_stateless_gpt_index

    index = build_stateless_gpt_index(lengths, document_ids, num_samples=num_samples,
                                      seq_length=seq_length, seed=seed)
    return dict(block_token_starts=index.block_token_starts)


MODES: dict[str, Callable[..., dict]] = {
    "megatron-core": build_megatron_core,
    "exact": build_exact,
    "exact-numpy": build_exact_numpy,
    "stateless": build_stateless,
}
"""name -> build(lengths, document_ids, num_samples, seq_length, seed) -> {name: array}."""

SAME_ARRAYS_AS_MEGATRON = {"megatron-core", "exact", "exact-numpy"}
"""Modes whose arrays must equal megatron-core's bit for bit."""

MODULE_OF_MODE = {"megatron-core": "megatron.core", "stateless": "tokenloom.index.stateless"}


# ----------------------------------------------------------------------------- measurement


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak_rss() -> None:
    """Reset VmHWM so the next reading is the peak of what follows (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def digest(arrays: dict) -> str:
    hasher = hashlib.blake2b(digest_size=16)
    for name in sorted(arrays):
        array = np.ascontiguousarray(arrays[name])
        hasher.update(f"{name}:{array.dtype.str}:{array.shape}".encode())
        hasher.update(memoryview(array).cast("B"))
    return hasher.hexdigest()


def run_child(mode: str, num_documents: int, epochs: float, seq_length: int, seed: int, repeat: int) -> dict:
    """Build once per repeat in this process; report the best time and the peak RSS."""
    build = MODES[mode]
    warm = synthetic_lengths(64, seed=1)
    build(warm, np.arange(64, dtype=np.int32), 40, 8, seed)  # imports, JIT cache, lazy helpers
    lengths = synthetic_lengths(num_documents)
    document_ids = np.arange(num_documents, dtype=np.int32)  # the split megatron-core hands over
    num_tokens = int(lengths.sum(dtype=np.int64))
    num_samples = int(epochs * num_tokens / seq_length)
    seconds, peak_kib, build_kib = [], 0, 0
    arrays: dict = {}
    for _ in range(repeat):
        arrays = {}
        before_kib = _status_kib("VmRSS")
        _reset_peak_rss()
        start = time.perf_counter()
        arrays = build(lengths, document_ids, num_samples, seq_length, seed)
        seconds.append(time.perf_counter() - start)
        high_kib = _status_kib("VmHWM")
        peak_kib, build_kib = max(peak_kib, high_kib), max(build_kib, high_kib - before_kib)
    return dict(mode=mode, num_documents=num_documents, num_tokens=num_tokens, num_samples=num_samples,
                seconds=min(seconds), peak_rss_kib=peak_kib, build_rss_kib=build_kib,
                rows=int(arrays["sample_index"].shape[0]) - 1 if "sample_index" in arrays else None,
                digest=digest(arrays))


def _available(mode: str) -> bool:
    import importlib.util

    module = MODULE_OF_MODE.get(mode)
    return module is None or importlib.util.find_spec(module) is not None


def _fmt_gib(kib: int) -> str:
    return f"{kib / 2**20:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-documents", nargs="+", type=float, default=[1e6, 1e7, 1e8])
    parser.add_argument("--modes", nargs="+", default=["megatron-core", "exact"],
                        help=f"any of {sorted(MODES)} (stateless once tokenloom.index.stateless exists)")
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--epochs", type=float, default=1.5, help="samples requested, in epochs")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--repeat", type=int, default=1, help="builds per child; the best time counts")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:
        size = int(args.num_documents[0])
        print(json.dumps(run_child(args.child, size, args.epochs, args.seq_length, args.seed, args.repeat)))
        return 0

    modes = [mode for mode in args.modes if mode in MODES and _available(mode)]
    skipped = sorted(set(args.modes) - set(modes))
    if skipped:
        print(f"skipping unavailable modes: {skipped}", file=sys.stderr)
    results: dict[tuple[int, str], dict] = {}
    for size in (int(n) for n in args.num_documents):
        for mode in modes:
            command = [sys.executable, __file__, "--child", mode, "--num-documents", str(size),
                       "--seq-length", str(args.seq_length), "--epochs", str(args.epochs),
                       "--seed", str(args.seed), "--repeat", str(args.repeat)]
            done = subprocess.run(command, capture_output=True, text=True, env=os.environ.copy())
            if done.returncode != 0:
                print(f"{mode} at {size} documents failed:\n{done.stderr[-2000:]}", file=sys.stderr)
                continue
            results[size, mode] = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"measured {mode} at {size:.0e} documents: {results[size, mode]['seconds']:.2f} s",
                  file=sys.stderr)

    print(f"seq_length {args.seq_length}, {args.epochs} epochs of samples, seed {args.seed}, "
          f"best of {args.repeat}\n")
    print("| documents | tokens | samples built | mode | build s | x megatron-core | peak RSS GiB "
          "| build RSS GiB | x megatron-core | same arrays |")
    print("|---:|---:|---:|---|---:|---:|---:|---:|---:|---|")
    for size in (int(n) for n in args.num_documents):
        peer = results.get((size, "megatron-core"))
        for mode in modes:
            result = results.get((size, mode))
            if result is None:
                continue
            time_ratio = f"{result['seconds'] / peer['seconds']:.2f}" if peer else "-"
            rss_ratio = f"{result['build_rss_kib'] / peer['build_rss_kib']:.2f}" if peer else "-"
            if mode not in SAME_ARRAYS_AS_MEGATRON or peer is None:
                same = "n/a"
            else:
                same = "yes" if result["digest"] == peer["digest"] else "**NO**"
            print(f"| {size:.0e} | {result['num_tokens']:.3e} | {result['rows']} | {mode} "
                  f"| {result['seconds']:.2f} | {time_ratio} | {_fmt_gib(result['peak_rss_kib'])} "
                  f"| {_fmt_gib(result['build_rss_kib'])} | {rss_ratio} | {same} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
