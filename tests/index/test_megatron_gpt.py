"""The Megatron-exact packed-sample index, checked against megatron-core 0.19.2 itself, against a
slow reference built from the definition of a sample, and against golden arrays."""

from __future__ import annotations

import json
import logging
import pathlib
import tempfile
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from index_fixtures import ArrayReader, numbered_documents
from tokenloom.errors import BuildError, ConfigError
from tokenloom.index.epochs import plan_epochs
from tokenloom.index.kernels import numba_available
from tokenloom.index.megatron_gpt import (
    SAMPLE_INDEX_KERNELS,
    build_megatron_gpt_indices,
    build_sample_index,
    megatron_gpt_sample,
    sample_index_dtype,
    shuffle_index_dtype,
)
from tokenloom.index.split import document_ids, split_document_ranges
from tokenloom.io import IndexedDataset as TokenloomStore

GOLDEN = pathlib.Path(__file__).resolve().parents[1] / "golden" / "index"
SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
KERNELS = sorted(k for k in SAMPLE_INDEX_KERNELS if k != "numba" or numba_available())


# ---------------------------------------------------------------- helpers


def _megatron():
    pytest.importorskip("megatron.core")
    warnings.filterwarnings("ignore", module="megatron")
    logging.getLogger("megatron").setLevel(logging.ERROR)
    from megatron.core.datasets import gpt_dataset
    from megatron.core.datasets.utils import Split
    from megatron.core.tokenizers import MegatronTokenizer

    return gpt_dataset, Split, MegatronTokenizer


class _Lengths:
    """The only part of a low-level dataset megatron-core reads to build indices."""

    def __init__(self, lengths):
        self.sequence_lengths = lengths


def megatron_indices(lengths, ids, *, num_samples, seq_length, seed, extra, valid, drop):
    gpt_dataset, Split, MegatronTokenizer = _megatron()
    config = gpt_dataset.GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length,
        tokenizer=MegatronTokenizer.from_pretrained(metadata_path={"library": "null-text"}, vocab_size=512),
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        add_extra_token_to_sequence=extra, drop_last_partial_validation_sequence=drop,
    )
    split = Split.valid if valid else Split.train
    dataset = gpt_dataset.GPTDataset(_Lengths(lengths), None, ids, num_samples, split, config)
    return dataset.document_index, dataset.sample_index, dataset.shuffle_index


def reference_sample_index(lengths, document_index, seq_length, num_samples, extra):
    """From the definition: sample k starts at global token k * seq_length; its boundary row names
    the document holding the last token of the window before it and the offset just past that
    token minus the shared extra token (megatron-core's convention). Past the last token: the last
    document at its length minus the extra token. Row 0 is (0, 0)."""
    position_of_token, offset_of_token = [], []
    for position, document in enumerate(document_index.tolist()):
        for offset in range(int(lengths[document])):
            position_of_token.append(position)
            offset_of_token.append(offset)
    rows = [(0, 0)]
    last = document_index.shape[0] - 1
    for k in range(1, num_samples + 1):
        token = k * seq_length + extra - 1
        if token < len(position_of_token):
            rows.append((position_of_token[token], offset_of_token[token] + 1 - extra))
        else:
            rows.append((last, int(lengths[document_index[last]]) - extra))
    return np.array(rows, dtype=np.int64).reshape(-1, 2)


def assert_same_array(theirs, ours):
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    np.testing.assert_array_equal(ours, theirs)


# ---------------------------------------------------------------- strategies

lengths_strategy = st.one_of(
    st.lists(st.integers(1, 4), min_size=1, max_size=60),  # tiny documents
    st.lists(st.integers(1, 400), min_size=1, max_size=30),  # documents longer than seq_length
    st.lists(st.integers(0, 30), min_size=1, max_size=30),  # with empty documents
    st.integers(1, 500).map(lambda n: [n]),  # one document
).map(lambda v: np.array(v, dtype=np.int32))

seeds = st.one_of(st.integers(0, 2**32 - 1), st.sampled_from([0, 1, 1234, 2**31 - 1, 2**32 - 1]))


@st.composite
def configs(draw, max_epochs=25):
    lengths = draw(lengths_strategy)
    first = draw(st.integers(0, lengths.shape[0]))  # the last choice: a split of no documents
    ids = np.arange(first, lengths.shape[0], dtype=np.int32)
    tokens = int(lengths[ids].sum())
    seq_length = draw(st.integers(1, 80))
    num_samples = None if tokens == 0 else draw(st.one_of(
        st.none(), st.just(0), st.integers(0, max(tokens // seq_length, 1)),
        st.integers(0, max_epochs * tokens // seq_length),  # many epochs
    ))
    return dict(lengths=lengths, ids=ids, num_samples=num_samples, seq_length=seq_length,
                seed=draw(seeds), extra=draw(st.booleans()), valid=draw(st.booleans()),
                drop=draw(st.booleans()))


def ours(config, kernel=None):
    drop = config["drop"] or not config["valid"]
    return build_megatron_gpt_indices(
        config["lengths"], config["ids"], num_samples=config["num_samples"],
        seq_length=config["seq_length"], seed=config["seed"], add_extra_token=config["extra"],
        drop_last_partial=drop, kernel=kernel,
    )


# ---------------------------------------------------------------- differential: megatron-core


@SETTINGS
@given(config=configs())
def test_indices_match_megatron_core(config):
    try:
        theirs = megatron_indices(config["lengths"], config["ids"], num_samples=config["num_samples"],
                                  seq_length=config["seq_length"], seed=config["seed"],
                                  extra=config["extra"], valid=config["valid"], drop=config["drop"])
    except (AssertionError, ValueError):
        # megatron-core's final-epoch or int32-range assertion, or its reduction over an empty
        # index: ours refuses the same input
        for kernel in KERNELS:
            with pytest.raises((ConfigError, BuildError)):
                ours(config, kernel)
        return
    for kernel in KERNELS:
        mine = ours(config, kernel)
        for their_array, my_array in zip(theirs, (mine.document_index, mine.sample_index,
                                                  mine.shuffle_index)):
            assert_same_array(their_array, my_array)
        assert len(mine) == theirs[1].shape[0] - 1


def test_separate_final_epoch_matches_megatron_core():
    """1.5 epochs: the final epoch's documents and samples are shuffled apart."""
    lengths = np.arange(1, 101, dtype=np.int32)
    ids = np.arange(100, dtype=np.int32)
    num_samples = int(1.5 * lengths.sum() / 16)
    mine = build_megatron_gpt_indices(lengths, ids, num_samples=num_samples, seq_length=16, seed=5)
    assert mine.plan.separate_final_epoch and mine.plan.num_epochs == 2
    # the final epoch is a permutation by itself, the first samples never mix with the last ones
    assert sorted(mine.document_index[100:].tolist()) == list(range(100))
    split_at = mine.plan.num_samples_sans_final_epoch
    assert mine.shuffle_index[:split_at].max() < split_at <= mine.shuffle_index[split_at:].min()
    theirs = megatron_indices(lengths, ids, num_samples=num_samples, seq_length=16, seed=5,
                              extra=True, valid=False, drop=True)
    for their_array, my_array in zip(theirs, (mine.document_index, mine.sample_index,
                                              mine.shuffle_index)):
        assert_same_array(their_array, my_array)


def _write_store(prefix, documents):
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for document in documents:
        builder.add_item(torch.from_numpy(document.astype(np.int32)))
        builder.end_document()
    builder.finalize(prefix + ".idx")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.integers(1, 120), min_size=3, max_size=40),
       split=st.sampled_from(["969,30,1", "8,1,1", "1,1,1", "2,1", "1"]),
       sizes=st.tuples(st.one_of(st.none(), st.integers(0, 300)), st.one_of(st.none(), st.integers(0, 60)),
                       st.one_of(st.none(), st.integers(0, 30))),
       seq_length=st.integers(2, 48), seed=seeds, extra=st.booleans(), drop=st.booleans())
def test_real_store_samples_match_megatron_core(lengths, split, sizes, seq_length, seed, extra, drop):
    """Whole pipeline through megatron-core's builder: split string, every split's arrays (all from
    the same seed), and every sample's tokens read back through __getitem__."""
    gpt_dataset, Split, MegatronTokenizer = _megatron()
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    lengths = np.array(lengths, dtype=np.int32)
    documents = [(np.arange(n) * 7 + d) % 500 + 1 for d, n in enumerate(lengths.tolist())]
    with tempfile.TemporaryDirectory() as directory:
        prefix = str(pathlib.Path(directory) / "store")
        _write_store(prefix, documents)
        config = gpt_dataset.GPTDatasetConfig(
            random_seed=seed, sequence_length=seq_length, blend=([prefix], None), split=split,
            path_to_cache=str(pathlib.Path(directory) / "cache"),
            tokenizer=MegatronTokenizer.from_pretrained(metadata_path={"library": "null-text"}, vocab_size=512),
            reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
            add_extra_token_to_sequence=extra, drop_last_partial_validation_sequence=drop,
        )
        ranges = split_document_ranges(split, lengths.shape[0])
        # megatron-core loops forever drawing a number of samples from an empty split
        sizes = tuple(
            None if document_range is not None and document_range.num_documents == 0 else size
            for document_range, size in zip(ranges, sizes)
        )
        try:
            datasets = BlendedMegatronDatasetBuilder(gpt_dataset.GPTDataset, list(sizes),
                                                     lambda: True, config).build()
        except AssertionError:  # megatron-core's final-epoch assertion: ours refuses too
            with pytest.raises((ConfigError, BuildError)):
                for document_range, size in zip(ranges, sizes):
                    if document_range is not None:
                        build_megatron_gpt_indices(lengths, document_ids(document_range),
                                                   num_samples=size, seq_length=seq_length,
                                                   seed=seed, add_extra_token=extra)
            return
        reader = IndexedDataset(prefix)
        store = TokenloomStore(prefix)  # tokenloom's own reader of the store megatron-core wrote
        np.testing.assert_array_equal(store.sequence_lengths, lengths)
        for split_kind, document_range, size, theirs in zip(Split, ranges, sizes, datasets):
            if document_range is None:
                assert theirs is None
                continue
            mine = build_megatron_gpt_indices(
                store.sequence_lengths, document_ids(document_range), num_samples=size,
                seq_length=seq_length,
                seed=seed, add_extra_token=extra,
                drop_last_partial=drop or split_kind is not Split.valid,
            )
            for their_array, my_array in zip(
                (theirs.document_index, theirs.sample_index, theirs.shuffle_index),
                (mine.document_index, mine.sample_index, mine.shuffle_index),
            ):
                assert_same_array(np.asarray(their_array), my_array)
            memory_reader = ArrayReader(documents)
            event(f"{split_kind.name} split built")
            for i in range(len(mine)):
                text, their_ids, their_lengths = theirs._query_document_sample_shuffle_indices(i)
                sample = megatron_gpt_sample(mine, reader, i, pad_token_id=theirs._pad_token_id)
                assert_same_array(text, sample.tokens)
                assert_same_array(their_ids, sample.document_ids)
                assert list(sample.document_lengths) == their_lengths
                from_memory = megatron_gpt_sample(mine, memory_reader, i, pad_token_id=-1)
                np.testing.assert_array_equal(from_memory.tokens, text)
                from_store = megatron_gpt_sample(mine, store, i, pad_token_id=-1)
                np.testing.assert_array_equal(from_store.tokens, text)
                item = theirs[i]
                served = sample.tokens[:-1] if extra else sample.tokens
                np.testing.assert_array_equal(item["tokens"].numpy(), np.where(served == -1, 0, served))


# ---------------------------------------------------------------- kernels against the definition


@SETTINGS
@given(config=configs(max_epochs=8), kernel=st.sampled_from(KERNELS))
def test_sample_index_kernels_match_reference(config, kernel):
    drop = config["drop"] or not config["valid"]
    plan = plan_epochs(config["lengths"], config["ids"], num_samples=config["num_samples"],
                       seq_length=config["seq_length"], add_extra_token=config["extra"],
                       drop_last_partial=drop) if _plannable(config) else None
    assume(plan is not None)
    if plan.num_samples_in_index < 0:
        with pytest.raises(BuildError, match="fails on this input"):
            build_sample_index(config["lengths"], config["ids"], plan, kernel=kernel)
        return
    rng = np.random.default_rng(config["seed"])
    document_index = np.tile(config["ids"], plan.num_epochs)
    rng.shuffle(document_index)
    expected = reference_sample_index(config["lengths"], document_index, plan.seq_length,
                                      plan.num_samples_in_index, int(plan.add_extra_token))
    if expected[-1, 1] < 0:
        with pytest.raises(BuildError, match="empty"):
            build_sample_index(config["lengths"], document_index, plan, kernel=kernel)
        return
    got = build_sample_index(config["lengths"], document_index, plan, kernel=kernel)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, expected)


def _plannable(config):
    try:
        plan_epochs(config["lengths"], config["ids"], num_samples=config["num_samples"],
                    seq_length=config["seq_length"], add_extra_token=config["extra"])
    except ConfigError:
        return False
    return True


def _try_ours(config):
    """Our indices, or None where megatron-core too refuses the input (see the differential test)."""
    try:
        return ours(config)
    except (ConfigError, BuildError):
        return None


def test_numpy_kernel_chunks_agree():
    rng = np.random.default_rng(3)
    lengths = rng.integers(0, 50, 5000).astype(np.int32)
    lengths[-1] = 9
    document_index = rng.permutation(np.tile(np.arange(5000, dtype=np.int32), 3))
    document_index[-1] = 4999
    plan = plan_epochs(lengths, np.arange(5000), num_samples=int(2.5 * lengths.sum() / 13),
                       seq_length=13, drop_last_partial=False)
    out = {}
    for chunk in (7, 1000, 1 << 22):
        sample_index = np.empty((plan.num_samples_in_index + 1, 2), np.int32)
        SAMPLE_INDEX_KERNELS["numpy"](lengths, document_index, 13, plan.num_samples_in_index, 1,
                                      sample_index, chunk=chunk)
        out[chunk] = sample_index
    np.testing.assert_array_equal(out[7], out[1 << 22])
    np.testing.assert_array_equal(out[1000], out[1 << 22])
    np.testing.assert_array_equal(out[7], build_sample_index(lengths, document_index, plan))
    np.testing.assert_array_equal(out[7], build_sample_index(lengths, document_index, plan,
                                                             kernel="python"))


# ---------------------------------------------------------------- properties


@SETTINGS
@given(config=configs(max_epochs=6))
def test_every_token_in_exactly_one_sample_position(config):
    mine = _try_ours(config)
    assume(mine is not None)
    plan, lengths = mine.plan, config["lengths"]
    extra = int(plan.add_extra_token)
    reader = ArrayReader(numbered_documents(lengths))
    stream = np.concatenate([reader.documents[d] for d in mine.document_index.tolist()] + [np.empty(0, np.int64)])
    order = np.argsort(mine.shuffle_index, kind="stable")  # sample k is served at order[k]
    samples = [megatron_gpt_sample(mine, reader, int(order[k])) for k in range(len(mine))]
    pieces = []
    for k, sample in enumerate(samples):
        assert sample.tokens.shape == (plan.seq_length + extra,)
        real = sample.tokens[: sum(sample.document_lengths)]
        if real.shape[0] < sample.tokens.shape[0]:  # only the kept partial last sample is short
            assert not plan.drop_last_partial and k >= len(mine) - 2
            assert (sample.tokens[real.shape[0]:] == -1).all()
        np.testing.assert_array_equal(real, stream[k * plan.seq_length: k * plan.seq_length + real.shape[0]])
        if extra and k + 1 < len(samples) and real.shape[0] == sample.tokens.shape[0]:
            assert sample.tokens[-1] == samples[k + 1].tokens[0]  # the shared extra token
        pieces.append(real[: plan.seq_length])
    served = np.concatenate(pieces) if pieces else np.empty(0, np.int64)
    # every token of every epoch appears once, in order; only a tail shorter than a sample is left
    np.testing.assert_array_equal(served, stream[: served.shape[0]])
    assert stream.shape[0] - served.shape[0] < plan.seq_length + extra or not plan.drop_last_partial


@SETTINGS
@given(config=configs(max_epochs=6))
def test_shuffles_are_permutations_and_deterministic(config):
    mine = _try_ours(config)
    assume(mine is not None)
    again = ours(config)
    plan = mine.plan
    for a, b in zip((mine.document_index, mine.sample_index, mine.shuffle_index),
                    (again.document_index, again.sample_index, again.shuffle_index)):
        assert_same_array(a, b)
    np.testing.assert_array_equal(np.sort(mine.shuffle_index), np.arange(len(mine)))
    epochs = mine.document_index.reshape(plan.num_epochs, -1)
    np.testing.assert_array_equal(np.sort(mine.document_index),
                                  np.sort(np.tile(config["ids"], plan.num_epochs)))
    if plan.separate_final_epoch:
        np.testing.assert_array_equal(np.sort(epochs[-1]), config["ids"])


@SETTINGS
@given(lengths=st.lists(st.integers(1, 60), min_size=12, max_size=40).map(lambda v: np.array(v, np.int32)),
       seed=seeds, other=seeds)
def test_different_seed_different_order(lengths, seed, other):
    assume(seed != other)
    ids = np.arange(lengths.shape[0])
    a = build_megatron_gpt_indices(lengths, ids, num_samples=None, seq_length=2, seed=seed)
    b = build_megatron_gpt_indices(lengths, ids, num_samples=None, seq_length=2, seed=other)
    assert not np.array_equal(a.document_index, b.document_index)
    assert not np.array_equal(a.shuffle_index, b.shuffle_index)


def test_dtype_switches_at_megatron_thresholds():
    assert sample_index_dtype(2**31 - 1) == np.int32 and sample_index_dtype(2**31) == np.int64
    assert shuffle_index_dtype(2**32 - 3) == np.uint32 and shuffle_index_dtype(2**32 - 2) == np.int64


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("kwargs, match", [
    (dict(seed=-1), "seed=-1"),
    (dict(seed=2**32), "seed=4294967296"),
    (dict(kernel="fortran"), "kernel='fortran'"),
])
def test_build_rejects_bad_arguments(kwargs, match):
    arguments = dict(num_samples=3, seq_length=2, seed=0) | kwargs
    with pytest.raises(ConfigError, match=match):
        build_megatron_gpt_indices(np.array([5, 3], np.int32), np.arange(2), **arguments)


def test_build_rejects_bad_inputs():
    with pytest.raises(ConfigError, match="document_ids span"):
        build_megatron_gpt_indices(np.array([5, 3], np.int32), np.array([0, 2]), num_samples=1,
                                   seq_length=2, seed=0)
    with pytest.raises(ConfigError, match="sequence_lengths span"):
        build_megatron_gpt_indices(np.array([5, -3]), np.arange(2), num_samples=1, seq_length=2, seed=0)
    with pytest.raises(ConfigError, match="1-D integer"):
        build_megatron_gpt_indices(np.array([5.0, 3.0]), np.arange(2), num_samples=1, seq_length=2, seed=0)


def test_empty_last_document_on_the_partial_path_is_refused():
    with pytest.raises(BuildError, match="empty"):
        build_megatron_gpt_indices(np.array([5, 0], np.int32), np.array([1, 0]), num_samples=None,
                                   seq_length=3, seed=0, drop_last_partial=False)


def test_sample_lookup_rejects_out_of_range_index():
    indices = build_megatron_gpt_indices(np.array([5, 3], np.int32), np.arange(2), num_samples=None,
                                         seq_length=3, seed=0)
    with pytest.raises(ConfigError, match="index=2"):
        megatron_gpt_sample(indices, ArrayReader(numbered_documents(np.array([5, 3]))), 2)


# ---------------------------------------------------------------- golden arrays


def _golden_cases():
    manifest = GOLDEN / "cases.json"
    return json.loads(manifest.read_text()) if manifest.exists() else []


@pytest.mark.parametrize("case", _golden_cases(), ids=lambda case: case["name"])
def test_golden_arrays_from_megatron_core(case):
    lengths = np.load(GOLDEN / f"{case['name']}-sequence_lengths.npy")
    mine = build_megatron_gpt_indices(
        lengths, np.arange(case["first_document"], lengths.shape[0], dtype=np.int32),
        num_samples=case["num_samples"], seq_length=case["seq_length"], seed=case["seed"],
        add_extra_token=case["add_extra_token"], drop_last_partial=case["drop_last_partial"],
    )
    for name in ("document_index", "sample_index", "shuffle_index"):
        assert_same_array(np.load(GOLDEN / f"{case['name']}-{name}.npy"), getattr(mine, name))


def test_golden_cases_present():
    assert len(_golden_cases()) >= 6, "run tests/golden/make_index_golden.py"
