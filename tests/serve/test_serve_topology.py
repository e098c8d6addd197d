"""Rank order, who loads, and context-parallel chunks, checked against megatron-core."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenloom.errors import ConfigError
from tokenloom.serve.topology import LoadMode, Topology, context_parallel_positions, context_parallel_slice

sizes = st.integers(1, 4)


def test_worked_example_rank_order():
    topology = Topology(dp=2, tp=2, pp=2)
    c = topology.coordinates(5)
    assert (c.tp_rank, c.dp_rank, c.pp_rank, c.cp_rank) == (1, 0, 1, 0)
    assert [topology.coordinates(r).tp_rank for r in range(8)] == [0, 1] * 4
    assert [topology.coordinates(r).pp_rank for r in range(8)] == [0] * 4 + [1] * 4


@settings(max_examples=100, deadline=None)
@given(dp=sizes, tp=sizes, pp=sizes, cp=sizes)
def test_groups_match_megatron_rank_generator(dp, tp, pp, cp):
    parallel_state = pytest.importorskip("megatron.core.parallel_state")
    generator = parallel_state.RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    topology = Topology(dp=dp, tp=tp, pp=pp, cp=cp)
    for axis, attribute in (("tp", "tp_rank"), ("dp", "dp_rank"), ("pp", "pp_rank"), ("cp", "cp_rank")):
        for group in generator.get_ranks(axis):
            # a megatron group: ranks differing only along this axis, listed by that coordinate
            coords = [topology.coordinates(r) for r in group]
            assert [getattr(c, attribute) for c in coords] == list(range(len(group)))
            others = {(c.tp_rank, c.dp_rank, c.pp_rank, c.cp_rank) for c in coords}
            assert len({tuple(v for k, v in zip("tdpc", o) if k != axis[0]) for o in others}) == 1
    for rank in range(topology.world_size):
        c = topology.coordinates(rank)
        assert topology.rank_of(dp_rank=c.dp_rank, tp_rank=c.tp_rank, pp_rank=c.pp_rank, cp_rank=c.cp_rank) == rank
    # the tensor groups are megatron's tp groups
    assert sorted(topology.tensor_groups()) == sorted(tuple(g) for g in generator.get_ranks("tp"))


def test_who_loads():
    topology = Topology(dp=1, tp=2, pp=3)
    first, middle, last = (topology.plan(topology.rank_of(pp_rank=s)) for s in range(3))
    assert first.fields == ("tokens", "position_ids", "attention_mask") and first.loads
    assert middle.fields == () and not middle.loads and middle.broadcast_source is None
    assert last.fields == ("labels", "loss_mask") and last.loads
    peer = topology.plan(topology.rank_of(pp_rank=2, tp_rank=1))
    assert not peer.loads and peer.broadcast_source == last.coordinates.rank
    assert topology.plan(topology.rank_of(pp_rank=2, tp_rank=1), LoadMode.EVERY_RANK).loads
    assert set(Topology(dp=1).plan(0).fields) == {"tokens", "position_ids", "attention_mask", "labels", "loss_mask"}


@settings(max_examples=60, deadline=None)
@given(cp=st.integers(1, 4), chunk=st.integers(1, 5), batch=st.integers(1, 3), data=st.data())
def test_context_parallel_matches_megatron(cp, chunk, batch, data):
    torch = pytest.importorskip("torch")
    utils = pytest.importorskip("megatron.core.utils")
    seq = 2 * cp * chunk
    rng = np.random.default_rng(data.draw(st.integers(0, 100)))
    fields = {"tokens": rng.integers(0, 50, (batch, seq)), "labels": rng.integers(0, 50, (batch, seq)),
              "loss_mask": rng.random((batch, seq)).astype(np.float32),
              "position_ids": np.tile(np.arange(seq), (batch, 1)),
              "attention_mask": rng.random((batch, 1, seq, seq)) < 0.5}
    for rank in range(cp):
        mp = pytest.MonkeyPatch()
        mp.setattr(torch.distributed, "get_world_size", lambda group=None: cp)
        mp.setattr(torch.distributed, "get_rank", lambda group=None, rank=rank: rank)
        try:
            theirs = utils._get_batch_on_this_cp_rank_per_sequence_balancing(
                {k: torch.from_numpy(np.array(v)) for k, v in fields.items()}, cp_group=None)
        finally:
            mp.undo()
        ours = context_parallel_slice(fields, cp, rank)
        ours_torch = context_parallel_slice({k: torch.from_numpy(np.array(v)) for k, v in fields.items()}, cp, rank)
        for name in fields:
            np.testing.assert_array_equal(ours[name], theirs[name].numpy(), err_msg=name)
            np.testing.assert_array_equal(ours_torch[name].numpy(), theirs[name].numpy(), err_msg=name)


def test_context_parallel_chunks_tile_the_sequence():
    # 8 tokens, cp=2: 4 chunks of 2; rank 0 gets chunks 0 and 3, rank 1 chunks 1 and 2
    assert context_parallel_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert context_parallel_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    with pytest.raises(ConfigError, match="not divisible by 2 x cp = 4"):
        context_parallel_positions(10, 2, 0)


def test_from_device_mesh():
    pytest.importorskip("torch")
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=16)
    try:
        mesh = init_device_mesh("cpu", (2, 2, 4), mesh_dim_names=("pp", "dp", "tp"))
        topology = Topology.from_device_mesh(mesh)
        assert (topology.dp, topology.tp, topology.pp, topology.cp) == (2, 4, 2, 1)
        # the mesh's own coordinate of this rank agrees with ours
        pp, dp, tp = mesh.get_coordinate()
        c = topology.coordinates(dist.get_rank())
        assert (c.pp_rank, c.dp_rank, c.tp_rank) == (pp, dp, tp)
        # a mesh in megatron's order gives megatron's order
        assert topology.order[:3] == ("tp", "dp", "pp")
    finally:
        dist.destroy_process_group()


def test_bad_sizes_name_the_value():
    with pytest.raises(ConfigError, match=r"Topology\.tp=0"):
        Topology(dp=1, tp=0)
    with pytest.raises(ConfigError, match=r"rank=8; expected an integer in \[0, 8\)"):
        Topology(dp=2, tp=4).coordinates(8)


def test_device_mesh_with_a_custom_rank_layout_is_refused():
    class Mesh:  # stands in for a DeviceMesh built from an explicit rank tensor
        mesh_dim_names = ("dp", "tp")
        mesh = np.array([[0, 2], [1, 3]])

    with pytest.raises(ConfigError, match="row-major"):
        Topology.from_device_mesh(Mesh())
    Mesh.mesh = np.arange(4).reshape(2, 2)
    assert Topology.from_device_mesh(Mesh()).coordinates(1).tp_rank == 1
