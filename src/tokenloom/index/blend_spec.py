"""Blend configuration: which datasets, with what weights, how many samples per split.

Two sizing modes, named in ``SIZING_MODES``:

``"exact"`` — megatron-core 0.19.2's ``BlendedMegatronDatasetBuilder``, number for number:
    * weights are normalised (float64 ``w / sum(w)``);
    * dataset ``d`` of a split asked for ``N`` samples has the *target* ``ceil(N * w_d)`` and
      is built with the *buffer* ``ceil(ceil(N * w_d) * (1 + surplus))`` samples
      (``mid_level_dataset_surplus``, default 0.005: half a percent spare);
    * the blended split has ``sum_d ceil(N * w_d)`` samples — up to ``D - 1`` more than ``N``;
    * ``BlendedDataset`` normalises the weights once more and runs the greedy
      (:func:`tokenloom.index.megatron_blend.megatron_blend`) over that length;
    * without weights, dataset sizes are the weights: ``min(N, sum)`` samples by the greedy, or
      every sample of every dataset (the exhaustive greedy) when the split has no ``N``;
    * a lone prefix without weights (or any lone prefix of ``blend_per_split``) is no blend at
      all: position ``i`` is sample ``i`` of that dataset, ``N`` samples.

``"tokenloom"`` — exactly ``N`` samples, ``count_d`` by largest remainder, nothing spare
    (:class:`tokenloom.index.blend.Blend`); each dataset is built with exactly its count.

Weights are **per sample** (``weight_unit="sample"``, megatron's meaning: the share of the
blend's samples) or **per token** (``weight_unit="token"``: the share of the blend's tokens;
converted to per-sample weights through each dataset's tokens per sample).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from tokenloom.errors import ConfigError
from tokenloom.index.blend import Blend
from tokenloom.index.megatron_blend import megatron_blend, megatron_exhaustive_blend
from tokenloom.index.split import SPLIT_NAMES, split_bookends
from tokenloom.validate import check_non_negative_int

__all__ = [
    "DEFAULT_SURPLUS",
    "SIZING_MODES",
    "WEIGHT_UNITS",
    "BlendSpec",
    "MegatronSizes",
    "SplitBlendPlan",
    "megatron_normalize",
    "megatron_sizes",
    "plan_split_blends",
]

SIZING_MODES = ("exact", "tokenloom")
WEIGHT_UNITS = ("sample", "token")
#: megatron-core's default ``mid_level_dataset_surplus``.
DEFAULT_SURPLUS = 0.005


def megatron_normalize(weights) -> np.ndarray:
    """megatron-core's ``normalize``: float64 ``w / sum(w)`` (as an array, not a list)."""
    w = np.asarray(weights, dtype=np.float64)
    return w / np.sum(w)


def _as_count(value, what: str) -> int:
    return check_non_negative_int(what, value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlendSpec:
    """The datasets of a blend and their weights (``BlendSpec(prefixes=..., weights=...)``)."""

    prefixes: tuple[str, ...]
    """Token-store prefixes (paths without ``.bin``/``.idx``), one per dataset."""
    weights: tuple[float, ...] | None = None
    """Relative weights, one per prefix, any positive scale; ``None`` weighs every dataset by
    its size (megatron's unweighted blend)."""
    weight_unit: str = "sample"
    """``"sample"``: a weight is the dataset's share of the blend's samples (megatron-core's
    meaning). ``"token"``: its share of the blend's tokens."""
    budget_tokens: tuple[int, ...] | None = None
    """Training tokens each dataset was given instead of a share (a token or epoch budget), when
    the weights were derived from budgets: the weights are then the sample counts
    ``budget // seq_length`` (see ``tokenloom.builder.config``); None when weights were given."""
    budget_epochs: tuple[float, ...] | None = None
    """Epochs of each dataset's train documents, given as its budget and not yet turned into
    sample counts: a build resolves them first (``BuildConfig.resolve`` reads the stores' .idx),
    after which ``weights`` and ``budget_tokens`` hold the counts and this is None."""
    written_prefixes: tuple[str, ...] | None = dataclasses.field(default=None, compare=False)
    """The prefixes as a config file spelt them, where ``prefixes`` are those resolved against the
    file's folder; None when they are the same. Build keys and megatron-core's file names are made
    from the spelling, so moving the directory a config is run from changes neither."""

    def spelt(self) -> tuple[str, ...]:
        """The prefixes as the config spelt them (what keys and megatron-core's names hash)."""
        return self.prefixes if self.written_prefixes is None else self.written_prefixes

    def has_prefix(self, prefix: str) -> bool:
        """Whether ``prefix`` is one of the blend's datasets (O(1): blends hold 10,000 stores)."""
        return prefix in self._prefix_set

    def __post_init__(self) -> None:
        prefixes = tuple(self.prefixes) if not isinstance(self.prefixes, str) else None
        if not prefixes or any(not isinstance(p, str) or not p for p in prefixes):
            raise ConfigError(f"prefixes={self.prefixes!r}; expected a non-empty sequence of non-empty strings")
        object.__setattr__(self, "prefixes", prefixes)
        if self.written_prefixes is not None:
            written = tuple(self.written_prefixes)
            if len(written) != len(prefixes):
                raise ConfigError(f"{len(written)} written prefixes for {len(prefixes)} prefixes; expected one each")
            object.__setattr__(self, "written_prefixes", None if written == prefixes else written)
        object.__setattr__(self, "_prefix_set", frozenset(prefixes))  # not a field: O(1) membership
        object.__setattr__(self, "_sizes", {})  # not a field: megatron_sizes by (num_samples, surplus)
        if self.weight_unit not in WEIGHT_UNITS:
            raise ConfigError(f"weight_unit={self.weight_unit!r}; expected one of {WEIGHT_UNITS}")
        if self.budget_epochs is not None:
            epochs = tuple(float(e) for e in self.budget_epochs)
            if len(epochs) != len(prefixes) or self.weights is not None or self.budget_tokens is not None:
                raise ConfigError(f"{len(epochs)} epoch budgets for {len(prefixes)} prefixes (with weights "
                                  f"{self.weights!r}); expected one budget per prefix and no weights before they "
                                  "are resolved")
            object.__setattr__(self, "budget_epochs", epochs)
        if self.budget_tokens is not None:
            budgets = tuple(int(b) for b in self.budget_tokens)
            if len(budgets) != len(prefixes) or self.weights is None:
                raise ConfigError(f"{len(budgets)} token budgets for {len(prefixes)} prefixes (with weights "
                                  f"{self.weights!r}); expected one budget per prefix and the weights made from them")
            object.__setattr__(self, "budget_tokens", budgets)
        if self.weights is None:
            return
        weights = tuple(float(w) for w in self.weights)
        if len(weights) != len(prefixes):
            raise ConfigError(
                f"{len(weights)} weights for {len(prefixes)} prefixes; expected one weight per prefix"
            )
        for prefix, w in zip(prefixes, weights):
            if not math.isfinite(w) or w < 0:
                raise ConfigError(f"weight of dataset {prefix!r} is {w!r}; expected a finite, non-negative number")
        if not any(w > 0 for w in weights):
            raise ConfigError(f"all {len(weights)} weights are zero; at least one dataset needs a positive weight")
        object.__setattr__(self, "weights", weights)

    @classmethod
    def from_megatron_list(cls, blend: Sequence[str]) -> BlendSpec:
        """Read megatron's flat blend list: ``["30", "a", "70", "b"]`` or ``["a", "b"]``.

        Like megatron-core's ``get_blend_from_list``: an even-length list whose every other
        entry (from the first) is a number is weighted; otherwise all entries are prefixes.
        """
        items = [str(item) for item in blend]
        if not items:
            raise ConfigError("blend list is empty; expected prefixes, or weight-prefix pairs like ['30', 'a']")
        if len(items) % 2 == 0:
            parsed = []
            for item in items[0::2]:
                try:
                    parsed.append(float(item))
                except ValueError:
                    parsed.append(None)
            if all(p is not None for p in parsed):
                return cls(prefixes=tuple(items[1::2]), weights=tuple(parsed))
            if any(p is not None for p in parsed):
                raise ConfigError(
                    f"blend list {items!r} mixes weights and prefixes; expected weight-prefix pairs "
                    "or only prefixes"
                )
        return cls(prefixes=tuple(items))

    def megatron_sizes(self, num_samples: int, *, surplus: float = DEFAULT_SURPLUS) -> MegatronSizes:
        """megatron-core's sizing of this blend for a split asked for ``num_samples`` samples:
        each dataset's target and buffer, the blended length and the weights its greedy blends
        with (see :func:`megatron_sizes`). Needs weights (a blend weighed by dataset sizes has
        no sizing rule: every dataset gives what it has)."""
        if self.weights is None:
            raise ConfigError("megatron's sizing needs weights; this blend weighs its datasets by their sizes")
        key = (num_samples, surplus)
        sizes = self._sizes.get(key)
        if sizes is None:  # a plan asks several times per split; 10,000 weights take a while
            sizes = self._sizes[key] = megatron_sizes(self.weights, num_samples, surplus=surplus)
        return sizes

    @property
    def num_datasets(self) -> int:
        """Datasets in the blend."""
        return len(self.prefixes)

    def sample_weights(self, *, dataset_num_samples=None, dataset_num_tokens=None) -> np.ndarray:
        """Per-sample weights, ``(D,)`` float64 summing to one.

        ``"sample"`` weights are normalised. ``"token"`` weights are divided by each dataset's
        tokens per sample (``dataset_num_tokens / dataset_num_samples``) first, so a dataset
        with twice the weight gets twice the tokens. Without weights, the datasets' sizes are
        the weights (sample counts; by tokens the result is the same).
        """
        samples = None if dataset_num_samples is None else self._per_dataset(dataset_num_samples, "dataset_num_samples")
        tokens = None if dataset_num_tokens is None else self._per_dataset(dataset_num_tokens, "dataset_num_tokens")
        if self.weights is None:
            if samples is None:
                raise ConfigError("an unweighted blend takes its weights from dataset_num_samples; give it")
            return megatron_normalize(samples)
        w = np.array(self.weights, dtype=np.float64)
        if self.weight_unit == "token":
            if samples is None or tokens is None:
                raise ConfigError(
                    "weight_unit='token' needs dataset_num_samples and dataset_num_tokens to turn "
                    "token shares into sample shares"
                )
            used = w > 0
            if np.any(used & ((samples <= 0) | (tokens <= 0))):
                d = int(np.flatnonzero(used & ((samples <= 0) | (tokens <= 0)))[0])
                raise ConfigError(
                    f"dataset {self.prefixes[d]!r} has {samples[d]} samples and {tokens[d]} tokens; "
                    "a weighted dataset needs both positive"
                )
            tokens_per_sample = np.where(used, tokens / np.maximum(samples, 1), 1.0)
            w = w / tokens_per_sample
        return megatron_normalize(w)

    def _per_dataset(self, values, what: str) -> np.ndarray:
        array = np.asarray(values, dtype=np.int64).reshape(-1)
        if array.shape[0] != self.num_datasets or np.any(array < 0):
            raise ConfigError(
                f"{what} has {array.shape[0]} entries (min {array.min() if array.size else None}); "
                f"expected {self.num_datasets} non-negative counts, one per prefix"
            )
        return array


@dataclasses.dataclass(frozen=True, kw_only=True)
class MegatronSizes:
    """megatron-core's per-dataset sizing of one weighted split."""

    targets: tuple[int, ...]
    """``ceil(N * w_d)``: samples the blend may draw from each dataset."""
    buffers: tuple[int, ...]
    """``ceil(ceil(N * w_d) * (1 + surplus))``: samples each dataset is built with."""
    blended_size: int
    """``sum(targets)``: the blended split's length (not ``N``)."""
    blend_weights: tuple[float, ...]
    """The weights ``BlendedDataset`` blends with: the builder's normalised weights normalised a
    second time (``w / sum(w)`` twice; the float results can differ in the last bit from once)."""


def megatron_sizes(weights, num_samples: int, *, surplus: float = DEFAULT_SURPLUS) -> MegatronSizes:
    """Targets, buffers and blended length as megatron-core computes them for ``num_samples``.

    ``weights`` are normalised here first (megatron normalises before sizing).
    """
    n = _as_count(num_samples, "num_samples")
    if not math.isfinite(surplus) or surplus < 0:
        raise ConfigError(f"surplus={surplus!r}; expected a finite, non-negative fraction such as 0.005")
    normalised = megatron_normalize(weights).tolist()
    targets = tuple(math.ceil(n * w) for w in normalised)
    buffers = tuple(math.ceil(math.ceil(n * w) * (1 + surplus)) for w in normalised)
    # BlendedDataset normalises the builder's already normalised weights once more
    blend_weights = tuple(megatron_normalize(normalised).tolist())
    return MegatronSizes(targets=targets, buffers=buffers, blended_size=sum(targets), blend_weights=blend_weights)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SplitBlendPlan:
    """How one split is blended; :meth:`build` returns its two index arrays."""

    split: str
    """``"train"``, ``"valid"`` or ``"test"``."""
    mode: str
    """``"exact"`` (megatron-core's sizing and greedy) or ``"tokenloom"``."""
    prefixes: tuple[str, ...]
    """The split's datasets."""
    weights: tuple[float, ...] | None
    """Per-sample weights handed to the blend builder (exact mode: after megatron's two
    normalisations); ``None`` for the exhaustive blend, which weighs by dataset sizes."""
    size: int
    """Samples in the blended split."""
    dataset_num_samples: tuple[int, ...] | None
    """Samples to build per dataset (exact: megatron's buffers, or the sizes it was given;
    tokenloom: exactly the blend's counts)."""
    exhaustive_sizes: tuple[int, ...] | None = None
    """Exact mode without weights or size: every sample of datasets of these sizes."""
    seed: int | None = None
    """tokenloom mode: seed of the within-window shuffle (None: closed-form order)."""
    window: int | None = None
    """tokenloom mode: positions per shuffled window."""

    def blend(self) -> Blend:
        """The tokenloom :class:`Blend` of this split (tokenloom mode only)."""
        if self.mode != "tokenloom":
            raise ConfigError(f"split {self.split!r} is planned in {self.mode!r} mode; Blend is tokenloom mode's")
        return Blend(self.weights, self.size, seed=self.seed, window=self.window, names=self.prefixes)

    def build(self) -> tuple[np.ndarray, np.ndarray]:
        """``(dataset_ids, sample_ids)`` of the split, each ``(size,)``."""
        if self.mode == "tokenloom":
            return self.blend().materialize()
        if self.exhaustive_sizes is not None:
            return megatron_exhaustive_blend(self.exhaustive_sizes)
        dataset_ids, sample_ids = megatron_blend(np.array(self.weights, dtype=np.float64), self.size)
        drawn = np.bincount(dataset_ids, minlength=len(self.prefixes))  # (D,) samples per dataset
        for d, (want, have) in enumerate(zip(drawn.tolist(), self.dataset_num_samples)):
            if want > have:  # megatron-core raises IndexError here too
                raise ConfigError(
                    f"split {self.split!r}: megatron's greedy draws {want} samples from dataset "
                    f"{self.prefixes[d]!r}, more than the {have} its surplus builds; raise surplus "
                    "(mid_level_dataset_surplus) or use mode='tokenloom', which draws exact counts"
                )
        return dataset_ids, sample_ids


def _plan_one(name: str, spec: BlendSpec, num_samples, *, mode: str, surplus: float,
              dataset_num_samples, dataset_num_tokens, seed, window,
              single_is_plain: bool) -> SplitBlendPlan:
    n = None if num_samples is None else _as_count(num_samples, f"num_samples[{name!r}]")
    if mode == "exact" and len(spec.prefixes) == 1 and (spec.weights is None or single_is_plain):
        # megatron builds the lone dataset itself, no BlendedDataset: position i is sample i
        size = n if n is not None else int(spec._per_dataset(_require(dataset_num_samples, name),
                                                              "dataset_num_samples")[0])
        return SplitBlendPlan(split=name, mode=mode, prefixes=spec.prefixes, weights=(1.0,), size=size,
                              dataset_num_samples=(size,))
    if mode == "exact":
        if spec.weight_unit != "sample":
            raise ConfigError(
                "megatron-core weighs by samples only; use weight_unit='sample' in exact mode, or "
                "mode='tokenloom' for token shares"
            )
        if spec.weights is not None:
            if n is None:
                raise ConfigError(f"split {name!r} has weights but no num_samples; weighted blends need a size")
            if any(w <= 0 for w in spec.weights):
                raise ConfigError(f"megatron-core needs positive weights; got {spec.weights!r} for split {name!r}")
            sizes = spec.megatron_sizes(n, surplus=surplus)
            return SplitBlendPlan(split=name, mode=mode, prefixes=spec.prefixes, weights=sizes.blend_weights,
                                  size=sizes.blended_size, dataset_num_samples=sizes.buffers)
        lengths = spec._per_dataset(_require(dataset_num_samples, name), "dataset_num_samples")
        for prefix, length in zip(spec.prefixes, lengths.tolist()):
            if length == 0:
                raise ConfigError(
                    f"dataset {prefix!r} has no samples in split {name!r}; megatron-core cannot blend "
                    "an empty dataset by size (give weights, or drop it from this split)"
                )
        if n is None:
            return SplitBlendPlan(split=name, mode=mode, prefixes=spec.prefixes, weights=None,
                                  size=int(lengths.sum()), dataset_num_samples=tuple(lengths.tolist()),
                                  exhaustive_sizes=tuple(lengths.tolist()))
        return SplitBlendPlan(split=name, mode=mode, prefixes=spec.prefixes,
                              weights=tuple(megatron_normalize(lengths).tolist()),
                              size=min(n, int(lengths.sum())), dataset_num_samples=tuple(lengths.tolist()))
    weights = spec.sample_weights(dataset_num_samples=dataset_num_samples, dataset_num_tokens=dataset_num_tokens)
    if n is None:
        n = int(spec._per_dataset(_require(dataset_num_samples, name), "dataset_num_samples").sum())
    blend = Blend(weights, n, seed=seed, window=window, names=spec.prefixes)
    return SplitBlendPlan(split=name, mode=mode, prefixes=spec.prefixes, weights=tuple(weights.tolist()),
                          size=n, dataset_num_samples=tuple(blend.counts.tolist()), seed=seed, window=window)


def _require(dataset_num_samples, name: str):
    if dataset_num_samples is None:
        raise ConfigError(
            f"split {name!r} is weighted by dataset sizes; give dataset_num_samples (samples in each "
            "dataset's part of the split)"
        )
    return dataset_num_samples


def plan_split_blends(*, num_samples: Sequence[int | None], blend: BlendSpec | None = None,
                      split: str | None = None, blend_per_split: Sequence[BlendSpec | None] | None = None,
                      mode: str = "exact", surplus: float = DEFAULT_SURPLUS,
                      dataset_num_samples: Sequence | None = None, dataset_num_tokens: Sequence | None = None,
                      seed: int | None = None, window: int | None = None) -> tuple[SplitBlendPlan | None, ...]:
    """Plan the train, valid and test blends, as megatron-core's builder would (``"exact"``) or
    with tokenloom's exact-size blend (``"tokenloom"``).

    Args:
        num_samples: samples wanted per split (train, valid, test); ``None`` for "all of it".
        blend: one blend cut into splits by ``split`` (a split string like ``"969,30,1"``).
        blend_per_split: or a separate blend (or ``None``) per split.
        mode: ``"exact"`` or ``"tokenloom"`` (see the module docstring).
        surplus: megatron's ``mid_level_dataset_surplus`` (exact mode).
        dataset_num_samples: per split, the samples of each dataset's part of that split; needed
            for unweighted blends and token weights.
        dataset_num_tokens: per split, the tokens of each dataset's part; needed for token weights.
        seed, window: tokenloom mode's within-window shuffle.

    Returns one :class:`SplitBlendPlan` or ``None`` per split. Splits with zero weight in the
    split string, or no blend, are ``None``.
    """
    if mode not in SIZING_MODES:
        raise ConfigError(f"mode={mode!r}; expected one of {SIZING_MODES}")
    sizes = list(num_samples)
    if len(sizes) != len(SPLIT_NAMES):
        raise ConfigError(f"num_samples has {len(sizes)} entries; expected one per split {SPLIT_NAMES}")
    if (blend is None) == (blend_per_split is None):
        raise ConfigError("give exactly one of blend (with split) and blend_per_split")
    if blend is not None:
        if split is None:
            raise ConfigError("a single blend needs a split string such as '969,30,1' to cut it into splits")
        specs = [blend if bookend is not None else None for bookend in split_bookends(split)]
    else:
        if split is not None:
            raise ConfigError("split applies to a single blend; blend_per_split already names each split's data")
        specs = list(blend_per_split)
        if len(specs) != len(SPLIT_NAMES):
            raise ConfigError(f"blend_per_split has {len(specs)} entries; expected one per split {SPLIT_NAMES}")
    per_split = lambda values, i: None if values is None else values[i]  # noqa: E731
    return tuple(
        None if spec is None else _plan_one(
            name, spec, sizes[i], mode=mode, surplus=surplus,
            dataset_num_samples=per_split(dataset_num_samples, i),
            dataset_num_tokens=per_split(dataset_num_tokens, i), seed=seed, window=window,
            single_is_plain=blend_per_split is not None,
        )
        for i, (name, spec) in enumerate(zip(SPLIT_NAMES, specs))
    )
