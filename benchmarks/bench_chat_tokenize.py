"""Benchmark: `tokenloom tokenize --input-format chat` (tokens and loss mask) vs Megatron-LM's
`SFTDataset` path, per CPU-second; and the loss-mask sidecar's bytes per token.

Builds, in --workdir (cached): a byte-level BPE tokenizer (--vocab ids) trained with the
`tokenizers` library on the Python standard library's sources, with ChatML's special tokens and a
`tokenizer_config.json` holding a ChatML chat template; and --records chat JSONL records made of
real text: each answer is a docstring of a standard-library function or class (read from the
sources with `ast`, no imports), each question names it, 1-4 exchanges per conversation, most
with a system prompt, one record in eight packing two conversations (as `SFTDataset` splits them).

Then, in one run on that data:

* Megatron-LM: `SFTDataset.__getitem__` (megatron/training/datasets/sft_dataset.py of the
  megatron-core wheel) over the first --peer-records records, its tokenizer Megatron's own
  `SFTTokenizer` (the tokenizer loaded by its constructor through `transformers.AutoTokenizer`,
  the ChatML template in a `PromptConfig` with the role header outside the loss): every
  conversation rendered and encoded whole and message by message, masked, packed and padded to
  --seq-length (4096; a longer record is cut there, as in training). The tokenizing part alone
  (`tokenize_conversation` on each conversation) is a second row.
* tokenloom: `tokenize_to_store` from the JSONL file to a finished store with its `.mask`
  (reading, JSON parsing, rendering, one batch encode per task of the conversations and their
  messages, the check that they agree, the mask, the EOD, writing), in the calling thread and
  with worker threads (gigatoken), on the same first --peer-records records and on all records.

The stores' tokens and masks are checked against Megatron's samples on the peer records before
any figure is printed. CPU seconds are user + system of this process and its reaped children
(threads included). Not collected by pytest. Run it under the shared lock:

    flock /tmp/tokenloom-bench.lock python benchmarks/bench_chat_tokenize.py
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import platform
import random
import resource
import sysconfig
import time
import types

import numpy as np

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
          "{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
SYSTEM_PROMPTS = ["You are a helpful Python assistant.", "Answer from the standard library's documentation.",
                  "Be precise and cite the function's behaviour.", "You explain Python code to beginners."]
QUESTIONS = ["What does {name} do?", "How do I use {name}?", "Explain {name} from the {module} module.",
             "What are the arguments of {name}?", "When would I call {module}.{name}?"]


def _stdlib_sources() -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for directory, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "__pycache__", "test", "tests", "idlelib"))
        found.extend(os.path.join(directory, name) for name in sorted(files) if name.endswith(".py"))
    return found


def _docstrings(paths: list[str]) -> list[tuple[str, str, str]]:
    """(module, name, docstring) of every documented function and class of the sources."""
    found = []
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read())
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        module = os.path.splitext(os.path.relpath(path, sysconfig.get_paths()["stdlib"]))[0].replace(os.sep, ".")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= 40 and not node.name.startswith("_"):
                    found.append((module, node.name, doc[:2000]))
    return found


def _records(count: int, pairs: list[tuple[str, str, str]], seed: int) -> list[dict]:
    rng = random.Random(seed)
    records = []
    for _ in range(count):
        messages = []
        for _conversation in range(2 if rng.random() < 0.125 else 1):
            if rng.random() < 0.8 or messages:
                messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
            for _turn in range(rng.randint(1, 4)):
                module, name, doc = rng.choice(pairs)
                messages.append({"role": "user", "content": rng.choice(QUESTIONS).format(name=name, module=module)})
                messages.append({"role": "assistant", "content": doc})
        records.append({"messages": messages})
    return records


def _prepare(workdir: str, vocab: int, count: int) -> tuple[str, str, list[dict]]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    sources = _stdlib_sources()
    directory = os.path.join(workdir, f"chat-tokenizer-{vocab}")
    if not os.path.isfile(os.path.join(directory, "tokenizer_config.json")):
        os.makedirs(directory, exist_ok=True)
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        tokenizer.train(sources[::4], trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS,
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                          show_progress=False))
        tokenizer.save(os.path.join(directory, "tokenizer.json"))
        with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
            json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
                       "pad_token": "<|pad|>", "chat_template": CHATML}, f)
    jsonl = os.path.join(workdir, f"chat-{count}.jsonl")
    records = _records(count, _docstrings(sources), seed=0)
    if not os.path.isfile(jsonl):
        with open(jsonl + ".tmp", "w", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps(record) + "\n")
        os.replace(jsonl + ".tmp", jsonl)
    return directory, jsonl, records


def _split(messages: list[dict]) -> list[list[dict]]:
    """A record's conversations: a new one at each system message (SFTDataset's split)."""
    found, current = [], []
    for message in messages:
        if message["role"] == "system" and current:
            found.append(current)
            current = []
        current.append(message)
    return [*found, current] if current else found


def _cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _megatron(directory: str, header: int, seq_length: int):
    """Megatron-LM's SFTTokenizer (its constructor) and an SFTDataset factory over records."""
    import megatron.core
    from megatron.core.tokenizers.text.libraries.sft_tokenizer import PromptConfig, SFTTokenizer

    path = os.path.join(os.path.dirname(os.path.dirname(megatron.core.__file__)), "training", "datasets",
                        "sft_dataset.py")
    spec = importlib.util.spec_from_file_location("megatron_sft_dataset", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # megatron.training's __init__ needs Python 3.12; this file does not
    sft = SFTTokenizer(directory, "nemotron-h-aligned")
    sft._prompt_config = PromptConfig(assistant_prefix_len=header, custom_chat_template=CHATML,
                                      pad_token_id=sft._tokenizer.convert_tokens_to_ids("<|pad|>"),
                                      has_bos=False, has_system_role=True)

    def dataset(records):
        found = module.SFTDataset.__new__(module.SFTDataset)
        found.config = types.SimpleNamespace(
            tokenizer=types.SimpleNamespace(tokenize_conversation=sft.tokenize_conversation, eod=sft.eod,
                                            pad=sft.pad_id),
            sequence_length=seq_length, reset_position_ids=False, context_parallel_size=1,
            create_attention_mask=False, reset_attention_mask=False)
        found.dataset = [record["messages"] for record in records]
        found.indices = np.arange(len(records))
        return found

    return sft, dataset, module


def _timed(call):
    wall, cpu = time.perf_counter(), _cpu_seconds()
    result = call()
    return result, time.perf_counter() - wall, _cpu_seconds() - cpu


def _tokenloom(jsonl: str, prefix: str, directory: str, header: int, workers: int):
    from tokenloom.tokenization import TokenizeConfig, tokenize_to_store

    config = TokenizeConfig(tokenizer=directory, input_format="chat", assistant_prefix_tokens=header,
                            append_eod=False, workers=workers, threads=True if workers else None)
    return _timed(lambda: tokenize_to_store([jsonl], prefix, config))


def _check(prefix: str, samples, records: list[dict]) -> None:
    """The store's tokens and masks are Megatron's on every record (loss_mask[i] is the mask of
    token i + 1)."""
    from tokenloom.io import IndexedDataset

    store = IndexedDataset(prefix)
    document = 0
    for line, record in enumerate(records):
        count = len(_split(record["messages"]))
        tokens = np.concatenate([store[d] for d in range(document, document + count)])
        mask = np.concatenate([store.get_loss_mask(d) for d in range(document, document + count)])
        document += count
        sample = samples[line]
        n = min(tokens.size, sample["tokens"].shape[0])
        if not (np.array_equal(sample["tokens"].numpy()[:n], tokens[:n])
                and np.array_equal(sample["loss_mask"].numpy()[:n - 1], mask[1:n])):
            raise SystemExit(f"record {line + 1}: tokenloom's tokens or mask differ from Megatron's SFTDataset")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", default="/tmp/tokenloom-bench-chat")
    parser.add_argument("--records", type=int, default=40000, help="chat records for tokenloom's full run")
    parser.add_argument("--peer-records", type=int, default=4000, help="records both sides tokenize")
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--seq-length", type=int, default=4096,
                        help="SFTDataset's pack length (a record longer is cut there, as in training)")
    parser.add_argument("--workers", type=int, default=2, help="tokenloom's worker threads in the threaded rows")
    args = parser.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    directory, jsonl, records = _prepare(args.workdir, args.vocab, args.records)
    peer_jsonl = os.path.join(args.workdir, f"chat-peer-{args.peer_records}.jsonl")
    with open(jsonl, "rb") as f, open(peer_jsonl, "wb") as out:
        for _ in range(args.peer_records):
            out.write(f.readline())
    peer_records = records[:args.peer_records]

    from tokenloom.tokenization.tokenizers import HuggingFaceTokenizer

    header = len(HuggingFaceTokenizer(directory, engine="hf").encode_text("<|im_start|>assistant\n"))
    # first use, not timed: the code point scan of this tokenizer (cached), the template's compile, imports
    _tokenloom(peer_jsonl, os.path.join(args.workdir, "warm"), directory, header, 0)
    sft, megatron_dataset, _ = _megatron(directory, header, args.seq_length)
    sft.tokenize_conversation(peer_records[0]["messages"][:3], return_target=True, add_generation_prompt=False)

    rows = []
    samples = megatron_dataset(peer_records)
    got, wall, cpu = _timed(lambda: [samples[i] for i in range(len(peer_records))])
    conversations = sum(len(_split(r["messages"])) for r in peer_records)
    rows.append(("Megatron-LM SFTDataset[i] (SFTTokenizer, transformers)", len(peer_records), conversations,
                 None, wall, cpu))

    convs = [c for r in peer_records for c in _split(r["messages"])]
    _, wall, cpu = _timed(lambda: [sft.tokenize_conversation(c, return_target=True, add_generation_prompt=False)
                                   for c in convs])
    rows.append(("Megatron-LM SFTTokenizer.tokenize_conversation only", len(peer_records), len(convs), None,
                 wall, cpu))

    peer_prefix = os.path.join(args.workdir, "peer-store")
    for workers, label in ((0, "calling thread"), (args.workers, f"{args.workers} threads")):
        summary, wall, cpu = _tokenloom(peer_jsonl, peer_prefix, directory, header, workers)
        if workers == 0:
            _check(peer_prefix, got, peer_records)
        rows.append((f"tokenloom tokenize --input-format chat ({label})", len(peer_records), summary.num_documents,
                     summary.num_tokens, wall, cpu))
    full_prefix = os.path.join(args.workdir, "full-store")
    for workers, label in ((0, "calling thread"), (args.workers, f"{args.workers} threads")):
        summary, wall, cpu = _tokenloom(jsonl, full_prefix, directory, header, workers)
        rows.append((f"tokenloom tokenize --input-format chat ({label})", args.records, summary.num_documents,
                     summary.num_tokens, wall, cpu))
    peer_tokens = rows[2][3]
    rows[0] = (*rows[0][:3], peer_tokens, *rows[0][4:])
    rows[1] = (*rows[1][:3], peer_tokens, *rows[1][4:])

    print(f"machine: {_cpu_model()}, {os.cpu_count()} cores; tokenizer: byte-level BPE, {args.vocab} ids, ChatML; "
          f"SFTDataset seq_length {args.seq_length}; masks checked equal to Megatron's on {len(peer_records)} records")
    print()
    print("| run | records | conversations | tokens | wall s | CPU s | conversations / CPU-s | tokens / CPU-s | "
          "vs SFTDataset per CPU-s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    base = rows[0][2] / rows[0][5]
    for name, count, documents, num_tokens, wall, cpu in rows:
        print(f"| {name} | {count:,} | {documents:,} | {num_tokens:,} | {wall:.1f} | {cpu:.1f} | "
              f"{documents / cpu:,.0f} | {num_tokens / cpu:,.0f} | {documents / cpu / base:.1f}x |")
    size = os.path.getsize(full_prefix + ".mask")
    bin_size = os.path.getsize(full_prefix + ".bin")
    tokens = rows[-1][3]
    print()
    print(f"loss-mask sidecar: {size:,} bytes for {tokens:,} tokens = {size / tokens:.4f} bytes/token "
          f"(the .bin: {bin_size / tokens:.0f} bytes/token, so +{size / bin_size:.1%}); "
          f"{summary.loss_tokens / summary.num_tokens:.1%} of the tokens in the loss")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
