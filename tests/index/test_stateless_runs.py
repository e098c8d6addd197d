"""Length runs of the stateless index (``first_token``): a run cut from the document stream at any
stream token, against the slow packer, megatron-core's walk, the whole-request index and
``plan_run_starts``; both backends alike."""

from __future__ import annotations

import logging
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from index_fixtures import (
    ArrayReader,
    megatron_pieces,
    numbered_documents,
    pieces_of,
    reference_document_order,
    reference_pieces,
    reference_row,
    reference_stream,
)
from tokenloom.errors import ConfigError
from tokenloom.index.feistel import FeistelPermutation
from tokenloom.index.length_runs import plan_run_starts
from tokenloom.index.megatron_gpt import megatron_gpt_sample
from tokenloom.index.stateless import BACKENDS, build_stateless_gpt_index

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
BACKEND_NAMES = sorted(BACKENDS)
PRIMARY = "numba" if "numba" in BACKENDS else "numpy"  # the slow reference's checks run on the faster one
STARTS = ("token 0", "inside a document", "a document's start", "an epoch's end", "past an epoch's end")


@st.composite
def run_configs(draw, max_documents=30):
    """A split (empty documents included), a sequence length, and a run's first token of each kind
    in ``STARTS``, found in the stream the index will read (the reference's, not the index's)."""
    num_store = draw(st.integers(1, max_documents + 5))
    lengths = np.array(draw(st.lists(st.integers(0, 40), min_size=num_store, max_size=num_store)), dtype=np.int32)
    if draw(st.booleans()):
        ids, split = None, np.arange(num_store)
    else:
        chosen = draw(st.lists(st.integers(0, num_store - 1), min_size=1, max_size=max_documents, unique=True))
        ids = split = np.array(sorted(chosen) if draw(st.booleans()) else chosen, dtype=np.int64)
    tokens_per_epoch = int(lengths[split].sum())
    assume(tokens_per_epoch > 0)
    seed = draw(st.integers(0, 2**64 - 1))
    order = reference_stream(split, seed, 3)
    document_lengths = lengths[order].astype(np.int64)  # (3 * documents,) along the stream
    starts = np.concatenate([[0], np.cumsum(document_lengths)])  # C_j
    kind = draw(st.sampled_from(STARTS))
    inside = np.flatnonzero(document_lengths >= 2)
    if kind == "inside a document" and inside.shape[0]:
        j = int(draw(st.sampled_from(inside.tolist())))
        first_token = int(starts[j]) + draw(st.integers(1, int(document_lengths[j]) - 1))
    elif kind in ("inside a document", "a document's start"):
        first_token = int(starts[draw(st.integers(0, len(order) - 1))])
    elif kind == "token 0":
        first_token = 0
    else:
        first_token = draw(st.integers(1, 2)) * tokens_per_epoch
        if kind == "past an epoch's end":
            first_token += draw(st.integers(1, tokens_per_epoch))
    seq_length = draw(st.integers(1, 24))
    # up to ~3 epochs' samples more: a few epochs in all (the numpy backend walks each one)
    num_samples = draw(st.integers(0, min(60, 3 * tokens_per_epoch // seq_length + 3)))
    return dict(lengths=lengths, ids=ids, seed=seed, first_token=first_token, seq_length=seq_length,
                extra=draw(st.booleans()), num_samples=num_samples, block_size=draw(st.sampled_from([1, 2, 4, 16, 64])))


def build(config, backend="auto", **overrides):
    args = dict(num_samples=config["num_samples"], seq_length=config["seq_length"], seed=config["seed"],
                add_extra_token=config["extra"], block_size=config["block_size"], backend=backend,
                first_token=config["first_token"])
    args.update(overrides)
    return build_stateless_gpt_index(config["lengths"], config["ids"], **args)


def stream_tokens(lengths, order):
    """Every token of the stream, spelled out (document d's token at offset o is d * 100_000 + o)."""
    documents = numbered_documents(lengths)
    return np.concatenate([documents[d] for d in order.tolist()])


def served_holders(spans, num_samples, num_store):
    """Brute-force provenance: the served samples whose pieces hold tokens of each store document."""
    holders = [set() for _ in range(num_store)]
    for i in range(num_samples):
        for _, document, _, length in pieces_of(spans, i):
            if length > 0:
                holders[document].add(i)
    return [sorted(h) for h in holders]


# ----------------------------------------------------------------------------- one run


@SETTINGS
@given(config=run_configs())
def test_a_run_serves_the_stream_from_its_first_token(config):
    lengths, first_token, n = config["lengths"], config["first_token"], config["num_samples"]
    seq_length, extra = config["seq_length"], int(config["extra"])
    index = build(config, PRIMARY)
    # exactly the samples asked for, over the fewest epochs holding the last one's last token
    plan = index.plan
    assert index.num_samples == n and not plan.separate_final_epoch
    reach = first_token + n * seq_length + extra
    assert plan.num_epochs * plan.num_tokens_per_epoch >= reach
    assert plan.num_epochs == 1 or (plan.num_epochs - 1) * plan.num_tokens_per_epoch < reach
    order = reference_document_order(index)
    ids = np.arange(n)
    # packed samples: the slow packer's pieces from first_token, the megatron rows of their tokens
    packed_spans = index.spans(ids, shuffled=False)
    for k, pieces in enumerate(reference_pieces(lengths, order, seq_length, extra, n, first_token=first_token)):
        assert pieces_of(packed_spans, k, keep_empty=False) == pieces, k
    rows = np.array([reference_row(lengths, order, first_token + k * seq_length, extra) for k in range(n + 1)],
                    dtype=np.int64).reshape(n + 1, 2)
    begin, end = index.sample_bounds(ids)
    assert np.array_equal(begin, rows[:-1]) and np.array_equal(end, rows[1:])
    packed = index.shuffle(ids)
    assert np.array_equal(np.sort(packed), ids)
    # megatron-shaped arrays: GPTDataset reads the same pieces and tokens from them
    arrays = index.to_arrays()
    assert np.array_equal(arrays.document_index, order)
    assert np.array_equal(arrays.sample_index, rows) and arrays.sample_index.dtype == np.int32
    assert np.array_equal(arrays.shuffle_index, packed)
    tokens = stream_tokens(lengths, order)
    reader = ArrayReader(numbered_documents(lengths))
    spans = index.spans(ids)
    for i in range(n):
        k = int(packed[i])
        got = pieces_of(spans, i)
        assert [row[:3] for row in got] == [row[:3] for row in megatron_pieces(arrays.document_index,
                                                                               arrays.sample_index, k, extra)]
        read = np.concatenate([reader.get(d, offset=o, length=size) for _, d, o, size in got])
        start = first_token + k * seq_length
        assert np.array_equal(read, tokens[start:start + seq_length + extra]), i
        assert np.array_equal(read, megatron_gpt_sample(arrays, reader, i).tokens)
    for i in range(min(n, 2)):  # read() is spans() of one sample
        assert np.array_equal(index.read(reader, i), megatron_gpt_sample(arrays, reader, i).tokens)
    # provenance: the served samples holding each document, brute force from the spans
    assert [index.samples_holding(d).tolist() for d in range(len(lengths))] == served_holders(spans, n, len(lengths))


def lookups(index, documents, positions):
    """Every answer of an index, as arrays: what the backends must agree on (``sample_bounds`` is
    the first pass of ``spans``)."""
    ids = np.arange(index.num_samples)
    spans = index.spans(ids)
    arrays = index.to_arrays()
    out = dict(block_token_starts=index.block_token_starts, document_keys=index.document_keys,
               packed=index.shuffle(ids), documents_at=index.documents_at(positions),
               document_index=arrays.document_index, sample_index=arrays.sample_index,
               shuffle_index=arrays.shuffle_index,
               **{f: getattr(spans, f) for f in ("bounds", "document_ids", "offsets", "lengths", "positions")})
    for d in documents:
        out[f"samples_holding({d})"] = index.samples_holding(d)
    return out


@pytest.mark.skipif(len(BACKEND_NAMES) < 2, reason="numba is not installed")
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=run_configs(), data=st.data())
def test_backends_agree_on_a_run(config, data):
    # the numpy backend's small Feistel domains walk long: a few documents and positions suffice
    documents = data.draw(st.lists(st.integers(0, len(config["lengths"]) - 1), max_size=2, unique=True))
    split = len(config["lengths"] if config["ids"] is None else config["ids"])  # positions of epoch 0 (there is one)
    positions = np.array(data.draw(st.lists(st.integers(0, split - 1), max_size=8)), dtype=np.int64)
    first, *others = (lookups(build(config, backend), documents, positions) for backend in BACKEND_NAMES)
    for other in others:
        for name, value in first.items():
            assert value.dtype == other[name].dtype and np.array_equal(value, other[name]), name


@SETTINGS
@given(config=run_configs(), data=st.data())
def test_a_run_at_a_multiple_of_seq_length_holds_the_whole_request_indexs_samples(config, data):
    """A run from token m * seq_length holds the samples m, m + 1, ... of the whole-request
    index (checked against megatron-core in test_stateless.py): same stream, same rows."""
    seq_length, n = config["seq_length"], config["num_samples"]
    m = data.draw(st.integers(0, 3 * int(config["lengths"].sum()) // seq_length + 1))
    run = build(config, first_token=m * seq_length)
    try:
        whole = build(config, first_token=None, num_samples=m + n)
    except ConfigError as error:  # megatron-core's final-epoch assertion, reported as ConfigError
        assume("final epoch" not in str(error))
        raise
    assert whole.plan.num_epochs == run.plan.num_epochs
    assert np.array_equal(whole.document_keys, run.document_keys)
    assert np.array_equal(whole.block_token_starts, run.block_token_starts)
    for a, b in zip(whole.sample_bounds(m + np.arange(n)), run.sample_bounds(np.arange(n))):
        assert np.array_equal(a, b)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=run_configs())
def test_a_runs_rows_are_megatron_cores_walk_from_its_first_document(config):
    """A run from a document's start: its rows after the first are those megatron-core's own
    build_sample_idx writes for the document index from that document on."""
    pytest.importorskip("megatron.core")
    warnings.filterwarnings("ignore", module="megatron")
    logging.getLogger("megatron").setLevel(logging.ERROR)
    from megatron.core.datasets import helpers

    seq_length, first_token, n = config["seq_length"], config["first_token"], config["num_samples"]
    assume(seq_length > 1 and n > 0)  # megatron-core asserts seq_length > 1
    index = build(config)
    arrays = index.to_arrays()
    lengths = np.ascontiguousarray(config["lengths"], dtype=np.int32)
    starts = np.concatenate([[0], np.cumsum(lengths[arrays.document_index], dtype=np.int64)])
    first = int(np.searchsorted(starts, first_token, side="left"))  # C_first = first_token, if any
    assume(first < len(arrays.document_index) and starts[first] == first_token)
    tail = arrays.document_index[first:].astype(np.int32)
    theirs = helpers.build_sample_idx(lengths, tail, seq_length, 1, int(starts[-1] - first_token), True,
                                      config["extra"])
    assert theirs.shape[0] >= n + 1
    ours = arrays.sample_index[1:].astype(np.int64)
    assert np.array_equal(ours, theirs[1:n + 1].astype(np.int64) + np.array([first, 0]))


# ----------------------------------------------------------------------------- runs in a row


@SETTINGS
@given(config=run_configs(), runs=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 24)), min_size=2,
                                           max_size=4))
def test_runs_in_a_row_read_every_token_once(config, runs):
    """Runs cut one after another (T_r = T_{r-1} + n_{r-1} * s_{r-1}): each starts on the row the
    previous one ended on, and their inputs are the stream's tokens, each once, none skipped."""
    lengths, extra = config["lengths"], int(config["extra"])
    first_token, previous_end, previous_documents = 0, None, None
    inputs = []
    for num_samples, seq_length in runs:
        index = build(config, first_token=first_token, num_samples=num_samples, seq_length=seq_length)
        arrays = index.to_arrays()
        if previous_end is not None:
            assert tuple(arrays.sample_index[0].tolist()) == previous_end
            shorter = min(len(previous_documents), len(arrays.document_index))
            assert np.array_equal(previous_documents[:shorter], arrays.document_index[:shorter])  # one stream
        previous_end, previous_documents = tuple(arrays.sample_index[-1].tolist()), arrays.document_index
        starts = np.concatenate([[0], np.cumsum(lengths[arrays.document_index], dtype=np.int64)])
        spans = index.spans(np.arange(num_samples), shuffled=False)
        for k in range(num_samples):
            sample = np.concatenate([starts[p] + o + np.arange(size) for p, _, o, size in pieces_of(spans, k)])
            assert sample.shape == (seq_length + extra,)
            inputs.append(sample[:seq_length])
        first_token += num_samples * seq_length
    assert np.array_equal(np.concatenate(inputs), np.arange(first_token))


@pytest.mark.parametrize("extra", [True, False])
def test_runs_start_where_plan_run_starts_says(extra):
    """``length_runs.plan_run_starts`` walks the same stream: each run's first token is its start,
    the document holding it is the run's first row (with the extra token, the same rule), and the
    positions the last run needs end at its last row."""
    rng = np.random.default_rng(3)
    lengths = rng.integers(0, 40, 70_000).astype(np.int32)
    lengths[rng.integers(0, 70_000, 5_000)] = 0
    seed, runs = 17, [(200, 4096), (7, 16_384), (300, 2048), (1, 8), (40, 1000)]  # reaches epoch 1
    order = reference_stream(np.arange(70_000), seed, 3)
    run_starts, needed = plan_run_starts(lambda positions: lengths[order[positions]], runs, extra=int(extra))
    first_token = 0
    for (num_samples, seq_length), start in zip(runs, run_starts):
        assert start.token == first_token
        index = build_stateless_gpt_index(lengths, None, num_samples=num_samples, seq_length=seq_length,
                                          seed=seed, add_extra_token=extra, first_token=first_token)
        begin, end = index.sample_bounds(np.array([0, num_samples - 1]))
        before = int(np.sum(lengths[order[:start.position]], dtype=np.int64))
        assert before + start.offset == first_token
        if extra:
            assert tuple(begin[0].tolist()) == (start.position, start.offset)
        first_token += num_samples * seq_length
    assert index.plan.num_epochs == 2
    assert int(end[-1, 0]) + 1 == needed


def test_runs_shuffle_apart_from_the_whole_request_index_and_from_each_other():
    lengths = np.full(100, 10, dtype=np.int32)  # 1000 tokens an epoch: 99 samples of 10 (+ 1)
    whole = build_stateless_gpt_index(lengths, None, num_samples=None, seq_length=10, seed=4)
    assert whole.num_samples == 99 and len(whole._sample_parts) == 1
    run = build_stateless_gpt_index(lengths, None, num_samples=99, seq_length=10, seed=4, first_token=0)
    later = build_stateless_gpt_index(lengths, None, num_samples=99, seq_length=10, seed=4, first_token=10)
    ids = np.arange(99)
    for a, b in zip(whole.sample_bounds(ids), run.sample_bounds(ids)):  # the same samples...
        assert np.array_equal(a, b)
    orders = [index.shuffle(ids) for index in (whole, run, later)]  # ...served in other orders
    assert not np.array_equal(orders[0], orders[1]) and not np.array_equal(orders[1], orders[2])
    expected = FeistelPermutation.from_seed(99, seed=4, purpose="samples.run", epoch=10, backend="numpy")
    assert np.array_equal(orders[2], expected(ids))


# ----------------------------------------------------------------------------- validation


LENGTHS = np.array([5, 0, 7], dtype=np.int32)


@pytest.mark.parametrize("first_token, needle", [
    (-1, "first_token=-1"), (1.5, "first_token=1.5"), ("3", "first_token='3'"), (True, "first_token=True"),
    (2**63, f"first_token={2**63}"), (np.float64(2.0), "first_token=np.float64(2.0)"),
])
def test_a_bad_first_token_raises_config_error(first_token, needle):
    with pytest.raises(ConfigError) as error:
        build_stateless_gpt_index(LENGTHS, None, num_samples=2, seq_length=2, seed=0, first_token=first_token)
    assert needle in str(error.value) and "expected" in str(error.value)


def test_a_run_needs_a_sample_count():
    with pytest.raises(ConfigError, match="num_samples=None with first_token=5"):
        build_stateless_gpt_index(LENGTHS, None, num_samples=None, seq_length=2, seed=0, first_token=5)
    index = build_stateless_gpt_index(LENGTHS, None, num_samples=0, seq_length=2, seed=0, first_token=5)
    assert index.num_samples == 0 and index.spans(np.zeros(0, dtype=np.int64)).bounds.tolist() == [0]
    (position, offset), = index.to_arrays().sample_index.tolist()  # the row of token 5
    order = reference_document_order(index)
    assert int(LENGTHS[order[:position]].sum()) + offset == 5 and offset < LENGTHS[order[position]]
