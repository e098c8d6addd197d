"""Helpers shared by the serving tests: small token stores and megatron-core's blended dataset."""

from __future__ import annotations

import logging
import os
import warnings

import numpy as np
import pytest

from tokenloom.io import IndexedDatasetWriter


def tokenizer_record(vocab_size: int, eod_id: int | None) -> dict:
    """The sidecar's tokenizer record, as ``tokenloom tokenize`` writes it."""
    return {"tokenizer": {"kind": "bytes", "name": "bytes", "path": None, "sha256": None,
                          "vocab_size": vocab_size, "eod_id": eod_id, "append_eod": eod_id is not None}}


def write_store(prefix: str, documents: list[np.ndarray], *, vocab_size: int, eod_id: int | None,
                dtype=np.uint16) -> str:
    """A store with one sequence per document (each already ending in EOD if wanted)."""
    with IndexedDatasetWriter(prefix, dtype=dtype) as writer:
        for doc in documents:
            writer.add_document(np.asarray(doc, dtype=np.int64))
        writer.finalize(tokenizer_record(vocab_size, eod_id))
    return prefix


def random_documents(rng: np.random.Generator, num_documents: int, *, vocab_size: int, eod_id: int,
                     max_length: int = 40, eod_rate: float = 0.0) -> list[np.ndarray]:
    """Documents of random tokens (below ``eod_id``), each ending in ``eod_id``; ``eod_rate``
    sprinkles extra EOD ids inside documents too."""
    docs = []
    for _ in range(num_documents):
        n = int(rng.integers(1, max_length + 1))
        doc = rng.integers(0, eod_id, size=n)
        doc[rng.random(n) < eod_rate] = eod_id
        doc[-1] = eod_id
        docs.append(doc)
    return docs


def write_corpus(directory, num_stores: int, *, seed: int = 0, vocab_size: int = 1000,
                 num_documents: int = 60, max_length: int = 40, eod_rate: float = 0.05) -> list[str]:
    """``num_stores`` stores under ``directory``, tokenizer record with eod = vocab_size - 1 (the
    null tokenizer's EOD in megatron-core)."""
    rng = np.random.default_rng(seed)
    prefixes = []
    for k in range(num_stores):
        docs = random_documents(rng, num_documents + 7 * k, vocab_size=vocab_size, eod_id=vocab_size - 1,
                                max_length=max_length, eod_rate=eod_rate)
        prefixes.append(write_store(os.path.join(str(directory), f"store{k}"), docs,
                                    vocab_size=vocab_size, eod_id=vocab_size - 1))
    return prefixes


def megatron_blended(prefixes, weights, *, num_samples: int, seq_length: int, seed: int, cache_dir,
                     vocab_size: int = 1000, split: str = "1,0,0", eod_mask_loss=False,
                     reset_position_ids=False, reset_attention_mask=False, create_attention_mask=True,
                     add_extra_token=True, split_name="train", drop_last_partial_validation=True,
                     inter_document_masking=False):
    """megatron-core's train BlendedDataset over the same stores (skips when it is missing)."""
    pytest.importorskip("megatron.core")
    warnings.filterwarnings("ignore", module="megatron")
    logging.getLogger("megatron").setLevel(logging.ERROR)
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.tokenizers import MegatronTokenizer

    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length,
        blend=(list(prefixes), list(weights)), split=split, path_to_cache=str(cache_dir),
        tokenizer=MegatronTokenizer.from_pretrained(metadata_path={"library": "null-text"}, vocab_size=vocab_size),
        reset_position_ids=reset_position_ids, reset_attention_mask=reset_attention_mask,
        eod_mask_loss=eod_mask_loss, create_attention_mask=create_attention_mask,
        add_extra_token_to_sequence=add_extra_token,
        drop_last_partial_validation_sequence=drop_last_partial_validation,
        inter_document_masking=inter_document_masking,
    )
    names = ("train", "valid", "test")
    sizes = [num_samples if name == split_name else 0 for name in names]
    built = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
    return built[names.index(split_name)]


#: Special tokens of the code tokenizer: end of document, FIM's sentinels and pad, a file separator.
FIM_SPECIALS = ("<|endoftext|>", "<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>", "<file_sep>")
FIM_EXTRA_TOKENS = {"prefix": "<fim_prefix>", "middle": "<fim_middle>", "suffix": "<fim_suffix>",
                    "pad": "<fim_pad>", "eod": "<|endoftext|>"}


def stdlib_sources(first: int, count: int) -> list[str]:
    """``count`` standard-library modules (sorted by name, from ``first``): real code, no download."""
    import glob

    return sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))[first:first + count]


def train_code_tokenizer(directory):
    """A byte-level BPE (GPT-2 style, 1500 ids) trained on 25 standard-library modules, with
    :data:`FIM_SPECIALS`, loaded as tokenloom's ``HuggingFaceTokenizer`` (the ``tokenizers``
    engine: FIM re-encodes with it)."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenloom.tokenization.tokenizers import HuggingFaceTokenizer

    model = tokenizers.Tokenizer(tokenizers.models.BPE())
    model.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = tokenizers.decoders.ByteLevel()
    model.train(stdlib_sources(0, 25), tokenizers.trainers.BpeTrainer(
        vocab_size=1500, special_tokens=list(FIM_SPECIALS),
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    path = os.path.join(str(directory), "tokenizer.json")
    model.save(path)
    return HuggingFaceTokenizer(path, engine="hf")
