"""The README is a manual that runs: every line of it that begins with ``$ `` (continued by a
trailing backslash) runs as written, in order, in a fresh folder after ``tokenloom demo``, and
ends with status 0 and no traceback."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")


def readme_commands(text: str) -> list[str]:
    """The ``$`` lines of the README's fenced blocks, each with its continuation lines joined."""
    commands, inside, current = [], False, None
    for line in text.splitlines():
        if line.startswith("```"):
            inside, current = not inside, None
            continue
        if not inside:
            continue
        if current is not None:
            current += "\n" + line
        elif line.startswith("$ "):
            current = line[2:]
        if current is not None and not line.rstrip().endswith("\\"):
            commands.append(current)
            current = None
    return commands


def test_the_parser_finds_commands_and_their_continuations():
    text = "```\n$ a \\\n    b\nout\n$ c\n```\n$ not in a block\n```python\nx = 1\n```\n"
    assert readme_commands(text) == ["a \\\n    b", "c"]


def test_every_readme_command_runs_as_written(tmp_path):
    pytest.importorskip("torch")
    commands = readme_commands(open(README, encoding="utf-8").read())
    assert len(commands) >= 15, commands  # the tour's commands, not a parse gone wrong
    os.symlink(os.path.join(ROOT, "examples"), tmp_path / "examples")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "JAX_PLATFORMS": "cpu"}
    bin_dir = os.path.dirname(sys.executable)  # this interpreter's tokenloom, torchrun and python first
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    demo = subprocess.run([sys.executable, "-m", "tokenloom.cli", "demo", "--output", "tokenloom-demo"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert demo.returncode == 0, demo.stderr[-3000:]
    for command in commands:
        result = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True,
                                timeout=600)
        assert result.returncode == 0, f"$ {command}\nexit {result.returncode}\n{result.stderr[-3000:]}"
        assert "Traceback" not in result.stderr, f"$ {command}\n{result.stderr[-3000:]}"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return "-".join(re.sub(r"[^\w\- ]", "", heading.strip().lower()).split(" "))


def test_known_limits_are_short_and_each_links_to_its_measurement():
    text = open(README, encoding="utf-8").read()
    limits = text.split("## Known limits", 1)[1].split("\n## ", 1)[0].strip().splitlines()
    assert 0 < len(limits) <= 10
    assert all(line.startswith("- ") and "(BENCHMARKS.md#" in line for line in limits), limits


def test_links_into_benchmarks_name_sections_that_exist():
    headings = {_anchor(line.lstrip("#")) for line in open(os.path.join(ROOT, "BENCHMARKS.md"), encoding="utf-8")
                if line.startswith("#")}
    links = re.findall(r"\(BENCHMARKS\.md#([\w\-]+)\)", open(README, encoding="utf-8").read())
    assert links and set(links) <= headings, sorted(set(links) - headings)
