"""ZeRO-2 (the config's zero: 2) and the overlapped parameter all-gather of every sharded level.

Rajbhandari et al. 2020 (ZeRO, §5.2 "P_os+g"): besides the AdamW moments, each of the R
replicas (dp × cp) keeps only its shard of the summed gradients. The buckets, their padded
layout and the reduce-scatter launched as each bucket completes during the last backward are
zero=1's (zero.py); what changes is what is held. Between microbatches each rank accumulates
its local full-size grads (Megatron's distributed optimizer and DeepSpeed's ZeRO-2 do the same
under gradient accumulation: the reduce-scatter runs once, on the last microbatch). When a
bucket's reduce-scatter is launched its local grads are dropped (copied into the send buffer);
after `finish()` only the reduce-scattered shard remains (`bucket.shard`, float32, 1/R of the
bucket): no parameter holds a `.grad`. The tp partial sums, the tied embedding's two copies, the
global norm and the clip then run on the shards (train/zero_grads.py): they are linear or
elementwise and the shards line up across the ranks they combine (zero.py's docstring).

bf16 weights (train.params_dtype, parallel/precision.py; Megatron-Core's distributed optimizer
with bf16 params): the local grads are the float32 main grads, accumulated in place over the
microbatches in the chunk's one buffer; after `finish()` that buffer is freed (`MainGrads.
release`) and the step's first forward allocates it again, so over the step a rank holds bf16
weights 2 + its float32 grad shard 4/d + main params and moments 12/d bytes per parameter. The
optimizer steps the owned float32 main params, rounds them into the weights' owned ranges and
all-gathers the weights in bf16; the reduce-scatter stays float32.

Overlap (Megatron's distributed optimizer, `overlap_param_gather`): after the step the updated
shards' all-gathers are all launched asynchronously, in forward order, and the step returns. A
forward pre-hook on each block (embedding, each layer, head: `WeightBlock`) waits for the buckets
holding the parameters that block reads, so bucket b's gather overlaps the forward of every
block before its first user. Anything else that reads weights between steps (a checkpoint,
the tests) first calls `wait_params()` through `ShardedOptimizer.full_weights()`.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from functools import partial
from typing import ClassVar

import torch
from torch import nn

from megapipe.config.states import IN_FLIGHT
from megapipe.distributed import collectives as C
from megapipe.parallel.data.fp8_params import HeldFp8Weights
from megapipe.parallel.data.reducer import Bucket
from megapipe.parallel.data.zero import (
    ShardedGradReducer,
    ShardedOptimizer,
    Slot,
    _all_gather,
    widest,
)
from megapipe.parallel.data.zero3_fp8 import fp8_linears


@dataclass(frozen=True)
class WeightBlock:
    """A unit of the model for weight gathers: `module`'s forward reads `forward`, its backward
    reads `backward` (an embedding's backward reads no weight: it scatters rows of the grad)."""

    module: nn.Module
    forward: tuple[nn.Parameter, ...]
    backward: tuple[nn.Parameter, ...]


@dataclass(eq=False)
class OverlappedGatherReducer(ShardedGradReducer):
    """zero=1's reducer whose weight all-gather after the step overlaps the next forward."""

    blocks: tuple[WeightBlock, ...] = ()
    pending: dict = field(default_factory=dict)  # bucket index -> (gathered flat, work)
    waited_s: float = 0.0  # seconds spent waiting for weight gathers (the exposed part)
    fp8_params: bool = False  # train.fp8_params: the FP8 linears' weights held cast (fp8_params.py)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.held = HeldFp8Weights(self) if self.fp8_params else None
        self.main_shards: dict[int, torch.Tensor] = {}
        self.rebucket()
        self.index_of = {id(p): i for i, b in enumerate(self.buckets) for p in b.params}
        self.slot_of = {
            id(s.param): (s, b) for b, slots in zip(self.buckets, self.slots) for s in slots
        }
        self.install_hooks()

    def rebucket(self) -> None:
        """A level that lays its buckets out otherwise does it here (zero3.py)."""
        return None

    def pack_kind(self, kind):
        """train.fp8_params: the FP8 linears' weights in buckets of their own, gathered cast."""
        if not self.fp8_params:
            return kind
        fp8 = fp8_linears(self.model)
        return lambda p: (bool(kind and kind(p)), id(p) in fp8)

    def buckets_of(self, params) -> list[int]:
        """The indices of the buckets holding `params`, in forward (descending) order."""
        return sorted({self.index_of[id(p)] for p in params if id(p) in self.index_of})[::-1]

    def install_hooks(self) -> None:
        for block in self.blocks:
            needs = self.buckets_of(block.forward)
            block.module.register_forward_pre_hook(partial(self._wait_for, needs))

    def _wait_for(self, needs: list[int], *_) -> None:
        for i in needs:
            self._wait(i)

    @torch.no_grad()
    def gather_params(self) -> None:
        """After the step: launch every bucket's all-gather of the updated shards (the first
        block's bucket first); each completes at the first use of its bucket (module doc).
        A gather still pending from the step before (a bucket no block read) lands first."""
        self.wait_params()
        for i in reversed(range(len(self.buckets))):
            self.pending[i] = self._gather_bucket(i)
        if not self.blocks:  # nothing would wait on first use
            self.wait_params()

    def hold_fp8(self, main: dict[int, torch.Tensor]) -> None:
        """train.fp8_params: the FP8 buckets gathered cast from `main` ({id(param): this rank's
        float32 main shard}, the optimizer's), then their bf16 weights freed (fp8_params.py)."""
        if self.held is None:
            return
        self.main_shards = main
        self.wait_params()
        for i, bucket in enumerate(self.buckets):
            if self.held.bucket_holds(bucket):
                self.pending[i] = self._gather_bucket(i)
        self.wait_params()
        self.held.release()

    def _gather_bucket(self, i: int):
        """Bucket `i`'s gather launched: (its gathered flat, work), or for FP8 weights held
        cast (None, their payloads' works)."""
        bucket, slots = self.buckets[i], self.slots[i]
        if self.held is None or not self.held.bucket_holds(bucket):
            return self._launch_gather(bucket, slots)
        lo, hi = self.shard_range(bucket)
        owned = torch.zeros(hi - lo, dtype=bucket.params[0].dtype, device=bucket.params[0].device)
        for s in slots:  # rounded as the bf16 weight is (ShardedOptimizer._round_into_weights)
            owned[s.shard_lo : s.shard_lo + s.hi - s.lo].copy_(self.main_shards[id(s.param)])
        group = self.group_of(bucket)

        def gather(full, shard):
            C.count("all_gather", full)
            return _all_gather(full, shard, group=group, async_op=True)

        return None, self.held.launch(i, owned, gather)

    def _launch_gather(self, bucket: Bucket, slots: list[Slot]):
        lo, hi = self.shard_range(bucket)
        p0 = bucket.params[0]
        mine = torch.zeros(hi - lo, dtype=widest(bucket.params), device=p0.device)
        for s in slots:
            mine[s.shard_lo : s.shard_lo + s.hi - s.lo].copy_(s.param.view(-1)[s.lo : s.hi])
        full = mine.new_empty(self.size_of(bucket) * (hi - lo))
        C.count("all_gather", full)
        return full, _all_gather(full, mine, group=self.group_of(bucket), async_op=True)

    @torch.no_grad()
    def _wait(self, i: int) -> None:
        if i not in self.pending:
            return
        full, work = self.pending.pop(i)
        began = time.perf_counter()
        for each in work if full is None else [work]:  # FP8 weights held cast: their payloads'
            each.wait()
        self.waited_s += time.perf_counter() - began
        if full is None:
            return
        bucket = self.buckets[i]
        sizes = [p.numel() for p in bucket.params]
        for p, chunk in zip(bucket.params, full[: bucket.numel].split(sizes)):
            p.copy_(chunk.view_as(p))

    def wait_params(self) -> None:
        """Every pending gather done: the weights are whole again."""
        for i in sorted(self.pending, reverse=True):
            self._wait(i)

    @contextlib.contextmanager
    def full_weights(self, write_back: bool = False):
        """Within: every local parameter holds its whole (gathered) value."""
        self.wait_params()
        yield


class Zero2Reducer(OverlappedGatherReducer):
    """Grads reduce-scattered into shards; nothing full-size is kept (module docstring)."""

    in_place: ClassVar[bool] = False  # the main grads are zeroed or freed once a bucket is sent

    def __post_init__(self) -> None:
        super().__post_init__()
        self.sums: dict[int, torch.Tensor] = {}  # per microbatch: id(bucket) -> shard sum
        self.in_flight: list[Bucket] = []  # per microbatch: launched, not yet settled
        self.main_grads = getattr(self.model, "main_grads", None)  # bf16 weights' buffer
        if self.main_grads is not None:  # allocated again by the step's first forward
            for module in [b.module for b in self.blocks] or [self.model]:
                module.register_forward_pre_hook(self._ensure_main_grads)

    def _ensure_main_grads(self, *_) -> None:
        if self.main_grads is not None and torch.is_grad_enabled():
            self.main_grads.ensure()

    def finish(self) -> None:
        """The reduce-scatter; then bf16 weights' float32 main grads go (copied into the send
        buffers at launch): the rank keeps its float32 shard of each bucket only."""
        if self.per_microbatch:
            self._flush(in_backward=False)
            for bucket in self.buckets:  # HSDP: the step's sums over the replicas, once
                total = self.replicate(self.sums.pop(id(bucket), None))
                bucket.shard = None if total is None else total.float()
        else:
            super().finish()
        self._release_main_grads()

    # ---- per-microbatch reduction (parallel.grad_reduce=microbatch) ---------------------------
    # FSDP (Zhao et al. 2023, §3.3) and DeepSpeed ZeRO-3: every microbatch's backward
    # reduce-scatters each bucket as its grads are complete (the arrival hooks, in bucket
    # order), into a float32 sum of the rank's shard (`sums`); the local grads go at launch.
    # A grad action's end launches the buckets it left (Zero Bubble's B leaves the deferred
    # weight grads to W, whose end sends them) and waits: every grad is sent once, on every
    # rank in the same order. At most IN_FLIGHT reductions run at once (FSDP's limit on
    # in-flight reduce-scatters), so their full-size send buffers stay a bucket or two.

    def backward_of(self, last: bool):
        if not self.per_microbatch:
            return super().backward_of(last)
        return self._flushing(last)

    @contextlib.contextmanager
    def _flushing(self, last: bool):
        self._before_grads()
        yield
        if not last:  # the last one's rest is launched by finish()
            self._flush(in_backward=False)

    def _before_grads(self) -> None:
        """Before a grad action adds into grads (zero3.py allocates what W writes)."""
        return None

    def _flush(self, in_backward: bool) -> None:
        """Launch the buckets this round has not, and settle every reduction."""
        while self.next_launch < len(self.buckets):
            self._launch(self.buckets[self.next_launch], in_backward)
        self.overlapped = sum(b.launched_in_backward for b in self.buckets)
        for bucket in self.buckets:
            bucket.arrived = 0
            self._settle(bucket)
        self.in_flight, self.next_launch = [], 0

    def _settle(self, bucket: Bucket) -> None:
        """`bucket`'s reduction in flight waited for and added into its float32 shard sum."""
        if bucket.work is None:
            return
        bucket.work.wait()
        shard, total = bucket.shard.float(), self.sums.get(id(bucket))
        if total is None:
            self.sums[id(bucket)] = shard
        else:
            total += shard
        bucket.flat, bucket.work, bucket.shard = None, None, None

    def _release_main_grads(self) -> None:
        if self.main_grads is not None:
            self.main_grads.release()

    def _launch(self, bucket: Bucket, in_backward: bool) -> None:
        if self.per_microbatch:
            while len(self.in_flight) >= IN_FLIGHT:
                self._settle(self.in_flight.pop(0))
            self.in_flight.append(bucket)
        super()._launch(bucket, in_backward)
        for p in bucket.params:  # their values are in the send buffer now
            p.grad = None
        if self.per_microbatch:  # the next microbatch adds into zeros
            self._zero_main_grads(bucket)

    def _zero_main_grads(self, bucket: Bucket) -> None:
        for p in bucket.params:
            main = getattr(p, "main_grad", None)
            if main is not None:
                main.zero_()

    def _write_back(self, bucket: Bucket) -> None:
        """The shard is the bucket's grad (float32); the full-size send buffer goes (finish
        drops it); HSDP: summed over the replicas first."""
        bucket.shard = self.replicate(bucket.shard).float()
        for p in bucket.params:
            p.grad = None

    def grad_piece(self, param: nn.Parameter) -> torch.Tensor | None:
        """The summed grad of `param`'s owned range (a view of its bucket's shard); None when
        this rank owns none of it or there is no grad."""
        found = self.slot_of.get(id(param))
        if found is None:
            return None
        slot, bucket = found
        if bucket.shard is None:
            return None
        return bucket.shard[slot.shard_lo : slot.shard_lo + slot.hi - slot.lo]

    def shards(self) -> list[torch.Tensor]:
        """The reduce-scattered grad shards (for the clip)."""
        return [b.shard for b in self.buckets if b.shard is not None]

    def drop_grads(self) -> None:
        self.sums = {}
        for bucket in self.buckets:
            bucket.shard = None
        for p in self.model.parameters():
            p.grad = None
        self._release_main_grads()  # a skipped step's too: the next forward zeroes them


class Zero2Optimizer(ShardedOptimizer):
    """The distributed optimizer over grad shards: each owned range's grad is its view of the
    bucket's reduce-scattered shard (Zero2Reducer.grad_piece), not of a full-size .grad."""

    def step(self) -> None:
        reducer_of = {id(p): r for r in self.reducers for p in r.model.parameters()}
        for s, view in zip(self.slots, self.views):
            view.grad = reducer_of[id(s.param)].grad_piece(s.param)
        self.inner.step()
        self._round_into_weights()  # bf16 weights: the owned ranges from the main params
        for r in self.reducers:
            r.gather_params()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for view in self.views:
            view.grad = None
        for r in self.reducers:
            r.drop_grads()
