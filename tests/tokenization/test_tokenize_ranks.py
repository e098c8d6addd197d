"""Tokenization divided over torchrun ranks (gloo, 127.0.0.1): the store is byte-identical to one
process's for every number of ranks, large files split at line starts with their line numbers
right, a failing rank fails every rank with the same message, a killed rank fails the others at
once, and a rerun keeps finished parts. Of chat and spans input the loss mask, ``.meta.json`` and
the printed summary are one process's too."""

from __future__ import annotations

import gzip
import json
import os
import re
import socket
import subprocess
import sys

import numpy as np
import pytest

from tokenloom.tokenization import TokenizeConfig, tokenize_to_store
from tokenloom.tokenization.inputs import discover_inputs
from tokenloom.tokenization.pipeline import plan_pieces

pytest.importorskip("torch")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def corpus(tmp_path):
    """A large JSONL file (split between ranks), a gzipped one (whole), plain text files."""
    rng = np.random.default_rng(0)
    root = tmp_path / "in"
    root.mkdir()
    words = ["data", "layer", "token", "blend", "rank", "step", "ünïcode", "sample"]
    with open(root / "a_big.jsonl", "w", encoding="utf-8") as f:
        for k in range(3000):
            text = " ".join(rng.choice(words, size=int(rng.integers(1, 60))))
            f.write(json.dumps({"text": f"{k}: {text}", "id": k}) + "\n")
    with gzip.open(root / "b_small.jsonl.gz", "wt", encoding="utf-8") as f:
        for k in range(200):
            f.write(json.dumps({"text": f"gz {k} " + "x" * k}) + "\n")
    for k in range(5):
        (root / f"c_doc{k}.txt").write_text(f"plain document {k}\n" * (k + 1), encoding="utf-8")
    return root


def _run(corpus, output, ranks: int, *extra, expect: int = 0) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr",
               "127.0.0.1", "--master-port", str(_free_port()), "-m", "tokenloom.cli", "tokenize", str(corpus),
               "--output", str(output), "--workers", "0", "--chunk-size", "4096", *extra]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == expect, result.stderr[-4000:]
    return result


def _run_ranks(corpus, output, ranks: int, *extra) -> list[subprocess.CompletedProcess]:
    """The same command on ``ranks`` processes started directly (torchrun's environment, without
    its agent, which stops the other ranks as soon as one fails): each rank's own outcome."""
    port = _free_port()
    procs = []
    for rank in range(ranks):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(rank), "LOCAL_RANK": str(rank),
               "WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, "-m", "tokenloom.cli", "tokenize", str(corpus), "--output",
                                       str(output), "--workers", "0", "--chunk-size", "4096", *extra], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=240)
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return results


def _files(prefix, suffixes=(".bin", ".idx", ".meta.json")) -> dict[str, bytes]:
    return {suffix: open(f"{prefix}{suffix}", "rb").read() for suffix in suffixes}


def test_every_number_of_ranks_writes_the_one_process_store(corpus, tmp_path):
    tokenize_to_store([str(corpus)], str(tmp_path / "one"), TokenizeConfig(workers=0))
    expected = _files(tmp_path / "one")
    files = discover_inputs([str(corpus)])
    runs = plan_pieces(files, TokenizeConfig(), 3)
    assert sum(1 for run in runs for p in run if p.byte_range is not None) >= 2  # the big file is split
    for ranks in (2, 3):
        result = _run(corpus, tmp_path / f"r{ranks}", ranks)
        assert f"on {ranks} ranks" in result.stdout
        assert _files(tmp_path / f"r{ranks}") == expected
        assert not os.path.exists(f"{tmp_path / f'r{ranks}'}.parts")  # parts removed after the merge


def test_a_bad_record_fails_every_rank_naming_its_file_and_line(corpus, tmp_path):
    big = corpus / "a_big.jsonl"
    lines = big.read_text(encoding="utf-8").splitlines(keepends=True)
    lines[2500] = '{"text": broken\n'  # in the last third of the big file: not rank 0's piece
    big.write_text("".join(lines), encoding="utf-8")
    results = _run_ranks(corpus, tmp_path / "out", 3)
    assert [r.returncode for r in results] == [2, 2, 2]
    errors = {r.stderr.strip().splitlines()[-1] for r in results}
    assert len(errors) == 1  # every rank raised the same error, naming the line as one process would
    (error,) = errors
    assert "tokenize phase]" in error and f"{big}:2501: " in error
    assert not (tmp_path / "out.bin").exists() and not (tmp_path / "out.idx").exists()


def test_a_rerun_keeps_the_parts_of_ranks_that_finished(corpus, tmp_path):
    # one rank fails on a file only it reads; the others' parts survive and are reused as they are
    bad = corpus / "c_doc4.txt"
    bad.write_bytes(b"\xff\xfe not utf-8\n")
    results = _run_ranks(corpus, tmp_path / "out", 3)
    assert all(r.returncode == 2 and "c_doc4.txt" in r.stderr for r in results)
    parts = tmp_path / "out.parts"
    kept = {p.name: p.stat().st_mtime_ns for p in parts.iterdir() if p.suffix == ".bin"}
    assert kept and "part-00002-of-00003.bin" not in kept
    bad.write_text("fixed document\n", encoding="utf-8")
    result = _run(corpus, tmp_path / "out", 3)
    assert f"{len(kept)} part(s) kept from an earlier run" in result.stdout
    assert not parts.exists()
    tokenize_to_store([str(corpus)], str(tmp_path / "one"), TokenizeConfig(workers=0))
    assert _files(tmp_path / "out") == _files(tmp_path / "one")


KILLED_RANK_SCRIPT = r"""
import gc, json, os, sys, time
gc.disable()  # no collector to free a failed collective's group by chance: close() alone must release peers
from datetime import timedelta
import torch.distributed as dist
import tokenloom.builder.tokenize as tk
from tokenloom.tokenization import TokenizeConfig
rank, world, port, corpus, output = int(sys.argv[1]), 3, int(sys.argv[2]), sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                        timeout=timedelta(seconds=120))
if rank == 2:  # dies in its part, between the planning agreement and the tokenize one
    tk._tokenize_part = lambda *args, **kwargs: os._exit(3)
started = time.perf_counter()
try:
    tk.tokenize_on_ranks([corpus], output, TokenizeConfig(workers=0, chunk_bytes=4096), group=dist.group.WORLD,
                         timeout_s=60.0)
    outcome = {"error": None}
except Exception as exc:
    outcome = {"error": f"{type(exc).__name__}: {exc}"}
outcome["seconds"] = time.perf_counter() - started
print(json.dumps(outcome), flush=True)
time.sleep(12)  # alive after failing: only the group's close can release a rank waiting on this one
"""


@pytest.mark.timeout(200)
def test_a_killed_rank_fails_the_others_long_before_the_timeout(corpus, tmp_path):
    # the second agreement's root is rank 1: its gather fails on the dead rank 2, and rank 0, waiting
    # for rank 1's broadcast, is released by rank 1 closing the tokenization's group; without that
    # close rank 0 waits until rank 1's process exits (12 s here). The close releases it only if
    # nothing else still holds the group: torch's frames in the failed gather's traceback did, in a
    # cycle that only the garbage collector broke, so rank 0 was released only when a collection
    # happened to run (the flaky failures). The survivors run with the collector off to show that
    # close() alone is enough.
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", KILLED_RANK_SCRIPT, str(rank), str(port), str(corpus),
                               str(tmp_path / "out")], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for rank in range(3)]
    try:
        outs = [proc.communicate(timeout=150) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert procs[2].returncode == 3 and not outs[2][0].strip()
    for rank in (0, 1):
        assert procs[rank].returncode == 0, outs[rank][1][-3000:]
    outcomes = [json.loads(outs[rank][0].strip().splitlines()[-1]) for rank in (0, 1)]
    # both survivors' outcomes and the end of their stderr: a slow failure says which rank waited on which
    report = "\n".join(f"rank {rank}: {outcomes[rank]}\n{outs[rank][1][-2000:]}" for rank in (0, 1))
    for outcome in outcomes:
        assert outcome["error"] is not None and "BuildError" in outcome["error"], report
        assert "killed or hung" in outcome["error"], report
        assert outcome["seconds"] < 8.0, report  # the group's timeout is 60 s, the survivors live 12 s


# -- chat input: the loss mask and the summary ----------------------------------------------------
@pytest.fixture(scope="module")
def chat_corpus(tmp_path_factory):
    """Chat JSONL in three files (a big one split between two ranks, a gzipped one that goes whole,
    a small one) and the tokenizer with a ChatML template that reads them."""
    pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    from chat_fixtures import make_conversations, train_chat_tokenizer, write_jsonl

    tokenizer = train_chat_tokenizer(tmp_path_factory.mktemp("chat_tokenizer"))
    root = tmp_path_factory.mktemp("chat")
    records = make_conversations(160, seed=11)
    write_jsonl(root / "a_big.jsonl", records[:110])
    with gzip.open(root / "b_small.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(record) + "\n" for record in records[110:140])
    write_jsonl(root / "c_last.jsonl", records[140:])
    return root, tokenizer


CHAT_FLAGS = ("--input-format", "chat", "--assistant-prefix-tokens", "auto", "--engine", "hf")
"""``hf``: no code point scan for gigatoken (tens of seconds here; the ids are the same either way,
test_tokenize_identity holds them to each other)."""


def _copy_corpus(root, target):
    target.mkdir()
    for path in root.iterdir():
        (target / path.name).write_bytes(path.read_bytes())
    return target


def _two_ranks_as_one_process(root, tmp_path, capsys, flags) -> tuple[dict, list[str]]:
    """Tokenize ``root`` with the CLI in this process and on 2 torchrun ranks, both into a store
    named ``out`` (``.meta.json`` names its mask's file); hold the ranks' .bin, .idx, .mask and
    .meta.json to one process's byte for byte, and their printed summary line for line but for
    the run's time and the ranks it ran on. Returns the store's metadata and the printed lines."""
    from tokenloom.cli import main

    runs = plan_pieces(discover_inputs([str(root)], input_format=flags[flags.index("--input-format") + 1]),
                       TokenizeConfig(), 2)
    assert runs[0][-1].source.path == runs[1][0].source.path == str(root / "a_big.jsonl")  # split between ranks
    (tmp_path / "one").mkdir()
    (tmp_path / "r2").mkdir()
    assert main(["tokenize", str(root), "--output", str(tmp_path / "one" / "out"), "--workers", "0",
                 "--chunk-size", "4096", "-q", *flags]) == 0
    one_lines = capsys.readouterr().out.splitlines()
    result = _run(root, tmp_path / "r2" / "out", 2, *flags)
    suffixes = (".bin", ".idx", ".mask", ".meta.json")
    assert _files(tmp_path / "r2" / "out", suffixes) == _files(tmp_path / "one" / "out", suffixes)
    assert not os.path.exists(tmp_path / "r2" / "out.parts")
    timing = re.compile(r" in [0-9.]+ s \([0-9,]+ docs/s, [0-9,]+ tokens/s\)")
    lines = [timing.sub("", line.replace(str(tmp_path / "r2"), "DIR")) for line in result.stdout.splitlines()]
    expected = [timing.sub("", line.replace(str(tmp_path / "one"), "DIR")) for line in one_lines]
    assert lines[-1].endswith(" on 2 ranks")
    lines[-1] = lines[-1].removesuffix(" on 2 ranks")
    assert lines == expected
    with open(tmp_path / "r2" / "out.meta.json") as f:
        return json.load(f), lines


def test_two_ranks_write_the_one_process_chat_store_mask_and_summary(chat_corpus, tmp_path, capsys):
    root, tokenizer = chat_corpus
    meta, lines = _two_ranks_as_one_process(root, tmp_path, capsys, ["--tokenizer", tokenizer, *CHAT_FLAGS])
    header = meta["source"]["assistant_prefix_tokens"]  # "auto" resolved, as one process records it
    assert isinstance(header, int) and header > 0
    mask = meta["loss_mask"]  # its SHA-256 and counts: one process's (the files are equal above)
    assert mask["file"] == "out.mask" and 0 < mask["tokens_outside_loss"] < mask["num_tokens"]
    loss = mask["num_tokens"] - mask["tokens_outside_loss"]
    assert any(line.startswith(f"loss mask DIR/out.mask: {loss:,} tokens in the loss")
               and f"first {header} tokens outside it" in line for line in lines), lines


def test_two_ranks_write_the_one_process_spans_store_mask_and_summary(tmp_path, capsys):
    rng = np.random.default_rng(5)
    root = tmp_path / "spans"
    root.mkdir()
    for name, count in (("a_big.jsonl", 400), ("b_small.jsonl", 40)):
        with open(root / name, "w", encoding="utf-8") as f:
            for _ in range(count):
                ids = rng.integers(0, 256, size=int(rng.integers(0, 40))).tolist()
                cuts = sorted(set(rng.integers(0, len(ids) + 1, size=4).tolist()))
                spans = [[a, b] for a, b in zip(cuts[::2], cuts[1::2]) if a < b]
                f.write(json.dumps({"input_ids": ids, "loss_spans": spans}) + "\n")
    meta, lines = _two_ranks_as_one_process(root, tmp_path, capsys, ["--input-format", "spans"])
    assert meta["source"]["empty_documents"] > 0 and "assistant_prefix_tokens" not in meta["source"]
    assert lines[1] == "engine none (pre-tokenized input), in the calling thread"
    assert any(line.startswith("loss mask DIR/out.mask: ") for line in lines) and any(
        line.startswith("left out ") for line in lines)


def test_a_bad_conversation_on_one_rank_fails_every_rank_and_writes_nothing(chat_corpus, tmp_path):
    root, tokenizer = chat_corpus
    corpus = _copy_corpus(root, tmp_path / "in")
    last = corpus / "c_last.jsonl"  # rank 1's alone
    lines = last.read_text(encoding="utf-8").splitlines(keepends=True)
    lines[7] = json.dumps({"messages": [{"role": "user", "content": "Hi"}, {"role": "wizard", "content": "?"}]}) + "\n"
    last.write_text("".join(lines), encoding="utf-8")
    results = _run_ranks(corpus, tmp_path / "out", 2, "--tokenizer", tokenizer, *CHAT_FLAGS)
    assert [r.returncode for r in results] == [2, 2], [r.stderr[-2000:] for r in results]
    errors = {r.stderr.strip().splitlines()[-1] for r in results}
    assert len(errors) == 1, errors  # every rank raised the same error, naming the line as one process would
    (error,) = errors
    assert "tokenize phase]" in error and f"{last}:8: " in error and "wizard" in error
    assert error.endswith("(--skip-bad skips and counts such records)")  # the flag, as one process names it
    # no store, no mask, no hidden file beside them: only the parts a rerun would keep
    assert sorted(os.listdir(tmp_path)) == ["in", "out.parts"]
