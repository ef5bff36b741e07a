"""The experts' matmul: rows grouped by expert, each group times its expert's slice of a stacked
weight (E, out, in), with the weight grad deferrable to a Zero Bubble W action.

`grouped_linear(x, weight, bias, counts, owner, name)` is y[g] = x[g] W[e]ᵀ + b[e] for the
consecutive row groups g of sizes `counts` (one per expert e). Backward makes grad_x and the
bias grads now; the stacked weight grad now, or queued on `owner.wgrad_queue` under the active
B key (parallel/autograd/weight_grad.py) and done by `owner.deferred_weight_grad` when the W
action runs. Under bf16 weights the weight grad goes in float32 straight into the parameter's
`main_grad` (parallel/precision.py), one expert's slice at a time. The groups are a loop of
matmuls (torch's private `_grouped_mm` is not used: docs/moe.md, "The layer").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megapipe.parallel.autograd.weight_grad import autocast_operands
from megapipe.parallel.precision import fused_weight_grad, main_grad_arrived


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, counts, owner, name, bias_name):
        x, weight, bias = autocast_operands(x, weight, bias)
        ctx.save_for_backward(x, weight)
        ctx.counts, ctx.owner, ctx.name, ctx.has_bias = counts, owner, name, bias is not None
        ctx.bias_name = bias_name
        outs = []
        with torch.autocast(x.device.type, enabled=False):
            for e, xe in enumerate(x.split(counts)):
                outs.append(F.linear(xe, weight[e], None if bias is None else bias[e]))
        return torch.cat(outs) if outs else x.new_zeros(0, weight.shape[1])

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_out = grad_out.to(weight.dtype)
        groups = grad_out.split(ctx.counts)
        grad_x = torch.cat([g @ weight[e] for e, g in enumerate(groups)])
        owner = ctx.owner
        grad_b = _bias_grad(getattr(owner, ctx.bias_name), groups) if ctx.has_bias else None
        key = owner.wgrad_queue.key
        if key is not None:
            owner.wgrad_queue.setdefault(key, []).append((ctx.name, x, grad_out, ctx.counts))
            return grad_x, None, grad_b, None, None, None, None
        grad_w = stacked_weight_grad(getattr(owner, ctx.name), x, grad_out, ctx.counts)
        return grad_x, grad_w, grad_b, None, None, None, None


def _bias_grad(param, groups) -> torch.Tensor | None:
    """(E, out) grad of a stacked bias, each expert's rows summed in float32: straight into
    the bias's main grad under bf16 weights (None returned), as parallel/precision.add_bias
    does for the dense row biases (a bf16 sum would round differently per split of rows)."""
    grad = torch.stack([g.float().sum(0) for g in groups])
    main = getattr(param, "main_grad", None)
    if main is None:
        return grad.to(param.dtype)
    main.add_(grad)
    main_grad_arrived(param)
    return None


def stacked_weight_grad(param, x, grad_out, counts) -> torch.Tensor | None:
    """(E, out, in) grad of the stacked weight `param`: each expert's g_eᵀ x_e. Under bf16
    weights it is added into `param.main_grad` instead, and None returned."""
    main = getattr(param, "main_grad", None)
    pairs = zip(grad_out.split(counts), x.split(counts))
    if main is not None:
        for e, (g, xe) in enumerate(pairs):
            fused_weight_grad(main[e], g, xe)
        main_grad_arrived(param)
        return None
    return torch.stack([g.t() @ xe for g, xe in pairs])


def grouped_linear(
    x, weight, bias, counts: list[int], owner, name: str, bias_name: str | None = None
) -> torch.Tensor:
    """Rows `x` (N, in) grouped by expert (`counts`), each group times its expert's weight
    `owner.<name>` plus its bias `owner.<bias_name>`."""
    return _GroupedLinear.apply(x, weight, bias, tuple(counts), owner, name, bias_name)
