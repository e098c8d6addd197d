"""Length runs: where a dataset continues when a mixture schedule changes its ``seq_length``.

Samples are shuffled within an epoch in every index mode, so after ``n`` samples a dataset has
served a scattered subset of its token stream, and "where it stopped" has no meaning inside one
sequence length. Across a *change* of sequence length it has one, by this rule:

* A dataset's samples split into **length runs**: maximal runs of the schedule's phases in which it
  has samples and one ``seq_length`` (a phase where it has no samples does not break a run). A
  dataset with one run is built exactly as without a schedule.
* A dataset has one **document stream**: its documents epoch after epoch, each epoch in its
  shuffled order (the stateless Feistel order, or megatron-core's ``document_index``), and so one
  token stream. Run ``r`` cuts its samples from that stream by concatenation, as megatron-core cuts
  one epoch (sample ``i`` holds stream tokens ``[T_r + i * s_r, T_r + (i + 1) * s_r + extra)``),
  and shuffles them among themselves only.
* Run ``r`` starts at **the first token run r - 1 did not take as an input**:
  ``T_r = T_{r-1} + n_{r-1} * s_{r-1}``, inside a document or at its start. The extra label
  token of run ``r - 1``'s last row is the first input of run ``r``, exactly as between two rows
  of one run.

So across a change each dataset reads on from the token it stopped at: no token is an input
twice before its epoch comes round again, and none is skipped. (Starting run ``r`` at the first
document not served whole instead would read a document's head again at every change, and a
run shorter than one document would read it again and again.) Worked example: documents of
lengths ``3, 4, 6, 5`` (stream offsets 0, 3, 7, 13), a first run of ``n = 2`` samples of
``s = 4`` with the extra token: its inputs are tokens ``[0, 8)`` and its second row also holds
token 8 as a label. The second run, of ``s = 8``, starts at token 8: the third document (stream
position 2) at its offset 1, and its first row holds tokens ``[8, 17)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from tokenloom.errors import ConfigError

_BLOCK = 1 << 16
"""Document lengths read at a time while walking the stream."""
_EMPTY_BLOCKS = 64
"""Blocks in a row without a token after which a walk gives up (a store of empty documents)."""


@dataclass(frozen=True)
class LengthRun:
    """One run of a dataset: the phases it spans, their sequence length and its samples."""

    phases: tuple[int, ...]
    """0-based phases of the schedule the run's samples are served in (those with samples)."""
    seq_length: int
    samples: int
    """Samples the run serves: its phases' counts summed."""


def length_runs(counts, seq_lengths: Sequence[int]) -> list[list[LengthRun]]:
    """Each dataset's runs (column ``d`` of ``counts``, ``(P, D)`` samples per phase), in order."""
    counts = np.asarray(counts, dtype=np.int64)
    if counts.ndim != 2 or counts.shape[0] != len(seq_lengths):
        raise ConfigError(f"counts of shape {counts.shape} for {len(seq_lengths)} phases; expected (phases, datasets)")
    out = []
    for d in range(counts.shape[1]):
        runs: list[LengthRun] = []
        for k in np.flatnonzero(counts[:, d] > 0).tolist():
            seq, n = int(seq_lengths[k]), int(counts[k, d])
            if runs and runs[-1].seq_length == seq:
                last = runs[-1]
                runs[-1] = LengthRun(phases=(*last.phases, k), seq_length=seq, samples=last.samples + n)
            else:
                runs.append(LengthRun(phases=(k,), seq_length=seq, samples=n))
        out.append(runs)
    return out


@dataclass(frozen=True)
class RunStart:
    """Where one run of a dataset begins in its document stream."""

    token: int
    """The stream token the run's first row starts at."""
    position: int
    """The stream position (``epoch * documents + p``) of the document holding that token."""
    offset: int
    """That token's offset inside its document."""


def plan_run_starts(lengths_of: Callable[[np.ndarray], np.ndarray], runs: Sequence[tuple[int, int]], *,
                    extra: int) -> tuple[list[RunStart], int]:
    """Each run's :class:`RunStart` and the stream positions the last run needs (its documents
    end there), walking the stream once.

    ``lengths_of(positions)`` gives the token lengths of stream positions (int, their shape); the
    stream must go on as far as the runs need (a dataset's epochs repeat). ``runs`` are
    ``(samples, seq_length)`` in order; ``extra`` is 1 when every row carries the next sample's
    first token as its last label (megatron-core's ``add_extra_token``), else 0.
    """
    if extra not in (0, 1):
        raise ConfigError(f"extra={extra!r}; expected 0 or 1 (add_extra_token)")
    walker = _StreamWalker(lengths_of)
    starts: list[RunStart] = []
    token = 0
    for r, (samples, seq_length) in enumerate(runs):
        if samples < 1 or seq_length < 1:
            raise ConfigError(f"run {r}: {samples} samples of seq_length {seq_length}; expected positive integers")
        position = walker.holding(token)
        starts.append(RunStart(token=token, position=position, offset=token - walker.offset(position)))
        token += samples * seq_length  # the first token this run does not take as an input
    # the last run needs every document up to the one holding its last row's last token
    return starts, walker.holding(token + extra - 1) + 1


class _StreamWalker:
    """Stream offsets of a dataset's document stream, read block by block as a walk needs them."""

    def __init__(self, lengths_of: Callable[[np.ndarray], np.ndarray]) -> None:
        self._lengths_of = lengths_of
        self._offsets = np.zeros(1, dtype=np.int64)  # (read + 1,) token offset of each position read
        self._empty = 0  # blocks in a row without a token

    def _read_past(self, token: int) -> None:
        while self._offsets[-1] <= token:
            read = self._offsets.shape[0] - 1
            lengths = np.asarray(self._lengths_of(np.arange(read, read + _BLOCK, dtype=np.int64)), dtype=np.int64)
            if lengths.shape != (_BLOCK,) or (lengths < 0).any():
                raise ConfigError(f"document lengths of stream positions {read}..{read + _BLOCK - 1}: expected "
                                  f"{_BLOCK} non-negative integers, got shape {lengths.shape}")
            self._empty = 0 if lengths.any() else self._empty + 1
            if self._empty == _EMPTY_BLOCKS:  # a stream of empty documents never reaches `token`
                raise ConfigError(f"stream positions {read + _BLOCK - _EMPTY_BLOCKS * _BLOCK}..{read + _BLOCK - 1} "
                                  f"hold no tokens; expected a document stream that reaches token {token}")
            self._offsets = np.concatenate([self._offsets, self._offsets[-1] + np.cumsum(lengths)])

    def holding(self, token: int) -> int:
        """The stream position of the document holding stream token ``token``."""
        self._read_past(token)
        return int(np.searchsorted(self._offsets, token, side="right")) - 1

    def offset(self, position: int) -> int:
        """The stream token a document begins at."""
        return int(self._offsets[position])


__all__ = ["LengthRun", "RunStart", "length_runs", "plan_run_starts"]
