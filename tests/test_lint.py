"""ruff runs clean over the whole tree, with the rules pyproject.toml chooses (CI runs it here)."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    assert importlib.util.find_spec("ruff") is not None, "ruff is missing: bash scripts/dev-setup.sh installs it"
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise",
                             str(ROOT)], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, f"ruff check found:\n{result.stdout}{result.stderr}"
