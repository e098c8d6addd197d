"""The ``tokenloom`` command line: plan -> tokenize -> build -> serve.

This module is the only place that knows flag names. Library errors (TokenloomError) become
one line on stderr and exit code 2; Ctrl-C exits 130.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from tokenloom import __version__
from tokenloom._cli_build import add_build_parser, add_cache_parser
from tokenloom._cli_plan import add_plan_parser
from tokenloom._cli_serve import add_audit_parser
from tokenloom._cli_tokenize import add_tokenize_parser
from tokenloom.errors import TokenloomError



# -- inspect ---------------------------------------------------------------------------------------
def _add_inspect(subparsers) -> None:
    p = subparsers.add_parser(
        "inspect",
        help="counts, statistics and a consistency check of token stores",
        description="Open each token store, check its arrays against each other and the .bin "
        "size, and print counts, dtype and document-length statistics.",
    )
    p.add_argument("prefixes", nargs="+", metavar="PREFIX", help="store path without .bin/.idx")
    p.add_argument("--json", action="store_true", help="print one JSON object per store")
    p.add_argument(
        "--scan-tokens",
        action="store_true",
        help="also read every token: min/max id, EOD count, ids outside the recorded vocabulary",
    )
    p.set_defaults(run=_run_inspect)


def _format_report(report) -> str:
    lines = [f"{report.prefix}"]
    lines.append(
        f"  dtype {report.dtype}   sequences {report.num_sequences:,}   documents "
        f"{report.num_documents:,}   tokens {report.num_tokens:,}"
    )
    lines.append(f"  files  .idx {report.idx_bytes:,} B   .bin {report.bin_bytes:,} B")
    s = report.document_lengths
    if s is not None:
        lines.append(
            f"  document length  min {s.min:,}  mean {s.mean:,.1f}  p50 {s.p50:,.0f}  "
            f"p90 {s.p90:,.0f}  p99 {s.p99:,.0f}  max {s.max:,}   empty {report.empty_documents:,}"
        )
    tokenizer = (report.metadata or {}).get("tokenizer")
    if tokenizer:
        lines.append(
            "  tokenizer  " + "  ".join(f"{k} {tokenizer[k]}" for k in ("kind", "name", "vocab_size", "eod_id") if k in tokenizer)
        )
    if report.token_scan:
        t = report.token_scan
        lines.append(
            "  token ids  " + "  ".join(f"{k} {v}" for k, v in t.items() if v is not None)
        )
    lines.append("  consistent: yes" if report.consistent else f"  consistent: NO - {report.problem}")
    return "\n".join(lines)


def _run_inspect(args) -> int:
    from tokenloom.io import inspect_store

    reports = [inspect_store(p, scan_tokens=args.scan_tokens) for p in args.prefixes]
    for report in reports:
        if args.json:
            print(json.dumps(report.to_dict(), sort_keys=True))
        else:
            print(_format_report(report))
    return 0 if all(r.consistent for r in reports) else 1


# -- merge -----------------------------------------------------------------------------------------
def _add_merge(subparsers) -> None:
    p = subparsers.add_parser(
        "merge",
        help="concatenate token stores into one",
        description="Concatenate token stores (same dtype and tokenizer) into one, copying tokens as bytes.",
    )
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="input store prefixes, in order")
    p.add_argument("--output", "-o", required=True, metavar="PREFIX", help="output store prefix")
    p.set_defaults(run=_run_merge)


def _run_merge(args) -> int:
    from tokenloom.io import merge_stores

    merged = merge_stores(args.inputs, args.output)
    print(f"{merged.prefix}: {merged.num_documents:,} documents, {merged.num_tokens:,} tokens")
    return 0


# -- demo ------------------------------------------------------------------------------------------
def _add_demo(subparsers) -> None:
    p = subparsers.add_parser(
        "demo",
        help="the main job end to end on text every Python installation has",
        description="Tokenize the standard library's sources and pydoc topics into token stores, "
        "then run the later stages on them, printing what each produced.",
    )
    p.add_argument("--output", "-o", default="tokenloom-demo", metavar="DIR", help="where to write (default: %(default)s)")
    p.add_argument("--workers", type=int, default=None, help="tokenizer worker processes (default: one per core)")
    p.set_defaults(run=_run_demo)


def _run_demo(args) -> int:
    from tokenloom.demo import run_demo

    run_demo(args.output, workers=args.workers)
    return 0


# -- the parser ------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenloom",
        description="The data layer of LLM pretraining: plan -> tokenize -> build -> serve.",
    )
    parser.add_argument("--version", action="version", version=f"tokenloom {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in _SUBCOMMANDS:
        add(subparsers)
    return parser


_SUBCOMMANDS = [
    add_plan_parser,
    add_tokenize_parser,
    _add_inspect,
    _add_merge,
    add_build_parser,
    add_cache_parser,
    add_audit_parser,
    _add_demo,
]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.run(args) or 0)
    except TokenloomError as exc:
        print(f"tokenloom {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"tokenloom {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
