"""Pure index kernels (arrays in, arrays out; no I/O): packed samples, shuffles, blends.

Two modes share one sample semantics (:mod:`tokenloom.index.epochs`):

* Megatron-exact: :func:`build_megatron_gpt_indices` and :func:`megatron_blend` reproduce
  megatron-core 0.19.2's arrays bit for bit;
* stateless: :func:`build_stateless_gpt_index` and :class:`Blend` answer "which tokens form
  sample i" in O(1)-ish time with no per-sample array;

and whole documents packed by best fit (:func:`pack_best_fit`) serve either blend. A global
batch's samples are placed on (rank, micro-batch) slots by their attention cost
(:class:`CostModel`, :func:`assign_slots`) when serving balances ranks. This package
exports the kernels a user calls and the arrays they return; the build's own planning of epochs,
splits and blends (``epochs``, ``blend_spec``) stays importable from its modules.

numba (a dependency of tokenloom) speeds up the sequential kernels; on a platform without it
every function returns the same arrays, more slowly. :mod:`tokenloom.index.kernels` is the one module that knows
numba: it picks backends and compiles a kernel on first use, so importing this package never
imports numba.
"""

from tokenloom import _moved
from tokenloom.index.balance import CostModel, assign_slots
from tokenloom.index.best_fit import BestFitPacking, pack_best_fit
from tokenloom.index.blend import Blend
from tokenloom.index.feistel import FeistelPermutation
from tokenloom.index.megatron_blend import megatron_blend
from tokenloom.index.megatron_gpt import GPTIndices, build_megatron_gpt_indices
from tokenloom.index.split import SplitDocumentRanges, document_ids, split_document_ranges
from tokenloom.index.stateless import StatelessGPTIndex, build_stateless_gpt_index

#: Names this package exported before its face was curated, and the module each is imported from
#: now; importing one from here still works, with a DeprecationWarning (:mod:`tokenloom._moved`).
_MOVED = {
    "MAX_BLEND_SIZE": "tokenloom.index.blend",
    "largest_remainder_counts": "tokenloom.index.blend",
    "BlendSpec": "tokenloom.index.blend_spec",
    "MegatronSizes": "tokenloom.index.blend_spec",
    "SplitBlendPlan": "tokenloom.index.blend_spec",
    "megatron_sizes": "tokenloom.index.blend_spec",
    "plan_split_blends": "tokenloom.index.blend_spec",
    "EpochPlan": "tokenloom.index.epochs",
    "plan_epochs": "tokenloom.index.epochs",
    "megatron_exhaustive_blend": "tokenloom.index.megatron_blend",
    "GPTSample": "tokenloom.index.megatron_gpt",
    "megatron_gpt_sample": "tokenloom.index.megatron_gpt",
    "DocumentRange": "tokenloom.index.split",
    "parse_split": "tokenloom.index.split",
    "SampleSpans": "tokenloom.index.stateless",
}


def __getattr__(name: str) -> object:
    return _moved.moved_attribute(__name__, name, _MOVED)


__all__ = [
    "BestFitPacking",
    "Blend",
    "CostModel",
    "FeistelPermutation",
    "GPTIndices",
    "SplitDocumentRanges",
    "StatelessGPTIndex",
    "assign_slots",
    "build_megatron_gpt_indices",
    "build_stateless_gpt_index",
    "document_ids",
    "megatron_blend",
    "pack_best_fit",
    "split_document_ranges",
]
