"""Sample sources: one split of a build, readable by position. The layer under build and serve.

io <- index <- **source** <- builder, serve. The build stage *produces* sources (``BuildResult.split``),
the serving stage *consumes* them (through the :class:`SampleSource` protocol):

* ``protocol`` -- :class:`SampleSource`, :class:`DatasetInfo`: the contract;
* ``readers`` -- one reader per kind of index (megatron-core's arrays, in memory or
  memory-mapped; the stateless Feistel index): sample ids of one dataset -> token rows;
* ``blended`` -- :class:`BlendedSource`, the one blended source: a locator (blend arrays,
  closed-form blend, or one dataset) over one reader per dataset;
* ``memory`` -- :class:`StoreBlendSource` and :class:`StatelessBlendSource`: blended sources
  built in memory from token stores, without a build;
* ``gather`` -- the compiled row-copying kernels the readers use;
* ``keys`` -- canonical JSON and the one :func:`build_key` a serving state is checked against;
* ``provenance`` -- where a sample's documents come from (:class:`SampleOrigin`, :class:`Piece`),
  the samples holding a document, and :func:`steps_of` them, without replaying the stream
  (``split.where(positions)``, ``split.find(prefix, document)``).

This package exports the contract and the sources a user opens or receives; readers, locators,
kernels and keys stay importable from their modules.
"""

from tokenloom import _moved
from tokenloom.source.blended import BlendedSource
from tokenloom.source.fim_options import FimOptions
from tokenloom.source.memory import StatelessBlendSource, StoreBlendSource
from tokenloom.source.protocol import DatasetInfo, PieceRows, SampleSource
from tokenloom.source.provenance import Piece, SampleOrigin, steps_of

#: Names this package exported before its face was curated, and the module each is imported from
#: now; importing one from here still works, with a DeprecationWarning (:mod:`tokenloom._moved`).
_MOVED = {
    "ArrayLocator": "tokenloom.source.blended",
    "BlendLocator": "tokenloom.source.blended",
    "DirectLocator": "tokenloom.source.blended",
    "read_by_dataset": "tokenloom.source.blended",
    "build_key": "tokenloom.source.keys",
    "canonical_json": "tokenloom.source.keys",
    "hash_key": "tokenloom.source.keys",
    "MEGATRON_SURPLUS": "tokenloom.source.memory",
    "read_positions": "tokenloom.source.protocol",
    "find": "tokenloom.source.provenance",
    "where": "tokenloom.source.provenance",
    "DatasetReader": "tokenloom.source.readers",
    "MegatronReader": "tokenloom.source.readers",
    "StatelessReader": "tokenloom.source.readers",
    "gather_gpt_samples": "tokenloom.source.readers",
    "resolve_eod": "tokenloom.source.readers",
}


def __getattr__(name: str) -> object:
    return _moved.moved_attribute(__name__, name, _MOVED)


__all__ = [
    "BlendedSource",
    "DatasetInfo",
    "FimOptions",
    "Piece",
    "PieceRows",
    "SampleOrigin",
    "SampleSource",
    "StatelessBlendSource",
    "StoreBlendSource",
    "steps_of",
]
