"""Sequence-parallel linears whose collective overlaps their matmul by chunked decomposition.

Wang et al., ASPLOS 2023 ("Overlap communication with dependent computation via decomposition
in large deep learning models", §3-4): an all-gather feeding a matmul, or a matmul feeding a
reduce-scatter, is split into tp pieces along the sequence that travel a ring of p2p steps, and
each step's transfer runs while the matmul of a piece already at hand computes. Under
`parallel.tp_overlap: true` (`TPInfo.overlap`, sequence parallelism on) the tp linears of
layers.py use these in place of SP's separate collective (mappings.py) and `_Linear`:

- column linear, forward (SP's all-gather, then x Aᵀ + b): at step s rank r holds the sequence
  chunk of rank (r − s) mod tp; it forwards it to rank r+1 and receives the next from r−1 while
  multiplying it, so tp − 1 transfers each hide behind one chunk's matmul;
- column linear, backward (grad_x's reduce-scatter): an accumulator for chunk (r − s − 1) mod tp
  travels the ring, each rank adding grad_y[chunk] · A, its own product for step s computed
  while step s − 1's accumulator is in flight; after tp − 1 steps chunk r is complete at rank r;
- row linear, forward (x Aᵀ, then SP's reduce-scatter): the same ring reduce-scatter over the
  products x[chunk] Aᵀ; backward: the ring all-gather of grad_y, grad_x's rows per chunk.

Each output element is the dot product it was; only the order of the tp-way sums moves (float
reassociation). The ring is dist.batch_isend_irecv (NCCL and gloo alike), every step counted as
`ring_send` by distributed/collectives.COUNTER.

Weight grads (deferred to a Zero Bubble W or not, fused into the float32 main grad under bf16
weights: parallel/autograd/weight_grad.weight_grad_now_or_later): the column linear keeps only
its own sequence shard of the input, as the non-overlapped path does (sharded_input.py), and
gathers it again (a plain all-gather) before its backward ring; the row linear keeps the
gathered output grad its backward ring delivered. A deferred W takes the gathered tensors with
it, so it stays a local matmul.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megapipe.distributed import collectives as C
from megapipe.parallel.autograd.weight_grad import (
    autocast_operands,
    save_operands,
    saved_operands,
    weight_grad_now_or_later,
)
from megapipe.parallel.tensor.mappings import SEQ_DIM
from megapipe.parallel.tensor.sharding import TPInfo

TP_COMM_OVERLAP = True  # the runtime can overlap SP's collectives (perf/software.py reads it)


def _shift(send: torch.Tensor, tp: TPInfo):
    """Start sending `send` to tp rank r+1 and receiving rank r−1's like tensor: (buffer,
    works, send); the send tensor is kept until the works are waited on."""
    recv = torch.empty_like(send)
    nxt = dist.get_global_rank(tp.group, (tp.rank + 1) % tp.size)
    prv = dist.get_global_rank(tp.group, (tp.rank - 1) % tp.size)
    C.count("ring_send", send)
    ops = [
        dist.P2POp(dist.isend, send, nxt, tp.group),
        dist.P2POp(dist.irecv, recv, prv, tp.group),
    ]
    return recv, dist.batch_isend_irecv(ops), send


def _wait(pending) -> torch.Tensor:
    recv, works, _ = pending
    for work in works:
        work.wait()
    return recv


def ring_gather(local: torch.Tensor, tp: TPInfo, fn):
    """All-gather along the sequence as tp ring steps, `fn` applied to each piece while the
    next one moves: (pieces, fn's results), both in sequence order."""
    local = local.contiguous()
    pieces, outs = [None] * tp.size, [None] * tp.size
    for step in range(tp.size):
        c = (tp.rank - step) % tp.size  # whose chunk this rank holds at this step
        pending = _shift(local, tp) if step < tp.size - 1 else None
        pieces[c], outs[c] = local, fn(local)  # overlaps the transfer just started
        if pending is not None:
            local = _wait(pending)
    return pieces, outs


def ring_reduce_scatter(tp: TPInfo, part):
    """This rank's sequence chunk of Σ over tp ranks of `part(c)` (chunk c's partial), as tp
    ring steps, each step's partial computed while the previous accumulator moves."""
    pending = None
    for step in range(tp.size):
        c = (tp.rank - step - 1) % tp.size  # the chunk whose accumulator passes here now
        acc = part(c).contiguous()  # overlaps the transfer of the previous step
        if pending is not None:
            acc += _wait(pending)
        if step == tp.size - 1:
            return acc  # c == tp.rank: every rank's partial is in
        pending = _shift(acc, tp)


class _GatherLinear(torch.autograd.Function):
    """SP's all-gather then y = x Aᵀ + b, chunk by chunk on the ring; backward: grad_x's
    reduce-scatter chunk by chunk, grad_W from the kept shard gathered again (now or in W)."""

    @staticmethod
    def forward(ctx, x, weight, bias, owner):
        x, cast, bias = autocast_operands(x, weight, bias)
        with torch.autocast(x.device.type, enabled=False):
            _, outs = ring_gather(x, owner.tp, lambda p: F.linear(p, cast, bias))
        save_operands(ctx, x, weight, cast)  # (B, T/tp, in): this rank's shard, the cast one
        ctx.owner, ctx.has_bias = owner, bias is not None
        ctx.input_shard = owner.input_shard  # saved_operands gathers the shards again
        return torch.cat(outs, SEQ_DIM)  # (B, T, out/tp)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = saved_operands(ctx)  # x: (B, T, in)
        grad_out = grad_out.to(weight.dtype)  # (B, T, out/tp)
        chunks = grad_out.chunk(ctx.owner.tp.size, SEQ_DIM)
        grad_x = ring_reduce_scatter(ctx.owner.tp, lambda c: chunks[c] @ weight)
        grad_b = grad_out.reshape(-1, grad_out.shape[-1]).sum(0) if ctx.has_bias else None
        grad_w = weight_grad_now_or_later(ctx.owner, x, grad_out)
        return grad_x, grad_w, grad_b, None  # grad_x: (B, T/tp, in)


class _LinearScatter(torch.autograd.Function):
    """y = x Aᵀ then SP's reduce-scatter, chunk by chunk on the ring; backward: grad_y's
    all-gather chunk by chunk with grad_x's rows, grad_W from the kept gathered grad_y."""

    @staticmethod
    def forward(ctx, x, weight, owner):
        x, cast = autocast_operands(x, weight)
        chunks = x.chunk(owner.tp.size, SEQ_DIM)  # x: (B, T, in/tp)
        with torch.autocast(x.device.type, enabled=False):
            y = ring_reduce_scatter(owner.tp, lambda c: F.linear(chunks[c], cast))
        save_operands(ctx, x, weight, cast)
        ctx.owner = owner
        return y  # (B, T/tp, out)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = saved_operands(ctx)
        grad_out = grad_out.to(weight.dtype)  # (B, T/tp, out)
        pieces, grad_x = ring_gather(grad_out, ctx.owner.tp, lambda g: g @ weight)
        grad_w = weight_grad_now_or_later(ctx.owner, x, torch.cat(pieces, SEQ_DIM))
        return torch.cat(grad_x, SEQ_DIM), grad_w, None


def gather_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, owner: nn.Module
) -> torch.Tensor:
    """Column linear under SP with the all-gather overlapped: (B, T/tp, in) -> (B, T, out/tp);
    `owner` holds `tp` and the weight-grad queue."""
    return _GatherLinear.apply(x, weight, bias, owner)


def linear_scatter(x: torch.Tensor, weight: torch.Tensor, owner: nn.Module) -> torch.Tensor:
    """Row linear under SP with the reduce-scatter overlapped: (B, T, in/tp) -> (B, T/tp, out),
    no bias (the caller adds it once, after)."""
    return _LinearScatter.apply(x, weight, owner)
