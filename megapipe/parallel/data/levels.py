"""The ZeRO level as a sharding strategy (the config's zero: 0 plain all-reduce; 1 moments sharded,
zero.py; 2 + grads, zero2.py; 3 + weights, zero3.py): one `Sharding` object, resolved once from
the config (train/parallelize.py) and handed to the reducers, the optimizer, the engines and the
checkpoint code, which ask it instead of reading the level again.

It also holds the norm-group rule, once for every engine: a logical grad is summed whole on
each of its replicas, except where its replicas hold different pieces of it (a sharded level
with replicas: each rank's shard of the summed grads, zeros elsewhere) or where the ranks of
one replica group hold different parameters (parallel.ep > 1: different experts). Then the
grad norm spans every rank (the whole model) or the stage's dp × cp × tp ranks (one stage), and
each grad is counted by the replica its reducer names (GradReducer.counts); otherwise it spans
pp × tp (the mesh's norm group) or tp, where every replica holds every grad.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace

import torch
from torch import nn

from megapipe.parallel.data.reducer import GradReducer
from megapipe.parallel.data.zero import ShardedOptimizer
from megapipe.parallel.data.zero2 import (
    OverlappedGatherReducer,
    WeightBlock,
    Zero2Optimizer,
    Zero2Reducer,
)
from megapipe.parallel.data.zero3 import Zero3Optimizer, Zero3Reducer

__all__ = [
    "LEVELS",
    "PLAIN",
    "Sharding",
    "WeightBlock",
    "full_weights",
    "sharding_of",
]


@dataclass(frozen=True)
class Sharding:
    """One ZeRO level: the reducer and optimizer it builds, what it shards, and the norm rule."""

    level: int
    reducer_kind: type[GradReducer]
    optimizer_kind: type[ShardedOptimizer] | None  # None: the plain optimizer (optim.py)
    per_microbatch: bool = False  # parallel.grad_reduce=microbatch (zero >= 2: zero2.py)
    reduce_dtype: torch.dtype = torch.float32  # parallel.grad_reduce_dtype (zero >= 1)
    fp8_params: bool = False  # train.fp8_params at zero 1-2 (fp8_params.py; zero=3 casts anyway)

    @property
    def grads_as_shards(self) -> bool:
        """The summed grads live as each rank's shards (zero >= 2), not in the params' .grad."""
        return self.level >= 2

    def reducer(
        self,
        model: nn.Module,
        mesh,
        bucket_mb: float,
        shared: nn.Parameter | None = None,
        blocks: tuple[WeightBlock, ...] = (),
    ) -> GradReducer:
        """The dp × cp gradient reducer of `model` on `mesh`'s groups: `shared` (a pipeline
        stage's copy of the tied table, summed with another stage's after the reduction) gets
        a bucket of its own so both copies shard alike (zero=0: so that the sum's new grad
        frees the old one's whole flat buffer); `blocks` (the model's units of weight use, in
        forward order) are where the weight gathers wait (1, 2) or gather and free (3). The
        expert weights' buckets (parallel.ep > 1) are summed over their replicas; a sharded
        level shards over the mesh's shard groups, HSDP's replicas all-reducing the shards
        (parallel.dp_shard: distributed/mesh.py)."""
        own = (shared,) if shared is not None else ()
        if self.optimizer_kind is None:
            experts = mesh.expert_replica_group
            return self.reducer_kind(
                model, mesh.replica_group, bucket_mb, own_bucket=own, expert_group=experts
            )
        return self.reducer_kind(
            model,
            mesh.shard_group,
            bucket_mb,
            own,
            blocks=tuple(blocks),
            expert_group=mesh.expert_shard_group,
            reduce_dtype=self.reduce_dtype,
            per_microbatch=self.per_microbatch,
            replicate_group=mesh.replicate_group,
            fp8_params=self.fp8_params,
        )

    def optimizer(self, reducers: list, groups: list[dict], make, stage_group=None):
        """The distributed optimizer over `reducers`' shards; None at zero=0 or without
        reducers (no replicas): the plain one."""
        mine = [r for r in reducers if r is not None]
        if self.optimizer_kind is None or not mine:
            return None
        return self.optimizer_kind(mine, groups, make, stage_group)

    # ---- the norm-group rule ------------------------------------------------------------------

    def spread(self, mesh) -> bool:
        """Each logical grad is whole on one rank of its replica group only (a sharded level
        with replicas; or parallel.ep > 1, whose ep ranks hold different experts)."""
        if mesh is None:
            return False
        return bool(self.level) or mesh.expert_replica_group is not None

    def norm_group(self, mesh):
        """The group the whole model's grad norm is summed over (None: one process)."""
        if mesh is None:
            return None
        return mesh.world_group if self.spread(mesh) else mesh.norm_group

    def stage_norm_group(self, mesh):
        """The group one pipeline stage's grad norm is summed over (PipeDream's per-stage
        clip, post-validation's partial state)."""
        return mesh.stage_group if self.spread(mesh) else mesh.group("tp")

    def counted(self, mesh, reducer: GradReducer | None):
        """`reducer`'s test of which grads this rank counts in that norm (None: all)."""
        return reducer.counts if reducer is not None and self.spread(mesh) else None


LEVELS = {
    0: Sharding(0, GradReducer, None),
    1: Sharding(1, OverlappedGatherReducer, ShardedOptimizer),
    2: Sharding(2, Zero2Reducer, Zero2Optimizer),
    3: Sharding(3, Zero3Reducer, Zero3Optimizer),
}
PLAIN = LEVELS[0]


def sharding_of(
    level: int,
    replicas: bool,
    per_microbatch: bool = False,
    reduce_dtype=torch.float32,
    fp8_params: bool = False,
) -> Sharding:
    """The strategy of ZeRO `level` (the config's); without dp × cp `replicas` nothing is
    sharded, whatever the level. `per_microbatch` (zero >= 2) and `reduce_dtype` (zero >= 1):
    how the sharded levels reduce (parallel.grad_reduce, parallel.grad_reduce_dtype);
    `fp8_params` (train.fp8_params): zero 1-2 hold the FP8 linears' weights cast."""
    base = LEVELS[level if replicas else 0]
    if not base.level:
        return base
    mode = per_microbatch and base.level >= 2
    held = fp8_params and base.level <= 2
    return replace(base, per_microbatch=mode, reduce_dtype=reduce_dtype, fp8_params=held)


@contextlib.contextmanager
def full_weights(reducers: list, write_back: bool = False):
    """Within: every local parameter holds its whole, current value (pending overlapped gathers
    waited for; zero=3's blocks gathered); `write_back`: zero=3 shards take them back after."""
    with contextlib.ExitStack() as stack:
        for r in reducers:
            if r is not None:
                stack.enter_context(r.full_weights(write_back))
        yield
