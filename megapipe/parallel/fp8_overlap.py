"""FP8 sequence-parallel linears with their collective overlapped by the tp ring (`train.fp8`
with `parallel.tp_overlap`): tensor/overlap.py's chunked decomposition (Wang et al., ASPLOS
2023) around parallel/fp8.py's FP8 matmuls, casting every element as one process does.

- A cast needs the scales of the whole tensor it belongs to, so a tensorwise scale's amax is
  shared over tp (besides cp) before the ring starts (one scalar all-reduce; the gathered
  tensor's amax is the MAX of its pieces'), and the row-local scales (rowwise: a token's row;
  blockwise: a token's 1 x 128 tiles) come from each piece's own rows. The matmuls then see
  the FP8 operands the non-overlapped path (SP's gather, then _Fp8Linear) makes, and its
  float32 products.
- Under tensorwise scales the ring moves FP8 payloads (bit-cast to uint8: gloo sends no
  float8), cast once before the ring, half the bytes of bf16 pieces, as Transformer Engine's
  FP8 userbuffers gather (`payloads`): the column linear's input, whose xᵀ cast for grad_W is
  its transpose (one scale either way), and the row linear's output grad, whose gᵀ cast
  likewise. Rowwise and blockwise pieces move in high precision and are cast
  where they land: grad_W's casts of them run their scales along the other dimension and
  need the high-precision source.
- Where the ring scatters products (the column linear's grad_x, the row linear's output), the
  whole local operand is cast once, as the non-overlapped path casts it, and each ring step
  multiplies its sequence chunk's rows of the cast (with the matching rows of row-local
  scales): the same products, summed over tp in the ring's order.
- grad_W is the non-overlapped path's: the column linear keeps only its own piece of what
  its ring sends (under tensorwise the payloads, else the high-precision shard) and gathers
  the pieces again in backward, a plain all-gather before its backward ring as the
  high-precision ring does (Korthikanti et al. 2022 §4.2.2; parallel/tensor/sharded_input.py):
  the tensor its forward ring delivered, bit for bit, at 1/tp of the memory. The row linear
  takes the output grad its backward ring gathers. Each is cast for the contraction over
  tokens in backward (under tensorwise the payloads read transposed), or queued so for a Zero
  Bubble W (parallel/fp8.weight_grad_or_queue).
"""

from __future__ import annotations

import torch
from torch import nn

from megapipe.parallel.autograd.weight_grad import kept_input
from megapipe.parallel.fp8 import fp8_operands, weight_cast, weight_grad_or_queue
from megapipe.parallel.fp8_scaling import E4M3, E5M2
from megapipe.parallel.tensor.mappings import SEQ_DIM
from megapipe.parallel.tensor.overlap import ring_gather, ring_reduce_scatter


def chunk_rows(operand: tuple, batch: int, parts: int, c: int) -> tuple:
    """Sequence chunk `c` of `parts` of a cast (B·T, k) operand whose rows are (batch, token):
    its rows, and its scales' rows where they are per row (rowwise, tiles); a tensorwise
    scale as it is."""
    q, scale = operand

    def rows(t):
        return t.reshape(batch, -1, t.shape[-1]).chunk(parts, SEQ_DIM)[c].reshape(-1, t.shape[-1])

    return rows(q), (rows(scale) if scale.dim() == 2 else scale)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class _Fp8GatherLinear(torch.autograd.Function):
    """SP's all-gather then y = x Wᵀ + b in FP8, piece by piece on the ring; backward: grad_x's
    reduce-scatter chunk by chunk over the cast output grad, grad_W from the kept piece
    gathered again."""

    @staticmethod
    def forward(ctx, x, weight, bias, owner):
        fp8, tp = owner.fp8, owner.tp
        x, weight, bias = fp8_operands(ctx, x, weight, bias, owner, fp8)
        cast = fp8.piece_caster(_flat(x), E4M3, fp8.ins, tp.group)
        qw = weight_cast(ctx, weight, "forward")
        sent, inv = payloads(fp8, cast, x)

        def product(piece):  # (B, T/tp, in) -> (B, T/tp, out/tp)
            flat = (_flat(piece).view(E4M3), inv) if inv is not None else cast(_flat(piece))
            y = fp8.matmul(flat, qw)
            y = y if bias is None else y + bias.float()
            return y.to(x.dtype).reshape(*piece.shape[:-1], y.shape[-1])

        with torch.autocast(x.device.type, enabled=False):
            _, outs = ring_gather(sent, tp, product)
        ctx.inv = inv  # the payloads' scale (a scalar), or None: high-precision pieces
        ctx.input_shard = owner.input_shard  # the rank's own piece, gathered again for W
        ctx.save_for_backward(sent, ctx.param)  # (B, T/tp, in)
        return torch.cat(outs, SEQ_DIM)

    @staticmethod
    def backward(ctx, grad_out):
        sent, weight = ctx.saved_tensors
        x = kept_input(ctx, sent)()  # (B, T, in): the pieces the forward's ring delivered
        fp8, owner = ctx.fp8, ctx.owner
        g2, batch, tp = _flat(grad_out), grad_out.shape[0], owner.tp
        qg, qw_t = fp8.quantized_grad(g2), weight_cast(ctx, weight, "dgrad")

        def part(c):  # chunk c's partial of grad_x: (B, T/tp, in)
            rows = fp8.matmul(chunk_rows(qg, batch, tp.size, c), qw_t)
            return rows.to(ctx.in_dtype).reshape(batch, -1, x.shape[-1])

        grad_x = ring_reduce_scatter(tp, part)
        grad_b = g2.sum(0).to(ctx.w_dtype) if ctx.has_bias else None
        qx = None if ctx.inv is None else (_flat(x).view(E4M3), ctx.inv)
        grad_w = weight_grad_or_queue(owner, fp8.weight_grad_operands(_flat(x), g2, qx))
        return grad_x, grad_w, grad_b, None


class _Fp8LinearScatter(torch.autograd.Function):
    """y = x Wᵀ in FP8 then SP's reduce-scatter, chunk by chunk over the cast input; backward:
    grad_y's all-gather piece by piece with grad_x's rows, grad_W from the gathered grad_y."""

    @staticmethod
    def forward(ctx, x, weight, owner):
        fp8, tp = owner.fp8, owner.tp
        x, weight, _ = fp8_operands(ctx, x, weight, None, owner, fp8)
        batch, qx = x.shape[0], fp8.quantized_input(_flat(x))
        qw = weight_cast(ctx, weight, "forward")

        def part(c):  # chunk c's partial of y: (B, T/tp, out)
            rows = fp8.matmul(chunk_rows(qx, batch, tp.size, c), qw)
            return rows.to(x.dtype).reshape(batch, -1, rows.shape[-1])

        with torch.autocast(x.device.type, enabled=False):
            y = ring_reduce_scatter(tp, part)
        ctx.save_for_backward(x, ctx.param)  # the parameter: fp8.weight_cast
        return y

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        fp8, owner = ctx.fp8, ctx.owner
        cast = fp8.piece_caster(_flat(grad_out), E5M2, fp8.outs, owner.tp.group)
        qw_t = weight_cast(ctx, weight, "dgrad")
        sent, inv = payloads(fp8, cast, grad_out)

        def rows(piece):  # (B, T/tp, out) -> grad_x's rows (B, T/tp, in/tp)
            flat = (_flat(piece).view(E5M2), inv) if inv is not None else cast(_flat(piece))
            out = fp8.matmul(flat, qw_t).to(ctx.in_dtype)
            return out.reshape(*piece.shape[:-1], out.shape[-1])

        pieces, grad_x = ring_gather(sent, owner.tp, rows)
        g2 = _flat(torch.cat(pieces, SEQ_DIM))
        qg = None if inv is None else (g2.view(E5M2), inv)
        grad_w = weight_grad_or_queue(owner, fp8.weight_grad_operands(_flat(x), g2, qg=qg))
        return torch.cat(grad_x, SEQ_DIM), grad_w, None


def payloads(fp8, cast, local: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What the ring sends of `local`: under tensorwise scales its cast, once, as uint8
    payloads (gloo sends no float8), and the one scale they share; else `local` itself, cast
    piece by piece where it lands (module docstring), and None."""
    if fp8.granularity[0] != "tensorwise":
        return local, None
    q, inv = cast(_flat(local))
    return q.view(torch.uint8).reshape(local.shape), inv


def fp8_gather_linear(x, weight, bias, owner: nn.Module) -> torch.Tensor:
    """Column linear in FP8 under SP with the all-gather overlapped: (B, T/tp, in) ->
    (B, T, out/tp); `owner` holds `tp`, `fp8` (an Fp8Linear) and the weight-grad queue."""
    return _Fp8GatherLinear.apply(x, weight, bias, owner)


def fp8_linear_scatter(x, weight, owner: nn.Module) -> torch.Tensor:
    """Row linear in FP8 under SP with the reduce-scatter overlapped: (B, T, in/tp) ->
    (B, T/tp, out), no bias (the caller adds it once, after)."""
    return _Fp8LinearScatter.apply(x, weight, owner)
