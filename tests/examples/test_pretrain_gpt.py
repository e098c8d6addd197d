"""examples/pretrain_gpt.py under torchrun on gloo: the loss falls, a run stopped at 2 ranks
resumes at 1 (and the reverse) on the identical global batches with the same losses, a crash
inside gradient accumulation resumes from the last step boundary, and a checkpoint of another
build is refused."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys

import pytest
import yaml

torch = pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "pretrain_gpt.py")
SEQ, GLOBAL, MICRO, STEPS = 128, 16, 4, 60


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_build(directory, stores, *, seed: int = 1234) -> str:
    config = {"blend": [str(0.7), stores[0], str(0.3), stores[1]], "split": "90,10,0", "seq_length": SEQ,
              "seed": seed, "train_samples": 2 * STEPS * GLOBAL, "valid_samples": 32, "test_samples": 0,
              "cache": str(directory / "cache"), "timeout_s": 120}
    path = directory / f"build-{seed}.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """Two byte-tokenized stores of real text (standard-library sources) and two builds of them
    that differ in their seed."""
    from tokenloom.tokenization import TokenizeConfig, tokenize_to_store

    directory = tmp_path_factory.mktemp("pretrain")
    library = os.path.dirname(os.__file__)
    modules = sorted(f for f in os.listdir(library) if f.endswith(".py"))  # about 200, a document each
    stores = []
    for name, files in (("a-m", [f for f in modules if f < "n"]), ("n-z", [f for f in modules if f >= "n"])):
        summary = tokenize_to_store([os.path.join(library, f) for f in files], str(directory / name),
                                    TokenizeConfig(tokenizer="bytes", workers=1, skip_bad=True))
        stores.append(summary.prefix)
    return directory, _write_build(directory, stores), _write_build(directory, stores, seed=99)


def train(build: str, checkpoint, *, ranks: int, steps: int, resume: bool = False, metrics=None,
          extra=(), env=None, expect: int = 0) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
               "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), EXAMPLE,
               "--build", build, "--steps", str(steps), "--global-batch-size", str(GLOBAL),
               "--micro-batch-size", str(MICRO), "--checkpoint", str(checkpoint), *extra]
    if resume:
        command.append("--resume")
    if metrics is not None:
        command += ["--metrics", str(metrics)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == expect, result.stderr[-4000:]
    return result


def _metrics(path) -> list[dict]:
    return [json.loads(line) for line in open(path, encoding="utf-8")]


@pytest.fixture(scope="module")
def uninterrupted(builds, tmp_path_factory):
    """The reference: 2 ranks, 60 steps in one go."""
    directory = tmp_path_factory.mktemp("whole")
    _, build, _ = builds
    train(build, directory / "ckpt", ranks=2, steps=STEPS, metrics=directory / "metrics.jsonl")
    return _metrics(directory / "metrics.jsonl")


def test_two_ranks_train_and_the_loss_falls(uninterrupted):
    assert [m["step"] for m in uninterrupted] == list(range(STEPS))  # 0-based, as the serving state counts
    assert all(m["tokens"] == GLOBAL * SEQ and m["dp"] == 2 for m in uninterrupted)
    first = sum(m["loss"] for m in uninterrupted[:3]) / 3
    last = sum(m["loss"] for m in uninterrupted[-5:]) / 5
    assert first > 5.0  # about ln(257): a byte model that knows nothing
    assert last < first - 1.5, (first, last)
    assert len({m["batch_fingerprint"] for m in uninterrupted}) == STEPS  # every step a new global batch


def _same_run(resumed: list[dict], reference: list[dict]) -> None:
    assert [m["step"] for m in resumed] == [m["step"] for m in reference]
    assert [m["batch_fingerprint"] for m in resumed] == [m["batch_fingerprint"] for m in reference]
    for got, want in zip(resumed, reference):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-3), got["step"]


@pytest.mark.parametrize("first, then", [(2, 1), (1, 2)])
def test_a_run_stopped_halfway_resumes_on_another_number_of_ranks(builds, uninterrupted, tmp_path, first, then):
    _, build, _ = builds
    metrics = tmp_path / "metrics.jsonl"
    train(build, tmp_path / "ckpt", ranks=first, steps=STEPS // 2, metrics=metrics)
    train(build, tmp_path / "ckpt", ranks=then, steps=STEPS, resume=True, metrics=metrics)
    resumed = _metrics(metrics)
    assert [m["dp"] for m in resumed] == [first] * (STEPS // 2) + [then] * (STEPS // 2)
    _same_run(resumed, uninterrupted)


def test_a_crash_inside_gradient_accumulation_resumes_from_the_last_step_boundary(builds, uninterrupted, tmp_path):
    _, build, _ = builds
    metrics = tmp_path / "metrics.jsonl"
    # checkpoints every 10 steps; the job dies after the first micro-batch (of 2 per rank) of step
    # 14, the fifteenth
    result = train(build, tmp_path / "ckpt", ranks=2, steps=STEPS, metrics=metrics, extra=["--save-interval", "10"],
                   env={"PRETRAIN_GPT_CRASH_AT": "14:1"}, expect=1)
    assert "exiting inside step 14" in result.stderr
    state = torch.load(tmp_path / "ckpt" / "checkpoint.pt", weights_only=False)
    assert state["step"] == 10 and state["loader"]["step"] == 10 and state["loader"]["micro_batch"] == 0
    assert state["loader"]["consumed_samples"] == 10 * GLOBAL
    logged = _metrics(metrics)
    assert len(logged) == 14  # steps 11-14 ran after the checkpoint: the resume drops them and trains them again
    train(build, tmp_path / "ckpt", ranks=2, steps=STEPS, resume=True, metrics=metrics)
    _same_run(_metrics(metrics), uninterrupted)


def test_a_checkpoint_of_another_build_or_a_second_start_is_refused(builds, tmp_path):
    _, build, other = builds
    train(build, tmp_path / "ckpt", ranks=1, steps=2)
    result = train(other, tmp_path / "ckpt", ranks=1, steps=4, resume=True, expect=1)
    assert "was saved from build" in result.stderr and "another data stream" in result.stderr
    result = train(build, tmp_path / "ckpt", ranks=1, steps=4, expect=1)  # no --resume: not overwritten
    assert "exists; pass --resume" in result.stderr
    path = tmp_path / "ckpt" / "checkpoint.pt"
    state = torch.load(path, weights_only=False)
    assert state["step"] == 2
    state["loader"]["micro_batch"] = 1  # as if saved inside a step's accumulation
    torch.save(state, path)
    result = train(build, tmp_path / "ckpt", ranks=1, steps=4, resume=True, expect=1)
    assert "not saved at an optimizer step boundary" in result.stderr


def test_a_resume_can_skip_the_steps_around_a_loss_spike(builds, uninterrupted, tmp_path):
    _, build, _ = builds
    metrics = tmp_path / "metrics.jsonl"
    out = train(build, tmp_path / "ckpt", ranks=2, steps=20, metrics=metrics).stdout
    # rank 0 talks: a line every 10 steps (step, loss, tokens/s, the data wait's share) and a summary
    lines = out.splitlines()
    assert [line.split("  ")[0] for line in lines[:2]] == ["step 10", "step 20"], out
    assert all(" tokens/s  data wait " in line and line.endswith("%") for line in lines[:2])
    assert lines[2].startswith("trained steps 1-20: final loss ") and "data wait" in lines[2]
    assert len(lines) == 3
    # resumed at step 20 on one rank, steps 25-29 skipped: step 25 trains on what step 30 had
    out = train(build, tmp_path / "ckpt", ranks=1, steps=40, resume=True, metrics=metrics,
                extra=["--skip-steps", "25:30", "--quiet"]).stdout
    assert out == ""
    logged = _metrics(metrics)
    fingerprints = [m["batch_fingerprint"] for m in logged]
    reference = [m["batch_fingerprint"] for m in uninterrupted]
    assert fingerprints[:25] == reference[:25]
    assert fingerprints[25:40] == reference[30:45]
    state = torch.load(tmp_path / "ckpt" / "checkpoint.pt", weights_only=False)
    assert state["loader"]["skipped_ranges"] == [[25 * GLOBAL, 30 * GLOBAL]]


def _example_module():
    """examples/pretrain_gpt.py imported as a module (its model and attention)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("pretrain_gpt_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_document_mask_leaks_nothing_across_documents(tmp_path):
    """With --document-mask's fields and attention, every token's loss in a packed sample equals
    the loss of its document run alone (the served position ids restart per document); without
    the mask the later documents' losses change (attention reaches into the earlier ones)."""
    import numpy as np

    from tokenloom.io import IndexedDatasetWriter
    from tokenloom.serve.loader import read_batch
    from tokenloom.serve.stream import SampleStream
    from tokenloom.source import StoreBlendSource

    example = _example_module()
    vocab, seq = 97, 48
    rng = np.random.default_rng(5)
    with IndexedDatasetWriter(str(tmp_path / "short"), dtype=np.uint16) as writer:  # no EOD tokens at all
        for length in rng.integers(3, 30, 200):
            writer.add_document(rng.integers(0, vocab, int(length)))
        writer.finalize({"tokenizer": {"kind": "bytes", "name": "bytes", "path": None, "sha256": None,
                                       "vocab_size": vocab, "eod_id": None, "append_eod": False}})
    source = StoreBlendSource.from_prefixes([str(tmp_path / "short")], [1.0], num_samples=16, seq_length=seq, seed=3)
    options = example.sample_options(example.parse_args(["--build", "b", "--steps", "1", "--global-batch-size", "4",
                                                          "--micro-batch-size", "4", "--checkpoint", "c",
                                                          "--document-mask"]))
    batch = {k: torch.from_numpy(v) for k, v in read_batch(SampleStream(source), np.arange(4), options).items()}
    torch.manual_seed(0)
    model = example.GPT(vocab_size=vocab, seq_length=seq, layers=2, hidden=32, heads=4).eval()

    def token_losses(tokens, positions, labels, documents=None):
        logits = model(tokens, positions, documents)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")

    with torch.no_grad():
        masked = token_losses(batch["tokens"], batch["position_ids"], batch["labels"],
                              batch["document_ids"]).view(4, seq)
        unmasked = token_losses(batch["tokens"], batch["position_ids"], batch["labels"]).view(4, seq)
        leaked = 0
        for row in range(4):
            documents = batch["document_ids"][row]
            assert int(documents.max()) >= 2  # short documents: several in every sample
            for document in range(1, int(documents.max()) + 1):
                columns = torch.nonzero(documents == document).flatten()
                alone = token_losses(batch["tokens"][row, columns][None], torch.arange(columns.numel())[None],
                                     batch["labels"][row, columns][None])
                torch.testing.assert_close(masked[row, columns], alone, rtol=1e-4, atol=1e-5)
                leaked += document > 1 and not torch.allclose(unmasked[row, columns], alone, rtol=1e-4, atol=1e-5)
        assert leaked > 0


def test_a_run_with_the_document_mask_trains_and_resumes_only_with_it(builds, tmp_path):
    _, build, _ = builds
    metrics = tmp_path / "metrics.jsonl"
    train(build, tmp_path / "ckpt", ranks=1, steps=4, metrics=metrics, extra=["--document-mask", "--num-workers", "0"])
    logged = _metrics(metrics)
    assert [m["step"] for m in logged] == [0, 1, 2, 3] and all(5.0 < m["loss"] < 6.5 for m in logged[:1])
    assert torch.load(tmp_path / "ckpt" / "checkpoint.pt", weights_only=False)["document_mask"] is True
    result = train(build, tmp_path / "ckpt", ranks=1, steps=6, resume=True, expect=1)
    assert "trained with --document-mask; resume it the same way" in result.stderr
    train(build, tmp_path / "ckpt", ranks=1, steps=6, resume=True, extra=["--document-mask"])


@pytest.fixture(scope="module")
def mixed_build(tmp_path_factory):
    """Standard-library code and a store of random characters (a domain no model gets below
    ln(90) nats a byte), blended half and half, with room for the weights to move."""
    import random

    from tokenloom.tokenization import TokenizeConfig, tokenize_to_store

    directory = tmp_path_factory.mktemp("mixed")
    library = os.path.dirname(os.__file__)
    code = [os.path.join(library, f) for f in sorted(os.listdir(library)) if f.endswith(".py")][:80]
    rng, alphabet = random.Random(5), [chr(c) for c in range(33, 123)]
    (directory / "noise").mkdir()
    noise = []
    for k in range(80):
        path = directory / "noise" / f"{k}.txt"
        path.write_text("".join(rng.choice(alphabet) for _ in range(3000)))
        noise.append(str(path))
    stores = [tokenize_to_store(files, str(directory / name), TokenizeConfig(tokenizer="bytes", workers=1,
                                                                             skip_bad=True)).prefix
              for name, files in (("code", code), ("noise", noise))]
    config = {"blend": ["0.5", stores[0], "0.5", stores[1]], "split": "100,0,0", "seq_length": SEQ, "seed": 3,
              "train_samples": 8 * 30 * GLOBAL, "valid_samples": 0, "test_samples": 0,
              "cache": str(directory / "cache"), "timeout_s": 120}
    path = directory / "mixed.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_online_mixing_moves_weight_to_the_harder_domain_and_resumes_on_another_number_of_ranks(mixed_build,
                                                                                             tmp_path):
    mixing = ["--online-mixing", "1.0:5:2", "--min-weight", "0.05"]
    whole = tmp_path / "whole.jsonl"
    train(mixed_build, tmp_path / "a", ranks=2, steps=30, metrics=whole, extra=mixing)
    reference = _metrics(whole)
    noise = [m["weights"][1] for m in reference]
    assert noise[:6] == [0.5] * 6 and noise[6] != 0.5  # the first decision (after step 4) serves from step 6 on
    decided = noise[6::5]
    assert decided == sorted(decided) and decided[-1] > 0.6, noise  # up at every decision
    metrics = tmp_path / "resumed.jsonl"
    train(mixed_build, tmp_path / "b", ranks=2, steps=13, metrics=metrics, extra=mixing)
    train(mixed_build, tmp_path / "b", ranks=1, steps=30, resume=True, metrics=metrics, extra=mixing)
    resumed = _metrics(metrics)
    assert [m["weights"] for m in resumed] == [m["weights"] for m in reference]
    _same_run(resumed, reference)


def test_fill_in_the_middle_trains_on_the_code_store_and_resumes_only_with_the_same_settings(builds, tmp_path):
    """--fim-rate on stores tokenized by a BPE with FIM sentinels: the code store's samples are
    permuted (their sentinels reach the model), the other store's are not, the run trains, the
    settings are kept in the checkpoint, and stores of a byte tokenizer are refused by name."""
    import importlib.util

    from tokenloom.tokenization import TokenizeConfig, tokenize_to_store

    spec = importlib.util.spec_from_file_location("serve_fixtures", os.path.join(ROOT, "tests", "serve",
                                                                                 "serve_fixtures.py"))
    fixtures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fixtures)
    tokenizer = fixtures.train_code_tokenizer(tmp_path)
    stores = []
    for name, files in (("code", fixtures.stdlib_sources(60, 40)), ("more", fixtures.stdlib_sources(100, 40))):
        summary = tokenize_to_store(files, str(tmp_path / name), TokenizeConfig(tokenizer=tokenizer.path, workers=1))
        stores.append(summary.prefix)
    build = _write_build(tmp_path, stores)
    fim = ["--fim-rate", "0.9", "--fim-store", stores[0], "--num-workers", "0"]
    train(build, tmp_path / "ckpt", ranks=1, steps=3, metrics=tmp_path / "m.jsonl", extra=fim)
    assert all(math.isfinite(m["loss"]) for m in _metrics(tmp_path / "m.jsonl"))
    saved = torch.load(tmp_path / "ckpt" / "checkpoint.pt", weights_only=False)["fim"]
    assert saved == {"rate": 0.9, "spm_rate": 0.5, "stores": [stores[0]],
                     "tokens": "<fim_prefix>,<fim_middle>,<fim_suffix>,<fim_pad>,<|endoftext|>"}
    result = train(build, tmp_path / "ckpt", ranks=1, steps=5, resume=True, extra=["--fim-rate", "0.5"], expect=1)
    assert "was trained with FIM settings" in result.stderr
    # what the example serves: the code rows carry FIM's sentinels, the other store's none
    example = _example_module()
    args = example.parse_args(["--build", build, "--steps", "1", "--global-batch-size", str(GLOBAL),
                               "--micro-batch-size", str(MICRO), "--checkpoint", str(tmp_path), *fim])
    import tokenloom
    from tokenloom.serve import BatchGeometry, RankLoader

    split = tokenloom.build(build).split("train")
    loader = RankLoader(split, BatchGeometry(global_batch_size=GLOBAL, micro_batch_size=GLOBAL, dp=1),
                        options=example.sample_options(args, split))
    batch = loader.next_batch()
    sentinel = tokenizer.token_id("<fim_middle>")
    has = (batch["tokens"] == sentinel).any(axis=1)
    assert has[batch["dataset_id"] == 0].any() and not has[batch["dataset_id"] == 1].any()
    byte_build = builds[1]
    result = train(byte_build, tmp_path / "other", ranks=1, steps=1, extra=["--fim-rate", "0.5"], expect=1)
    assert "--fim-rate:" in result.stderr and "FIM needs the HuggingFace tokenizer.json" in result.stderr
