"""Fill-in-the-middle settings: Megatron-LM's options, and what a build's config asks of its splits.

:class:`FimOptions` is ``GPTFIMDatasetConfig``'s vocabulary, validated. It lives under both the
builder (a build config's ``fim``) and serving (``tokenloom.serve.fim.FimTransform``, which
permutes samples by it), so it sits in the layer they share. :class:`FimSettings` is what a
build hands each split it opens: the options, the stores they permute, the stores' tokenizer and
the build's seed; ``BatchPipeline`` makes the transformation of it when ``SampleOptions`` gives
none.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tokenloom.errors import ConfigError

#: The keys of Megatron-LM's ``fim_extra_tokens``, in its order.
FIM_TOKEN_KEYS = ("prefix", "middle", "suffix", "pad", "eod")


def _rate(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0.0 <= value <= 1.0:
        raise ConfigError(f"{name}={value!r}; expected a probability in [0, 1]")
    return float(value)


@dataclass(frozen=True)
class FimOptions:
    """FIM in Megatron-LM's vocabulary (``GPTFIMDatasetConfig``): ``rate`` is ``fim_rate``,
    ``spm_rate`` ``fim_spm_rate``, ``extra_tokens`` ``fim_extra_tokens`` (the spelling of the
    prefix, middle, suffix, pad and end-of-document tokens), ``split_sample``
    ``fim_split_sample``, ``fragment_rate`` ``fim_fragment_rate``, ``no_prefix`` ``fim_no_prefix``."""

    rate: float
    """Probability that a piece of a sample (between end-of-document tokens) is permuted."""
    extra_tokens: Mapping[str, str]
    """The tokens' spellings by :data:`FIM_TOKEN_KEYS`, e.g. ``{"prefix": "<fim_prefix>", ...}``."""
    spm_rate: float = 0.5
    """Probability that a permuted piece is SPM rather than PSM."""
    split_sample: str | None = None
    """A token (e.g. a file separator) at which a piece is split again, each fragment permuted
    on its own at ``fragment_rate``."""
    fragment_rate: float | None = None
    """Probability that a fragment is permuted (with ``split_sample``)."""
    no_prefix: str | None = None
    """A piece whose text starts with this is never permuted."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "rate", _rate("fim_rate", self.rate))
        object.__setattr__(self, "spm_rate", _rate("fim_spm_rate", self.spm_rate))
        if not isinstance(self.extra_tokens, Mapping) or set(self.extra_tokens) != set(FIM_TOKEN_KEYS) \
                or not all(isinstance(v, str) and v for v in self.extra_tokens.values()):
            raise ConfigError(f"fim_extra_tokens={self.extra_tokens!r}; expected the spelling of each of "
                              f"{', '.join(FIM_TOKEN_KEYS)}, e.g. {{'prefix': '<fim_prefix>', 'middle': "
                              "'<fim_middle>', 'suffix': '<fim_suffix>', 'pad': '<fim_pad>', 'eod': '<|endoftext|>'}")
        object.__setattr__(self, "extra_tokens", dict(self.extra_tokens))
        if self.split_sample is not None:
            if not isinstance(self.split_sample, str) or not self.split_sample:
                raise ConfigError(f"fim_split_sample={self.split_sample!r}; expected the spelling of one token")
            if self.fragment_rate is None:
                raise ConfigError(f"fim_split_sample={self.split_sample!r} without fim_fragment_rate; each fragment "
                                  "is permuted at that rate: give it (Megatron-LM fails on the first sample without)")
        if self.fragment_rate is not None:
            object.__setattr__(self, "fragment_rate", _rate("fim_fragment_rate", self.fragment_rate))
        if self.no_prefix is not None and not isinstance(self.no_prefix, str):
            raise ConfigError(f"fim_no_prefix={self.no_prefix!r}; expected a string or None")

    @classmethod
    def from_megatron(cls, values: Mapping[str, Any]) -> FimOptions:
        """From Megatron-LM's names (``fim_rate``, ``fim_spm_rate``, ``fim_extra_tokens``,
        ``fim_split_sample``, ``fim_fragment_rate``, ``fim_no_prefix``)."""
        known = {"fim_rate": "rate", "fim_spm_rate": "spm_rate", "fim_extra_tokens": "extra_tokens",
                 "fim_split_sample": "split_sample", "fim_fragment_rate": "fragment_rate",
                 "fim_no_prefix": "no_prefix"}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ConfigError(f"unknown FIM key(s) {unknown}; expected {', '.join(known)}")
        if "fim_rate" not in values or "fim_extra_tokens" not in values:
            raise ConfigError("FIM needs fim_rate and fim_extra_tokens (the prefix, middle, suffix, pad and eod "
                              "tokens)")
        return cls(**{known[key]: value for key, value in values.items()})


@dataclass(frozen=True, kw_only=True)
class FimConfig:
    """A build config's ``fim``: Megatron-LM's keys (:meth:`FimOptions.from_megatron`) plus
    ``stores``, the stores whose samples are permuted (a blend of code and prose permutes the
    code only; absent: every store). FIM happens when samples are served, so it is not part of
    the build's key: changing it reuses the built indices."""

    options: FimOptions
    stores: tuple[str, ...] | None = None
    """Store prefixes as the config spells them (the builder resolves them as it does a blend's)."""

    @classmethod
    def from_mapping(cls, values: Any) -> FimConfig:
        """ConfigError naming the key for anything but Megatron-LM's FIM keys and ``stores``."""
        if isinstance(values, FimConfig):
            return values
        if not isinstance(values, Mapping):
            raise ConfigError(f"fim={values!r}; expected a mapping of Megatron-LM's FIM keys (fim_rate, "
                              "fim_extra_tokens, ...) and optionally stores")
        values = dict(values)
        stores = values.pop("stores", None)
        if stores is not None and (isinstance(stores, str) or not isinstance(stores, (list, tuple)) or not stores
                                   or not all(isinstance(p, str) and p for p in stores)):
            raise ConfigError(f"fim.stores={stores!r}; expected a non-empty list of store prefixes")
        try:
            options = FimOptions.from_megatron(values)
        except ConfigError as exc:
            raise ConfigError(f"fim: {exc}") from None
        return cls(options=options, stores=None if stores is None else tuple(stores))

    def to_dict(self) -> dict[str, Any]:
        """The config's spelling (Megatron-LM's keys)."""
        o = self.options
        return {"fim_rate": o.rate, "fim_spm_rate": o.spm_rate, "fim_extra_tokens": dict(o.extra_tokens),
                "fim_split_sample": o.split_sample, "fim_fragment_rate": o.fragment_rate,
                "fim_no_prefix": o.no_prefix, "stores": None if self.stores is None else list(self.stores)}


@dataclass(frozen=True, kw_only=True)
class FimSettings:
    """A build config's ``fim`` as a split serves it (``BlendedSource.fim``)."""

    options: FimOptions
    stores: tuple[str, ...] | None
    """The config's permuted store prefixes, resolved (a split permutes those it holds); None:
    every store."""
    codec: Any
    """The stores' tokenizer (a ``tokenloom.serve.fim.FimCodec``: FIM cuts the samples' text)."""
    seed: int
    """The build's seed: each sample's generator is drawn from ``(seed, dataset, sample)``."""


__all__ = ["FIM_TOKEN_KEYS", "FimConfig", "FimOptions", "FimSettings"]
