"""ZeRO-3 (the config's zero: 3): parameters sharded too, gathered block by block as they are used.

Rajbhandari et al. 2020 (ZeRO, §5.3 "P_os+g+p") with FSDP's unit of gathering (Zhao et al.
2023, §3.2-3.3): each block (embedding, each transformer layer, head: `WeightBlock`) has buckets of
its own, laid out as zero=1's (a contiguous 1/R range of each padded flat bucket per replica).
Between uses a bucket's full flat buffer has no storage (resized to 0: FSDP's free); each rank
keeps its range of the weights (`master`, the parameter dtype) that the optimizer steps in
place. The parameters are views of the flat buffer, so the autograd graph's saved weights see
whatever the buffer holds when backward reads them; the buffer is refilled by writing through
the flat tensor, which does not bump the parameters' version counters.

Per block, on this rank's stream of actions:
- before its forward: its buckets gathered (waiting for the prefetch), the next block's gather
  launched (prefetch); after its forward: freed;
- before its backward (a hook on its output's grad): the blocks held for the previous backward
  freed (every node reading their weights ran before this grad was complete), its buckets
  gathered again, the previous block's gather launched; at the end of the backward pass
  (autograd's queued callback) the rest freed. An embedding's backward reads no weight and
  gathers nothing.
So every F and every B (or BW) re-gathers the weights of its blocks, since holding them across
the microbatches in flight would hold the whole stage; full recompute reruns a layer's forward
inside that layer's backward, while it is gathered; Zero Bubble's deferred W computes
grad_W = grad_outᵀ · x from the queued activations and reads no weight, so it gathers nothing.
Gradients (parallel.grad_reduce, always per microbatch at zero=3: config/states
.reduces_per_microbatch): each microbatch's backward reduce-scatters each block's buckets as
they complete, into the rank's float32 shard sum, and frees the local grads (zero2.py; bf16
weights' main grads per bucket, bucket_grads.py), so no full-size grad exists.
bf16 weights (train.params_dtype; FSDP2's MixedPrecisionPolicy with bf16 params and float32
reduce, Megatron's float32 main params): the master shard, the full buffers and so every
gather are bf16; the main grads float32, freed after the reduce-scatter as at zero=2; the
optimizer steps float32 main params of the owned ranges and rounds them into the master shard.
Over the step a rank holds 2/d + 4/d + 12/d = 18/d bytes per parameter, plus the blocks
gathered in bf16.
"""

from __future__ import annotations

import contextlib
import time
from functools import partial

import torch
from torch import nn

from megapipe._torch_compat import queue_backward_callback, resize_storage
from megapipe.distributed import collectives as C
from megapipe.parallel.data.bucket_grads import BucketMainGrads
from megapipe.parallel.data.reducer import Bucket, pack
from megapipe.parallel.data.zero import _all_gather
from megapipe.parallel.data.zero2 import Zero2Optimizer, Zero2Reducer
from megapipe.parallel.data.zero3_fp8 import Fp8Gathers, fp8_linears


class Zero3Reducer(Zero2Reducer):
    """Zero2Reducer whose buckets are per block and whose weights live as shards."""

    bucket_grads: BucketMainGrads | None = None  # bf16 weights reducing every microbatch

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.per_microbatch and self.main_grads is not None:
            self.bucket_grads = BucketMainGrads(self.buckets, self.main_grads)
            self.main_grads = None
        self.full, self.master, self.work = [], [], {}
        with torch.no_grad():
            for bucket in self.buckets:
                self._shard(bucket)
        self.full += self.fp8.buffers()  # train.fp8's weights gathered cast (zero3_fp8.py)
        self.refs = [0] * len(self.full)  # per gather unit: buckets, then FP8 payloads
        self.held: list[int] = []  # buckets held for the backward running now
        self.in_backward = False
        self.prefetch = True  # False: each block's gather waited for at once (benchmarks)

    def rebucket(self) -> None:
        """Per-block buckets in place of the size-packed ones (before any hook counts them)."""
        experts = self.expert_kind() or (lambda p: False)
        self.buckets = [Bucket(b, experts=experts(b[0])) for b in self._pack()]
        self.bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self.slots = [self._slots(b) for b in self.buckets]

    def _pack(self) -> list[list[nn.Parameter]]:
        """Each block's own parameters (first user wins) in buckets, in backward order; a
        bucket holds one dtype (its flat buffer is the parameters' storage: an MoE router stays
        float32 beside bf16 weights) and, under parallel.ep, experts or dense weights only."""
        seen, per_block = set(), []
        alone, experts = {id(p) for p in self.own_bucket}, self.expert_kind()
        fp8 = fp8_linears(self.model)  # their weights apart: gathered cast (zero3_fp8.py)

        def kind(p):
            return p.dtype, bool(experts and experts(p)), id(p) in fp8

        for block in self.blocks:
            own = [p for p in block.forward if id(p) not in seen]
            own = sorted(own, key=lambda p: id(p) in fp8) if fp8 else own
            seen.update(id(p) for p in own)
            per_block.append(pack(own[::-1], self.bucket_mb * 2**20, alone, kind))
        rest = [p for p in self.model.parameters() if p.requires_grad and id(p) not in seen]
        out = [b for buckets in per_block[::-1] for b in buckets]
        return out + pack(rest[::-1], self.bucket_mb * 2**20, alone, kind)

    def _shard(self, bucket: Bucket) -> None:
        """Move `bucket`'s parameters into one flat buffer, keep this rank's range, free it."""
        lo, hi = self.shard_range(bucket)
        p0 = bucket.params[0]
        full = torch.zeros(self.size_of(bucket) * (hi - lo), dtype=p0.dtype, device=p0.device)
        offset = 0
        deferred = getattr(self.model, "deferred_init", None)  # built without storage
        for p in bucket.params:
            view = full[offset : offset + p.numel()]
            view.copy_((deferred.value(p) if deferred else p.detach()).reshape(-1))
            p.data = view.view_as(p)
            offset += p.numel()
        self.full.append(full)
        self.master.append(full[lo:hi].clone())
        _free(full)

    def install_hooks(self) -> None:
        self.fp8 = Fp8Gathers(self)
        self.fwd = [self.buckets_of(b.forward) for b in self.blocks]
        self.bwd = [self.buckets_of(b.backward) for b in self.blocks]
        in_blocks = {i for needs in self.fwd for i in needs}
        self.gather_fwd = [self.fp8.map(needs, "forward") for needs in self.fwd]
        self.gather_bwd = [self.fp8.map(needs, "dgrad") for needs in self.bwd]
        self.rest = [i for i in range(len(self.buckets)) if i not in in_blocks]
        for k, block in enumerate(self.blocks):
            block.module.register_forward_pre_hook(partial(self._pre_forward, k))
            block.module.register_forward_hook(partial(self._post_forward, k))

    # ---------------------------------------------------------------- gather and free

    def _prefetch(self, i: int) -> None:
        if i in self.work or _resident(self.full[i]):
            return
        b = self.fp8.bucket(i)  # unit i gathers bucket b (in FP8 past the buckets)
        group = self.group_of(self.buckets[b])  # the expert replicas for an expert bucket
        source = self.fp8.source(i, self.master[b], group)
        _alloc(self.full[i])
        C.count("all_gather", self.full[i])
        self.work[i] = _all_gather(self.full[i], source, group=group, async_op=True)

    def _acquire(self, needs: list[int]) -> None:
        for i in needs:
            self._prefetch(i)
        for i in needs:
            work = self.work.pop(i, None)
            if work is not None:
                began = time.perf_counter()
                work.wait()
                self.waited_s += time.perf_counter() - began
            self.refs[i] += 1

    def _release(self, needs: list[int]) -> None:
        for i in needs:
            self.refs[i] -= 1
            if self.refs[i] == 0 and i not in self.work:
                _free(self.full[i])

    def _pre_forward(self, k: int, *_) -> None:
        self._acquire(self.gather_fwd[k])
        if self.prefetch and k + 1 < len(self.blocks):
            for i in self.gather_fwd[k + 1]:
                self._prefetch(i)

    def _post_forward(self, k: int, module, args, output) -> None:
        out = output[0] if isinstance(output, tuple) else output
        if self.bwd[k] and torch.is_grad_enabled() and out.requires_grad:
            out.register_hook(partial(self._pre_backward, k))
        if self.bucket_grads is not None and torch.is_grad_enabled() and out.requires_grad:
            out.register_hook(partial(self._grads_for, k))
        self._release(self.gather_fwd[k])

    def _pre_backward(self, k: int, grad: torch.Tensor) -> None:
        if not self.in_backward:
            self.in_backward = True
            queue_backward_callback(self._end_backward)
        self._release(self.held)
        self._acquire(self.gather_bwd[k])
        self.held = list(self.gather_bwd[k])
        before = [j for j in range(k) if self.bwd[j]] if self.prefetch else []
        for i in self.gather_bwd[before[-1]] if before else ():
            self._prefetch(i)

    # ---------------------------------------------------------------- per-bucket main grads

    def _grads_for(self, k: int, grad: torch.Tensor) -> None:
        """Block k's backward starts: the main grads of what it read (and of the parameters
        outside every block) allocated, for its backward to add into."""
        self.bucket_grads.ensure([*self.fwd[k], *self.rest])

    def _before_grads(self) -> None:
        """Zero Bubble's W adds the deferred weight grads of the blocks with work queued."""
        if self.bucket_grads is None:
            return
        for k, block in enumerate(self.blocks):
            if any(getattr(m, "wgrad_queue", None) for m in block.module.modules()):
                self.bucket_grads.ensure([*self.fwd[k], *self.rest])

    def _launch(self, bucket: Bucket, in_backward: bool) -> None:
        if self.bucket_grads is not None:  # zeros where this round added nothing
            self.bucket_grads.ensure([self.index_of[id(bucket.params[0])]])
        super()._launch(bucket, in_backward)

    def _zero_main_grads(self, bucket: Bucket) -> None:
        if self.bucket_grads is None:
            return super()._zero_main_grads(bucket)
        self.bucket_grads.free(self.index_of[id(bucket.params[0])])

    def _end_backward(self) -> None:
        self._release(self.held)
        self.held, self.in_backward = [], False
        for i in list(self.work):  # prefetched, not used by this backward
            self.work.pop(i).wait()
            if self.refs[i] == 0:
                _free(self.full[i])

    # ---------------------------------------------------------------- step and whole weights

    def gather_params(self) -> None:
        """Nothing after the step: each block gathers its updated shards when next used (the
        FP8 casts of the new shards made then)."""
        self.fp8.stale()

    def wait_params(self) -> None:
        return None

    @contextlib.contextmanager
    def full_weights(self, write_back: bool = False):
        """Within: every parameter whole (a checkpoint's read or write, the tests); with
        `write_back` (a load), this rank's range is taken back from them after."""
        everything = list(range(len(self.buckets)))
        self._acquire(everything)
        try:
            yield
        finally:
            if write_back:
                with torch.no_grad():
                    for bucket, full, master in zip(self.buckets, self.full, self.master):
                        lo, hi = self.shard_range(bucket)
                        master.copy_(full[lo:hi])
                self.fp8.stale()
            self._release(everything)


class Zero3Optimizer(Zero2Optimizer):
    """The distributed optimizer over the weight shards (`Zero3Reducer.master`): each owned
    range of a parameter is a view of its bucket's master shard (float32 weights: stepped in
    place), or a float32 main param rounded into it after each step (bf16 weights); nothing is
    gathered after the step (the next forward gathers)."""

    def __init__(self, reducers: list[Zero3Reducer], groups: list[dict], make, stage_group=None):
        self.reducers, self.stage_group = reducers, stage_group
        self.slots, self.masters = [], []
        for r in reducers:
            for slots, master in zip(r.slots, r.master):
                for s in slots:
                    self.slots.append(s)
                    self.masters.append(master[s.shard_lo : s.shard_lo + s.hi - s.lo])
        self.low = any(p.dtype != torch.float32 for r in reducers for p in r.model.parameters())
        self.views = [m.float().clone() if self.low else m for m in self.masters]
        self.main = {id(s.param): v for s, v in zip(self.slots, self.views)} if self.low else {}
        self.slot_of = {id(s.param): (s, v) for s, v in zip(self.slots, self.views)}
        group_of = {id(p): i for i, g in enumerate(groups) for p in g["params"]}
        shard_groups = [{**g, "params": []} for g in groups]
        for s, view in zip(self.slots, self.views):
            shard_groups[group_of[id(s.param)]]["params"].append(view)
        empty = [{"params": [torch.zeros(0)]}]
        self.inner = make([g for g in shard_groups if g["params"]] or empty)

    @torch.no_grad()
    def _round_into_weights(self) -> None:
        """bf16 weights: each master range takes its float32 main param, rounded; where the
        bucket is gathered (a checkpoint load, within `full_weights`) the whole buffer too, so
        its write-back keeps the rounded values."""
        if not self.main:
            return
        for s, master, main in zip(self.slots, self.masters, self.views):
            master.copy_(main)
            if _resident(s.param):
                s.param.detach().view(-1)[s.lo : s.hi].copy_(main)


def _free(full: torch.Tensor) -> None:
    """FSDP's free: the storage goes, the tensor (and its parameter views) stay."""
    resize_storage(full, 0)


def _alloc(full: torch.Tensor) -> None:
    resize_storage(full, full.numel() * full.element_size())


def _resident(full: torch.Tensor) -> bool:
    return full.untyped_storage().size() > 0
