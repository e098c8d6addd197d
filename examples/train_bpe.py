"""Train a small byte-level BPE tokenizer on JSONL or text files and save its ``tokenizer.json``.

    python examples/train_bpe.py tokenloom-demo/raw/pydoc-topics.jsonl --output tok/tokenizer.json

For trying ``tokenloom tokenize --tokenizer`` where no model hub can be reached: any
HuggingFace ``tokenizer.json`` works the same way. The first special token, ``<|endoftext|>``,
gets id 0; pass ``--eod-id 0`` to ``tokenloom tokenize`` so that it ends every document with it.
``--chat`` adds ChatML's ``<|im_start|>`` and ``<|im_end|>`` as special tokens and writes a
``tokenizer_config.json`` beside the tokenizer with its ``eos_token`` and a ChatML
``chat_template``, which ``tokenloom tokenize --input-format chat`` renders conversations with.
``--fim`` adds the fill-in-the-middle sentinels as StarCoder spells them (``<fim_prefix>``,
``<fim_middle>``, ``<fim_suffix>``, ``<fim_pad>``) as special tokens, for a build config's
``fim: fim_extra_tokens`` to name, so a code store tokenized with it can be served with FIM; the
two combine (one tokenizer for a blend of code, prose and chat stores).
Needs the ``tokenizers`` library (``pip install "tokenloom[tokenizers]"``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
                   "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                   "{% endif %}")
"""ChatML: each message opens with its role's header and ends with ``<|im_end|>``."""
FIM_TOKENS = ("<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>")
"""The sentinels of Megatron-LM's ``fim_extra_tokens`` (prefix, middle, suffix, pad) as
StarCoder spells them; the fifth, ``eod``, is ``<|endoftext|>``."""


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
    parser.add_argument("--chat", action="store_true",
                        help="add ChatML's special tokens and a tokenizer_config.json with a ChatML chat template")
    parser.add_argument("--fim", action="store_true",
                        help="add the fill-in-the-middle sentinels " + ", ".join(FIM_TOKENS) + " as special tokens")
    args = parser.parse_args(argv)

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", *(CHATML_TOKENS if args.chat else ()), *(FIM_TOKENS if args.fim else ())]
    trainer = trainers.BpeTrainer(vocab_size=args.vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts(args.inputs, args.text_key), trainer=trainer)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    tokenizer.save(args.output)
    written = ""
    if args.chat:
        config_path = os.path.join(os.path.dirname(os.path.abspath(args.output)), "tokenizer_config.json")
        with open(config_path, "w", encoding="utf-8") as f:
            json.dump({"eos_token": "<|endoftext|>", "chat_template": CHATML_TEMPLATE}, f, indent=1)
        written = f", ChatML chat template in {os.path.join(os.path.dirname(args.output), 'tokenizer_config.json')}"
    if args.fim:
        written += f", FIM sentinels {tokenizer.token_to_id(FIM_TOKENS[0])}-{tokenizer.token_to_id(FIM_TOKENS[-1])}"
    print(f"wrote {args.output}: byte-level BPE, {tokenizer.get_vocab_size():,} ids, <|endoftext|> = "
          f"{tokenizer.token_to_id('<|endoftext|>')}{written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
