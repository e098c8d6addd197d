"""Length runs (issue 40; served once a phase may change seq_length): each dataset's runs of one
sequence length, and where each run starts in its document stream, against a slow reference that
spells out every token; across a change each dataset reads on from the token it stopped at."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenloom.errors import ConfigError
from tokenloom.index.length_runs import LengthRun, length_runs, plan_run_starts


def test_runs_join_phases_of_one_length_and_skip_phases_without_samples():
    counts = np.array([[5, 0, 2], [3, 0, 0], [0, 4, 1], [2, 2, 0]])  # (phases, datasets)
    runs = length_runs(counts, [8, 8, 8, 16])
    assert runs[0] == [LengthRun((0, 1), 8, 8), LengthRun((3,), 16, 2)]
    assert runs[1] == [LengthRun((2,), 8, 4), LengthRun((3,), 16, 2)]
    assert runs[2] == [LengthRun((0, 2), 8, 3)]  # phase 1 has none of it: one run
    assert length_runs(np.array([[1, 1], [1, 1]]), [8, 16])[0] == [LengthRun((0,), 8, 1), LengthRun((1,), 16, 1)]


def test_the_worked_example():
    lengths = np.array([3, 4, 6, 5])
    starts, end = plan_run_starts(lambda p: lengths[p % 4], [(2, 4), (1, 8)], extra=1)
    assert [(s.token, s.position, s.offset) for s in starts] == [(0, 0, 0), (8, 2, 1)]
    assert end == 4  # the second run's row is tokens 8..16: up to the fourth document


def _slow(lengths: list[int], runs: list[tuple[int, int]], extra: int) -> tuple[list, list[list[int]], int]:
    """Every stream token as ``(position, offset)``, each run's rows as stream tokens (cut on from
    where the previous run's inputs ended), and the stream tokens the rows reach."""
    tokens = [(q, o) for q, n in enumerate(lengths) for o in range(n)]
    start, rows = 0, []
    for samples, seq in runs:
        rows.append([list(range(start + i * seq, start + (i + 1) * seq + extra)) for i in range(samples)])
        start += samples * seq
    return tokens, rows, start + extra


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 12), min_size=1, max_size=12).filter(any),
       st.lists(st.tuples(st.integers(1, 5), st.integers(1, 9)), min_size=1, max_size=4), st.integers(0, 1))
def test_each_run_reads_on_from_the_token_the_last_stopped_at_none_twice_none_skipped(epoch, runs, extra):
    need = sum(n * s for n, s in runs) + extra + 64
    lengths = epoch * (need // sum(epoch) + 2)  # epochs enough, in stream order
    tokens, rows, reach = _slow(lengths, runs, extra)
    starts, end = plan_run_starts(lambda p: np.asarray(epoch)[p % len(epoch)], runs, extra=extra)
    for start, run_rows in zip(starts, rows):
        assert tokens[run_rows[0][0]] == (start.position, start.offset) and start.token == run_rows[0][0]
    inputs = [t for run_rows in rows for row in run_rows for t in row[: len(row) - extra]]
    assert inputs == list(range(len(inputs)))  # every token an input once, in order, across the changes
    assert end == tokens[reach - 1][0] + 1  # the documents the last run's rows reach


def test_a_stream_without_tokens_is_a_config_error_not_a_hang():
    with pytest.raises(ConfigError, match=r"hold no tokens; expected a document stream that reaches token 0"):
        plan_run_starts(lambda p: np.zeros(p.shape, dtype=np.int64), [(2, 4)], extra=0)
    with pytest.raises(ConfigError, match=r"run 0: 0 samples of seq_length 4"):
        plan_run_starts(lambda p: np.ones(p.shape, dtype=np.int64), [(0, 4)], extra=0)
