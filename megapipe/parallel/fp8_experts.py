"""The routed experts' matmuls in FP8 (`train.fp8`), with the dense linears' recipe semantics
(parallel/fp8.py): e4m3 activations and weights forward, e5m2 output grads backward, current
scaling, each matmul's operands cast for its own contraction (fp8_scaling.py).

The stacked weight (E, out, in) is E tensors: each expert's weight gets its own scales, one per
expert under tensorwise (what Transformer Engine's GroupedLinear and torchao's grouped FP8
MoE training do: a scale per expert's GEMM), per row or per 128 x 128 block of it otherwise.
An expert's weight is whole on its ep rank and on every tp rank (models/moe.py), so its amax
needs no group.

Its input rows are the tokens routed to it, and the one process quantizes them per microbatch.
Under ep an expert takes, in one matmul, the rows of every ep rank of its group: each is the
same microbatch index on another dp rank, so another of the one process's microbatches
(parallel/expert/all_to_all.py: grouped by expert, then by source in ep order). Its rows are
therefore cut into parts, one per (expert, source), and each part is cast with scales of its own
(fp8_scaling.quantize_parts): sharing an amax over the ep group would cast with the max over
several of the one process's microbatches. The groups that split a source's microbatch tokens
(cp, and tp under sequence parallelism: each tp rank routes its chunk of tokens) do share the
amax, MAX over them per part, so that a part's scale is made from all of that microbatch's rows
routed to the expert. Rowwise forward scales are per token and need no group. Blockwise's
1 x 128 token tiles of the weight grad's operands start at each part's first row; with the
tokens split over cp or tp the one process's tiles would span the splits, so that mesh casts
differently there (config/fp8_checks.py).

Zero Bubble's deferred W keeps the quantized operands, as the dense path does (parallel/fp8.py).
Torch's grouped FP8 kernel (`torch._scaled_grouped_mm`) is CUDA-only and takes one scale set
per call, so the parts run as a loop of `fp8_matmul`s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megapipe.parallel.autograd.grouped_linear import bias_grad
from megapipe.parallel.autograd.weight_grad import accumulate, autocast_operands
from megapipe.parallel.fp8_scaling import E4M3, E5M2, Groups, fp8_matmul, quantize, quantize_parts
from megapipe.parallel.precision import weight_grad_landed

# torch._scaled_mm's CUDA kernels take a contraction in whole 16s: the weight grad's, over a
# part's tokens, is padded to it (torchao's grouped FP8 MoE pads its token groups to 16 too)
ALIGN = 16
KERNEL = ("tensorwise", "rowwise")  # parallel/fp8_scaling.fp8_matmul's torch._scaled_mm path


@dataclass(frozen=True)
class Fp8Experts:
    """The experts' FP8 matmuls: (activation, weight) `granularity` (parallel/fp8.GRANULARITY)
    and the groups splitting a microbatch's tokens (`tokens`: cp, tp under SP)."""

    granularity: tuple[str, str]
    tokens: tuple = ()

    def _weights(self, weight, transposed: bool) -> list:
        wgt = self.granularity[1]
        return [quantize(w.t() if transposed else w, E4M3, wgt) for w in weight]

    def _products(self, a, weight, parts, transposed: bool, dtype) -> torch.Tensor:
        """Each part of rows `a` (N, k) times its expert's (cast) weight: (N, out) float32."""
        act, wgt = self.granularity
        per = len(parts) // weight.shape[0]  # sources per expert
        qa = quantize_parts(a.split(parts), dtype, act, Groups(self.tokens, ()))
        qw = self._weights(weight, transposed)
        width = weight.shape[2 if transposed else 1]
        empty = a.new_zeros(0, width, dtype=torch.float32)
        outs = [fp8_matmul(q, qw[i // per], act, wgt) if n else empty for i, (q, n) in
                enumerate(zip(qa, parts, strict=True))]  # fmt: skip
        return torch.cat(outs) if outs else empty

    def forward(self, x, weight, parts) -> torch.Tensor:
        return self._products(x, weight, parts, False, E4M3)  # (N, out)

    def input_grad(self, g, weight, parts) -> torch.Tensor:
        return self._products(g, weight, parts, True, E5M2)  # (N, in)

    def weight_grad_operands(self, x, g, parts, n_experts: int, align: int | None = None) -> tuple:
        """Each part's (gᵀ, xᵀ) cast for a contraction over its tokens; the grad's shape, device.
        `align`: the tokens zero-padded to a multiple (default: ALIGN on CUDA's kernel path)."""
        act = self.granularity[0]
        if align is None:
            align = ALIGN if x.device.type == "cuda" and act in KERNEL else 1
        groups = Groups((), self.tokens)
        qg = quantize_parts([_pad(p.t(), align) for p in g.split(parts)], E5M2, act, groups)
        qx = quantize_parts([_pad(p.t(), align) for p in x.split(parts)], E4M3, act, groups)
        shape = (n_experts, g.shape[1], x.shape[1])
        return list(zip(qg, qx, parts, strict=True)), shape, x.device

    def weight_grad(self, operands) -> torch.Tensor:
        """(E, out, in) float32: each expert's Σ over its parts of gᵀ x."""
        act = self.granularity[0]
        pairs, shape, device = operands
        per = len(pairs) // shape[0]
        grad = torch.zeros(shape, device=device)
        for i, (qg, qx, n) in enumerate(pairs):
            if n:
                grad[i // per] += fp8_matmul(qg, qx, act, act)
        return grad


def _pad(t: torch.Tensor, align: int) -> torch.Tensor:
    """(features, n) with zero columns up to a multiple of `align` (zeros move no amax and add
    nothing to a product)."""
    extra = -t.shape[1] % align
    return torch.nn.functional.pad(t, (0, extra)) if extra else t


class _Fp8GroupedLinear(torch.autograd.Function):
    """grouped_linear's y[g] = x[g] W[e]ᵀ + b[e] (parallel/autograd/grouped_linear.py) in FP8
    (Fp8Experts); backward: grad_x and the bias grads now, the stacked weight grad now or, under
    a Zero Bubble B key, its quantized operands queued for W."""

    @staticmethod
    def forward(ctx, x, weight, bias, parts, owner, name, bias_name):
        in_dtype, param = x.dtype, weight
        x, weight, bias = autocast_operands(x, weight, bias)
        # the stack itself, not autocast's copy (one per microbatch in flight): cast again in
        # backward, as the high-precision experts do (weight_grad.save_operands)
        ctx.save_for_backward(x, param)
        ctx.parts, ctx.owner, ctx.name, ctx.bias_name = parts, owner, name, bias_name
        ctx.has_bias, ctx.in_dtype, ctx.w_dtype = bias is not None, in_dtype, weight.dtype
        y = owner.fp8_experts.forward(x, weight, parts)  # (N, out) float32
        if bias is not None:  # each row its expert's bias, in float32
            rows = torch.tensor(_per_expert(parts, weight.shape[0]), device=x.device)
            y = y + bias.float().repeat_interleave(rows, dim=0, output_size=x.shape[0])
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        owner, parts, fp8, n = ctx.owner, ctx.parts, ctx.owner.fp8_experts, weight.shape[0]
        g = grad_out.contiguous()
        # the stack cast again, freed before the weight grad is made
        grad_x = fp8.input_grad(g, weight.to(ctx.w_dtype), parts).to(ctx.in_dtype)
        grad_b = None
        if ctx.has_bias:
            groups = g.split(_per_expert(parts, n))
            grad_b = bias_grad(getattr(owner, ctx.bias_name), groups)
        operands = fp8.weight_grad_operands(x, g, parts, n)
        key = owner.wgrad_queue.key
        if key is not None:  # W later: the FP8 operands kept, not x and g
            owner.wgrad_queue.setdefault(key, []).append((ctx.name, operands, parts))
            return grad_x, None, grad_b, None, None, None, None
        grad_w = finish_weight_grad(getattr(owner, ctx.name), fp8, operands)
        return grad_x, grad_w, grad_b, None, None, None, None


def _per_expert(parts, n_experts: int) -> list[int]:
    """Rows per expert from rows per (expert, source) part."""
    per = len(parts) // n_experts
    return [sum(parts[e * per : (e + 1) * per]) for e in range(n_experts)]


def finish_weight_grad(param, fp8: Fp8Experts, operands) -> torch.Tensor | None:
    """The stacked weight grad from its quantized operands: into the float32 main grad under
    bf16 weights (then None), else returned in the weight's dtype."""
    return weight_grad_landed(param, fp8.weight_grad(operands))


def deferred_weight_grad(owner, name: str, operands) -> None:
    """W: the queued FP8 operands' stacked weight grad accumulated into `owner.<name>`."""
    param = getattr(owner, name)
    grad = finish_weight_grad(param, owner.fp8_experts, operands)
    if grad is not None:
        accumulate(param, grad)


def fp8_grouped_linear(x, weight, bias, parts, owner, name: str, bias_name=None) -> torch.Tensor:
    """grouped_linear in FP8: rows `x` (N, in) in `parts` (rows per expert and source, expert
    major) through `owner.fp8_experts` (module docstring)."""
    return _Fp8GroupedLinear.apply(x, weight, bias, tuple(parts), owner, name, bias_name)
