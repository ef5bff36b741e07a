"""Deferred weight gradients for Zero Bubble's B/W split (Qi et al. 2023, §2).

A linear layer's backward is two matmuls: grad_input = grad_out · W (needed upstream now, on the
critical path) and grad_W = grad_outᵀ · x (needed only by the optimizer). `linear` computes both
unless `defer_weight_grads(model, key)` is active: then backward returns grad_input only and
queues (x, grad_out) on the module under `key` (the runtime uses the action's (microbatch,
chunk, segment)); the W action calls `run_weight_grads(model, key)` to do the queued matmuls and
accumulate weight.grad. Under bf16 params (parallel/precision.py) the weight grad is added in
float32 straight into the weight's `main_grad`, in B or in W alike (Megatron's gradient-
accumulation fusion), and backward hands autograd no weight grad. Biases (a sum over tokens,
and hooked: attention zeroes its key-bias grad), norms and embeddings keep computing their small
grads in B.

The active key is held by each linear's own queue (`WeightGradQueue.key`), set for the modules
of the model whose backward runs: state of the objects passed in, not of this module, and not
a context variable, which autograd's backward thread (one per CUDA device) would not see.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from megapipe.parallel.precision import fused_weight_grad, main_grad_arrived


class WeightGradQueue(dict):
    """A linear's weight-grad work deferred to W, {B action key: [(x, grad_out), ...]}, and
    `key`: the B action whose backward runs now, under which backward queues (None: it does
    the weight grad itself)."""

    def __init__(self) -> None:
        super().__init__()
        self.key = None


def _queues(model: nn.Module) -> list[WeightGradQueue]:
    """The weight-grad queues of `model`'s linear layers."""
    found = (getattr(m, "wgrad_queue", None) for m in model.modules())
    return [q for q in found if isinstance(q, WeightGradQueue)]


@contextlib.contextmanager
def defer_weight_grads(model: nn.Module, key):
    """Within: the linear layers of `model` queue their weight-grad work under `key` instead of
    doing it. The key is set on each layer's queue in place (never a module attribute: those
    a compiled graph may guard on)."""
    queues = _queues(model)
    previous = [q.key for q in queues]
    for q in queues:
        q.key = key
    try:
        yield
    finally:
        for q, before in zip(queues, previous, strict=True):
            q.key = before


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype F.linear computes `x` in: autocast's where it is on (bf16 on the GPU path),
    else x's own."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def autocast_operands(*tensors):
    """The tensors in the dtype F.linear would compute in under autocast, else as they are."""
    if not torch.is_autocast_enabled(tensors[0].device.type):
        return tensors
    dtype = compute_dtype(tensors[0])
    return tuple(None if t is None else t.to(dtype) for t in tensors)


def save_operands(ctx, x: torch.Tensor, weight: torch.Tensor, cast: torch.Tensor, owner=None):
    """A linear's saves for backward: its input `x` (under SP only its sequence shard, where
    `owner` has an `input_shard`: keep_input) and its weight as the parameter itself,
    not autocast's `cast` of it (a compute-dtype copy of every linear's weights per
    microbatch in flight), which backward makes again (saved_operands): the bytes of
    one weight's cast per linear's backward, and under ZeRO-3 the parameter's storage is the
    gathered block's, gathered again for the backward (parallel/data/zero3.py)."""
    ctx.save_for_backward(keep_input(ctx, x, owner), weight)
    ctx.compute_dtype = cast.dtype


def saved_operands(ctx) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, the weight in the compute dtype) that save_operands kept."""
    x, weight = ctx.saved_tensors
    return kept_input(ctx, x)(), weight.to(ctx.compute_dtype)


def keep_input(ctx, x: torch.Tensor, owner) -> torch.Tensor:
    """What a linear saves of its input `x`: x, or the sequence shard `owner.input_shard`
    packs of it (parallel/tensor/sharded_input.py), which kept_input gathers again."""
    ctx.input_shard = getattr(owner, "input_shard", None)
    return x if ctx.input_shard is None else ctx.input_shard.pack(x)


def kept_input(ctx, saved: torch.Tensor) -> Callable[[], torch.Tensor]:
    """A function giving the input keep_input saved, whole again: a sequence shard's gather is
    launched now and waited for when it is called, so the caller's input-grad matmul runs
    beside it."""
    shard = getattr(ctx, "input_shard", None)
    return (lambda: saved) if shard is None else shard.unpack(saved)


class _Linear(torch.autograd.Function):
    """y = x Wᵀ + b; backward: grad_x and grad_b now, grad_W now or queued on `owner`."""

    @staticmethod
    def forward(ctx, x, weight, bias, owner):
        x, cast, bias = autocast_operands(x, weight, bias)
        save_operands(ctx, x, weight, cast, owner)
        ctx.owner, ctx.has_bias = owner, bias is not None
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x, cast, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        gathered = kept_input(ctx, x)  # under SP gathered again beside grad_x's matmul
        weight = weight.to(ctx.compute_dtype)
        grad_out = grad_out.to(weight.dtype)
        grad_x = grad_out @ weight  # (..., in)
        grad_b = grad_out.reshape(-1, grad_out.shape[-1]).sum(0) if ctx.has_bias else None
        return grad_x, weight_grad_now_or_later(ctx.owner, gathered(), grad_out), grad_b, None


def weight_grad_now_or_later(owner: nn.Module, x: torch.Tensor, grad_out: torch.Tensor):
    """The weight grad a linear's backward hands autograd: None where it is queued on `owner`
    for a W action (the B action's key is set) or added into the float32 main grad (bf16
    weights); else grad_outᵀ · x. The tp linears' backward (this one and the overlapped ones,
    parallel/tensor/overlap.py) all end here."""
    key = owner.wgrad_queue.key
    if key is not None:  # x's values only: its grad_fn would keep the graph, and the stage's
        # received input and its grad (the leaf AccumulateGrad holds), alive until W
        owner.wgrad_queue.setdefault(key, []).append((x.detach(), grad_out))
        return None
    weight_param = owner.weight
    main = getattr(weight_param, "main_grad", None)
    if main is not None:  # fused into the float32 main grad: no bf16 weight grad
        _into_main(main, x, grad_out)
        main_grad_arrived(weight_param)
        return None
    return _weight_grad(x, grad_out, owner)


def _into_main(main: torch.Tensor, x: torch.Tensor, grad_out: torch.Tensor) -> None:
    x2, g2 = x.reshape(-1, x.shape[-1]), grad_out.reshape(-1, grad_out.shape[-1])
    fused_weight_grad(main, g2, x2)


def _weight_grad(x: torch.Tensor, grad_out: torch.Tensor, owner: nn.Module) -> torch.Tensor:
    """grad_outᵀ · x (out, in); on the CPU, where it is the weight's own dtype, written into
    the buffer `owner` keeps from step to step (`kept_grads`, kept_buffers.py: a fresh one is
    paid in page faults there). Not on CUDA, whose caching allocator already hands back the
    freed grad's block, and not in a compiled block, whose buffers inductor plans. The memory
    model counts a grad per parameter throughout the step either way (config/memory_terms.py)."""
    x2, g2 = x.reshape(-1, x.shape[-1]), grad_out.reshape(-1, grad_out.shape[-1])  # (N, in|out)
    kept = getattr(owner, "kept_grads", None)
    plain = kept is None or g2.device.type != "cpu" or g2.dtype != owner.weight.dtype
    if plain or torch.compiler.is_compiling():
        return g2.t() @ x2
    out = kept.take((g2.shape[1], x2.shape[1]), g2.dtype, g2.device)
    return torch.mm(g2.t(), x2, out=out)


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, owner: nn.Module
) -> torch.Tensor:
    """F.linear whose weight grad can be deferred; `owner` holds the queue (`wgrad_queue`)."""
    return _Linear.apply(x, weight, bias, owner)


@torch.no_grad()
def run_weight_grads(model: nn.Module, key) -> int:
    """W: do the weight-grad work queued under `key` in `model`; returns the matmuls run."""
    done = 0
    for module in model.modules():
        for item in getattr(module, "wgrad_queue", {}).pop(key, []):
            done += 1
            if len(item) != 2:  # a stacked experts' matmul (parallel/autograd/grouped_linear.py)
                module.deferred_weight_grad(*item)
                continue
            x, grad_out = item
            main = getattr(module.weight, "main_grad", None)
            if main is not None:
                _into_main(main, x, grad_out)
            else:
                accumulate(module.weight, _weight_grad(x, grad_out, module))
    return done


def accumulate(param: nn.Parameter, grad: torch.Tensor) -> None:
    grad = grad.to(param.dtype)
    if param.grad is None:
        param.grad = grad
    else:
        param.grad += grad
