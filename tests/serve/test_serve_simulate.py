"""A whole DP x TP x PP x CP job in one process serves the dp=1 stream, and resumes across layouts."""

from __future__ import annotations

import numpy as np
import pytest

from serve_fixtures import write_corpus
from tokenloom.serve import BatchGeometry, MixtureAudit, SampleOptions, Topology, read_audit_log
from tokenloom.serve.simulate import simulate_job
from tokenloom.source import StoreBlendSource

OPTIONS = SampleOptions(eod_mask_loss=True, reset_position_ids=True, create_attention_mask=True,
                        reset_attention_mask=True)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    prefixes = write_corpus(tmp_path_factory.mktemp("simulate"), 2, seed=61, num_documents=60)
    return StoreBlendSource.from_prefixes(prefixes, [0.6, 0.4], num_samples=300, seq_length=8, seed=4)


def test_dp_tp_pp_cp_job_serves_the_dp1_stream_and_resumes_elsewhere(source, tmp_path):
    def geometry(dp):
        return BatchGeometry(global_batch_size=8, micro_batch_size=2, dp=dp)

    reference = simulate_job(source, geometry(1), Topology(dp=1), num_steps=6, options=OPTIONS)
    audit = MixtureAudit(tmp_path / "audit.jsonl")
    job = simulate_job(source, geometry(2), Topology(dp=2, tp=2, pp=2, cp=2), num_steps=3, options=OPTIONS, audit=audit)
    resumed = simulate_job(source, geometry(4), Topology(dp=4, tp=1, pp=3, cp=1), num_steps=3, options=OPTIONS,
                           state=job.state, audit=MixtureAudit(tmp_path / "audit.jsonl"))
    for step, batch in enumerate(job.global_batches + resumed.global_batches):
        assert set(batch) == set(reference.global_batches[step])
        for name, value in reference.global_batches[step].items():
            np.testing.assert_array_equal(batch[name], value, err_msg=f"step {step} {name}")
    assert [r["step"] for r in read_audit_log(tmp_path / "audit.jsonl").records] == list(range(6))
