"""The distributed optimizer (ZeRO-1): gradients reduce-scattered in buckets, AdamW state and the
update only for this rank's shard of each bucket, weights all-gathered after the step.

Rajbhandari et al. 2020 (ZeRO, §5.1 "P_os"): each of the R data-parallel replicas (dp × cp here)
keeps the optimizer state of 1/R of the parameters. As Megatron's distributed optimizer does,
the shard is a contiguous range of each flat gradient bucket (the bucket padded to a multiple of
R), so a bucket's reduce-scatter leaves each rank exactly the summed gradients it steps. With
float32 weights (autocast computes in bf16) the state per parameter is weight 4 + grad 4 + AdamW
moments 8/R bytes: Megatron's fp32 layout, 8 + 8/d. With bf16 weights (train.params_dtype,
parallel/precision.py) the grads are the float32 main grads, and the optimizer keeps float32
main params of its shard only, written back into the weights' shard and all-gathered in bf16:
weight 2 + main grad 4 + (main param 4 + moments 8)/R, Megatron's 6 + 12/d.

The reduce-scatter replaces `GradReducer`'s all-reduce, launched from the same hooks while the
last backward runs. No full-size copy of the grads is made for it where the grads can be sent as
they lie (Megatron-Core's `param_and_grad_buffer.py` reduce-scatters its grad buffer in place):
bf16 weights' main grads are one float32 buffer per bucket, padded to R·S elements
(`BucketMainGrads`), reduce-scattered in place when the reduction is float32 (a bf16 one sends
a bf16 copy, half the bytes); float32 weights' grads are rebound, at launch, to views of the
float32 send buffer they were copied into, so the two are held at once for the bucket being
copied only.
`finish()` leaves each parameter's full-size `.grad` holding the summed
gradient on this rank's shard and zeros elsewhere. The later sums over other axes are linear and
elementwise (tp partial grads, the tied embedding's two copies), and they line up shard for
shard because the bucket layouts agree across the ranks they sum over: tp ranks hold local
tensors of equal shapes, and under pp the tied table sits in a bucket of its own on both of its
holders.
The zeros also make the squared-norm sum over every rank count each element once.

HSDP (parallel.dp_shard, distributed/mesh.py): `group` is the shard group (S·cp ranks) and
`replicate_group` the dp/S replicas of this rank's shard. The reduce-scatter runs within the
shard group; its shard is then all-reduced over the replicate group (torchtitan's HSDP, FSDP2's
reduce-scatter then all-reduce, Zhao et al. 2023 §3.4 "hybrid sharding"), so every replica holds
the same summed shard. The norm counts it on the first replica only (`counts`), and a checkpoint
takes its moments from that replica only (`ShardedOptimizer.writes_shards`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist
from torch import nn

from megapipe._torch_compat import is_released
from megapipe.distributed import collectives as C
from megapipe.parallel.data.bucket_grads import BucketMainGrads
from megapipe.parallel.data.reducer import Bucket, GradReducer
from megapipe.parallel.precision import (
    grad_of,
    main_grad_span,
    set_grad,
    widened,
    zero_main_grads,
)

# torch 2.13 renamed the flat-tensor collectives; older releases (the GPU machine's) have these
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


_EMPTY = torch.zeros(0)


@dataclass(frozen=True)
class Slot:
    """Where a parameter's owned elements lie: flat range [lo, hi) of the parameter, at
    [shard_lo, shard_lo + hi - lo) of this rank's shard of the bucket."""

    param: nn.Parameter
    lo: int
    hi: int
    shard_lo: int


@dataclass(eq=False)
class ShardedGradReducer(GradReducer):
    """GradReducer whose buckets are reduce-scattered: rank r of the replica group owns the
    contiguous range [r·S, (r+1)·S) of each bucket padded to R·S elements. `reduce_dtype`
    (parallel.grad_reduce_dtype) is what the reduce-scatter sends and sums in; the shards it
    leaves are widened to float32 (bf16: FSDP2's MixedPrecisionPolicy.reduce_dtype)."""

    reduce_dtype: torch.dtype = torch.float32
    per_microbatch: bool = False  # parallel.grad_reduce=microbatch (zero2.py)
    replicate_group: object = None  # HSDP: the replicas of this rank's shards (None: none)
    # the grads are sent as they lie (module docstring); Zero2Reducer: copied, since it zeroes or
    # frees the main grads once a bucket is sent
    in_place: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        self.size = dist.get_world_size(self.group)
        self.index = dist.get_rank(self.group)
        if self.expert_group is not None:  # expert buckets shard over the expert replicas
            self.expert_size = dist.get_world_size(self.expert_group)
            self.expert_index = dist.get_rank(self.expert_group)
        self.slots = [self._slots(b) for b in self.buckets]
        self.slots_by_bucket = {id(b): s for b, s in zip(self.buckets, self.slots)}
        self.padded_grads = self._padded_main_grads() if self.in_place else None

    def padded_numel(self, bucket: Bucket) -> int:
        """`bucket`'s flat size padded to a multiple of its group's size."""
        lo, hi = self.shard_range(bucket)
        return self.size_of(bucket) * (hi - lo)

    def _padded_main_grads(self) -> BucketMainGrads | None:
        """bf16 weights: the model's main grads rebound to one padded buffer per bucket, when
        the buckets hold every parameter that has one (else left as they are)."""
        whole = getattr(self.model, "main_grads", None)
        with_main = {id(p) for p in self.model.parameters() if hasattr(p, "main_grad_span")}
        in_buckets = {id(p) for b in self.buckets for p in b.params}
        if whole is None or not with_main or with_main != in_buckets:
            return None
        numels = [self.padded_numel(b) for b in self.buckets]
        return BucketMainGrads(self.buckets, whole, numels, resident=True)

    def size_of(self, bucket: Bucket) -> int:
        """The ranks sharing `bucket`'s shards (its group's size)."""
        return self.expert_size if bucket.experts else self.size

    def shard_range(self, bucket: Bucket) -> tuple[int, int]:
        """This rank's [lo, hi) of the bucket's padded flat index space."""
        index = self.expert_index if bucket.experts else self.index
        per = -(-bucket.numel // self.size_of(bucket))
        return index * per, (index + 1) * per

    def _slots(self, bucket: Bucket) -> list[Slot]:
        lo, hi = self.shard_range(bucket)
        out, offset = [], 0
        for p in bucket.params:
            a, b = max(lo, offset), min(hi, offset + p.numel())
            if a < b:
                out.append(Slot(p, a - offset, b - offset, a - lo))
            offset += p.numel()
        return out

    def counts(self, param: nn.Parameter) -> bool:
        """Every rank counts its shard (the summed grad is zero outside it), on the first of
        its HSDP replicas."""
        return self.first_replica

    @property
    def first_replica(self) -> bool:
        """This rank is the first of its shard's replicas (always, without HSDP)."""
        return self.replicate_group is None or dist.get_rank(self.replicate_group) == 0

    def replicate(self, shard: torch.Tensor | None) -> torch.Tensor | None:
        """HSDP: `shard` (summed over the shard group) summed over its replicas too, in the
        reduce dtype; as it is without replicas."""
        if self.replicate_group is None or shard is None:
            return shard
        sent = shard.to(self.reduce_dtype)
        C.count("all_reduce", sent)
        dist.all_reduce(sent, group=self.replicate_group)
        return sent

    def owned(self) -> list[Slot]:
        """Every parameter range this rank steps, bucket by bucket."""
        return [s for slots in self.slots for s in slots]

    def _launch(self, bucket: Bucket, in_backward: bool) -> None:
        lo, hi = self.shard_range(bucket)
        flat = self._padded_span(bucket)
        if flat is None or flat.dtype != self.reduce_dtype:  # sent as a copy
            flat = self._send_copy(bucket)
        bucket.flat, bucket.shard = flat, flat.new_empty(hi - lo)
        C.count("reduce_scatter", flat)
        group = self.group_of(bucket)
        bucket.work = _reduce_scatter(bucket.shard, flat, group=group, async_op=True)
        bucket.launched_in_backward = in_backward
        self.next_launch += 1

    def _padded_span(self, bucket: Bucket) -> torch.Tensor | None:
        """The bucket's padded main-grad buffer (`BucketMainGrads`), else None."""
        if self.padded_grads is None or main_grad_span(bucket.params) is None:
            return None
        flat, start = bucket.params[0].main_grad_span
        return flat if start == 0 and flat.numel() == self.padded_numel(bucket) else None

    def _send_copy(self, bucket: Bucket) -> torch.Tensor:
        """The bucket's grads copied into a padded send buffer of the reduce dtype. Float32
        weights' grads become views of a float32 one at once (the copy is the grads now)."""
        bucket.flat = torch.zeros(self.padded_numel(bucket), dtype=self.reduce_dtype,
                                  device=bucket.params[0].device)  # fmt: skip
        self._copy_in(bucket, bucket.flat)
        return bucket.flat

    def _copy_in(self, bucket: Bucket, flat: torch.Tensor) -> None:
        """`bucket`'s grads into its send buffer `flat`, each cast as copied (no converted copy
        of each grad). A weight's own grad (main grads are left as they are) is dropped once
        copied at zero 2-3 (sent: the shard is what is kept) and under a float32 reduction
        becomes a view of the send buffer (the copy is the grad now); until then both are
        held (config/states.packing_bytes)."""
        sizes = [p.numel() for p in bucket.params]
        for p, chunk in zip(bucket.params, flat[: bucket.numel].split(sizes)):
            if grad_of(p) is None:
                continue
            chunk.copy_(grad_of(p).detach().view(-1))
            if hasattr(p, "main_grad"):
                continue
            if not self.in_place:
                p.grad = None
            elif flat.dtype == torch.float32:
                p.grad = chunk.view_as(p)

    def _write_back(self, bucket: Bucket) -> None:
        """The bucket's grads become this rank's summed shard, zeros around, written into the
        grads where they lie (no widened copy of the send buffer); the send buffer goes."""
        lo, hi = self.shard_range(bucket)
        shard = self.replicate(bucket.shard)  # HSDP: over the replicas too
        padded = self._padded_span(bucket)
        if padded is not None:
            padded.zero_()[lo:hi].copy_(shard)
        else:
            for p in bucket.params:
                if grad_of(p) is None:  # a parameter no backward reached
                    set_grad(p, torch.zeros_like(p, dtype=torch.float32))
                grad_of(p).zero_()
            for s in self.slots_by_bucket[id(bucket)]:
                piece = shard[s.shard_lo : s.shard_lo + s.hi - s.lo]
                grad_of(s.param).view(-1)[s.lo : s.hi].copy_(piece)
        bucket.flat, bucket.shard = None, None

    @torch.no_grad()
    def gather_params(self, main: dict | None = None, dtype: torch.dtype | None = None) -> list:
        """After the step: every rank's updated shard of each bucket, all-gathered into the
        weights (launched for all buckets before the first wait), in the weights' dtype. The
        owned ranges come from `main` ({id(param): its float32 main shard}) where given, else
        from the weights. With `dtype` float32 (a checkpoint of bf16 weights) the weights are
        left alone and the full float32 tensors returned, one per parameter, in bucket order."""
        pending, out = [], []
        for bucket, slots in zip(self.buckets, self.slots):
            lo, hi = self.shard_range(bucket)
            kind = dtype or widest(bucket.params)
            mine = torch.zeros(hi - lo, dtype=kind, device=bucket.params[0].device)
            for s in slots:
                src = main[id(s.param)] if main else s.param.view(-1)[s.lo : s.hi]
                mine[s.shard_lo : s.shard_lo + s.hi - s.lo].copy_(src)
            full = mine.new_empty(self.size_of(bucket) * (hi - lo))
            C.count("all_gather", full)
            work = _all_gather(full, mine, group=self.group_of(bucket), async_op=True)
            pending.append((bucket, full, work))
        for bucket, full, work in pending:
            work.wait()
            sizes = [p.numel() for p in bucket.params]
            for p, chunk in zip(bucket.params, full[: bucket.numel].split(sizes)):
                if dtype is None:
                    p.copy_(chunk.view_as(p))
                else:
                    out.append((p, chunk.view_as(p)))
        return out


def _float_copy(param: nn.Parameter) -> torch.Tensor:
    """A float32 copy of `param`; zeros of its shape where its storage is freed (an FP8 weight
    held cast: a load writes every element)."""
    if is_released(param):
        return torch.zeros(param.shape, dtype=torch.float32, device=param.device)
    return param.detach().float()


def widest(params) -> torch.dtype:
    """The dtype a flat buffer of `params` is gathered in: a bucket holding a float32 weight
    (an MoE router) among bf16 ones goes in float32, so the router is never rounded."""
    return max((p.dtype for p in params), key=lambda d: d.itemsize)


def _low(param: nn.Parameter) -> bool:
    return param.dtype != torch.float32


def _shard(s: Slot) -> torch.Tensor:
    """The tensor the optimizer steps for slot `s`: a view of a float32 weight (the step writes
    it in place), or a float32 copy of a low-precision weight's owned range (its main param)."""
    view = s.param.detach().view(-1)[s.lo : s.hi]
    return view.float().clone() if _low(s.param) else view


class ShardedOptimizer:
    """An optimizer over this rank's shard of every bucket: each owned range of a parameter is a
    view of the weight (so the step writes the weight in place) whose grad is the same range of
    the parameter's grad; `step()` then all-gathers the weights. `param_groups` are the model's
    (e.g. decay / no decay), each mapped to its owned views. It offers the optimizer interface
    (optimizer_interface.py) with its state as owned ranges (`owned_state`)."""

    shards_state = True

    @property
    def writes_shards(self) -> bool:
        """This rank writes its owned moments to a checkpoint: HSDP's first replica only
        (the others hold the same ones)."""
        return all(r.first_replica for r in self.reducers)

    def __init__(
        self, reducers: list[ShardedGradReducer], groups: list[dict], make, stage_group=None
    ) -> None:
        self.reducers = reducers
        self.stage_group = stage_group  # dp × cp × tp: the ranks writing this stage's shards
        self.slots = [s for r in reducers for s in r.owned()]
        group_of = {id(p): i for i, g in enumerate(groups) for p in g["params"]}
        # float32 weights: views of the weight; bf16: this shard's float32 main params
        self.views = [_shard(s) for s in self.slots]
        self.main = {id(s.param): v for s, v in zip(self.slots, self.views) if _low(s.param)}
        self.low = any(_low(p) for r in reducers for p in r.model.parameters())
        self.slot_of = {id(s.param): (s, v) for s, v in zip(self.slots, self.views)}
        shard_groups = [{**g, "params": []} for g in groups]
        for s, view in zip(self.slots, self.views):
            shard_groups[group_of[id(s.param)]]["params"].append(view)
        # a rank that owns nothing (more replicas than elements) still needs an optimizer
        self.inner = make([g for g in shard_groups if g["params"]] or [{"params": [_EMPTY]}])
        for r in reducers:  # train.fp8_params: FP8 weights cast from the main params from now
            if hasattr(r, "hold_fp8"):
                r.hold_fp8(self.main)

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    def step(self) -> None:
        copies = []  # bf16 main grads' float32 copies: for the step alone, gone before the gather
        for s, view in zip(self.slots, self.views):
            grad = grad_of(s.param)
            piece = None if grad is None else grad.view(-1)[s.lo : s.hi]
            view.grad = widened(piece)
            if view.grad is not piece:
                copies.append(view)
        self.inner.step()
        for view in copies:
            view.grad = None
        self._round_into_weights()
        for r in self.reducers:
            r.gather_params()

    @torch.no_grad()
    def _round_into_weights(self) -> None:
        """bf16 weights: each owned range of the weights takes its float32 main param, rounded;
        the all-gather after (`gather_params`, overlapped at zero >= 1) spreads them."""
        for s in self.slots:  # FP8 weights held cast have no bf16 storage (fp8_params.py)
            if id(s.param) in self.main and not is_released(s.param):
                s.param.detach().view(-1)[s.lo : s.hi].copy_(self.main[id(s.param)])

    def zero_grad(self, set_to_none: bool = True) -> None:
        for view in self.views:
            view.grad = None
        for r in self.reducers:
            for p in r.model.parameters():
                p.grad = None
            zero_main_grads(r.model.parameters())

    @contextlib.contextmanager
    def full_weights(self, write_back: bool = False):
        """Within: every parameter whole (gathers waited for; zero=3's blocks gathered, and
        with `write_back` their shards taken back after)."""
        with contextlib.ExitStack() as stack:
            for r in self.reducers:
                stack.enter_context(r.full_weights(write_back))
            yield

    def main_weights(self) -> dict[int, torch.Tensor]:
        """bf16 weights: {id(param): its whole float32 main param}, every rank's shards
        all-gathered (a collective over the replicas; a checkpoint's transient); else {}."""
        if not self.low:
            return {}
        pairs = [  # the plain, blocking gather: a checkpoint reads the result at once
            pair
            for r in self.reducers
            for pair in ShardedGradReducer.gather_params(r, self.main, torch.float32)
        ]
        return {id(p): t for p, t in pairs}

    def load_targets(self) -> dict[int, torch.Tensor]:
        """bf16 weights: a whole float32 tensor per parameter for a checkpoint to read the
        weights into (restore_main then keeps the owned shards); else {}."""
        if not self.low:
            return {}
        return {id(p): _float_copy(p) for r in self.reducers for p in r.model.parameters()}

    @torch.no_grad()
    def restore_main(self, full: dict[int, torch.Tensor]) -> None:
        """Each owned shard's main param from {id(param): whole float32 tensor}, then the
        weights from every rank's shards (as after a step)."""
        for s, view in zip(self.slots, self.views):
            if id(s.param) in full and id(s.param) in self.main:
                view.copy_(full[id(s.param)].reshape(-1)[s.lo : s.hi])
        self._round_into_weights()
        for r in self.reducers:
            r.gather_params()

    def owned_state(self, param: nn.Parameter) -> tuple[Slot, dict] | None:
        """(the owned range of `param`, its AdamW state: created as zeros if the optimizer has
        not stepped yet, so a checkpoint load has tensors to fill); None if none is owned."""
        if id(param) not in self.slot_of:
            return None
        slot, view = self.slot_of[id(param)]
        state = self.inner.state[view]
        if not state:
            state["step"] = self.step_count().clone()
            state["exp_avg"] = torch.zeros_like(view)
            state["exp_avg_sq"] = torch.zeros_like(view)
        return slot, state

    def step_count(self) -> torch.Tensor:
        """AdamW's step count (every shard steps together)."""
        steps = [st["step"] for st in self.inner.state.values() if "step" in st]
        return steps[0] if steps else torch.zeros((), dtype=torch.float32)

    def set_step_count(self, value: torch.Tensor) -> None:
        for view in self.views:
            state = self.inner.state[view]
            if state:
                state["step"].copy_(value)

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (AdamW: both moments of its shard)."""
        return sum(
            t.numel() * t.element_size()
            for st in self.inner.state.values()
            for t in st.values()
            if torch.is_tensor(t) and t.dim() > 0
        )
