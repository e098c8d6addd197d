"""The ``tokenloom`` command line: plan -> tokenize -> build -> serve.

One module per command group, each with a ``register(subparsers)`` that adds its subcommands;
they are the only places that know flag names. Library errors (TokenloomError) become one line on
stderr and exit code 2; Ctrl-C exits 130. ``tokenloom``, ``python -m tokenloom`` and
``python -m tokenloom.cli`` all run :func:`main`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import tokenloom
from tokenloom.cli import builder, demo, planning, serving, stores, tokenization

#: Command groups in the order ``--help`` lists them (the flow: plan -> tokenize -> build -> serve).
_COMMAND_GROUPS = (planning, tokenization, stores, builder, serving, demo)


def build_parser() -> argparse.ArgumentParser:
    """The ``tokenloom`` parser with every command group's subcommands."""
    parser = argparse.ArgumentParser(
        prog="tokenloom",
        description="The data layer of LLM pretraining: plan -> tokenize -> build -> serve.",
    )
    parser.add_argument("--version", action="version", version=f"tokenloom {tokenloom.__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for group in _COMMAND_GROUPS:
        group.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        status = int(args.run(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, inside the handler below, not at exit
        return status
    except BrokenPipeError:
        # the reader went away (`tokenloom where ... | head`): stop quietly, as Unix tools do; the
        # output still buffered goes to /dev/null so that exit does not fail on it again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except tokenloom.TokenloomError as exc:
        print(f"tokenloom {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"tokenloom {args.command}: interrupted", file=sys.stderr)
        return 130


__all__ = ["build_parser", "main"]
