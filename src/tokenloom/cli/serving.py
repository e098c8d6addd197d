"""``tokenloom audit``: the realised mixture of a serving run, from its audit log. ``tokenloom
where`` / ``tokenloom find``: which documents a sample holds, and which samples hold a document
(and, given a layout, the rank and micro-batch that read it). ``tokenloom balance``: the step
imbalance of a layout over a run's first steps, with and without balanced ranks."""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from tokenloom import ConfigError


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
    p.add_argument("--plot", metavar="PNG", help="also draw each dataset's realised share over the steps against "
                   "its target, weight changes and skips marked (needs matplotlib: tokenloom[plot])")
    p.set_defaults(run=run_audit)
    return p


def run_audit(args: argparse.Namespace) -> int:
    from tokenloom.serve import by_store, read_audit_log, summarize_audit, summarize_skips

    log = read_audit_log(args.log)
    rows = summarize_audit(log)
    skips = summarize_skips(log)
    last_steps = log.records[-args.steps:] if args.steps > 0 else []
    worst = max((abs(r["drift"]) for r in rows), default=0.0)
    failed = args.max_drift is not None and worst > args.max_drift
    if args.plot:
        from tokenloom.plots import plot_mixture

        # a schedule's length runs of one store drawn as the store
        print(f"wrote the mixture plot to {plot_mixture(by_store(log), args.plot)}", file=sys.stderr)
    if args.json:
        print(json.dumps({"log": args.log, "build_key": log.header["build_key"], "steps": len(log.records),
                          "datasets": rows, "last_steps": last_steps, "max_abs_final_drift": worst,
                          "skipped": skips}))
        return 1 if failed else 0
    print(f"{args.log}: build {log.header['build_key'][:16]}  steps {len(log.records)}  "
          f"seq_length {log.header['seq_length']}")
    budgets = any("budget_tokens" in r for r in rows)
    headers = ["dataset", "target", "tokens", "realised", "drift", "max abs drift"]
    headers += ["budget tokens", "of budget"] if budgets else []
    table = []
    for r in rows:
        cells = [str(r["dataset"]), f"{r['target']:.4f}", f"{r['tokens']:,}", f"{r['realised']:.4f}",
                 f"{r['drift'] if abs(r['drift']) >= 5e-5 else 0.0:+.4f}", f"{r['max_abs_drift']:.4f}"]
        if budgets:
            used = "" if r.get("budget_used") is None else f"{100 * r['budget_used']:.1f}%"
            cells += [f"{r['budget_tokens'] or 0:,}", used]
        table.append(cells)
    print(markdown_table(headers, table, right=range(1, len(headers))))
    if skips["skipped_samples"]:
        steps = skips["steps"]
        print(f"skipped {skips['skipped_samples']:,} samples in {len(skips['ranges'])} range(s), jumped before "
              f"step(s) {', '.join(str(s) for s in steps[:10])}{' ...' if len(steps) > 10 else ''}")
    for record in last_steps:
        print(f"step {record['step']:>6}  consumed {record['consumed_samples']:>10,}  "
              f"batch {record['global_batch_size']:>5}"
              f"  fingerprint {record['fingerprint']}")
    if failed:
        print(f"drift {worst:.4f} exceeds --max-drift {args.max_drift}")
    return 1 if failed else 0


def markdown_table(headers: list[str], rows: list[list[str]], *, right=()) -> str:
    """A Markdown table whose columns line up in a terminal too: every cell padded to its column's
    width, the columns in ``right`` right-aligned (numbers)."""
    right = set(right)
    widths = [max([len(h)] + [len(row[i]) for row in rows]) for i, h in enumerate(headers)]

    def line(cells):
        return "| " + " | ".join(c.rjust(w) if i in right else c.ljust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths))) + " |"

    rule = "|" + "|".join("-" * (w + 1) + ":" if i in right else "-" * (w + 2) for i, w in enumerate(widths)) + "|"
    return "\n".join([line(headers), rule, *(line(row) for row in rows)])


def _open_split(config: str, split: str):
    import tokenloom

    result = tokenloom.build(config)
    if result.built_keys:
        print(f"(built {len(result.built_keys)} missing item(s) into the cache first)", file=sys.stderr)
    return result.split(split)


def _positions(args: argparse.Namespace) -> np.ndarray:
    if args.positions is not None:
        text = args.positions
        try:
            if ":" in text:
                first, last = (int(v) for v in text.split(":", 1))
            else:
                first = int(text)
                last = first + 1
        except ValueError:
            raise ConfigError(f"--positions {text!r}; expected A:B (positions A to B-1) or one position") from None
        if first < 0 or last <= first:
            raise ConfigError(f"--positions {text!r}; expected 0 <= A < B")
        return np.arange(first, last, dtype=np.int64)
    if args.step is None or args.global_batch_size is None:
        raise ConfigError("give --positions A:B, or --step S with --global-batch-size G")
    if args.step < 0 or args.global_batch_size < 1:
        raise ConfigError(f"--step {args.step} --global-batch-size {args.global_batch_size}; expected S >= 0, G >= 1")
    return np.arange(args.step * args.global_batch_size, (args.step + 1) * args.global_batch_size, dtype=np.int64)


def _decoder(store):
    """A function from token ids to text, from the store's tokenizer record."""
    record = (store.metadata or {}).get("tokenizer") or {}
    kind = record.get("kind")
    if kind == "bytes":
        eod = record.get("eod_id")

        def decode_bytes(ids) -> str:  # UTF-8 bytes; each end of document shown as <|eod|>
            parts, run = [], bytearray()
            for token in (int(t) for t in ids):
                if token == eod:
                    parts += [run.decode("utf-8", errors="replace"), "<|eod|>"]
                    run = bytearray()
                elif token < 256:
                    run.append(token)
            return "".join(parts) + run.decode("utf-8", errors="replace")

        return decode_bytes
    if kind == "huggingface" and record.get("path") and os.path.isfile(record["path"]):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ConfigError("--text with a HuggingFace tokenizer needs the 'tokenizers' library "
                              "(pip install 'tokenloom[tokenizers]')") from None
        tokenizer = Tokenizer.from_file(record["path"])
        return lambda ids: tokenizer.decode([int(t) for t in ids], skip_special_tokens=False)
    raise ConfigError(f"{store.prefix}: --text needs a tokenizer to decode with; the store records "
                      f"{kind or 'none'}{' at ' + record['path'] + ' (missing)' if record.get('path') else ''}")


def _document_boundaries(source, located: tuple[np.ndarray, np.ndarray]) -> list[dict]:
    """Each sample's ``cu_seqlens`` (without megatron-core's padding) and ``max_seqlen``, as the
    loaders serve them with ``inter_document_masking``, for ``located`` ``(dataset_ids,
    sample_ids)``; read a sequence length at a time (a schedule's phases may have their own)."""
    from tokenloom.serve import BatchPipeline, SampleOptions

    pipeline = BatchPipeline(source, options=SampleOptions(inter_document_masking=True),
                             fields=("cu_seqlens", "max_seqlen"))
    dataset_ids, sample_ids = located
    widths = np.asarray(getattr(source, "seq_lengths", np.full(len(source.datasets), source.seq_length)))[dataset_ids]
    out: list[dict] = [{} for _ in range(dataset_ids.shape[0])]
    for width in np.unique(widths).tolist():
        rows = np.flatnonzero(widths == width)
        fields = pipeline.read(dataset_ids[rows], sample_ids[rows])
        for row, cu, longest in zip(rows.tolist(), fields["cu_seqlens"], fields["max_seqlen"]):
            documents = int(np.argmax(cu == width))  # the first S closes the last document
            out[row] = {"cu_seqlens": [int(c) for c in cu[:documents + 1]], "max_seqlen": int(longest)}
    return out


def _load_state(path: str) -> dict:
    """A serving state saved as JSON, or by ``torch.save`` (``state_dict()`` as the README saves it)."""
    if not os.path.isfile(path):
        raise ConfigError(f"--state {path}: no such file; expected a serving state (state_dict() saved as JSON "
                          "or with torch.save)")
    if path.endswith(".json"):
        try:
            with open(path, encoding="utf-8") as f:
                return json.load(f)
        except ValueError as exc:
            raise ConfigError(f"--state {path}: not JSON ({exc}); expected a serving state") from None
    try:
        import torch
    except ImportError:
        raise ConfigError(f"--state {path}: not a .json file, and reading a torch.save file needs torch "
                          "(pip install torch), or save the state as JSON") from None
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a file torch cannot read, whatever the reason, is the user's file
        raise ConfigError(f"--state {path}: torch.load cannot read it ({exc}); expected a serving state") from None


def _stream(source, path: str | None):
    from tokenloom.serve import stream_from_state

    return None if path is None else stream_from_state(source, _load_state(path))


def _weights_line(source, weights) -> str:
    top = sorted(range(len(weights)), key=lambda d: -weights[d])[:8]
    shown = ", ".join(f"{_as_typed(source.datasets[d].name)} {weights[d]:.4f}" for d in top)
    return shown + (f" (and {len(weights) - 8} more)" if len(weights) > 8 else "")


def _as_typed(prefix: str) -> str:
    """A store as a user here would type it: relative to the current directory when it lies below
    it, else as it is (an absolute path, an object-store URL). ``--json`` keeps the full path."""
    if "://" in prefix or not os.path.isabs(prefix):
        return prefix
    relative = os.path.relpath(prefix)
    return prefix if relative == ".." or relative.startswith(".." + os.sep) else relative


def run_where(args: argparse.Namespace) -> int:
    source = _open_split(args.config, args.split)
    positions = _positions(args)
    stream = _stream(source, args.state)
    served = source if stream is None else stream  # where and locate as the run served the positions
    origins = served.where(positions)
    records = [origin.to_dict() for origin in origins]
    if args.boundaries:
        for record, boundaries in zip(records, _document_boundaries(source, served.locate(positions))):
            record.update(boundaries)
    for record, slot in zip(records, _slots(args, source, stream, positions)):
        record.update(slot)
    if stream is not None:  # the weights in force at each position, as the run served it
        for record in records:
            record["weights"] = [float(w) for w in stream.target_weights(record["position"])]
    if args.text:
        decoders: dict[int, object] = {}
        for origin, record in zip(origins, records):
            reader = source.readers[origin.dataset]
            if origin.dataset not in decoders:
                decoders[origin.dataset] = _decoder(reader.store)
            tokens = np.concatenate([reader.store.get(p.document, offset=p.offset, length=p.length)
                                     for p in origin.pieces] or [np.zeros(0, dtype=np.int64)])
            record["text"] = decoders[origin.dataset](tokens)
    if args.json:
        print(json.dumps(records))
        return 0
    shown = None
    for record in records:
        if stream is not None and record["weights"] != shown:
            shown = record["weights"]
            print(f"weights in force from position {record['position']}: {_weights_line(source, shown)}")
        placed = f"  step {record['step']} rank {record['dp_rank']} micro-batch {record['micro_batch']}" \
            if "step" in record else ""
        print(f"position {record['position']}  dataset {record['dataset']} ({_as_typed(record['prefix'])})  "
              f"sample {record['sample']}{placed}")
        for piece in record["pieces"]:
            print(f"  document {piece['document']:>10}  tokens {piece['offset']}..{piece['offset'] + piece['length']}"
                  f" ({piece['length']})")
        if args.boundaries:
            print(f"  cu_seqlens {' '.join(str(c) for c in record['cu_seqlens'])}  max_seqlen {record['max_seqlen']}")
        if args.text:
            print("  text: " + json.dumps(record["text"]))
    return 0


def run_find(args: argparse.Namespace) -> int:
    from tokenloom.source import steps_of

    source = _open_split(args.config, args.split)
    stream = _stream(source, args.state)
    positions = source.find(args.store, args.document) if stream is None else \
        stream.positions_holding(args.store, args.document)
    out: dict = {"positions": [int(p) for p in positions]}
    if args.global_batch_size is not None:
        out["steps"] = [int(s) for s in steps_of(positions, args.global_batch_size)]
    slots = _slots(args, source, stream, positions)
    if slots:
        out["slots"] = [{k: v for k, v in slot.items() if k != "step"} for slot in slots]
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"document {args.document} of {args.store}: {len(positions)} position(s) of the {args.split} split")
    if positions.shape[0]:
        print("positions: " + " ".join(str(p) for p in out["positions"]))
    if "steps" in out:
        print(f"steps (global batch size {args.global_batch_size}): " + " ".join(str(s) for s in out["steps"]))
    if slots:
        print(f"rank/micro-batch (dp {args.dp}, micro-batch size {args.micro_batch_size}"
              f"{', balance ' + args.balance if args.balance else ''}): "
              + " ".join(f"{slot['dp_rank']}/{slot['micro_batch']}" for slot in slots))
    return 0


def _geometry(args: argparse.Namespace):
    """The layout of ``--dp``, ``--micro-batch-size``, ``--global-batch-size`` and ``--balance``."""
    from tokenloom.index import CostModel
    from tokenloom.serve import BatchGeometry

    if args.global_batch_size is None:
        raise ConfigError("--dp needs --global-batch-size G (the step a position belongs to)")
    cost = None
    if args.balance == "attention" and getattr(args, "hidden_size", None) is not None:
        cost = CostModel.for_width(args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
                                   kv_channels_total=args.kv_channels_total, gated=args.swiglu)
    return BatchGeometry(global_batch_size=args.global_batch_size, micro_batch_size=args.micro_batch_size,
                         dp=args.dp, balance=args.balance, balance_cost=cost)


def _slots(args: argparse.Namespace, source, stream, positions) -> list[dict]:
    """Each position's step, data-parallel rank and micro-batch under ``--dp`` (none without it)."""
    from tokenloom.serve import slots_of

    if args.dp is None:
        if args.balance is not None:
            raise ConfigError("--balance needs --dp N (and --global-batch-size, --micro-batch-size): the layout "
                              "the samples are placed on")
        return []
    return [{"step": slot.step, "dp_rank": slot.dp_rank, "micro_batch": slot.micro_batch}
            for slot in slots_of(source if stream is None else stream, _geometry(args), positions)]


def run_balance(args: argparse.Namespace) -> int:
    from tokenloom.serve import balance_report

    if args.balance is None:
        args.balance = "attention"
    source = _open_split(args.config, args.split)
    stream = _stream(source, args.state)
    report = balance_report(source if stream is None else stream, _geometry(args), num_steps=args.steps,
                            first_step=args.first_step)
    summary = report.summary()
    if args.json:
        print(json.dumps(summary))
        return 0
    if not summary["steps"]:
        print(f"no whole step of {args.global_batch_size} samples from step {args.first_step} in the {args.split} "
              "split")
        return 0
    print(f"{summary['steps']} step(s) from step {args.first_step}, dp {args.dp}, micro-batch size "
          f"{args.micro_batch_size}, global batch {args.global_batch_size}, cost: {args.balance}")
    rows = [[name, f"{summary[key]['mean']:.3f}", f"{summary[key]['max']:.3f}"]
            for name, key in (("Megatron's order", "unbalanced"), ("balanced", "balanced"),
                              ("lower bound (costliest sample / mean rank)", "bound"))]
    print(markdown_table(["largest rank cost / mean", "mean over steps", "worst step"], rows, right=(1, 2)))
    return 0


def register(subparsers) -> None:
    """Add this group's subcommands."""
    add_audit_parser(subparsers)
    p = subparsers.add_parser(
        "where", help="the dataset, store and document pieces of samples, by position or step (no replay)",
        description="For samples of a built split (positions A:B, or one optimizer step's global batch), print "
        "the global position, dataset, store and the document pieces (document id, first token, tokens) each "
        "sample holds, in served order; read from the build's arrays (exact) or closed forms (stateless), at "
        "the same cost for any position.")
    p.add_argument("config", metavar="CONFIG", help="build config (YAML/JSON) of a built cache")
    p.add_argument("--split", default="train", choices=("train", "valid", "test"))
    p.add_argument("--positions", metavar="A:B", help="global positions A..B-1 (or one position)")
    p.add_argument("--step", type=int, metavar="S", help="0-based optimizer step (with --global-batch-size)")
    p.add_argument("--global-batch-size", type=int, metavar="G")
    p.add_argument("--text", action="store_true", help="also decode each sample's tokens (needs a tokenizer record)")
    p.add_argument("--state", metavar="STATE", help="a run's serving state (JSON, or saved by torch.save): positions "
                   "as that run serves them, after its weight changes (online mixing too), skipped steps and "
                   "quarantines, with the weights in force at each")
    p.add_argument("--inter-document-masking", dest="boundaries", action="store_true",
                   help="also print each sample's document boundaries as served with inter_document_masking: "
                   "cu_seqlens (without the padding to seq_length + 1) and max_seqlen")
    p.add_argument("--json", action="store_true", help="print a JSON list of {position, dataset, prefix, sample, "
                   "pieces: [{document, offset, length}]} (and cu_seqlens, max_seqlen; step, dp_rank, micro_batch)")
    _add_layout(p)
    p.set_defaults(run=run_where)
    p = subparsers.add_parser(
        "find", help="every global position (and step) whose sample holds a piece of one document",
        description="Every global position of a built split whose sample holds tokens of document D of store "
        "PREFIX, ascending (and the optimizer steps that serve them, given the global batch size): one pass over "
        "memory-mapped arrays in exact mode, inverted permutations in stateless mode.")
    p.add_argument("config", metavar="CONFIG", help="build config (YAML/JSON) of a built cache")
    p.add_argument("--split", default="train", choices=("train", "valid", "test"))
    p.add_argument("--store", required=True, metavar="PREFIX", help="the store, as the build config names it")
    p.add_argument("--document", required=True, type=int, metavar="D", help="document id within the store")
    p.add_argument("--global-batch-size", type=int, metavar="G", help="also list the 0-based steps")
    p.add_argument("--state", metavar="STATE", help="a run's serving state (JSON, or saved by torch.save): the "
                   "positions that run serves the document at, after its weight changes, skips and quarantines")
    p.add_argument("--json", action="store_true", help='print {"positions": [...]} (and "steps", "slots")')
    _add_layout(p)
    p.set_defaults(run=run_find)
    p = subparsers.add_parser(
        "balance", help="how uneven a layout's ranks are over a run's first steps, with and without balancing",
        description="For a built split and a layout (--dp, --micro-batch-size, --global-batch-size), each step's "
        "largest rank cost over the mean rank cost, in Megatron's order and with the samples placed by cost "
        "(BatchGeometry(balance=...)), and the lower bound (the costliest sample over the mean rank cost). The "
        "cost is the attention and dense FLOPs of the documents as served with inter_document_masking (model "
        "width --hidden-size, default 4096), or the real tokens (--balance tokens); read from the index alone.")
    p.add_argument("config", metavar="CONFIG", help="build config (YAML/JSON) of a built cache")
    p.add_argument("--split", default="train", choices=("train", "valid", "test"))
    p.add_argument("--global-batch-size", type=int, required=True, metavar="G")
    p.add_argument("--steps", type=int, default=100, metavar="N", help="steps to report (default 100)")
    p.add_argument("--first-step", type=int, default=0, metavar="S", help="the first (default 0)")
    p.add_argument("--state", metavar="STATE", help="a run's serving state: its steps as that run serves them")
    p.add_argument("--hidden-size", type=int, metavar="D", help="model width of the cost (default 4096)")
    p.add_argument("--ffn-hidden-size", type=int, metavar="F", help="MLP inner width (default 4D)")
    p.add_argument("--kv-channels-total", type=int, metavar="K", help="key/value heads x head width (default D)")
    p.add_argument("--swiglu", action="store_true", help="gated MLP (three matrices)")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    _add_layout(p, required=True)
    p.set_defaults(run=run_balance)


def _add_layout(p: argparse.ArgumentParser, *, required: bool = False) -> None:
    p.add_argument("--dp", type=int, metavar="N", required=required,
                   help="data-parallel size: also say which rank and micro-batch reads each position")
    p.add_argument("--micro-batch-size", type=int, default=1, metavar="M", help="samples per micro-batch (default 1)")
    p.add_argument("--balance", choices=("attention", "tokens"),
                   help="the run places each step's samples by cost (BatchGeometry(balance=...))")
