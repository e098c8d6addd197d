"""The Megatron-LM .bin/.idx token store: read, write, merge, validate.

The format's constants and parsers (``format``), the object-storage readers (``remote``, ``s3``)
and the free-space checks (``space``) stay importable from their modules.
"""

from tokenloom import _moved
from tokenloom.io.format import dtype_for_vocab
from tokenloom.io.merge import merge_stores
from tokenloom.io.reader import IndexedDataset
from tokenloom.io.report import StoreReport, inspect_store, validate
from tokenloom.io.writer import IndexedDatasetWriter

#: Names this package exported before its face was curated, and the module each is imported from
#: now; importing one from here still works, with a DeprecationWarning (:mod:`tokenloom._moved`).
_MOVED = {
    "DTYPE_CODES": "tokenloom.io.format",
    "MAGIC": "tokenloom.io.format",
}


def __getattr__(name: str) -> object:
    return _moved.moved_attribute(__name__, name, _MOVED)


__all__ = [
    "IndexedDataset",
    "IndexedDatasetWriter",
    "StoreReport",
    "dtype_for_vocab",
    "inspect_store",
    "merge_stores",
    "validate",
]
