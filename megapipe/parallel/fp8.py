"""FP8 linears (`train.fp8`): e4m3 activations and weights forward, e5m2 output grads backward,
current (just-in-time) scaling, as NVIDIA's H100 recipes and torchao's float8 training do.

`Fp8.of(train, cp)` is the policy, resolved once (pipeline/stages.py Components) and applied to
a built chunk (`apply`, as torchtitan applies torchao's Float8 converter to a built model): each
tp linear (models' QKV, attention out, MLP) outside `train.fp8_keep_bf16` gets an `Fp8Linear`,
which its `_linear` asks, and the routed experts an `Fp8Experts` (parallel/fp8_experts.py:
scales per expert, their rows cast per source microbatch). Recipes:

- `tensorwise`: one scale per tensor; `rowwise`: one per row of each matmul operand (per token,
  per output or input channel); both through torch._scaled_mm (_torch_compat.scaled_mm).
- `blockwise`: DeepSeek-V3 §3.3.2's 1 x 128 tiles of activations and grads and 128 x 128
  blocks of weights. No torch kernel takes these scales, so it is emulated: quantize per block,
  dequantize, matmul in float32 (what the numerics are; not the speed).

Each of the three matmuls quantizes its two operands with scales along its non-contracted dim
(fp8_scaling.py), so a forward's y = x Wᵀ, a backward's grad_x = g W and grad_W = gᵀ x each see
the operands cast for their own contraction. Exact under parallelism: the amax of a scale is
shared (MAX) over the groups that split its elements: tp for the features a column or row linear
splits, cp for the tokens of a sequence. Inside the linear the tokens are whole over tp (SP
gathers before the column linear and after the row linear's backward) and dp ranks hold whole
rows, so every mesh casts as one process does with the same microbatch rows.

A weight is cast once a step: the policy's `WeightCasts` (fp8_weight_cache.py) keeps W's cast
(and Wᵀ's, where the recipe needs its own) from the step's first microbatch to its end, as
Transformer Engine reuses its weight casts over a step's microbatches; the bits are those every
microbatch would make.

Zero Bubble's deferred W keeps the FP8 operands, quantized in B: half the bytes of bf16 ones
kept to W (the saving Transformer Engine's saved FP8 inputs make), and W then runs no amax
collective, so it stays free of communication wherever the schedule puts it. The result is the
same as quantizing in W. Weights, their grads and the optimizer stay high precision: the casts
are made afresh each step, so checkpoints hold no FP8 state.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from megapipe.parallel.autograd.weight_grad import (
    accumulate,
    autocast_operands,
    keep_input,
    kept_input,
)
from megapipe.parallel.fp8_experts import Fp8Experts
from megapipe.parallel.fp8_scaling import (
    E4M3,
    E5M2,
    Groups,
    amax_of,
    fp8_matmul,
    quantize,
    quantize_with,
)
from megapipe.parallel.fp8_weight_cache import WeightCasts
from megapipe.parallel.precision import weight_grad_landed

RECIPES = ("none", "tensorwise", "rowwise", "blockwise")
EMULATED = ("blockwise",)  # no torch kernel takes its scales: quantize, dequantize, float32 mm
# (activation and grad, weight) granularity of each recipe (fp8_scaling.GRANULARITIES)
GRANULARITY = {
    "tensorwise": ("tensorwise", "tensorwise"),
    "rowwise": ("rowwise", "rowwise"),
    "blockwise": ("tile", "block"),
}


def describe(recipe: str) -> str:
    """One line on what `recipe` runs: the dry run prints it, and an emulated one warns it."""
    how = (
        "emulated: cast per block, dequantized, float32 matmul"
        if recipe in EMULATED
        else ("torch._scaled_mm")
    )
    act, wgt = GRANULARITY[recipe]
    return (
        f"train.fp8={recipe}: the linears' matmuls in FP8 (e4m3 forward, e5m2 grads; scales per "
        f"{act} of activations and grads, per {wgt} of weights), {how}"
    )


@dataclass(frozen=True)
class Fp8Linear:
    """One linear's FP8 matmuls: the recipe and the groups splitting its operands (`tokens`: cp,
    and tp for a linear whole on every tp rank under SP; `ins`, `outs`: tp where the linear
    splits its input or output features); `casts`: the policy's once-a-step weight casts."""

    recipe: str
    tokens: tuple = ()
    ins: tuple = ()
    outs: tuple = ()
    casts: WeightCasts | None = field(default=None, compare=False, repr=False)

    @property
    def granularity(self) -> tuple[str, str]:
        return GRANULARITY[self.recipe]

    def linear(self, x, weight, bias, owner: nn.Module) -> torch.Tensor:
        """y = x Wᵀ + b through FP8 matmuls; the weight grad now or queued on `owner`."""
        return _Fp8Linear.apply(x, weight, bias, owner, self)

    def forward(self, x2, qw) -> torch.Tensor:
        """x Wᵀ from W's cast `qw` (weight_cast)."""
        return self.matmul(self.quantized_input(x2), qw)  # (N, out)

    def quantized_input(self, x2) -> tuple:
        """The input (N, in) cast for the forward's contraction over the input features."""
        return quantize(x2, E4M3, self.granularity[0], Groups(self.tokens, self.ins))

    def input_grad(self, g2, qw_t) -> torch.Tensor:
        """g W from Wᵀ's cast `qw_t` (weight_cast)."""
        return self.matmul(self.quantized_grad(g2), qw_t)  # (N, in)

    def quantized_grad(self, g2) -> tuple:
        """The output grad (N, out) cast for grad_x's contraction over the output features."""
        return quantize(g2, E5M2, self.granularity[0], Groups(self.tokens, self.outs))

    def matmul(self, a, w) -> torch.Tensor:
        """a · wᵀ, float32, from an activation-like and a weight-like quantized operand."""
        return fp8_matmul(a, w, *self.granularity)

    def piece_caster(self, local2, dtype, cols: tuple, split) -> Callable:
        """Casts each row piece of the tensor a tp ring gathers from every rank's `local2` (rows
        split over `split`; `cols`: the groups splitting its columns) exactly as the gathered
        whole would be cast (parallel/fp8_overlap.py): a tensorwise scale from one amax shared
        over the pieces' ranks, taken here before the ring; row-local scales (rowwise, tiles)
        from each piece's own rows."""
        act, _ = self.granularity
        if act == "tensorwise":
            amax = amax_of(local2, act, Groups(self.tokens + (split,), cols))
            return lambda piece: quantize_with(piece, dtype, act, amax)
        return lambda piece: quantize(piece, dtype, act, Groups(self.tokens, cols))

    def weight_operand(self, weight, form: str, param=None, dtype=None) -> tuple:
        """W cast for the forward (`form` "forward") or Wᵀ for the input grad ("dgrad"), kept
        over the step where the policy's casts are open (fp8_weight_cache.py); `dtype`: the
        one `weight` is cast to first where a cast is made (autocast's, weight_cast)."""

        def cast(f):
            return self._cast_weight(weight if dtype is None else weight.to(dtype), f)

        if self.casts is None or param is None:
            return cast(form)
        return self.casts.operand(param, form, self.granularity[1], cast)

    def _cast_weight(self, weight, form: str) -> tuple:
        _, wgt = self.granularity
        if form == "forward":
            return quantize(weight, E4M3, wgt, Groups(self.outs, self.ins))
        return quantize(weight.t(), E4M3, wgt, Groups(self.ins, self.outs))

    def weight_grad_operands(self, x2, g2, qx=None, qg=None) -> tuple:
        """grad_W's operands quantized for a contraction over tokens: (gᵀ, xᵀ) with scales;
        `qx`, `qg`: x or g already cast with one tensorwise scale (the tp ring's FP8
        payloads, fp8_overlap.py), whose transpose is xᵀ's or gᵀ's cast."""
        act, _ = self.granularity
        if qg is None:
            qg = quantize(g2.t(), E5M2, act, Groups(self.outs, self.tokens))
        else:
            qg = (qg[0].t(), qg[1])
        if qx is not None:
            return qg, (qx[0].t(), qx[1])
        return qg, quantize(x2.t(), E4M3, act, Groups(self.ins, self.tokens))

    def weight_grad(self, operands) -> torch.Tensor:
        act, _ = self.granularity
        return fp8_matmul(operands[0], operands[1], act, act)  # (out, in), float32


class _Fp8Linear(torch.autograd.Function):
    """y = x Wᵀ + b in FP8 (Fp8Linear); backward: grad_x and grad_b now, grad_W now or, under a
    Zero Bubble B key, its quantized operands queued for W (module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias, owner, fp8):
        x, weight, bias = fp8_operands(ctx, x, weight, bias, owner, fp8)
        # the parameter, not autocast's copy (weight_cast); under SP the input's shard
        ctx.save_for_backward(keep_input(ctx, x, owner), ctx.param)
        x2 = x.reshape(-1, x.shape[-1])  # (N, in)
        y = fp8.forward(x2, weight_cast(ctx, weight, "forward"))
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        saved, weight = ctx.saved_tensors
        gathered = kept_input(ctx, saved)  # under SP gathered again beside grad_x's matmul
        fp8, owner = ctx.fp8, ctx.owner
        g2 = grad_out.reshape(-1, grad_out.shape[-1])  # (N, out)
        qw_t = weight_cast(ctx, weight, "dgrad")
        grad_x = fp8.input_grad(g2, qw_t).to(ctx.in_dtype).reshape(*grad_out.shape[:-1], -1)
        grad_b = g2.sum(0).to(ctx.w_dtype) if ctx.has_bias else None
        x2 = gathered().flatten(0, -2)  # (N, in)
        grad_w = weight_grad_or_queue(owner, fp8.weight_grad_operands(x2, g2))
        return grad_x, grad_w, grad_b, None, None


def fp8_operands(ctx, x, weight, bias, owner: nn.Module, fp8: Fp8Linear) -> tuple:
    """(x, W, b) in autocast's dtype, and on `ctx` what an FP8 linear's backward reads: its
    owner, policy, the input's dtype, zero=3's gathered FP8 W (then W's storage is never read),
    W's compute dtype and the parameter keying the step's casts (fp8_weight_cache.py)."""
    in_dtype, param = x.dtype, weight
    gathered = getattr(owner, "fp8_weight", None)
    x, cast, bias = autocast_operands(x, None if gathered else weight, bias)
    weight = weight if cast is None else cast
    ctx.owner, ctx.fp8, ctx.has_bias, ctx.in_dtype = owner, fp8, bias is not None, in_dtype
    ctx.gathered, ctx.w_dtype = gathered, _cast_dtype(weight) if gathered else weight.dtype
    ctx.param = param
    return x, weight, bias


def weight_cast(ctx, weight, form: str) -> tuple:
    """W cast for the forward (`form` "forward") or Wᵀ for grad_x ("dgrad"): zero=3's gathered
    cast, else the step's (Fp8Linear.weight_operand); `ctx` as fp8_operands set it. `weight`:
    autocast's copy in the forward; in backward the parameter the linear saved (a copy kept
    per microbatch in flight would hold its stage's weights again), cast to the compute dtype
    again only where a cast is made from it (the step's dgrad cast, made once)."""
    gathered = ctx.gathered and ctx.gathered.operand(form)
    return gathered or ctx.fp8.weight_operand(weight, form, ctx.param, ctx.w_dtype)


def weight_grad_or_queue(owner: nn.Module, operands) -> torch.Tensor | None:
    """grad_W now (finish_weight_grad), or under a Zero Bubble B key its quantized operands
    queued for W (the FP8 operands kept, not x and g): then None."""
    key = owner.wgrad_queue.key
    if key is not None:
        owner.wgrad_queue.setdefault(key, []).append((operands,))  # run_weight_grads: not 2
        return None
    return finish_weight_grad(owner, operands)


def _cast_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype autocast would give `weight`, read without touching its (freed) storage."""
    (probe,) = autocast_operands(torch.empty(0, dtype=weight.dtype, device=weight.device))
    return probe.dtype


def finish_weight_grad(owner: nn.Module, operands) -> torch.Tensor | None:
    """grad_W from its quantized operands: into the float32 main grad under bf16 weights (then
    None), else returned in the weight's dtype. The W action calls it through the linear's
    `deferred_weight_grad` (parallel/autograd/weight_grad.run_weight_grads)."""
    return weight_grad_landed(owner.weight, owner.fp8.weight_grad(operands))


def deferred_weight_grad(owner: nn.Module, operands) -> None:
    """W: the queued FP8 operands' weight grad accumulated into the weight's grad."""
    grad = finish_weight_grad(owner, operands)
    if grad is not None:
        accumulate(owner.weight, grad)


@dataclass(frozen=True)
class Fp8:
    """The FP8 policy: `recipe` (train.fp8), the linears kept in high precision (`keep`: module
    name parts, train.fp8_keep_bf16), the cp group that splits the tokens, and the weight casts
    kept over a step (`casts`, fp8_weight_cache.py; the engines open its `step()`)."""

    recipe: str = "none"
    keep: tuple[str, ...] = ()
    cp_group: object = None
    casts: WeightCasts = field(default_factory=WeightCasts, compare=False, repr=False)

    @staticmethod
    def of(train, cp, cache_weights: bool = True) -> Fp8:
        """The policy of the config's `train` section on this rank's cp axis (CPInfo);
        `cache_weights` False casts each weight at each use (a benchmark's baseline)."""
        group = cp.group if cp.size > 1 else None
        keep = tuple(k.strip() for k in train.fp8_keep_bf16.split(",") if k.strip())
        return Fp8(train.fp8, keep, group, WeightCasts(cache_weights))

    @property
    def on(self) -> bool:
        return self.recipe != "none"

    def step(self):
        """Within: one step's forwards and backwards, no weight changing; each FP8 weight is
        cast at its first use and the cast reused (fp8_weight_cache.py), dropped at the end."""
        return self.casts.step()

    def kept(self, name: str) -> bool:
        return any(part in self.keep for part in name.split("."))

    def apply(self, model: nn.Module) -> nn.Module:
        """`model` with an Fp8Linear on each tp linear not kept and an Fp8Experts on the routed
        experts not kept (none: left as it is)."""
        if not self.on:
            return model
        if self.recipe in EMULATED:
            warnings.warn(describe(self.recipe), stacklevel=2)
        tokens = (self.cp_group,) if self.cp_group is not None else ()
        for name, module in model.named_modules():
            if hasattr(module, "fp8_experts") and not self.kept(name):  # models/moe.Experts
                sp = (module.tp.group,) if module.tp.sp else ()  # tp splits tokens under SP
                module.fp8_experts = Fp8Experts(GRANULARITY[self.recipe], tokens + sp)
            splits = getattr(module, "tp_splits", None)
            if splits is None or self.kept(name):
                continue
            module.fp8 = Fp8Linear(self.recipe, *_groups(splits, module.tp, tokens), self.casts)
        return model


def _groups(splits: str, tp, tokens: tuple) -> tuple[tuple, tuple, tuple]:
    """(tokens, ins, outs) of a linear whose features tp splits on side `splits` (`in`, `out`,
    or `none`: latent attention's down projections, whole on every tp rank, models/mla.py).
    Those read the layer's input as it stands: under SP each tp rank's sequence chunk (the
    gather comes after them, in the up projections), so their tokens are split over tp as
    well as cp, and their activation, grad and weight-grad amaxes are shared over both; with
    plain tp their inputs and (f's all-reduced) output grads are whole on every rank, and
    nothing is shared beyond cp."""
    group = (tp.group,) if tp.size > 1 else ()
    if splits == "none":
        return (tokens + group if tp.sp else tokens), (), ()
    return (tokens, group, ()) if splits == "in" else (tokens, (), group)


NO_FP8 = Fp8()
