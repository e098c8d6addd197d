"""Stores' loss masks, served (issue 42): the served ``loss_mask`` is the product of the store's mask
of each label (token t + 1 decides the loss at t, as Megatron-LM's SFTDataset aligns it), the EOD
mask and the padding mask, on every kind of index, boundary format and layout, after a resume."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tokenloom
from serve_fixtures import FIM_EXTRA_TOKENS
from tokenloom.errors import ConfigError
from tokenloom.io import IndexedDatasetWriter
from tokenloom.serve import BatchGeometry, RankLoader, SampleOptions, Topology
from tokenloom.serve.batch import BatchPipeline
from tokenloom.serve.fim import FimTransform
from tokenloom.source import FimOptions

EOD, SEQ = 999, 24


def _write(prefix, rng, num_documents, mask_every):
    """Documents ending in EOD; every ``mask_every``-th one (0: none) without a mask, the others
    with a prompt of random length (0) and an answer (1), as a chat store has."""
    docs, masks = [], []
    with IndexedDatasetWriter(prefix) as writer:
        for i in range(num_documents):
            n = int(rng.integers(2, 50))
            tokens = rng.integers(0, EOD, size=n)
            tokens[-1] = EOD
            mask = None
            if mask_every and i % mask_every:
                mask = (np.arange(n) >= int(rng.integers(0, n))).astype(np.uint8)
                mask[rng.random(n) < 0.1] ^= 1
            writer.add_document(tokens, loss_mask=mask)
            docs.append(tokens)
            masks.append(np.ones(n, np.uint8) if mask is None else mask)
        writer.finalize({"tokenizer": {"kind": "bytes", "name": "bytes", "eod_id": EOD, "vocab_size": 1000}})
    return docs, masks


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Two masked stores (one with documents given no mask) and an unmasked one: prefix -> (docs, masks)."""
    root = tmp_path_factory.mktemp("loss-mask")
    rng = np.random.default_rng(42)
    return {str(root / name): _write(str(root / name), rng, count, every)
            for name, count, every in (("chat", 160, 4), ("prose", 140, 0), ("sft", 90, 1000))}


@pytest.fixture(scope="module", params=["exact", "stateless", "best_fit"])
def source(request, corpus, tmp_path_factory):
    config = {"blend": {"prefixes": list(corpus), "weights": [3.0, 2.0, 1.0]}, "split": "100,0,0",
              "valid_samples": 0, "test_samples": 0, "seq_length": SEQ, "train_samples": 600, "seed": 5,
              "mode": "exact" if request.param == "best_fit" else request.param,
              "cache_dir": str(tmp_path_factory.mktemp("cache")), "rng_workers": 0}
    if request.param == "best_fit":
        config["packing"] = "best_fit"
    return tokenloom.build(config).split("train")


def _reference(source, corpus, positions, options):
    """``(tokens, labels, loss_mask)`` per position from the documents themselves: the sample's
    pieces (``where``) cut from the Python lists, padded, the mask of each label times the
    padding and EOD masks."""
    width = source.seq_length + int(source.add_extra_token)
    tokens, labels, loss = [], [], []
    for origin in source.where(positions):
        docs, masks = corpus[origin.prefix]
        row = [docs[p.document][p.offset:p.offset + p.length] for p in origin.pieces]
        mask = [masks[p.document][p.offset:p.offset + p.length] for p in origin.pieces]
        row = np.concatenate([*row, np.full(width, source.pad_id)])[:width]
        mask = np.concatenate([*mask, np.ones(width, np.uint8)])[:width]
        label, token = row[1:], row[:-1]
        keep = mask[1:].astype(np.float32) * (label != source.pad_id)
        if options.eod_mask_loss:
            keep *= token != EOD
        tokens.append(np.where(token == source.pad_id, 0, token))
        labels.append(np.where(label == source.pad_id, 0, label))
        loss.append(keep)
    return np.stack(tokens), np.stack(labels), np.stack(loss)


option_sets = st.sampled_from([
    SampleOptions(),
    SampleOptions(eod_mask_loss=True),
    SampleOptions(inter_document_masking=True),
    SampleOptions(inter_document_masking=True, boundary_format="thd", eod_mask_loss=True),
    SampleOptions(inter_document_masking=True, boundary_format="segments"),
])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(options=option_sets, data=st.data())
def test_served_loss_mask_is_the_documents_masks_of_the_labels(source, corpus, options, data):
    positions = np.array(data.draw(st.lists(st.integers(0, source.num_samples - 1), min_size=1, max_size=12)))
    out = BatchPipeline(source, options=options).read(*source.locate(positions))
    tokens, labels, loss = _reference(source, corpus, positions, options)
    np.testing.assert_array_equal(out["tokens"].reshape(tokens.shape), tokens)  # the pieces are the row
    np.testing.assert_array_equal(out["labels"].reshape(labels.shape), labels)
    np.testing.assert_array_equal(out["loss_mask"].reshape(loss.shape), loss)
    assert out["loss_mask"].dtype == np.float32


def test_masks_reach_the_loss_where_the_stores_have_them(source, corpus):
    """Not vacuous: the masked stores take prompts out of the loss, the unmasked one changes nothing."""
    positions = np.arange(min(source.num_samples, 300))
    dataset_ids, sample_ids = source.locate(positions)
    pipeline = BatchPipeline(source)
    served = pipeline.read(dataset_ids, sample_ids)["loss_mask"]
    without = pipeline.from_rows(source.read_samples(dataset_ids, sample_ids), dataset_ids)["loss_mask"]
    prose = next(d for d, info in enumerate(source.datasets) if info.name.endswith("prose"))
    np.testing.assert_array_equal(served[dataset_ids == prose], without[dataset_ids == prose])
    for d in {0, 1, 2} - {prose}:
        assert source.has_loss_mask(d)
        assert served[dataset_ids == d].sum() < 0.9 * without[dataset_ids == d].sum()
    assert not source.has_loss_mask(prose)
    assert source.read_loss_masks(dataset_ids[dataset_ids == prose], sample_ids[dataset_ids == prose]) is None


def test_the_numpy_gather_of_the_masks_equals_the_compiled_one(source):
    from tokenloom.source.gather import GATHER_BACKENDS

    dataset_ids, sample_ids = source.locate(np.arange(min(source.num_samples, 64)))
    got = {}
    for backend in GATHER_BACKENDS:
        source.backend = backend
        try:
            got[backend] = source.read_loss_masks(dataset_ids, sample_ids)
        finally:
            source.backend = None
    assert set(got) == {"numpy", "numba"}
    np.testing.assert_array_equal(got["numpy"], got["numba"])


def _steps(source, topology, options, num_steps, state=None):
    """Every field in stream order over ``num_steps`` global batches of 8, assembled from every
    data-parallel rank of ``topology`` (tensor rank 0), after ``state`` when given."""
    geometry = BatchGeometry(global_batch_size=8, micro_batch_size=2, dp=topology.dp)
    loaders = [RankLoader(source, geometry, topology=topology, rank=r, options=options)
               for r in range(topology.world_size)]
    if state is not None:
        for loader in loaders:
            loader.load_state_dict(state)
    served = []
    for _ in range(num_steps * loaders[0].sampler.num_micro_batches):
        outputs = [loader.next_batch() for loader in loaders]
        served += [outputs[topology.rank_of(dp_rank=d)]["loss_mask"] for d in range(topology.dp)]
    return np.concatenate(served), loaders[0].state_dict()


def test_any_layout_and_a_resume_on_another_serve_the_same_masks(source, corpus):
    options = SampleOptions(eod_mask_loss=True)
    whole, _ = _steps(source, Topology(dp=1), options, 6)
    _, _, loss = _reference(source, corpus, np.arange(48), options)
    np.testing.assert_array_equal(whole, loss)
    first, state = _steps(source, Topology(dp=4), options, 3)
    np.testing.assert_array_equal(first, whole[:24])
    resumed, _ = _steps(source, Topology(dp=2, tp=2), options, 3, json.loads(json.dumps(state)))
    np.testing.assert_array_equal(resumed, whole[24:])


class _Codec:
    """Just enough of a tokenizer for FimTransform to name its tokens."""

    def token_id(self, token):
        return {"<fim_prefix>": 1000, "<fim_middle>": 1001, "<fim_suffix>": 1002, "<fim_pad>": 1003,
                "<|endoftext|>": EOD}.get(token)

    def decode(self, ids):  # one character per id: any cut re-encodes
        return "".join(chr(0x4E00 + int(i)) for i in ids)

    def encode_text(self, text):
        return [ord(c) - 0x4E00 for c in text]


def test_fim_on_a_masked_store_is_refused_and_on_the_others_served(source, corpus):
    fim = FimTransform(FimOptions(rate=0.5, extra_tokens=FIM_EXTRA_TOKENS), _Codec(), seed=3)
    with pytest.raises(ConfigError, match=r"would permute .*chat.*carry a loss mask.*only unmasked stores"):
        BatchPipeline(source, options=SampleOptions(fim=fim))
    prose = next(prefix for prefix in corpus if prefix.endswith("prose"))
    pipeline = BatchPipeline(source, options=SampleOptions(fim=fim, fim_stores=(prose,)))
    positions = np.arange(40)
    out = pipeline.read(*source.locate(positions))
    plain = BatchPipeline(source).read(*source.locate(positions))
    masked = np.array([not d.name.endswith("prose") for d in source.datasets])[out["dataset_id"].astype(int)]
    np.testing.assert_array_equal(out["loss_mask"][masked], plain["loss_mask"][masked])


def test_the_torch_and_grain_adapters_carry_the_masks(source, corpus):
    """The adapters convert the pipeline's arrays: the masks reach a DataLoader worker (on a
    context-parallel layout, each rank its chunks) and a grain record."""
    pytest.importorskip("torch")
    from tokenloom.serve.torch_adapter import build_dataloader

    options = SampleOptions(inter_document_masking=True, boundary_format="thd")
    topology, geometry = Topology(dp=2, cp=2), BatchGeometry(global_batch_size=8, micro_batch_size=2, dp=2)
    for rank in (0, 3):
        loader = build_dataloader(source, geometry, topology=topology, rank=rank, options=options, num_workers=1,
                                  max_steps=2)
        expected = list(RankLoader(source, geometry, topology=topology, rank=rank, options=options, max_steps=2))
        got = list(loader)
        assert len(got) == len(expected) == 4
        for a, b in zip(got, expected):
            np.testing.assert_array_equal(a["loss_mask"].numpy(), b["loss_mask"])
    _, _, loss = _reference(source, corpus, np.arange(8), options)
    assert any((loss[k] == 0).any() for k in range(8))  # the first step holds masked tokens
    pytest.importorskip("grain")
    from tokenloom.serve.grain_adapter import GrainSource

    records = GrainSource(source, options=SampleOptions(eod_mask_loss=True))
    _, _, loss = _reference(source, corpus, np.arange(6), SampleOptions(eod_mask_loss=True))
    for position in range(6):
        np.testing.assert_array_equal(records[position]["loss_mask"], loss[position])


def test_a_padded_validation_sample_keeps_its_padding_out_of_the_loss(corpus):
    """megatron-core's short last validation sample (drop_last_partial=False): its masks end where
    its tokens do, and the padding after them is outside the loss."""
    from tokenloom.source import StoreBlendSource

    chat = next(prefix for prefix in corpus if prefix.endswith("chat"))
    docs, masks = corpus[chat]
    source = StoreBlendSource.from_prefixes([chat], num_samples=10, seq_length=SEQ, split="80,20,0",
                                            split_name="valid", drop_last_partial=False, seed=4)
    sample_ids = np.arange(source.readers[0].num_samples)  # every sample of the index, the short one too
    dataset_ids = np.zeros_like(sample_ids)
    rows = source.read_samples(dataset_ids, sample_ids)
    assert (rows == source.pad_id).any()
    spans = source.readers[0].spans(sample_ids)
    for k in range(sample_ids.shape[0]):  # the pieces are the row, then padding
        pieces = range(spans.bounds[k], spans.bounds[k + 1])
        row = np.concatenate([docs[spans.document_ids[j]][spans.offsets[j]:spans.offsets[j] + spans.lengths[j]]
                              for j in pieces])
        mask = np.concatenate([masks[spans.document_ids[j]][spans.offsets[j]:spans.offsets[j] + spans.lengths[j]]
                               for j in pieces])
        np.testing.assert_array_equal(rows[k, :row.shape[0]], row)
        padded_mask = np.concatenate([mask, np.ones(SEQ + 1 - mask.shape[0], np.uint8)])
        want = padded_mask[1:] * (rows[k, 1:] != source.pad_id)
        np.testing.assert_array_equal(BatchPipeline(source).read(dataset_ids[k:k + 1], sample_ids[k:k + 1])
                                      ["loss_mask"][0], want)
