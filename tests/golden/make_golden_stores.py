"""Regenerate tests/golden/stores with megatron-core's own IndexedDatasetBuilder.

    python tests/golden/make_golden_stores.py

Writes two tiny stores (uint16 one-sequence documents; int32 multi-sequence documents) and
expected.json holding their sequences and document boundaries, so tests/io/test_golden_stores.py
checks compatibility on machines without megatron-core.
"""

import json
import os

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stores")

CORPORA = {
    "uint16_docs": (np.uint16, [[[72, 105, 256]], [[256]], [[1, 65535, 0, 7, 256]]]),
    "int32_multiseq": (np.int32, [[[1, 2], [3]], [[100000]], [[4], [], [5, 6, 2**31 - 1]]]),
}


def main() -> None:
    os.makedirs(HERE, exist_ok=True)
    expected = {}
    for name, (dtype, docs) in CORPORA.items():
        prefix = os.path.join(HERE, name)
        builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
        for doc in docs:
            for seq in doc:
                builder.add_item(torch.tensor(np.asarray(seq, dtype=np.int64)))
            builder.end_document()
        builder.finalize(prefix + ".idx")
        expected[name] = {"dtype": np.dtype(dtype).name, "documents": docs}
    with open(os.path.join(HERE, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
