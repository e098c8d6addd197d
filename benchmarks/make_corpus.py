"""Make a benchmark corpus: D Megatron token stores, T tokens in all, lognormal document lengths.

Each store gets a real ``.idx`` (lengths, pointers, document indices, exactly what Megatron's
preprocessing writes) and a *sparse* ``.bin`` of the right size (``truncate``: no disk blocks,
reads return zeros), so index builds see a corpus of any size without its tokens on disk.

    python benchmarks/make_corpus.py --out /tmp/corpus --stores 1000 --tokens 1e11 --documents 1e8

Store sizes vary (lognormal, sigma ``--store-sigma``); every store's document lengths are lognormal
with mean ``T / N`` tokens (sigma ``--sigma``), at least 1, scaled so each store holds its token
count exactly. Writes ``corpus.json`` with every prefix and its token and document counts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from tokenloom.io.format import bin_path, idx_path
from tokenloom.io.writer import write_index_file


def store_sizes(total: int, count: int, sigma: float, rng: np.random.Generator) -> np.ndarray:
    """``count`` positive integers summing to ``total``, lognormally spread."""
    raw = rng.lognormal(0.0, sigma, size=count)
    sizes = np.floor(raw / raw.sum() * total).astype(np.int64)  # (count,)
    sizes = np.maximum(sizes, 1)
    sizes[np.argmax(sizes)] += total - int(sizes.sum())
    return sizes


def document_lengths(num_tokens: int, num_documents: int, sigma: float, rng: np.random.Generator) -> np.ndarray:
    """``num_documents`` lognormal lengths (>= 1) summing to ``num_tokens`` exactly."""
    raw = rng.lognormal(0.0, sigma, size=num_documents)
    lengths = np.maximum(np.floor(raw / raw.sum() * num_tokens), 1).astype(np.int64)  # (n,)
    residual = num_tokens - int(lengths.sum())
    # spread the rounding residual over the longest documents, one token each (or more)
    order = np.argsort(lengths)[::-1]
    per, rest = divmod(abs(residual), num_documents)
    step = np.full(num_documents, per, dtype=np.int64)
    step[order[:rest]] += 1
    lengths += np.sign(residual) * step
    if lengths.min() < 1 or lengths.max() >= 2**31:
        raise SystemExit(f"cannot fit {num_tokens} tokens into {num_documents} documents of int32 lengths >= 1")
    return lengths


def write_sparse_store(prefix: str, lengths: np.ndarray, dtype: np.dtype) -> None:
    """A real .idx and a sparse .bin, the .idx renamed into place last."""
    tmp_idx = idx_path(prefix) + ".tmp"
    write_index_file(tmp_idx, dtype, lengths.astype(np.int32), np.arange(lengths.size + 1, dtype=np.int64))
    with open(bin_path(prefix), "wb") as f:
        f.truncate(int(lengths.sum()) * dtype.itemsize)
    os.replace(tmp_idx, idx_path(prefix))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for the stores")
    parser.add_argument("--stores", type=int, default=1000, help="number of stores D")
    parser.add_argument("--tokens", type=float, default=1e11, help="tokens in all stores T")
    parser.add_argument("--documents", type=float, default=1e8, help="documents in all stores N")
    parser.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of document lengths")
    parser.add_argument("--store-sigma", type=float, default=0.5, help="lognormal sigma of store sizes")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    total_tokens, total_documents = int(args.tokens), int(args.documents)
    rng = np.random.default_rng(args.seed)
    os.makedirs(args.out, exist_ok=True)
    tokens = store_sizes(total_tokens, args.stores, args.store_sigma, rng)  # (D,)
    documents = np.maximum(np.round(tokens / total_tokens * total_documents).astype(np.int64), 1)
    dtype = np.dtype(np.uint16)
    started = time.perf_counter()
    stores = []
    for d in range(args.stores):
        prefix = os.path.join(args.out, f"store{d:05d}")
        lengths = document_lengths(int(tokens[d]), int(documents[d]), args.sigma, rng)
        write_sparse_store(prefix, lengths, dtype)
        stores.append({"prefix": prefix, "num_tokens": int(tokens[d]), "num_documents": int(documents[d])})
        if (d + 1) % 100 == 0:
            print(f"{d + 1}/{args.stores} stores, {time.perf_counter() - started:.1f} s", file=sys.stderr)
    manifest = {"stores": stores, "num_tokens": total_tokens, "num_documents": int(documents.sum()),
                "sigma": args.sigma, "seed": args.seed}
    with open(os.path.join(args.out, "corpus.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    print(f"{args.stores} stores, {total_tokens:.3g} tokens, {int(documents.sum()):,} documents in "
          f"{time.perf_counter() - started:.1f} s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
