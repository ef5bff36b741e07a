"""FP8 weight gathers under ZeRO-3 (train.fp8 with parallel.zero=3): Megatron-Core's
`--fp8-param-gather`, on megapipe's shards.

The weights of the FP8 linears (parallel/fp8.py: each tp linear not in train.fp8_keep_bf16) sit
in buckets of their own (zero3.py `_pack`). Once per step, at the first gather after the
optimizer changed the shards, each rank casts its range of such a bucket to e4m3 and keeps the
1-byte payload; every gather of the step then moves those payloads (bit-cast to uint8: gloo and
torch's fake backend refuse float8) into a uint8 buffer, half the bytes of a bf16 gather, and
the linear multiplies with views of it (no dequantize and cast again). The high-precision
buffer of such a bucket is gathered only for whole weights (a checkpoint's read or write).

Exact: each scale is the one the linear would make from the whole weight (fp8_scaling.quantize),
because its amax is taken over the same elements. A ZeRO range cuts a weight anywhere (rows,
128 x 128 blocks), so each rank takes the amax of its elements per scale (one per tensor, per
row, per block), the amax vector is all-reduced (MAX) over the bucket's shard group and then
over the tp groups that split the weight's scaled extent (as `quantize` reduces over its
`Groups`), and each element is cast with its own scale. The payloads are those one process
casts, bit for bit; the scales are on every rank after the all-reduce, so they need no gather.

Which cast each matmul needs: the forward's y = x Wᵀ scales W along its rows (per output
channel), the input grad's g W scales Wᵀ along its rows (per input channel). One tensor scale
(`tensorwise`) and 128 x 128 blocks (`block`) are the same cast read transposed, so one payload
serves the forward and the backward; per-row scales (`rowwise`) are two casts, so a rowwise
bucket has two payloads: the forward's gathered before a block's forward, the input grad's
before its backward (each gather still one byte per weight). The weight grad (grad_W = gᵀ x)
reads no weight. Under autocast the shard is cast to the compute dtype first, as the linear
casts its weight (weight_grad.autocast_operands).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from megapipe._torch_compat import resize_storage
from megapipe.distributed import collectives as C
from megapipe.parallel.autograd.weight_grad import autocast_operands
from megapipe.parallel.fp8_scaling import BLOCK, E4M3, amax_to_scale, to_fp8

FORMS = ("forward", "dgrad")  # the forward's cast of W and the input grad's cast of Wᵀ


def fp8_linears(model: nn.Module) -> dict[int, nn.Module]:
    """{id(weight): linear} of `model`'s FP8 linears (those the policy gave an Fp8Linear)."""
    return {id(m.weight): m for m in model.modules() if getattr(m, "fp8", None) is not None}


@dataclass(eq=False)
class Cast:
    """One weight's cast in one form: which scale each element takes, over what groups."""

    granularity: str  # "tensorwise", "rowwise" or "block" (fp8.GRANULARITY's weight side)
    form: str  # FORMS
    rows: int  # the weight's (R, C)
    cols: int
    groups: tuple  # the tp groups the amax is shared over beyond the shard group

    @property
    def n_scales(self) -> int:
        if self.granularity == "tensorwise":
            return 1
        if self.granularity == "rowwise":
            return self.rows if self.form == "forward" else self.cols
        return -(-self.rows // BLOCK) * -(-self.cols // BLOCK)

    def scale_index(self, flat: torch.Tensor) -> torch.Tensor:
        """The scale of each element at flat positions `flat` of the (R, C) weight."""
        r, c = flat // self.cols, flat % self.cols
        if self.granularity == "tensorwise":
            return torch.zeros_like(flat)
        if self.granularity == "rowwise":
            return r if self.form == "forward" else c
        return (r // BLOCK) * -(-self.cols // BLOCK) + c // BLOCK

    def shaped(self, inv: torch.Tensor) -> torch.Tensor:
        """The inverse scales as `quantize` returns them for W (forward) or Wᵀ (dgrad)."""
        if self.granularity == "tensorwise":
            return inv.reshape(())
        if self.granularity == "rowwise":
            return inv.reshape(-1, 1)
        blocks = inv.reshape(-(-self.rows // BLOCK), -(-self.cols // BLOCK))
        return blocks if self.form == "forward" else blocks.t()


def cast_of(linear: nn.Module, form: str) -> Cast:
    """`linear`'s weight cast for `form`: its recipe's weight granularity and the tp groups
    that split the extent a scale covers (fp8.Fp8Linear.forward / input_grad's Groups)."""
    fp8 = linear.fp8
    granularity = fp8.granularity[1]
    rows, cols = linear.weight.shape
    ins, outs = fp8.ins, fp8.outs
    if granularity == "tensorwise":
        groups = outs + ins
    elif granularity == "rowwise":  # a row of W is split where its inputs are, of Wᵀ its outputs
        groups = ins if form == "forward" else outs
    else:  # whole blocks on each tp rank (config/fp8_checks.py)
        groups = ()
    return Cast(granularity, form, rows, cols, tuple(g for g in groups if _split(g)))


def _split(group) -> bool:
    return group is not None and dist.get_world_size(group) > 1


@dataclass(eq=False)
class Payload:
    """One form's cast of a bucket: this rank's 1-byte shard (None: to cast again), the
    gathered buffer (storage only while used) and each weight's inverse scales."""

    full: torch.Tensor  # uint8, the padded flat bucket
    shard: torch.Tensor | None = None
    scales: dict[int, torch.Tensor] = field(default_factory=dict)


class Fp8Bucket:
    """A bucket of FP8 linears' weights gathered as e4m3 payloads (module docstring): one
    payload, or under rowwise a forward one and an input-grad one."""

    def __init__(self, params, linears: dict[int, nn.Module], lo: int, hi: int, n: int):
        self.params, self.lo, self.hi = params, lo, hi
        self.casts = {id(p): {f: cast_of(linears[id(p)], f) for f in FORMS} for p in params}
        twin = any(c["forward"].granularity == "rowwise" for c in self.casts.values())
        self.forms = FORMS if twin else FORMS[:1]  # one payload serves both unless rowwise
        device = params[0].device
        self.payloads = {
            f: Payload(torch.zeros(n * (hi - lo), dtype=torch.uint8, device=device))
            for f in self.forms
        }
        for payload in self.payloads.values():
            resize_storage(payload.full, 0)
        offset = 0
        for p in params:
            linears[id(p)].fp8_weight = GatheredWeight(self, id(p), offset, tuple(p.shape))
            offset += p.numel()

    def payload(self, form: str) -> Payload:
        return self.payloads[form if form in self.payloads else "forward"]

    def stale(self) -> None:
        """The shards changed (a step, a load): cast again at the next gather."""
        for payload in self.payloads.values():
            payload.shard, payload.scales = None, {}

    @torch.no_grad()
    def shard(self, form: str, master: torch.Tensor, group) -> torch.Tensor:
        """This rank's 1-byte cast of its range (`master`), cast now if stale."""
        payload = self.payloads[form]
        if payload.shard is None:
            payload.shard, payload.scales = self.cast_shard(form, master, group)
        return payload.shard

    def cast_shard(self, form: str, master: torch.Tensor, group):
        """(this rank's 1-byte cast of its range `master`, each weight's inverse scales), the
        amax shared over `group` and tp (`_shared`)."""
        (values,) = autocast_operands(master)  # the dtype the linear would cast W to
        amax = self._shared(self.local_amax(form, values), form, group)
        return self.cast(form, values, amax)

    def _pieces(self, form: str, device) -> list[tuple[int, int, torch.Tensor]]:
        """Each weight's owned elements: (lo, hi) in this rank's range, their scales' index."""
        pieces, offset, base = [], 0, 0
        for p in self.params:
            a, b = max(self.lo, offset), min(self.hi, offset + p.numel())
            cast = self.casts[id(p)][form]
            if a < b:
                flat = torch.arange(a - offset, b - offset, device=device)
                pieces.append((a - self.lo, b - self.lo, base + cast.scale_index(flat)))
            offset, base = offset + p.numel(), base + cast.n_scales
        return pieces

    def local_amax(self, form: str, values: torch.Tensor) -> torch.Tensor:
        """The amax of this rank's elements of every scale of the bucket's weights (zeros
        where it holds none: |x| >= 0 leaves the MAX to the others)."""
        n = sum(self.casts[id(p)][form].n_scales for p in self.params)
        amax = torch.zeros(n, dtype=torch.float32, device=values.device)
        for lo, hi, index in self._pieces(form, values.device):
            amax.scatter_reduce_(0, index, values[lo:hi].detach().abs().float(), "amax")
        return amax

    def cast(self, form: str, values: torch.Tensor, amax: torch.Tensor):
        """(this rank's 1-byte payload, {id(weight): {form: inverse scale}}) from the shared
        amax: each element cast with its own scale, as fp8_scaling.quantize casts it."""
        scale = amax_to_scale(amax, E4M3)
        out = torch.zeros(self.hi - self.lo, dtype=torch.uint8, device=values.device)
        for lo, hi, index in self._pieces(form, values.device):
            out[lo:hi] = to_fp8(values[lo:hi].float() * scale[index], E4M3).view(torch.uint8)
        inv, scales, base = scale.reciprocal(), {}, 0
        served = [f for f in FORMS if self.payload(f) is self.payloads[form]]
        for p in self.params:
            casts = self.casts[id(p)]
            span = inv[base : base + casts[form].n_scales]
            scales[id(p)] = {f: casts[f].shaped(span) for f in served}
            base += casts[form].n_scales
        return out, scales

    def _shared(self, amax: torch.Tensor, form: str, group) -> torch.Tensor:
        """The amax vector's MAX over the shard group, then each weight's entries over the tp
        groups that split its scales' extent (fp8_scaling._max_over's order: rows, then cols)."""
        if _split(group):
            amax = C.all_reduce(amax, group, op=dist.ReduceOp.MAX)
        spans, base = {}, 0
        for p in self.params:
            cast = self.casts[id(p)][form]
            if cast.groups:
                spans.setdefault(cast.groups, []).append((base, base + cast.n_scales))
            base += cast.n_scales
        for groups, ranges in spans.items():
            index = torch.cat([torch.arange(a, b, device=amax.device) for a, b in ranges])
            sub = amax[index]
            for g in groups:
                sub = C.all_reduce(sub, g, op=dist.ReduceOp.MAX)
            amax[index] = sub
        return amax


@dataclass(eq=False)
class GatheredWeight:
    """A linear's weight as zero=3 gathered it in FP8 (the linear's `fp8_weight`): the
    (e4m3 operand, inverse scale) pairs its forward and its input grad multiply with."""

    bucket: Fp8Bucket
    key: int  # id of the weight
    offset: int  # in the bucket's flat index space
    shape: tuple[int, int]

    def operand(self, form: str) -> tuple[torch.Tensor, torch.Tensor]:
        """forward: (W as e4m3 (R, C), its scales); dgrad: (Wᵀ (C, R), its scales)."""
        payload = self.bucket.payload(form)
        n = self.shape[0] * self.shape[1]
        q = payload.full[self.offset : self.offset + n].view(E4M3).view(self.shape)
        return (q if form == "forward" else q.t()), payload.scales[self.key][form]


class Fp8Gathers:
    """A Zero3Reducer's FP8 gather units: the reducer's gather units are its buckets' high-
    precision buffers (0 .. B-1, whole weights), then one per (FP8 bucket, form) (B ..)."""

    def __init__(self, reducer) -> None:
        linears = fp8_linears(reducer.model)
        self.n = len(reducer.buckets)
        self.units: list[tuple[int, Fp8Bucket, str]] = []
        self.of: dict[tuple[int, str], int] = {}
        for i, bucket in enumerate(reducer.buckets):
            if id(bucket.params[0]) not in linears:
                continue
            lo, hi = reducer.shard_range(bucket)
            cast = Fp8Bucket(bucket.params, linears, lo, hi, reducer.size_of(bucket))
            for form in cast.forms:
                self.of[(i, form)] = self.n + len(self.units)
                self.units.append((i, cast, form))

    def buffers(self) -> list[torch.Tensor]:
        """The units' gathered uint8 buffers, in unit order."""
        return [cast.payloads[form].full for _, cast, form in self.units]

    def map(self, buckets: list[int], form: str) -> list[int]:
        """The units a pass of `form` gathers for `buckets`: an FP8 bucket's payload for that
        form (its one payload unless rowwise), any other bucket's own buffer."""
        return [self.of.get((i, form), self.of.get((i, "forward"), i)) for i in buckets]

    def bucket(self, unit: int) -> int:
        return unit if unit < self.n else self.units[unit - self.n][0]

    def source(self, unit: int, master: torch.Tensor, group) -> torch.Tensor:
        """What unit `unit` gathers from: the bucket's master shard, or its 1-byte cast."""
        if unit < self.n:
            return master
        _, cast, form = self.units[unit - self.n]
        return cast.shard(form, master, group)

    def stale(self) -> None:
        for _, cast, _ in self.units:
            cast.stale()
