"""Balanced ranks (tokenloom.index.balance): the cost of a sample against megatron-core's
boundary rule as the batch pipeline applies it, and the placement's guarantees (a permutation
of the batch, never worse than Megatron's order, the same in every process)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenloom.errors import ConfigError
from tokenloom.index.balance import (
    _CLOSE_ENOUGH,
    _SWAPS_PER_LEVEL,
    CostModel,
    _partition_kernel,
    _stable_argsort,
    assign_slots,
    served_document_pairs,
    served_real_tokens,
    slot_costs,
)
from tokenloom.index.kernels import compiled
from tokenloom.serve.samples import document_fields


@st.composite
def _samples(draw):
    """Pieces of a batch of samples as an index hands them over: concat (pieces summing to
    ``S + extra``) or best fit (whole documents, then padding)."""
    seq = draw(st.integers(2, 40))
    extra = draw(st.booleans())
    packed = draw(st.booleans())
    rows = []
    for _ in range(draw(st.integers(1, 6))):
        room = seq + extra
        pieces = []
        while room > 0 and len(pieces) < seq - 1:  # cu_seqlens lists at most S documents
            length = draw(st.integers(0 if pieces else 1, room))
            pieces.append(length)
            room -= length
            if packed and draw(st.booleans()):
                break
        if not packed and room:
            pieces.append(room)
        rows.append(pieces)
    return seq, extra, rows


@settings(max_examples=200, deadline=None)
@given(_samples())
def test_served_pairs_follow_the_boundary_fields(case):
    seq, extra, rows = case
    lengths = np.array([p for row in rows for p in row], dtype=np.int64)
    bounds = np.concatenate([[0], np.cumsum([len(row) for row in rows])])
    ends = np.zeros((len(rows), seq + extra + 1), dtype=np.int32)
    for k, row in enumerate(rows):
        ends[k, :len(row)] = np.cumsum(row)
    counts = np.array([len(row) for row in rows], dtype=np.int32)
    cu_seqlens, _, _ = document_fields(ends, counts, seq_length=seq, add_extra_token=extra, backend="numpy")
    documents = np.diff(cu_seqlens.astype(np.int64), axis=1)  # (B, S) the attention kernel's segments
    assert served_document_pairs(lengths, bounds, seq, extra).tolist() == \
        (documents * (documents + 1) // 2).sum(axis=1).tolist()
    real = [min(sum(row), seq) for row in rows]
    assert served_real_tokens(lengths, bounds, seq).tolist() == real


def test_default_cost_model_is_the_layer_flops():
    model = CostModel.for_width(4096)
    assert model.attention == 4 * 4096 and model.tokens == 24 * 4096**2  # a / b = 1 / (6 d)
    llama3 = CostModel.for_width(4096, ffn_hidden_size=14336, kv_channels_total=1024, gated=True)
    assert llama3.tokens == 2 * 4096 * (2 * 4096 + 2 * 1024) + 6 * 4096 * 14336
    assert CostModel(attention=1, tokens=3).sample_costs([10, 0], [4, 4]).tolist() == [22, 12]


def test_refusals_name_the_value():
    with pytest.raises(ConfigError, match="attention=-1"):
        CostModel(attention=-1, tokens=1)
    with pytest.raises(ConfigError, match="attention=0, tokens=0"):
        CostModel(attention=0, tokens=0)
    with pytest.raises(ConfigError, match="12 samples does not fill micro-batches of 2 on 4"):
        assign_slots(np.ones(12, dtype=np.int64), dp=4, micro_batch_size=2)
    with pytest.raises(ConfigError, match="integer cost"):
        assign_slots(np.ones(8), dp=4, micro_batch_size=2)
    with pytest.raises(ConfigError, match="overflows"):
        CostModel(attention=2**40, tokens=1).sample_costs([2**30] * 4, [8] * 4)


def _reference_partition(costs: np.ndarray, bins: int) -> np.ndarray:
    """The module's rule in vectorised numpy, written apart from the kernel: LPT in rounds, then
    the first best swap out of the heaviest bin while one lowers it; rows ascending."""
    per = costs.shape[0] // bins
    order = np.lexsort((np.arange(costs.shape[0]), -costs))
    members = np.empty((bins, per), dtype=np.int64)
    loads = np.zeros(bins, dtype=np.int64)
    for t in range(per):
        dealt = order[t * bins:(t + 1) * bins]
        lightest = np.lexsort((np.arange(bins), loads))
        members[lightest, t] = dealt
        loads[lightest] += costs[dealt]
    bound = max(int(costs.max(initial=0)), -(-int(costs.sum()) // bins))
    for _ in range(_SWAPS_PER_LEVEL if per > 1 and bins > 1 else 0):
        heavy = int(np.argmax(loads))
        if loads[heavy] - bound <= bound // _CLOSE_ENOUGH:
            break
        delta = costs[members[heavy]][:, None, None] - costs[members][None, :, :]  # (per, bins, per)
        after = np.maximum(loads[heavy] - delta, loads[None, :, None] + delta)
        useful = (delta > 0) & (after < loads[heavy])
        useful[:, heavy, :] = False
        if not useful.any():
            break
        i, other, j = np.unravel_index(int(np.argmin(np.where(useful, after, np.iinfo(np.int64).max))), delta.shape)
        moved = int(delta[i, other, j])
        members[heavy, i], members[other, j] = members[other, j], members[heavy, i]
        loads[heavy] -= moved
        loads[other] += moved
    members.sort(axis=1)
    return members


def _reference_assign(costs: np.ndarray, dp: int, micro: int) -> np.ndarray:
    num_micro = costs.shape[0] // (dp * micro)
    plain = np.arange(costs.shape[0]).reshape(num_micro, dp, micro).transpose(1, 0, 2).reshape(dp, -1)
    ranks = _reference_partition(costs, dp)
    if costs[ranks].sum(axis=1).max() >= costs[plain].sum(axis=1).max():
        ranks = plain
    slots = np.empty((num_micro, dp, micro), dtype=np.int64)
    for r in range(dp):
        held = np.sort(ranks[r])
        split = plain_micro = held.reshape(num_micro, micro)
        if num_micro > 1:
            split = held[_reference_partition(costs[held], num_micro)]
            if costs[split].sum(axis=1).max() >= costs[plain_micro].sum(axis=1).max():
                split = plain_micro
        slots[:, r, :] = split
    return slots.reshape(-1)


@st.composite
def _batches(draw):
    dp = draw(st.integers(1, 6))
    micro = draw(st.integers(1, 3))
    num_micro = draw(st.integers(1, 4))
    size = dp * micro * num_micro
    kind = draw(st.sampled_from(["heavy", "equal", "few"]))
    if kind == "equal":
        costs = [draw(st.integers(0, 5))] * size
    elif kind == "few":
        costs = draw(st.lists(st.sampled_from([1, 2, 3, 50]), min_size=size, max_size=size))
    else:
        costs = draw(st.lists(st.integers(0, 10**12), min_size=size, max_size=size))
    return np.array(costs, dtype=np.int64), dp, micro


@settings(max_examples=150, deadline=None)
@given(_batches())
def test_placement_is_a_permutation_never_worse_than_megatrons(case):
    costs, dp, micro = case
    order = assign_slots(costs, dp=dp, micro_batch_size=micro)
    assert order.tolist() == _reference_assign(costs, dp, micro).tolist()
    assert order.tolist() == assign_slots(costs, dp=dp, micro_batch_size=micro, backend="python").tolist()
    # the same multiset, every slot filled once
    assert sorted(order.tolist()) == list(range(costs.shape[0]))
    balanced = slot_costs(costs, order, dp=dp, micro_batch_size=micro)  # (M, dp)
    plain = slot_costs(costs, np.arange(costs.shape[0]), dp=dp, micro_batch_size=micro)
    assert balanced.sum(axis=0).max() <= plain.sum(axis=0).max()
    num_micro = balanced.shape[0]
    slots = order.reshape(num_micro, dp, micro)
    for r in range(dp):
        held = np.sort(slots[:, r, :].reshape(-1))  # this rank's samples, cut in stream order
        assert balanced[:, r].max() <= costs[held].reshape(num_micro, micro).sum(axis=1).max()
        assert all((np.diff(slots[m, r]) > 0).all() for m in range(num_micro))
    if (costs == costs[0]).all():  # nothing to gain: Megatron's order
        assert order.tolist() == list(range(costs.shape[0]))


@settings(max_examples=200, deadline=None)
@given(_batches(), st.randoms(use_true_random=False))
def test_loads_do_not_depend_on_the_listing_order(case, random):
    costs, dp, _ = case
    shuffled = costs.copy()
    random.shuffle(shuffled)
    def loads(values):
        members = np.empty((dp, values.shape[0] // dp), dtype=np.int64)
        _partition_kernel(values, dp, members)
        return sorted(values[members].sum(axis=1).tolist())

    assert loads(costs) == loads(shuffled)


@pytest.mark.parametrize("sigma", [0.6, 1.2])
def test_lpt_and_swaps_reach_the_bound(sigma):
    # 64 ranks x 8 samples of lognormal costs: within 5% of the lower bound, the mean rank cost
    # or the rank that must hold the costliest sample and 7 others (the 7 cheapest at best)
    rng = np.random.default_rng(7)
    costs = (rng.lognormal(10, sigma, size=512) * 1000).astype(np.int64)
    order = assign_slots(costs, dp=64, micro_batch_size=2)
    ranks = slot_costs(costs, order, dp=64, micro_batch_size=2).sum(axis=0)
    bound = max(costs.sum() / 64, costs.max() + np.sort(costs)[:7].sum())
    assert ranks.max() <= 1.05 * bound
    plain = slot_costs(costs, np.arange(512), dp=64, micro_batch_size=2).sum(axis=0)
    assert plain.max() > 1.2 * bound  # the unbalanced order is far off


def test_every_process_computes_the_same_placement():
    rng = np.random.default_rng(3)
    cases = [(rng.integers(0, 10**9, size=dp * micro * m).tolist(), dp, micro)
             for dp, micro, m in ((8, 2, 4), (64, 1, 4), (3, 3, 1))]
    script = ("import json, sys, numpy as np\nfrom tokenloom.index.balance import assign_slots\n"
              "print(json.dumps([assign_slots(np.array(c, dtype=np.int64), dp=d, micro_batch_size=m).tolist() "
              "for c, d, m in json.loads(sys.stdin.read())]))")
    there = json.loads(subprocess.run([sys.executable, "-c", script], input=json.dumps(cases), capture_output=True,
                                      text=True, check=True, timeout=120).stdout)
    here = [assign_slots(np.array(c, dtype=np.int64), dp=d, micro_batch_size=m).tolist() for c, d, m in cases]
    assert there == here


def test_format_worked_example():
    """FORMAT.md "Balanced ranks": the costs and the placement of its table."""
    documents = [[8], [2, 2, 2, 2], [3, 5], [1, 1, 6], [8], [4, 4], [2, 6], [1] * 8]
    lengths = np.array([L for sample in documents for L in sample], dtype=np.int64)
    bounds = np.concatenate([[0], np.cumsum([len(sample) for sample in documents])])
    pairs = served_document_pairs(lengths, bounds, 8, False)
    costs = CostModel(attention=1, tokens=0).sample_costs(pairs, np.full(8, 8))
    assert costs.tolist() == [36, 12, 21, 23, 36, 20, 24, 8]
    order = assign_slots(costs, dp=2, micro_batch_size=2)
    assert order.tolist() == [0, 1, 4, 7, 3, 5, 2, 6]
    assert slot_costs(costs, order, dp=2, micro_batch_size=2).tolist() == [[48, 44], [43, 45]]
    assert slot_costs(costs, np.arange(8), dp=2, micro_batch_size=2).sum(axis=0).tolist() == [104, 76]
    assert (CostModel.for_width().attention, CostModel.for_width().tokens) == (16384, 402653184)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(-3, 3) | st.integers(-2**62, 2**62), max_size=80))
def test_the_kernels_stable_argsort_is_numpys(keys):
    """The assignment's own sort (insertion below 16 keys, merging above) orders as numpy's
    mergesort: ascending, ties by index, compiled and interpreted."""
    keys = np.array(keys, dtype=np.int64)
    expected = np.argsort(keys, kind="mergesort")
    np.testing.assert_array_equal(_stable_argsort(keys), expected)
    np.testing.assert_array_equal(compiled(_stable_argsort)(keys), expected)
