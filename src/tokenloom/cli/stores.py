"""``tokenloom inspect`` and ``tokenloom merge``: the command-line side of :mod:`tokenloom.io`."""

from __future__ import annotations

import json


def add_inspect_parser(subparsers) -> None:
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
    p.set_defaults(run=run_inspect)


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
            "  tokenizer  "
            + "  ".join(f"{k} {tokenizer[k]}" for k in ("kind", "name", "vocab_size", "eod_id") if k in tokenizer)
        )
    mask = (report.metadata or {}).get("loss_mask")
    if isinstance(mask, dict) and isinstance(mask.get("num_tokens"), int):
        outside = mask.get("tokens_outside_loss", 0)
        share = 100 * outside / mask["num_tokens"] if mask["num_tokens"] else 0.0
        lines.append(f"  loss mask  {mask.get('file')} {mask.get('bytes', 0):,} B   tokens outside the loss "
                     f"{outside:,} ({share:.1f}%)")
    if report.token_scan:
        t = report.token_scan
        lines.append(
            "  token ids  " + "  ".join(f"{k} {v}" for k, v in t.items() if v is not None)
        )
    lines.append("  consistent: yes" if report.consistent else f"  consistent: NO - {report.problem}")
    return "\n".join(lines)


def run_inspect(args) -> int:
    from tokenloom.io import inspect_store

    reports = [inspect_store(p, scan_tokens=args.scan_tokens) for p in args.prefixes]
    for report in reports:
        if args.json:
            print(json.dumps(report.to_dict(), sort_keys=True))
        else:
            print(_format_report(report))
    return 0 if all(r.consistent for r in reports) else 1



def add_merge_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "merge",
        help="concatenate token stores into one",
        description="Concatenate token stores (same dtype and tokenizer) into one, copying tokens as bytes; "
                    "loss masks (PREFIX.mask) come along, all ones for an input without one.",
    )
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="input store prefixes, in order")
    p.add_argument("--output", "-o", required=True, metavar="PREFIX", help="output store prefix")
    p.set_defaults(run=run_merge)


def run_merge(args) -> int:
    from tokenloom.io import merge_stores

    merged = merge_stores(args.inputs, args.output)
    print(f"{merged.prefix}: {merged.num_documents:,} documents, {merged.num_tokens:,} tokens")
    return 0


def register(subparsers) -> None:
    """Add ``inspect`` and ``merge``."""
    add_inspect_parser(subparsers)
    add_merge_parser(subparsers)


__all__ = ["add_inspect_parser", "add_merge_parser", "register", "run_inspect", "run_merge"]
