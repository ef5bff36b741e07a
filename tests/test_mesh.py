"""The rank grid as pure functions: coordinates, groups and pp neighbours, no process group."""

import itertools

import pytest
import torch
import torch.distributed as dist

from megapipe.config import ConfigError
from megapipe.distributed.fake_world import fake_world
from megapipe.distributed.mesh import (
    AXES,
    MeshSizes,
    ParallelMesh,
    all_meshes,
    check_world_size,
    coords,
    cp_split_ranks,
    ep_group_ranks,
    expert_replica_ranks,
    expert_shard_ranks,
    group_ranks,
    pp_neighbours,
    rank_at,
    rank_grid,
    replicate_group_ranks,
    shard_group_ranks,
)


@pytest.mark.parametrize("world", [1, 2, 4, 6, 8, 12, 16])
def test_coords_round_trip_and_tp_fastest(world):
    for sizes in all_meshes(world):
        grid = rank_grid(*sizes.shape)
        for rank in range(world):
            c = coords(rank, sizes)
            assert grid[c["pp"], c["dp"], c["cp"], c["tp"]].item() == rank
            assert rank_at(sizes, **c) == rank
        if sizes.tp > 1:
            assert coords(1, sizes)["tp"] == 1  # neighbours in rank are neighbours in tp


@pytest.mark.parametrize("world", [4, 8, 12])
def test_groups_partition_the_world_along_their_axes(world):
    for sizes in all_meshes(world):
        for axes in [("tp",), ("dp",), ("pp",), ("dp", "cp"), ("pp", "tp")]:
            groups = group_ranks(sizes, axes)
            assert sorted(r for g in groups for r in g) == list(range(world))
            for g in groups:
                cs = [coords(r, sizes) for r in g]
                for axis in AXES:  # members agree on every other axis
                    if axis not in axes:
                        assert len({c[axis] for c in cs}) == 1


def test_bloom_layout():
    sizes = MeshSizes(pp=12, dp=8, cp=1, tp=4)  # BLOOM: 8DP · 12PP · 4TP = 384 GPUs
    assert group_ranks(sizes, ("tp",))[0] == [0, 1, 2, 3]
    assert group_ranks(sizes, ("dp",))[0] == [0, 4, 8, 12, 16, 20, 24, 28]
    assert group_ranks(sizes, ("pp",))[0][:3] == [0, 32, 64]
    assert coords(37, sizes) == {"pp": 1, "dp": 1, "cp": 0, "tp": 1}


def test_pp_neighbours_wrap():
    sizes = MeshSizes(pp=4, dp=1, cp=1, tp=2)
    assert pp_neighbours(0, sizes) == (6, 2)
    assert pp_neighbours(3, sizes) == (1, 5)
    assert pp_neighbours(7, sizes) == (5, 1)
    assert pp_neighbours(1, MeshSizes(tp=2)) == (1, 1)


def test_grid_is_arange_view():
    assert torch.equal(rank_grid(2, 2, 1, 2).flatten(), torch.arange(8))


def test_world_size_mismatch_is_one_line():
    check_world_size(MeshSizes(dp=2, tp=2), 4)
    with pytest.raises(ConfigError) as e:
        check_world_size(MeshSizes(dp=2, tp=2), 3)
    msg = str(e.value)
    assert "\n" not in msg and "world size 3" in msg and "4" in msg and "dp=2" in msg


def test_dry_run_per_rank_counts_without_process_group():
    import torch.distributed as dist

    from megapipe.config import load_config
    from megapipe.train.dry_run import describe, rank_params
    from tests.conftest import TINY

    whole, _ = rank_params(load_config(TINY, ["model.vocab_size=97"]), 0, 0)
    cfg = load_config(TINY, ["parallel.tp=4", "parallel.dp=2", "model.vocab_size=97"])
    counts = [rank_params(cfg, 0, r)[0] for r in range(4)]
    d, v, n = 32, 97, 2  # replicated per tp rank: positions 16·d, 2 norms per layer + final,
    replicated = 16 * d + (2 * n + 1) * 2 * d + n * 2 * d  # row biases (attn proj, fc2)
    padded_rows = 4 * 25 - v  # vocab 97 over tp=4: 25 rows each, 3 padding rows
    assert sum(counts) == whole + 3 * replicated + padded_rows * d
    text = describe(cfg)
    assert "world size 8" in text and "pp=0 tp=3: " in text and not dist.is_initialized()


@pytest.mark.parametrize("world", [4, 8, 16])
def test_expert_groups_come_from_dp(world):
    """ep groups: ep consecutive dp ranks agreeing on pp, cp, tp; expert-replica groups: the
    ranks of one ep rank (same pp, tp) over every dp block and cp rank; together with the ep
    groups they tile the dp × cp group of each (pp, tp)."""
    for base in all_meshes(world):
        for ep in [e for e in (2, 4) if base.dp % e == 0]:
            sizes = MeshSizes(base.pp, base.dp, base.cp, base.tp, ep=ep)
            eps, reps = ep_group_ranks(sizes), expert_replica_ranks(sizes)
            for groups in (eps, reps):
                assert sorted(r for g in groups for r in g) == list(range(world))
            for g in eps:
                cs = [coords(r, sizes) for r in g]
                assert [c["dp"] for c in cs] == list(range(cs[0]["dp"], cs[0]["dp"] + ep))
                assert cs[0]["dp"] % ep == 0
                assert all((c["pp"], c["cp"], c["tp"]) == (cs[0]["pp"], cs[0]["cp"], cs[0]["tp"])
                           for c in cs)  # fmt: skip
            for g in reps:
                cs = [coords(r, sizes) for r in g]
                assert len(g) == sizes.dp // ep * sizes.cp
                assert len({(c["pp"], c["tp"], c["dp"] % ep) for c in cs}) == 1
            for e, r in itertools.product(eps, reps):
                assert len(set(e) & set(r)) <= 1  # one rank of each ep group holds those experts


def test_expert_groups_of_megatron_layout():
    sizes = MeshSizes(pp=1, dp=8, cp=1, tp=2, ep=4)
    assert ep_group_ranks(sizes)[:2] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert expert_replica_ranks(sizes)[:2] == [[0, 8], [1, 9]]
    assert str(sizes) == "pp=1 dp=8 cp=1 tp=2 ep=4"


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["parallel.dp=4", "parallel.ep=3"], "parallel.ep=3 must divide parallel.dp=4"),
        (["parallel.dp=4", "parallel.ep=4", "model.n_experts=6"], "n_experts=6 to be a positive"),
        (["parallel.dp=2", "parallel.ep=2", "model.n_experts=0"], "n_experts=0 to be a positive"),
    ],
)
def test_expert_parallel_rules_are_one_line(tiny_cfg, overrides, words):
    with pytest.raises(ConfigError, match=words) as err:
        tiny_cfg("model.n_experts=4", *overrides)
    assert "\n" not in str(err.value)


def test_hybrid_cp_groups_are_adjacent_a2a_blocks_and_rings_across_them():
    """parallel.cp_comm=hybrid (parallel/context/hybrid.py): a2a groups of K adjacent cp ranks
    (stride tp), ring groups of the ranks at one place in every block, in block order; each cp
    group is the disjoint union of its a2a groups and of its ring groups."""
    sizes = MeshSizes(dp=2, cp=8, tp=2, cp_a2a=4)
    a2a, ring = cp_split_ranks(sizes)
    assert a2a[:2] == [[0, 2, 4, 6], [8, 10, 12, 14]]
    assert ring[:4] == [[0, 8], [2, 10], [4, 12], [6, 14]]
    for members in group_ranks(sizes, ("cp",)):
        mine = set(members)
        assert sorted(r for g in a2a if set(g) <= mine for r in g) == sorted(members)
        assert sorted(r for g in ring if set(g) <= mine for r in g) == sorted(members)
    assert len(a2a) == 2 * 2 * 2 and len(ring) == 2 * 2 * 4
    assert cp_split_ranks(MeshSizes(cp=4)) == ([], [])  # not hybrid
    assert MeshSizes(cp=4, cp_a2a=2) == MeshSizes(cp=4)  # a resume sees the same mesh


def test_each_rank_makes_only_its_own_groups_and_they_are_the_grids():
    """ParallelMesh under the fake backend, every rank of pp2 · dp2 · cp2 · tp2 (ep 2, hybrid
    cp is off): each group it makes by itself is the one of group_ranks (or the ep lists) that
    holds it (new_group sorts its members)."""
    sizes = MeshSizes(pp=2, dp=2, cp=2, tp=2, ep=2)
    expected = {"norm_group": group_ranks(sizes, ("pp", "tp")),
                "stage_group": group_ranks(sizes, ("dp", "cp", "tp")),
                "ep_group": ep_group_ranks(sizes),
                "expert_replica_group": expert_replica_ranks(sizes)}  # fmt: skip
    for rank in range(sizes.world):
        with fake_world(rank, sizes.world):
            mesh = ParallelMesh(sizes)
            for name, groups in expected.items():
                (mine,) = [g for g in groups if rank in g]
                assert dist.get_process_group_ranks(getattr(mesh, name)) == sorted(mine), name


def test_hsdp_groups_shard_inner_and_replicate_outer():
    """parallel.dp_shard=S: shard groups of S consecutive dp ranks × every cp rank, replicate
    groups of the dp/S ranks at one place of every block; per (pp, tp) they are orthogonal and
    each tiles the dp × cp group. Experts shard over their replicas inside a block. Under the
    fake backend each rank's ParallelMesh makes its own of each."""
    sizes = MeshSizes(pp=2, dp=4, cp=2, tp=2, ep=2, dp_shard=2)
    shard, rep = shard_group_ranks(sizes), replicate_group_ranks(sizes)
    assert shard[0] == [0, 2, 4, 6] and rep[0] == [0, 8]  # dp 0, 1 × cp; dp 0 and 2
    for groups, n in ((shard, 2 * 2), (rep, 4 // 2)):
        assert sorted(r for g in groups for r in g) == list(range(sizes.world))
        assert all(len(g) == n for g in groups)
    for members in group_ranks(sizes, ("dp", "cp")):
        inside = [g for g in shard if set(g) <= set(members)]
        assert sorted(r for g in inside for r in g) == sorted(members)
        assert all(len(set(a) & set(b)) <= 1 for a in inside for b in rep)
    experts = expert_shard_ranks(sizes)
    assert experts[0] == [0, 2] and len(experts) == sizes.world // 2  # one dp rank × cp
    same = MeshSizes(dp=4)
    assert shard_group_ranks(same) == group_ranks(same, ("dp", "cp"))  # no replicas
    expected = {"shard_group": shard, "replicate_group": rep, "expert_shard_group": experts}
    for rank in (0, 5, 31):
        with fake_world(rank, sizes.world):
            mesh = ParallelMesh(sizes)
            for name, groups in expected.items():
                (mine,) = [g for g in groups if rank in g]
                assert dist.get_process_group_ranks(getattr(mesh, name)) == sorted(mine), name
