"""Helpers shared by the index tests (not collected: no test_ prefix)."""

import numpy as np

from tokenloom.index.feistel import FeistelPermutation


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


# ----------------------------------------------------------------------------- the stateless index's slow reference


def reference_stream(document_ids, seed, num_epochs):
    """The document stream from the FORMAT.md definition (not the index's kernels): the split's
    store document ids, epoch after epoch, epoch e in the order of its "documents" permutation."""
    ids = np.asarray(document_ids)
    order = []
    for epoch in range(num_epochs):
        perm = FeistelPermutation.from_seed(len(ids), seed=seed, purpose="documents", epoch=epoch, backend="numpy")
        order.extend(ids[perm(np.arange(len(ids)))].tolist())
    return np.array(order, dtype=np.int64)


def reference_document_order(index):
    """Every epoch's documents of a StatelessGPTIndex, in order (its virtual document_index)."""
    ids = (np.arange(index.num_documents) + index.first_document_id if index.document_ids is None
           else index.document_ids)
    return reference_stream(ids, index.seed, index.plan.num_epochs)


def reference_pieces(lengths, order, seq_length, extra, num_samples, first_token=0):
    """The slow packer: spell out the token stream, cut windows from stream token ``first_token``
    on, group them into document runs.

    Returns, per packed sample, the list of (position, document, offset, length) runs it reads.
    """
    stream = [(position, document, offset) for position, document in enumerate(order.tolist())
              for offset in range(int(lengths[document]))]
    samples = []
    for k in range(num_samples):
        window = stream[first_token + k * seq_length:first_token + (k + 1) * seq_length + extra]
        assert len(window) == seq_length + extra
        runs = []
        for position, document, offset in window:
            if runs and runs[-1][0] == position:
                runs[-1][3] += 1
            else:
                runs.append([position, document, offset, 1])
        samples.append([tuple(run) for run in runs])
    return samples


def reference_row(lengths, order, token, extra):
    """megatron-core's sample-index row of stream token ``token``: (0, 0) at token 0, else the
    (position j, token - C_j) with C_j < token + extra <= C_{j+1}, by a linear scan."""
    if token == 0:
        return (0, 0)
    before = 0  # C_j
    for position, document in enumerate(order.tolist()):
        after = before + int(lengths[document])
        if before < token + extra <= after:
            return (position, token - before)
        before = after
    raise AssertionError(f"the stream ends before token {token}")


def pieces_of(spans, k, keep_empty=True):
    """Sample k's pieces of a SampleSpans, as (position, document, offset, length)."""
    lo, hi = spans.bounds[k], spans.bounds[k + 1]
    rows = zip(spans.positions[lo:hi].tolist(), spans.document_ids[lo:hi].tolist(),
               spans.offsets[lo:hi].tolist(), spans.lengths[lo:hi].tolist())
    return [row for row in rows if keep_empty or row[3] > 0]


def megatron_pieces(document_index, sample_index, k, extra):
    """The pieces megatron-core's GPTDataset reads for packed sample k, from its arrays."""
    (begin, begin_offset), (end, end_offset) = sample_index[k].tolist(), sample_index[k + 1].tolist()
    pieces = []
    for position in range(begin, end + 1):
        offset = begin_offset if position == begin else 0
        stop = end_offset + extra if position == end else None
        pieces.append((position, int(document_index[position]), offset, stop))
    return pieces
