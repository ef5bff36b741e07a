"""Rows across the ep ranks by all-to-all, differentiable both ways (dispatch and combine, ep > 1).

GShard (Lepikhin et al. 2020, §2.2) and Megatron-Core's `MoEAlltoAllTokenDispatcher`: each rank
sorts its (token, choice) rows by global expert id, so the rows for ep rank r's experts are one
contiguous run; the count per expert goes first (an all-to-all of E/ep integers per pair of
ranks), then the rows with those splits. The backward of an all-to-all is the all-to-all of the
grads with the splits swapped, so dispatch's backward is combine-shaped and vice versa.

A rank receives the rows grouped by (source ep rank, local expert); its experts want them grouped
by (local expert, source), sources in ep order. Since ep ranks are consecutive dp ranks holding
consecutive rows of the global batch, this is the order of the one-rank sort restricted to the
expert: each expert sees its rows in the same order on every mesh.
gloo (torch 2.13) runs `all_to_all_single` with uneven splits, so the CPU path is the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megapipe.distributed import collectives as C


def exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Rows of `x` (in_splits[r] of them for rank r, in rank order) sent; the rows each rank sent
    here (out_splits[r] from rank r) returned in rank order. Not differentiable."""
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    C.count("all_to_all", x)
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """`exchange` whose backward is the exchange of the grads with the splits swapped."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return exchange(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return exchange(grad, in_splits, out_splits, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group):
    """Differentiable `exchange`."""
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group)


@dataclass
class Layout:
    """One dispatch's all-to-all layout, kept for its combine: rows sent to / received from each
    ep rank, and the permutation from (source, local expert) order to (local expert, source)."""

    send: list[int]
    recv: list[int]
    by_expert: torch.Tensor  # received row index of each local row, in local expert order
    inverse: torch.Tensor  # local row index of each received row


def received_counts(counts: torch.Tensor, ep_size: int, group) -> torch.Tensor:
    """(ep, E/ep): the rows each ep rank sends here for each of this rank's experts, from this
    rank's count per global expert (E,)."""
    out = torch.empty_like(counts)
    C.count("all_to_all", counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out.view(ep_size, -1)


def plan_exchange(counts: torch.Tensor, ep_size: int, group) -> tuple[Layout, torch.Tensor]:
    """The layout of sending rows sorted by expert (`counts` per global expert), and the count
    (ep, E/ep) this rank will hold from each source for each of its experts."""
    got = received_counts(counts, ep_size, group)  # (source, local expert)
    local = got.shape[1]
    # each received row's key: local expert first, then source; a stable sort keeps row order
    block = torch.arange(ep_size * local, device=counts.device).view(ep_size, local)
    key = (block % local) * ep_size + block // local
    by_expert = torch.argsort(torch.repeat_interleave(key.flatten(), got.flatten()), stable=True)
    inverse = torch.empty_like(by_expert)
    inverse[by_expert] = torch.arange(by_expert.numel(), device=by_expert.device)
    send = counts.view(ep_size, local).sum(1).tolist()
    ex = Layout(send, got.sum(1).tolist(), by_expert, inverse)
    return ex, got


def scatter_rows(sorted_rows: torch.Tensor, ex: Layout, group) -> torch.Tensor:
    """Rows sorted by global expert to the ranks holding their experts, grouped by local expert."""
    return all_to_all(sorted_rows, ex.recv, ex.send, group)[ex.by_expert]


def gather_rows(out: torch.Tensor, ex: Layout, group) -> torch.Tensor:
    """The inverse of `scatter_rows`: expert outputs back to their ranks, sorted by expert id."""
    return all_to_all(out[ex.inverse], ex.send, ex.recv, group)
