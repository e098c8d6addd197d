"""Every way of starting the command line runs the same parser, with every command group."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

import tokenloom
from tokenloom.cli import build_parser

COMMANDS = {"plan", "tokenize", "inspect", "merge", "build", "cache", "audit", "where", "find", "balance",
            "demo"}


def test_the_parser_has_every_command():
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command")
    assert set(subparsers.choices) == COMMANDS


@pytest.mark.parametrize("argv", [["-m", "tokenloom"], ["-m", "tokenloom.cli"],
                                  [str(pathlib.Path(tokenloom.__file__).parent / "cli" / "__main__.py")]],
                         ids=["python -m tokenloom", "python -m tokenloom.cli", "the file as a script"])
def test_each_entry_point_runs_the_cli(argv):
    help_text = subprocess.run([sys.executable, *argv, "--help"], capture_output=True, text=True, check=True).stdout
    assert all(command in help_text for command in COMMANDS)
    version = subprocess.run([sys.executable, *argv, "--version"], capture_output=True, text=True, check=True)
    assert version.stdout.strip() == f"tokenloom {tokenloom.__version__}"


def test_a_library_error_is_one_line_and_exit_2(tmp_path):
    result = subprocess.run([sys.executable, "-m", "tokenloom", "inspect", str(tmp_path / "missing")],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.startswith("tokenloom inspect: error: ") and result.stderr.count("\n") == 1
