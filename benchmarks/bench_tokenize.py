"""Benchmark: `tokenloom tokenize` vs the HuggingFace tokenizer's and gigatoken's own batch encodes.

Builds a real ~32k-vocabulary byte-level BPE tokenizer by training one with the `tokenizers`
library on the Python standard library's sources (cached in --workdir), writes tens of MB
of those sources as JSONL documents, then measures on that same text, in one run:

* peers: `tokenizers`' `Tokenizer.encode_batch` / `encode_batch_fast` on ~1 MiB batches of
  the texts already in memory (ids extracted, as any user needs them), single-threaded
  (TOKENIZERS_PARALLELISM=false) and with the library's own thread pool; gigatoken's
  `Tokenizer.encode_batch` on the same batches (ids as one numpy array), on the calling thread
  and with its own thread pool;
* tokenloom: `tokenize_to_store` from the JSONL file to a finished token store
  (reading, JSON parsing, encoding, EOD, writing, worker start-up all included) with
  1, 2, ... worker processes, with the engine it picks (gigatoken here) and with
  `engine="hf"` (the tokenizers library).

Prints a markdown table with tokens/s, tokens/s per core and the ratio to the peer.
Not collected by pytest. Run it under the shared lock:

    flock /tmp/tokenloom-bench.lock python benchmarks/bench_tokenize.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import sysconfig
import tempfile
import time


def _stdlib_documents(max_doc_bytes: int) -> list[str]:
    """The standard library's .py sources (site-packages excluded), cut at blank lines
    into documents of at most ``max_doc_bytes`` characters."""
    root = sysconfig.get_paths()["stdlib"]
    documents = []
    for directory, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "__pycache__"))
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            try:
                with open(os.path.join(directory, name), encoding="utf-8") as f:
                    source = f.read()
            except (UnicodeDecodeError, OSError):
                continue
            piece: list[str] = []
            size = 0
            for block in source.split("\n\n"):
                if size + len(block) > max_doc_bytes and piece:
                    documents.append("\n\n".join(piece))
                    piece, size = [], 0
                piece.append(block)
                size += len(block) + 2
            if piece:
                documents.append("\n\n".join(piece))
    return [d for d in documents if d.strip()]


def _train_tokenizer(path: str, documents: list[str], vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer)
    tokenizer.save(path)


def _batches(texts: list[str], batch_bytes: int) -> list[list[str]]:
    batches, batch, size = [], [], 0
    for text in texts:
        batch.append(text)
        size += len(text)
        if size >= batch_bytes:
            batches.append(batch)
            batch, size = [], 0
    if batch:
        batches.append(batch)
    return batches


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_seconds() -> float:
    """CPU time of this process (all threads) plus its reaped child processes."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _peer_encode(tokenizer, batches, method: str, parallel: bool) -> tuple[float, float, int]:
    """(wall s, CPU s, tokens) of encoding every batch and extracting the ids."""
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if parallel else "false"
    encode = getattr(tokenizer, method)
    cpu, wall = _cpu_seconds(), time.perf_counter()
    num_tokens = 0
    for batch in batches:
        ids = [encoding.ids for encoding in encode(batch, add_special_tokens=False)]
        num_tokens += sum(map(len, ids))
    return time.perf_counter() - wall, _cpu_seconds() - cpu, num_tokens


def _gigatoken_encode(path: str, batches, parallel: bool) -> tuple[float, float, int]:
    """(wall s, CPU s, tokens) of gigatoken encoding every batch, its ids as numpy arrays."""
    import gigatoken
    import numpy as np

    tokenizer = gigatoken.Tokenizer(path)
    cpu, wall = _cpu_seconds(), time.perf_counter()
    num_tokens = 0
    for batch in batches:
        layout = tokenizer.encode_batch(batch, parallel=parallel).layout
        ids = np.asarray(layout.content.data)  # (tokens,) uint32, documents back to back
        num_tokens += int(layout.offsets.data[-1] - layout.offsets.data[0]) if ids.size else 0
    return time.perf_counter() - wall, _cpu_seconds() - cpu, num_tokens


def _tokenloom(jsonl_path, prefix, config) -> tuple[float, float, int]:
    """(wall s, CPU s, tokens) of a whole tokenize run; tokens without the appended EODs."""
    from tokenloom.tokenization import tokenize_to_store

    cpu, wall = _cpu_seconds(), time.perf_counter()
    summary = tokenize_to_store([jsonl_path], prefix, config)
    # compare like with like: the peer produces no EOD ids
    return time.perf_counter() - wall, _cpu_seconds() - cpu, summary.num_tokens - summary.num_documents


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "tokenloom-bench-tokenize"),
                        help="where the trained tokenizer, the JSONL and the stores go")
    parser.add_argument("--target-mb", type=float, default=40.0,
                        help="JSONL text size in MB (the sources repeat to reach it)")
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="tokenloom worker counts to measure")
    parser.add_argument("--repeats", type=int, default=3,
                        help="best of N for every measurement (shared machines are noisy)")
    parser.add_argument("--chunk-bytes", type=int, default=1 << 20)
    args = parser.parse_args()

    from tokenizers import Tokenizer
    from tokenizers import __version__ as tokenizers_version

    from tokenloom.tokenization import TokenizeConfig

    os.makedirs(args.workdir, exist_ok=True)
    documents = _stdlib_documents(max_doc_bytes=8192)
    tokenizer_path = os.path.join(args.workdir, f"bpe{args.vocab_size}", "tokenizer.json")
    if not os.path.isfile(tokenizer_path):
        os.makedirs(os.path.dirname(tokenizer_path), exist_ok=True)
        started = time.perf_counter()
        _train_tokenizer(tokenizer_path, documents, args.vocab_size)
        print(f"trained BPE tokenizer in {time.perf_counter() - started:.1f} s -> {tokenizer_path}", file=sys.stderr)
    tokenizer = Tokenizer.from_file(tokenizer_path)

    target_bytes = int(args.target_mb * 1e6)
    texts: list[str] = []
    size = 0
    while size < target_bytes:
        for document in documents:
            texts.append(document)
            size += len(document.encode())
            if size >= target_bytes:
                break
    jsonl_path = os.path.join(args.workdir, "corpus.jsonl")
    with open(jsonl_path, "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")

    batches = _batches(texts, args.chunk_bytes)
    runs = {}  # label -> (cores, measure())
    for label, method, parallel in [
        ("peer: tokenizers encode_batch", "encode_batch", False),
        ("peer: tokenizers encode_batch_fast", "encode_batch_fast", False),
        ("peer: tokenizers encode_batch_fast, own thread pool", "encode_batch_fast", True),
    ]:
        if hasattr(tokenizer, method):
            runs[label] = (os.cpu_count() if parallel else 1,
                           lambda m=method, p=parallel: _peer_encode(tokenizer, batches, m, p))
    runs["peer: gigatoken encode_batch"] = (1, lambda: _gigatoken_encode(tokenizer_path, batches, False))
    runs["peer: gigatoken encode_batch, own thread pool"] = (
        os.cpu_count(), lambda: _gigatoken_encode(tokenizer_path, batches, True))
    for engine in ("auto", "hf"):
        for workers in args.workers if engine == "auto" else args.workers[:1]:
            config = TokenizeConfig(tokenizer=tokenizer_path, workers=workers, chunk_bytes=args.chunk_bytes,
                                    engine=engine)
            prefix = os.path.join(args.workdir, f"store_{engine}_w{workers}")
            name = "gigatoken" if engine == "auto" else "tokenizers"
            runs[f"tokenloom tokenize ({name}), {workers} worker{'s' if workers > 1 else ''}"] = (
                workers, lambda c=config, p=prefix: _tokenloom(jsonl_path, p, c))
    # Interleave the repeats so a burst of load from other processes hits every row alike;
    # keep each row's best wall time and best CPU time.
    best: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        for label, (_, measure) in runs.items():
            wall, cpu, num_tokens = measure()
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
            old = best.get(label, [float("inf"), float("inf"), num_tokens])
            best[label] = [min(old[0], wall), min(old[1], cpu), num_tokens]
    peer_label = min((k for k in best if k.startswith("peer: tokenizers") and "thread pool" not in k),
                     key=lambda k: best[k][0])
    _, peer_cpu, peer_tokens = best[peer_label]
    _, giga_cpu, giga_tokens = best["peer: gigatoken encode_batch"]

    text_mb = sum(len(t.encode()) for t in texts) / 1e6
    print(f"machine: {_cpu_model()}, {os.cpu_count()} cores, "
          f"python {platform.python_version()}, tokenizers {tokenizers_version}, "
          f"load average {os.getloadavg()[0]:.1f} at the end")
    print(f"text: {len(texts):,} documents, {text_mb:.1f} MB of Python stdlib sources as JSONL; "
          f"tokenizer: byte-level BPE, vocab {tokenizer.get_vocab_size():,}, trained on the same sources; "
          f"best of {args.repeats}")
    print()
    print("| run | cores | wall s | CPU s | tokens | tokens/s | tokens per CPU-second "
          "| per CPU-second vs tokenizers | per CPU-second vs gigatoken |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for label, (cores, _) in runs.items():
        wall, cpu, num_tokens = best[label]
        print(f"| {label} | {cores} | {wall:.2f} | {cpu:.2f} | {num_tokens:,} | {num_tokens / wall:,.0f} | "
              f"{num_tokens / cpu:,.0f} | {(num_tokens / cpu) / (peer_tokens / peer_cpu):.2f}x | "
              f"{(num_tokens / cpu) / (giga_tokens / giga_cpu):.2f}x |")
    print()
    print(f"peer = {peer_label[6:]}, single-threaded (the faster single-threaded peer row); tokenloom token "
          "counts leave out the EOD id it appends per document; tokenloom times include reading and "
          "parsing the JSONL, starting the workers and writing the store.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
