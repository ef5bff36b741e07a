"""An element-wise function that keeps only its inputs for backward and runs again there.

A norm computed in float32 on a bf16 stream, as RMSNorm (Zhang & Sennrich 2019) and autocast's
LayerNorm are, leaves autograd holding a float32 copy of its input and its float32 statistics,
and the product with the gain holds the normalised x as well: 6 bytes an element beside the
2-byte input for RMSNorm. Transformer Engine's fused norms keep the input and the statistics
and derive the rest in backward (Korthikanti et al. 2022, §4.2 count the norm's input alone).
Here the norm keeps its input, in the stream's dtype, and its backward reruns the same forward
with autograd on: the same kernels on the same values, so the grads are bitwise those of the
plain graph, for one more element-wise pass (memory-bound, a read of x and a write of x̂).

Inside torch.compile the plain graph is traced instead: inductor's partitioner chooses what to
keep and what to recompute for the whole layer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def _as_is(t: torch.Tensor) -> torch.Tensor:
    return t


class _RerunInBackward(torch.autograd.Function):
    """fn(*tensors), saving the tensors alone; backward reruns fn under the forward's
    autocast state and differentiates that."""

    @staticmethod
    def forward(ctx, fn, *tensors):
        device = tensors[0].device.type
        ctx.fn = fn
        ctx.autocast = (device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device))
        ctx.save_for_backward(*tensors)
        return fn(*tensors)

    @staticmethod
    def backward(ctx, grad):
        needs = ctx.needs_input_grad[1:]
        inputs = [t.detach().requires_grad_(n) for t, n in zip(ctx.saved_tensors, needs)]
        device, dtype, enabled = ctx.autocast
        # the rerun's graph lives for this backward alone: what it saves stays as it is, not
        # handed to the step's saved-tensor hooks (activation offload would move it to host)
        private = torch.autograd.graph.saved_tensors_hooks(_as_is, _as_is)
        with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled), private:
            out = ctx.fn(*inputs)
        wanted = [t for t in inputs if t.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, grad))
        return (None, *(next(grads) if t.requires_grad else None for t in inputs))


def rerun_in_backward(fn: Callable[..., torch.Tensor], *tensors: torch.Tensor) -> torch.Tensor:
    """fn(*tensors), one tensor out, keeping only `tensors` for backward (module docstring);
    the plain graph where nothing is recorded or inside torch.compile."""
    if not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return fn(*tensors)
    return _RerunInBackward.apply(fn, *tensors)
