"""Regenerate tests/golden/index/: GPTDataset index arrays built by megatron-core 0.19.2 itself.

    python tests/golden/make_index_golden.py

Needs megatron-core (and torch); the test that reads these files does not.
"""

from __future__ import annotations

import json
import logging
import pathlib
import warnings

import numpy as np

OUT = pathlib.Path(__file__).resolve().parent / "index"

# name, lengths, first document of the split, num_samples, seq_length, seed, extra, drop, valid
CASES = [
    ("worked-example", [5, 3, 4], 0, 4, 3, 1234, True, True, False),
    ("one-document", [37], 0, 9, 8, 0, True, True, False),
    ("tiny-documents-many-epochs", [1, 2, 1, 3, 1, 1, 2], 0, 40, 2, 99, True, True, False),
    ("long-documents", [300, 17, 260, 5], 1, 20, 16, 7, True, True, False),
    ("separate-final-epoch", list(range(1, 41)), 0, 153, 8, 2**32 - 1, True, True, False),
    ("no-extra-token", [9, 4, 11, 2, 6], 0, 15, 4, 31337, False, True, False),
    ("one-epoch-none", [12, 7, 30, 1, 9], 2, None, 5, 42, True, True, False),
    ("valid-keep-partial", [12, 7, 30, 1, 9], 0, None, 7, 5, True, False, True),
    ("with-empty-documents", [0, 6, 0, 0, 9, 3, 0, 4], 0, 10, 3, 2024, True, True, False),
]


def main() -> None:
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.utils import Split
    from megatron.core.tokenizers import MegatronTokenizer

    class Lengths:
        def __init__(self, lengths):
            self.sequence_lengths = lengths

    tokenizer = MegatronTokenizer.from_pretrained(metadata_path={"library": "null-text"}, vocab_size=512)
    OUT.mkdir(parents=True, exist_ok=True)
    manifest = []
    for name, lengths, first, num_samples, seq_length, seed, extra, drop, valid in CASES:
        lengths = np.array(lengths, dtype=np.int32)
        config = GPTDatasetConfig(
            random_seed=seed, sequence_length=seq_length, tokenizer=tokenizer,
            reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
            add_extra_token_to_sequence=extra, drop_last_partial_validation_sequence=drop,
        )
        ids = np.arange(first, lengths.shape[0], dtype=np.int32)
        dataset = GPTDataset(Lengths(lengths), None, ids, num_samples,
                             Split.valid if valid else Split.train, config)
        np.save(OUT / f"{name}-sequence_lengths.npy", lengths)
        np.save(OUT / f"{name}-document_index.npy", dataset.document_index)
        np.save(OUT / f"{name}-sample_index.npy", dataset.sample_index)
        np.save(OUT / f"{name}-shuffle_index.npy", dataset.shuffle_index)
        manifest.append(dict(name=name, first_document=first, num_samples=num_samples,
                             seq_length=seq_length, seed=seed, add_extra_token=extra,
                             drop_last_partial=drop or not valid))
    (OUT / "cases.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"wrote {len(manifest)} cases to {OUT}")


if __name__ == "__main__":
    main()
