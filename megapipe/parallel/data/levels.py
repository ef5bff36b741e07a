"""The ZeRO level's reducer and optimizer (parallel.zero: 0 plain all-reduce; 1 moments
sharded, zero.py; 2 + grads, zero2.py; 3 + weights, zero3.py), chosen in one place."""

from __future__ import annotations

import contextlib

from torch import nn

from megapipe.parallel.data.reducer import GradReducer
from megapipe.parallel.data.zero import ShardedGradReducer, ShardedOptimizer
from megapipe.parallel.data.zero2 import (
    OverlappedGatherReducer,
    WeightBlock,
    Zero2Optimizer,
    Zero2Reducer,
)
from megapipe.parallel.data.zero3 import Zero3Optimizer, Zero3Reducer

REDUCERS = {1: OverlappedGatherReducer, 2: Zero2Reducer, 3: Zero3Reducer}

__all__ = ["WeightBlock", "full_weights", "make_reducer", "sharded_optimizer", "shards_grads"]


def make_reducer(
    model: nn.Module,
    group,
    bucket_mb: float,
    zero: int,
    shared: nn.Parameter | None = None,
    blocks: tuple[WeightBlock, ...] = (),
    expert_group=None,
) -> GradReducer:
    """The dp × cp gradient reducer of `model` at ZeRO level `zero`: `shared` (a pipeline
    stage's copy of the tied table, summed with another stage's after the reduction) gets a
    bucket of its own so both copies shard alike (zero=0: so that the sum's new grad leaves no
    other grad viewing the old one's flat buffer); `blocks` (the model's units of weight use,
    in forward order) are where the weight gathers wait (1, 2) or gather and free (3);
    `expert_group` (parallel.ep > 1) is where the expert weights' buckets are summed."""
    own = (shared,) if shared is not None else ()
    if not zero:  # own bucket: the tied sum's new grad frees the old one's whole flat buffer
        return GradReducer(model, group, bucket_mb, own_bucket=own, expert_group=expert_group)
    kind = REDUCERS[zero]
    return kind(model, group, bucket_mb, own, blocks=tuple(blocks), expert_group=expert_group)


def sharded_optimizer(reducers: list, groups: list[dict], make, stage_group=None):
    """The distributed optimizer over `reducers`' shards (None: they are not sharded)."""
    sharded = [r for r in reducers if isinstance(r, ShardedGradReducer)]
    if not sharded:
        return None
    if isinstance(sharded[0], Zero3Reducer):
        return Zero3Optimizer(sharded, groups, make, stage_group)
    kind = Zero2Optimizer if isinstance(sharded[0], Zero2Reducer) else ShardedOptimizer
    return kind(sharded, groups, make, stage_group)


def shards_grads(reducers: list) -> bool:
    """The summed grads live as shards (zero >= 2), not in the parameters' .grad."""
    return any(isinstance(r, Zero2Reducer) for r in reducers)


@contextlib.contextmanager
def full_weights(reducers: list, write_back: bool = False):
    """Within: every local parameter holds its whole, current value (pending overlapped gathers
    waited for; zero=3's blocks gathered); `write_back`: zero=3 shards take them back after."""
    with contextlib.ExitStack() as stack:
        for r in reducers:
            if isinstance(r, OverlappedGatherReducer):
                stack.enter_context(r.full_weights(write_back))
        yield
