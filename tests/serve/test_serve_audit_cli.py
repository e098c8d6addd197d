"""``tokenloom audit`` on a log written by a real serving run."""

from __future__ import annotations

import json

import pytest

from serve_fixtures import write_corpus
from tokenloom.cli import main
from tokenloom.serve import BatchGeometry, MixtureAudit, RankLoader
from tokenloom.source import StoreBlendSource


@pytest.fixture(scope="module")
def log_path(tmp_path_factory):
    directory = tmp_path_factory.mktemp("audit")
    prefixes = write_corpus(directory, 2, seed=41, num_documents=50)
    source = StoreBlendSource.from_prefixes(prefixes, [0.25, 0.75], num_samples=200, seq_length=8, seed=1)
    path = directory / "audit.jsonl"
    loader = RankLoader(source, BatchGeometry(global_batch_size=8, micro_batch_size=4, dp=1), audit=MixtureAudit(path),
                        max_steps=12)
    for _ in loader:
        pass
    return path


def test_audit_json_summary(log_path, capsys):
    assert main(["audit", str(log_path), "--json", "--steps", "2"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] == 12 and len(summary["last_steps"]) == 2
    tokens = [row["tokens"] for row in summary["datasets"]]
    assert sum(tokens) == 12 * 8 * 8
    # megatron's greedy keeps the realised share within a sample of the target
    assert abs(tokens[0] / sum(tokens) - 0.25) <= 8 / sum(tokens)


def test_audit_table_and_drift_gate(log_path, capsys):
    assert main(["audit", str(log_path)]) == 0
    out = capsys.readouterr().out
    assert "| dataset" in out and "fingerprint" in out
    table = [line for line in out.splitlines() if line.startswith("|")]
    assert len(table) == 2 + 2  # header, rule, two datasets
    bars = {tuple(i for i, c in enumerate(line) if c == "|") for line in table}
    assert len(bars) == 1, "\n".join(table)  # every column lines up with its header
    assert "-0.0000" not in out
    assert main(["audit", str(log_path), "--max-drift", "1"]) == 0
    assert main(["audit", str(log_path), "--max-drift", "-1"]) == 1
    assert "exceeds --max-drift" in capsys.readouterr().out


def test_audit_rejects_other_files(tmp_path, capsys):
    path = tmp_path / "x.jsonl"
    path.write_text('{"hello": 1}\n')
    assert main(["audit", str(path)]) == 2
    assert "tokenloom audit" in capsys.readouterr().err
