"""Print the samples a build serves at some positions: each one's store, whether fill-in-the-middle
permuted it, and which of its labels are in the loss.

    python examples/show_batch.py mix.yaml --positions 0:8
    python examples/show_batch.py mix.yaml --positions 0:64 --json     # every field, a line per sample

``tokenloom where --text`` shows what the *index* holds at a position: the store's tokens, before
serving. A training job sees something else when the build config has ``fim:`` or a store has a
loss mask (``PREFIX.mask``, from ``tokenloom tokenize --input-format chat``): the samples of the
FIM stores are cut and put back between sentinel tokens, and the served ``loss_mask`` is the
store's mask times the EOD and padding masks. This script opens the build
(``tokenloom.build(config)``, which builds what the cache misses) and reads the positions through
``BatchPipeline(split)``, the one pipeline every loader and adapter serves with, so what it prints
is what ``RankLoader``, the DataLoader and the JAX and grain adapters hand a rank at those
positions.

Per sample it prints a line with its position, store, the store's sample id, the FIM sentinels'
order for each permuted piece (``PSM``: ``<fim_prefix>`` then ``<fim_suffix>`` after the prefix;
``SPM``: ``<fim_suffix>`` straight after ``<fim_prefix>``, as Megatron-LM writes it; a PSM piece
whose prefix is empty reads as SPM) and how many
of its labels are outside the loss; then an excerpt of the sample's tokens (its ``seq_length``
inputs and the last label) decoded with special tokens, escaped to one line (``\\n``), each run of tokens
whose prediction is outside the loss in ``[...]``: token ``t + 1`` is label ``t``, counted iff
``loss_mask[t]``, and the first token, which nothing predicts, is outside. The excerpt starts at
the first ``<fim_prefix>`` of a permuted sample, else a little before its first label outside the
loss (at the first label when none is), so the part worth seeing is in it; ``--chars`` sets its
length.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

import tokenloom
from tokenloom import ConfigError, TokenloomError
from tokenloom.io import IndexedDataset
from tokenloom.serve import BatchPipeline


def parse_positions(text: str) -> np.ndarray:
    """``A:B`` (positions A to B-1) or one position ``A``."""
    try:
        first, last = (int(v) for v in text.split(":", 1)) if ":" in text else (int(text), int(text) + 1)
    except ValueError:
        raise ConfigError(f"--positions {text!r}; expected A:B (positions A to B-1) or one position") from None
    if first < 0 or last <= first:
        raise ConfigError(f"--positions {text!r}; expected 0 <= A < B")
    return np.arange(first, last, dtype=np.int64)


class Decoder:
    """Token ids to text with special tokens kept, by the tokenizer the store records
    (``PREFIX.meta.json``): a HuggingFace ``tokenizer.json``, or the built-in bytes (EOD shown as
    ``<|eod|>``)."""

    def __init__(self, prefix: str) -> None:
        record = (IndexedDataset(prefix).metadata or {}).get("tokenizer") or {}
        self.kind, self.eod_id = record.get("kind"), record.get("eod_id")
        if self.kind == "huggingface" and record.get("path"):
            from tokenizers import Tokenizer

            try:
                self.tokenizer = Tokenizer.from_file(record["path"])
            except Exception as exc:  # the tokenizers library raises its own Exception
                raise ConfigError(f"{prefix}: cannot load its tokenizer {record['path']}: {exc}") from None
        elif self.kind != "bytes":
            raise ConfigError(f"{prefix}: the store records no tokenizer to decode with "
                              f"({self.kind or 'none'}); tokenize it with tokenloom tokenize")

    def decode(self, ids) -> str:
        ids = [int(t) for t in ids]
        if self.kind == "huggingface":
            return self.tokenizer.decode(ids, skip_special_tokens=False)
        text, run = [], bytearray()
        for token in ids:
            if token == self.eod_id or token > 255:
                text += [run.decode("utf-8", errors="replace"), "<|eod|>" if token == self.eod_id else f"<{token}>"]
                run = bytearray()
            else:
                run.append(token)
        return "".join(text) + run.decode("utf-8", errors="replace")

    def token_id(self, spelt: str) -> int | None:
        return self.tokenizer.token_to_id(spelt) if self.kind == "huggingface" else None


def fim_orders(row: np.ndarray, prefix_id: int | None, suffix_id: int | None) -> list[str]:
    """``PSM`` or ``SPM`` for each ``<fim_prefix>`` of ``row`` (a permuted piece opens with it;
    Megatron-LM's SPM puts ``<fim_suffix>`` straight after it)."""
    if prefix_id is None:
        return []
    at = np.flatnonzero(row[:-1] == prefix_id)
    return ["SPM" if row[i + 1] == suffix_id else "PSM" for i in at.tolist()]


def marked_text(decoder: Decoder, row: np.ndarray, in_loss: np.ndarray) -> str:
    """``row`` decoded a run at a time, each run of tokens outside the loss in brackets."""
    change = np.flatnonzero(np.diff(in_loss)) + 1
    parts = []
    for lo, hi in zip([0, *change.tolist()], [*change.tolist(), len(row)]):
        text = decoder.decode(row[lo:hi])
        parts.append(text if in_loss[lo] else f"[{text}]")
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in "".join(parts))  # one line: \n, \x0c ...


def excerpt(decoder: Decoder, row: np.ndarray, in_loss: np.ndarray, start: int, chars: int) -> str:
    """About ``chars`` characters of :func:`marked_text` from token ``start`` on."""
    text = marked_text(decoder, row[start:], in_loss[start:])
    return ("..." if start else "") + (text if len(text) <= chars else text[:chars] + "...")


def show(config: str, split_name: str, positions: np.ndarray, *, chars: int, as_json: bool) -> list[str]:
    """The lines to print for ``positions`` of the split (see the module docstring)."""
    split = tokenloom.build(config).split(split_name)
    if positions[-1] >= split.num_samples:
        raise ConfigError(f"--positions up to {int(positions[-1])}; the {split_name} split of {config} has "
                          f"{split.num_samples:,} samples")
    pipeline = BatchPipeline(split)
    dataset_ids, sample_ids = split.locate(positions)
    fields = pipeline.read(dataset_ids, sample_ids)
    tokens, labels = fields["tokens"], fields["labels"]  # (B, seq_length) each
    loss_mask = fields["loss_mask"]  # (B, seq_length) float32, 1 = label t is in the loss
    fim = getattr(split, "fim", None)
    decoders: dict[str, Decoder] = {}
    names = [d.name for d in split.datasets]
    width = max(len(short(n)) for n in names)
    lines = []
    for k, position in enumerate(positions.tolist()):
        name = names[int(dataset_ids[k])]
        decoder = decoders.setdefault(name, Decoder(name))
        row = np.concatenate([tokens[k], labels[k, -1:]])  # the sample's seq_length + 1 tokens
        prefix_id = suffix_id = None
        if fim is not None:
            prefix_id = decoder.token_id(fim.options.extra_tokens["prefix"])
            suffix_id = decoder.token_id(fim.options.extra_tokens["suffix"])
        orders = fim_orders(row, prefix_id, suffix_id)
        in_loss = loss_mask[k] > 0
        if as_json:
            lines.append(json.dumps({"position": position, "store": name, "sample": int(sample_ids[k]),
                                     "fim": orders, "tokens": tokens[k].tolist(), "labels": labels[k].tolist(),
                                     "loss_mask": in_loss.astype(int).tolist()}))
            continue
        permuted = f"FIM {','.join(orders)}" if orders else "no FIM"
        lines.append(f"{position:>4}  {short(name):<{width}}  sample {int(sample_ids[k]):<5} {permuted:<8}  "
                     f"{int((~in_loss).sum()):>3} of {len(in_loss)} labels outside the loss")
        row_in_loss = np.concatenate([[0], in_loss]).astype(np.int8)  # (seq_length + 1,) token t+1 is label t
        if orders:
            start = int(np.flatnonzero(row == prefix_id)[0])
        else:
            outside = np.flatnonzero(row_in_loss[1:] == 0)
            start = max(1, int(outside[0]) + 1 - 4) if len(outside) else 1
        lines.append("      " + excerpt(decoder, row, row_in_loss, start, chars))
    return lines


def short(prefix: str) -> str:
    """A store's name as a line shows it: its file name."""
    return prefix.replace("\\", "/").rsplit("/", 1)[-1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", metavar="CONFIG", help="build config (YAML/JSON)")
    parser.add_argument("--positions", required=True, metavar="A:B", help="global positions A..B-1 (or one)")
    parser.add_argument("--split", default="train", choices=("train", "valid", "test"))
    parser.add_argument("--chars", type=int, default=110, metavar="N", help="characters of each excerpt")
    parser.add_argument("--json", action="store_true",
                        help="a JSON object per sample: position, store, sample, fim, tokens, labels, loss_mask")
    args = parser.parse_args(argv)
    try:
        lines = show(args.config, args.split, parse_positions(args.positions), chars=args.chars, as_json=args.json)
    except TokenloomError as exc:
        print(f"show_batch: error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
