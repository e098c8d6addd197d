"""Benchmark: `tokenloom tokenize` vs the tokenizers library, gigatoken and Megatron-LM's tools.

Builds a real ~32k-vocabulary byte-level BPE tokenizer by training one with the `tokenizers`
library on the Python standard library's sources (cached in --workdir, or --tokenizer), writes
--target-mb (200 by default) of distinct real text as JSONL: this Python installation's source
and documentation files, each once, cut into documents of at most 8 KB. Then measures on that
same text, in one run:

* peers on ~1 MiB batches of the texts already in memory (ids extracted, as any user needs
  them): `tokenizers`' `encode_batch_fast` single-threaded, and gigatoken's `encode_batch` (ids
  as one numpy array) on the calling thread and with its own thread pool;
* Megatron-LM's `tools/preprocess_data.py` (with --workers N) and `tools/preprocess_data_fast.py`
  (gigatoken's Rust file reader and encoder) from a checkout (--megatron-dir; see
  megatron_preprocess.py for the commit and how it runs here), from the JSONL file to a store;
* tokenloom: `tokenize_to_store` from the JSONL file to a finished token store (reading, JSON
  parsing, the engine guard, routing documents gigatoken reads differently, encoding, EOD,
  writing, worker start-up all included), in the calling thread, with 1, 2, ... worker processes
  and with worker threads.

Then what identity with `tokenizers` costs (a second table): the one-time scan of every code
point for this tokenizer (cached per tokenizer and library versions; the timed rows above run
with it cached), the per-batch check for divergent code points on every batch of the corpus as it
is and with 1% of its documents given a Unicode 17 letter, and tokenloom's run on that 1% corpus
(those documents are encoded by `tokenizers`).

Prints a markdown table with wall and CPU seconds, tokens per CPU-second and the ratios to
`tokenizers` and to gigatoken's own encode. Not collected by pytest. Run it under the shared
lock:

    flock /tmp/tokenloom-bench.lock python benchmarks/bench_tokenize.py
"""

from __future__ import annotations

import argparse
import filecmp
import hashlib
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
            documents.extend(_cut(source, max_doc_bytes))
    return documents


def _corpus_documents(target_bytes: int, max_doc_bytes: int) -> tuple[list[str], bool]:
    """About ``target_bytes`` of real, distinct text: the source and documentation files of
    this Python installation (standard library first, then site-packages; .py, .pyi, .md,
    .rst, .txt, .c, .h, .cpp, .js, .html), each file once by content, in sorted order, cut
    at blank lines into documents of at most ``max_doc_bytes`` characters. Returns the
    documents and whether the text had to repeat to reach the target (a cache in an encoder
    flatters repeated text, so the bench says so)."""
    extensions = (".py", ".pyi", ".md", ".rst", ".txt", ".c", ".h", ".cpp", ".js", ".html")
    paths = sysconfig.get_paths()
    seen: set[bytes] = set()
    documents: list[str] = []
    size = 0
    for root in dict.fromkeys([paths["stdlib"], paths["purelib"], paths["platlib"]]):
        for directory, dirs, files in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not (root == paths["stdlib"]
                                                                             and d == "site-packages"))
            for name in sorted(files):
                if not name.endswith(extensions):
                    continue
                try:
                    with open(os.path.join(directory, name), "rb") as f:
                        raw = f.read()
                    digest = hashlib.sha1(raw).digest()
                    text = raw.decode("utf-8")
                except (OSError, UnicodeDecodeError):
                    continue
                if digest in seen or not text.strip():
                    continue
                seen.add(digest)
                for document in _cut(text, max_doc_bytes):
                    documents.append(document)
                    size += len(document.encode())
                if size >= target_bytes:
                    return documents, False
    repeated = list(documents)
    while size < target_bytes and repeated:
        for document in repeated:
            documents.append(document)
            size += len(document.encode())
            if size >= target_bytes:
                break
    return documents, True


def _cut(source: str, max_doc_bytes: int) -> list[str]:
    """``source`` cut at blank lines into pieces of at most about ``max_doc_bytes``."""
    documents, piece, size = [], [], 0
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


def _megatron(tool: str, megatron_dir: str, tokenizer_path: str, jsonl_path: str, prefix: str,
              workers: int, pythonpath: list[str]) -> tuple[float, float, int]:
    """(wall s, CPU s, tokens without EODs) of one Megatron-LM preprocessing tool run."""
    from megatron_preprocess import run_megatron_preprocess
    from tokenloom.io import IndexedDataset

    done = run_megatron_preprocess(tool, megatron_dir, tokenizer_path, jsonl_path, prefix, workers,
                                   pythonpath=pythonpath)
    store = IndexedDataset(done["bin"][: -len(".bin")])
    return done["wall_s"], done["cpu_s"], store.num_tokens - len(store)


def _identity(tokenizer_path: str, texts: list[str], batches, workdir: str, chunk_bytes: int,
              gigatoken_cpu: float, tokenloom_cpu: dict[str, float]) -> None:
    """Print the identity table (see the module docstring)."""
    import random

    from tokenloom.tokenization import TokenizeConfig
    from tokenloom.tokenization import divergence as dv

    raw = open(tokenizer_path, "rb").read()
    saved = os.environ.get("TOKENLOOM_CACHE_DIR")
    os.environ["TOKENLOOM_CACHE_DIR"] = tempfile.mkdtemp(dir=workdir)  # empty: the scan runs
    cpu, wall = _cpu_seconds(), time.perf_counter()
    divergence = dv.divergence_for(raw)
    scan = (time.perf_counter() - wall, _cpu_seconds() - cpu)
    os.environ["TOKENLOOM_CACHE_DIR"] = saved or ""
    rng = random.Random(0)
    marked = [t if rng.random() >= 0.01 else t[: len(t) // 2] + "\U00016ebb" + t[len(t) // 2:] for t in texts]
    holders_rows = []
    for label, corpus in (("as it is", texts), ("1% of documents holding U+16EBB", marked)):
        corpus_batches = batches if corpus is texts else _batches(corpus, chunk_bytes)
        best, best_wall, found = float("inf"), float("inf"), 0
        for _ in range(3):
            cpu, wall = _cpu_seconds(), time.perf_counter()
            found = sum(len(divergence.holders(batch)) for batch in corpus_batches)
            best, best_wall = min(best, _cpu_seconds() - cpu), min(best_wall, time.perf_counter() - wall)
        holders_rows.append((label, best_wall, best, found))
    jsonl_path = os.path.join(workdir, "corpus-marked.jsonl")
    with open(jsonl_path, "w", encoding="utf-8") as f:
        for text in marked:
            f.write(json.dumps({"text": text}) + "\n")
    routed_rows = []
    for workers, threads in ((0, False), (2, True)):
        config = TokenizeConfig(tokenizer=tokenizer_path, workers=workers, threads=threads, chunk_bytes=chunk_bytes)
        best_cpu, best_wall = float("inf"), float("inf")
        for _ in range(2):
            wall, cpu, _ = _tokenloom(jsonl_path, os.path.join(workdir, f"marked_w{workers}"), config)
            best_cpu, best_wall = min(best_cpu, cpu), min(best_wall, wall)
        routed_rows.append((workers, best_wall, best_cpu))
    print()
    print(f"Identity with tokenizers: {divergence.describe()} read differently by gigatoken; "
          f"{sum(a is not b for a, b in zip(texts, marked)):,} "
          "documents of the corpus given U+16EBB for the second corpus.")
    print()
    print("| what | wall s | CPU s | vs gigatoken encode_batch CPU (1 core) | note |")
    print("|---|---:|---:|---:|---|")
    print(f"| scan of every code point, first use of this tokenizer (cached after) | {scan[0]:.2f} | {scan[1]:.2f} "
          "| - | once per tokenizer and library versions |")
    for label, wall, cpu, found in holders_rows:
        print(f"| check of every batch for divergent code points, corpus {label} | {wall:.3f} | {cpu:.3f} | "
              f"{100 * cpu / gigatoken_cpu:.1f}% | {found:,} documents found |")
    for workers, wall, cpu in routed_rows:
        how = "in the calling thread" if workers == 0 else f"{workers} worker threads"
        plain = tokenloom_cpu.get(how)
        note = f"{cpu / plain:.2f}x the CPU of the same row on the corpus as it is" if plain else ""
        print(f"| tokenloom tokenize {how}, 1% of documents routed to tokenizers | {wall:.2f} | {cpu:.2f} | "
              f"{100 * cpu / gigatoken_cpu:.0f}% | {note} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "tokenloom-bench-tokenize"),
                        help="where the trained tokenizer, the JSONL and the stores go")
    parser.add_argument("--target-mb", type=float, default=200.0, help="JSONL text size in MB")
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--tokenizer", default=None,
                        help="a tokenizer.json to use instead of training one (e.g. the one another run trained)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2],
                        help="tokenloom worker counts to measure (processes, and threads where more than 1)")
    parser.add_argument("--megatron-dir", default="/tmp/mlm",
                        help="a Megatron-LM checkout for its preprocess_data*.py rows (skipped if absent)")
    parser.add_argument("--megatron-pythonpath", nargs="*", default=[],
                        help="directories its tools need on PYTHONPATH (e.g. a pip --target with transformers)")
    parser.add_argument("--megatron-workers", type=int, nargs="+", default=None,
                        help="preprocess_data.py --workers values (default: the --workers values)")
    parser.add_argument("--no-tokenizers-peer", action="store_true",
                        help="leave out the tokenizers row (minutes of one core at this size; the ratios to it "
                        "are then left out too)")
    parser.add_argument("--hf-row", action="store_true",
                        help="also tokenloom with engine='hf' (as slow as the tokenizers library)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="best of N for every row that takes under --slow-s (shared machines are noisy)")
    parser.add_argument("--slow-s", type=float, default=30.0, help="rows slower than this run once")
    parser.add_argument("--chunk-bytes", type=int, default=1 << 20)
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()

    from tokenizers import Tokenizer
    from tokenizers import __version__ as tokenizers_version

    from tokenloom.tokenization import TokenizeConfig

    os.makedirs(args.workdir, exist_ok=True)
    tokenizer_path = args.tokenizer or os.path.join(args.workdir, f"bpe{args.vocab_size}", "tokenizer.json")
    if not os.path.isfile(tokenizer_path):
        os.makedirs(os.path.dirname(tokenizer_path), exist_ok=True)
        started = time.perf_counter()
        _train_tokenizer(tokenizer_path, _stdlib_documents(max_doc_bytes=8192), args.vocab_size)
        print(f"trained BPE tokenizer in {time.perf_counter() - started:.1f} s -> {tokenizer_path}", file=sys.stderr)
    tokenizer = Tokenizer.from_file(tokenizer_path)

    texts, repeated = _corpus_documents(int(args.target_mb * 1e6), max_doc_bytes=8192)
    jsonl_path = os.path.join(args.workdir, "corpus.jsonl")
    with open(jsonl_path, "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")

    batches = _batches(texts, args.chunk_bytes)
    cores = os.cpu_count() or 1
    # the engine scan is cached here before any timed row (its one-time cost is in the second table)
    os.environ["TOKENLOOM_CACHE_DIR"] = os.path.join(args.workdir, "cache")
    from tokenloom.tokenization import load_tokenizer

    load_tokenizer(tokenizer_path).route_divergent()
    runs = {}  # label -> (cores, measure())
    if not args.no_tokenizers_peer:
        runs["peer: tokenizers encode_batch_fast"] = (
            1, lambda: _peer_encode(tokenizer, batches, "encode_batch_fast", False))
    runs["peer: gigatoken encode_batch"] = (1, lambda: _gigatoken_encode(tokenizer_path, batches, False))
    runs["peer: gigatoken encode_batch, own thread pool"] = (
        cores, lambda: _gigatoken_encode(tokenizer_path, batches, True))
    if os.path.isdir(os.path.join(args.megatron_dir, "tools")):
        for workers in args.megatron_workers or args.workers:
            runs[f"peer: Megatron-LM preprocess_data.py, --workers {workers}"] = (
                workers, lambda w=workers: _megatron("preprocess_data", args.megatron_dir, tokenizer_path, jsonl_path,
                                                     os.path.join(args.workdir, f"mlm_w{w}"), w,
                                                     args.megatron_pythonpath))
        runs["peer: Megatron-LM preprocess_data_fast.py"] = (
            cores, lambda: _megatron("preprocess_data_fast", args.megatron_dir, tokenizer_path, jsonl_path,
                                     os.path.join(args.workdir, "mlm_fast"), cores, args.megatron_pythonpath))
    else:
        print(f"no Megatron-LM checkout at {args.megatron_dir}: its rows are left out", file=sys.stderr)
    variants = [(0, False)] + [(w, False) for w in args.workers] + [(w, True) for w in args.workers if w > 1]
    for workers, threads in variants:
        config = TokenizeConfig(tokenizer=tokenizer_path, workers=workers, threads=threads,
                                chunk_bytes=args.chunk_bytes)
        how = ("in the calling thread" if workers == 0 else
               f"{workers} worker {'threads' if threads else 'process' + ('es' if workers > 1 else '')}")
        prefix = os.path.join(args.workdir, f"store_w{workers}{'t' if threads else ''}")
        runs[f"tokenloom tokenize (gigatoken), {how}"] = (
            max(workers, 1), lambda c=config, p=prefix: _tokenloom(jsonl_path, p, c))
    if args.hf_row:
        config = TokenizeConfig(tokenizer=tokenizer_path, workers=0, chunk_bytes=args.chunk_bytes, engine="hf")
        runs["tokenloom tokenize (tokenizers), in the calling thread"] = (
            1, lambda: _tokenloom(jsonl_path, os.path.join(args.workdir, "store_hf"), config))
    # Interleave the repeats so a burst of load from other processes hits every row alike;
    # keep each row's best wall time and best CPU time. Slow rows run once.
    best: dict[str, list[float]] = {}
    failed: dict[str, str] = {}  # a peer that does not run here: its row says why
    for repeat in range(args.repeats):
        for label, (_, measure) in runs.items():
            if label in failed or (repeat and best[label][0] > args.slow_s):
                continue
            try:
                wall, cpu, num_tokens = measure()
            except RuntimeError as exc:
                if not label.startswith("peer: Megatron-LM"):
                    raise
                failed[label] = str(exc).strip().splitlines()[-1][:200]
                print(f"{label}: did not run: {exc}", file=sys.stderr, flush=True)
                continue
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
            old = best.get(label, [float("inf"), float("inf"), num_tokens])
            best[label] = [min(old[0], wall), min(old[1], cpu), num_tokens]
            print(f"{label}: {wall:.2f} s, {cpu:.2f} CPU-s, {num_tokens:,} tokens", file=sys.stderr, flush=True)
    _, peer_cpu, peer_tokens = best.get("peer: tokenizers encode_batch_fast", (0.0, 0.0, 0))
    _, giga_cpu, giga_tokens = best["peer: gigatoken encode_batch"]

    text_mb = sum(len(t.encode()) for t in texts) / 1e6
    print(f"machine: {_cpu_model()}, {cores} cores, "
          f"python {platform.python_version()}, tokenizers {tokenizers_version}, "
          f"load average {os.getloadavg()[0]:.1f} at the end")
    print(f"text: {len(texts):,} documents, {text_mb:.1f} MB of this Python installation's sources and docs "
          f"as JSONL{' (repeated to reach the target)' if repeated else ' (no document repeats)'}; "
          f"tokenizer: byte-level BPE, vocab {tokenizer.get_vocab_size():,}; best of {args.repeats} "
          f"(rows over {args.slow_s:.0f} s: one run)")
    print()
    print("| run | cores | wall s | CPU s | tokens | tokens/s | tokens per CPU-second "
          "| per CPU-second vs tokenizers | per CPU-second vs gigatoken |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for label, (row_cores, _) in runs.items():
        if label in failed:
            print(f"| {label} | {row_cores} | did not run: {failed[label]} | | | | | | |")
            continue
        wall, cpu, num_tokens = best[label]
        rows.append({"run": label, "cores": row_cores, "wall_s": wall, "cpu_s": cpu, "tokens": num_tokens})
        vs_tokenizers = f"{(num_tokens / cpu) / (peer_tokens / peer_cpu):.2f}x" if peer_tokens else "-"
        print(f"| {label} | {row_cores} | {wall:.2f} | {cpu:.2f} | {num_tokens:,} | {num_tokens / wall:,.0f} | "
              f"{num_tokens / cpu:,.0f} | {vs_tokenizers} | {(num_tokens / cpu) / (giga_tokens / giga_cpu):.2f}x |")
    print()
    print("Token counts leave out the EOD id appended per document (tokenloom, Megatron-LM); tokenloom and "
          "Megatron-LM times include reading and parsing the JSONL, starting their workers and writing the store.")
    stores = sorted(name[: -len(".bin")] for name in os.listdir(args.workdir)
                    if name.endswith(".bin") and (name.startswith("store_") or name.startswith("mlm_")))
    if stores:
        first = os.path.join(args.workdir, stores[0] + ".bin")
        same = [s for s in stores[1:] if filecmp.cmp(first, os.path.join(args.workdir, s + ".bin"), shallow=False)]
        differ = sorted(set(stores[1:]) - set(same))
        print(f"token files (.bin) byte-identical to {stores[0]}: {', '.join(same) or 'none'}"
              + (f"; differing: {', '.join(differ)}" if differ else ""))
    tokenloom_cpu = {label.split("), ", 1)[1]: best[label][1] for label in best if label.startswith("tokenloom")}
    _identity(tokenizer_path, texts, batches, args.workdir, args.chunk_bytes, giga_cpu, tokenloom_cpu)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"rows": rows, "failed": failed, "text_mb": text_mb, "documents": len(texts), "cores": cores},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
