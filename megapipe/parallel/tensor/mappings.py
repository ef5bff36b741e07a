"""Megatron's f and g operators and their sequence-parallel forms: one autograd.Function each.

Tensor parallelism: Shoeybi et al. 2019, §3 (f: identity fwd / all-reduce bwd at the input of a
column-parallel linear; g: all-reduce fwd / identity bwd at the output of a row-parallel one).
Sequence parallelism: Korthikanti et al. 2022, §4.2.2 (g becomes reduce-scatter along the
sequence, f becomes all-gather along the sequence; each is the other's backward).
Each takes the `TPInfo` of its group explicitly; with tp size 1 every operator is the identity,
which is the single-process model. Activations are (B, T, ...): the sequence dim is 1.
"""

from __future__ import annotations

import torch

from megapipe.distributed import collectives as C
from megapipe.parallel.tensor.sharding import TPInfo

SEQ_DIM = 1


def _split(x: torch.Tensor, dim: int, tp: TPInfo) -> torch.Tensor:
    return x.chunk(tp.size, dim=dim)[tp.rank].contiguous()


class _CopyToTP(torch.autograd.Function):
    """f: identity fwd / all-reduce bwd (input of a column-parallel linear)."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x

    @staticmethod
    def backward(ctx, grad):
        return C.all_reduce(grad.contiguous().clone(), ctx.tp.group), None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce fwd / identity bwd (output of a row-parallel linear)."""

    @staticmethod
    def forward(ctx, x, tp):
        return C.all_reduce(x.contiguous().clone(), tp.group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    """All-gather the last dim fwd / split it bwd (a column linear with gather_output)."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return C.all_gather(x, -1, tp.group)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, -1, ctx.tp), None


class _GatherFromSeq(torch.autograd.Function):
    """SP's f: all-gather the sequence fwd / reduce-scatter it bwd (column-linear input).
    `dtype`: cast to it before the gather (the linear's compute dtype: half a float32 stream's
    bytes, and the cast made on this rank's tokens alone); the grads are summed in the input's
    own dtype, as autograd's cast after the gather would have them, so both ways are bitwise
    those of casting after it."""

    @staticmethod
    def forward(ctx, x, tp, dtype):
        ctx.tp, ctx.in_dtype = tp, x.dtype
        return C.all_gather(x if dtype is None else x.to(dtype), SEQ_DIM, tp.group)

    @staticmethod
    def backward(ctx, grad):
        grad = C.reduce_scatter(grad.to(ctx.in_dtype), SEQ_DIM, ctx.tp.group)
        return grad, None, None


class _ReduceScatterToSeq(torch.autograd.Function):
    """SP's g: reduce-scatter the sequence fwd / all-gather it bwd (row-linear output)."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return C.reduce_scatter(x, SEQ_DIM, tp.group)

    @staticmethod
    def backward(ctx, grad):
        return C.all_gather(grad, SEQ_DIM, ctx.tp.group), None


def copy_to_tp(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    return x if tp.size == 1 else _CopyToTP.apply(x, tp)


def reduce_from_tp(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    return x if tp.size == 1 else _ReduceFromTP.apply(x, tp)


def gather_from_tp(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    return x if tp.size == 1 else _GatherFromTP.apply(x, tp)


def gather_from_seq(x: torch.Tensor, tp: TPInfo, dtype: torch.dtype | None = None) -> torch.Tensor:
    return x if tp.size == 1 else _GatherFromSeq.apply(x, tp, dtype)


def reduce_scatter_to_seq(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    return x if tp.size == 1 else _ReduceScatterToSeq.apply(x, tp)


def enter_column(x: torch.Tensor, tp: TPInfo, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The input of a column-parallel region: SP's all-gather (in `dtype`, where given:
    _GatherFromSeq), else f."""
    return gather_from_seq(x, tp, dtype) if tp.sp else copy_to_tp(x, tp)


def exit_row(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    """The output of a row-parallel region: SP's reduce-scatter, else g."""
    return reduce_scatter_to_seq(x, tp) if tp.sp else reduce_from_tp(x, tp)
