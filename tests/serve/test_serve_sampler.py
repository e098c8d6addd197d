"""The sampler's public copy, seek and next_step: what the adapters and probes use."""

from __future__ import annotations

import pytest

from serve_fixtures import write_corpus
from tokenloom.errors import ConfigError
from tokenloom.serve import BatchGeometry, BatchSizeSchedule
from tokenloom.serve.sampler import MicroBatchSampler
from tokenloom.source import StoreBlendSource


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    prefixes = write_corpus(tmp_path_factory.mktemp("sampler"), 3, seed=31, num_documents=60)
    return StoreBlendSource.from_prefixes(prefixes, [0.5, 0.3, 0.2], num_samples=120, seq_length=16, seed=4)



def _positions(sampler) -> list[list[int]]:
    return [p.tolist() for p in sampler]


def test_copy_is_independent_and_continues_where_the_original_is(source):
    geometry = BatchGeometry(global_batch_size=12, micro_batch_size=2, dp=2)  # 3 micro-batches a step
    sampler = MicroBatchSampler(source, geometry, dp_rank=1, max_steps=4)
    for _ in range(4):  # one step and one micro-batch in
        sampler.advance()
    sampler_state = sampler.state_dict()
    copy = sampler.copy()
    assert copy.state_dict() == sampler_state and len(copy) == len(sampler) == 8
    from_copy = _positions(copy)
    assert copy.exhausted() and sampler.state_dict() == sampler_state  # the copy advanced alone
    assert from_copy == _positions(sampler)
    assert from_copy[0] == [12 + 4 + 2, 12 + 4 + 3]  # step 1's second micro-step (4 samples each), rank 1


def test_copy_keeps_changed_weights(source):
    geometry = BatchGeometry(global_batch_size=8, micro_batch_size=2, dp=1)
    sampler = MicroBatchSampler(source, geometry)
    for _ in range(8):
        sampler.advance()
    sampler.reweight([0.0, 0.0, 1.0])
    copy = sampler.copy()
    assert copy.state_dict() == sampler.state_dict()
    dataset_ids, _ = copy.stream.locate(copy.positions())
    assert dataset_ids.tolist() == [2, 2]


def test_seek_equals_advancing_under_a_batch_size_ramp(source):
    geometry = BatchGeometry(global_batch_size=16, micro_batch_size=2, dp=2,
                             schedule=BatchSizeSchedule.parse("0:4 8:8 24:16"))
    walked = MicroBatchSampler(source, geometry, dp_rank=1)
    seen = 0
    while not walked.exhausted():
        sought = MicroBatchSampler(source, geometry, dp_rank=1)
        sought.seek(walked.step, geometry.step_start(walked.step), walked.micro_batch)
        assert sought.state_dict() == walked.state_dict() and len(sought) == len(walked)
        assert _positions(sought) == _positions(walked.copy())
        walked.advance()
        seen += 1
    # global batches of 4, 4, 8, 8 and six of 16 fill the 120 samples, 4 samples a micro-step
    assert seen == 1 + 1 + 2 + 2 + 6 * 4


@pytest.mark.parametrize("args,message", [
    ((-1, 0, 0), r"step=-1; expected a non-negative integer"),
    ((0, True, 0), r"step_start=True; expected a non-negative integer"),
    ((1, 12, 3), r"micro_batch=3; the step starting after 12 samples has 3 micro-batches, so expected an "
                 r"integer in \[0, 3\)"),
])
def test_seek_refuses_places_off_the_schedule(source, args, message):
    sampler = MicroBatchSampler(source, BatchGeometry(global_batch_size=12, micro_batch_size=2, dp=2))
    with pytest.raises(ConfigError, match=message):
        sampler.seek(*args)
    assert sampler.state_dict()["consumed_samples"] == 0  # unchanged


def test_next_step_skips_the_rest_of_a_step(source):
    geometry = BatchGeometry(global_batch_size=12, micro_batch_size=2, dp=2)
    sampler = MicroBatchSampler(source, geometry, dp_rank=0, max_steps=4)
    for _ in range(4):  # step 1, micro-batch 1
        sampler.advance()
    skipped = sampler.copy()
    skipped.next_step()
    sought = MicroBatchSampler(source, geometry, dp_rank=0, max_steps=4)
    sought.seek(2, 24)
    assert skipped.state_dict() == sought.state_dict() and len(skipped) == len(sampler) - 2 == 6


def test_whole_step_items_are_counted_from_the_sampler_state(source):
    pytest.importorskip("torch")
    from tokenloom.serve.torch_adapter import StatefulBatchSampler

    geometry = BatchGeometry(global_batch_size=12, micro_batch_size=2, dp=2)
    batches = StatefulBatchSampler(source, geometry, dp_rank=1, max_steps=5, whole_steps=True)
    items = list(batches)
    assert len(batches) == len(items) == 5 and all(item.shape == (6, 2) for item in items)
    mid_step = MicroBatchSampler(source, geometry, dp_rank=1, max_steps=5)
    for _ in range(4):  # step 1, micro-batch 1: the rest of step 1 is one item
        mid_step.advance()
    batches.load_state_dict(mid_step.state_dict())
    items = list(batches)
    assert len(batches) == len(items) == 4 and items[0].shape == (4, 2)
