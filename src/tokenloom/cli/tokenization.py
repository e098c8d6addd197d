"""The ``tokenloom tokenize`` subcommand: flags in, :func:`tokenloom.tokenization.tokenize_to_store` out.

``register(subparsers)`` adds it; the parsed namespace carries ``run=run_tokenize``. Library
errors propagate to ``tokenloom.cli.main`` (one line, exit 2) with
the flag that addresses them added here.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

from tokenloom import BuildError, ConfigError, InputError, TokenloomError

_SIZE = re.compile(r"^\s*(\d+)\s*([kmg]?)i?b?\s*$", re.IGNORECASE)


def _byte_size(text: str) -> int:
    """``1048576``, ``512K``, ``4M``, ``1GiB`` -> bytes."""
    match = _SIZE.match(text)
    if not match or int(match.group(1)) == 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive size like 1048576, 512K or 4M")
    return int(match.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30}[match.group(2).lower()]


def _prefix_tokens(text: str) -> int | str:
    if text == "auto":
        return text
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is neither a count of tokens (0, 1, ...) nor 'auto'")
    return int(text)


def add_tokenize_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``tokenize`` on ``subparsers`` and return its parser."""
    p = subparsers.add_parser(
        "tokenize",
        help="tokenize JSONL / Parquet / text files (or chat and pre-tokenized spans, with a loss mask) into a "
             "token store",
        description="Tokenize documents from JSONL, Parquet or text files (gzip/zstd compressed, "
        "directories read recursively, glob patterns) in parallel into one Megatron .bin/.idx "
        "token store, with a PREFIX.meta.json sidecar recording the tokenizer. The output is "
        "byte-identical for any number of workers.",
    )
    p.set_defaults(run=run_tokenize)
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="files, directories or glob patterns (quote globs)")
    p.add_argument("--output", "-o", required=True, metavar="PREFIX",
                   help="store to write: PREFIX.bin, PREFIX.idx, PREFIX.meta.json")
    p.add_argument(
        "--tokenizer", default="bytes", metavar="PATH",
        help="'bytes' (built in: UTF-8 bytes 0-255, EOD 256; the default) or a HuggingFace tokenizer.json "
             "(or its directory)",
    )
    p.add_argument(
        "--format", "--input-format", dest="input_format",
        choices=("auto", "jsonl", "parquet", "text", "chat", "spans"), default="auto",
        help="input format; auto (default) goes by extension: .jsonl/.json/.ndjson, .parquet, "
             ".txt/.text/.md, plus .gz/.zst. chat: JSONL {\"messages\": [{\"role\", \"content\"}, ...]} "
             "rendered through the chat template, only the assistant turns in the loss; spans: JSONL "
             "{\"input_ids\": [...], \"loss_spans\": [[begin, end], ...]}; both write a loss mask beside the "
             "store (PREFIX.mask)",
    )
    p.add_argument("--chat-template", metavar="FILE", default=None,
                   help="chat: a Jinja chat template (default: the tokenizer's own, chat_template in "
                   "tokenizer_config.json or chat_template.jinja beside tokenizer.json)")
    p.add_argument("--assistant-prefix-tokens", type=_prefix_tokens, default=0, metavar="N|auto",
                   help="chat: keep the first N tokens of each assistant turn (its role header) outside the loss, "
                   "as Megatron-LM's assistant_prefix_len; auto counts the tokens the template writes before an "
                   "assistant message's content (default 0: the whole turn is in the loss)")
    p.add_argument("--text-key", default="text", metavar="KEY",
                   help="JSONL field with the text; a.b for nested objects (default: text)")
    p.add_argument("--column", default="text", metavar="NAME", help="Parquet column with the text (default: text)")
    p.add_argument("--lines", action="store_true",
                   help="text files: one document per non-blank line (default: one per file)")
    eod = p.add_mutually_exclusive_group()
    eod.add_argument("--no-eod", action="store_true", help="do not append an end-of-document token")
    eod.add_argument("--eod-id", type=int, metavar="ID",
                     help="end-of-document id (default: the tokenizer's eos / <|endoftext|>)")
    p.add_argument("--skip-bad", action="store_true",
                   help="skip and count bad records instead of stopping at the first")
    p.add_argument(
        "--workers", type=int, default=None, metavar="N",
        help=f"worker threads or processes (default: threads, one per core up to 4; processes, one per core, "
        f"here {os.cpu_count()}; 0 = in the calling thread)",
    )
    parallel = p.add_mutually_exclusive_group()
    parallel.add_argument("--threads", dest="threads", action="store_const", const=True, default=None,
                          help="the workers are threads of this process (the default with gigatoken, which "
                          "releases the GIL: nothing to start or copy between processes)")
    parallel.add_argument("--processes", dest="threads", action="store_const", const=False,
                          help="the workers are processes (the default with the other engines)")
    p.add_argument("--chunk-size", type=_byte_size, default=1 << 20, metavar="BYTES",
                   help="text per worker task, e.g. 512K, 4M (default 1M)")
    p.add_argument("--engine", choices=("auto", "gigatoken", "hf"), default="auto",
                   help="how a tokenizer.json encodes: gigatoken where it covers the tokenizer, else the "
                   "tokenizers library (auto, the default), or force one; the ids are the same: documents "
                   "holding a character gigatoken reads differently go to tokenizers, and each process "
                   "checks gigatoken against tokenizers on its first documents")
    p.add_argument("--verify", action="store_true",
                   help="encode every document with both engines and stop at the first difference, naming the "
                   "file, line and character (costs about what the tokenizers library costs)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    return p


class _ProgressBar:
    """A tqdm bar over input bytes (so it has an ETA) showing documents/s and tokens/s."""

    def __init__(self, total_bytes: int, *, disable: bool) -> None:
        from tqdm import tqdm

        self._bar = tqdm(
            total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024,
            desc="tokenize", disable=disable, dynamic_ncols=True,
        )
        self._started = time.perf_counter()
        self.documents = self.tokens = 0

    def __call__(self, documents: int, tokens: int, input_bytes: int) -> None:
        self.documents += documents
        self.tokens += tokens
        elapsed = max(time.perf_counter() - self._started, 1e-9)
        self._bar.set_postfix_str(
            f"{self.documents / elapsed:,.0f} docs/s, {self.tokens / elapsed:,.0f} tok/s", refresh=False
        )
        self._bar.update(input_bytes)

    def close(self) -> None:
        self._bar.close()


def _count(number: int, noun: str) -> str:
    return f"{number:,} {noun}{'' if number == 1 else 's'}"


def _format_summary(summary) -> str:
    record = summary.tokenizer
    lines = [
        f"wrote {summary.prefix}.bin/.idx/.meta.json: {_count(summary.num_documents, 'document')}, "
        f"{_count(summary.num_tokens, 'token')} from {_count(summary.num_files, 'file')} in {summary.elapsed_s:.1f} s "
        f"({summary.documents_per_s:,.0f} docs/s, {summary.tokens_per_s:,.0f} tokens/s); "
        f"tokenizer {record.name} (vocab {record.vocab_size:,}, "
        + (f"EOD {record.eod_id} appended)" if record.append_eod else "no EOD appended)")
    ]
    kind, plural = ("thread", "threads") if summary.threads else ("process", "processes")
    how = (f"{summary.workers} worker {kind if summary.workers == 1 else plural}" if summary.workers
           else "in the calling thread")
    if summary.engine != "bytes":
        lines.append(f"engine {summary.engine}" + (f" ({summary.engine_note})" if summary.engine_note else "")
                     + f", {how}")
    else:
        lines.append(how)
    if summary.engine == "gigatoken":
        lines.append(_identity(summary))
    if summary.loss_tokens is not None:
        share = summary.loss_tokens / summary.num_tokens if summary.num_tokens else 0.0
        header = ("" if not summary.assistant_prefix_tokens else
                  f"; each assistant turn's first {_count(summary.assistant_prefix_tokens, 'token')} outside it")
        lines.append(f"loss mask {summary.prefix}.mask: {_count(summary.loss_tokens, 'token')} in the loss "
                     f"({share:.1%}){header}")
    if summary.num_skipped:
        reasons = ", ".join(f"{reason} {count:,}" for reason, count in summary.skipped.items())
        lines.append(f"skipped {_count(summary.num_skipped, 'bad record')} ({reasons})")
    if summary.num_empty:
        lines.append(f"left out {_count(summary.num_empty, 'empty document')}")
    return "\n".join(lines)


def _identity(summary) -> str:
    """How the run held gigatoken's ids to the tokenizers library's."""
    routed = (f"{_count(summary.routed_documents, 'document')} holding one of the "
              f"{_count(summary.divergent_code_points or 0, 'code point')} gigatoken reads differently "
              "went to tokenizers")
    if summary.verified:
        return f"identity: {routed}; every document was compared with tokenizers (--verify)"
    return (f"identity: {routed}; tokenizers checked only each process's first {summary.guard_characters // 1024}K "
            "characters (--verify checks every document)")


def _with_flag_hint(exc: TokenloomError, args: argparse.Namespace) -> TokenloomError:
    """``exc`` with the flag that addresses it named, the same in one process and divided over
    ranks (where a rank's error reaches every rank inside a BuildError naming the phase);
    ``exc`` itself when no flag addresses it."""
    message = str(exc)
    if "has no chat template" in message or "assistant_prefix_tokens" in message:
        hint = "--chat-template FILE, --assistant-prefix-tokens N with --input-format chat"
    elif "end-of-document" in message:
        hint = "--eod-id ID, or --no-eod"
    elif "engine='hf'" in message:
        hint = "--engine hf"
    elif not args.skip_bad and isinstance(exc, (InputError, BuildError)) \
            and re.search(r"[^\s:]+:(row )?\d+: ", message):
        hint = "--skip-bad skips and counts such records"
    else:
        return exc
    failures = getattr(exc, "failures", None)  # a collective failure carries each rank's own
    try:
        return type(exc)(f"{message} ({hint})", *(() if failures is None else (failures,)))
    except TypeError:  # an error class made otherwise (a record's reason first): its public base
        base = next(cls for cls in (InputError, ConfigError, BuildError, TokenloomError) if isinstance(exc, cls))
        return base(f"{message} ({hint})")


def run_tokenize(args: argparse.Namespace) -> int:
    """Run ``tokenloom tokenize``; returns 0 (errors raise TokenloomError for cli.main)."""
    from tokenloom.tokenization import TokenizeConfig, discover_inputs, tokenize_to_store

    if args.workers is not None and args.workers < 0:
        raise ConfigError(f"--workers {args.workers}: expected 0 or more")
    config = TokenizeConfig(
        tokenizer=args.tokenizer,
        input_format=args.input_format,
        chat_template=args.chat_template,
        assistant_prefix_tokens=args.assistant_prefix_tokens,
        text_key=args.text_key,
        column=args.column,
        lines=args.lines,
        append_eod=not args.no_eod,
        eod_id=args.eod_id,
        skip_bad=args.skip_bad,
        workers=args.workers,
        threads=args.threads,
        chunk_bytes=args.chunk_size,
        engine=args.engine,
        verify=args.verify,
    )
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under torchrun: the inputs divided over the ranks
        from tokenloom.builder import tokenize_on_ranks

        try:
            summary = tokenize_on_ranks(args.inputs, args.output, config)
        except TokenloomError as exc:
            raise _with_flag_hint(exc, args) from exc
        if int(os.environ.get("RANK", "0")) == 0:
            kept = f", {summary.parts_kept} part(s) kept from an earlier run" if summary.parts_kept else ""
            print(_format_summary(summary) + f" on {summary.ranks} ranks{kept}")
        return 0
    total_bytes = sum(f.size_bytes for f in discover_inputs(args.inputs, input_format=args.input_format))
    bar = _ProgressBar(total_bytes, disable=args.quiet or not sys.stderr.isatty())
    try:
        summary = tokenize_to_store(args.inputs, args.output, config, progress=bar)
    except TokenloomError as exc:
        raise _with_flag_hint(exc, args) from exc
    finally:
        bar.close()
    print(_format_summary(summary))
    return 0


def register(subparsers) -> None:
    """Add this group's subcommands."""
    add_tokenize_parser(subparsers)


__all__ = ["add_tokenize_parser", "register", "run_tokenize"]
