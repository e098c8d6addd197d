"""Chat data made here (no downloads): a byte-level BPE trained on standard-library sources with
chat special tokens, a ``tokenizer_config.json`` holding a ChatML template, and multi-turn
conversations whose answers are real docstrings of the standard library."""

from __future__ import annotations

import glob
import importlib
import inspect
import json
import os
import random

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
          "{% endif %}")
"""ChatML (the shape of Qwen's template, without its default system prompt): role headers, an
end-of-turn special token."""

CHAT_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>", "<unk>", "<SPECIAL_10>", "<SPECIAL_11>",
                 "<SPECIAL_12>", "<SPECIAL_233>")
"""ChatML's tokens and those Megatron-LM's Nemotron prompt formats name."""

MODULES = ("os", "json", "collections", "itertools", "functools", "string", "textwrap", "shutil", "pathlib", "re",
           "random", "statistics", "heapq", "bisect", "fractions", "difflib", "csv", "gzip", "base64", "inspect")


def train_chat_tokenizer(directory) -> str:
    """A GPT-2 style byte-level BPE (1200 ids) with :data:`CHAT_SPECIALS`, and a
    ``tokenizer_config.json`` with :data:`CHATML`; returns the directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))[:20]
    tokenizer.train(files, trainers.BpeTrainer(vocab_size=1200, special_tokens=list(CHAT_SPECIALS),
                                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                               show_progress=False))
    directory = str(directory)
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
                   "pad_token": "<|pad|>", "unk_token": "<unk>", "chat_template": CHATML}, f)
    return directory


def docstring_answers() -> list[tuple[str, str]]:
    """(question, answer) pairs: each public function or class of :data:`MODULES` with a docstring."""
    pairs = []
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for name, value in sorted(vars(module).items()):
            if name.startswith("_") or not (inspect.isfunction(value) or inspect.isclass(value)):
                continue
            doc = inspect.getdoc(value)
            if doc and len(doc) > 20:
                pairs.append((f"What does {module_name}.{name} do?", doc[:1500]))
    return pairs


def make_conversations(count: int, seed: int = 0) -> list[dict]:
    """``count`` chat records: an optional system prompt, 1-4 user/assistant exchanges whose
    answers are docstrings; one record in eight packs two conversations (a second system
    message starts the next, as Megatron-LM's ``SFTDataset`` splits them)."""
    rng = random.Random(seed)
    pairs = docstring_answers()
    records = []
    for _ in range(count):
        messages = []
        for _conversation in range(2 if rng.random() < 0.125 else 1):
            messages.append({"role": "system", "content": rng.choice(
                ["You are a helpful Python assistant.", "Answer from the standard library's documentation.",
                 "Be precise."])})
            for _turn in range(rng.randint(1, 4)):
                question, answer = rng.choice(pairs)
                messages.append({"role": "user", "content": question})
                messages.append({"role": "assistant", "content": answer})
        if rng.random() < 0.25 and len(messages) == 3:  # some start without a system prompt
            messages = messages[1:]
        records.append({"messages": messages})
    return records


def write_jsonl(path, records) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    return str(path)
