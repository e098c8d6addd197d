"""Helpers shared by the index tests (not collected: no test_ prefix)."""

import numpy as np


class ArrayReader:
    """A token reader over in-memory documents (the ``IndexedDataset.get`` signature)."""

    def __init__(self, documents):
        self.documents = documents

    def get(self, sequence_id, offset=0, length=None):
        document = self.documents[sequence_id]
        stop = document.shape[0] if length is None else offset + length
        return document[offset:stop]


def numbered_documents(lengths):
    """Document d's token at offset o is d * 100_000 + o: every token of the store is distinct."""
    return [np.arange(n, dtype=np.int64) + d * 100_000 for d, n in enumerate(lengths.tolist())]


def megatron_blending_indices(weights, size):
    """megatron-core's build_blending_indices, called the way BlendedDataset calls it: (dataset
    index (size,) int16, dataset sample index (size,) int64)."""
    from megatron.core.datasets import helpers_cpp

    weights = np.asarray(weights, dtype=np.float64)
    dataset_index = np.zeros(size, dtype=np.int16)
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    helpers_cpp.build_blending_indices(dataset_index, dataset_sample_index, weights, len(weights), size, False)
    return dataset_index, dataset_sample_index
