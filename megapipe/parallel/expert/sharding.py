"""This rank's place on the expert-parallel axis, and which experts it holds.

The ep ranks are taken from the data-parallel group (parallel.ep divides parallel.dp, as in
Megatron-Core): ep rank r holds the contiguous experts [r·E/ep, (r+1)·E/ep) of every MoE layer.
Expert weights are stacked along a leading expert dimension, so a rank's experts are one slice
of each logical tensor, as a tp shard is (parallel/tensor/sharding.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EPInfo:
    """Expert-parallel rank and group (size 1: every rank holds every expert)."""

    size: int = 1
    rank: int = 0
    group: object = None  # torch.distributed ProcessGroup when size > 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"ep rank {self.rank} outside ep size {self.size}")

    def local_experts(self, n_experts: int) -> range:
        """The global ids of the experts this rank holds."""
        per_rank = n_experts // self.size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)


NO_EP = EPInfo()


def ep_info(mesh) -> EPInfo:
    """This rank's EPInfo on `mesh` (distributed/mesh.py: ep consecutive dp ranks); mesh None or
    parallel.ep=1: NO_EP."""
    if mesh is None or mesh.sizes.ep == 1:
        return NO_EP
    return EPInfo(mesh.sizes.ep, mesh.ep_rank, mesh.ep_group)


EXPERT_MARK = "expert_parallel"  # a parameter's EPInfo: it holds that rank's experts only


def mark_experts(ep: EPInfo, *params) -> None:
    """Mark `params` as expert weights (stacked, leading expert dim, ep rank's slice of the
    logical tensor): their grads are summed over the expert-replica group, not every dp × cp
    replica (parallel/data/reducer.py); init and checkpoints place them at `expert_offset`."""
    for p in params:
        setattr(p, EXPERT_MARK, ep)


def is_expert(param) -> bool:
    """`param` is an expert weight (`mark_experts`)."""
    return getattr(param, EXPERT_MARK, None) is not None


def expert_ep(param) -> EPInfo:
    """The EPInfo an expert weight was sharded by; NO_EP for any other parameter."""
    return getattr(param, EXPERT_MARK, None) or NO_EP


def expert_offset(param) -> int:
    """The logical index of `param`'s first expert along dim 0 (0 unless ep-sharded)."""
    ep = expert_ep(param)
    return ep.rank * (param.shape[0] if ep.size > 1 else 0)


def expert_slice(logical, param):
    """This rank's experts of the logical tensor `logical` (dim 0), for `param`."""
    if expert_ep(param).size == 1:
        return logical
    return logical.narrow(0, expert_offset(param), param.shape[0])
