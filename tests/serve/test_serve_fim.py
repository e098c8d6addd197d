"""Fill-in-the-middle served (issue 42): a blend of a code store (permuted) and a prose store (not),
each permuted row equal to ``FimTransform`` on the row as read with its sample's generator, FIM's
pad tokens outside the loss, document boundaries following the permuted row's end-of-document
tokens, and the same global batches on any data-parallel layout, micro-batch size, resume and
DataLoader worker count."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from serve_fixtures import FIM_EXTRA_TOKENS, stdlib_sources, train_code_tokenizer, write_store
from tokenloom.errors import BuildError, ConfigError
from tokenloom.serve import BatchGeometry, BatchPipeline, RankLoader, SampleOptions, Topology
from tokenloom.serve.fim import FimTransform
from tokenloom.source import FimOptions, StatelessBlendSource

SEQ = 128


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(codec, source): "code" holds standard-library modules in "repositories" of three files
    joined by <file_sep>; "prose" holds the modules' comment lines; both end documents with
    <|endoftext|>, 0.6 / 0.4 blend."""
    root = tmp_path_factory.mktemp("serve-fim")
    codec = train_code_tokenizer(root)
    eod, sep = codec.token_id("<|endoftext|>"), codec.token_id("<file_sep>")
    files = stdlib_sources(30, 24)
    texts = []
    for name in files:
        with open(name, encoding="utf-8") as f:
            texts.append(f.read()[:4000])
    code = []
    for k in range(0, len(texts), 3):
        ids: list[int] = []
        for j, text in enumerate(texts[k:k + 3]):
            ids += ([sep] if j else []) + codec.encode_text(text)
        code.append(np.asarray([*ids, eod]))
    comments = ["\n".join(line for line in text.splitlines() if line.strip().startswith("#")) for text in texts]
    prose = [np.asarray([*codec.encode_text(text), eod]) for text in comments]
    stores = [write_store(os.path.join(str(root), name), docs, vocab_size=codec.vocab_size, eod_id=eod)
              for name, docs in (("code", code), ("prose", prose))]
    source = StatelessBlendSource.from_prefixes(stores, [0.6, 0.4], num_samples=480, seq_length=SEQ, seed=11)
    return codec, source


def _fim(codec, **changes) -> FimTransform:
    options = {"fim_rate": 0.7, "fim_spm_rate": 0.5, "fim_extra_tokens": FIM_EXTRA_TOKENS,
               "fim_split_sample": "<file_sep>", "fim_fragment_rate": 0.5, **changes}
    return FimTransform(FimOptions.from_megatron(options), codec, seed=5)


def test_the_code_rows_are_permuted_with_their_samples_generator_and_the_prose_rows_are_not(setup):
    codec, source = setup
    fim = _fim(codec)
    code = source.datasets[0].name
    plain = BatchPipeline(source)
    served = BatchPipeline(source, options=SampleOptions(fim=fim, fim_stores=(code,)))
    dataset_ids, sample_ids = source.locate(np.arange(96))
    rows = source.read_samples(dataset_ids, sample_ids)
    got, before = served.read(dataset_ids, sample_ids), plain.read(dataset_ids, sample_ids)
    permuted = 0
    for k in range(96):
        if dataset_ids[k] == 1:  # prose: as without FIM
            for name in before:
                np.testing.assert_array_equal(got[name][k], before[name][k])
            continue
        row = fim.apply(rows[k], fim.sample_rng(int(dataset_ids[k]), int(sample_ids[k])))
        np.testing.assert_array_equal(got["tokens"][k], row[:-1])
        np.testing.assert_array_equal(got["labels"][k], row[1:])
        np.testing.assert_array_equal(got["loss_mask"][k], (row[1:] != fim.pad_id).astype(np.float32))
        permuted += not np.array_equal(row, rows[k])
    assert permuted > 10


@pytest.mark.parametrize("boundary_format", ["megatron", "thd"])
def test_document_boundaries_follow_the_permuted_rows_end_of_document_tokens(setup, boundary_format):
    codec, source = setup
    fim = _fim(codec, fim_rate=1.0)
    options = SampleOptions(fim=fim, inter_document_masking=True, boundary_format=boundary_format)
    pipeline = BatchPipeline(source, options=options)
    dataset_ids, sample_ids = source.locate(np.arange(64))
    fields = pipeline.read_samples_fields(dataset_ids, sample_ids)
    for k in range(64):
        tokens = fields["tokens"][k]
        labels = fields["labels"][k]
        ends = np.flatnonzero(tokens == fim.eod_id) + 1  # a document ends after its EOD
        cu = fields["cu_seqlens"][k]
        inner = cu[1:][cu[1:] < SEQ]
        assert set(ends[ends < SEQ].tolist()) <= set(inner.tolist()) | {SEQ}, k
        assert cu[-1] == SEQ and (np.diff(cu) >= 0).all()
        assert (fields["loss_mask"][k][labels == fim.pad_id] == 0).all()


def _serve(source, options, topology: Topology, micro: int, *, state=None) -> list[np.ndarray]:
    """Each step's global batch of tokens, rows in the order of their stream positions."""
    geometry = BatchGeometry(global_batch_size=24, micro_batch_size=micro, dp=topology.dp)
    loaders = [RankLoader(source, geometry, topology=topology, rank=r, options=options)
               for r in range(topology.world_size)]
    if state is not None:
        for loader in loaders:
            loader.load_state_dict(state)
    steps = []
    while not loaders[0].sampler.exhausted():
        positions, tokens = [], []
        for _ in range(loaders[0].sampler.num_micro_batches):
            for loader in loaders:
                positions.append(loader.sampler.positions())
                tokens.append(loader.next_batch()["tokens"])
        steps.append(np.concatenate(tokens)[np.argsort(np.concatenate(positions))])
    return steps


def test_the_same_batches_on_any_layout_after_a_resume_and_in_dataloader_workers(setup):
    codec, source = setup
    options = SampleOptions(fim=_fim(codec), fim_stores=(source.datasets[0].name,))
    reference = _serve(source, options, Topology(dp=1), 8)
    assert len(reference) == 20
    for layout, micro in ((Topology(dp=2), 4), (Topology(dp=4), 2)):
        for got, expected in zip(_serve(source, options, layout, micro), reference):
            np.testing.assert_array_equal(got, expected)
    loader = RankLoader(source, BatchGeometry(global_batch_size=24, micro_batch_size=8, dp=1), options=options)
    for _ in range(7 * 3):
        loader.next_batch()
    state = json.loads(json.dumps(loader.state_dict()))
    resumed = _serve(source, options, Topology(dp=3), 8, state=state)
    for got, expected in zip(resumed, reference[7:]):
        np.testing.assert_array_equal(got, expected)
    torch = pytest.importorskip("torch")
    from tokenloom.serve.torch_adapter import build_dataloader

    geometry = BatchGeometry(global_batch_size=24, micro_batch_size=8, dp=1)
    workers = build_dataloader(source, geometry, options=options, num_workers=2, max_steps=5)
    tokens = [batch["tokens"] for batch in workers]
    np.testing.assert_array_equal(torch.cat(tokens).numpy(), np.concatenate(reference[:5]))


def test_fim_options_that_do_not_fit_the_source_are_refused_naming_them(setup, tmp_path):
    codec, source = setup
    with pytest.raises(ConfigError, match="fim_stores names 'stores/missing', which is not a store of this split"):
        BatchPipeline(source, options=SampleOptions(fim=_fim(codec), fim_stores=("stores/missing",)))
    wrong = FimTransform(FimOptions.from_megatron({"fim_rate": 0.5, "fim_extra_tokens": {
        **FIM_EXTRA_TOKENS, "eod": "<file_sep>"}}), codec, seed=1)
    with pytest.raises(ConfigError, match=r"its documents end with id \d+ but fim_extra_tokens\['eod'\] is id"):
        BatchPipeline(source, options=SampleOptions(fim=wrong))
    with pytest.raises(ConfigError, match=r"fim_stores=.* without fim"):
        SampleOptions(fim_stores=("code",))


def _hf_store(prefix: str, documents, codec) -> str:
    """A store whose sidecar records ``codec`` as ``tokenloom tokenize`` does (kind, path, SHA-256)."""
    from tokenloom.io import IndexedDatasetWriter

    with IndexedDatasetWriter(prefix, dtype=np.uint16) as writer:
        for doc in documents:
            writer.add_document(np.asarray(doc, dtype=np.int64))
        writer.finalize({"tokenizer": codec.record(append_eod=True).to_dict()})
    return prefix


def test_fim_in_the_build_config_permutes_its_stores_when_served(setup, tmp_path):
    """A build config's ``fim`` (Megatron-LM's keys plus ``stores``) is served by every
    BatchPipeline of the build, with the stores' recorded tokenizer and the build's seed, exactly
    as SampleOptions(fim=...) would; it is not in the build key; a config it cannot serve fails
    when the build opens, naming the store or the tokenizer file."""
    import tokenloom
    from tokenloom.io import IndexedDataset

    codec, source = setup
    prefixes = []
    for reader, name in zip(source.readers, ("code", "prose")):
        store = IndexedDataset(reader.prefix)
        prefixes.append(_hf_store(str(tmp_path / name), [store[i] for i in range(len(store))], codec))
    fim = {"fim_rate": 0.7, "fim_spm_rate": 0.5, "fim_extra_tokens": FIM_EXTRA_TOKENS,
           "fim_split_sample": "<file_sep>", "fim_fragment_rate": 0.5, "stores": ["code"]}
    values = {"blend": ["0.6", "code", "0.4", "prose"], "split": "100,0,0", "samples": [240, 0, 0],
              "seq_length": SEQ, "seed": 5, "mode": "stateless", "cache_dir": "cache", "base_dir": str(tmp_path)}
    plain = tokenloom.build(values)
    served = tokenloom.build({**values, "fim": fim})
    assert served.build_key == plain.build_key and plain.split("train").fim is None
    train, reference = served.split("train"), plain.split("train")
    dataset_ids, sample_ids = train.locate(np.arange(96))
    got = BatchPipeline(train).read(dataset_ids, sample_ids)
    expected = BatchPipeline(reference, options=SampleOptions(fim=_fim(codec), fim_stores=(prefixes[0],)))
    for name, value in expected.read(dataset_ids, sample_ids).items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    unpermuted = BatchPipeline(reference).read(dataset_ids, sample_ids)["tokens"]
    assert (got["tokens"] != unpermuted).any(axis=1).sum() > 10
    assert not (got["tokens"] != unpermuted)[dataset_ids == 1].any()  # prose as it is
    # what cannot be served fails when the build opens (on every rank, as any failure to open)
    with pytest.raises(BuildError, match=r"fim_extra_tokens\['prefix'\]='<nope>' is not a token of .*tokenizer"
                                          r"\.json \(the tokenizer of store .*code'\)"):
        tokenloom.build({**values, "fim": {**fim, "fim_extra_tokens": {**FIM_EXTRA_TOKENS, "prefix": "<nope>"}}})
    write_store(str(tmp_path / "bytes"), [np.array([1, 2, 3])] * 20, vocab_size=codec.vocab_size, eod_id=3)
    with pytest.raises(BuildError, match=r"fim: store .*bytes' was tokenized with bytes tokenizer; FIM cuts"):
        tokenloom.build({**values, "blend": [*values["blend"], "0.1", "bytes"], "fim": {**fim, "stores": ["bytes"]}})
    with pytest.raises(ConfigError, match=r"fim.stores names 'gone', which is not a store of this config"):
        tokenloom.build({**values, "fim": {**fim, "stores": ["gone"]}})


def test_a_best_fit_sample_is_permuted_in_its_documents_and_keeps_its_padding(setup, tmp_path):
    """Best fit pads a sample after its whole documents; FIM permutes the documents alone (as
    ``apply`` on the columns before the padding), keeps them to that length, and leaves the
    padding, which stays outside the loss and after the last document boundary."""
    import tokenloom
    from tokenloom.io import IndexedDataset

    codec, source = setup
    eod = codec.token_id("<|endoftext|>")
    for reader, name in zip(source.readers, ("code", "prose")):
        store = IndexedDataset(reader.prefix)
        docs = [store[i] if i % 4 == 0 else np.append(store[i][:40], eod) for i in range(len(store))]  # short ones too
        _hf_store(str(tmp_path / name), docs, codec)
    fim = {"fim_rate": 0.9, "fim_spm_rate": 0.5, "fim_extra_tokens": FIM_EXTRA_TOKENS, "stores": ["code"]}
    values = {"blend": ["0.6", "code", "0.4", "prose"], "split": "100,0,0", "samples": [96, 0, 0],
              "seq_length": SEQ, "seed": 5, "mode": "stateless", "packing": "best_fit", "cache_dir": "cache",
              "base_dir": str(tmp_path)}
    train = tokenloom.build({**values, "fim": fim}).split("train")
    transform = BatchPipeline(train).options.fim
    dataset_ids, sample_ids = train.locate(np.arange(96))
    rows = train.read_samples(dataset_ids, sample_ids)
    got = BatchPipeline(train, options=SampleOptions(inter_document_masking=True)).read(dataset_ids, sample_ids)
    padded = 0
    for k in np.flatnonzero(dataset_ids == 0).tolist():
        n = int(np.flatnonzero(rows[k] != train.pad_id)[-1]) + 1
        padded += n < rows.shape[1]
        row = np.concatenate([transform.apply(rows[k, :n], transform.sample_rng(0, int(sample_ids[k]))),
                              rows[k, n:]])
        np.testing.assert_array_equal(got["tokens"][k][:min(n, SEQ)], row[:min(n, SEQ)])
        np.testing.assert_array_equal(got["labels"][k][:n - 1], row[1:n])
        assert not got["loss_mask"][k][n - 1:].any()  # the padding: no loss
        assert got["cu_seqlens"][k][got["cu_seqlens"][k] >= 0].max() <= rows.shape[1] - 1
    assert padded >= 2  # the store is small (8 code documents): a few padded samples
