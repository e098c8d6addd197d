"""examples/megatron_phases.py: Megatron-LM's launches become one tokenloom schedule whose phases
end at the launches' iterations; served, no sample of a store comes back at a phase change (both
modes), while megatron-core's relaunches, replayed as Megatron-LM sizes and reads them, serve
each store's first samples again: exactly the overlap of each phase's count with the most an
earlier phase took."""

from __future__ import annotations

import contextlib
import io
import os
import sys
from collections import Counter

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import megatron_phases as example  # noqa: E402

ENDS, GLOBAL, MICRO, SEQ = [12, 20, 26], 8, 4, 64


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The example's main() once (exact mode, megatron-core replayed when installed) on a small run."""
    work = tmp_path_factory.mktemp("megatron-phases")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = example.main(["--work", str(work), "--steps", *map(str, ENDS), "--global-batch-size", str(GLOBAL),
                             "--micro-batch-size", str(MICRO), "--seq-length", str(SEQ)])
    assert code == 0
    return work, out.getvalue()


def _config(work, mode: str) -> dict:
    prefixes = example.make_corpus(str(work))
    return example.phases_config(ENDS, prefixes, global_batch_size=GLOBAL, seq_length=SEQ, split="100,0,0",
                                 valid_samples=0, test_samples=0, seed=1234, mode=mode,
                                 cache_dir=str(work / f"cache-{mode}"))


def test_the_launches_become_phases_ending_at_their_iterations(run):
    work, printed = run
    prefixes = example.make_corpus(str(work))
    config = _config(work, "exact")
    assert [p["until"] for p in config["phases"]] == [{"steps": e} for e in ENDS]
    assert config["phases"][1]["blend"] == ["0.4", prefixes["web"], "0.3", prefixes["code"], "0.3", prefixes["math"]]
    arguments = example.megatron_arguments(ENDS, GLOBAL, prefixes)
    assert all(f"--phase-transition-iterations 12,20 --global-batch-size 8 --train-samples {26 * GLOBAL}" in a
               for a in arguments)
    assert "--load" not in arguments[0] and all("--load ckpt" in a for a in arguments[1:])
    assert "until: {steps: 20}" in printed


@pytest.mark.parametrize("mode", ["exact", "stateless"])
def test_tokenloom_serves_each_phase_and_reads_no_sample_twice(run, tmp_path, mode):
    import yaml

    work, _ = run
    build = tmp_path / "build.yaml"
    build.write_text(yaml.safe_dump(_config(work, mode)))
    served = example.tokenloom_phases(str(build), ENDS, GLOBAL, MICRO)
    sizes = [(e - s) * GLOBAL for s, e in zip([0, *ENDS[:-1]], ENDS)]
    assert [len(p) for p in served] == sizes
    assert Counter(store for store, _ in served[0])["math"] == 0  # math enters in phase 2
    assert example.rereads(served) == [0, 0, 0]
    every = [sample for phase in served for sample in phase]
    assert len(set(every)) == len(every)


def test_megatron_cores_relaunches_read_each_stores_first_samples_again(run):
    pytest.importorskip("megatron.core")
    work, printed = run
    prefixes = example.make_corpus(str(work))
    served = example.megatron_relaunches(ENDS, GLOBAL, prefixes, seq_length=SEQ, seed=1234,
                                         cache=str(work / "megatron-cache"))
    # within one epoch each relaunch reads a store's samples 0, 1, ... again: phase k re-reads as
    # many as the most an earlier phase took, up to its own count
    counts = [Counter(store for store, _ in phase) for phase in served]
    expected = [sum(min(counts[k][s], max((counts[j][s] for j in range(k)), default=0)) for s in example.STORES)
                for k in range(len(ENDS))]
    assert example.rereads(served) == expected and expected[0] == 0 and sum(expected) > 0
    total = sum(len(p) for p in served)
    assert f"megatron-core relaunch: {sum(expected):,} of {total:,} samples re-read" in printed
    assert f"tokenloom exact: 0 of {total:,} samples re-read" in printed
