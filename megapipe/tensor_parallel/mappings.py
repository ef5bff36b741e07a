"""Megatron's f and g operators (Shoeybi et al. 2019, §3): one autograd.Function per collective.

Each takes the `TPInfo` of its group explicitly; with tp size 1 every operator is the identity,
which is the single-process model.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megapipe.tensor_parallel.sharding import TPInfo


def _all_reduce(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    x = x.contiguous()
    dist.all_reduce(x, group=tp.group)
    return x


def _split_last(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    return x.chunk(tp.size, dim=-1)[tp.rank].contiguous()


def _gather_last(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(tp.size)]
    dist.all_gather(parts, x.contiguous(), group=tp.group)
    return torch.cat(parts, dim=-1)


class _CopyToTP(torch.autograd.Function):
    """f: identity forward / all-reduce backward (input of a column-parallel linear)."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.tp), None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward / identity backward (output of a row-parallel linear)."""

    @staticmethod
    def forward(ctx, x, tp):
        return _all_reduce(x.clone(), tp)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    """All-gather the last dim forward / split it backward."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return _gather_last(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.tp), None


def copy_to_tp(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    return x if tp.size == 1 else _CopyToTP.apply(x, tp)


def reduce_from_tp(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    return x if tp.size == 1 else _ReduceFromTP.apply(x, tp)


def gather_from_tp(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    return x if tp.size == 1 else _GatherFromTP.apply(x, tp)
