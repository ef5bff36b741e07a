"""Cross entropy over logits split along the vocabulary, never gathered (Megatron §3), and the
fused, chunked LM head + cross entropy the model trains with.

Shoeybi et al. 2019, §3: each tp rank holds the logits of its vocab slice; the loss needs only
three all-reduces of per-token scalars (max, sum of exp, target logit) instead of gathering the
(B·T, V) logits. Padding columns (a vocab that tp does not divide) are masked to -inf.

`linear_cross_entropy` goes one step further: the head's matmul and the loss in one autograd
Function that never holds the logits of the whole microbatch. Forward walks the tokens in
chunks of CHUNK_ROWS tokens, keeping per token only the log-sum-exp and the target's logit;
over a vocabulary split by tp, each chunk's row maxima are all-reduced (so every rank, and one
process, subtract the same maximum) and the sums of exp and the target logits once at the end.
It saves the head input, the targets and per token the row max and sum of exp, O(tokens·d),
instead of the float32 log-probabilities, O(tokens·V). Backward recomputes each chunk's logits
and turns them into softmax (exp(logit − max) / sum: the same max on every tp rank and in one
process, so only the sum's split rounds differently) − one-hot, then into the chunk's input
grad and its share of the weight grad (accumulated in float32): one more head matmul per step
for a transient of O(chunk·V). The weight grad is done in backward, never deferred to a Zero
Bubble W (it would need the logits a third time).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megapipe.distributed import collectives as C
from megapipe.parallel.tensor.sharding import TPInfo


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Summed cross entropy fwd (3 all-reduces of B·T scalars) / softmax − one-hot bwd (local)."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, vocab_size, tp):
        ctx.dtype = logits.dtype
        logits = logits.float()  # (N, V/tp)
        n_local = logits.shape[-1]
        valid = min(max(vocab_size - vocab_start, 0), n_local)
        if valid < n_local:  # padding rows of the embedding: never a prediction
            logits = logits.clone()
            logits[:, valid:] = float("-inf")
        top = C.all_reduce(logits.max(dim=-1).values, tp.group, op=dist.ReduceOp.MAX)
        shifted = logits - top[:, None]
        exp = shifted.exp()
        sum_exp = C.all_reduce(exp.sum(dim=-1), tp.group)
        local = targets - vocab_start
        inside = (local >= 0) & (local < valid)
        local = local.clamp(0, n_local - 1)
        picked = shifted.gather(1, local[:, None]).squeeze(1)
        target_logit = C.all_reduce(torch.where(inside, picked, 0.0), tp.group)
        ctx.save_for_backward(exp.div_(sum_exp[:, None]), local, inside)
        return (sum_exp.log() - target_logit).sum()

    @staticmethod
    def backward(ctx, grad):
        softmax, local, inside = ctx.saved_tensors
        out = softmax.clone()
        rows = torch.arange(out.shape[0], device=out.device)
        out[rows, local] -= inside.to(out.dtype)
        return (out * grad).to(ctx.dtype), None, None, None, None


# Tokens per chunk: a chunk's logits are CHUNK_ROWS · V/tp floats (12.9M, 51 MB, for GPT-2's
# 50257 on one rank). The fastest of 64..1024 on this CPU (2 cores) at V = 8192 and 50257: fewer
# rows re-read the head weight more often, more leave the chunk's elementwise passes less cache.
CHUNK_ROWS = 256


def _compute_dtype(h: torch.Tensor) -> torch.dtype:
    """The dtype the head's matmul runs in: autocast's (bf16 on the GPU path), else h's."""
    device = h.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else h.dtype


def _chunk_logits(
    h: torch.Tensor, weight: torch.Tensor, valid: int, buffer: torch.Tensor | None
) -> torch.Tensor:
    """float32 logits (rows, V/tp) of one chunk, written into `buffer` (float32 matmuls: one
    allocation for all chunks); padding columns (>= valid) at -inf."""
    if h.dtype == torch.float32 and buffer is not None:
        logits = torch.mm(h, weight.t(), out=buffer[: h.shape[0]])
    else:
        logits = (h @ weight.t()).float()
    if valid < logits.shape[-1]:
        logits[:, valid:] = float("-inf")
    return logits


def _buffer(h: torch.Tensor, rows: int, n_local: int) -> torch.Tensor | None:
    """The chunks' float32 logits buffer (float32 matmuls write into it), or None."""
    if h.dtype != torch.float32:
        return None
    return torch.empty(min(rows, h.shape[0]), n_local, device=h.device)


class _LinearCrossEntropy(torch.autograd.Function):
    """Σ_tokens lse(h Wᵀ) − (h Wᵀ)[target], by chunks of tokens (module docstring)."""

    @staticmethod
    def forward(ctx, h, weight, targets, vocab_start, vocab_size, tp, rows):
        dtype = _compute_dtype(h)
        n, n_local = h.shape[0], weight.shape[0]
        valid = min(max(vocab_size - vocab_start, 0), n_local)
        with torch.autocast(h.device.type, enabled=False):
            hc, wc = h.to(dtype), weight.to(dtype)
            local, inside = targets, None
            if tp.size > 1:
                local = targets - vocab_start
                inside = (local >= 0) & (local < valid)
                local = local.clamp(0, n_local - 1)
            top = torch.full((n,), float("-inf"), device=h.device)  # row max over the vocab
            sum_exp = torch.zeros(n, device=h.device)  # Σ exp(logit − top) over this slice
            picked = torch.zeros(n, device=h.device)  # the target's logit
            buffer = _buffer(hc, rows, n_local)
            for lo in range(0, n, rows):
                hi = min(lo + rows, n)
                if not valid:  # a tp slice of padding only: adds nothing, joins the max
                    C.all_reduce(top[lo:hi], tp.group, op=dist.ReduceOp.MAX)
                    continue
                logits = _chunk_logits(hc[lo:hi], wc, valid, buffer)
                picked[lo:hi] = logits.gather(1, local[lo:hi, None]).squeeze(1)
                torch.amax(logits, dim=-1, out=top[lo:hi])
                if tp.size > 1:  # the max over the whole vocabulary, as one process takes it
                    C.all_reduce(top[lo:hi], tp.group, op=dist.ReduceOp.MAX)
                sum_exp[lo:hi] = logits.sub_(top[lo:hi, None]).exp_().sum(dim=-1)
                del logits
            del buffer
            if tp.size > 1:
                C.all_reduce(sum_exp, tp.group)
                picked = C.all_reduce(torch.where(inside, picked, 0.0), tp.group)
            lse = sum_exp.log().add_(top)
        ctx.save_for_backward(
            hc, weight, local, top, sum_exp, *(() if inside is None else (inside,))
        )
        ctx.dtype, ctx.in_dtype, ctx.valid, ctx.rows = dtype, h.dtype, valid, rows
        return (lse - picked).sum()

    @staticmethod
    def backward(ctx, grad):
        hc, weight, local, top, sum_exp, *mask = ctx.saved_tensors
        inside = mask[0].to(torch.float32) if mask else None
        n, rows = hc.shape[0], ctx.rows
        wc = weight.to(ctx.dtype)
        grad_h = torch.zeros_like(hc)
        grad_w = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)
        buffer = _buffer(hc, rows, weight.shape[0])
        if not ctx.valid:  # a tp slice of padding only
            grad_w.zero_()
        for lo in range(0, n if ctx.valid else 0, rows):
            hi = min(lo + rows, n)
            h_c = hc[lo:hi]
            probs = _chunk_logits(h_c, wc, ctx.valid, buffer)
            probs.sub_(top[lo:hi, None]).exp_().div_(sum_exp[lo:hi, None])  # softmax
            at = torch.arange(hi - lo, device=probs.device)
            probs[at, local[lo:hi]] -= 1.0 if inside is None else inside[lo:hi]  # − one-hot
            g = probs.to(ctx.dtype)  # (rows, V/tp); the loss's grad is applied at the end
            torch.mm(g, wc, out=grad_h[lo:hi])
            if ctx.dtype != torch.float32:  # bf16 matmul, float32 sum over the chunks
                part = g.t() @ h_c
                grad_w.copy_(part) if lo == 0 else grad_w.add_(part)
            elif lo == 0:  # the first chunk writes the weight grad: no zero fill of V·d
                torch.mm(g.t(), h_c, out=grad_w)
            else:
                grad_w.addmm_(g.t(), h_c)
            del probs, g
        grad_h, grad_w = grad_h.mul_(grad).to(ctx.in_dtype), grad_w.mul_(grad).to(weight.dtype)
        return grad_h, grad_w, None, None, None, None, None


def linear_cross_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    vocab_start: int,
    vocab_size: int,
    tp: TPInfo,
    rows: int | None = None,
) -> torch.Tensor:
    """Σ over tokens of −log softmax(h Wᵀ)[target] without the whole (tokens, V/tp) logits: h
    (B, T, d) the head input on this rank (after f, or SP's all-gather), W (V/tp, d) this rank's
    vocabulary slice starting at `vocab_start` (rows past `vocab_size` are padding), targets
    (B, T); `rows` tokens per chunk (default CHUNK_ROWS)."""
    rows = rows or CHUNK_ROWS
    flat, flat_targets = h.flatten(0, 1), targets.flatten()
    return _LinearCrossEntropy.apply(flat, weight, flat_targets, vocab_start, vocab_size, tp, rows)


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, vocab_size: int, tp: TPInfo
) -> torch.Tensor:
    """Sum over tokens of −log softmax(logits)[target]; logits (B, T, V/tp), targets (B, T)."""
    flat, flat_targets = logits.flatten(0, 1), targets.flatten()
    if tp.size == 1:
        return F.cross_entropy(flat.float(), flat_targets, reduction="sum")
    return _VocabParallelCrossEntropy.apply(flat, flat_targets, vocab_start, vocab_size, tp)
