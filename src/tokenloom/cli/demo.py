"""``tokenloom demo``: the main job end to end on built-in data (:mod:`tokenloom.examples.demo`)."""

from __future__ import annotations


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "demo",
        help="the main job end to end on text every Python installation has",
        description="Tokenize the standard library's sources and pydoc topics into token stores, "
        "then run the later stages on them, printing what each produced.",
    )
    p.add_argument("--output", "-o", default="tokenloom-demo", metavar="DIR",
                   help="where to write (default: %(default)s)")
    p.add_argument("--workers", type=int, default=None, help="tokenizer worker processes (default: one per core)")
    p.set_defaults(run=run_demo_command)


def run_demo_command(args) -> int:
    from tokenloom.examples import run_demo

    run_demo(args.output, workers=args.workers)
    return 0


__all__ = ["register", "run_demo_command"]
