"""``tokenloom audit``: the realised mixture of a serving run, from its audit log."""

from __future__ import annotations

import argparse
import json


def add_audit_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "audit",
        help="realised tokens per dataset and drift from the target mixture, from a serving audit log",
        description="Read an audit log written by tokenloom.serve.MixtureAudit (one JSON line per optimizer "
        "step) and print, per dataset, the target weight, the tokens served, the realised share and its "
        "drift from the target, plus the last steps' global-batch fingerprints.",
    )
    p.add_argument("log", metavar="LOG", help="audit log (JSON lines)")
    p.add_argument("--steps", type=int, default=3, metavar="N", help="also list the last N steps (default 3)")
    p.add_argument("--max-drift", type=float, default=None, metavar="X",
                   help="exit with status 1 when a dataset's final |drift| exceeds X (a share, e.g. 0.01)")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.set_defaults(run=run_audit)
    return p


def run_audit(args: argparse.Namespace) -> int:
    from tokenloom.serve.audit import read_audit_log, summarize_audit

    log = read_audit_log(args.log)
    rows = summarize_audit(log)
    last_steps = log.records[-args.steps:] if args.steps > 0 else []
    worst = max((abs(r["drift"]) for r in rows), default=0.0)
    failed = args.max_drift is not None and worst > args.max_drift
    if args.json:
        print(json.dumps({"log": args.log, "build_key": log.header["build_key"], "steps": len(log.records),
                          "datasets": rows, "last_steps": last_steps, "max_abs_final_drift": worst}))
        return 1 if failed else 0
    print(f"{args.log}: build {log.header['build_key'][:16]}  steps {len(log.records)}  "
          f"seq_length {log.header['seq_length']}")
    width = max([len("dataset")] + [len(str(r["dataset"])) for r in rows])
    print(f"| {'dataset':<{width}} | target | tokens | realised | drift | max abs drift |")
    print(f"|{'-' * (width + 2)}|-------:|-------:|---------:|------:|--------------:|")
    for r in rows:
        print(f"| {r['dataset']:<{width}} | {r['target']:.4f} | {r['tokens']:,} | {r['realised']:.4f} | "
              f"{r['drift']:+.4f} | {r['max_abs_drift']:.4f} |")
    for record in last_steps:
        print(f"step {record['step']:>6}  consumed {record['consumed_samples']:>10,}  "
              f"batch {record['global_batch_size']:>5}"
              f"  fingerprint {record['fingerprint']}")
    if failed:
        print(f"drift {worst:.4f} exceeds --max-drift {args.max_drift}")
    return 1 if failed else 0


def register(subparsers) -> None:
    """Add this group's subcommands."""
    add_audit_parser(subparsers)
