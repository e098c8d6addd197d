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
* ``provenance`` -- :func:`where` a sample's documents come from, :func:`find` the samples
  holding a document, without replaying the stream.
"""

from tokenloom.source.blended import ArrayLocator, BlendedSource, BlendLocator, DirectLocator, read_by_dataset
from tokenloom.source.keys import build_key, canonical_json, hash_key
from tokenloom.source.memory import MEGATRON_SURPLUS, StatelessBlendSource, StoreBlendSource
from tokenloom.source.protocol import DatasetInfo, PieceRows, SampleSource, read_positions
from tokenloom.source.provenance import Piece, SampleOrigin, find, steps_of, where
from tokenloom.source.readers import DatasetReader, MegatronReader, StatelessReader, gather_gpt_samples, resolve_eod

__all__ = [
    "MEGATRON_SURPLUS",
    "ArrayLocator",
    "BlendLocator",
    "BlendedSource",
    "DatasetInfo",
    "DatasetReader",
    "DirectLocator",
    "MegatronReader",
    "Piece",
    "PieceRows",
    "SampleOrigin",
    "SampleSource",
    "StatelessBlendSource",
    "StatelessReader",
    "StoreBlendSource",
    "build_key",
    "canonical_json",
    "find",
    "gather_gpt_samples",
    "hash_key",
    "read_by_dataset",
    "read_positions",
    "resolve_eod",
    "steps_of",
    "where",
]
