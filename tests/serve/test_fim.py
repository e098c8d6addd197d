"""Fill-in-the-middle (issue 42): ``FimTransform`` against Megatron-LM's own ``GPTFIMDataset`` code,
driven with the generator tokenloom seeds each sample with, on standard-library code tokenized by
a byte-level BPE trained here (with FIM sentinels and a file separator); PSM, SPM and both, with
and without ``fim_split_sample`` and ``fim_no_prefix``. And the property that a permuted piece
holds exactly its source characters, and that the draws depend on the sample alone."""

from __future__ import annotations

import os
import types

import numpy as np
import pytest

from serve_fixtures import FIM_EXTRA_TOKENS, stdlib_sources, train_code_tokenizer
from tokenloom.errors import ConfigError
from tokenloom.serve.fim import FimTransform
from tokenloom.source import FimOptions

EXTRA = FIM_EXTRA_TOKENS


@pytest.fixture(scope="module")
def codec(tmp_path_factory):
    return train_code_tokenizer(tmp_path_factory.mktemp("fim"))


@pytest.fixture(scope="module")
def samples(codec) -> list[np.ndarray]:
    """Windows of 257 ids cut at random from "repositories" of standard-library modules: files
    joined by <file_sep>, repositories ended by <|endoftext|> (pieces, fragments, cuts mid-file)."""
    rng = np.random.default_rng(5)
    files = stdlib_sources(25, 30)
    eod, sep = codec.token_id("<|endoftext|>"), codec.token_id("<file_sep>")
    stream: list[int] = []
    for k in range(0, len(files), 3):
        for j, name in enumerate(files[k:k + 3]):
            with open(name, encoding="utf-8") as f:
                text = f.read()[:3000]
            stream += ([sep] if j else []) + codec.encode_text(text)
        stream.append(eod)
    stream_array = np.asarray(stream, dtype=np.int64)
    starts = rng.integers(0, stream_array.shape[0] - 257, size=120)
    return [stream_array[s:s + 257] for s in starts]


def _megatron_fim_module():
    """Megatron-LM's ``megatron/training/datasets/fim_dataset.py`` from the megatron-core wheel,
    loaded from its file: importing it through its package runs ``megatron.training``'s
    ``__init__``, which needs Python 3.12 (``typing.override``); the module itself needs only
    megatron-core's datasets."""
    import importlib.util

    core = pytest.importorskip("megatron.core")
    path = os.path.join(os.path.dirname(os.path.dirname(core.__file__)), "training", "datasets", "fim_dataset.py")
    if not os.path.isfile(path):
        pytest.skip(f"{path}: not in this megatron-core wheel")
    spec = importlib.util.spec_from_file_location("megatron_fim_dataset", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _megatron(codec, options: FimOptions, transform: FimTransform):
    """A ``GPTFIMDataset`` whose only sample is the one ``read`` returns: Megatron-LM's code from
    the read on (``_query_document_sample_shuffle_indices``), its tokenizer calls on ``codec``."""
    fim = _megatron_fim_module()
    shim = types.SimpleNamespace(
        ids_to_text=lambda ids, remove_special_tokens=True: codec.decode(ids),
        text_to_ids=lambda text: codec.encode_text(text),
        tokens_to_ids=lambda tokens: ([codec.token_id(t) for t in tokens] if isinstance(tokens, list)
                                      else codec.token_id(tokens)))
    dataset = fim.GPTFIMDataset.__new__(fim.GPTFIMDataset)
    dataset.config = types.SimpleNamespace(tokenizer=types.SimpleNamespace(_tokenizer=shim))
    dataset.fim_rate, dataset.fim_spm_rate = options.rate, options.spm_rate
    dataset.fragment_fim_rate, dataset.no_fim_prefix = options.fragment_rate, options.no_prefix
    dataset.fim_split_sample = transform.split_id
    dataset.prefix_tok_id, dataset.middle_tok_id, dataset.suffix_tok_id = (transform.prefix_id, transform.middle_id,
                                                                           transform.suffix_id)
    dataset.pad_tok_id, dataset.eod_tok_id = transform.pad_id, transform.eod_id

    def permute(sample: np.ndarray, rng) -> np.ndarray:
        dataset.np_rng = rng
        dataset.shuffle_index = np.zeros(1, dtype=np.int64)
        dataset.document_index = np.zeros(1, dtype=np.int64)
        dataset.sample_index = np.array([[0, 0], [0, sample.shape[0] - 1]], dtype=np.int64)
        dataset.dataset = types.SimpleNamespace(get=lambda doc, offset=0, length=None: sample[offset:offset + length])
        return dataset._query_document_sample_shuffle_indices(0)[0]

    return permute


CASES = {
    "psm": dict(rate=0.9, spm_rate=0.0),
    "spm": dict(rate=0.9, spm_rate=1.0),
    "both": dict(rate=0.5, spm_rate=0.5),
    "split": dict(rate=0.9, spm_rate=0.5, split_sample="<file_sep>", fragment_rate=0.6),
    "no_prefix": dict(rate=1.0, spm_rate=0.5, no_prefix="import"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_megatrons_code_permutes_every_sample_as_tokenloom_with_the_samples_generator(codec, samples, case):
    options = FimOptions(extra_tokens=EXTRA, **CASES[case])
    transform = FimTransform(options, codec, seed=1234)
    megatron = _megatron(codec, options, transform)
    changed = 0
    for k, sample in enumerate(samples):
        ours = transform.apply(sample, transform.sample_rng(3, k))
        theirs = megatron(sample, transform.sample_rng(3, k))
        np.testing.assert_array_equal(ours, theirs, err_msg=f"{case}: sample {k}")
        assert ours.shape == sample.shape
        changed += not np.array_equal(ours, sample)
    assert changed > len(samples) // 4  # the samples really were permuted


def test_a_permuted_piece_holds_exactly_its_source_characters(codec, samples):
    """PSM and SPM at rate 1 on a piece without end-of-document tokens, given room (pad tokens
    after it: special, so not part of its text) so nothing is cut off: the parts between the
    sentinels decode to the piece's text cut at two points, in PSM's or SPM's order."""
    for spm in (0.0, 1.0):
        transform = FimTransform(FimOptions(rate=1.0, spm_rate=spm, extra_tokens=EXTRA), codec, seed=9)
        sentinels = [transform.prefix_id, transform.suffix_id, transform.middle_id]
        for k, sample in enumerate(samples):
            ends = np.flatnonzero(sample == transform.eod_id)
            piece = sample[:ends[0]] if ends.shape[0] else sample
            room = np.concatenate([piece, np.full(64, transform.pad_id, dtype=np.int64)])
            out = transform.apply(room, transform.sample_rng(0, k))
            out = out[:np.flatnonzero(out != transform.pad_id)[-1] + 1]  # the padding at the end dropped
            where = np.flatnonzero(np.isin(out, sentinels))
            assert where.shape[0] == 3, f"sample {k}: sentinels at {where.tolist()}"
            order = out[where].tolist()
            source = codec.decode(piece.tolist())
            if spm:  # <P><S> suffix <M> prefix middle
                assert order == [transform.prefix_id, transform.suffix_id, transform.middle_id] and where[1] == 1
                suffix, head = codec.decode(out[2:where[2]].tolist()), codec.decode(out[where[2] + 1:].tolist())
                assert head + suffix == source, f"sample {k}"
            else:  # <P> prefix <S> suffix <M> middle
                assert order == sentinels and where[0] == 0
                prefix = codec.decode(out[1:where[1]].tolist())
                suffix = codec.decode(out[where[1] + 1:where[2]].tolist())
                middle = codec.decode(out[where[2] + 1:].tolist())
                assert prefix + middle + suffix == source, f"sample {k}"


def test_the_draws_depend_on_the_sample_alone(codec, samples):
    transform = FimTransform(FimOptions(rate=0.5, extra_tokens=EXTRA), codec, seed=7)
    forward = [transform.apply(s, transform.sample_rng(1, k)) for k, s in enumerate(samples)]
    backward = [transform.apply(samples[k], transform.sample_rng(1, k)) for k in reversed(range(len(samples)))]
    for k, (a, b) in enumerate(zip(forward, reversed(backward))):
        np.testing.assert_array_equal(a, b, err_msg=f"sample {k}")
    rows = transform.apply_rows(np.stack(samples[:6]), [1] * 6, list(range(6)))
    np.testing.assert_array_equal(rows, np.stack(forward[:6]))
    other = FimTransform(FimOptions(rate=0.5, extra_tokens=EXTRA), codec, seed=8)
    assert any(not np.array_equal(a, other.apply(s, other.sample_rng(1, k)))
               for k, (a, s) in enumerate(zip(forward, samples)))


@pytest.mark.parametrize("values, message", [
    ({"fim_rate": 1.5, "fim_extra_tokens": EXTRA}, r"fim_rate=1.5; expected a probability in \[0, 1\]"),
    ({"fim_rate": 0.5, "fim_extra_tokens": {"prefix": "<fim_prefix>"}}, "fim_extra_tokens=.*expected the spelling"),
    ({"fim_rate": 0.5, "fim_extra_tokens": EXTRA, "fim_split_sample": "<file_sep>"}, "without fim_fragment_rate"),
    ({"fim_rate": 0.5, "fim_extra_tokens": EXTRA, "fim_spm": 0.5}, r"unknown FIM key\(s\) \['fim_spm'\]"),
])
def test_bad_options_name_the_key(values, message):
    with pytest.raises(ConfigError, match=message):
        FimOptions.from_megatron(values)


def test_a_sentinel_the_tokenizer_lacks_is_refused_by_name(codec):
    options = FimOptions(rate=0.5, extra_tokens={**EXTRA, "pad": "<pad>"})
    with pytest.raises(ConfigError, match=r"fim_extra_tokens\['pad'\]='<pad>' is not a token of the tokenizer"):
        FimTransform(options, codec, seed=1)


def test_a_micro_batch_in_two_tokenizer_calls_permutes_as_row_by_row(codec, samples):
    """``apply_rows`` decodes every piece and encodes every part of a micro-batch in one call
    each; the ids are ``apply``'s row by row, on rows with empty pieces and fragments (an EOD or
    a split token right after another, or first)."""
    eod, sep = codec.token_id("<|endoftext|>"), codec.token_id("<file_sep>")
    rows = np.stack(samples[:60]).copy()
    rows[::5, 0] = sep
    rows[1::5, 10:12] = sep
    rows[2::5, 20:22] = eod
    rows[3::5, -1] = eod
    for changes in ({}, {"split_sample": "<file_sep>", "fragment_rate": 0.5}, {"no_prefix": "def", "rate": 1.0}):
        transform = FimTransform(FimOptions(**{"rate": 0.6, "spm_rate": 0.5, "extra_tokens": EXTRA, **changes}),
                                 codec, seed=21)
        batched = transform.apply_rows(rows, [4] * 60, list(range(60)))
        one_by_one = np.stack([transform.apply(rows[k], transform.sample_rng(4, k)) for k in range(60)])
        np.testing.assert_array_equal(batched, one_by_one, err_msg=str(changes))
        assert (batched != rows).any(axis=1).sum() > 20


def test_gigatoken_encodes_the_cut_parts_to_the_ids_megatron_gets_from_tokenizers(codec, samples):
    """The tokenizer as load_tokenizer opens it decodes a micro-batch's pieces and encodes its
    parts with gigatoken (what FIM's speed rests on: BENCHMARKS.md, "Fill in the middle"); the
    permuted rows are those of the ``tokenizers`` engine, which Megatron-LM's own code matches
    above. Its first call scans the tokenizer once (cached)."""
    from tokenloom.tokenization.tokenizers import HuggingFaceTokenizer

    fast = HuggingFaceTokenizer(codec.path)
    if fast.engine != "gigatoken":
        pytest.skip(f"gigatoken does not cover this tokenizer here: {fast.engine_note}")
    options = FimOptions(rate=0.9, spm_rate=0.5, extra_tokens=EXTRA, split_sample="<file_sep>", fragment_rate=0.5)
    rows = np.stack(samples[:40])
    reference = FimTransform(options, codec, seed=2).apply_rows(rows, [1] * 40, list(range(40)))
    np.testing.assert_array_equal(FimTransform(options, fast, seed=2).apply_rows(rows, [1] * 40, list(range(40))),
                                  reference)
