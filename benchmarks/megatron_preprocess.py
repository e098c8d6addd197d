"""Run Megatron-LM's own JSONL -> .bin/.idx preprocessors as benchmark peers.

Written against Megatron-LM commit d98e8a64dd: `tools/preprocess_data.py` (the tokenizer called
per document in a `multiprocessing.Pool` of `--workers` processes) and
`tools/preprocess_data_fast.py` (the whole file encoded at once by gigatoken's
`encode_files`, on gigatoken's rayon thread pool, no `--workers` option).

Why the launcher: both tools import `megatron.training`, which does
`from typing import override`, new in Python 3.12; the interpreter with torch here is 3.11.
The tool therefore runs through a few lines that define `typing.override` as the identity
(a no-op on 3.12+) and then `runpy` the script, so the tool itself runs unmodified. The
checkout goes first on PYTHONPATH because the scripts only *append* it to `sys.path`, and an
installed megatron-core would otherwise shadow the checkout's `megatron.core`.

Why the staged tokenizer directory: `--tokenizer-type HuggingFaceTokenizer` loads
`--tokenizer-model` with `transformers.AutoTokenizer.from_pretrained`, which takes a directory,
not a tokenizer.json, and a bare tokenizer.json names no eos token, so the tools' EOD would be
None. The directory holds a link to the tokenizer.json and a tokenizer_config.json naming
``eod_token`` as eos. The fast tool also needs `--use-gigatoken` (without it `tokenize_files`
raises NotImplementedError).

Needs torch, transformers (5.x works), gigatoken and awkward importable by ``python``
(``pythonpath`` may add a `pip install --target` directory).

Known differences (both tools otherwise match `tokenizers`' `encode_batch_fast(...,
add_special_tokens=False)` plus one EOD per document): preprocess_data.py writes an empty
document (no EOD, no sequence) for an empty text, where preprocess_data_fast.py writes [EOD];
and preprocess_data.py waits forever when a worker process dies, hence the timeout.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

TOOLS = ("preprocess_data", "preprocess_data_fast")

_LAUNCHER = (
    "import runpy, sys, typing\n"
    "if not hasattr(typing, 'override'):\n"
    "    typing.override = lambda f: f\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_megatron_preprocess(
    tool: str,
    megatron_dir: str,
    tokenizer_json: str,
    jsonl: str,
    output_prefix: str,
    workers: int,
    *,
    python: str = sys.executable,
    pythonpath: Sequence[str] = (),
    eod_token: str = "<|endoftext|>",
    timeout_s: float | None = 3600.0,
) -> dict:
    """Run ``tools/<tool>.py`` of ``megatron_dir`` on the "text" field of ``jsonl``, appending
    EOD, and return {"wall_s", "cpu_s", "bin", "idx", "command"}.

    ``workers`` is `--workers` for preprocess_data and RAYON_NUM_THREADS (gigatoken's thread
    count) for preprocess_data_fast. ``wall_s`` and ``cpu_s`` cover the whole process,
    including the 10-15 s of importing torch and megatron that precedes any tokenizing;
    ``cpu_s`` is user+sys of the tool and the worker processes it reaps. ``command`` names a
    tokenizer directory that is removed on return.
    """
    if tool not in TOOLS:
        raise ValueError(f"tool must be one of {TOOLS}, not {tool!r}")
    megatron_dir = os.path.abspath(megatron_dir)
    output_prefix = os.path.abspath(output_prefix)
    os.makedirs(os.path.dirname(output_prefix), exist_ok=True)
    bin_path = f"{output_prefix}_text_document.bin"
    idx_path = f"{output_prefix}_text_document.idx"
    for stale in (bin_path, idx_path):  # so that a silent failure cannot pass as a result
        if os.path.exists(stale):
            os.remove(stale)

    with tempfile.TemporaryDirectory(prefix="megatron-tokenizer-") as tokenizer_dir:
        os.symlink(os.path.abspath(tokenizer_json), os.path.join(tokenizer_dir, "tokenizer.json"))
        with open(os.path.join(tokenizer_dir, "tokenizer_config.json"), "w") as f:
            json.dump({"eos_token": eod_token}, f)

        command = [
            python,
            "-c",
            _LAUNCHER,
            os.path.join(megatron_dir, "tools", f"{tool}.py"),
            "--input",
            os.path.abspath(jsonl),
            "--output-prefix",
            output_prefix,
            "--tokenizer-type",
            "HuggingFaceTokenizer",
            "--tokenizer-model",
            tokenizer_dir,
            "--append-eod",
        ]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([megatron_dir, *pythonpath, *filter(None, [env.get("PYTHONPATH")])])
        if tool == "preprocess_data":
            command += ["--workers", str(workers)]
        else:
            command += ["--use-gigatoken"]
            env["RAYON_NUM_THREADS"] = str(workers)

        with tempfile.TemporaryFile() as log:
            cpu_before = _children_cpu_s()
            start = time.perf_counter()
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            try:
                returncode = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                returncode = None
            wall_s = time.perf_counter() - start
            cpu_s = _children_cpu_s() - cpu_before
            if returncode != 0 or not (os.path.exists(bin_path) and os.path.exists(idx_path)):
                log.seek(0)
                tail = log.read().decode(errors="replace")[-4000:]
                status = f"timed out after {timeout_s} s" if returncode is None else f"exited with {returncode}"
                raise RuntimeError(f"megatron {tool} {status}; output tail:\n{tail}")

    return {"wall_s": wall_s, "cpu_s": cpu_s, "bin": bin_path, "idx": idx_path, "command": command}
