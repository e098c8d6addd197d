"""Fill-in-the-middle serving speed against Megatron-LM's ``GPTFIMDataset``, in one run (issue 42).

    flock /tmp/tokenloom-bench.lock python benchmarks/bench_fim.py --work /tmp/tl_fim --json /tmp/tl_fim.json

* **Corpus:** every module of the Python standard library (``*.py`` under its directory, tests
  included), as "repositories" of four files joined by ``<file_sep>``, each ending in
  ``<|endoftext|>``; tokenized by a byte-level BPE of ``--vocab`` ids trained here on the same
  files (no download), with FIM's sentinels and pad.
* **Samples:** the exact-mode index (megatron-core's arrays) of ``--samples`` samples at each
  sequence length; both sides read the same samples in the same order.
* **tokenloom:** ``BatchPipeline(source, options=SampleOptions(fim=FimTransform(...)))`` on
  micro-batches of ``--micro`` samples: the fields of each micro-batch, FIM'd with each
  sample's own generator (the texts decoded a few calls per micro-batch and the parts encoded
  in one call, both by gigatoken on the calling thread, which gives ``tokenizers``' text and ids;
  the tokenizer as ``load_tokenizer`` opens it). Its one-off scan of the tokenizer (cached) is done before timing
  and reported. Beside it the same pipeline without FIM: what FIM costs over plain serving.
* **Megatron-LM:** ``GPTFIMDataset._query_document_sample_shuffle_indices(i)`` (what
  ``GPTFIMDataset[i]`` calls; its ``__getitem__`` then makes the masks, not timed here, so the
  peer is timed for less than tokenloom does) over megatron-core's ``IndexedDataset`` and the same
  index arrays, its tokenizer calls (``ids_to_text``, ``text_to_ids``) on the same tokenizer by
  the ``tokenizers`` library, as Megatron-LM's HuggingFace tokenizer makes them, its one generator
  seeded as Megatron-LM seeds it. Loaded from megatron-core's wheel (``megatron/training/datasets``).
* **Check:** before timing, a few samples of each setting are permuted by Megatron-LM's code with
  tokenloom's per-sample generator and compared id for id.
* **Timing:** ``--rounds`` rounds, each timing the three loops in a rotating order; the table
  gives the median samples/s of each and the median of each round's ratio.
"""

from __future__ import annotations

import argparse
import functools
import glob
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
import types

import numpy as np

SPECIALS = ["<|endoftext|>", "<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>", "<file_sep>"]
EXTRA = {"prefix": "<fim_prefix>", "middle": "<fim_middle>", "suffix": "<fim_suffix>", "pad": "<fim_pad>",
         "eod": "<|endoftext|>"}


def stdlib_files() -> list[str]:
    root = os.path.dirname(os.__file__)
    return sorted(f for f in glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
                  if "site-packages" not in f)


def train_tokenizer(work: str, vocab: int, files: list[str]):
    import tokenizers

    from tokenloom.tokenization.tokenizers import HuggingFaceTokenizer

    path = os.path.join(work, f"bpe-{vocab}.json")
    if not os.path.exists(path):
        model = tokenizers.Tokenizer(tokenizers.models.BPE())
        model.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
        model.decoder = tokenizers.decoders.ByteLevel()
        model.train(files[:400], tokenizers.trainers.BpeTrainer(
            vocab_size=vocab, special_tokens=SPECIALS, show_progress=False,
            initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
        model.save(path)
    return HuggingFaceTokenizer(path)  # gigatoken where it covers the tokenizer, as load_tokenizer gives it


def write_corpus(work: str, codec, files: list[str]) -> str:
    from tokenloom.io import IndexedDatasetWriter

    prefix = os.path.join(work, "stdlib")
    if os.path.exists(prefix + ".idx"):
        return prefix
    eod, sep = codec.token_id("<|endoftext|>"), codec.token_id("<file_sep>")
    texts = []
    for name in files:
        with open(name, encoding="utf-8", errors="replace") as f:
            texts.append(f.read())
    tokens, lengths = codec.encode_batch(texts)  # whole files: the pipeline's path (encode_texts is for parts)
    tokens = tokens.astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    with IndexedDatasetWriter(prefix, dtype=np.uint16 if codec.vocab_size < 65500 else np.int32) as writer:
        for k in range(0, len(texts), 4):
            parts = []
            for j in range(k, min(k + 4, len(texts))):
                if j > k:
                    parts.append(np.array([sep]))
                parts.append(tokens[starts[j]:starts[j + 1]])
            parts.append(np.array([eod]))
            writer.add_document(np.concatenate(parts).astype(np.int64))
        writer.finalize({"tokenizer": {"kind": "huggingface", "name": "bpe", "path": codec.path,
                                       "sha256": codec.sha256, "vocab_size": codec.vocab_size, "eod_id": eod,
                                       "append_eod": True}})
    return prefix


def megatron_fim_module():
    import megatron.core

    path = os.path.join(os.path.dirname(os.path.dirname(megatron.core.__file__)), "training", "datasets",
                        "fim_dataset.py")
    spec = importlib.util.spec_from_file_location("megatron_fim_dataset", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # its package's __init__ needs Python 3.12; the module does not
    return module


def megatron_dataset(fim_module, prefix: str, indices, codec, transform, seed: int):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    shim = types.SimpleNamespace(
        ids_to_text=lambda ids, remove_special_tokens=True: codec.decode(ids),
        text_to_ids=lambda text: codec.encode_text(text),
        tokens_to_ids=lambda tokens: [codec.token_id(t) for t in tokens] if isinstance(tokens, list)
        else codec.token_id(tokens))
    dataset = fim_module.GPTFIMDataset.__new__(fim_module.GPTFIMDataset)
    dataset.config = types.SimpleNamespace(tokenizer=types.SimpleNamespace(_tokenizer=shim))
    options = transform.options
    dataset.fim_rate, dataset.fim_spm_rate = options.rate, options.spm_rate
    dataset.fragment_fim_rate, dataset.no_fim_prefix = options.fragment_rate, options.no_prefix
    dataset.fim_split_sample = transform.split_id
    dataset.prefix_tok_id, dataset.middle_tok_id, dataset.suffix_tok_id = (
        transform.prefix_id, transform.middle_id, transform.suffix_id)
    dataset.pad_tok_id, dataset.eod_tok_id = transform.pad_id, transform.eod_id
    dataset.dataset = IndexedDataset(prefix)
    dataset.document_index = np.asarray(indices.document_index)
    dataset.sample_index = np.asarray(indices.sample_index)
    dataset.shuffle_index = np.asarray(indices.shuffle_index)
    dataset.np_rng = np.random.RandomState(seed=seed)
    return dataset


def tokenloom_loop(pipeline, ids: np.ndarray, micro: int) -> None:
    """Every field of every micro-batch of the samples ``ids`` of dataset 0."""
    for begin in range(0, ids.shape[0], micro):
        part = ids[begin:begin + micro]
        pipeline.read(np.zeros(part.shape[0], np.int64), part)


def megatron_loop(dataset, samples: int) -> None:
    """Megatron-LM's FIM read of samples ``0..samples-1``, its generator seeded as it seeds it."""
    dataset.np_rng = np.random.RandomState(seed=1234)
    for i in range(samples):
        dataset._query_document_sample_shuffle_indices(i)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", default="/tmp/tl_fim")
    parser.add_argument("--json", default=None)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--seq-lengths", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--rates", type=float, nargs="+", default=[0.5, 0.9])
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    os.makedirs(args.work, exist_ok=True)

    from tokenloom.serve import BatchPipeline, FimTransform, SampleOptions
    from tokenloom.source import FimOptions, StoreBlendSource

    files = stdlib_files()
    started = time.perf_counter()
    codec = train_tokenizer(args.work, args.vocab, files)
    scan = time.perf_counter()
    codec.encode_texts(["warm up"])  # gigatoken's one-off scan of the tokenizer (cached per tokenizer)
    scan = time.perf_counter() - scan
    print(f"first encode (the tokenizer's scan, or its cache): {scan:.1f} s, engine {codec.engine}", file=sys.stderr)
    prefix = write_corpus(args.work, codec, files)
    print(f"corpus: {len(files)} files -> {prefix} in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    fim_module = megatron_fim_module()
    rows = []
    for seq in args.seq_lengths:
        source = StoreBlendSource.from_prefixes([prefix], [1.0], num_samples=args.samples, seq_length=seq, seed=1234)
        indices = source.readers[0].indices
        ids = np.arange(args.samples, dtype=np.int64)
        for rate in args.rates:
            options = FimOptions.from_megatron({"fim_rate": rate, "fim_spm_rate": 0.5, "fim_extra_tokens": EXTRA,
                                                "fim_split_sample": "<file_sep>", "fim_fragment_rate": 0.5})
            transform = FimTransform(options, codec, seed=1234)
            fim_pipeline = BatchPipeline(source, options=SampleOptions(fim=transform))
            plain_pipeline = BatchPipeline(source)
            megatron = megatron_dataset(fim_module, prefix, indices, codec, transform, seed=1234)
            for i in range(8):  # Megatron-LM's code with tokenloom's generator: the same ids
                megatron.np_rng = transform.sample_rng(0, i)
                theirs = megatron._query_document_sample_shuffle_indices(i)[0]
                ours = fim_pipeline.read_samples_fields(np.zeros(1, np.int64), np.array([i]))
                row = np.concatenate([ours["tokens"][0], ours["labels"][0][-1:]])
                if not np.array_equal(row, theirs):
                    raise SystemExit(f"seq {seq} rate {rate}: sample {i} differs from Megatron-LM's")

            loops = {"tokenloom FIM": functools.partial(tokenloom_loop, fim_pipeline, ids, args.micro),
                     "tokenloom plain": functools.partial(tokenloom_loop, plain_pipeline, ids, args.micro),
                     "Megatron-LM GPTFIMDataset": functools.partial(megatron_loop, megatron, args.samples)}
            times: dict[str, list[float]] = {name: [] for name in loops}
            names = list(loops)
            for r in range(args.rounds):
                for name in names[r % 3:] + names[:r % 3]:
                    t0 = time.perf_counter()
                    loops[name]()
                    times[name].append(time.perf_counter() - t0)
            rate_of = {name: args.samples / statistics.median(t) for name, t in times.items()}
            vs_megatron = statistics.median(m / f for f, m in zip(times["tokenloom FIM"],
                                                                  times["Megatron-LM GPTFIMDataset"]))
            vs_plain = statistics.median(f / p for f, p in zip(times["tokenloom FIM"], times["tokenloom plain"]))
            row = {"seq_length": seq, "fim_rate": rate, "samples": args.samples,
                   "samples_per_s": {k: round(v, 1) for k, v in rate_of.items()},
                   "ratio_vs_megatron": round(vs_megatron, 2), "fim_time_over_plain": round(vs_plain, 2)}
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    print("| seq | fim_rate | tokenloom FIM samples/s | Megatron-LM GPTFIMDataset samples/s | **ratio** | "
          "tokenloom plain samples/s | FIM time / plain |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        s = r["samples_per_s"]
        print(f"| {r['seq_length']} | {r['fim_rate']} | {s['tokenloom FIM']:,.0f} | "
              f"{s['Megatron-LM GPTFIMDataset']:,.0f} | **{r['ratio_vs_megatron']:.2f}x** | "
              f"{s['tokenloom plain']:,.0f} | {r['fim_time_over_plain']:.1f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "engine": codec.engine, "first_encode_s": round(scan, 2),
                       "machine": platform.node(), "cpus": os.cpu_count(),
                       "load": os.getloadavg()}, f, indent=1)


if __name__ == "__main__":
    main()
