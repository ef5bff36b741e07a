"""The MLPs' activations (config/archs.Arch.mlp): SwiGLU, squared ReLU, and GPT-2's tanh GeLU
(Hendrycks & Gimpel 2016, eq. for the tanh approximation), the last computed as x·σ(2u) on
the CPU.

gelu(x) = ½·x·(1 + tanh u), u = √(2/π)·(x + 0.044715·x³), and ½·(1 + tanh u) = σ(2u) exactly, so
gelu(x) = x·σ(z) with z = 2√(2/π)·x·(1 + 0.044715·x²). The same function; only the rounding
differs (≤ 5e-7 absolute over N(0, 1) inputs). Why: this build's vectorized tanh is slow on the
CPU (aten's tanh GeLU ran ~5× slower than its sigmoid over the same 2M floats), and:

- eager, CPU: the forward is four passes (addcmul, mul, sigmoid, mul), 1.7-2× faster than
  aten's tanh GeLU; the backward stays aten's `gelu_backward` (the sigmoid form's backward is
  more passes than it saves); docs/benchmarks/2026-11-24-train-throughput-cpu.md timed both.
- compiled blocks: the expression is left to inductor, which fuses it (and its derivative) into
  one loop each, ~2.5× faster than its own tanh lowering forward and backward.
- CUDA (and other dtypes/devices): aten's fused tanh GeLU kernel, which is already one pass.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

_K = 2.0 * math.sqrt(2.0 / math.pi)  # z = _K·x·(1 + _C·x²) = 2u
_C = 0.044715


def _sigmoid_form(x: torch.Tensor) -> torch.Tensor:
    """x·σ(_K·x·(1 + _C·x²)) as one expression (what inductor fuses)."""
    return x * torch.sigmoid(_K * x * (1.0 + _C * x * x))


class _GeluTanhCPU(torch.autograd.Function):
    """Forward x·σ(z) in four in-place-friendly passes; backward aten's tanh gelu_backward."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        k = torch.tensor(_K, dtype=x.dtype)
        z = torch.addcmul(k, x, x, value=_K * _C)  # _K·(1 + _C·x²)
        return z.mul_(x).sigmoid_().mul_(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return torch.ops.aten.gelu_backward(grad, x, approximate="tanh")


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's tanh GeLU (`gelu_new`): x·σ(2u) on the CPU in float32 (module docstring), aten's
    `F.gelu(x, approximate="tanh")` elsewhere."""
    if x.device.type != "cpu" or x.dtype != torch.float32:
        return F.gelu(x, approximate="tanh")
    if torch.compiler.is_compiling():
        return _sigmoid_form(x)
    return _GeluTanhCPU.apply(x)


class _SwiGLU(torch.autograd.Function):
    """silu(gate)·up from fc1's [gate | up] output, keeping that output alone: autograd would
    also keep silu(gate), half as much again (Shazeer 2020's GLU variants; Megatron-Core's
    fused bias_swiglu keeps its input alone too). Backward makes silu(gate) again, straight into
    the up half of the grad, then the gate half in place: the same kernels as autograd's
    (mul, silu_backward), so the grads are bitwise its, with no buffer beyond the grad."""

    @staticmethod
    def forward(ctx, h):
        ctx.save_for_backward(h)
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):
        (h,) = ctx.saved_tensors
        gate, up = h.chunk(2, dim=-1)
        grad_h = torch.empty_like(h)
        grad_gate, grad_up = grad_h.chunk(2, dim=-1)
        torch.ops.aten.silu.out(gate, out=grad_up)
        grad_up.mul_(grad)  # grad · silu(gate)
        torch.mul(grad, up, out=grad_gate)
        torch.ops.aten.silu_backward.grad_input(grad_gate, gate, grad_input=grad_gate)
        return grad_h


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """silu(gate)·up for fc1's output h = [gate | up] (last dim), keeping h alone for backward;
    the plain expression inside torch.compile (inductor fuses it) or without autograd."""
    if not torch.is_grad_enabled() or torch.compiler.is_compiling():
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    return _SwiGLU.apply(h)


class _ReLU2(torch.autograd.Function):
    """relu(h)², keeping relu's output r alone (autograd keeps it too, once). Backward makes
    2·r·grad in one buffer, where autograd's pow and threshold backward make two more of the
    same width: that is the MLP's widest transient in backward (config/memory_backward.py).
    2·r·g rounds as autograd's g·(2·r) does (doubling is exact), and is 0 where h <= 0."""

    @staticmethod
    def forward(ctx, h):
        r = F.relu(h)
        ctx.save_for_backward(r)
        return r * r

    @staticmethod
    def backward(ctx, grad):
        (r,) = ctx.saved_tensors
        return torch.mul(grad, r).mul_(2.0)


def relu2(h: torch.Tensor) -> torch.Tensor:
    """Squared ReLU, relu(h)² (So et al. 2021, Primer; Nemotron-4's MLP), keeping relu's output
    alone; the plain expression inside torch.compile (inductor fuses it) or without autograd."""
    if not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return F.relu(h).square()
    return _ReLU2.apply(h)
