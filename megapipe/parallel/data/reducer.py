"""Data-parallel gradient reduction: flat buckets, all-reduced while backward still runs.

PyTorch DDP (Li et al. 2020, §3.2): parameters are packed in reverse registration order (about
the order backward produces their grads) into flat float32 buckets of ~`bucket_mb` MB
(replica_bucket_mb(dp·cp): 25 MB, growing with the replicas past 6). During the last
microbatch's backward a post-accumulate-grad hook counts each bucket's arrivals; a full
bucket (and every bucket before it, so all ranks launch in one order) starts an asynchronous
all-reduce, overlapping communication with the rest of backward. Earlier microbatches run under
`no_sync()`: their grads just accumulate. `finish()` waits and writes the sums back.
Grads are summed, not averaged: the loss is already divided by the global token count.
Expert parallelism (parallel/expert/): a parameter marked as an expert weight holds this ep
rank's experts only, the same on the dp/ep · cp ranks of its expert-replica group and different
on the others; its buckets are summed over `expert_group` (Megatron-Core's expert data-parallel
group), the dense ones over `group` as before. Buckets never mix the two.
Under bf16 params (parallel/precision.py) a bucket's float32 main grads are one contiguous span
of the module's main-grad buffer, all-reduced in place (Megatron-Core's grad buffer): no copy
in or out, and arrivals are counted by the main grads' own hooks.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from megapipe.config.states import DEFAULT_BUCKET_MB, bucket_runs
from megapipe.distributed import collectives as C
from megapipe.parallel.expert.sharding import is_expert
from megapipe.parallel.precision import grad_of, main_grad_span, set_grad


@dataclass
class Bucket:
    params: list[nn.Parameter]
    arrived: int = 0
    flat: torch.Tensor | None = None
    work: object = None
    launched_in_backward: bool = False
    shard: torch.Tensor | None = None  # zero=1: this rank's reduce-scattered part
    experts: bool = False  # expert weights: summed over the expert-replica group

    @property
    def ready(self) -> bool:
        return self.arrived == len(self.params)

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)


@dataclass
class GradReducer:
    """Bucketed, overlapped sum of gradients over `group` (the dp or dp×cp group)."""

    model: nn.Module
    group: object
    bucket_mb: float = DEFAULT_BUCKET_MB
    own_bucket: tuple = ()  # parameters that get a bucket of their own
    buckets: list[Bucket] = field(default_factory=list)
    expert_group: object = None  # parallel.ep > 1: the expert weights' replicas

    def __post_init__(self) -> None:
        self.syncing, self.next_launch = True, 0
        params = [p for p in self.model.parameters() if p.requires_grad][::-1]
        alone = {id(p) for p in self.own_bucket}
        kind = self.expert_kind()
        packed = pack(params, self.bucket_mb * 2**20, alone, self.pack_kind(kind))
        self.buckets = [Bucket(b, experts=bool(kind and kind(b[0]))) for b in packed]
        self.bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self.hooks = [self._hook(p) for p in params]

    def expert_kind(self):
        """`pack`'s kind: expert weights apart from dense ones (parallel.ep > 1), else None."""
        return is_expert if self.expert_group is not None else None

    def pack_kind(self, kind):
        """`pack`'s kind: where it changes a new bucket starts (a level that keeps more kinds
        apart says so: zero2.py)."""
        return kind

    def _hook(self, param: nn.Parameter):
        """Count `param`'s arrival after each backward: when its main grad is added into (bf16
        params), else after autograd accumulates its .grad."""
        if hasattr(param, "main_grad_hooks"):
            param.main_grad_hooks.append(self._arrived)
            return None
        return param.register_post_accumulate_grad_hook(self._arrived)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward without communication (all microbatches but the last)."""
        self.syncing = False
        try:
            yield
        finally:
            self.syncing = True

    def backward_of(self, last: bool):
        """The context one microbatch's backward (a grad action) runs in: step-wise reduction,
        so the buckets sync during the `last` one only (`no_sync` before); a per-microbatch
        reducer (zero2.py) overrides it."""
        return contextlib.nullcontext() if last else self.no_sync()

    def full_weights(self, write_back: bool = False):
        """Within: every parameter whole; here always (a sharded level gathers, zero2.py)."""
        return contextlib.nullcontext()

    def _arrived(self, param: nn.Parameter) -> None:
        if not self.syncing:
            return
        self.bucket_of[id(param)].arrived += 1
        while self.next_launch < len(self.buckets) and self.buckets[self.next_launch].ready:
            self._launch(self.buckets[self.next_launch], in_backward=True)

    def _launch(self, bucket: Bucket, in_backward: bool) -> None:
        bucket.flat = main_grad_span(bucket.params)  # in place; else a float32 copy
        if bucket.flat is None:
            grads = [grad_of(p) if grad_of(p) is not None else torch.zeros_like(p)
                     for p in bucket.params]  # fmt: skip
            bucket.flat = torch.cat([g.detach().float().flatten() for g in grads])
        C.count("all_reduce", bucket.flat)
        bucket.work = dist.all_reduce(bucket.flat, group=self.group_of(bucket), async_op=True)
        bucket.launched_in_backward = in_backward
        self.next_launch += 1

    def group_of(self, bucket: Bucket):
        """The ranks `bucket` is summed over: the expert replicas or every dp × cp replica."""
        return self.expert_group if bucket.experts else self.group

    def counts(self, param: nn.Parameter) -> bool:
        """This rank counts `param`'s summed grad in a grad norm taken over every rank: the
        grad is whole on each replica of its group, so the group's first rank counts it."""
        return dist.get_rank(self.group_of(self.bucket_of[id(param)])) == 0

    def finish(self) -> None:
        """Launch what backward did not (unused params), wait, and write the sums back."""
        while self.next_launch < len(self.buckets):
            self._launch(self.buckets[self.next_launch], in_backward=False)
        for bucket in self.buckets:
            bucket.work.wait()
            self._write_back(bucket)
        self.overlapped = sum(b.launched_in_backward for b in self.buckets)
        for bucket in self.buckets:
            bucket.arrived, bucket.flat, bucket.work = 0, None, None
        self.next_launch = 0

    def _write_back(self, bucket: Bucket) -> None:
        """The summed flat bucket back into each parameter's grad."""
        if main_grad_span(bucket.params) is not None:
            return  # reduced in place
        sizes = [p.numel() for p in bucket.params]
        for p, chunk in zip(bucket.params, bucket.flat.split(sizes)):
            set_grad(p, chunk.view_as(p))


def pack(params: list[nn.Parameter], limit_bytes: float, alone: set[int], kind=None) -> list:
    """Consecutive float32 buckets of about `limit_bytes` (config/states.bucket_runs, which the
    memory model lays out alike); a parameter in `alone` (by id) gets a bucket of its own, so
    its place in the flat index space is the same on every rank; where `kind(p)` changes
    (expert or dense weights) a new bucket starts."""
    kinds = [kind(p) for p in params] if kind is not None else ()
    sizes, apart = [p.numel() for p in params], [id(p) in alone for p in params]
    runs = bucket_runs(sizes, limit_bytes, apart, kinds)
    return [params[r.start : r.stop] for r in runs]
