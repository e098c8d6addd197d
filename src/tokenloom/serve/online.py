"""Online data mixing: blend weights that follow the training signal, the same after any resume.

The training loop reports, after every step, each dataset's tokens and summed loss in that step
(all-reduced over the data-parallel ranks, so every rank reports the same numbers). Every
``every`` steps a *controller* turns the window's statistics into new weights; they take effect
``lag`` steps later, at a global-batch boundary decided now, so every rank and every prefetching
worker agrees on them without waiting on the step in flight. A decision is a weight change of the
stream (:mod:`tokenloom.serve.weight_changes`): it lives in the serving state with the
controller's own state, so a resume on any layout serves the same weights and the same batches,
and replays the history instead of recomputing it (the statistics of past steps are not needed
again).

The controller gives factors over the weights the build declared where the change takes effect
(:class:`MixingController`): on a mixture schedule a change holds to the end of its phase, and the
next decision scales the next phase's own weights, so the schedule stays the prior and a dataset
a phase leaves out stays out. A change that would take more of a dataset than the
build sized its index for (``headroom``) is a ConfigError naming the dataset and the phase: the
build decides the room, not the controller.

The loss exists on the last pipeline stage only: the training loop all-reduces the per-dataset
sums there over the data-parallel group, broadcasts them over the pipeline group (one
``(2, datasets)`` tensor), and every rank calls :meth:`OnlineMixing.report` with them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from tokenloom.errors import ConfigError
from tokenloom.validate import is_integer, is_number


def _vector(name: str, value, size: int, *, non_negative: bool) -> np.ndarray:
    try:
        array = np.asarray(value, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}={value!r}; expected {size} numbers, one per dataset") from None
    if array.shape[0] != size:
        raise ConfigError(f"{name} has {array.shape[0]} entries; expected {size}, one per dataset in the build's order")
    if not np.all(np.isfinite(array)) or (non_negative and (array < 0).any()):
        kind = "finite non-negative" if non_negative else "finite"
        raise ConfigError(f"{name}={array.tolist()}; expected {kind} numbers")
    return array


SIGNIFICANT_DIGITS = 6
"""Reported loss sums are rounded to this many significant digits before a controller sees them:
data-parallel ranks sum in another order on another layout, and a resumed run must decide the
same weights from sums that differ in their last bits."""


def _significant(values: np.ndarray, digits: int) -> np.ndarray:
    """``values`` rounded to ``digits`` significant digits (zeros stay zeros)."""
    scale = np.where(values == 0, 1.0, 10.0 ** (digits - 1 - np.floor(np.log10(np.abs(np.where(values == 0, 1.0,
                                                                                                  values))))))
    return np.round(values * scale) / scale


class MixingController(Protocol):
    """Turns one window of per-dataset statistics into the next weights: multiplicative factors
    over the weights the build declared where they take effect (a schedule's phase, a ramp's step,
    or the blend), so that a controller that has learnt nothing serves the build's mixture.
    Deterministic: any randomness comes from a generator seeded by the run's seed and kept in its
    state."""

    def decide(self, step: int, tokens: np.ndarray, loss_sums: np.ndarray) -> np.ndarray:
        """Positive factors ``(D,)`` given the window that ends before ``step``: each dataset's
        ``tokens`` and summed ``loss_sums`` over it."""
        ...

    def state_dict(self) -> dict[str, Any]:
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ...


@dataclass
class ExponentiatedGradient:
    """DoReMi's update on the per-domain loss (Xie et al. 2023): log-weights move by
    ``learning_rate`` times each domain's excess loss, ``mean loss - reference``, and the weights
    are the declared ones times their exponentials, normalised (DoReMi's softmax over a prior).
    With no reference losses the excess is against the window's token-weighted mean loss, so a
    domain the model finds harder than the rest gains weight. A domain not served in the window
    keeps its log-weight. Deterministic, so replay needs only its log-weights."""

    num_datasets: int
    learning_rate: float = 1.0
    reference: tuple[float, ...] | None = None
    """Per-domain reference losses (DoReMi's reference model), or None: the window's mean."""
    log_weights: np.ndarray = field(default=None)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if not is_integer(self.num_datasets) or self.num_datasets < 1:
            raise ConfigError(f"num_datasets={self.num_datasets!r}; expected a positive integer")
        if not is_number(self.learning_rate) or not 0 < self.learning_rate < 1e6:
            raise ConfigError(f"learning_rate={self.learning_rate!r}; expected a positive number")
        if self.reference is not None:
            self.reference = tuple(_vector("reference", self.reference, self.num_datasets, non_negative=False))
        if self.log_weights is None:
            self.log_weights = np.zeros(self.num_datasets)

    def decide(self, step: int, tokens: np.ndarray, loss_sums: np.ndarray) -> np.ndarray:
        served = tokens > 0
        if served.any():
            mean = np.where(served, loss_sums / np.maximum(tokens, 1e-300), 0.0)
            baseline = (np.asarray(self.reference) if self.reference is not None
                        else np.full(self.num_datasets, loss_sums[served].sum() / tokens[served].sum()))
            self.log_weights = self.log_weights + self.learning_rate * np.where(served, mean - baseline, 0.0)
            self.log_weights -= self.log_weights.max()  # keeps exp() in range; the ratios are unchanged
        return np.exp(self.log_weights)

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "exponentiated_gradient", "log_weights": self.log_weights.tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != "exponentiated_gradient":
            raise ConfigError(f"controller state of kind {state.get('kind')!r}; this controller is "
                              "'exponentiated_gradient'")
        self.log_weights = _vector("log_weights", state["log_weights"], self.num_datasets, non_negative=False)


def _run_end(sampler) -> int:
    """The samples the run serves in all: up to ``max_steps`` steps, or the whole stream."""
    end = sampler.stream.num_samples
    if sampler.max_steps is None or sampler.step >= sampler.max_steps:
        return end if sampler.max_steps is None else sampler.step_start
    if sampler.geometry.schedule is None:  # steps of one size: no walk
        return min(end, sampler.step_start + (sampler.max_steps - sampler.step) * sampler.geometry.global_batch_size)
    position = sampler.step_start
    for _ in range(sampler.step, sampler.max_steps):
        position += sampler.size_at(position)
        if position >= end:
            return end
    return position


class OnlineMixing:
    """Reports in, weight changes out (see the module's docstring). Attach it to a loader
    (``RankLoader(..., mixing=OnlineMixing(...))``), which calls :meth:`attach`; then call
    ``loader.report(tokens, loss_sums)`` after every optimizer step, on every rank."""

    def __init__(self, controller: MixingController, *, every: int, lag: int = 1, min_weight: float = 0.0) -> None:
        for name, value, low in (("every", every, 1), ("lag", lag, 1)):
            if not is_integer(value) or value < low:
                raise ConfigError(f"{name}={value!r}; expected an integer >= {low} (steps)"
                                  + (": weights are decided ahead, so a prefetching loader never holds a "
                                     "batch of the old weights" if name == "lag" else ""))
        if not is_number(min_weight) or not 0 <= min_weight < 1:
            raise ConfigError(f"min_weight={min_weight!r}; expected a fraction in [0, 1)")
        self.controller = controller
        self.every, self.lag, self.min_weight = int(every), int(lag), float(min_weight)
        self._decisions: list[tuple[int, int | tuple[float, ...]]] = []
        """``(step, position)`` of every decision, in order: the step the weights take effect and
        the underlying stream position where its blend segment starts (the weights are the
        segment's, not held twice). A state of schema 2 gives ``(step, weights)`` instead."""
        self._sampler = None
        self._tokens: np.ndarray | None = None
        self._loss_sums: np.ndarray | None = None
        self._reported = 0
        """Steps reported so far (the next report is of step ``_reported``)."""

    # -- the loop -------------------------------------------------------------------------------
    def report(self, sampler, tokens, loss_sums) -> bool:
        """Record step ``sampler.step - 1``'s statistics; every ``every`` steps, decide the
        weights of step ``sampler.step - 1 + lag`` and change ``sampler``'s stream there. True
        when the stream changed (a loader that reads ahead starts again from its state)."""
        num_datasets = len(sampler.source.datasets)
        if sampler.micro_batch:
            raise ConfigError(f"report after a whole step: {sampler.micro_batch} micro-batches of step "
                              f"{sampler.step} are served")
        if sampler.step <= self._reported:
            what = "no step is served yet" if sampler.step == 0 else f"step {sampler.step - 1} is reported already"
            raise ConfigError(f"report: {what}; expected one report after every optimizer step")
        if sampler.step > self._reported + 1:
            raise ConfigError(f"report of step {sampler.step - 1}, but steps {self._reported} to {sampler.step - 2} "
                              "were not reported; expected one report after every optimizer step, in order")
        tokens = _vector("tokens", tokens, num_datasets, non_negative=True)
        loss_sums = _significant(_vector("loss_sums", loss_sums, num_datasets, non_negative=False), SIGNIFICANT_DIGITS)
        if self._tokens is None:
            self._tokens, self._loss_sums = np.zeros(num_datasets), np.zeros(num_datasets)
        self._tokens += tokens
        self._loss_sums += loss_sums
        self._reported += 1
        return self._reported % self.every == 0 and self._decide(sampler)

    def _decide(self, sampler) -> bool:
        step = sampler.step - 1 + self.lag  # the first step the new weights serve
        position = sampler.step_start
        for _ in range(sampler.step, step):
            position += sampler.size_at(position)
        if position >= sampler.stream.num_samples:
            self._tokens[:], self._loss_sums[:] = 0.0, 0.0
            return False  # the run ends before the weights would take effect
        declared = np.asarray(sampler.stream.changes.declared_at(position), dtype=np.float64)
        before = self.controller.state_dict()  # a refused decision leaves the controller as it was
        try:
            factors = np.asarray(self.controller.decide(step, self._tokens, self._loss_sums), dtype=np.float64)
            if factors.shape != declared.shape or not np.all(np.isfinite(factors)) or (factors < 0).any():
                raise ConfigError(f"the controller gave factors {factors.tolist()}; expected {declared.shape[0]} "
                                  "finite non-negative numbers")
            weights = self.bounded(declared * factors, support=declared > 0)
            stream = sampler.stream.reweighted(position, weights)
            needed = _run_end(sampler)
            if stream.num_samples < needed:
                raise ConfigError(
                    f"online mixing: the weights {np.round(weights, 6).tolist()} from step {step} (sample {position}) "
                    f"would end the stream at sample {stream.num_samples}, before the run's {needed}: some dataset's "
                    "index runs out; build with more samples per dataset (a schedule: headroom), or lower min_weight")
        except ConfigError:
            self.controller.load_state_dict(before)
            raise
        sampler.stream = stream
        self._sampler = sampler  # the history reads the weights from its stream
        self._decisions.append((step, int(stream.segments[-1].start)))
        self._tokens[:], self._loss_sums[:] = 0.0, 0.0
        return True

    def bounded(self, proposed: np.ndarray, *, support: np.ndarray) -> np.ndarray:
        """``proposed`` on ``support`` (the datasets in use there), normalised, each at least
        ``min_weight``: ``min_weight + (1 - n * min_weight) * p`` over the ``n`` datasets."""
        if proposed.shape != support.shape or not np.all(np.isfinite(proposed)) or (proposed < 0).any():
            raise ConfigError(f"the controller gave weights {proposed.tolist()}; expected {support.shape[0]} finite "
                              "non-negative numbers")
        p = np.where(support, proposed, 0.0)
        if p.sum() <= 0:
            raise ConfigError(f"the controller gave weights {proposed.tolist()}, all zero on the datasets in use "
                              f"({np.flatnonzero(support).tolist()}); expected some weight there")
        n = int(support.sum())
        if n * self.min_weight >= 1:
            raise ConfigError(f"min_weight={self.min_weight} for {n} datasets in use; expected below {1 / n:.6g}")
        return np.where(support, self.min_weight + (1 - n * self.min_weight) * p / p.sum(), 0.0)

    # -- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """JSON-ready: the controller's state, the window so far, the steps reported, the history
        (``[step, position]`` per decision: its weights are the blend segment's there, in the
        sampler's state)."""
        return {"every": self.every, "lag": self.lag, "min_weight": self.min_weight, "reported": self._reported,
                "window_tokens": None if self._tokens is None else self._tokens.tolist(),
                "window_loss_sums": None if self._loss_sums is None else self._loss_sums.tolist(),
                "history": [[step, list(at) if isinstance(at, tuple) else at] for step, at in self._decisions],
                "controller": self.controller.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s output (any layout); ConfigError on another setting."""
        for name in ("every", "lag", "min_weight"):
            if state.get(name) != getattr(self, name):
                raise ConfigError(f"the state's online mixing has {name}={state.get(name)!r}, this one "
                                  f"{getattr(self, name)!r}; resume with the settings the run started with")
        try:
            self._reported = int(state["reported"])
            self._tokens = None if state["window_tokens"] is None else np.asarray(state["window_tokens"], np.float64)
            self._loss_sums = (None if state["window_loss_sums"] is None
                               else np.asarray(state["window_loss_sums"], np.float64))
            self._decisions = [(int(step), tuple(float(w) for w in at) if isinstance(at, list) else int(at))
                               for step, at in state["history"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"serving state: malformed online_mixing ({exc!r})") from None
        self.controller.load_state_dict(state["controller"])

    def attach(self, sampler) -> None:
        """Start with ``sampler`` (a fresh run): the steps it has served count as reported."""
        self._reported = sampler.step
        self._sampler = sampler

    @property
    def history(self) -> list[tuple[int, tuple[float, ...]]]:
        """``(step, weights)`` of every decision, in order: the step the weights take effect and
        the (normalised) weights its blend segment serves from there."""
        if self._sampler is None:  # nothing decided yet, or a schema-2 state not yet attached
            return [(step, at) for step, at in self._decisions if isinstance(at, tuple)]
        changes = self._sampler.stream.changes
        return [(step, at if isinstance(at, tuple) else changes.target_at(at)) for step, at in self._decisions]


__all__ = ["ExponentiatedGradient", "MixingController", "OnlineMixing"]
