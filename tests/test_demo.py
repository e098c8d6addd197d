"""The README's main job runs end to end: tokenize -> build on 2 gloo ranks -> serve -> audit."""

import os
import re

import pytest
import yaml

import tokenloom
from tokenloom.examples.demo import DEMO_WEIGHTS, run_demo
from tokenloom.io import IndexedDataset, validate


@pytest.mark.timeout(300)
def test_demo_runs_end_to_end_and_serves_the_target_mixture(tmp_path):
    pytest.importorskip("torch")
    lines = []
    demo = tmp_path / "demo"
    rows = run_demo(str(demo), workers=1, ranks=2, echo=lines.append)
    text = "\n".join(lines)
    for name in DEMO_WEIGHTS:
        store = IndexedDataset(os.path.join(demo, "stores", name))
        validate(store)
        assert store.num_documents > 0 and store.metadata["tokenizer"]["kind"] == "bytes"
    assert "rank 0:" in text and "rank 1:" in text  # two real ranks shared the build
    realised = {os.path.basename(row["dataset"]): row["realised"] for row in rows}
    assert set(realised) == set(DEMO_WEIGHTS)
    for name, weight in DEMO_WEIGHTS.items():
        assert realised[name] == pytest.approx(weight, abs=0.01)
    assert os.path.isfile(demo / "audit.jsonl") and os.path.isfile(demo / "build.yaml")

    # the config names its files relative to its folder: the folder moves, and its key and cache go with it
    config = yaml.safe_load((demo / "build.yaml").read_text())
    assert config["cache"] == "cache" and config["blend"][1::2] == [f"stores/{name}" for name in DEMO_WEIGHTS]
    key = re.search(r"build ([0-9a-f]{16})  cache", text).group(1)
    os.rename(demo, tmp_path / "moved")
    moved = tokenloom.build(str(tmp_path / "moved" / "build.yaml"))
    assert moved.build_key.startswith(key) and not moved.built_keys
