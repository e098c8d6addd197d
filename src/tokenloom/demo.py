"""The main job on built-in data: text every Python installation has -> token stores -> report.

Three corpora come from the running interpreter, so the demo needs no download:

* ``stdlib-code``: the standard library's modules (one document per ``.py`` file, tests excluded);
* ``stdlib-tests``: its test suite (one document per file under ``test/``);
* ``pydoc-topics``: the language reference topics of ``pydoc_data`` (one document per topic).

Each is tokenized with the built-in byte tokenizer into its own store under ``OUTPUT/stores``.
"""

from __future__ import annotations

import json
import logging
import os
import sysconfig
from dataclasses import dataclass

from tokenloom.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class DemoCorpus:
    """One built-in corpus: a name and the files that hold its documents."""

    name: str
    inputs: tuple[str, ...]
    """Files to tokenize (text: one document per file; JSONL: one per line)."""


def _stdlib_files(*, tests: bool) -> list[str]:
    """The standard library's ``.py`` files: its test package if ``tests``, else everything else."""
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in ("site-packages", "dist-packages", "__pycache__"))
        in_test_package = os.path.relpath(directory, root).split(os.sep)[0] == "test"
        if in_test_package == tests:
            found.extend(os.path.join(directory, f) for f in sorted(files) if f.endswith(".py"))
    return found


def collect_corpora(raw_dir: str) -> list[DemoCorpus]:
    """Find the built-in text and write what needs writing (pydoc topics as JSONL) to ``raw_dir``."""
    from pydoc_data.topics import topics

    os.makedirs(raw_dir, exist_ok=True)
    topics_path = os.path.join(raw_dir, "pydoc-topics.jsonl")
    with open(topics_path, "w", encoding="utf-8") as f:
        for name in sorted(topics):
            f.write(json.dumps({"topic": name, "text": topics[name]}) + "\n")
    corpora = [
        DemoCorpus(name="stdlib-code", inputs=tuple(_stdlib_files(tests=False))),
        DemoCorpus(name="stdlib-tests", inputs=tuple(_stdlib_files(tests=True))),
        DemoCorpus(name="pydoc-topics", inputs=(topics_path,)),
    ]
    for corpus in corpora:
        if not corpus.inputs:
            raise ConfigError(
                f"built-in corpus {corpus.name!r} found no files under {sysconfig.get_paths()['stdlib']}; "
                "this Python installation ships without its standard library sources"
            )
    return corpora


@dataclass(frozen=True, kw_only=True)
class DemoStore:
    """A corpus tokenized into a store."""

    name: str
    prefix: str
    num_documents: int
    num_tokens: int


def tokenize_corpora(output_dir: str, *, workers: int | None = None, echo=print) -> list[DemoStore]:
    """Stage 1: built-in text -> one byte-tokenized store per corpus, each validated."""
    from tokenloom.io import inspect_store
    from tokenloom.tokenize import TokenizeConfig, tokenize_to_store

    corpora = collect_corpora(os.path.join(output_dir, "raw"))
    store_dir = os.path.join(output_dir, "stores")
    os.makedirs(store_dir, exist_ok=True)
    stores = []
    for corpus in corpora:
        # The standard library's tests include files that are deliberately not UTF-8: skip, count.
        config = TokenizeConfig(tokenizer="bytes", workers=workers, skip_bad=True)
        summary = tokenize_to_store(list(corpus.inputs), os.path.join(store_dir, corpus.name), config)
        report = inspect_store(summary.prefix)
        if not report.consistent:  # a store we just wrote must validate; anything else is a bug
            raise ConfigError(f"{summary.prefix}: freshly written store failed validation: {report.problem}")
        echo(
            f"  {corpus.name:<14} {summary.num_files:>5} files  {summary.num_documents:>6,} documents  "
            f"{summary.num_tokens:>12,} tokens  {summary.num_skipped:>3} skipped  "
            f"({summary.tokens_per_s / 1e6:.1f} M tokens/s)"
        )
        stores.append(
            DemoStore(name=corpus.name, prefix=summary.prefix, num_documents=summary.num_documents,
                      num_tokens=summary.num_tokens)
        )
    return stores


def run_demo(output_dir: str, *, workers: int | None = None, echo=print) -> list[DemoStore]:
    """Run the main job end to end into ``output_dir``; returns what each stage produced."""
    echo(f"tokenize: built-in text -> token stores under {os.path.join(output_dir, 'stores')}")
    stores = tokenize_corpora(output_dir, workers=workers, echo=echo)
    return stores
