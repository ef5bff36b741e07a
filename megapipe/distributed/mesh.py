"""ParallelMesh: sizes, coordinates, process groups and pp neighbours of a DP × PP × CP × TP mesh.

The rank grid is a pure function (picotron: `arange(world).view(pp, dp, cp, tp)`), tp varying
fastest so a tp group sits on one node (Megatron, Narayanan et al. 2021 §3.3; BLOOM's
8DP·12PP·4TP). Groups come from torch's DeviceMesh with axes ("pp", "dp", "cp", "tp"). The mesh
is passed explicitly to whatever communicates; nothing here is a module-level group.

Expert parallelism (docs/moe.md) adds no axis: as in Megatron-Core, its ranks are taken from the
dp axis. ep consecutive dp ranks (same pp, cp, tp) form an ep group, which exchanges tokens by
all-to-all; the ranks holding the same experts (same ep rank, every dp block and cp rank: dp/ep ·
cp of them) form the expert-replica group, over which the expert weights' grads are summed.

Hybrid context parallelism (parallel.cp_comm=hybrid, parallel/context/hybrid.py) adds no axis
either: the cp axis is cut into cp/K blocks of K adjacent cp ranks (K = parallel.cp_a2a), the
a2a groups, inner so they sit on one node as tp does; the ranks of the same place in every
block form the ring groups (USP's "ulysses degree × ring degree", Fang and Zhao 2024 §3).

HSDP (parallel.dp_shard = S < dp) adds no axis either: the dp axis is cut into dp/S blocks of S
consecutive ranks, replicate outer and shard inner as torchtitan's ParallelDims lays out
("dp_replicate", "dp_shard") and flattens dp_shard with cp into the FSDP mesh
(torchtitan/distributed/parallel_dims.py). A block's S·cp ranks of one (pp, tp) are a shard
group, over which ZeRO shards; the dp/S ranks at the same place of every block (same cp) are a
replicate group, which all-reduces the shards. Routed experts shard over the expert replicas
inside a block (S/ep · cp ranks: S is a multiple of ep) and replicate over the same groups.
"""

from __future__ import annotations

import datetime
import itertools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megapipe._torch_compat import flatten_mesh, set_group_timeout
from megapipe.config import Config, ConfigError
from megapipe.distributed.progress import NO_PROGRESS, Progress

AXES = ("pp", "dp", "cp", "tp")


@dataclass(frozen=True)
class MeshSizes:
    pp: int = 1
    dp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1  # expert-parallel ranks, taken from dp (not an axis of the grid)
    # hybrid cp: a2a group size K, taken from cp (1: not hybrid). It shards nothing a checkpoint
    # holds, so two meshes that differ only in it are the same mesh to a resume.
    cp_a2a: int = field(default=1, compare=False)
    dp_shard: int = 0  # HSDP: dp ranks per shard group, taken from dp (0: dp, no replicas)

    @staticmethod
    def of(cfg: Config) -> MeshSizes:
        p = cfg.parallel
        k = p.cp_a2a if p.cp_comm == "hybrid" else 1
        s = p.dp_shard if p.dp_shard != p.dp else 0  # one spelling of "no replicas"
        return MeshSizes(pp=p.pp, dp=p.dp, cp=p.cp, tp=p.tp, ep=p.ep, cp_a2a=k, dp_shard=s)

    @property
    def shard(self) -> int:
        """The dp ranks of one shard group (HSDP's S; dp without replicas)."""
        return self.dp_shard or self.dp

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.pp, self.dp, self.cp, self.tp)

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    def __str__(self) -> str:
        ep = f" ep={self.ep}" if self.ep > 1 else ""
        a2a = f" cp_a2a={self.cp_a2a}" if self.cp_a2a > 1 else ""
        hsdp = f" dp_shard={self.dp_shard}" if self.dp_shard else ""
        return f"pp={self.pp} dp={self.dp} cp={self.cp} tp={self.tp}{ep}{a2a}{hsdp}"


def rank_grid(pp: int, dp: int, cp: int, tp: int) -> torch.Tensor:
    """Global ranks laid out as (pp, dp, cp, tp), tp fastest-varying."""
    return torch.arange(pp * dp * cp * tp).view(pp, dp, cp, tp)


def coords(rank: int, sizes: MeshSizes) -> dict[str, int]:
    """{axis: coordinate} of `rank`."""
    out, rest = {}, rank
    for axis, size in reversed(list(zip(AXES, sizes.shape))):
        out[axis], rest = rest % size, rest // size
    return {axis: out[axis] for axis in AXES}


def rank_at(sizes: MeshSizes, **where: int) -> int:
    """The rank at the given coordinates (missing axes: 0)."""
    rank = 0
    for axis, size in zip(AXES, sizes.shape):
        rank = rank * size + where.get(axis, 0)
    return rank


def pp_neighbours(rank: int, sizes: MeshSizes) -> tuple[int, int]:
    """(previous, next) pipeline rank, wrapping around (interleaved schedules send last -> 0)."""
    c = coords(rank, sizes)
    prev = rank_at(sizes, **{**c, "pp": (c["pp"] - 1) % sizes.pp})
    nxt = rank_at(sizes, **{**c, "pp": (c["pp"] + 1) % sizes.pp})
    return prev, nxt


def group_ranks(sizes: MeshSizes, axes: tuple[str, ...]) -> list[list[int]]:
    """Every group of ranks that differ only along `axes`, in a fixed order."""
    grid = rank_grid(*sizes.shape)
    keep = [i for i, axis in enumerate(AXES) if axis in axes]
    other = [i for i, axis in enumerate(AXES) if axis not in axes]
    n = 1
    for i in keep:
        n *= sizes.shape[i]
    return grid.permute(*other, *keep).reshape(-1, n).tolist()


def _expert_grid(sizes: MeshSizes) -> torch.Tensor:
    """Ranks as (pp, dp/ep, ep, cp, tp): the dp axis split into blocks of ep consecutive ranks."""
    pp, dp, cp, tp = sizes.shape
    return rank_grid(pp, dp, cp, tp).view(pp, dp // sizes.ep, sizes.ep, cp, tp)


def ep_group_ranks(sizes: MeshSizes) -> list[list[int]]:
    """Every ep group: ep consecutive dp ranks of one (pp, dp block, cp, tp), in ep-rank order."""
    return _expert_grid(sizes).permute(0, 1, 3, 4, 2).reshape(-1, sizes.ep).tolist()


def expert_replica_ranks(sizes: MeshSizes) -> list[list[int]]:
    """Every expert-replica group: the dp/ep · cp ranks of one (pp, ep rank, tp), which hold the
    same experts and see different tokens (dp block major, cp minor)."""
    n = sizes.dp // sizes.ep * sizes.cp
    return _expert_grid(sizes).permute(0, 2, 4, 1, 3).reshape(-1, n).tolist()


def _hsdp_grid(sizes: MeshSizes) -> torch.Tensor:
    """Ranks as (pp, dp/S, S, cp, tp): the dp axis cut into blocks of S consecutive ranks."""
    pp, dp, cp, tp = sizes.shape
    return rank_grid(pp, dp, cp, tp).view(pp, dp // sizes.shard, sizes.shard, cp, tp)


def shard_group_ranks(sizes: MeshSizes) -> list[list[int]]:
    """Every HSDP shard group: the S·cp ranks of one (pp, dp block, tp), dp major, cp minor
    (the dp × cp group's order, so a shard's index is its place in that order)."""
    n = sizes.shard * sizes.cp
    return _hsdp_grid(sizes).permute(0, 1, 4, 2, 3).reshape(-1, n).tolist()


def replicate_group_ranks(sizes: MeshSizes) -> list[list[int]]:
    """Every HSDP replicate group: the dp/S ranks of one (pp, place in a block, cp, tp)."""
    n = sizes.dp // sizes.shard
    return _hsdp_grid(sizes).permute(0, 2, 3, 4, 1).reshape(-1, n).tolist()


def expert_shard_ranks(sizes: MeshSizes) -> list[list[int]]:
    """Every HSDP expert shard group: the expert replicas inside one dp block, S/ep · cp ranks
    of one (pp, dp block, ep rank, tp) (dp major, cp minor, as expert_replica_ranks)."""
    pp, dp, cp, tp = sizes.shape
    s, ep = sizes.shard, sizes.ep
    grid = rank_grid(pp, dp, cp, tp).view(pp, dp // s, s // ep, ep, cp, tp)
    return grid.permute(0, 1, 3, 5, 2, 4).reshape(-1, s // ep * cp).tolist()


def cp_split_ranks(sizes: MeshSizes) -> tuple[list[list[int]], list[list[int]]]:
    """Hybrid cp's (a2a groups, ring groups): each cp group cut into blocks of K = cp_a2a
    adjacent cp ranks (the a2a groups, in cp order), and the ranks at the same place of every
    block (the ring groups, block order = ring order). Empty lists unless 1 < K < cp."""
    k, cp = sizes.cp_a2a, sizes.cp
    if not 1 < k < cp:
        return [], []
    a2a, ring = [], []
    for ranks in group_ranks(sizes, ("cp",)):  # (cp,) ranks of one (pp, dp, tp), in cp order
        a2a += [ranks[g * k : (g + 1) * k] for g in range(cp // k)]
        ring += [ranks[j::k] for j in range(k)]
    return a2a, ring


def check_world_size(sizes: MeshSizes, world: int) -> None:
    """One-line error when the launched world does not match the mesh (before any collective)."""
    if world != sizes.world:
        raise ConfigError(
            f"world size {world} != dp·pp·cp·tp = {sizes.world} ({sizes}); launch "
            f"{sizes.world} processes (torchrun --nproc_per_node) or change parallel.*"
        )


class ParallelMesh:
    """This rank's view of the mesh: coordinates and the groups of each axis; `progress`, this
    rank's record of what it is doing (distributed/progress.py), for whatever communicates."""

    def __init__(
        self,
        sizes: MeshSizes,
        device_type: str = "cpu",
        timeout_s: float | None = None,
        progress: Progress = NO_PROGRESS,
    ) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        check_world_size(sizes, dist.get_world_size())
        self.sizes, self.device_type, self.progress = sizes, device_type, progress
        # New groups do not inherit the default group's timeout (torch gives them 30 min).
        self.timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
        self.rank = dist.get_rank()
        self.coords = coords(self.rank, sizes)
        self.device_mesh = init_device_mesh(device_type, sizes.shape, mesh_dim_names=AXES)
        self.groups = {axis: self.device_mesh[axis].get_group() for axis in AXES}
        self.dp_cp_group = flatten_mesh(self.device_mesh, ("dp", "cp"), "dp_cp").get_group()
        self.norm_group = self._new_group(("pp", "tp"))  # one copy of every parameter
        # every rank holding this pp stage's parameters: zero=1 checkpoints write shards over it
        self.stage_group = self._new_group(("dp", "cp", "tp"))
        self.ep_group = self.expert_replica_group = None
        if sizes.ep > 1:
            self.ep_group = self._new_group_of(ep_group_ranks(sizes))
            self.expert_replica_group = self._new_group_of(expert_replica_ranks(sizes))
        self.cp_a2a_group = self.cp_ring_group = None  # hybrid cp's sub-groups of the cp axis
        if 1 < sizes.cp_a2a < sizes.cp:
            a2a, ring = cp_split_ranks(sizes)
            self.cp_a2a_group, self.cp_ring_group = map(self._new_group_of, (a2a, ring))
        self._hsdp_groups()
        self._set_timeouts()

    def _hsdp_groups(self) -> None:
        """ZeRO's shard groups (dense, experts) and the replicate group across them: the dp ×
        cp and expert-replica groups with no replicate group unless parallel.dp_shard < dp."""
        self.shard_group = self.replica_group
        self.expert_shard_group, self.replicate_group = self.expert_replica_group, None
        if not self.sizes.dp_shard:
            return
        self.shard_group = self._new_group_of(shard_group_ranks(self.sizes))
        self.replicate_group = self._new_group_of(replicate_group_ranks(self.sizes))
        if self.sizes.ep > 1:
            self.expert_shard_group = self._new_group_of(expert_shard_ranks(self.sizes))

    def _set_timeouts(self) -> None:
        """A dead peer fails every wait within the timeout, whatever group it waits in.
        DeviceMesh takes no timeout, so its groups get it set after they exist."""
        if self.timeout is None:
            return
        for group in {*self.groups.values(), self.dp_cp_group}:
            if group is not dist.group.WORLD:
                set_group_timeout(group, self.timeout)

    def _new_group(self, axes: tuple[str, ...]):
        """This rank's group along `axes`: the ranks that share its other coordinates, in
        group_ranks' order, cut from the rank grid without listing the world's groups."""
        at = tuple(slice(None) if a in axes else self.coords[a] for a in AXES)
        return self._own_group(rank_grid(*self.sizes.shape)[at].flatten().tolist())

    def _new_group_of(self, groups: list[list[int]]):
        return self._own_group(next(ranks for ranks in groups if self.rank in ranks))

    def _own_group(self, ranks: list[int]):
        """The group of `ranks`, made by its members only (use_local_synchronization: its
        barrier is theirs, its name a hash of its ranks): no rank creates the groups of
        others, so the work of a rank's start-up does not grow with the world (at 16,384
        ranks every rank made 1,024 norm groups: docs/benchmarks/2026-11-29-fake-startup-cpu.md)."""
        return dist.new_group(ranks, timeout=self.timeout, use_local_synchronization=True)

    def size(self, axis: str) -> int:
        return getattr(self.sizes, axis)

    def coord(self, axis: str) -> int:
        return self.coords[axis]

    def group(self, axis: str):
        return self.groups[axis]

    @property
    def replica_group(self):
        """dp × cp: the ranks that hold the same weights and see different tokens, over which
        gradients, the loss and the token count are summed."""
        return self.dp_cp_group if self.sizes.cp > 1 else self.groups["dp"]

    @property
    def world_group(self):
        """Every rank: the grad norm under zero=1, where each replica holds its own shard."""
        return dist.group.WORLD

    def pp_neighbours(self) -> tuple[int, int]:
        return pp_neighbours(self.rank, self.sizes)

    @property
    def ep_rank(self) -> int:
        """This rank's place in its ep group (its experts: parallel/expert/sharding.py)."""
        return self.coords["dp"] % self.sizes.ep

    def __str__(self) -> str:
        c = " ".join(f"{a}={self.coords[a]}" for a in AXES)
        return f"mesh {self.sizes} (world {self.sizes.world}); rank {self.rank}: {c}"


def all_meshes(world: int) -> list[MeshSizes]:
    """Every (pp, dp, cp, tp) factorisation of `world` (used by tests and the dry run)."""
    divs = [d for d in range(1, world + 1) if world % d == 0]
    return [
        MeshSizes(pp, dp, cp, tp)
        for pp, dp, cp, tp in itertools.product(divs, repeat=4)
        if pp * dp * cp * tp == world
    ]
