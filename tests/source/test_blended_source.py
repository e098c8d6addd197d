"""The one blended source: the same class from a build and from memory, one reader per index kind,
positions out of range refused as PositionError (a ConfigError and an IndexError)."""

from __future__ import annotations

import numpy as np
import pytest

import tokenloom
from tokenloom.errors import ConfigError, PositionError
from tokenloom.index import build_megatron_gpt_indices
from tokenloom.index.blend_spec import BlendSpec
from tokenloom.index.megatron_gpt import megatron_gpt_sample
from tokenloom.io import IndexedDataset, IndexedDatasetWriter
from tokenloom.source import BlendedSource, SampleSource, StatelessBlendSource, StoreBlendSource
from tokenloom.source.blended import ArrayLocator, BlendLocator, DirectLocator
from tokenloom.source.keys import build_key
from tokenloom.source.readers import MegatronReader, StatelessReader


@pytest.fixture(scope="module")
def prefixes(tmp_path_factory):
    rng = np.random.default_rng(3)
    out = []
    for k in range(2):
        prefix = str(tmp_path_factory.mktemp("stores") / f"s{k}")
        with IndexedDatasetWriter(prefix, dtype=np.uint16) as writer:
            for _ in range(120):
                document = rng.integers(0, 99, size=int(rng.integers(1, 30)))
                document[-1] = 99
                writer.add_document(document)
            writer.finalize({"tokenizer": {"kind": "bytes", "vocab_size": 100, "eod_id": 99}})
        out.append(prefix)
    return out


def test_in_memory_sources_are_blended_sources_with_their_readers(prefixes):
    exact = StoreBlendSource.from_prefixes(prefixes, [0.6, 0.4], num_samples=50, seq_length=8)
    lean = StatelessBlendSource.from_prefixes(prefixes, [0.6, 0.4], num_samples=50, seq_length=8)
    assert isinstance(exact, BlendedSource) and isinstance(exact, SampleSource)
    assert all(isinstance(r, MegatronReader) for r in exact.readers)
    assert all(isinstance(r, StatelessReader) for r in lean.readers)
    assert isinstance(exact.locator, ArrayLocator) and isinstance(lean.locator, BlendLocator)
    assert exact.dataset_index is not None and exact.blend is None
    assert lean.blend is not None and lean.dataset_index is None


def test_a_build_gives_the_same_blended_source_as_memory(prefixes, tmp_path):
    config = {"seq_length": 8, "blend": {"prefixes": prefixes, "weights": [0.6, 0.4]}, "split": "1,0,0",
              "train_samples": 50, "valid_samples": 0, "test_samples": 0, "cache_dir": str(tmp_path / "cache")}
    built = tokenloom.build(config).split("train")
    memory = StoreBlendSource.from_prefixes(prefixes, [0.6, 0.4], num_samples=50, seq_length=8)
    assert type(built) is BlendedSource and isinstance(built.locator, ArrayLocator)
    assert [r.key is not None for r in built.readers] == [True, True]
    assert built.num_samples == memory.num_samples
    positions = np.arange(built.num_samples)
    np.testing.assert_array_equal(built.read_samples(*built.locate(positions)),
                                  memory.read_samples(*memory.locate(positions)))


def test_a_reader_reads_what_the_index_says(prefixes):
    store = IndexedDataset(prefixes[0])
    indices = build_megatron_gpt_indices(store.sequence_lengths, np.arange(store.num_sequences, dtype=np.int32),
                                         num_samples=20, seq_length=8, seed=5)
    reader = MegatronReader(name="s0", store=store, indices=indices)
    ids = np.array([3, 0, 19, 3])
    rows = reader.read(ids)
    for k, i in enumerate(ids):
        np.testing.assert_array_equal(rows[k], megatron_gpt_sample(indices, store, int(i)).tokens)


def test_a_single_dataset_is_read_directly(prefixes):
    store = IndexedDataset(prefixes[1])
    indices = build_megatron_gpt_indices(store.sequence_lengths, np.arange(store.num_sequences, dtype=np.int32),
                                         num_samples=10, seq_length=8, seed=5)
    source = BlendedSource(readers=[MegatronReader(name="s1", store=store, indices=indices)], weights=[1.0],
                           locator=DirectLocator(indices.num_samples), seq_length=8, add_extra_token=True,
                           build_key="k")
    dataset_ids, sample_ids = source.locate([0, 4, 9])
    assert dataset_ids.tolist() == [0, 0, 0] and sample_ids.tolist() == [0, 4, 9]
    np.testing.assert_array_equal(source[4], megatron_gpt_sample(indices, store, 4).tokens)


@pytest.mark.parametrize("kind", ["exact", "stateless"])
@pytest.mark.parametrize("positions", [[-1], [0, 50], [10**9]])
def test_positions_out_of_range_are_position_errors(prefixes, kind, positions):
    cls = StoreBlendSource if kind == "exact" else StatelessBlendSource
    source = cls.from_prefixes(prefixes, [0.6, 0.4], num_samples=50, seq_length=8)
    n = source.num_samples
    with pytest.raises(PositionError, match=rf"the train split holds {n} samples: expected positions in \[0, {n}\)"):
        source.locate(np.array(positions) if positions != [0, 50] else np.array([0, n]))
    with pytest.raises(IndexError):  # the same error, caught as Python's sequence protocols do
        source[n]
    with pytest.raises(ConfigError):
        source[-1]


def test_a_dataset_sample_past_its_index_is_a_position_error(prefixes):
    source = StoreBlendSource.from_prefixes(prefixes, [0.6, 0.4], num_samples=50, seq_length=8)
    held = source.datasets[1].num_samples
    with pytest.raises(PositionError, match=f"asked for sample {held} but its index holds {held}"):
        source.read_samples(np.array([1]), np.array([held]))


def test_the_store_raises_position_errors_too(prefixes):
    store = IndexedDataset(prefixes[0])
    n = store.num_sequences
    for bad in (lambda: store.get(n), lambda: store.read_spans([n], [0], [1]),
                lambda: store.read_spans([0], [0], [10**6]), lambda: store.window(0, 0, 10**9)):
        with pytest.raises(PositionError, match=store.prefix):
            bad()
    assert sum(1 for _ in store) == n  # iteration by __getitem__ stops at the IndexError


def test_sizing_and_key_have_one_home(prefixes):
    sizes = BlendSpec(prefixes=tuple(prefixes), weights=(3.0, 1.0)).megatron_sizes(100)
    assert sizes.targets == (75, 25) and sizes.buffers == (76, 26) and sizes.blended_size == 100
    once = np.array([3.0, 1.0]) / 4.0
    assert sizes.blend_weights == tuple((once / once.sum()).tolist())
    with pytest.raises(ConfigError, match="needs weights"):
        BlendSpec(prefixes=tuple(prefixes)).megatron_sizes(100)
    assert build_key({"b": 1, "a": [1.5, 2]}) == build_key({"a": [1.5, 2], "b": 1})
    assert len(build_key({"a": 1})) == 40


def test_an_eod_id_that_contradicts_the_store_fails_when_the_source_is_made(prefixes):
    for source_class in (StoreBlendSource, StatelessBlendSource):
        with pytest.raises(ConfigError, match=r"s0: eod_id=7 but the store's tokenizer record says 99"):
            source_class.from_prefixes(prefixes, [0.6, 0.4], num_samples=50, seq_length=8, eod_id=7)


def test_a_build_reads_the_eod_ids_of_its_stores_when_asked(prefixes, tmp_path):
    config = {"seq_length": 8, "blend": {"prefixes": prefixes, "weights": [0.6, 0.4]}, "split": "1,0,0",
              "train_samples": 50, "valid_samples": 0, "test_samples": 0, "cache_dir": str(tmp_path / "cache")}
    built = tokenloom.build(config).split("train")
    assert not any(r.store_open for r in built.readers)  # opening the build opened no store
    assert [d.eod_id for d in built.datasets] == [99, 99]
    assert all(r.store_open for r in built.readers)  # the tokenizer records needed them
    assert [d.name for d in built.datasets] == prefixes
