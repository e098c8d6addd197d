"""The README's main job runs end to end: tokenize -> build on 2 gloo ranks -> serve -> audit."""

import os

import pytest

from tokenloom.examples.demo import DEMO_WEIGHTS, run_demo
from tokenloom.io import IndexedDataset, validate


@pytest.mark.timeout(300)
def test_demo_runs_end_to_end_and_serves_the_target_mixture(tmp_path):
    pytest.importorskip("torch")
    lines = []
    rows = run_demo(str(tmp_path), workers=1, ranks=2, echo=lines.append)
    text = "\n".join(lines)
    for name in DEMO_WEIGHTS:
        store = IndexedDataset(os.path.join(tmp_path, "stores", name))
        validate(store)
        assert store.num_documents > 0 and store.metadata["tokenizer"]["kind"] == "bytes"
    assert "rank 0:" in text and "rank 1:" in text  # two real ranks shared the build
    realised = {os.path.basename(row["dataset"]): row["realised"] for row in rows}
    assert set(realised) == set(DEMO_WEIGHTS)
    for name, weight in DEMO_WEIGHTS.items():
        assert realised[name] == pytest.approx(weight, abs=0.01)
    assert os.path.isfile(tmp_path / "audit.jsonl") and os.path.isfile(tmp_path / "build.yaml")
