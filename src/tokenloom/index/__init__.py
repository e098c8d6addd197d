"""Pure index kernels (arrays in, arrays out; no I/O): packed samples, shuffles, blends.

Two modes share one sample semantics (:mod:`tokenloom.index.epochs`):

* Megatron-exact: :func:`build_megatron_gpt_indices` and :func:`megatron_blend` reproduce
  megatron-core 0.19.2's arrays bit for bit;
* stateless: :func:`build_stateless_gpt_index` and :class:`Blend` answer "which tokens form
  sample i" in O(1)-ish time with no per-sample array.

numba (a dependency of tokenloom) speeds up the sequential kernels; on a platform without it
every function returns the same arrays, more slowly. :mod:`tokenloom.index.kernels` is the one module that knows
numba: it picks backends and compiles a kernel on first use, so importing this package never
imports numba.
"""

from tokenloom.index.blend import MAX_BLEND_SIZE, Blend, largest_remainder_counts
from tokenloom.index.blend_spec import (
    BlendSpec,
    MegatronSizes,
    SplitBlendPlan,
    megatron_sizes,
    plan_split_blends,
)
from tokenloom.index.epochs import EpochPlan, plan_epochs
from tokenloom.index.feistel import FeistelPermutation
from tokenloom.index.megatron_blend import megatron_blend, megatron_exhaustive_blend
from tokenloom.index.megatron_gpt import (
    GPTIndices,
    GPTSample,
    build_megatron_gpt_indices,
    megatron_gpt_sample,
)
from tokenloom.index.split import (
    DocumentRange,
    SplitDocumentRanges,
    document_ids,
    parse_split,
    split_document_ranges,
)
from tokenloom.index.stateless import SampleSpans, StatelessGPTIndex, build_stateless_gpt_index

__all__ = [
    "MAX_BLEND_SIZE",
    "Blend",
    "BlendSpec",
    "DocumentRange",
    "EpochPlan",
    "FeistelPermutation",
    "GPTIndices",
    "GPTSample",
    "MegatronSizes",
    "SampleSpans",
    "SplitBlendPlan",
    "SplitDocumentRanges",
    "StatelessGPTIndex",
    "build_megatron_gpt_indices",
    "build_stateless_gpt_index",
    "document_ids",
    "largest_remainder_counts",
    "megatron_blend",
    "megatron_exhaustive_blend",
    "megatron_gpt_sample",
    "megatron_sizes",
    "parse_split",
    "plan_epochs",
    "plan_split_blends",
    "split_document_ranges",
]
