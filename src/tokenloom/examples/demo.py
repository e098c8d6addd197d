"""The main job on built-in data: text every Python installation has -> stores -> build -> serve.

Three corpora come from the running interpreter, so the demo needs no download:

* ``stdlib-code``: the standard library's modules (one document per ``.py`` file, tests excluded);
* ``stdlib-tests``: its test suite (one document per file under ``test/``);
* ``pydoc-topics``: the language reference topics of ``pydoc_data`` (one document per topic).

Each is tokenized with the built-in byte tokenizer into its own store under ``OUTPUT/stores``;
a 50/30/20 blend of them is built on two gloo ranks (``OUTPUT/build.yaml``, ``OUTPUT/cache``)
and served to every rank of a dp=2 x tp=2 x pp=2 job, with the realised mixture audited.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sysconfig
from dataclasses import dataclass

from tokenloom import ConfigError


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
    from tokenloom.tokenization import TokenizeConfig, tokenize_to_store

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


DEMO_WEIGHTS = {"stdlib-code": 0.5, "stdlib-tests": 0.3, "pydoc-topics": 0.2}
"""The demo mixture: half library code, 30% tests, 20% reference prose."""

DEMO_SEQ_LENGTH = 512
DEMO_GLOBAL_BATCH = 32


def write_build_config(output_dir: str, stores: list[DemoStore]) -> str:
    """Stage 2's input: a build config in Megatron's vocabulary, written where a user can rerun it
    with ``tokenloom build``. Its paths are relative to the config's folder (where a config file's
    relative paths point), so the folder can move and keep its build key and its cache."""
    import yaml

    blend: list[str] = []
    for store in stores:
        blend += [str(DEMO_WEIGHTS[store.name]), os.path.relpath(store.prefix, output_dir)]
    config = {
        "blend": blend,
        "split": "98,1,1",
        "seq_length": DEMO_SEQ_LENGTH,
        "seed": 1234,
        "train_iters": 200,
        "global_batch_size": DEMO_GLOBAL_BATCH,
        "eval_interval": 100,
        "eval_iters": 4,
        "cache": "cache",
        "timeout_s": 300,
    }
    path = os.path.join(output_dir, "build.yaml")
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(config, f, sort_keys=False)
    return path


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _build_rank(rank: int, world_size: int, port: int, config_path: str, results) -> None:
    """One rank of the demo's build: a real gloo process group on 127.0.0.1."""
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=300))
    try:
        import tokenloom

        result = tokenloom.build(config_path)
        mine = result.plan.items_of_rank(rank)
        seconds = sum(item.cost_s for item in mine)
        results.put((rank, None, (len(mine), seconds), result.build_key))
    except Exception as exc:  # reported by the parent, which names the rank
        results.put((rank, f"{type(exc).__name__}: {exc}", None, None))
    finally:
        dist.destroy_process_group()


def build_indices(config_path: str, *, ranks: int = 2, echo=print):
    """Stage 2: build every split's indices, spread over ``ranks`` gloo processes when torch is
    installed (one process otherwise), then open the result here from the warm cache."""
    import tokenloom
    from tokenloom import BuildError

    if ranks > 1 and importlib.util.find_spec("torch") is None:
        echo("  torch is not installed: building on 1 rank (pip install torch for the multi-rank build)")
        ranks = 1
    if ranks > 1:
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        results = context.Queue()
        port = _free_port()
        processes = [context.Process(target=_build_rank, args=(r, ranks, port, config_path, results))
                     for r in range(ranks)]
        for process in processes:
            process.start()
        reports = []
        try:
            for _ in processes:
                reports.append(results.get(timeout=600))
        finally:
            for process in processes:
                process.join(timeout=60)
                if process.is_alive():
                    process.terminate()
        for rank, error, work, _ in sorted(reports):
            if error is not None:
                raise BuildError(f"demo build failed on rank {rank}: {error}")
            echo(f"  rank {rank}: {work[0]} items (estimated {work[1]:.2f} s of work)")
    result = tokenloom.build(config_path)
    for name in ("train", "valid", "test"):
        split = result.split(name)
        echo(f"  {name:<5} {split.num_samples:>7,} samples of {split.seq_length} tokens")
    echo(f"  build {result.build_key[:16]}  cache {os.path.dirname(config_path)}/cache "
         f"(rerun: tokenloom build {config_path})")
    return result


def serve_and_audit(result, output_dir: str, *, num_steps: int = 20, echo=print) -> list[dict]:
    """Stage 3: serve ``num_steps`` steps to every rank of a dp=2 x tp=2 x pp=2 job and report the
    realised mixture from the audit log."""
    from tokenloom.experimental import simulate_job
    from tokenloom.serve import BatchGeometry, MixtureAudit, Topology, read_audit_log, summarize_audit

    topology = Topology(dp=2, tp=2, pp=2)
    geometry = BatchGeometry(global_batch_size=DEMO_GLOBAL_BATCH, micro_batch_size=4, dp=topology.dp)
    audit_path = os.path.join(output_dir, "audit.jsonl")
    if os.path.exists(audit_path):
        os.remove(audit_path)  # a fresh run of the demo starts a fresh log
    simulate_job(result.split("train"), geometry, topology, num_steps=num_steps, audit=MixtureAudit(audit_path))
    rows = summarize_audit(read_audit_log(audit_path))
    echo(f"  {num_steps} steps x {DEMO_GLOBAL_BATCH} samples to {topology.world_size} ranks "
         f"(dp={topology.dp} tp={topology.tp} pp={topology.pp}, {geometry.num_micro_batches_for(DEMO_GLOBAL_BATCH)} "
         "micro-batches of 4 per step); tensor peers checked identical")
    echo(f"  {'dataset':<14} {'target':>7} {'realised':>9} {'tokens':>10}")
    for row in rows:
        name = os.path.basename(str(row["dataset"]))
        echo(f"  {name:<14} {row['target']:>7.3f} {row['realised']:>9.3f} {row['tokens']:>10,}")
    echo(f"  audit log {audit_path} (tokenloom audit {audit_path})")
    return rows


def run_demo(output_dir: str, *, workers: int | None = None, ranks: int = 2, echo=print) -> list[dict]:
    """Run the main job end to end into ``output_dir``: tokenize, build, serve; returns the
    realised mixture rows."""
    echo(f"tokenize: built-in text -> token stores under {os.path.join(output_dir, 'stores')}")
    stores = tokenize_corpora(output_dir, workers=workers, echo=echo)
    echo(f"build: blend {', '.join(f'{n} {w}' for n, w in DEMO_WEIGHTS.items())} -> indices on {ranks} ranks")
    result = build_indices(write_build_config(output_dir, stores), ranks=ranks, echo=echo)
    echo("serve: every rank's micro-batches; realised mixture")
    return serve_and_audit(result, output_dir, echo=echo)
