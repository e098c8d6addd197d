"""Train a small byte-level BPE tokenizer on JSONL or text files and save its ``tokenizer.json``.

    python examples/train_bpe.py tokenloom-demo/raw/pydoc-topics.jsonl --output tok/tokenizer.json

For trying ``tokenloom tokenize --tokenizer`` where no model hub can be reached: any
HuggingFace ``tokenizer.json`` works the same way. The first special token, ``<|endoftext|>``,
gets id 0; pass ``--eod-id 0`` to ``tokenloom tokenize`` so that it ends every document with it.
Needs the ``tokenizers`` library (``pip install "tokenloom[tokenizers]"``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def texts(paths: list[str], key: str):
    """Each JSONL record's ``key`` (a ``.jsonl`` file), or each file's whole text."""
    for path in paths:
        with open(path, encoding="utf-8") as f:
            if path.endswith(".jsonl"):
                for line in f:
                    if line.strip():
                        yield json.loads(line)[key]
            else:
                yield f.read()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("inputs", nargs="+", help=".jsonl files (records with --text-key) or text files")
    parser.add_argument("--output", required=True, help="where to write tokenizer.json (its folder is created)")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--text-key", default="text")
    args = parser.parse_args(argv)

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=args.vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts(args.inputs, args.text_key), trainer=trainer)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    tokenizer.save(args.output)
    print(f"wrote {args.output}: byte-level BPE, {tokenizer.get_vocab_size():,} ids, <|endoftext|> = "
          f"{tokenizer.token_to_id('<|endoftext|>')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
