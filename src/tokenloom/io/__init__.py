"""The Megatron-LM .bin/.idx token store: read, write, merge, validate."""

from tokenloom.io.format import DTYPE_CODES, MAGIC, dtype_for_vocab
from tokenloom.io.merge import merge_stores
from tokenloom.io.reader import IndexedDataset
from tokenloom.io.report import StoreReport, inspect_store, validate
from tokenloom.io.writer import IndexedDatasetWriter

__all__ = [
    "DTYPE_CODES",
    "MAGIC",
    "IndexedDataset",
    "IndexedDatasetWriter",
    "StoreReport",
    "dtype_for_vocab",
    "inspect_store",
    "merge_stores",
    "validate",
]
