"""Document boundaries in every sample (``inter_document_masking``): megatron-core's ``cu_seqlens``,
``max_seqlen`` and per-document position ids, taken from the index's document pieces.

Exact mode is held equal to megatron-core 0.19.2's ``BlendedDataset[i]`` and ``GPTDataset[j]``
with ``inter_document_masking=True``, field for field; stateless mode against a slow reference of
megatron-core's rule applied to its own spans.
"""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from serve_fixtures import megatron_blended, write_store
from tokenloom.errors import BuildError, ConfigError, FormatError, InputError
from tokenloom.serve import BatchGeometry, BatchPipeline, RankLoader, SampleOptions, Topology, field_schema
from tokenloom.serve.loader import read_batch
from tokenloom.serve.samples import document_fields
from tokenloom.serve.stream import SampleStream
from tokenloom.source import StatelessBlendSource, StoreBlendSource

VOCAB = 1000
EOD = VOCAB - 1
MASKING = SampleOptions(inter_document_masking=True)


def _corpus(directory, num_stores: int, *, seed: int, max_length: int, empty_rate: float) -> list[str]:
    """Stores whose documents end in EOD, ``empty_rate`` of the first 70% of them empty, lengths up
    to ``max_length`` (longer than a sample when ``max_length`` exceeds the sequence length).

    The last 30% hold no empty document: megatron-core 0.19.2's ``GPTDataset._get_num_epochs``
    loops forever on a split whose documents are all empty (it adds epochs of zero tokens until
    they reach the tokens asked for), and a validation or test split is that tail."""
    rng = np.random.default_rng(seed)
    prefixes = []
    for k in range(num_stores):
        docs = []
        count = 25 + 5 * k
        for index in range(count):
            if index < 0.7 * count and rng.random() < empty_rate:
                docs.append(np.zeros(0, dtype=np.int64))
                continue
            doc = rng.integers(0, EOD, size=int(rng.integers(1, max_length + 1)))
            doc[-1] = EOD
            docs.append(doc)
        prefixes.append(write_store(str(directory / f"store{k}"), docs, vocab_size=VOCAB, eod_id=EOD))
    return prefixes


def _assert_fields_equal(ours: dict, theirs: dict, what: str) -> None:
    assert set(ours) == set(theirs), (what, sorted(ours), sorted(theirs))
    for name, value in theirs.items():
        expected = np.asarray(value)
        got = np.asarray(ours[name])
        assert (got.dtype, got.shape) == (expected.dtype, expected.shape), (what, name, got.dtype, got.shape,
                                                                            expected.dtype, expected.shape)
        np.testing.assert_array_equal(got, expected, err_msg=f"{what}, field {name}")


def _reference_boundaries(lengths, seq_length: int, add_extra_token: bool):
    """megatron-core 0.19.2's rule (GPTDataset.__getitem__ with inter_document_masking), one
    sample at a time, from the lengths of the pieces it read (the extra token included)."""
    lengths = [int(n) for n in lengths]
    if add_extra_token:
        lengths[-1] -= 1
        if lengths[-1] == 0:
            lengths.pop()
    shortfall = seq_length - sum(lengths)
    if shortfall > 0:
        if lengths:
            lengths[-1] += shortfall
        else:
            lengths.append(shortfall)
    cu = np.cumsum([0, *lengths]).astype(np.int32)
    positions = np.arange(seq_length, dtype=np.int64)
    for start, stop in itertools.pairwise(cu):
        positions[start:stop] = np.arange(stop - start)
    padded = np.full(seq_length + 1, seq_length, dtype=np.int32)
    padded[:cu.shape[0]] = cu
    return padded, np.int32(np.diff(cu).max()), positions


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(
    num_stores=st.integers(1, 3),
    raw_weights=st.lists(st.floats(0.05, 5.0), min_size=3, max_size=3),
    num_samples=st.integers(1, 200),
    seq_length=st.integers(1, 40),
    seed=st.integers(0, 2**32 - 1),
    corpus_seed=st.integers(0, 1000),
    max_length=st.sampled_from([3, 12, 90]),
    empty_rate=st.sampled_from([0.0, 0.2]),
    split=st.sampled_from(["1,0,0", "90,10,0"]),
    eod_mask_loss=st.booleans(),
    reset_position_ids=st.booleans(),
    extra=st.booleans(),
    backend=st.sampled_from(["numba", "numpy"]),
)
def test_exact_samples_equal_megatron_core_with_inter_document_masking(
        tmp_path_factory, num_stores, raw_weights, num_samples, seq_length, seed, corpus_seed, max_length,
        empty_rate, split, eod_mask_loss, reset_position_ids, extra, backend):
    """Every position of the blend equals megatron-core's BlendedDataset[i], and every sample a
    dataset serves equals its GPTDataset[j]: documents longer than a sample, empty documents, with
    and without the extra token, several epochs (up to 200 samples of a 25-40 document store)."""
    directory = tmp_path_factory.mktemp("documents")
    prefixes = _corpus(directory, num_stores, seed=corpus_seed, max_length=max_length, empty_rate=empty_rate)
    weights = raw_weights[:num_stores]
    theirs = megatron_blended(prefixes, weights, num_samples=num_samples, seq_length=seq_length, seed=seed,
                              cache_dir=directory / "cache", split=split, eod_mask_loss=eod_mask_loss,
                              reset_position_ids=reset_position_ids, create_attention_mask=False,
                              add_extra_token=extra, inter_document_masking=True)
    source = StoreBlendSource.from_prefixes(prefixes, weights, num_samples=num_samples, seq_length=seq_length,
                                            seed=seed, split=split, add_extra_token=extra)
    source.backend = backend
    assert source.num_samples == len(theirs)
    options = SampleOptions(eod_mask_loss=eod_mask_loss, reset_position_ids=reset_position_ids,
                            inter_document_masking=True)
    stream = SampleStream(source)
    try:
        ours = read_batch(stream, np.arange(len(theirs)), options)
    except InputError:  # a sample of mostly empty documents: compare one position at a time
        ours = None
    for i in range(len(theirs)):
        if ours is None:
            _compare_or_fail_alike(functools.partial(read_batch, stream, np.array([i]), options), 0,
                                   functools.partial(theirs.__getitem__, i), f"position {i}")
        else:
            _compare_or_fail_alike(functools.partial(dict, ours), i, functools.partial(theirs.__getitem__, i),
                                   f"position {i}")
    pipeline = BatchPipeline(source, options=options)
    for d, dataset in enumerate(theirs.datasets):  # megatron-core's GPTDataset, sample by sample
        for j in range(min(len(dataset), 40)):
            _compare_or_fail_alike(functools.partial(_sample_fields, pipeline, d, j), 0,
                                   functools.partial(dataset.__getitem__, j), f"dataset {d} sample {j}")


def _sample_fields(pipeline: BatchPipeline, dataset: int, sample: int) -> dict:
    """Sample ``sample`` of dataset ``dataset`` as a batch of one, without ``dataset_id``
    (megatron-core's GPTDataset has none)."""
    fields = pipeline.read(np.array([dataset]), np.array([sample]))
    return {k: v for k, v in fields.items() if k != "dataset_id"}


def _compare_or_fail_alike(read_ours, row: int, read_theirs, what: str) -> None:
    """Equal fields, or both fail: a sample with more document pieces than ``cu_seqlens`` has
    entries (seq_length + 1) breaks megatron-core's __getitem__ and is an InputError here."""
    try:
        expected = read_theirs()
    except RuntimeError:
        with pytest.raises(InputError, match="document pieces"):
            read_ours()
        return
    ours = read_ours()
    _assert_fields_equal({k: v[row] for k, v in ours.items()}, expected, what)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(num_samples=st.integers(1, 60), seq_length=st.integers(2, 40), seed=st.integers(0, 2**31),
       corpus_seed=st.integers(0, 1000), extra=st.booleans())
def test_padded_last_validation_sample_equals_megatron_core(tmp_path_factory, num_samples, seq_length, seed,
                                                            corpus_seed, extra):
    """The valid split keeping its short last sample: the padding belongs to the last document.

    eod_mask_loss is on so that megatron-core recomputes the loss mask per sample: otherwise its
    GPTDataset caches the first sample's mask object and then zeroes that sample's padding in it
    in place, so when the padded sample is the first one read, every later sample of the dataset
    loses the loss on those columns (an order-dependent megatron-core 0.19.2 quirk tokenloom does
    not reproduce)."""
    directory = tmp_path_factory.mktemp("valid")
    prefixes = _corpus(directory, 2, seed=corpus_seed, max_length=30, empty_rate=0.1)
    try:
        theirs = megatron_blended(prefixes, [0.4, 0.6], num_samples=num_samples, seq_length=seq_length, seed=seed,
                                  cache_dir=directory / "cache", split="6,4,0", split_name="valid",
                                  drop_last_partial_validation=False, create_attention_mask=False,
                                  eod_mask_loss=True, add_extra_token=extra, inter_document_masking=True)
    except AssertionError:  # megatron-core's build_sample_idx asserts on some splits ending in empty documents
        assume(False)
    source = StoreBlendSource.from_prefixes(prefixes, [0.4, 0.6], num_samples=num_samples, seq_length=seq_length,
                                            seed=seed, split="6,4,0", split_name="valid", drop_last_partial=False,
                                            add_extra_token=extra)
    options = SampleOptions(eod_mask_loss=True, inter_document_masking=True)
    stream = SampleStream(source)
    for i in range(len(theirs)):
        try:
            expected = theirs[i]
        except RuntimeError:  # more pieces than cu_seqlens holds (empty documents): megatron-core fails too
            with pytest.raises(InputError, match="document pieces"):
                read_batch(stream, np.array([i]), options)
            continue
        ours = read_batch(stream, np.array([i]), options)
        _assert_fields_equal({k: v[0] for k, v in ours.items()}, expected, f"position {i}")


def test_a_padded_sample_whose_last_piece_is_the_extra_token(tmp_path):
    """Documents of 5 and 1 tokens, seq_length 6 kept short: the 1-token piece is only the extra
    token, so it is dropped and the padding joins the first document (megatron-core's rule)."""
    from tokenloom.index.megatron_gpt import build_megatron_gpt_indices
    from tokenloom.io import IndexedDataset
    from tokenloom.source.readers import MegatronReader

    store = IndexedDataset(write_store(str(tmp_path / "s"), [np.arange(1, 6), np.array([EOD])], vocab_size=VOCAB,
                                       eod_id=EOD))
    indices = build_megatron_gpt_indices(store.sequence_lengths, np.arange(2), num_samples=None, seq_length=6,
                                         seed=1, drop_last_partial=False)
    reader = MegatronReader(name="s", store=store, indices=indices)
    width = 7
    for backend in ("numba", "numpy"):
        tokens = np.empty((1, width), dtype=np.int64)
        ends = np.empty((1, width + 1), dtype=np.int32)
        counts = np.empty(1, dtype=np.int32)
        reader.read_into(np.array([0]), tokens, np.array([0]), backend=backend, ends=ends, counts=counts)
        assert counts.tolist() == [2] and ends[0, :2].tolist() == [5, 6]
        for fields_backend in ("numba", "numpy"):
            cu, longest, positions = document_fields(ends, counts, seq_length=6, add_extra_token=True,
                                                     backend=fields_backend)
            assert cu[0].tolist() == [0, 6, 6, 6, 6, 6, 6] and longest.tolist() == [6]
            assert positions[0].tolist() == [0, 1, 2, 3, 4, 5]
            expected = _reference_boundaries([5, 1], 6, True)
            np.testing.assert_array_equal(cu[0], expected[0])
            np.testing.assert_array_equal(positions[0], expected[2])


@settings(max_examples=200, deadline=None)
@given(data=st.data(), seq_length=st.integers(1, 30), extra=st.booleans(), batch=st.integers(1, 6))
def test_both_backends_of_the_boundary_fields_follow_megatron_cores_rule(data, seq_length, extra, batch):
    """Random piece lists (empty pieces, short padded rows, a last piece of only the extra token)
    against the per-sample reference of megatron-core's code."""
    width = seq_length + int(extra)
    rows = []
    for _ in range(batch):
        total = data.draw(st.integers(1, width)) if data.draw(st.booleans()) else width
        # with the extra token the last piece holds at least that token (the index's end offset + 1)
        cuts = sorted(data.draw(st.lists(st.integers(0, total - int(extra)), max_size=min(seq_length - 1, 8))))
        lengths = np.diff([0, *cuts, total]).tolist()
        if extra and len(lengths) > seq_length:
            lengths = [*lengths[:seq_length - 1], sum(lengths[seq_length - 1:])]
        rows.append(lengths)
    ends = np.full((batch, width + 1), -7, dtype=np.int32)
    counts = np.array([len(r) for r in rows], dtype=np.int32)
    for k, lengths in enumerate(rows):
        ends[k, :len(lengths)] = np.cumsum(lengths)
    results = [document_fields(ends, counts, seq_length=seq_length, add_extra_token=extra, backend=b)
               for b in ("numba", "numpy")]
    for k, lengths in enumerate(rows):
        cu, longest, positions = _reference_boundaries(lengths, seq_length, extra)
        for cu_got, longest_got, positions_got in results:
            np.testing.assert_array_equal(cu_got[k], cu)
            assert longest_got[k] == longest
            np.testing.assert_array_equal(positions_got[k], positions)


@pytest.mark.parametrize("backend", ["numba", "numpy"])
def test_pieces_that_cannot_be_a_sample_are_refused(backend):
    ends = np.array([[3, 2, 8, 0, 0, 0, 0, 0, 0]], dtype=np.int32)  # out of order
    with pytest.raises(FormatError, match="row 0 of the batch has 3 document pieces"):
        document_fields(ends, np.array([3], dtype=np.int32), seq_length=7, add_extra_token=True, backend=backend)
    with pytest.raises(FormatError, match="row 0"):  # past the row
        document_fields(np.array([[12, 0, 0, 0, 0, 0, 0, 0, 0]], dtype=np.int32), np.array([1], dtype=np.int32),
                        seq_length=7, add_extra_token=True, backend=backend)


def test_a_sample_of_mostly_empty_documents_is_refused_by_name(tmp_path):
    """More pieces than cu_seqlens can list (megatron-core's own __getitem__ fails here too)."""
    docs = [np.array([1, 2, EOD])] + [np.zeros(0, dtype=np.int64)] * 12 + [np.array([3, EOD])]
    prefix = write_store(str(tmp_path / "empty"), docs, vocab_size=VOCAB, eod_id=EOD)
    source = StoreBlendSource.from_prefixes([prefix], [1.0], num_samples=1, seq_length=4, seed=0)
    for backend in ("numba", "numpy"):
        source.backend = backend
        with pytest.raises(InputError, match=f"{prefix}: sample 0 holds more than 6 document pieces"):
            read_batch(SampleStream(source), np.arange(1), MASKING)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(seq_length=st.integers(1, 48), num_samples=st.integers(1, 300), seed=st.integers(0, 2**40),
       extra=st.booleans(), empty_rate=st.sampled_from([0.0, 0.2]), data=st.data())
def test_stateless_boundaries_come_from_its_own_spans(tmp_path_factory, seq_length, num_samples, seed, extra,
                                                      empty_rate, data):
    """The pieces a stateless sample is read from (its spans, what `where` reports) give its
    boundaries by megatron-core's rule; the gather records them in both backends."""
    directory = tmp_path_factory.mktemp("stateless")
    prefixes = _corpus(directory, 2, seed=seed % 1000, max_length=60, empty_rate=empty_rate)
    source = StatelessBlendSource.from_prefixes(prefixes, [0.3, 0.7], num_samples=num_samples,
                                                seq_length=seq_length, seed=seed, add_extra_token=extra)
    positions = np.array(data.draw(st.lists(st.integers(0, source.num_samples - 1), min_size=1, max_size=12)))
    dataset_ids, sample_ids = source.locate(positions)
    pieces = [source.readers[int(d)].spans(sample_ids[k:k + 1]).lengths for k, d in enumerate(dataset_ids)]
    # more pieces than cu_seqlens' seq_length + 1 entries can end (a tiny sample starting with an empty
    # piece): refused, as megatron-core's rule cannot list them either
    listable = np.array([len(p) - int(extra and len(p) > 1 and p[-1] == 1) <= seq_length for p in pieces])
    for backend in ("numba", "numpy"):
        source.backend = backend
        if not listable.all():
            k = int(np.flatnonzero(~listable)[0])
            with pytest.raises(InputError, match="document pieces, more than"):
                BatchPipeline(source, options=MASKING).read(dataset_ids[k:k + 1], sample_ids[k:k + 1])
        if not listable.any():
            continue
        fields = BatchPipeline(source, options=MASKING).read(dataset_ids[listable], sample_ids[listable])
        for j, k in enumerate(np.flatnonzero(listable).tolist()):
            cu, longest, ids = _reference_boundaries(pieces[k], seq_length, extra)
            np.testing.assert_array_equal(fields["cu_seqlens"][j], cu)
            assert fields["max_seqlen"][j] == longest
            np.testing.assert_array_equal(fields["position_ids"][j], ids)


def test_boundaries_need_no_eod_tokens(tmp_path):
    """A store written without EOD tokens (and no EOD id) still has its document boundaries."""
    docs = [np.arange(1, 6), np.arange(10, 13), np.arange(20, 30)]
    prefix = write_store(str(tmp_path / "noeod"), docs, vocab_size=VOCAB, eod_id=None)
    source = StoreBlendSource.from_prefixes([prefix], [1.0], num_samples=2, seq_length=8, seed=0)
    fields = read_batch(SampleStream(source), np.arange(2), MASKING)
    where = source.where(np.arange(2))
    for k, origin in enumerate(where):
        lengths = [p.length for p in origin.pieces]
        np.testing.assert_array_equal(fields["cu_seqlens"][k], _reference_boundaries(lengths, 8, True)[0])
        # each inner boundary is where a document of the store starts in the row
        row = source[k]
        cu = fields["cu_seqlens"][k]
        for j in range(1, len(lengths)):
            assert row[cu[j]] == docs[origin.pieces[j].document][0]


def test_options_megatron_core_does_not_combine_are_refused():
    with pytest.raises(ConfigError, match="inter_document_masking=True, create_attention_mask=True"):
        SampleOptions(inter_document_masking=True, create_attention_mask=True)
    with pytest.raises(ConfigError, match="inter_document_masking=1"):
        SampleOptions(inter_document_masking=1)
    assert MASKING.field_names == ("tokens", "labels", "loss_mask", "position_ids", "cu_seqlens", "max_seqlen")


def test_a_source_without_pieces_is_refused_by_name(tmp_path):
    class TokensOnly:  # a SampleSource of someone else's: tokens, no document pieces
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            if name == "read_pieces":
                raise AttributeError(name)
            return getattr(self.inner, name)

    prefix = write_store(str(tmp_path / "s"), [np.arange(1, 9)], vocab_size=VOCAB, eod_id=EOD)
    source = TokensOnly(StoreBlendSource.from_prefixes([prefix], [1.0], num_samples=1, seq_length=4, seed=0))
    with pytest.raises(ConfigError, match="TokensOnly has no read_pieces"):
        BatchPipeline(source, options=MASKING)


def test_every_pipeline_stage_gets_the_boundaries_and_context_parallel_keeps_them_whole(tmp_path):
    """pp=3: the middle stage reads cu_seqlens and max_seqlen only; cp=2 ranks cut the sequence
    fields but hold the whole sample's boundaries (as Megatron-LM's per-sequence split does)."""
    rng = np.random.default_rng(4)
    docs = [np.append(rng.integers(0, EOD, int(n)), EOD) for n in rng.integers(1, 20, 40)]
    prefix = write_store(str(tmp_path / "s"), docs, vocab_size=VOCAB, eod_id=EOD)
    source = StoreBlendSource.from_prefixes([prefix], [1.0], num_samples=48, seq_length=16, seed=2)
    geometry = BatchGeometry(global_batch_size=4, micro_batch_size=2, dp=1)
    whole = next(iter(RankLoader(source, geometry, options=MASKING, max_steps=1)))
    topology = Topology(dp=1, pp=3)
    stages = [next(iter(RankLoader(source, geometry, topology=topology, rank=topology.rank_of(pp_rank=p),
                                   options=MASKING, max_steps=1))) for p in range(3)]
    assert sorted(stages[0]) == ["cu_seqlens", "dataset_id", "max_seqlen", "position_ids", "tokens"]
    assert sorted(stages[1]) == ["cu_seqlens", "dataset_id", "max_seqlen"]
    assert sorted(stages[2]) == ["cu_seqlens", "dataset_id", "labels", "loss_mask", "max_seqlen"]
    for stage in stages:
        for name, value in stage.items():
            np.testing.assert_array_equal(value, whole[name])
    topology = Topology(dp=1, cp=2)
    for cp_rank in range(2):
        part = next(iter(RankLoader(source, geometry, topology=topology, rank=topology.rank_of(cp_rank=cp_rank),
                                    options=MASKING, max_steps=1)))
        np.testing.assert_array_equal(part["cu_seqlens"], whole["cu_seqlens"])
        np.testing.assert_array_equal(part["max_seqlen"], whole["max_seqlen"])
        assert part["tokens"].shape == (2, 8)
    schema = field_schema(source, 2, options=MASKING)
    assert {k: (v.shape, v.dtype) for k, v in schema.items()} == {k: (v.shape, v.dtype) for k, v in whole.items()}


def test_a_simulated_dp_tp_pp_cp_job_serves_the_one_process_boundaries(tmp_path):
    """dp=2 x tp=2 x pp=3 x cp=2 with boundaries: the reassembled global batches (sequence fields
    from the cp chunks, boundaries whole) equal what one process reads."""
    from tokenloom.serve.simulate import simulate_job

    rng = np.random.default_rng(9)
    docs = [np.append(rng.integers(0, EOD, int(n)), EOD) for n in rng.integers(1, 30, 60)]
    prefix = write_store(str(tmp_path / "s"), docs, vocab_size=VOCAB, eod_id=EOD)
    source = StoreBlendSource.from_prefixes([prefix], [1.0], num_samples=64, seq_length=16, seed=3)
    geometry = BatchGeometry(global_batch_size=8, micro_batch_size=2, dp=2)
    report = simulate_job(source, geometry, Topology(dp=2, tp=2, pp=3, cp=2), num_steps=2, options=MASKING)
    for step, batch in enumerate(report.global_batches):
        expected = read_batch(SampleStream(source), np.arange(step * 8, step * 8 + 8), MASKING)
        assert sorted(batch) == sorted(expected)
        for name, value in expected.items():
            np.testing.assert_array_equal(batch[name], value, err_msg=f"step {step} {name}")


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(seq_length=st.integers(2, 40), micro=st.integers(1, 5), seed=st.integers(0, 2**31),
       corpus_seed=st.integers(0, 1000), extra=st.booleans(), empty_rate=st.sampled_from([0.0, 0.2]))
def test_packed_thd_equals_megatron_cores_flattened_batch(tmp_path_factory, seq_length, micro, seed, corpus_seed,
                                                          extra, empty_rate):
    """boundary_format='thd': each micro-batch's cu_seqlens and max_seqlen are what megatron-core's
    flatten_batch_for_packed_sequences makes of its own collated samples (numpy and torch paths)."""
    torch = pytest.importorskip("torch")
    from megatron.core.utils import flatten_batch_for_packed_sequences

    from tokenloom.serve.batch import pack_documents

    directory = tmp_path_factory.mktemp("thd")
    prefixes = _corpus(directory, 2, seed=corpus_seed, max_length=50, empty_rate=empty_rate)
    theirs = megatron_blended(prefixes, [0.5, 0.5], num_samples=40, seq_length=seq_length, seed=seed,
                              cache_dir=directory / "cache", create_attention_mask=False, add_extra_token=extra,
                              inter_document_masking=True)
    source = StoreBlendSource.from_prefixes(prefixes, [0.5, 0.5], num_samples=40, seq_length=seq_length, seed=seed,
                                            add_extra_token=extra)
    thd = SampleOptions(inter_document_masking=True, boundary_format="thd")
    stream = SampleStream(source)
    for begin in range(0, len(theirs) - micro + 1, micro):
        try:
            samples = [theirs[i] for i in range(begin, begin + micro)]
        except RuntimeError:  # a sample with more documents than cu_seqlens can list (see above)
            continue
        collated = {k: torch.stack([torch.as_tensor(s[k]) for s in samples]) for k in samples[0]}
        flat = flatten_batch_for_packed_sequences(collated)
        ours = read_batch(stream, np.arange(begin, begin + micro), thd)
        assert ours["cu_seqlens"].dtype == np.int32 and ours["max_seqlen"].dtype == np.int32
        np.testing.assert_array_equal(ours["cu_seqlens"], flat["cu_seqlens"][0].numpy())
        assert ours["max_seqlen"].shape == () and int(ours["max_seqlen"]) == int(flat["max_seqlen"][0])
        np.testing.assert_array_equal(ours["tokens"].reshape(1, -1), flat["tokens"].numpy())
        per_sample = read_batch(stream, np.arange(begin, begin + micro), MASKING)
        on_torch = pack_documents({k: torch.from_numpy(v) for k, v in per_sample.items()}, seq_length)
        np.testing.assert_array_equal(on_torch["cu_seqlens"].numpy(), ours["cu_seqlens"])
        assert on_torch["cu_seqlens"].dtype == torch.int32 and int(on_torch["max_seqlen"]) == int(ours["max_seqlen"])


def _segments_reference(lengths, seq_length: int, add_extra_token: bool) -> np.ndarray:
    """MaxText's segment ids of one sample: its documents with input tokens numbered from 1 (by
    megatron-core's pieces), 0 on the padding past the row's tokens."""
    cu, _, _ = _reference_boundaries(lengths, seq_length, add_extra_token)
    segments = np.zeros(seq_length, dtype=np.int32)
    number = 0
    for start, stop in itertools.pairwise(cu):
        if stop > start:
            number += 1
            segments[start:stop] = number
    segments[sum(int(n) for n in lengths):] = 0
    return segments


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(seq_length=st.integers(1, 40), seed=st.integers(0, 2**31), extra=st.booleans(),
       empty_rate=st.sampled_from([0.0, 0.2]), keep_partial=st.booleans(), data=st.data())
def test_segment_ids_and_document_ids_number_the_documents(tmp_path_factory, seq_length, seed, extra, empty_rate,
                                                           keep_partial, data):
    """inputs_segmentation / document_ids: the sample's non-empty documents from 1, 0 on padding
    (the valid split's short last sample); inputs_position restarts per document. Both backends."""
    directory = tmp_path_factory.mktemp("segments")
    prefixes = _corpus(directory, 2, seed=seed % 997, max_length=40, empty_rate=empty_rate)
    try:
        source = StoreBlendSource.from_prefixes(prefixes, [0.5, 0.5], num_samples=30, seq_length=seq_length,
                                                seed=seed, add_extra_token=extra, split="6,4,0", split_name="valid",
                                                drop_last_partial=not keep_partial)
    except BuildError:  # a split ending in an empty document keeps no short sample (megatron-core refuses it too)
        assume(False)
    positions = np.array(data.draw(st.lists(st.integers(0, source.num_samples - 1), min_size=1, max_size=10)))
    segments = SampleOptions(inter_document_masking=True, boundary_format="segments")
    thd = SampleOptions(inter_document_masking=True, boundary_format="thd")
    dataset_ids, sample_ids = source.locate(positions)
    for backend in ("numba", "numpy"):
        source.backend = backend
        try:
            jax_fields = BatchPipeline(source, options=segments).read(dataset_ids, sample_ids)
        except InputError:  # more documents than cu_seqlens can list
            continue
        torch_fields = BatchPipeline(source, options=thd).read_samples_fields(dataset_ids, sample_ids)
        assert sorted(jax_fields) == ["dataset_id", "inputs_position", "inputs_segmentation", "labels", "loss_mask",
                                      "position_ids", "tokens"]
        for k in range(positions.shape[0]):
            spans = source.readers[int(dataset_ids[k])].spans(sample_ids[k:k + 1])
            expected = _segments_reference(spans.lengths, seq_length, extra)
            np.testing.assert_array_equal(jax_fields["inputs_segmentation"][k], expected)
            np.testing.assert_array_equal(torch_fields["document_ids"][k], expected)
            positions_expected = _reference_boundaries(spans.lengths, seq_length, extra)[2]
            np.testing.assert_array_equal(jax_fields["inputs_position"][k], positions_expected)
            assert jax_fields["inputs_segmentation"].dtype == np.int32 == jax_fields["inputs_position"].dtype


def test_boundary_formats_are_checked_and_thd_is_refused_where_rows_are_assembled():
    from tokenloom.serve.jax_adapter import HostLoader, ShardOptions
    from tokenloom.serve.simulate import simulate_job

    with pytest.raises(ConfigError, match="boundary_format='packed'; expected one of"):
        SampleOptions(inter_document_masking=True, boundary_format="packed")
    with pytest.raises(ConfigError, match="needs inter_document_masking=True"):
        SampleOptions(boundary_format="thd")
    thd = SampleOptions(inter_document_masking=True, boundary_format="thd")
    assert thd.field_names[-3:] == ("cu_seqlens", "max_seqlen", "document_ids")
    with pytest.raises(ConfigError, match="boundary_format='segments'"):
        HostLoader(None, global_batch_size=8, shard=ShardOptions(shard_index=0, shard_count=1), options=thd)
    with pytest.raises(ConfigError, match="simulate with boundary_format='megatron'"):
        simulate_job(None, None, Topology(dp=1), num_steps=1, options=thd)


def _te_partitioned_indices(cu_seqlens, total_tokens: int, world_size: int, rank: int) -> list[int]:
    """Transformer Engine's ``thd_get_partitioned_indices``, from its documentation: every
    sequence of ``cu_seqlens`` (lengths multiples of 2 x world_size) is cut into 2 x world_size
    equal chunks and ``rank`` takes chunks ``rank`` and ``2 x world_size - 1 - rank``, sequence
    after sequence."""
    out = []
    for start, stop in itertools.pairwise([int(c) for c in cu_seqlens]):
        chunk = (stop - start) // (2 * world_size)
        for part in (rank, 2 * world_size - 1 - rank):
            out.extend(range(start + part * chunk, start + (part + 1) * chunk))
    assert all(0 <= i < total_tokens for i in out)
    return out


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(seq_length=st.integers(2, 40), micro=st.integers(1, 4), cp=st.sampled_from([2, 3, 4]),
       seed=st.integers(0, 2**31), extra=st.booleans(), empty_rate=st.sampled_from([0.0, 0.2]))
def test_context_parallel_ranks_hold_transformer_engines_thd_chunks_of_every_document(
        tmp_path_factory, seq_length, micro, cp, seed, extra, empty_rate):
    """boundary_format='thd' with cp > 1: documents padded to a multiple of 2 x cp, every rank the
    two chunks of each that Transformer Engine's partitioning gives it; together the ranks hold
    every token of the micro-batch once. numpy and torch alike."""
    torch = pytest.importorskip("torch")
    from tokenloom.serve.batch import finish_micro_batch

    directory = tmp_path_factory.mktemp("cp")
    prefixes = _corpus(directory, 1, seed=seed % 991, max_length=50, empty_rate=empty_rate)
    source = StoreBlendSource.from_prefixes(prefixes, [1.0], num_samples=24, seq_length=seq_length, seed=seed,
                                            add_extra_token=extra)
    thd = SampleOptions(inter_document_masking=True, boundary_format="thd")
    try:
        whole = BatchPipeline(source, options=thd).read_samples_fields(np.zeros(micro, np.int64), np.arange(micro))
    except InputError:  # more documents than cu_seqlens can list
        return
    packed = read_batch(SampleStream(source), np.arange(micro), thd)  # the same micro-batch, cp = 1
    ends = packed["cu_seqlens"].astype(np.int64)
    flat = {name: whole[name].reshape(-1) for name in ("tokens", "labels", "loss_mask")}
    # the reference padded sequence, document by document
    padded_ends, reference = [0], {name: [] for name in ("tokens", "labels", "loss_mask", "position_ids",
                                                          "document_ids")}
    for d, (start, stop) in enumerate(itertools.pairwise(ends)):
        length = int(stop - start)
        size = -(-length // (2 * cp)) * 2 * cp
        padded_ends.append(padded_ends[-1] + size)
        for name in ("tokens", "labels", "loss_mask"):
            reference[name].extend([*flat[name][start:stop].tolist(), *[0] * (size - length)])
        reference["position_ids"].extend(range(size))
        reference["document_ids"].extend([d + 1] * size)
    total = padded_ends[-1]
    seen = []
    for rank in range(cp):
        indices = _te_partitioned_indices(padded_ends, total, cp, rank)
        seen.extend(indices)
        ours = finish_micro_batch(whole, thd, seq_length, cp_size=cp, cp_rank=rank)
        on_torch = finish_micro_batch({k: torch.from_numpy(v) for k, v in whole.items()}, thd, seq_length,
                                      cp_size=cp, cp_rank=rank)
        np.testing.assert_array_equal(ours["cu_seqlens"], ends)
        np.testing.assert_array_equal(ours["cu_seqlens_padded"], padded_ends)
        assert int(ours["max_seqlen"]) == max(np.diff(padded_ends), default=0)
        assert all(v % (2 * cp) == 0 for v in np.diff(padded_ends))
        for name, values in reference.items():
            expected = np.asarray(values)[indices]
            assert ours[name].shape == (1, total // cp), name
            np.testing.assert_array_equal(ours[name][0], expected, err_msg=f"rank {rank} {name}")
            np.testing.assert_array_equal(on_torch[name].numpy(), ours[name], err_msg=f"torch, rank {rank} {name}")
        for name in ("cu_seqlens", "cu_seqlens_padded", "max_seqlen"):
            np.testing.assert_array_equal(on_torch[name].numpy(), ours[name])
            assert on_torch[name].dtype == torch.int32 and ours[name].dtype == np.int32
    assert sorted(seen) == list(range(total))  # every padded position on exactly one rank


def test_context_parallel_loaders_and_distributed_batches_serve_the_thd_split(tmp_path):
    """A cp=2 job's loaders (RankLoader, and DistributedBatches through its whole-step DataLoader)
    give each cp rank the per-document chunks of the one-process micro-batch."""
    pytest.importorskip("torch")
    from tokenloom.serve.batch import finish_micro_batch
    from tokenloom.serve.torch_adapter import DistributedBatches

    rng = np.random.default_rng(12)
    docs = [np.append(rng.integers(0, EOD, int(n)), EOD) for n in rng.integers(1, 25, 80)]
    prefix = write_store(str(tmp_path / "s"), docs, vocab_size=VOCAB, eod_id=EOD)
    source = StoreBlendSource.from_prefixes([prefix], [1.0], num_samples=64, seq_length=16, seed=6)
    thd = SampleOptions(inter_document_masking=True, boundary_format="thd")
    geometry = BatchGeometry(global_batch_size=8, micro_batch_size=2, dp=2)
    topology = Topology(dp=2, cp=2)
    for dp_rank in range(2):
        per_sample = RankLoader(source, geometry, topology=Topology(dp=2), rank=dp_rank,
                                options=SampleOptions(inter_document_masking=True), max_steps=2)
        whole = [dict(b) for b in per_sample]
        for cp_rank in range(2):
            rank = topology.rank_of(dp_rank=dp_rank, cp_rank=cp_rank)
            loaded = list(RankLoader(source, geometry, topology=topology, rank=rank, options=thd, max_steps=2))
            batches = DistributedBatches(source, geometry, topology, rank, options=thd, num_workers=1, max_steps=2,
                                         mode="every_rank")
            distributed = [batches.next_batch() for _ in range(len(loaded))]
            assert len(loaded) == len(whole) == 4
            for n, batch in enumerate(loaded):
                # the split numbers the documents anew over the micro-batch: any (B, S) document_ids will do
                unsplit = {**whole[n], "document_ids": np.zeros_like(whole[n]["tokens"], dtype=np.int32)}
                expected = finish_micro_batch(unsplit, thd, 16, cp_size=2, cp_rank=cp_rank)
                assert "cu_seqlens_padded" in batch and batch["tokens"].shape[0] == 1
                for name in ("tokens", "labels", "loss_mask", "position_ids", "document_ids", "cu_seqlens",
                             "cu_seqlens_padded", "max_seqlen", "dataset_id"):
                    np.testing.assert_array_equal(batch[name], expected[name], err_msg=f"{rank} {n} {name}")
                    np.testing.assert_array_equal(distributed[n][name].numpy(), batch[name],
                                                  err_msg=f"DistributedBatches {rank} {n} {name}")


def test_the_packed_ends_are_the_same_without_numba(monkeypatch):
    """The numpy fallback of the packing kernel (platforms without numba) against the kernel."""
    import tokenloom.serve.packed as packed

    rng = np.random.default_rng(3)
    seq_length = 30
    cu = np.full((5, seq_length + 1), seq_length, dtype=np.int32)
    cu[:, 0] = 0
    for row in cu:
        cuts = np.sort(rng.integers(0, seq_length, int(rng.integers(0, 6))))
        row[1:cuts.shape[0] + 1] = cuts
    compiled_ends = packed._packed_ends(cu, seq_length)
    monkeypatch.setattr(packed, "numba_available", lambda: False)
    np.testing.assert_array_equal(packed._packed_ends(cu, seq_length), compiled_ends)
    assert compiled_ends[0] == 0 and compiled_ends[-1] == 5 * seq_length
