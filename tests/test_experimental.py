"""tokenloom.experimental: its names load on first use, and a missing extra is named."""

from __future__ import annotations

import subprocess
import sys

import tokenloom.experimental as experimental
from tokenloom.serve.simulate import JobReport, simulate_job


def test_the_names_are_the_modules_own():
    assert experimental.simulate_job is simulate_job and experimental.JobReport is JobReport


def test_grain_source_without_grain_names_the_extra_to_install():
    code = ("import sys; sys.modules['grain'] = None\n"
            "try:\n"
            "    from tokenloom.experimental import GrainSource\n"
            "except ImportError as exc:\n"
            "    print(type(exc).__name__, exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == ('ImportError tokenloom.experimental.GrainSource needs grain: '
                                  'pip install "tokenloom[grain]"'), out.stdout + out.stderr
